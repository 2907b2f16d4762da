"""Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (``gemma3_text``)
/ ``Gemma4ForCausalLM`` (``gemma4_text``; :mod:`~dspark_jax.models.gemma4_io`) safetensors directories.

:func:`hf_config` reads ``config.json`` (via ``transformers.AutoConfig``),
``generation_config.json`` and the safetensors headers; :func:`load_hf_dir` reads the
weights (memory-mapped, F32/F16/BF16/F64 -> float32) in the canonical layout of
:mod:`dspark_jax.models.weights`. :func:`hf_target_config` also serves the presets, which
build their configs from ``transformers`` config objects.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.gemma4_io import (
    GEMMA4_CONFIG_KEYS,
    GEMMA4_LAYER_TENSORS,
    GEMMA4_TEXT_TYPES,
    gemma4_fields,
    gemma4_prefixes,
)
from dspark_jax.models.rope import hf_rope_scaling
from dspark_jax.models.weights import (
    GEMMA_LAYER_TENSORS,
    HF_LAYER_TENSORS,
    Params,
    canonical_params,
    owned_f32,
    stack_layers,
)

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# Qwen2's q/k/v biases: this project's name -> the Hugging Face tensor under ``layers.{i}.``.
HF_BIAS_TENSORS = {"bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
                   "bo": "self_attn.o_proj.bias"}  # fmt: skip
# Model types whose attention_bias puts a bias on each of q/k/v/o_proj (transformers' Llama / Qwen3).
ATTENTION_BIAS_TYPES = ("llama", "qwen3")
# A sparse layer's router under ``layers.{i}.``, and each expert's projections under
# ``layers.{i}.mlp.experts.{e}.`` (stacked over the experts at load): this project's name -> theirs.
HF_ROUTER_TENSOR = "mlp.gate.weight"
HF_EXPERT_TENSORS = {"moe_gate": "gate_proj.weight", "moe_up": "up_proj.weight", "moe_down": "down_proj.weight"}
# Tensors a checkpoint may hold that the model does not use (transformers ignores them too).
_HF_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The image-only parts of a multimodal Gemma 3 checkpoint (a text target never runs them).
_IMAGE_ONLY_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def _safetensors_index(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """Maps tensor name -> (file, dtype, shape, begin, end) from safetensors headers."""
    index = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                b, e = info["data_offsets"]
                index[name] = (f, info["dtype"], tuple(info["shape"]), 8 + n + b, 8 + n + e)
    return index


def _read_st(entry: tuple[Path, str, tuple[int, ...], int, int]) -> np.ndarray:
    """Reads one safetensors tensor as float32 (F32/F16/BF16/F64), memory-mapped."""
    f, dtype, shape, b, e = entry
    if dtype not in _ST_DTYPES:
        raise DSparkInputError(f"{f.name}: unsupported safetensors dtype {dtype}")
    a = np.memmap(
        f, dtype=_ST_DTYPES[dtype], mode="r", offset=b, shape=((e - b) // np.dtype(_ST_DTYPES[dtype]).itemsize,)
    )
    if dtype == "BF16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return owned_f32(a).reshape(shape)


# ministral: transformers' Mistral with per-layer layer_types (sliding / full), one RoPE for all layers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
                         *GEMMA4_TEXT_TYPES)  # fmt: skip
# Config keys of Qwen3-MoE that _moe_fields reads (the general refusal rule skips them).
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts")
# Config keys of the Gemma families that _gemma_fields reads (the general refusal rule skips them).
GEMMA_CONFIG_KEYS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "hidden_activation")


# The config keys that change the model's math beyond what TargetConfig expresses, each with the
# values this package implements exactly: (key, feature, accepted(value)). A key absent from a
# config is not checked; anything else is refused by _refuse_unimplemented, naming the feature.
# (rope_parameters / rope_scaling are read, and refused where unimplemented, by models.rope.)
HF_MATH_KEYS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("attn_logit_softcapping", "attention logit soft-capping", lambda v: v is None),
    ("final_logit_softcapping", "final logit soft-capping", lambda v: v is None),
    ("query_pre_attn_scalar", "a query pre-attention scalar", lambda v: v is None),
    ("partial_rotary_factor", "partial rotary embedding", lambda v: v in (None, 1, 1.0)),
    ("mlp_bias", "MLP biases", lambda v: not v),
    ("attention_bias", "attention biases on every projection (o_proj included)", lambda v: not v),
    ("hidden_act", "an activation other than SiLU", lambda v: v in (None, "silu")),
    ("hidden_activation", "an activation other than SiLU", lambda v: v in (None, "silu")),
    ("num_experts", "mixture-of-experts layers", lambda v: not v),
    ("num_local_experts", "mixture-of-experts layers", lambda v: not v),
    ("per_layer_config", "per-layer attention shapes", lambda v: not v),
    ("attention_k_eq_v", "keys shared as values", lambda v: not v),
    ("hidden_size_per_layer_input", "per-layer input embeddings", lambda v: not v),
    ("num_kv_shared_layers", "KV-shared layers", lambda v: not v),
    ("enable_moe_block", "a mixture-of-experts block beside the MLP", lambda v: not v),
    ("use_double_wide_mlp", "double-wide MLPs", lambda v: not v),
    ("use_bidirectional_attention", "bidirectional attention", lambda v: not v),
)


def _refuse_unimplemented(cfg_dict: dict[str, Any], path: str) -> None:
    """Refuses a Hugging Face config whose math this package does not implement exactly.

    Checks every key of :data:`HF_MATH_KEYS` present in ``cfg_dict`` (``config.to_dict()``, so
    derived values such as Qwen's ``layer_types`` count), e.g. ``use_sliding_window: true``,
    ``layer_types`` with ``sliding_attention``, soft-capping, biases other than Qwen2's q/k/v.

    Raises:
      DSparkInputError: one line naming the feature, its key and value, and ``path``.
    """
    for key, feature, ok in HF_MATH_KEYS:
        if key in cfg_dict and not ok(cfg_dict[key]):
            value = cfg_dict[key]
            shown = sorted(set(value)) if isinstance(value, list) else value
            raise DSparkInputError(f"{path}: {feature} ({key}={shown!r}) is not supported")


def hf_target_config(
    c: Any, *, where: str, name: str, lm_head_in_weights: bool | None = None, generation_eos: Any = ()
) -> TargetConfig:
    """:class:`TargetConfig` from a ``transformers`` config object (``LlamaConfig``/``Qwen2Config``/``Qwen3Config``).

    ``rope_theta`` and the RoPE scaling come from ``rope_parameters`` (or legacy
    ``rope_scaling``; :func:`~dspark_jax.models.rope.hf_rope_scaling`), ``head_dim`` when present,
    tied embeddings from ``tie_word_embeddings`` (or from the weights lacking ``lm_head.weight``
    when ``lm_head_in_weights`` is known); EOS ids are the config's joined with ``generation_eos``
    (``generation_config.json``). Qwen2 has q/k/v biases (``qkv_bias``); Llama and Qwen3 with
    ``attention_bias`` have q/k/v and o_proj biases (``qkv_bias``, ``o_bias``).

    Args:
      c: the config (``AutoConfig.from_pretrained`` or ``AutoConfig.for_model``).
      where: what to name in error messages (a path or a preset).
      name: :attr:`TargetConfig.name`.
    Raises:
      DSparkInputError: an unsupported architecture or a feature not implemented exactly
        (:func:`_refuse_unimplemented`, an unimplemented RoPE scaling).
    """
    multimodal = c.model_type in ("gemma3", "gemma4", "gemma4_unified")  # ...ForConditionalGeneration: its text model
    gemma3_mm = c.model_type == "gemma3"
    if multimodal:
        c = c.text_config
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise DSparkInputError(
            f"{where}: model_type {c.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    gemma = _gemma_fields(c, where) if c.model_type in GEMMA_MODEL_TYPES else {}
    gemma4 = c.model_type in GEMMA4_TEXT_TYPES
    gemma = gemma4_fields(c, where) if gemma4 else gemma
    if gemma3_mm:  # transformers' Gemma3ForConditionalGeneration never applies final_logit_softcapping
        gemma["final_logit_softcap"] = None
    cfg_dict = c.to_dict()
    if c.model_type == "qwen2":  # Qwen2's q/k/v biases are architectural, not the attention_bias key
        cfg_dict.pop("attention_bias", None)
    attention_bias = c.model_type in ATTENTION_BIAS_TYPES and bool(cfg_dict.pop("attention_bias", False))
    for key in (GEMMA_CONFIG_KEYS + GEMMA4_CONFIG_KEYS * gemma4) if gemma else ():
        cfg_dict.pop(key, None)  # read (and refused where unimplemented) by _gemma_fields / gemma4_fields
    moe = _moe_fields(c, where) if c.model_type == "qwen3_moe" else {}
    for key in MOE_CONFIG_KEYS if moe else ():
        cfg_dict.pop(key, None)
    _refuse_unimplemented(cfg_dict, where)
    if gemma:
        theta, scaling = gemma.pop("rope_theta"), gemma.pop("rope_scaling")
    else:
        rp = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
        theta, scaling = hf_rope_scaling(rp, max_position=c.max_position_embeddings, where=where)
    theta = theta if theta is not None else getattr(c, "rope_theta", None) or 10000.0
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, (list, tuple)) else [c.eos_token_id]
    eos += list(generation_eos) if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    nh = c.num_attention_heads
    tie = bool(getattr(c, "tie_word_embeddings", False)) or lm_head_in_weights is False
    layer_types, window = hf_attention_windows(c, where)
    kvh = gemma.pop("num_kv_heads", None) or getattr(c, "num_key_value_heads", None) or nh
    hd = gemma.pop("head_dim", None) or getattr(c, "head_dim", None) or c.hidden_size // nh
    return TargetConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=nh,
        num_kv_heads=kvh,
        head_dim=hd,
        max_position=c.max_position_embeddings,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_eps=float(c.rms_norm_eps),
        tie_embeddings=tie,
        qk_norm=c.model_type in ("qwen3", "qwen3_moe", "gemma3_text") or gemma4,
        qkv_bias=c.model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        bos_id=c.bos_token_id,
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=name,
        layer_types=layer_types,
        sliding_window=window,
        **gemma,
        **moe,
    )


def _moe_fields(c: Any, where: str) -> dict[str, Any]:
    """The mixture-of-experts part of a :class:`TargetConfig` from a ``Qwen3MoeConfig``.

    Raises:
      DSparkInputError: Qwen3-MoE's sliding window (``use_sliding_window``, which transformers
        applies to every layer of this family) or an expert count below the experts per token.
    """
    if getattr(c, "use_sliding_window", False):
        raise DSparkInputError(f"{where}: sliding-window attention (use_sliding_window) is not supported for qwen3_moe")
    fields = {
        "num_experts": int(c.num_experts),
        "num_experts_per_tok": int(c.num_experts_per_tok),
        "moe_intermediate_size": int(c.moe_intermediate_size),
        "norm_topk_prob": bool(c.norm_topk_prob),
        "decoder_sparse_step": int(c.decoder_sparse_step),
        "mlp_only_layers": tuple(int(i) for i in (c.mlp_only_layers or ())),
    }
    if fields["num_experts"] and not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise DSparkInputError(f"{where}: num_experts_per_tok={c.num_experts_per_tok} of {c.num_experts} experts")
    return fields


def _gemma_fields(c: Any, where: str) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 text parts of a :class:`TargetConfig` (with ``rope_theta`` / ``rope_scaling``:
    the full-attention layers' RoPE), read from a ``Gemma2Config`` / ``Gemma3TextConfig`` as transformers applies them.

    Gemma 3 ignores ``attn_logit_softcapping`` (transformers' Gemma 3 attention never passes it on),
    so only Gemma 2 soft-caps attention scores.

    Raises:
      DSparkInputError: a part not implemented exactly: RoPE scaling on sliding layers (or one
        :func:`~dspark_jax.models.rope.hf_rope_scaling` refuses), bidirectional attention, an
        activation other than ``gelu_pytorch_tanh``.
    """
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise DSparkInputError(f"{where}: activation {act!r} is not supported for {c.model_type} (gelu_pytorch_tanh)")
    if getattr(c, "use_bidirectional_attention", False):
        raise DSparkInputError(f"{where}: bidirectional attention (use_bidirectional_attention) is not supported")
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    if bad := sorted(set(types) - {"full_attention", "sliding_attention"}):
        raise DSparkInputError(f"{where}: layer_types {bad} are not supported")
    rp = dict(getattr(c, "rope_parameters", None) or {})
    per_type = rp if rp and all(isinstance(v, dict) for v in rp.values()) else {t: rp for t in set(types)}
    mp = c.max_position_embeddings
    rope = {t: hf_rope_scaling(per_type.get(t), max_position=mp, where=f"{where} ({t} layers)") for t in set(types)}
    theta, scaling = rope.get("full_attention", (None, None))
    local_theta, local_scaling = rope.get("sliding_attention", (None, None))
    if local_scaling is not None:
        raise DSparkInputError(f"{where}: RoPE scaling {local_scaling.rope_type!r} on sliding layers is not supported")
    theta = theta if theta is not None else getattr(c, "rope_theta", None) or 10000.0
    if local_theta is not None and "full_attention" not in types:  # every layer slides: one RoPE
        theta, local_theta = local_theta, None
    local_alike = local_theta is None or (local_theta, scaling) == (theta, None)  # one RoPE for every layer
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qpas = getattr(c, "query_pre_attn_scalar", None)
    return {
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "sliding_rope_theta": None if local_alike or local_theta is None else float(local_theta),
        "norm_offset": 1.0,
        "embed_scale": float(np.float32(c.hidden_size**0.5)),  # transformers: a float32 tensor
        "mlp_activation": "gelu_tanh",
        "sandwich_norms": True,
        "attn_logit_softcap": getattr(c, "attn_logit_softcapping", None) if c.model_type == "gemma2" else None,
        "final_logit_softcap": getattr(c, "final_logit_softcapping", None),
        "query_scale": None if qpas in (None, hd) else float(qpas) ** -0.5,
    }


def hf_attention_windows(c: Any, where: str) -> tuple[tuple[str, ...], int | None]:
    """The per-layer attention kinds and the sliding window of a ``transformers`` config, as
    :attr:`TargetConfig.layer_types` / :attr:`TargetConfig.sliding_window` (``((), None)`` when
    every layer attends fully).

    Mistral slides every layer when ``sliding_window`` is set (Ministral: as its ``layer_types``
    say). Qwen3's config object has already resolved ``use_sliding_window`` / ``max_window_layers``
    into ``layer_types`` (layers from ``max_window_layers`` on slide) and cleared ``sliding_window``
    unless ``use_sliding_window``.
    Other families take ``layer_types`` as given.

    Raises:
      DSparkInputError: a ``layer_types`` value that is not implemented, a sliding layer without
        a window, or a list of the wrong length.
    """
    n = c.num_hidden_layers
    window = getattr(c, "sliding_window", None)
    if c.model_type == "mistral":
        types = ["sliding_attention"] * n if window is not None else []
    else:
        types = list(getattr(c, "layer_types", None) or [])
    if bad := sorted(set(types) - {"full_attention", "sliding_attention"}):
        raise DSparkInputError(f"{where}: layer_types {bad} are not supported (full_attention, sliding_attention)")
    if "sliding_attention" not in types:
        return (), None
    if len(types) != n:
        raise DSparkInputError(f"{where}: layer_types lists {len(types)} layers, the model has {n}")
    if window is None or int(window) < 1:
        raise DSparkInputError(f"{where}: sliding_attention layers without a sliding_window (got {window!r})")
    return tuple(types), int(window)


def _hf_dir_config(path: Path, index: dict | None) -> TargetConfig:
    """Config of a Hugging Face directory: ``AutoConfig`` + ``generation_config.json`` EOS ids;
    ``index`` (safetensors headers, if any) tells whether ``lm_head.weight`` exists."""
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise DSparkInputError(f"cannot read Hugging Face config in {path}: {str(e).splitlines()[0]}") from None
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    return hf_target_config(
        c,
        where=str(path / "config.json"),
        name=path.resolve().name,
        generation_eos=gen_eos,
        lm_head_in_weights=None
        if index is None
        else bool({"lm_head.weight", "language_model.lm_head.weight"} & set(index)),
    )


def hf_config(path: str | Path) -> TargetConfig:
    """The :class:`TargetConfig` of a Hugging Face model directory without reading weights
    (``config.json``, ``generation_config.json`` and the safetensors *headers*, if present).

    Raises:
      DSparkInputError: as :func:`load_hf_dir` for the config.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    return _hf_dir_config(path, _safetensors_index(files) if files else None)


def load_hf_dir(path: str | Path) -> tuple[TargetConfig, Params]:
    """Loads a Hugging Face ``LlamaForCausalLM``/``Qwen2ForCausalLM``/``Qwen3ForCausalLM`` (also Mistral,
    Gemma 2, Gemma 3: text-only or the text model of ``Gemma3ForConditionalGeneration``) safetensors directory.

    Config via ``transformers.AutoConfig`` (:func:`hf_target_config`; EOS ids joined
    with ``generation_config.json``). Weights from every ``*.safetensors`` file (F32,
    F16 and BF16 are converted to float32); ``[out, in]`` matrices are
    transposed to ``[in, out]``. HF already uses half RoPE: no permutation.

    Raises:
      DSparkInputError: no config/weights, an unsupported architecture or feature
        (:func:`hf_target_config`), missing tensors, or a tensor the model would not read.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    index = _safetensors_index(files) if files else None
    cfg = _hf_dir_config(path, index)  # config errors first, then missing weights
    if index is None:
        raise DSparkInputError(f"{path}: no *.safetensors weight files (PyTorch .bin checkpoints are not supported)")

    read: set[str] = set()
    # A multimodal Gemma 3 checkpoint keeps its text model under language_model.; its vision tower
    # and projector only read images, which a target never receives.
    multimodal = "language_model.model.embed_tokens.weight" in index
    pre, head = (
        ("language_model.model.", "language_model.lm_head.weight") if multimodal else ("model.", "lm_head.weight")
    )
    pre, skipped = gemma4_prefixes(index, pre) if cfg.grouped_attention else (pre, ())

    def get(name: str) -> np.ndarray:
        if name not in index:
            raise DSparkInputError(f"{path}: weight {name!r} not found in the safetensors files")
        read.add(name)
        return _read_st(index[name])

    def layer_tensor(i: int, key: str) -> np.ndarray:
        if key in HF_EXPERT_TENSORS:  # [E, out, in]
            experts = range(cfg.num_experts)
            return np.stack([get(f"model.layers.{i}.mlp.experts.{e}.{HF_EXPERT_TENSORS[key]}") for e in experts])
        if key == "moe_router":
            return get(f"model.layers.{i}.{HF_ROUTER_TENSOR}")
        if key in HF_BIAS_TENSORS or key == "layer_scalar":
            return get(f"{pre}layers.{i}.{HF_BIAS_TENSORS.get(key, key)}")
        return get(f"{pre}layers.{i}.{hf[key]}.weight")

    hf = GEMMA_LAYER_TENSORS if cfg.sandwich_norms else HF_LAYER_TENSORS
    hf = GEMMA4_LAYER_TENSORS if cfg.grouped_attention else hf
    names = {**{k: f"{v}.weight" for k, v in hf.items()}, **HF_BIAS_TENSORS, "moe_router": HF_ROUTER_TENSOR}
    names["layer_scalar"] = "layer_scalar"
    names.update({k: f"mlp.experts.*.{v}" for k, v in HF_EXPERT_TENSORS.items()})
    layers = stack_layers(cfg, layer_tensor, lambda i, key: f"{path}: layer {i} {names[key]}")
    params = canonical_params(
        cfg, layers, get(f"{pre}embed_tokens.weight"), get(f"{pre}norm.weight"), lambda: get(head)
    )
    # A tensor the model would not read changes what transformers computes: refuse it by name.
    unread = sorted(n for n in index if n not in read and not n.endswith(_HF_IGNORED_SUFFIXES))
    unread = [n for n in unread if not (n == head and cfg.tie_embeddings)]  # tied: transformers ignores it
    if multimodal or skipped:
        unread = [n for n in unread if not n.startswith(_IMAGE_ONLY_PREFIXES + skipped)]
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise DSparkInputError(
            f"{path}: tensor {unread[0]!r}{more} is not read by this loader (an unsupported feature)"
        )
    return cfg, params
