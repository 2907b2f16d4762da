"""One backbone layer of the DSpark / DFlash drafter, its differences as data in the
:class:`~dspark_jax.config.DrafterConfig` (docs/design.md#drafter).

The layer is pre-norm attention with KV injection and a gated MLP. The config's layer fields
select, without a copy of the layer per family: per-head q/k RMSNorm (``qk_norm``, Qwen3 and
Gemma 4), a weightless RMSNorm on the value heads (``v_norm``), values taken from the key
projection (``k_eq_v``: no ``wv``), the score scale (``query_scale``), post-branch norms before
each residual add (``sandwich_norms``), the MLP activation, and a stored per-layer output scalar
(``layer_scalar``). With the fields at their defaults it is the Qwen3 layer of DeepSpec's
``Qwen3DSparkModel``; with DeepSeek's ``Gemma4DSparkModel`` settings (formats.py) its Gemma 4 layer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.models.layers import gated_mlp, rms_norm


def layer_params(cfg: DrafterConfig, w: Callable[..., nnx.Param], dtype) -> nnx.Dict:
    """The stacked ``[N, ...]`` layer parameters of ``cfg`` (``w(*shape)``: a random kernel ``[in, out]``).

    Kernels are drawn in a fixed order (q, k, v, gate, up), so a config without the Gemma fields
    gets the weights it always got from a seed; the residual branches' output kernels start at zero
    so an untrained block is stable.
    """
    d, n, hd = cfg.model_width, cfg.num_layers, cfg.head_dim
    qd, kd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    ones = lambda *shape: nnx.Param(jnp.ones(shape, dtype))
    p: dict[str, nnx.Param] = {}
    if cfg.qk_norm:
        p.update(q_norm=ones(n, hd), k_norm=ones(n, hd))
    p.update(attn_norm=ones(n, d), wq=w(n, d, qd), wk=w(n, d, kd))
    if not cfg.k_eq_v:
        p["wv"] = w(n, d, kd)
    p.update(wo=nnx.Param(jnp.zeros((n, qd, d), dtype)), mlp_norm=ones(n, d))
    p.update(w_gate=w(n, d, cfg.intermediate_size), w_up=w(n, d, cfg.intermediate_size))
    p["w_down"] = nnx.Param(jnp.zeros((n, cfg.intermediate_size, d), dtype))
    if cfg.sandwich_norms:
        p.update(post_attn_norm=ones(n, d), post_mlp_norm=ones(n, d))
    if cfg.layer_scalar:
        p["layer_scalar"] = ones(n)
    return nnx.Dict(**p)


def _unit_norm(v: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight over the last axis (Gemma 4's ``v_norm``)."""
    return rms_norm(v, jnp.ones((v.shape[-1],), jnp.float32), eps)


def context_kv(
    cfg: DrafterConfig, params: dict, ctx: jax.Array, rope: Callable, layers: list | None = None
) -> tuple[jax.Array, jax.Array]:
    """Every layer's injected keys/values of context vectors ``ctx [B, T, d]``.

    ``params``: the stacked layer arrays; ``layers``: optional per-layer copies of the same weights
    (decoding on the CPU reads them in place: XLA's stacked product transposes each layer's slice on
    every call); ``rope``: ``[B, T, kvh, hd] -> rotated``.
    Returns ``(k, v)``, each ``[N, B, T, kvh, hd]``; keys carry ``k_norm`` (before RoPE) and RoPE.
    """
    b, t, _ = ctx.shape
    if layers is not None:
        k = jnp.stack([ctx @ p["wk"] for p in layers])
        v = k if cfg.k_eq_v else jnp.stack([ctx @ p["wv"] for p in layers])
    else:
        k = jnp.einsum("btd,nde->nbte", ctx, params["wk"])
        v = k if cfg.k_eq_v else jnp.einsum("btd,nde->nbte", ctx, params["wv"])
    k = k.reshape(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # the context keys get k_norm too (before RoPE), like the block's
        k = rms_norm(k, params["k_norm"][:, None, None, None, :], cfg.rms_eps)
    if cfg.v_norm:
        v = _unit_norm(v, cfg.rms_eps)
    return jax.vmap(rope)(k), v


def layer(cfg: DrafterConfig, p: dict, h: jax.Array, rope: Callable, attend: Callable) -> jax.Array:
    """One layer over draft slots.

    Args:
      p: this layer's parameters (one slice of :func:`layer_params`).
      h: ``[B, A, S, d]`` residual stream.
      rope: ``[B, A, S, heads, hd] -> rotated``.
      attend: ``(q, k, v, scale) -> [B, A, S, heads * hd]``, attention over the injected context and
        the slots' own keys/values ``[B, A, S, kvh, hd]`` (``scale``: the static score scale).
    Returns:
      ``[B, A, S, d]``, the layer's output.
    """
    b, a, s, _ = h.shape
    eps = cfg.rms_eps

    def heads(y, n):
        return y.reshape(b, a, s, n, cfg.head_dim)

    u = rms_norm(h, p["attn_norm"], eps)
    q = heads(u @ p["wq"], cfg.num_heads)
    k = k_raw = heads(u @ p["wk"], cfg.num_kv_heads)
    if cfg.qk_norm:  # per head, before RoPE
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    q, k = rope(q), rope(k)
    v = k_raw if cfg.k_eq_v else heads(u @ p["wv"], cfg.num_kv_heads)
    if cfg.v_norm:
        v = _unit_norm(v, eps)
    o = attend(q, k, v, cfg.query_scale) @ p["wo"]
    h = h + (rms_norm(o, p["post_attn_norm"], eps) if cfg.sandwich_norms else o)
    f = gated_mlp(rms_norm(h, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"], cfg.mlp_activation)
    h = h + (rms_norm(f, p["post_mlp_norm"], eps) if cfg.sandwich_norms else f)
    return h * p["layer_scalar"].astype(h.dtype) if cfg.layer_scalar else h
