"""Gemma 4 text targets (``gemma4_text`` / ``gemma4_unified_text``, and the text model of a ``gemma4`` /
``gemma4_unified`` config) read from Hugging Face configs and checkpoints, as transformers'
``modeling_gemma4`` / ``modeling_gemma4_unified`` compute them (the unified text decoder is Gemma 4's
without per-layer inputs and experts; a text-only input sees the causal mask under
``use_bidirectional_attention: vision``).

:func:`gemma4_fields` turns a ``Gemma4TextConfig`` into the Gemma 4 part of a
:class:`~dspark_jax.config.TargetConfig` (the decoder: :mod:`dspark_jax.models.gemma4`), refusing
by name what is not implemented: per-layer input embeddings (``hidden_size_per_layer_input``, the
E2B/E4B models), KV-shared layers, the mixture-of-experts block, bidirectional attention, a RoPE
other than ``default`` on sliding layers and ``default`` / ``proportional`` on full ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark_jax.config import RopeScaling
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.weights import GEMMA_LAYER_TENSORS, GLOBAL_ATTN_KEYS

GEMMA4_TEXT_TYPES = ("gemma4_text", "gemma4_unified_text")
# The config keys gemma4_fields reads (and refuses where unimplemented); the general rule skips them.
GEMMA4_CONFIG_KEYS = (
    "final_logit_softcapping",
    "hidden_activation",
    "attention_k_eq_v",
    "per_layer_config",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "use_bidirectional_attention",
)
# A Gemma 4 layer's tensors: Gemma's names, and the full-attention layers' ``g_*`` keys read the same
# names (``layer_scalar`` has no ``.weight``).
GEMMA4_LAYER_TENSORS = GEMMA_LAYER_TENSORS | {g: GEMMA_LAYER_TENSORS[k] for k, g in GLOBAL_ATTN_KEYS.items()}
# The non-text parts of a Gemma4ForConditionalGeneration checkpoint (a text target never runs them).
_MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def gemma4_prefixes(index: dict[str, Any], pre: str) -> tuple[str, tuple[str, ...]]:
    """The text model's tensor prefix in a Gemma 4 checkpoint (``model.`` or, multimodal,
    ``model.language_model.``) and the prefixes of the parts a text target does not read."""
    if "model.language_model.embed_tokens.weight" in index:
        return "model.language_model.", _MULTIMODAL_PREFIXES
    return pre, ()


def _refuse(c: Any, where: str) -> None:
    """Raises DSparkInputError for a Gemma 4 part not implemented exactly."""
    parts = (
        ("hidden_size_per_layer_input", "per-layer input embeddings"),
        ("num_kv_shared_layers", "KV-shared layers"),
        ("enable_moe_block", "the mixture-of-experts block"),
        ("use_bidirectional_attention", "bidirectional attention"),
    )
    for key, feature in parts:
        if (value := getattr(c, key, None)) and value != "vision":  # vision: bidirectional over image tokens only
            raise DSparkInputError(f"{where}: Gemma 4 {feature} ({key}={value!r}) is not supported")
    act = getattr(c, "hidden_activation", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise DSparkInputError(f"{where}: activation {act!r} is not supported for {c.model_type} (gelu_pytorch_tanh)")
    cap = getattr(c, "final_logit_softcapping", None)
    if cap is not None and not cap > 0:
        raise DSparkInputError(f"{where}: final_logit_softcapping={cap!r} is not supported (positive or null)")


def _layer_shapes(c: Any, where: str, kinds: list[str]) -> dict[str, tuple[int, int]]:
    """``{layer type: (head_dim, num_key_value_heads)}``, one shape per type (transformers' ``per_layer_config``)."""
    shapes: dict[str, set[tuple[int, int]]] = {}
    per_layer = getattr(c, "per_layer_config", None)
    for i, kind in enumerate(kinds):
        lc = per_layer[i] if per_layer is not None else c
        shapes.setdefault(kind, set()).add((int(lc.head_dim), int(lc.num_key_value_heads)))
    if any(len(s) > 1 for s in shapes.values()):
        raise DSparkInputError(f"{where}: layers of one layer type with different attention shapes are not supported")
    return {k: next(iter(s)) for k, s in shapes.items()}


def _rope(c: Any, where: str, kinds: list[str]) -> dict[str, Any]:
    """The RoPE fields: the full layers' ``default`` or ``proportional`` (theta; ``rope_scaling`` with
    the factor and partial rotary factor); the sliding layers' ``default`` theta (transformers' Gemma 4
    default RoPE rotates every pair whatever ``partial_rotary_factor`` says)."""
    rp = dict(getattr(c, "rope_parameters", None) or {})
    out: dict[str, Any] = {"rope_scaling": None, "sliding_rope_theta": None}
    for kind in sorted(set(kinds)):
        p = rp.get(kind)
        if not isinstance(p, dict) or "rope_theta" not in p:
            raise DSparkInputError(f"{where}: rope_parameters gives no rope_theta for {kind} layers")
        rt = p.get("rope_type", "default")
        if rt not in (("default", "proportional") if kind == "full_attention" else ("default",)):
            raise DSparkInputError(f"{where}: RoPE type {rt!r} on {kind} layers is not supported for Gemma 4")
        if kind == "sliding_attention":
            out["sliding_rope_theta"] = float(p["rope_theta"])
            continue
        out["rope_theta"] = float(p["rope_theta"])
        if rt == "proportional":
            factor, share = float(p.get("factor", 1.0)), float(p.get("partial_rotary_factor", 1.0))
            out["rope_scaling"] = RopeScaling("proportional", factor=factor, partial_rotary_factor=share)
    return out


def gemma4_fields(c: Any, where: str) -> dict[str, Any]:
    """The Gemma 4 parts of a :class:`~dspark_jax.config.TargetConfig` from a ``Gemma4TextConfig``
    (``rope_theta`` / ``rope_scaling``: the full-attention layers'; ``head_dim`` / ``num_kv_heads``:
    the sliding layers').

    Raises:
      DSparkInputError: a part not implemented exactly (see the module docstring), or layers of
        one type with different attention shapes.
    """
    _refuse(c, where)
    kinds = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    if bad := sorted(set(kinds) - {"full_attention", "sliding_attention"}):
        raise DSparkInputError(f"{where}: layer_types {bad} are not supported")
    shapes = _layer_shapes(c, where, kinds)
    local = shapes["sliding_attention"] if "sliding_attention" in shapes else shapes["full_attention"]
    ghd, gkv = shapes.get("full_attention", local)
    rope = _rope(c, where, kinds)
    if "full_attention" not in kinds:  # every layer slides: their RoPE is the only one
        rope["rope_theta"] = rope.pop("sliding_rope_theta")
    return {
        **rope,
        "head_dim": local[0],  # a config with per_layer_config forbids reading c.head_dim
        "num_kv_heads": local[1],
        "norm_offset": 0.0,
        "embed_scale": float(np.float32(c.hidden_size**0.5)),  # transformers: a float32 tensor
        "mlp_activation": "gelu_tanh",
        "sandwich_norms": True,
        "final_logit_softcap": getattr(c, "final_logit_softcapping", None),
        "query_scale": 1.0,  # transformers' Gemma 4 attention: scaling 1.0 (q and k are RMS-normed)
        "global_head_dim": ghd,
        "global_num_kv_heads": gkv,
        "k_eq_v": bool(getattr(c, "attention_k_eq_v", False)) and "full_attention" in kinds,
        "v_norm": True,
        "layer_scalar": True,
    }
