"""llama.cpp GGUF checkpoints (architectures ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma2`` and
``gemma3``; ``llama`` with ``llama.expert_count`` is Mixtral).

:func:`gguf_config` reads only the metadata; :func:`load_gguf` dequantizes every tensor to
float32 in the canonical layout of :mod:`dspark_jax.models.weights`. Uses the ``gguf``
package (memory-mapped reader), imported when a file is opened.

Exact or refused: an ``{arch}.*`` metadata key outside :data:`GGUF_ARCH_KEYS` (a soft-cap, shared
experts, ...) and a tensor the loader does not read are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.rope import gguf_rope_scaling
from dspark_jax.models.weights import Params, adjacent_to_half, canonical_params, owned_f32, stack_layers

# llama: adjacent-pair RoPE rows (permuted at load); qwen2 / qwen3: HF-style half RoPE (no permutation),
# qwen2 with q/k/v biases, qwen3 with q/k norms, gemma2 / gemma3 as llama.cpp reads them (_gemma2_fields,
# _gemma3_fields).
_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3")
# The ``{arch}.`` metadata keys this loader understands (read, checked, or without effect on the math).
# Any other ``{arch}.`` key may change the math and is refused (general.*, tokenizer.*, quantize.*
# and split.* keys describe the file, not the model's math).
GGUF_ARCH_KEYS = frozenset(
    {"block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
     "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
     "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
     "attention.sliding_window", "attention.sliding_window_pattern",
     "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
     "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
     "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor",
     "rope.scaling.yarn_log_multiplier", "expert_count", "expert_used_count", "expert_feed_forward_length"}
)  # fmt: skip
# Keys one architecture understands on top of GGUF_ARCH_KEYS (elsewhere they are refused).
GGUF_ARCH_ONLY_KEYS = {"gemma2": frozenset({"attn_logit_softcapping", "final_logit_softcapping"})}
ROPE_FREQS = "rope_freqs.weight"
_GGUF_NAMES = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "mlp_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "moe_router": "ffn_gate_inp",
    "moe_gate": "ffn_gate_exps",
    "moe_up": "ffn_up_exps",
    "moe_down": "ffn_down_exps",
    "post_attn_norm": "post_attention_norm",
    "post_mlp_norm": "post_ffw_norm",
}
# qwen2: blk.{i}.attn_q.bias ...; llama (optional, as llama.cpp reads them): those and attn_output.bias
_GGUF_BIASES = {"bq": "attn_q", "bk": "attn_k", "bv": "attn_v", "bo": "attn_output"}


def _tensor_name(i: int, key: str) -> str:
    return f"blk.{i}.{_GGUF_BIASES[key]}.bias" if key in _GGUF_BIASES else f"blk.{i}.{_GGUF_NAMES[key]}.weight"


def _refuse_unknown_keys(reader: Any, arch: str, fname: Path) -> None:
    """Refuses an ``{arch}.`` metadata key outside :data:`GGUF_ARCH_KEYS` and the architecture's
    :data:`GGUF_ARCH_ONLY_KEYS` (it may change the math)."""
    prefix, known = f"{arch}.", GGUF_ARCH_KEYS | GGUF_ARCH_ONLY_KEYS.get(arch, frozenset())
    for key in reader.fields:
        if key.startswith(prefix) and key[len(prefix) :] not in known:
            raise DSparkInputError(
                f"GGUF file {fname.name}: metadata {key} is not supported (a feature this loader does not implement)"
            )


def _f32(x: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def open_gguf(path: str | Path) -> Any:
    """Opens a GGUF file with ``gguf.GGUFReader`` (memory-mapped, ~3 s for 49k-token vocabularies).

    Raises:
      DSparkInputError: unreadable or not a GGUF file.
    """
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError, IndexError) as e:
        raise DSparkInputError(
            f"cannot read GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def _as_reader(path: Any) -> Any:
    import gguf

    return path if isinstance(path, gguf.GGUFReader) else open_gguf(path)


def _gguf_name(reader: Any) -> Path:
    return Path(reader.data.filename if hasattr(reader.data, "filename") else "model.gguf")


def gguf_config(path: Any) -> TargetConfig:
    """The :class:`TargetConfig` of a GGUF file from its metadata (no tensor data is read).

    Hyperparameters come from ``{arch}.*`` metadata (see :func:`load_gguf`), the RoPE scaling
    from ``{arch}.rope.scaling.*`` and the ``rope_freqs.weight`` tensor; tied embeddings when
    there is no ``output.weight`` tensor.

    Args:
      path: a ``.gguf`` path or an open ``gguf.GGUFReader``.
    Raises:
      DSparkInputError: unreadable file, unsupported architecture, missing metadata, an
        ``{arch}.`` key outside :data:`GGUF_ARCH_KEYS`, a RoPE setting not implemented exactly,
        partial rotary dimensions.
    """
    reader = _as_reader(path)
    fname = _gguf_name(reader)

    def meta(key: str, default: Any = None, required: bool = False) -> Any:
        f = reader.fields.get(key)
        if f is None:
            if required:
                raise DSparkInputError(f"GGUF file {fname.name} lacks metadata key {key!r}")
            return default
        return f.contents()

    arch = meta("general.architecture", required=True)
    if arch not in _GGUF_ARCHS:
        raise DSparkInputError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_GGUF_ARCHS)})")
    _refuse_unknown_keys(reader, arch, fname)
    tensors = {t.name: t for t in reader.tensors}
    H = int(meta(f"{arch}.embedding_length", required=True))
    nh = int(meta(f"{arch}.attention.head_count", required=True))
    hd = int(meta(f"{arch}.attention.key_length", H // nh))
    for key in ("attention.value_length", "rope.dimension_count"):  # partial rotary, a distinct value width
        v = meta(f"{arch}.{key}")
        if v is not None and int(v) != hd:
            raise DSparkInputError(f"GGUF file {fname.name}: {arch}.{key}={v} differs from the head size {hd}")
    freqs = tensors.get(ROPE_FREQS)
    freq_factors = None if freqs is None else np.asarray(freqs.data, np.float32)
    scaling = gguf_rope_scaling(meta, arch, freq_factors, where=f"GGUF file {fname.name}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
    bos = meta("tokenizer.ggml.bos_token_id")
    eos = [meta("tokenizer.ggml.eos_token_id"), meta("tokenizer.ggml.eot_token_id")]
    n_layers = int(meta(f"{arch}.block_count", required=True))
    theta = _f32(meta(f"{arch}.rope.freq_base", 10000.0))
    if arch in ("gemma2", "gemma3"):
        gemma = _gemma3_fields(meta, n_layers, H, nh, fname.name) if arch == "gemma3" else {}
        gemma = gemma or _gemma2_fields(meta, n_layers, H, nh, fname.name, scaling, "output.weight" in tensors)
        layer_types, window = gemma.pop("layer_types"), gemma.pop("sliding_window")
        if arch == "gemma3" and layer_types and "full_attention" not in layer_types:  # all slide: local RoPE only
            theta, scaling = GEMMA3_LOCAL_ROPE_BASE, None
    else:
        gemma = {}
        layer_types, window = gguf_attention_windows(meta, arch, n_layers, fname.name)
    ffn = int(meta(f"{arch}.feed_forward_length", required=True))
    return TargetConfig(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=ffn,
        num_layers=n_layers,
        num_heads=nh,
        num_kv_heads=int(meta(f"{arch}.attention.head_count_kv", nh)),
        head_dim=hd,
        max_position=int(meta(f"{arch}.context_length", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=_f32(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        qkv_bias=arch == "qwen2" or (arch == "llama" and "blk.0.attn_q.bias" in tensors),
        o_bias=arch == "llama" and "blk.0.attn_output.bias" in tensors,
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=fname.stem,
        layer_types=layer_types,
        sliding_window=window,
        **gguf_experts(meta, arch, ffn, fname.name),
        **gemma,
    )


def gguf_experts(meta: Any, arch: str, ffn: int, fname: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a :class:`TargetConfig` from ``{arch}.expert_count`` /
    ``expert_used_count`` (and ``qwen3moe``'s ``expert_feed_forward_length``); ``{}`` for a dense file.

    Every layer is sparse, and the top-k weights are renormalised (llama.cpp's ``llama`` and
    ``qwen3moe`` graphs: Mixtral's softmax over its top-k logits, Qwen3-MoE's ``norm_topk_prob``).

    Raises:
      DSparkInputError: experts without a used count, or a used count outside ``[1, expert_count]``.
    """
    n = int(meta(f"{arch}.expert_count", 0) or 0)
    if n == 0:
        if arch == "qwen3moe":
            raise DSparkInputError(f"GGUF file {fname}: qwen3moe without {arch}.expert_count")
        return {}
    k = int(meta(f"{arch}.expert_used_count", 0) or 0)
    if not 1 <= k <= n:
        raise DSparkInputError(f"GGUF file {fname}: {arch}.expert_used_count={k} for {n} experts")
    width = int(meta(f"{arch}.expert_feed_forward_length", ffn)) if arch == "qwen3moe" else ffn
    return {"num_experts": n, "num_experts_per_tok": k, "moe_intermediate_size": width, "norm_topk_prob": True}


# llama.cpp's Gemma 3 (llama_load_hparams / the gemma3 graph): every 6th layer attends fully, the
# others slide with RoPE base 1e4 unscaled; neither is written to the file.
GEMMA3_SWA_PATTERN, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_27B_LAYERS = 6, 10000.0, 62


def _gemma3_fields(meta: Any, n_layers: int, H: int, nh: int, fname: str) -> dict[str, Any]:
    """The Gemma 3 parts of a ``gemma3`` GGUF's :class:`TargetConfig`, as llama.cpp reads the file
    that ``convert_hf_to_gguf.py`` writes: layer ``i`` slides iff ``i % 6 < 5`` (window from
    ``gemma3.attention.sliding_window``; absent or 0: every layer full), sliding layers rotate with
    base 1e4, the query scale is ``head_dim ** -0.5`` except for the 62-layer 27B model
    (``(H / heads) ** -0.5``), ``1 + w`` norms (stored with the 1 added; :func:`load_gguf` takes
    it off), embedding times sqrt(H), GELU-tanh, sandwich norms, no soft-caps.

    Raises:
      DSparkInputError: a ``sliding_window_pattern`` key (llama.cpp ignores it for Gemma 3, so the
        file's meaning would be ambiguous).
    """
    if meta("gemma3.attention.sliding_window_pattern") is not None:
        raise DSparkInputError(
            f"GGUF file {fname}: gemma3.attention.sliding_window_pattern is not supported "
            "(llama.cpp fixes Gemma 3's pattern at every 6th layer full)"
        )
    window = int(meta("gemma3.attention.sliding_window", 0) or 0)
    slides = [window > 0 and i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 for i in range(n_layers)]
    mixed = any(slides) and not all(slides)
    return {
        "layer_types": tuple("sliding_attention" if x else "full_attention" for x in slides) if any(slides) else (),
        "sliding_window": window if any(slides) else None,
        "sliding_rope_theta": GEMMA3_LOCAL_ROPE_BASE if mixed else None,
        "norm_offset": 1.0,
        "embed_scale": float(np.float32(H**0.5)),
        "mlp_activation": "gelu_tanh",
        "sandwich_norms": True,
        "query_scale": float(H // nh) ** -0.5 if n_layers == GEMMA3_27B_LAYERS else None,
    }


# llama.cpp's Gemma 2 (llama_load_hparams / the gemma2 graph): even layers slide (window 4096 unless the
# file says), soft-caps 50 / 30 unless the file says, the 46-layer 27B model's query scale (H / heads) ** -0.5.
GEMMA2_SWA_PATTERN, GEMMA2_WINDOW, GEMMA2_SOFTCAPS, GEMMA2_27B_LAYERS = 2, 4096, (50.0, 30.0), 46


def _gemma2_fields(
    meta: Any, n_layers: int, H: int, nh: int, fname: str, scaling: Any, has_output: bool
) -> dict[str, Any]:
    """The Gemma 2 parts of a ``gemma2`` GGUF's :class:`TargetConfig`, as llama.cpp reads the file that
    ``convert_hf_to_gguf.py`` writes: layer ``i`` slides iff ``i`` is even (window from
    ``gemma2.attention.sliding_window``, absent: 4096), every layer rotates with ``rope.freq_base``,
    attention / final soft-caps from ``gemma2.{attn,final}_logit_softcapping`` (absent: 50 / 30), the
    query scale ``head_dim ** -0.5`` except for the 46-layer 27B model (``(H / heads) ** -0.5``;
    llama.cpp reads no ``query_pre_attn_scalar``), ``1 + w`` norms (stored with the 1 added), embedding
    times sqrt(H), GELU-tanh, sandwich norms, no q/k norms.

    Args:
      scaling: the file's RoPE scaling; has_output: whether it has an ``output.weight`` tensor.
    Raises:
      DSparkInputError: a ``sliding_window_pattern`` key (llama.cpp fixes Gemma 2's pattern), a
        window or soft-cap that is not positive, RoPE scaling (llama.cpp would scale the sliding
        layers too), an ``output.weight`` (llama.cpp's Gemma 2 ties the LM head and ignores it).
    """
    if scaling is not None:
        raise DSparkInputError(f"GGUF file {fname}: RoPE scaling is not supported for gemma2")
    if has_output:
        raise DSparkInputError(
            f"GGUF file {fname}: gemma2 with an output.weight tensor is not supported (llama.cpp ties the head)"
        )
    if meta("gemma2.attention.sliding_window_pattern") is not None:
        raise DSparkInputError(
            f"GGUF file {fname}: gemma2.attention.sliding_window_pattern is not supported "
            "(llama.cpp fixes Gemma 2's pattern at every other layer sliding)"
        )
    window = int(meta("gemma2.attention.sliding_window", GEMMA2_WINDOW))
    caps = [_f32(meta(f"gemma2.{k}_logit_softcapping", d)) for k, d in zip(("attn", "final"), GEMMA2_SOFTCAPS)]
    if window <= 0 or min(caps) <= 0:
        raise DSparkInputError(f"GGUF file {fname}: gemma2 sliding window {window} / soft-caps {caps} not positive")
    slides = [i % GEMMA2_SWA_PATTERN < GEMMA2_SWA_PATTERN - 1 for i in range(n_layers)]
    return {
        "layer_types": tuple("sliding_attention" if x else "full_attention" for x in slides),
        "sliding_window": window,
        "norm_offset": 1.0,
        "embed_scale": float(np.float32(H**0.5)),
        "mlp_activation": "gelu_tanh",
        "sandwich_norms": True,
        "attn_logit_softcap": caps[0],
        "final_logit_softcap": caps[1],
        "query_scale": float(H // nh) ** -0.5 if n_layers == GEMMA2_27B_LAYERS else None,
    }


def gguf_attention_windows(meta: Any, arch: str, n_layers: int, fname: str) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention kinds and the sliding window from ``{arch}.attention.sliding_window``
    (0 or absent: full attention) and ``{arch}.attention.sliding_window_pattern`` (one bool per
    layer, True: sliding), as :attr:`TargetConfig.layer_types` / :attr:`TargetConfig.sliding_window`.

    A window without a pattern slides every layer for ``llama`` (Mistral's meaning). llama.cpp's
    converter writes Mistral as ``llama`` *without* the window, so such a file cannot be told
    from full attention: it loads as full attention (docs/design.md#sliding-window-attention).

    Args:
      meta: ``meta(key, default)`` metadata reader; fname: the file name for messages.
    Raises:
      DSparkInputError: a pattern of the wrong length, or a window without a pattern for an
        architecture whose sliding layers it does not determine.
    """
    window = int(meta(f"{arch}.attention.sliding_window", 0) or 0)
    if window <= 0:
        return (), None
    pattern = meta(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, int):
        raise DSparkInputError(f"GGUF file {fname}: an integer sliding_window_pattern ({pattern}) is not supported")
    if pattern is None:
        if arch != "llama":
            raise DSparkInputError(
                f"GGUF file {fname}: {arch}.attention.sliding_window without a sliding_window_pattern "
                "(which layers slide is unknown)"
            )
        pattern = [True] * n_layers
    pattern = [bool(x) for x in pattern]
    if len(pattern) != n_layers:
        raise DSparkInputError(f"GGUF file {fname}: sliding_window_pattern has {len(pattern)} entries, not {n_layers}")
    if not any(pattern):
        return (), None
    return tuple("sliding_attention" if x else "full_attention" for x in pattern), window


def load_gguf(path: Any) -> tuple[TargetConfig, Params]:
    """Loads a llama.cpp GGUF checkpoint (``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma2``, ``gemma3``).

    Hyperparameters come from ``{arch}.*`` metadata (``block_count``,
    ``embedding_length``, ``feed_forward_length``, ``attention.head_count[_kv]``,
    ``attention.key_length``, ``rope.freq_base``,
    ``attention.layer_norm_rms_epsilon``, ``context_length``), the vocabulary
    size from ``tokenizer.ggml.tokens`` (else ``token_embd``). Tensors of any
    type supported by ``gguf.quants.dequantize`` (F32/F16/Q8_0/Q4_1/...) become
    float32; a GGUF shape ``[in, out]`` is a numpy ``[out, in]`` matrix,
    transposed here to ``[in, out]``. ``llama`` q/k rows are permuted from
    adjacent-pair to half RoPE. No ``output.weight`` means tied embeddings. RoPE scaling from
    ``rope_freqs.weight`` and ``{arch}.rope.scaling.*`` (:func:`~dspark_jax.models.rope.gguf_rope_scaling`);
    ``qwen2`` q/k/v biases from ``blk.{i}.attn_{q,k,v}.bias``, ``llama`` ones (optional, permuted like
    their rows) with ``attn_output.bias``; ``gemma2`` / ``gemma3`` sandwich norms from
    ``blk.{i}.post_attention_norm`` / ``post_ffw_norm``, every norm weight stored as ``1 + w``. Experts
    (:func:`gguf_experts`) from ``blk.{i}.ffn_gate_inp`` (router ``[E, H]``) and ``blk.{i}.ffn_{gate,up,down}_exps``
    (``[E, out, in]``, each expert's matrix transposed).

    Args:
      path: a ``.gguf`` path or an open ``gguf.GGUFReader`` (reading the header
        of a large-vocabulary file takes seconds, so callers may share it).

    Raises:
      DSparkInputError: unreadable file, unsupported architecture or metadata, missing tensors,
        a tensor the model would not read.
    """
    import gguf

    reader = _as_reader(path)
    fname = _gguf_name(reader)
    cfg = gguf_config(reader)
    arch = reader.fields["general.architecture"].contents()
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    tensors = {t.name: t for t in reader.tensors}

    read = {ROPE_FREQS}  # read by gguf_config

    def get(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise DSparkInputError(f"GGUF file {fname.name} lacks tensor {name!r}")
        read.add(name)
        # A plain-ndarray view avoids numpy.memmap's per-slice overhead (3x faster).
        return owned_f32(gguf.quants.dequantize(t.data.view(np.ndarray), t.tensor_type))

    permute = {"wq": nh, "wk": nkv, "bq": nh, "bk": nkv} if arch == "llama" else {}

    # gemma2 / gemma3: the converter stores Gemma's norm weights w as 1 + w; the model applies 1 + w itself.
    shift = np.float32(cfg.norm_offset)

    def fetch(i: int, key: str) -> np.ndarray:
        m = get(_tensor_name(i, key))
        if key.endswith("norm") and shift:
            m -= shift
        if key in permute and m.ndim <= 2:  # a q/k matrix or bias: adjacent-pair -> half RoPE rows
            m = adjacent_to_half(m.reshape(m.shape[0], -1), permute[key]).reshape(m.shape)
        return m

    layers = stack_layers(cfg, fetch, lambda i, key: f"GGUF tensor {_tensor_name(i, key)}")
    params = canonical_params(
        cfg, layers, get("token_embd.weight"), get("output_norm.weight") - shift, lambda: get("output.weight")
    )
    unread = sorted(set(tensors) - read)
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise DSparkInputError(f"GGUF file {fname.name}: tensor {unread[0]!r}{more} is not read by this loader")
    return cfg, params
