"""Functional transformer building blocks shared by the target and the drafter.

Pure functions over arrays: RMSNorm, rotary embeddings (Hugging Face
``rotate_half`` convention), grouped-query attention with an explicit boolean
mask, SwiGLU, and the KV-cache write. Softmax and normalisation statistics are
computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import RopeScaling
from dspark_jax.models.rope import rope_table

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
        """S, the positions each row holds (a Gemma 4 cache's ``k`` is a pair: sliding, full)."""
        return (self.k[0] if isinstance(self.k, tuple) else self.k).shape[2]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``, all in float32, cast back to
    ``x``'s dtype. ``offset`` (static) is 1 for Gemma's ``1 + w`` norms."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (y * (w + offset if offset else w)).astype(x.dtype)


def apply_rope_table(x: jax.Array, positions: jax.Array, inv_freq, mscale: float = 1.0) -> jax.Array:
    """:func:`apply_rope` with the inverse frequencies given: ``inv_freq [head_dim / 2]`` float32
    (a constant, or traced: a layer's row of a per-layer table), ``x [B, T, heads, head_dim]``,
    ``positions [B, T]`` int32, ``mscale`` (static) multiplies cos and sin. Returns ``x`` rotated,
    same shape and dtype."""
    hd = x.shape[-1]
    # jnp.asarray without a dtype: the same numpy table for q and k stays one constant of the program
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2 :]
    rot = jnp.concatenate([-x2, x1], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


def score_scale(hd: int, scale: float | None = None) -> jax.Array:
    """The float32 multiplier of the attention scores ``q.k``: ``scale`` (static), default ``hd ** -0.5``."""
    return 1.0 / jnp.sqrt(jnp.float32(hd)) if scale is None else jnp.float32(scale)


def soft_cap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's attention soft-cap, before masking); the scores
    unchanged when ``softcap`` (static) is None."""
    if softcap is None:
        return scores
    return jnp.tanh(scores / jnp.float32(softcap)) * jnp.float32(softcap)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding, Hugging Face ``rotate_half`` layout.

    Args:
      x: ``[B, T, heads, head_dim]``.
      positions: ``[B, T]`` int32 absolute positions.
      theta: RoPE base.
      scaling: the target's RoPE frequency scaling (None: plain RoPE). Its frequency table is a
        constant computed once per config (:func:`~dspark_jax.models.rope.rope_table`).
    Returns:
      ``x`` rotated (and, with YaRN, scaled by its attention factor), same shape and dtype.
    """
    table, mscale = rope_table(float(theta), x.shape[-1], scaling)
    return apply_rope_table(x, positions, table, mscale)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Grouped-query scaled dot-product attention (``scale``: :func:`score_scale`; ``softcap``: :func:`soft_cap`).

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
    scores = soft_cap(scores * score_scale(hd, scale), softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    w = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", w, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh * hd).astype(q.dtype)


ATTN_BLOCK = 256
"""Keys per block of :func:`cached_attention` (a cache shorter than this is one block)."""


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    q_pos: jax.Array,
    *,
    block: int = ATTN_BLOCK,
    scale: float | None = None,
    softcap: float | None = None,
    window: jax.Array | int | None = None,
) -> jax.Array:
    """Grouped-query attention over one layer of a static KV cache, at a cost that follows the live length.

    Query ``(b, t)`` attends to cache slots ``s <= q_pos[b, t]`` of row ``b``. The slots are read in
    blocks of ``block`` aligned to absolute positions, by a ``lax.fori_loop`` whose trip count is
    ``ceil((max(q_pos) + 1) / block)`` (a traced value): blocks past the longest row are never read,
    so the cost does not depend on how many slots the cache was allocated with. With a sliding
    ``window`` the loop also starts at the first block any query sees, so the cost follows the
    window rather than the context. A cache of at most one block is read in one pass, without the
    loop. The softmax is accumulated online in float32; a block entirely masked for a row adds exact zeros to it, so a
    row's output does not depend on its batch-mates' lengths nor on the cache length.

    Args:
      q: ``[B, T, n_heads, hd]`` queries (RoPE applied).
      k_cache, v_cache: ``[L, B', S, n_kv_heads, hd]`` the full caches (``B' >= B``: the first ``B``
        rows are read), read in place (no per-layer copy).
      layer: int32 scalar (traced or static) layer index into the caches' axis 0.
      q_pos: ``[B, T]`` int32 last visible slot of each query; ``< 0``: sees nothing (its output is 0).
      block: static keys per block (clipped to ``S``).
      scale / softcap: static score scale (:func:`score_scale`) and soft-cap (:func:`soft_cap`).
      window: None (full causal attention) or an int32 scalar (traced or static) W >= 1: query
        ``(b, t)`` then sees only the slots ``q_pos[b, t] - W < s <= q_pos[b, t]`` (a sliding window
        of W tokens, its own included, as transformers' ``sliding_window_overlay``).
    Returns:
      ``[B, T, n_heads * hd]`` in the dtype of ``q``.
    """
    b, t, nh, hd = q.shape
    nkv = k_cache.shape[3]
    qg = q.reshape(b, t, nkv, nh // nkv, hd)
    m, l, acc = online_attention_stats(
        qg, k_cache, v_cache, layer, q_pos, block=block, window=window, scale=scale, softcap=softcap
    )
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]  # [B, g, r, T, hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, nh * hd).astype(q.dtype)


def online_attention_stats(
    qg: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    q_pos: jax.Array,
    *,
    block: int = ATTN_BLOCK,
    scale: float | None = None,
    softcap: float | None = None,
    window: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised online-softmax statistics of grouped queries over the live blocks of a cache layer.

    The loop of :func:`cached_attention` (which documents ``k_cache``, ``v_cache``, ``layer``,
    ``q_pos``, ``block`` and ``window``), without the final normalisation, so that a caller can
    merge more keys.

    Args:
      qg: ``[B, T, g, r, hd]`` queries grouped by KV head.
    Returns:
      ``(m, l, acc)`` float32: the running max ``[B, g, r, T]`` (``-1e30`` where nothing was seen),
      the sum of ``exp(score - m)`` ``[B, g, r, T]`` and the weighted values ``[B, g, r, T, hd]``.
    """
    b, t, nkv, rep, hd = qg.shape
    s_len = k_cache.shape[2]
    bs = min(block, s_len)
    mult = score_scale(hd, scale)
    n_blocks = (jnp.clip(jnp.max(q_pos) + 1, 1, s_len) + bs - 1) // bs
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.zeros((), jnp.int32)

    def body(i, carry):
        m, l, acc = carry
        start = i * bs
        first = jnp.minimum(start, s_len - bs)  # the last block of a cache not a multiple of bs overlaps
        idx = (layer, zero, first, zero, zero)
        kb = jax.lax.dynamic_slice(k_cache, idx, (1, b, bs, nkv, hd))[0].astype(qg.dtype)
        vb = jax.lax.dynamic_slice(v_cache, idx, (1, b, bs, nkv, hd))[0].astype(qg.dtype)
        slots = first + jnp.arange(bs, dtype=jnp.int32)
        ok = (slots >= start)[None, None, :] & (slots[None, None, :] <= q_pos[:, :, None])  # [B, T, bs]
        if window is not None:
            ok = ok & (slots[None, None, :] > q_pos[:, :, None] - window)
        ok = ok[:, None, None]  # [B, 1, 1, T, bs]
        sc = soft_cap(jnp.einsum("btgrd,bsgd->bgrts", qg, kb, preferred_element_type=jnp.float32) * mult, softcap)
        sc = jnp.where(ok, sc, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.where(ok, jnp.exp(sc - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bgrts,bsgd->bgrtd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    m0 = jnp.full((b, nkv, rep, t), _NEG_INF, jnp.float32)
    init = (m0, jnp.zeros_like(m0), jnp.zeros((b, nkv, rep, t, hd), jnp.float32))
    if s_len <= bs:  # one block: no loop (an XLA while costs ~1 ms a layer on CPU)
        return body(jnp.int32(0), init)
    if window is None:
        return jax.lax.fori_loop(0, n_blocks, body, init)
    # The blocks before the earliest slot any query's window reaches hold nothing visible.
    lo = jnp.min(jnp.where(q_pos >= 0, q_pos - window + 1, s_len))
    return jax.lax.fori_loop(jnp.clip(lo, 0, s_len) // bs, n_blocks, body, init)


def block_attention_cached(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    ctx_end: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    scale: float | None = None,
) -> jax.Array:
    """:func:`block_attention` with the context read from one layer of a cache, live blocks only.

    Args:
      q: ``[B, A, S, n_heads, hd]`` queries of A blocks of S slots.
      k_cache, v_cache: ``[N, B, C, n_kv_heads, hd]`` context caches (only read); ``layer``: int32 layer index.
      ctx_end: ``[B, A]`` int32: block ``a`` of row ``b`` sees the context slots ``< ctx_end[b, a]``.
      k_blk, v_blk: ``[B, A, S, n_kv_heads, hd]`` the blocks' own keys/values (bidirectional within
        a block).
      scale: the score scale (static; :func:`score_scale`).
    Returns:
      ``[B, A, S, n_heads * hd]`` in the dtype of ``q``.
    """
    b, a, s, nh, hd = q.shape
    g = k_cache.shape[3]
    r = nh // g
    qg = q.reshape(b, a * s, g, r, hd)
    q_pos = jnp.broadcast_to(ctx_end[:, :, None] - 1, (b, a, s)).reshape(b, a * s)
    m, l, acc = online_attention_stats(qg, k_cache, v_cache, layer, q_pos, scale=scale)
    m, l, acc = (x.reshape((b, g, r, a, s) + x.shape[4:]) for x in (m, l, acc))
    qb = q.reshape(b, a, s, g, r, hd)
    sb = jnp.einsum("basgrd,batgd->bgrast", qb, k_blk, preferred_element_type=jnp.float32) * score_scale(hd, scale)
    m_all = jnp.maximum(m, jnp.max(sb, axis=-1))
    corr, eb = jnp.exp(m - m_all), jnp.exp(sb - m_all[..., None])
    denom = l * corr + jnp.sum(eb, axis=-1)
    pv = jnp.einsum("bgrast,batgd->bgrasd", eb.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    out = (acc * corr[..., None] + pv) / denom[..., None]  # [B, g, r, A, S, hd]
    return jnp.transpose(out, (0, 3, 4, 1, 2, 5)).reshape(b, a, s, nh * hd).astype(q.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: ``(silu(x W_gate) * (x W_up)) W_down``; kernels ``[in, out]``."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, activation: str) -> jax.Array:
    """Gated MLP ``(act(x W_gate) * (x W_up)) W_down`` with ``activation`` (static) ``silu``
    (as :func:`swiglu`) or ``gelu_tanh`` (GELU, tanh approximation: transformers' ``gelu_pytorch_tanh``)."""
    return gate(x @ w_gate, x @ w_up, activation) @ w_down


def gate(g: jax.Array, u: jax.Array, activation: str) -> jax.Array:
    """The gated MLP's ``act(g) * u`` of its gate and up projections (:func:`gated_mlp`'s activations).

    Raises:
      ValueError: an unknown ``activation``.
    """
    if activation == "silu":
        return jax.nn.silu(g) * u
    if activation == "gelu_tanh":
        return jax.nn.gelu(g, approximate=True) * u
    raise ValueError(f"unknown MLP activation {activation!r}")


def kv_scatter(cache: jax.Array, index: tuple, update: jax.Array, *, flat: bool | None = None) -> jax.Array:
    """``cache.at[index].set(update, mode="drop")`` for a KV cache whose last two axes are
    ``(n_kv_heads, head_dim)``; on a TPU written as rows of a ``[prod(leading), n_kv_heads,
    head_dim]`` view (the leading axes flattened).

    Why the view: under tensor parallelism a TPU device often holds one KV head, and the TPU lays
    out a cache shard ``[..., S, 1, hd]`` with the size-1 head axis moved out of the tiled minor
    pair, while the read-modify-write of a one-token write (a dynamic-update-slice with the
    dropped-write select) asked for the plain order: the compiler copied the whole cache twice in
    every layer. The flattened view has one layout for both (and keeps a shard of several heads as
    laid out: merging heads into ``head_dim`` would relayout it); its reshapes are bitcasts and the
    values are the same. Other backends keep the plain scatter (XLA's CPU layout assignment copies around the view).

    Args:
      cache: ``[*lead, n_kv_heads, head_dim]``.
      index: one int32 array (or int) per leading axis, broadcastable together to a shape ``I``;
        an index outside ``[0, n)`` of its axis drops that write (callers map negative positions
        out of range first: ``.at`` would wrap them).
      update: ``[*I, n_kv_heads, head_dim]``.
      flat: use the view on a TPU; default: only for a single written row (``prod(I) == 1``). A
        many-row scatter stays a scatter, which keeps the cache's layout: the view would relayout a
        shard of two heads on v5p for the 8-token verification pass (measured), so callers opt in
        where the plain form copied (the DSpark drafter's all-layer context write).
    Returns:
      the updated cache (same shape and dtype).
    """
    index = tuple(jnp.asarray(i, jnp.int32) for i in index)
    if flat is None:  # one written row: the dynamic-update-slice case
        flat = math.prod(int(d) for d in jnp.broadcast_shapes(*(i.shape for i in index))) == 1
    if not flat:
        return _kv_scatter_plain(cache, index, update.astype(cache.dtype))
    return jax.lax.platform_dependent(
        cache, index, update.astype(cache.dtype), tpu=_kv_scatter_flat, default=_kv_scatter_plain
    )


def _kv_scatter_plain(cache: jax.Array, index: tuple, update: jax.Array) -> jax.Array:
    return cache.at[index].set(update, mode="drop")


def _kv_scatter_flat(cache: jax.Array, index: tuple, update: jax.Array) -> jax.Array:
    lead, (heads, hd) = cache.shape[:-2], cache.shape[-2:]
    idx = jnp.broadcast_arrays(*index)
    total = math.prod(lead)
    row, ok = jnp.zeros(idx[0].shape, jnp.int32), jnp.ones(idx[0].shape, bool)
    for i, n in zip(idx, lead):
        row, ok = row * n + i, ok & (i >= 0) & (i < n)
    row = jnp.where(ok, row, total)  # out of range: dropped
    flat = cache.reshape(total, heads, hd)
    flat = flat.at[row].set(update.reshape(row.shape + (heads, hd)), mode="drop")
    return flat.reshape(cache.shape)


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


def kv_cache_write(cache: jax.Array, update: jax.Array, positions: jax.Array) -> jax.Array:
    """:func:`cache_write` for a KV cache ``[B, S, n_kv_heads, hd]`` (update ``[B, T, n_kv_heads, hd]``),
    through :func:`kv_scatter`'s merged-heads view (the same values, no layout copy on a TPU mesh)."""
    pos = jnp.where(positions < 0, cache.shape[1], positions)
    return kv_scatter(cache, (jnp.arange(cache.shape[0])[:, None], pos), update)


def block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_mask: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    scale: float | None = None,
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
      scale: the score scale (static; :func:`score_scale`).
    Returns:
      ``[B, A, S, n_heads * hd]`` in the dtype of ``q``.
    """
    b, a, s, nh, hd = q.shape
    g = k_ctx.shape[2]
    r = nh // g
    qg = q.reshape(b, a, s, g, r, hd)
    mult = score_scale(hd, scale)
    sc = jnp.einsum("basgrd,bcgd->basgrc", qg, k_ctx, preferred_element_type=jnp.float32) * mult
    sc = jnp.where(ctx_mask[:, :, :, None, None, :], sc, _NEG_INF)
    sb = jnp.einsum("basgrd,batgd->basgrt", qg, k_blk, preferred_element_type=jnp.float32) * mult
    m = jnp.maximum(jnp.max(sc, -1, keepdims=True), jnp.max(sb, -1, keepdims=True))
    ec, eb = jnp.exp(sc - m), jnp.exp(sb - m)
    denom = jnp.sum(ec, -1, keepdims=True) + jnp.sum(eb, -1, keepdims=True)
    out = jnp.einsum(
        "basgrc,bcgd->basgrd", ec.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32
    ) + jnp.einsum("basgrt,batgd->basgrd", eb.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    out = out / denom
    return out.reshape(b, a, s, nh * hd).astype(q.dtype)
