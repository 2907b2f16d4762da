"""Gemma 4's decoder pass: sliding and full-attention layers of two shapes in one layer scan.

A Gemma 4 target (``cfg.grouped_attention``) gives its full-attention ("global") layers their own
head width and KV heads (``global_head_dim`` / ``global_num_kv_heads``), keys that double as values
(``k_eq_v``: no value projection), a partial ("proportional") RoPE, and its sliding layers a
plain RoPE of their own base. Every layer RMS-normalises q and k (``x * w`` norms), and v without
a weight (``v_norm``), attends with score scale 1, and multiplies its output by ``layer_scalar``.

Design: the layer pattern repeats with a period ``P`` (Gemma 4: five sliding layers, then one
full), so ``lax.scan`` runs over the ``L / P`` periods and each scan step unrolls one period,
whose layer kinds are static. The sliding and the full layers keep their weights in two stacks
(:data:`~dspark_jax.models.weights.GLOBAL_ATTN_KEYS`) and their keys/values in two caches of their
own shapes, both riding in the scan carry and written in place, so a decode step reads each layer
once with no padding and no branch. An irregular pattern is one period of ``L`` layers (unrolled).

What refuses a Gemma 4 target, by name: the serving engine's packed passes (and so its chunked
prefill), an attention backend other than xla. On a device mesh the sliding layers' weights split
like every target's, the full layers' ``g_wq`` / ``g_wo`` over heads, their few KV heads replicated.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import TargetConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.layers import (
    KVCache,
    apply_rope_table,
    attention,
    cached_attention,
    gated_mlp,
    kv_scatter,
    rms_norm,
)
from dspark_jax.models.rope import rope_table
from dspark_jax.models.weights import GLOBAL_ATTN_KEYS, attention_groups, target_param_shapes


def layer_period(cfg: TargetConfig) -> int:
    """The smallest ``P`` dividing ``L`` such that layer ``i`` has the kind of layer ``i % P``."""
    kinds = cfg.layer_windows()
    n = cfg.num_layers
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def refuse(cfg: TargetConfig, what: str) -> None:
    """Raises DSparkInputError naming ``what`` when ``cfg`` is a Gemma 4 target."""
    if cfg.grouped_attention:
        raise DSparkInputError(f"{what} does not support Gemma 4 targets ({cfg.name}): use batch decoding")


def _rope_tables(cfg: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(sliding [head_dim / 2], full [global_head_dim / 2])`` float32 inverse frequencies: the
    sliding layers' plain RoPE of ``sliding_rope_theta``; the full layers' ``rope_theta`` with
    ``rope_scaling`` (``proportional``: pairs past its partial rotary factor turn at frequency 0)."""
    local, _ = rope_table(float(cfg.sliding_rope_theta or cfg.rope_theta), cfg.head_dim, None)
    hd = cfg.global_head_dim or cfg.head_dim
    full, mscale = rope_table(float(cfg.rope_theta), hd, cfg.rope_scaling)
    if mscale != 1.0:
        raise ValueError("Gemma 4 RoPE with a cos/sin attention factor (YaRN) is not implemented")
    return local, full


def random_grouped_params(cfg: TargetConfig, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Random float32 parameters of a Gemma 4 target in the canonical layout (tests, dry runs)."""
    rng = np.random.default_rng(seed)
    shapes = target_param_shapes(cfg)

    def n(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    norms = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "layer_scalar")
    layers = {k: (1 + n(*s) if k.removeprefix("g_") in norms else n(*s)) for k, s in shapes["layers"].items()}
    params = {"embed": n(*shapes["embed"]) * 10, "layers": layers, "final_norm": 1 + n(cfg.hidden_size)}
    if "lm_head" in shapes:
        params["lm_head"] = n(*shapes["lm_head"])
    return params


def init_grouped_cache(cfg: TargetConfig, batch: int, length: int, dtype) -> KVCache:
    """An empty Gemma 4 cache: ``k = (sliding [Ls, B, S, kvh, hd], full [Lf, B, S, gkvh, ghd])``, ``v`` alike."""
    local, full = attention_groups(cfg)
    gkv, ghd = cfg.global_num_kv_heads or cfg.num_kv_heads, cfg.global_head_dim or cfg.head_dim
    ks = jnp.zeros((len(local), batch, length, cfg.num_kv_heads, cfg.head_dim), dtype)
    kf = jnp.zeros((len(full), batch, length, gkv, ghd), dtype)
    return KVCache(cast(Any, (ks, kf)), cast(Any, (ks, kf)))


def _period_inputs(cfg: TargetConfig, layers: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The stacked weights reshaped by period: a key over all L layers -> ``[L/P, P, ...]``, a
    sliding (full) layer key -> ``[L/P, Ps, ...]`` (``[L/P, Pf, ...]``)."""
    n = cfg.num_layers // layer_period(cfg)
    return {k: v.reshape((n, v.shape[0] // n) + v.shape[1:]) for k, v in layers.items()}


def _qkv(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, positions: jax.Array, full: bool, table):
    """A layer's normed q, k (RoPE applied) and v: ``[B, T, heads, hd]`` each (the layer's shapes)."""
    a = rms_norm(h, p["attn_norm"], cfg.rms_eps, cfg.norm_offset)
    b, t, _ = a.shape
    hd = (cfg.global_head_dim or cfg.head_dim) if full else cfg.head_dim
    kvh = (cfg.global_num_kv_heads or cfg.num_kv_heads) if full else cfg.num_kv_heads
    q = rms_norm((a @ p["wq"]).reshape(b, t, cfg.num_heads, hd), p["q_norm"], cfg.rms_eps, cfg.norm_offset)
    k_raw = (a @ p["wk"]).reshape(b, t, kvh, hd)
    v = k_raw if full and cfg.k_eq_v else (a @ p["wv"]).reshape(b, t, kvh, hd)
    if cfg.v_norm:
        v = rms_norm(v, jnp.ones((hd,), v.dtype), cfg.rms_eps)
    k = rms_norm(k_raw, p["k_norm"], cfg.rms_eps, cfg.norm_offset)
    return apply_rope_table(q, positions, table), apply_rope_table(k, positions, table), v


def _layer_rest(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, the (sandwich-normed) residual adds around it and the gated MLP, times the
    layer scalar: ``h [B, T, H]``, ``attn [B, T, nh*hd]`` -> ``[B, T, H]``."""
    eps, off, a = cfg.rms_eps, cfg.norm_offset, attn @ p["wo"]
    h = h + (rms_norm(a, p["post_attn_norm"], eps, off) if cfg.sandwich_norms else a)
    m = gated_mlp(rms_norm(h, p["mlp_norm"], eps, off), p["w_gate"], p["w_up"], p["w_down"], cfg.mlp_activation)
    out = h + (rms_norm(m, p["post_mlp_norm"], eps, off) if cfg.sandwich_norms else m)
    return out if not cfg.layer_scalar else out * p["layer_scalar"].astype(out.dtype)


def grouped_forward(
    target, tokens: jax.Array, positions: jax.Array, cache: KVCache | None, taps: tuple[int, ...], attn_mask
) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
    """The decoder layers of a Gemma 4 target (:meth:`~dspark_jax.models.target.Target.__call__`'s
    arguments): returns ``(h [B, T, H]`` before the final norm, ``hidden [L, B, T, H]`` or None
    without taps, the updated cache or None without one)."""
    cfg = target.cfg
    if cfg.attention_backend not in ("auto", "xla"):
        raise DSparkInputError(f"attention backend {cfg.attention_backend!r} does not support Gemma 4 targets")
    if cfg.num_experts or cfg.qkv_bias or cfg.o_bias or not cfg.qk_norm:
        raise ValueError("Gemma 4 layers with experts, q/k/v biases or without q/k norms are not implemented")
    period = layer_period(cfg)
    kinds = [w is None for w in cfg.layer_windows()[:period]]  # True: a full-attention layer
    tables = tuple(jnp.asarray(t) for t in _rope_tables(cfg))
    opts = {"scale": cfg.query_scale, "softcap": cfg.attn_logit_softcap}
    x = target.embed_tokens(tokens).astype(target.dtype)
    xs = _period_inputs(cfg, target.layer_weights())
    if cache is None:
        causal = positions[:, None, :] <= positions[:, :, None]
        causal = causal if attn_mask is None else causal & attn_mask
        local_mask = causal & (positions[:, None, :] > positions[:, :, None] - (cfg.sliding_window or 0))
    b_idx = jnp.arange(tokens.shape[0])[:, None]
    caches = () if cache is None else (*cache.k, *cache.v)
    wpos = None if cache is None else jnp.where(positions < 0, cache.length, positions)

    def period_body(carry, ps):
        h, cs, n = carry
        ks, kf, vs, vf = cs if cs else (None,) * 4
        seen, outs = [0, 0], []
        for full in kinds:
            j = seen[full]
            seen[full] += 1
            p = {k: ps[k][len(outs)] for k in ps if k.removeprefix("g_") not in GLOBAL_ATTN_KEYS}
            p |= {k: ps[GLOBAL_ATTN_KEYS[k] if full else k][j] for k in GLOBAL_ATTN_KEYS if k in _attn_keys(ps, full)}
            q, k, v = _qkv(cfg, p, h, positions, full, tables[full])
            if not cs:
                a = attention(q, k, v, causal if full else local_mask, **opts)
            else:
                li = n * sum(kinds if full else [not f for f in kinds]) + j
                ck, cv = (kf, vf) if full else (ks, vs)
                assert ck is not None and cv is not None
                ck, cv = kv_scatter(ck, (li, b_idx, wpos), k), kv_scatter(cv, (li, b_idx, wpos), v)
                a = cached_attention(q, ck, cv, li, positions, window=None if full else cfg.sliding_window, **opts)
                ks, vs, kf, vf = (ks, vs, ck, cv) if full else (ck, cv, kf, vf)
            h = _layer_rest(cfg, p, h, a)
            outs.append(h)
        cs = (ks, kf, vs, vf) if cs else cs
        return (h, cs, n + 1), (jnp.stack(outs) if taps else None)

    (x, caches, _), hidden = jax.lax.scan(period_body, (x, caches, jnp.int32(0)), xs)
    if hidden is not None:
        hidden = hidden.reshape((cfg.num_layers,) + hidden.shape[2:])
    new_cache = None if cache is None else KVCache(cast(Any, caches[:2]), cast(Any, caches[2:]))
    return x, hidden, new_cache


def _attn_keys(ps: dict[str, jax.Array], full: bool) -> tuple[str, ...]:
    """The attention keys (sliding names) a layer of the kind ``full`` has among the scan inputs ``ps``."""
    return tuple(k for k, g in GLOBAL_ATTN_KEYS.items() if (g if full else k) in ps)
