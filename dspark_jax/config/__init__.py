"""Configuration dataclasses and MaxText-style ``key=value`` overrides.

Three configs describe the whole system:

* :class:`TargetConfig`  -- the frozen Llama-family target (docs/design.md#target-model).
* :class:`DrafterConfig` -- the DSpark / DFlash drafter (docs/design.md#drafter).
* :class:`RopeScaling`   -- RoPE frequency scaling, a field of both (:mod:`.rope_scaling`).
* ``TrainConfig`` lives in :mod:`dspark_jax.training.train_config`.

All configs are frozen dataclasses so they can be hashed and used as static
arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from dspark_jax.config.gemma4_drafter import GEMMA4_LAYERS, gemma4_fields
from dspark_jax.config.rope_scaling import ROPE_TYPES as ROPE_TYPES
from dspark_jax.config.rope_scaling import RopeScaling as RopeScaling
from dspark_jax.errors import DSparkInputError

# DeepSpec's mask token for Qwen3 drafters (and the size of the Qwen2/3 embedding table it lies in).
QWEN_MASK_TOKEN_ID, QWEN_VOCAB_ROWS = 151669, 151936

# The implementations of the target's cached attention (docs/design.md#attention-backends).
ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "pallas_tpu")
# Gated MLP activations: SiLU (Llama, Qwen) and GELU-tanh (Gemma: transformers' gelu_pytorch_tanh).
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# TargetConfig's Gemma fields at their "absent" values, left out by to_dict (Llama/Qwen dicts unchanged).
_GEMMA_DEFAULTS = {"norm_offset": 0.0, "embed_scale": 1.0, "mlp_activation": "silu", "sandwich_norms": False,
                   "attn_logit_softcap": None, "final_logit_softcap": None, "query_scale": None,
                   "sliding_rope_theta": None, "global_head_dim": None, "global_num_kv_heads": None,
                   "k_eq_v": False, "v_norm": False, "layer_scalar": False}  # fmt: skip
# DrafterConfig's Gemma-layer fields at their absent values, likewise left out by its to_dict.
_DRAFTER_GEMMA_DEFAULTS = {"own_embeddings": False, "embed_scale": 1.0, "final_logit_softcap": None,
                           "mlp_activation": "silu", "sandwich_norms": False, "layer_scalar": False,
                           "v_norm": False, "k_eq_v": False, "query_scale": None}  # fmt: skip
# Its mixture-of-experts fields at their dense (absent) values, likewise left out by to_dict.
_MOE_DEFAULTS = {"num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0, "norm_topk_prob": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": ()}  # fmt: skip

# The per-layer attention kinds a target may have (transformers' ``layer_types`` values).
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Architecture of a decoder-only target (Llama 2/3.x, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Gemma 2/3/4).

    Weights follow the Hugging Face convention: RoPE rotates the two *halves* of
    each head (``rotate_half``). Loaders of formats that rotate adjacent pairs
    (llama2.c, GGUF) permute the q/k projection rows at load time, so a single
    model implementation serves every format.

    Attributes:
      vocab_size: V, number of token ids.
      hidden_size: H, residual stream width.
      intermediate_size: SwiGLU hidden width.
      num_layers: decoder layers L.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA when < num_heads).
      head_dim: width of one head.
      max_position: context length in tokens the model was trained for.
      rope_theta: RoPE base frequency.
      rope_scaling: RoPE frequency scaling (:class:`RopeScaling`), or None for plain RoPE.
      rms_eps: RMSNorm epsilon.
      tie_embeddings: LM head is the transposed token embedding.
      qk_norm: Qwen3-style RMSNorm on each query/key head before RoPE.
      qkv_bias: biases on the query, key and value projections (Qwen2 / Qwen2.5).
      o_bias: a bias on the attention output projection (with ``qkv_bias``: Llama / Qwen3 configs
        with ``attention_bias: true``).
      mask_token_id: the token id whose frozen embedding row fills a new drafter's mask slots
        (:meth:`DrafterConfig.for_target`), or None for the rule there. Set by the loaders
        that know a better choice than the rule (a token the model never reads as input).
      bos_id: beginning-of-sequence id, or None.
      eos_ids: ids that end generation.
      name: human-readable identifier of the checkpoint (used to match drafters).
      attention_backend: which implementation runs the cached attention, one of
        :data:`ATTENTION_BACKENDS` (docs/design.md#attention-backends): ``auto`` (the platform's:
        xla on CPU), ``xla``, ``cudnn`` or ``pallas_tpu``. Not part of the architecture: a
        setting the loaders leave at ``auto`` and a user may override
        (``dataclasses.replace``, ``load_target(attention_backend=...)``, ``--attention-backend``).
      norm_offset: RMSNorms multiply by ``norm_offset + weight`` in float32 (Gemma 2/3: 1).
      embed_scale: input embedding multiplier, cast to the embedding's dtype (Gemma: sqrt(H)).
      mlp_activation: the gated MLP's activation, one of :data:`MLP_ACTIVATIONS`.
      sandwich_norms: Gemma's ``post_attn_norm`` / ``post_mlp_norm`` before each residual add.
      attn_logit_softcap / final_logit_softcap: ``c * tanh(x / c)`` on the attention scores
        (before the mask; Gemma 2) / on the logits, or None.
      query_scale: attention score scale (Gemma's ``query_pre_attn_scalar ** -0.5``); None: ``hd ** -0.5``.
      sliding_rope_theta: RoPE base of the sliding layers, unscaled (Gemma 3's local base; full
        layers keep ``rope_theta`` and ``rope_scaling``), or None: every layer rotates alike.
      layer_types: per-layer attention kind, one of :data:`LAYER_TYPES` for each of the
        ``num_layers`` layers (transformers' ``layer_types``), or ``()``: every layer full
        attention. A ``sliding_attention`` layer's query at position ``p`` sees the keys at
        positions ``p - sliding_window + 1 .. p`` (transformers' ``sliding_window_overlay``).
      sliding_window: the window W of the sliding layers in tokens (required when a layer
        slides, else None).
      num_experts: E, experts of a sparse (mixture-of-experts) layer's feed-forward; 0: every
        layer has the dense gated MLP.
      num_experts_per_tok: k, experts each token is routed to (``1 <= k <= E``).
      moe_intermediate_size: the gated-MLP width of one expert.
      norm_topk_prob: the router's top-k softmax probabilities are renormalised to sum to 1
        (Mixtral always; Qwen3-MoE per its config). The router is transformers' ``qwen3_moe``:
        softmax over all E logits in float32, top k, optional renormalisation.
      decoder_sparse_step / mlp_only_layers: layer ``i`` is sparse when ``i`` is not in
        ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers'
        ``qwen3_moe`` rule); the other layers keep the dense MLP of ``intermediate_size``.
      global_head_dim / global_num_kv_heads: head width / KV heads of the full-attention layers
        when they differ from the sliding ones' (Gemma 4), else None.
      k_eq_v: full-attention layers have no value projection: V is the raw key projection (Gemma 4).
      v_norm: a weightless RMSNorm of every value head. layer_scalar: each layer's output is
        multiplied by its entry of ``layers.layer_scalar [L]`` (both Gemma 4).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mask_token_id: int | None = None
    bos_id: int | None = 1
    eos_ids: tuple[int, ...] = (2,)
    name: str = "unnamed"
    attention_backend: str = "auto"
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    mlp_activation: str = "silu"
    sandwich_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_scale: float | None = None
    sliding_rope_theta: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    k_eq_v: bool = False
    v_norm: bool = False
    layer_scalar: bool = False

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_scale", "sliding_rope_theta"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ValueError(f"{name}={value!r} must be positive or None")
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        self._check_windows()
        self._check_experts()
        for kvh in (self.num_kv_heads, self.global_num_kv_heads or self.num_kv_heads):
            if self.num_heads % kvh:
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of {kvh} KV heads")
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if isinstance(self.rope_scaling, dict):  # from_dict / JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        rs = self.rope_scaling
        if rs is not None and rs.freq_factors and len(rs.freq_factors) != self.head_dim // 2:
            raise ValueError(f"{len(rs.freq_factors)} RoPE freq_factors for head_dim {self.head_dim}")

    def _check_windows(self) -> None:
        """Raises ValueError for an inconsistent ``layer_types`` / ``sliding_window``."""
        if bad := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types value(s) {bad} are not implemented (known: {LAYER_TYPES})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.has_sliding_layers:
            if self.sliding_window is None or int(self.sliding_window) < 1:
                raise ValueError(f"sliding-window layers need sliding_window >= 1, got {self.sliding_window!r}")
            object.__setattr__(self, "sliding_window", int(self.sliding_window))
            if self.attention_backend == "pallas_tpu" and self.uniform_window is None:
                raise ValueError(
                    "attention backend 'pallas_tpu' does not implement sliding-window layers mixed with "
                    "full-attention layers (use 'auto', 'xla' or 'cudnn' for this model)"
                )

    def _check_experts(self) -> None:
        """Raises ValueError for inconsistent mixture-of-experts fields."""
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError("mixture-of-experts layers need moe_intermediate_size >= 1 and decoder_sparse_step >= 1")

    def sparse_layers(self) -> tuple[bool, ...]:
        """Whether each of the ``num_layers`` layers has the mixture-of-experts feed-forward."""
        if not self.num_experts:
            return (False,) * self.num_layers
        only = set(self.mlp_only_layers)
        return tuple(i not in only and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers))

    @property
    def num_sparse_layers(self) -> int:
        """How many layers route tokens to experts."""
        return sum(self.sparse_layers())

    @property
    def mixed_mlp(self) -> bool:
        """Whether dense and mixture-of-experts layers are mixed (their weights then live in two
        stacks the layer scan indexes, rather than in the scanned per-layer weights)."""
        return 0 < self.num_sparse_layers < self.num_layers

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return "sliding_attention" in self.layer_types

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides by it (Mistral), else None."""
        if self.layer_types and all(t == "sliding_attention" for t in self.layer_types):
            return self.sliding_window
        return None

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window in tokens (None: full attention), ``num_layers`` entries."""
        if not self.layer_types:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    def default_mask_token_id(self) -> int:
        """The id whose frozen embedding row fills a new drafter's mask slots.

        ``mask_token_id`` when set; else, for a Qwen2/Qwen3 vocabulary table (151,936 rows),
        151669, DeepSpec's choice (the first padding row past the tokenizer's 151,669 tokens, so
        never an anchor); else the last id ``V - 1``. The mask slots work with any row (they are
        told apart from the anchor by position); a row the target never reads keeps the anchor
        and the masks distinct.
        """
        if self.mask_token_id is not None:
            return self.mask_token_id
        return QWEN_MASK_TOKEN_ID if self.vocab_size == QWEN_VOCAB_ROWS else self.vocab_size - 1

    def default_taps(self, n: int = 5) -> tuple[int, ...]:
        """Layers whose outputs feed the drafter: ``n`` layers spread over the depth.

        Follows DFlash's choice (first tap at layer 1, last a few layers before the
        top); for Qwen3-4B (36 layers) this gives ``(1, 9, 17, 25, 33)``.
        """
        last = max(1, self.num_layers - 3)
        n = max(1, min(n, last))
        if n == 1:
            return (1 if self.num_layers > 1 else 0,)
        return tuple(int(round(1 + i * (last - 1) / (n - 1))) for i in range(n))

    @property
    def grouped_attention(self) -> bool:
        """Whether the layers run as Gemma 4's (:mod:`dspark_jax.models.gemma4`): sliding and
        full-attention layers with their own attention weights (and shapes), KV caches and RoPE."""
        g = (self.global_head_dim, self.global_num_kv_heads)
        proportional = self.rope_scaling is not None and self.rope_scaling.rope_type == "proportional"
        return self.k_eq_v or self.v_norm or self.layer_scalar or proportional or g != (None, None)

    @property
    def is_gemma4(self) -> bool:
        """Whether this is a Gemma 4 text target (v-norm and layer scalars are Gemma 4's alone)."""
        return self.v_norm and self.layer_scalar

    @property
    def per_layer_rope(self) -> bool:
        """Whether the sliding layers rotate differently from the full ones (a per-layer scan input)."""
        return self.sliding_rope_theta is not None and self.has_sliding_layers

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_ids"] = list(self.eos_ids)
        for key, absent in _GEMMA_DEFAULTS.items():
            if d[key] == absent:
                del d[key]
        for key, absent in _MOE_DEFAULTS.items():
            if d[key] == absent:
                del d[key]
        if not self.o_bias:  # as before the field existed
            del d["o_bias"]
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["layer_types"] = list(self.layer_types)
        if not self.layer_types and self.sliding_window is None:  # full attention: as before windows existed
            del d["layer_types"], d["sliding_window"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        if "eos_ids" in d:
            d["eos_ids"] = tuple(d["eos_ids"])
        if "layer_types" in d:
            d["layer_types"] = tuple(d["layer_types"] or ())
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = tuple(d["mlp_only_layers"] or ())
        return cls(**d)


# Keys renamed since the first release: still read from recipes, config files, overrides and
# old exports, with a note, so that nothing a user wrote stops working.
RENAMED_KEYS = {"gamma": "block_size"}


def renamed_key(key: str, where: str) -> str:
    """``key``'s current name (:data:`RENAMED_KEYS`), logging a one-line note when it was renamed."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    logging.getLogger("dspark_jax.config").warning("note: %s %r is now called %r", where, key, new)
    return new


VARIANTS = ("dspark", "dflash", "eagle3")
CONFIDENCE_INPUTS = ("head", "raw")
MARKOV_W1_ROWS = ("draft", "target")
# The drafter architecture DeepSpec's and speculators' formats express (DrafterConfig.for_target's
# default; mask_token_id comes from the target) and the first one of this project (the field
# defaults, which every export written before these fields existed holds).
INTEROP_ARCH: dict[str, Any] = {"qk_norm": True, "confidence_input": "raw", "markov_w1_rows": "target"}
LEGACY_ARCH: dict[str, Any] = {
    "qk_norm": False,
    "mask_token_id": -1,
    "confidence_input": "head",
    "markov_w1_rows": "draft",
}
GEMMA4_ARCH: dict[str, Any] = {**INTEROP_ARCH, **GEMMA4_LAYERS}  # DeepSeek's Gemma 4 drafters (.gemma4_drafter)
# "auto": gemma4 for a Gemma 4 target's DSpark drafter, else interop (DrafterConfig.for_target).
DRAFTER_ARCHS = ("auto", "interop", "legacy", "gemma4")
MARKOV_HEADS = ("vanilla", "gated", "rnn", "gated_v0", "rnn_v0")
# Exports of format 1 wrote "gated"/"rnn" for the first head variants; they load under these names.
LEGACY_MARKOV_HEADS = {"gated": "gated_v0", "rnn": "rnn_v0"}


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Architecture of a drafter (docs/design.md#drafter and docs/design.md#baselines).

    The drafter shares the target's token embedding and LM head (frozen); its width is the
    target's hidden size unless ``width`` says otherwise. DFlash is the same model with
    ``variant="dflash"``: no Markov head, no confidence head, and a block of
    anchor + block_size mask slots whose mask slots predict their own position.
    ``variant="eagle3"`` is the autoregressive baseline of :mod:`dspark_jax.drafters.eagle`
    (one decoder layer over fused low/mid/high target features, one token per step;
    ``num_layers`` must be 1, no Markov or confidence head).

    Attributes:
      variant: ``"dspark"`` (anchor + block_size-1 masks, prediction at every slot,
        Markov + confidence heads), ``"dflash"`` or ``"eagle3"``.
      block_size: the block size (the paper's gamma; DeepSpec, speculators and tpu-inference
        call it block_size), the number of draft tokens per drafting round.
      num_layers: backbone transformer layers N.
      num_heads / num_kv_heads / head_dim / intermediate_size: backbone shape.
      taps: target layers whose hidden states form the context features.
      markov_rank: rank r of the factorised bigram ``W1 (V x r) @ W2 (r x V)``.
      markov_head: sequential head type (paper Section 6; DeepSpec's heads), with
        ``e = W1[x_{k-1}]``: ``"vanilla"`` (bias ``e W2``); ``"gated"`` (``g = sigmoid(W_g
        [h_k; e] + b_g)``, bias ``(g * e) W2``); ``"rnn"`` (``s_0 = 0``, ``[a; c; o] =
        split3(W [s_{k-1}; e; h_k] + b)`` of width r each, ``u = sigmoid(a)``, ``s_k = u *
        s_{k-1} + (1 - u) * tanh(c)``, bias ``tanh(o) W2``). ``"gated_v0"`` / ``"rnn_v0"``:
        this project's first variants (gate from ``h_k`` alone; a GRU with ``e + s_k``),
        the names format-1 exports' ``"gated"`` / ``"rnn"`` load under. Exports written
        before this field existed load as ``"vanilla"``.
      rope_theta / rms_eps: backbone RoPE base and norm epsilon.
      rope_scaling: the backbone's RoPE frequency scaling (:class:`RopeScaling`; None: plain RoPE),
        the target's for a new drafter (as DeepSpec's drafters copy their target's RoPE settings).
      width: the backbone's residual width d (0 = the target's hidden size H). When
        ``d != H`` the anchor embedding enters through a learned ``H x d`` projection
        and the final hidden state leaves through a ``d x H`` one before the target's
        frozen LM head, so a tiny target can get a wider drafter (and a big one a
        narrower drafter). Exports written before this field existed load as 0.
      draft_vocab_size: N > 0 drafts over a draft vocabulary of N target ids (Eagle3's
        ``draft_vocab_size``, FR-Spec; docs/design.md#draft-vocabulary): the LM head is the frozen
        target head restricted to those ids, the Markov head's W2 and the sampler work on N
        columns, and q is mapped back to target ids with exact zeros elsewhere (lossless).
        The ids themselves live in the export (``DSparkDrafter.set_draft_vocab``). 0 = full V.
      vocab_size / hidden_size / target_num_layers / target_name /
        target_fingerprint: the target this drafter was built for; checked
        before decoding (a drafter for another vocab or model is refused).
        ``target_num_layers`` 0: unknown (an imported speculators or z-lab checkpoint).
      qk_norm: per-head RMSNorm (weights ``[head_dim]`` per layer) on the queries and on the
        block and context keys before RoPE, as in Qwen3 layers; DeepSpec's, speculators' and
        vLLM's DSpark/DFlash drafters all apply it.
      mask_token_id: ``>= 0``: the mask slots' input is the target's frozen embedding row of
        this id (the field's checkpoint formats record it); ``-1``: a learned mask vector
        ``mask_embed [d]`` (this project's first architecture).
      confidence_input: what the confidence head reads beside ``h_k``: ``"raw"``, the Markov
        embedding ``W1[x_{k-1}]`` (DeepSpec, speculators, vLLM), or ``"head"``, the Markov head's
        output ``e_k`` (the first architecture). The two agree for the vanilla head.
      markov_w1_rows: ``"target"``: ``W1`` has one row per target token ``[V, r]`` (the formats'
        layout); ``"draft"``: one per draft-vocabulary token plus one shared row for the rest,
        ``[N + 1, r]`` (the first architecture; ``[V, r]`` without a draft vocabulary).
      own_embeddings: the drafter holds its own embedding ``[V, H]`` and LM head (frozen copies:
        DeepSeek's ``Gemma4DSparkModel``), scaled by ``embed_scale`` (cast to the dtype; Gemma: sqrt(H))
        and soft-capped by ``final_logit_softcap`` (``c * tanh(x / c)``, None: none).
      mlp_activation: one of :data:`MLP_ACTIVATIONS`. sandwich_norms: ``post_attn_norm`` /
        ``post_mlp_norm`` before each residual add. layer_scalar: layer outputs times ``layer_scalar [N]``.
      v_norm: weightless RMSNorm on value heads. k_eq_v: no ``wv``, values are the key projection before
        ``k_norm``. query_scale: score scale (None: ``head_dim ** -0.5``; Gemma 4 drafters: 1).

    The last four fields' defaults are the first architecture's, the one every export written
    before they existed holds; :meth:`for_target` builds new drafters in the formats' architecture
    (:data:`INTEROP_ARCH`, DeepSpec's ``Qwen3DSparkModel`` / speculators' ``dspark``).
    """

    vocab_size: int
    hidden_size: int
    target_num_layers: int
    taps: tuple[int, ...]
    variant: str = "dspark"
    block_size: int = 8
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 256
    markov_rank: int = 64
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target_name: str = "unnamed"
    target_fingerprint: str = ""
    markov_head: str = "vanilla"
    width: int = 0
    draft_vocab_size: int = 0
    qk_norm: bool = False
    mask_token_id: int = -1
    confidence_input: str = "head"
    markov_w1_rows: str = "draft"
    rope_scaling: RopeScaling | None = None
    own_embeddings: bool = False
    embed_scale: float = 1.0
    final_logit_softcap: float | None = None
    mlp_activation: str = "silu"
    sandwich_norms: bool = False
    layer_scalar: bool = False
    v_norm: bool = False
    k_eq_v: bool = False
    query_scale: float | None = None

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # from_dict / JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation={self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, got {self.variant!r}")
        if self.markov_head not in MARKOV_HEADS:
            raise ValueError(
                f"markov_head must be one of {', '.join(map(repr, MARKOV_HEADS))}, got {self.markov_head!r}"
            )
        if self.variant == "eagle3" and self.num_layers != 1:
            raise ValueError(f"the eagle3 drafter has exactly one decoder layer, got num_layers={self.num_layers}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, {self.vocab_size}] (0 = the full vocabulary), "
                f"got {self.draft_vocab_size}"
            )
        if self.draft_vocab_size and self.variant == "eagle3":
            raise ValueError("a draft vocabulary is supported for dspark/dflash drafters, not eagle3")
        if self.width < 0 or (self.width and self.variant == "eagle3"):
            raise ValueError(f"width must be >= 0 (0 = the target's hidden size) and 0 for eagle3, got {self.width}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("drafter num_heads must be a multiple of num_kv_heads")
        if not -1 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be a token id in [0, {self.vocab_size}) or -1 (a learned mask vector), "
                f"got {self.mask_token_id}"
            )
        if self.confidence_input not in CONFIDENCE_INPUTS:
            raise ValueError(f"confidence_input must be one of {CONFIDENCE_INPUTS}, got {self.confidence_input!r}")
        if self.markov_w1_rows not in MARKOV_W1_ROWS:
            raise ValueError(f"markov_w1_rows must be one of {MARKOV_W1_ROWS}, got {self.markov_w1_rows!r}")
        if self.variant == "eagle3" and (self.qk_norm or self.mask_token_id >= 0):
            raise ValueError("qk_norm and mask_token_id are dspark/dflash drafter options, not eagle3's")
        if not self.taps:
            raise ValueError("drafter needs at least one tapped target layer")
        for t in self.taps:
            # target_num_layers 0: an imported checkpoint that does not record the target's depth
            if t < 0 or (self.target_num_layers and t >= self.target_num_layers):
                raise ValueError(f"tap layer {t} out of range for a {self.target_num_layers}-layer target")
        object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))

    @property
    def markov(self) -> bool:
        return self.variant == "dspark" and self.markov_rank > 0

    @property
    def draft_size(self) -> int:
        """Size of the vocabulary the drafter drafts over: ``draft_vocab_size`` or V."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def model_width(self) -> int:
        """The backbone's residual width d: ``width``, or the target's hidden size when 0."""
        return self.width or self.hidden_size

    @property
    def has_confidence(self) -> bool:
        return self.variant == "dspark"

    @property
    def num_block_positions(self) -> int:
        """Positions the drafter's backbone runs per block [tokens]: the anchor and ``block_size - 1``
        masks (DSpark) or ``block_size`` masks (DFlash); for eagle3, its ``block_size`` sequential
        draft steps. (Distinct from the serving engine's ``num_slots``, its decode rows.)"""
        return self.block_size + 1 if self.variant == "dflash" else self.block_size

    @property
    def markov_w1_size(self) -> int:
        """Rows of the Markov head's ``W1``: V (``markov_w1_rows="target"`` or no draft
        vocabulary), else ``N + 1`` (the shared row of tokens outside the draft vocabulary)."""
        if self.markov_w1_rows == "target" or not self.draft_vocab_size:
            return self.vocab_size
        return self.draft_vocab_size + 1

    @classmethod
    def for_target(cls, target: TargetConfig, arch: str = "interop", **overrides: Any) -> DrafterConfig:
        """Drafter sized for ``target``: width H, heads and FFN like the target's.

        Args:
          target: the target's config.
          arch: ``"interop"``, the checkpoint formats' architecture (:data:`INTEROP_ARCH`, mask
            row :meth:`TargetConfig.default_mask_token_id`), ``"legacy"``, this project's first
            (:data:`LEGACY_ARCH`), ``"gemma4"``, DeepSeek's Gemma 4 drafter (:data:`GEMMA4_ARCH`; a Gemma 4
            target only: the layers as DeepSpec's ``build_draft_config`` makes them, module
            :mod:`dspark_jax.drafters.gemma4_format`), or ``"auto"``: ``gemma4`` for a Gemma 4
            target's DSpark drafter, else ``interop``. eagle3 drafters keep the field defaults.
          overrides: any field.
        Raises:
          DSparkInputError: an unknown ``arch``; ``gemma4`` for a target that is not Gemma 4, a variant
            other than dspark, or with a width or a draft vocabulary (the format has neither).
          ValueError: an invalid field (:class:`DrafterConfig`).
        """
        if arch not in DRAFTER_ARCHS:
            raise DSparkInputError(f"drafter_arch must be one of {', '.join(DRAFTER_ARCHS)}, got {arch!r}")
        overrides = {renamed_key(k, "DrafterConfig.for_target argument"): v for k, v in overrides.items()}
        variant = overrides.get("variant", "dspark")
        if arch == "auto":
            arch = "gemma4" if target.is_gemma4 and variant == "dspark" else "interop"
        base: dict[str, Any] = dict(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            target_num_layers=target.num_layers,
            taps=target.default_taps(),
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            rms_eps=target.rms_eps,
            target_name=target.name,
        )
        if arch == "gemma4":
            base.update({**INTEROP_ARCH, **gemma4_fields(target, variant, overrides)})
        elif variant != "eagle3":
            arch_fields = LEGACY_ARCH if arch == "legacy" else INTEROP_ARCH
            base.update({"mask_token_id": target.default_mask_token_id(), **arch_fields})
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["taps"] = list(self.taps)
        return {k: v for k, v in d.items() if k not in _DRAFTER_GEMMA_DEFAULTS or v != _DRAFTER_GEMMA_DEFAULTS[k]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k if k in names else RENAMED_KEYS.get(k, k): v for k, v in d.items()}  # older exports
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown drafter config keys: {sorted(unknown)}")
        d = dict(d)
        d["taps"] = tuple(d["taps"])
        return cls(**d)
