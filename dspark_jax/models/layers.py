"""Functional transformer building blocks shared by the target and the drafter.

Pure functions over arrays: RMSNorm, rotary embeddings (Hugging Face
``rotate_half`` convention), grouped-query attention with an explicit boolean
mask, SwiGLU, and the KV-cache write. Softmax and normalisation statistics are
computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


class KVCache(NamedTuple):
    """Static-shape key/value cache indexed by absolute token position.

    Attributes:
      k: ``[L, B, S, n_kv_heads, head_dim]`` keys (RoPE already applied).
      v: ``[L, B, S, n_kv_heads, head_dim]`` values.

    Slot ``s`` holds the token at absolute position ``s``. Entries past a row's
    current position may be stale (e.g. rejected draft tokens): attention masks
    them by position, and the next write at that position overwrites them, so
    rolling back a rejected block costs nothing.
    """

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(num_layers: int, batch: int, length: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> KVCache:
        shape = (num_layers, batch, length, num_kv_heads, head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def length(self) -> int:
        return self.k.shape[2]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``, statistics in float32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding, Hugging Face ``rotate_half`` layout.

    Args:
      x: ``[B, T, heads, head_dim]``.
      positions: ``[B, T]`` int32 absolute positions.
      theta: RoPE base.
    Returns:
      ``x`` rotated, same shape and dtype.
    """
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    rot = jnp.concatenate([-x2, x1], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query scaled dot-product attention.

    Args:
      q: ``[B, T, n_heads, hd]`` queries.
      k, v: ``[B, S, n_kv_heads, hd]`` keys and values.
      mask: ``[B, T, S]`` bool, True where query t may attend to key s. Every
        query row must allow at least one key.
    Returns:
      ``[B, T, n_heads * hd]`` in the dtype of ``q``.
    """
    b, t, nh, hd = q.shape
    nkv = k.shape[2]
    rep = nh // nkv
    qg = q.reshape(b, t, nkv, rep, hd)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(hd)))
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    w = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", w, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh * hd).astype(q.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: ``(silu(x W_gate) * (x W_up)) W_down``; kernels ``[in, out]``."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def cache_write(cache: jax.Array, update: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes ``update[b, t]`` into ``cache[b, positions[b, t]]``.

    Args:
      cache: ``[B, S, ...]``.
      update: ``[B, T, ...]``.
      positions: ``[B, T]`` int32. Positions outside ``[0, S)`` are dropped, so a
        block that runs past the end of the cache never writes out of bounds.
    """
    b_idx = jnp.arange(cache.shape[0])[:, None]
    pos = jnp.where(positions < 0, cache.shape[1], positions)
    return cache.at[b_idx, pos].set(update.astype(cache.dtype), mode="drop")


def block_attention(
    q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_mask: jax.Array, k_blk: jax.Array, v_blk: jax.Array
) -> jax.Array:
    """Attention of draft blocks over shared context keys plus their own block (KV injection).

    One softmax over ``[context keys ; own block keys]`` per query, computed without
    materialising a dense ``[A*S, A*S]`` block-diagonal mask: context scores are
    ``[.., A*S, C]`` and block scores ``[.., A, S, S]``.

    Args:
      q: ``[B, A, S, n_heads, hd]`` queries of A blocks of S slots.
      k_ctx, v_ctx: ``[B, C, n_kv_heads, hd]`` injected context keys/values.
      ctx_mask: ``[B, A, S, C]`` bool, context entries visible to each slot.
      k_blk, v_blk: ``[B, A, S, n_kv_heads, hd]`` the blocks' own keys/values
        (bidirectional within a block).
    Returns:
      ``[B, A, S, n_heads * hd]`` in the dtype of ``q``.
    """
    b, a, s, nh, hd = q.shape
    g = k_ctx.shape[2]
    r = nh // g
    qg = q.reshape(b, a, s, g, r, hd)
    scale = 1.0 / jnp.sqrt(jnp.float32(hd))
    sc = jnp.einsum("basgrd,bcgd->basgrc", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    sc = jnp.where(ctx_mask[:, :, :, None, None, :], sc, _NEG_INF)
    sb = jnp.einsum("basgrd,batgd->basgrt", qg, k_blk, preferred_element_type=jnp.float32) * scale
    m = jnp.maximum(jnp.max(sc, -1, keepdims=True), jnp.max(sb, -1, keepdims=True))
    ec, eb = jnp.exp(sc - m), jnp.exp(sb - m)
    denom = jnp.sum(ec, -1, keepdims=True) + jnp.sum(eb, -1, keepdims=True)
    out = jnp.einsum(
        "basgrc,bcgd->basgrd", ec.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32
    ) + jnp.einsum("basgrt,batgd->basgrd", eb.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    out = out / denom
    return out.reshape(b, a, s, nh * hd).astype(q.dtype)
