"""DeepSeek's Gemma 4 DSpark drafters (DeepSpec's ``Gemma4DSparkModel``, e.g. ``dspark_gemma4_12b_block7``):
reading their ``config.json`` and tensors into this project's drafter, and writing them back.

Facts (DeepSpec ``deepspec/modeling/dspark/gemma4``; vLLM's ``gemma4_dspark.py`` reads the same
files): ``config.json`` is the target's ``gemma4_text`` config with ``num_hidden_layers`` the draft
depth, ``layer_types`` all ``full_attention`` and DeepSpec's drafter keys (``block_size``,
``target_layer_ids``, ``mask_token_id``, ``markov_*``, confidence-head flags, ``num_target_layers``).
The drafter is self-contained: its own ``embed_tokens`` (rows times ``sqrt(hidden_size)``) and
``lm_head`` (logits soft-capped by ``final_logit_softcapping``). Every draft layer is a Gemma 4
global layer: heads of ``global_head_dim`` with ``num_global_key_value_heads`` KV heads and values
equal to the key projection when ``attention_k_eq_v`` (else ``num_key_value_heads`` and a
``v_proj``), q/k RMSNorm ``x * w``, a weightless v-norm, score scale 1, RoPE of
``rope_parameters["full_attention"]`` over ``global_head_dim`` (proportional: a leading share of the
frequencies turns), sandwich norms, a GELU-tanh gated MLP and a stored ``layer_scalar`` on the layer
output. ``fc``, ``hidden_norm``, ``norm``, the Markov and confidence heads are DeepSpec's
``Qwen3DSparkModel``'s. Whatever else the config could switch on (biases, mixture of experts,
per-layer inputs, double-wide MLPs, an attention soft-cap, another RoPE) is refused by name.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from dspark_jax.config import DrafterConfig, RopeScaling
from dspark_jax.config.gemma4_drafter import GEMMA4_LAYERS
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.weights import GEMMA_LAYER_TENSORS

ARCHITECTURE = "Gemma4DSparkModel"
MODEL_TYPE = "gemma4_text"
# This project's stacked layer tensors -> DeepSpec's names under ``layers.{i}.`` (``.weight`` added).
LAYER_TENSORS = GEMMA_LAYER_TENSORS
NORM_TENSORS = ("attn_norm", "q_norm", "k_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")
# The DrafterConfig fields of a Gemma 4 drafter beyond its shape (and embed_scale: sqrt(H)).
_ARCH = GEMMA4_LAYERS
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "global_head_dim")  # fmt: skip
_ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}


def is_gemma4(c: dict[str, Any]) -> bool:
    """Whether a DeepSpec ``config.json`` is a ``Gemma4DSparkModel``'s."""
    return ARCHITECTURE in list(c.get("architectures") or [])


def layer_shape(c: dict[str, Any], where: str) -> dict[str, Any]:
    """The draft layers' shape and Gemma fields from a ``Gemma4DSparkModel`` config (module doc).

    Returns the keys of :func:`~dspark_jax.drafters.formats._layer_shape` plus ``arch``, the
    :class:`~dspark_jax.config.DrafterConfig` fields of the Gemma 4 layers.
    Raises:
      DSparkInputError: a setting the drafter does not implement exactly, named.
    """
    if c.get("model_type") != MODEL_TYPE:
        raise DSparkInputError(f"{where}: a Gemma4DSparkModel of model_type {c.get('model_type')!r} (gemma4_text only)")
    if missing := [k for k in _REQUIRED if c.get(k) is None]:
        raise DSparkInputError(f"{where}: the Gemma4DSparkModel config lacks {', '.join(missing)}")
    for key, why in (("attention_bias", "attention biases"), ("enable_moe_block", "mixture-of-experts blocks")):
        if c.get(key):
            raise DSparkInputError(f"{where}: {key} is set: {why} are not supported")
    if c.get("hidden_size_per_layer_input"):
        raise DSparkInputError(f"{where}: per-layer inputs (hidden_size_per_layer_input) are not supported")
    if c.get("attn_logit_softcapping") is not None:
        raise DSparkInputError(f"{where}: an attention soft-cap (attn_logit_softcapping) is not supported")
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise DSparkInputError(f"{where}: hidden_activation {c.get('hidden_activation')!r} is not supported")
    n = int(c["num_hidden_layers"])
    # DeepSpec's pinned transformers doubles the MLP of draft layers i >= n - num_kv_shared_layers > 0
    if c.get("use_double_wide_mlp") and 0 < n - int(c.get("num_kv_shared_layers") or 0) < n:
        raise DSparkInputError(f"{where}: double-wide MLP layers (use_double_wide_mlp) are not supported")
    if list(c.get("layer_types") or ["full_attention"] * n) != ["full_attention"] * n:
        raise DSparkInputError(f"{where}: draft layers other than full_attention (layer_types) are not supported")
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    if k_eq_v and c.get("num_global_key_value_heads") is None:
        raise DSparkInputError(f"{where}: attention_k_eq_v without num_global_key_value_heads")
    head_dim = int(c["global_head_dim"])
    kv = int(c["num_global_key_value_heads"] if k_eq_v else c["num_key_value_heads"])
    cap = c.get("final_logit_softcapping")
    if cap is not None and not float(cap) > 0:
        raise DSparkInputError(f"{where}: final_logit_softcapping {cap!r} is not positive")
    theta, scaling = _rope(c, head_dim, where)
    h = int(c["hidden_size"])
    arch = dict(
        _ARCH, k_eq_v=k_eq_v, embed_scale=float(h) ** 0.5, final_logit_softcap=None if cap is None else float(cap)
    )
    return dict(
        hidden_size=h,
        num_layers=n,
        num_heads=int(c["num_attention_heads"]),
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=int(c["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        vocab_size=int(c["vocab_size"]),
        arch=arch,
    )


def _rope(c: dict[str, Any], head_dim: int, where: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of the draft layers: ``rope_parameters["full_attention"]``."""
    rp = (c.get("rope_parameters") or {}).get("full_attention")
    if not isinstance(rp, dict) or rp.get("rope_theta") is None:
        raise DSparkInputError(f"{where}: rope_parameters has no full_attention entry with a rope_theta")
    if unknown := sorted(set(rp) - _ROPE_KEYS):
        raise DSparkInputError(f"{where}: full_attention RoPE parameters {unknown} are not supported")
    kind = rp.get("rope_type", "default")
    factor, share = float(rp.get("factor", 1.0)), float(rp.get("partial_rotary_factor", 1.0))
    if kind == "proportional":
        return float(rp["rope_theta"]), RopeScaling("proportional", factor=factor, partial_rotary_factor=share)
    if kind != "default" or factor != 1.0 or share != 1.0:
        raise DSparkInputError(f"{where}: full_attention RoPE {kind!r} is not supported (proportional, default)")
    if int(c.get("head_dim") or head_dim) != head_dim:  # DeepSpec's pinned transformers sizes it by head_dim
        raise DSparkInputError(f"{where}: default RoPE with head_dim != global_head_dim is not supported")
    return float(rp["rope_theta"]), None


def layer_params(cfg: DrafterConfig, take: Any) -> dict[str, np.ndarray]:
    """The stacked layer arrays from DeepSpec's tensors (``take(name, shape)`` reads one, checked).

    Matrices are transposed to ``[in, out]``; ``layer_scalar`` (``[1]`` per layer) stacks to ``[N]``.
    """
    d, n, hd = cfg.hidden_size, cfg.num_layers, cfg.head_dim
    qd, kd, i_ = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    shapes = {"wq": (qd, d), "wk": (kd, d), "wv": (kd, d), "wo": (d, qd), "w_gate": (i_, d), "w_up": (i_, d),
              "w_down": (d, i_), "q_norm": (hd,), "k_norm": (hd,)}  # fmt: skip
    out = {}
    for ours, theirs in LAYER_TENSORS.items():
        if ours == "wv" and cfg.k_eq_v:
            continue
        per = [take(f"layers.{k}.{theirs}.weight", shapes.get(ours, (d,))) for k in range(n)]
        out[ours] = np.stack(per if ours in NORM_TENSORS else [w.T for w in per])
    out["layer_scalar"] = np.concatenate([take(f"layers.{k}.layer_scalar", (1,)) for k in range(n)])
    return out


def own_params(cfg: DrafterConfig, take: Any) -> dict[str, np.ndarray]:
    """The drafter's own embedding ``[V, H]`` and LM head ``[H, V]``."""
    v, h = cfg.vocab_size, cfg.hidden_size
    return {"embed": take("embed_tokens.weight", (v, h)), "lm_head": take("lm_head.weight", (v, h)).T}


def copy_target_tables(drafter: Any, target: Any) -> None:
    """Sets a new drafter's own embedding ``[V, H]`` and LM head ``[H, V]`` (``cfg.own_embeddings``) to
    the target's (its tied embedding when it has no head), in the drafter's parameter dtype, as
    DeepSpec's ``initialize_embeddings_and_head`` does before training; the trainer keeps them frozen.

    Raises:
      DSparkInputError: the drafter has no own tables, or their shapes are not the target's.
    """
    if drafter.cfg.own_embeddings is False or drafter.embed is None:
        raise DSparkInputError("this drafter reads the target's embedding and LM head (it has no own copies)")
    embed, head = target.embed[...], target.lm_head_weight()
    if embed.shape != drafter.embed[...].shape or head.shape != drafter.lm_head[...].shape:
        raise DSparkInputError(
            f"the target's embedding {embed.shape} / LM head {head.shape} do not fit the drafter's "
            f"{drafter.embed[...].shape} / {drafter.lm_head[...].shape}"
        )
    # copies, never the target's buffers (the trainer donates the drafter's parameters each step)
    drafter.embed[...] = jnp.array(embed, drafter.embed[...].dtype, copy=True)
    drafter.lm_head[...] = jnp.array(head, drafter.lm_head[...].dtype, copy=True)


def tensors(drafter: Any, cast: Any) -> dict[str, np.ndarray]:
    """DeepSpec's layer tensors and own embedding / head of a Gemma 4 drafter (``cast(array)``:
    numpy in the export dtype); the inverse of :func:`layer_params` and :func:`own_params`."""
    cfg = drafter.cfg
    layers = {k: v[...] for k, v in drafter.layers.items()}
    t: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_TENSORS.items():
            if ours in layers:
                w = layers[ours][i]
                t[f"layers.{i}.{theirs}.weight"] = cast(w if ours in NORM_TENSORS else w.T)
        t[f"layers.{i}.layer_scalar"] = cast(layers["layer_scalar"][i]).reshape(1)
    t["embed_tokens.weight"] = cast(drafter.embed[...])
    t["lm_head.weight"] = cast(drafter.lm_head[...].T)
    return t


def blockers(cfg: DrafterConfig) -> list[str]:
    """Why a drafter with its own embeddings is not a ``Gemma4DSparkModel`` (empty: it is)."""
    want = dict(_ARCH, embed_scale=float(cfg.hidden_size) ** 0.5, qk_norm=True)
    return [
        f"its {k} is {getattr(cfg, k)!r}, a Gemma 4 drafter's is {v!r}" for k, v in want.items() if getattr(cfg, k) != v
    ]


def config(cfg: DrafterConfig, base: dict[str, Any] | None, drafter_keys: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``config.json`` of a Gemma 4 drafter: ``base`` (the source checkpoint's config, or None) with
    every key the drafter's math reads written from ``cfg``, plus DeepSpec's ``drafter_keys``."""
    out = dict(base or {})
    rope = dict(out.get("rope_parameters") or {})
    s = cfg.rope_scaling
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if s is not None:  # layer_shape admits proportional RoPE only
        full.update(rope_type="proportional", partial_rotary_factor=s.partial_rotary_factor)
        if s.factor != 1.0:
            full["factor"] = s.factor
    rope["full_attention"] = full
    kv = "num_global_key_value_heads" if cfg.k_eq_v else "num_key_value_heads"
    out.update(
        {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            kv: cfg.num_kv_heads,
            "global_head_dim": cfg.head_dim,
            "attention_k_eq_v": cfg.k_eq_v,
            "attention_bias": False,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": cfg.rms_eps,
            "rope_parameters": rope,
            "final_logit_softcapping": cfg.final_logit_softcap,
            "layer_types": ["full_attention"] * cfg.num_layers,
            "enable_moe_block": False,
            "hidden_size_per_layer_input": 0,
            "tie_word_embeddings": False,
            "dtype": dtype,
            **drafter_keys,
        }
    )
    other_kv = "num_key_value_heads" if cfg.k_eq_v else "num_global_key_value_heads"
    for key, value in (("head_dim", cfg.head_dim), (other_kv, cfg.num_kv_heads), ("num_kv_shared_layers", 0)):
        out.setdefault(key, value)  # keys the draft layers do not read, kept from the source when known
    return out
