"""Hugging Face ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen3ForCausalLM`` /
``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (``gemma3_text``) safetensors directories.

:func:`hf_config` reads ``config.json`` (via ``transformers.AutoConfig``),
``generation_config.json`` and the safetensors headers; :func:`load_hf_dir` reads the
weights (memory-mapped, F32/F16/BF16/F64 -> float32) in the canonical layout of
:mod:`dspark_jax.models.weights`. :func:`hf_target_config` also serves the presets, which
build their configs from ``transformers`` config objects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.weights import Params, canonical_params, owned_f32, stack_layers

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}
# A decoder layer's tensors: this project's stacked name -> the Hugging Face (Llama / Qwen3) name
# under ``layers.{i}.`` (also the DSpark checkpoint formats' names, drafters.formats).
HF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "mlp_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
# Gemma 2/3 name their norms around the attention and the MLP ("sandwich" norms) differently.
GEMMA_LAYER_TENSORS = {
    **HF_LAYER_TENSORS,
    "post_attn_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen3", "gemma2", "gemma3_text")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


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


def hf_target_config(
    c: Any, *, where: str, name: str, lm_head_in_weights: bool | None = None, generation_eos: Any = ()
) -> TargetConfig:
    """:class:`TargetConfig` from a ``transformers`` config object (``LlamaConfig``/``Qwen3Config``).

    ``rope_theta`` comes from ``rope_parameters``/``rope_scaling`` or the attribute,
    ``head_dim`` when present, tied embeddings from ``tie_word_embeddings`` (or from
    the weights lacking ``lm_head.weight`` when ``lm_head_in_weights`` is known); EOS
    ids are the config's joined with ``generation_eos`` (``generation_config.json``).

    Args:
      c: the config (``AutoConfig.from_pretrained`` or ``AutoConfig.for_model``).
      where: what to name in error messages (a path or a preset).
      name: :attr:`TargetConfig.name`.
    Raises:
      DSparkInputError: an unsupported architecture, RoPE scaling, biases or activation.
    """
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise DSparkInputError(
            f"{where}: model_type {c.model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    gemma = _gemma_fields(c, where) if c.model_type in GEMMA_MODEL_TYPES else {}
    rp = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    if gemma:
        rp = {}  # read per layer type by _gemma_fields
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", None):
        raise DSparkInputError(f"{where}: RoPE scaling {rope_type!r} is not supported (only plain RoPE)")
    theta = gemma.pop("rope_theta", None) or rp.get("rope_theta", getattr(c, "rope_theta", None)) or 10000.0
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise DSparkInputError(f"{where}: attention/MLP biases are not supported")
    if not gemma and getattr(c, "hidden_act", "silu") != "silu":
        raise DSparkInputError(f"{where}: activation {c.hidden_act!r} is not supported (only silu)")
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, (list, tuple)) else [c.eos_token_id]
    eos += list(generation_eos) if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    nh = c.num_attention_heads
    tie = bool(getattr(c, "tie_word_embeddings", False)) or lm_head_in_weights is False
    layer_types, window = hf_attention_windows(c, where)
    return TargetConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=nh,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or nh,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // nh,
        max_position=c.max_position_embeddings,
        rope_theta=float(theta),
        rms_eps=float(c.rms_norm_eps),
        tie_embeddings=tie,
        qk_norm=c.model_type in ("qwen3", "gemma3_text"),
        bos_id=c.bos_token_id,
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=name,
        layer_types=layer_types,
        sliding_window=window,
        **gemma,
    )


def _gemma_fields(c: Any, where: str) -> dict[str, Any]:
    """The Gemma 2 / Gemma 3 text parts of a :class:`TargetConfig` (plus ``rope_theta``: the global
    layers' base), read from a ``Gemma2Config`` / ``Gemma3TextConfig`` as transformers applies them.

    Gemma 3 ignores ``attn_logit_softcapping`` (transformers' Gemma 3 attention never passes it on),
    so only Gemma 2 soft-caps attention scores.

    Raises:
      DSparkInputError: a part not implemented exactly: RoPE scaling, bidirectional attention, an
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
    per_type = rp if all(isinstance(v, dict) for v in rp.values()) and rp else {t: rp for t in set(types)}
    thetas = {}
    for t in set(types):
        params = dict(per_type.get(t) or {})
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind != "default":
            raise DSparkInputError(f"{where}: RoPE scaling {kind!r} ({t} layers) is not supported (only plain RoPE)")
        thetas[t] = float(params.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0)
    layer_thetas = tuple(thetas[t] for t in types)
    theta = thetas.get("full_attention", layer_thetas[0])
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qpas = getattr(c, "query_pre_attn_scalar", None)
    return {
        "rope_theta": theta,
        "layer_rope_thetas": layer_thetas if len(set(layer_thetas)) > 1 else (),
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

    Mistral slides every layer when ``sliding_window`` is set. Qwen3's config object has already
    resolved ``use_sliding_window`` / ``max_window_layers`` into ``layer_types`` (layers from
    ``max_window_layers`` on slide) and cleared ``sliding_window`` unless ``use_sliding_window``.
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
    except (OSError, ValueError) as e:
        raise DSparkInputError(f"cannot read Hugging Face config in {path}: {str(e).splitlines()[0]}") from None
    gen = path / "generation_config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    return hf_target_config(
        c,
        where=str(path),
        name=path.resolve().name,
        generation_eos=gen_eos,
        lm_head_in_weights=None if index is None else "lm_head.weight" in index,
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
    """Loads a Hugging Face ``LlamaForCausalLM``/``Qwen3ForCausalLM`` safetensors directory.

    Config via ``transformers.AutoConfig`` (:func:`hf_target_config`; EOS ids joined
    with ``generation_config.json``). Weights from every ``*.safetensors`` file (F32,
    F16 and BF16 are converted to float32); ``[out, in]`` matrices are
    transposed to ``[in, out]``. HF already uses half RoPE: no permutation.

    Raises:
      DSparkInputError: no config/weights, an unsupported architecture or RoPE
        scaling, biases, or missing tensors.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    index = _safetensors_index(files) if files else None
    cfg = _hf_dir_config(path, index)  # config errors first, then missing weights
    if index is None:
        raise DSparkInputError(f"{path}: no *.safetensors weight files (PyTorch .bin checkpoints are not supported)")

    def get(name: str) -> np.ndarray:
        if name not in index:
            raise DSparkInputError(f"{path}: weight {name!r} not found in the safetensors files")
        return _read_st(index[name])

    hf = GEMMA_LAYER_TENSORS if cfg.sandwich_norms else HF_LAYER_TENSORS
    layers = stack_layers(
        cfg, lambda i, key: get(f"model.layers.{i}.{hf[key]}.weight"), lambda i, key: f"{path}: layer {i} {hf[key]}"
    )
    return cfg, canonical_params(
        cfg, layers, get("model.embed_tokens.weight"), get("model.norm.weight"), lambda: get("lm_head.weight")
    )
