"""The target model: a Llama-family decoder in Flax NNX with a static KV cache.

Implements docs/design.md#target-model: RMSNorm, RoPE, GQA, SwiGLU and optional
Qwen3 q/k-norm, with per-layer weights stacked on a leading axis and the layer
loop run by ``lax.scan`` (one compiled layer body whatever the depth). The
forward pass can return the hidden states of chosen layers ("taps"), which the
drafter consumes as context features (docs/design.md#context-features).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import TargetConfig
from dspark_jax.models.attention import attend, current_platform
from dspark_jax.models.layers import KVCache, apply_rope, attention, kv_scatter, rms_norm, swiglu

_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


class TargetOutput(NamedTuple):
    """Result of a target forward pass.

    Attributes:
      logits: ``[B, T, V]`` float32 (or ``[B, V]`` when ``logit_index`` is given).
      features: ``[B, T, n_taps * H]`` concatenated outputs of the tapped layers,
        or None when no taps were requested.
      cache: the updated :class:`KVCache`, or None when run without a cache.
    """

    logits: jax.Array
    features: jax.Array | None
    cache: KVCache | None


# Up to this many positions, a tied LM head on the CPU runs as a row reduction (tied_head_row_reduce).
ROW_REDUCE_MAX_TOKENS = 32


def tied_head_row_reduce(h: jax.Array, embed: jax.Array) -> jax.Array:
    """``h @ embed.T`` as one reduction over H for every embedding row: ``[..., H]`` x ``[V, H]``
    -> ``[..., V]`` float32.

    Why: XLA's CPU backend runs a dot with one row as a matrix-vector product near memory bandwidth,
    but a dot with 2-32 rows through a GEMM kernel that read SmolLM2's 113 MB embedding 2.6x
    slower (2 cores, 3 rows: 8.1 ms against 3.1 ms for one row); the reduction streams each
    embedding row once for every position (4.7 ms at 3 rows; 7.8 against 9.7 ms at 9; session 22).
    Equal to the dot up to float round-off (summation order).
    """
    lead, hidden = h.shape[:-1], h.shape[-1]
    flat = h.reshape(-1, hidden).astype(jnp.float32)
    logits = jnp.sum(embed.astype(jnp.float32)[:, None, :] * flat[None, :, :], axis=-1)  # [V, N]
    return logits.T.reshape(*lead, embed.shape[0])


def random_params(cfg: TargetConfig, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Random float32 parameters in the canonical layout (for tests and dry runs)."""
    rng = np.random.default_rng(seed)
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def n(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    layers = {
        "attn_norm": 1 + n(L, H),
        "wq": n(L, H, qd),
        "wk": n(L, H, kd),
        "wv": n(L, H, kd),
        "wo": n(L, qd, H),
        "mlp_norm": 1 + n(L, H),
        "w_gate": n(L, H, I),
        "w_up": n(L, H, I),
        "w_down": n(L, I, H),
    }
    if cfg.qk_norm:
        layers["q_norm"] = 1 + n(L, cfg.head_dim)
        layers["k_norm"] = 1 + n(L, cfg.head_dim)
    params = {"embed": n(cfg.vocab_size, H) * 10, "layers": layers, "final_norm": 1 + n(H)}
    if not cfg.tie_embeddings:
        params["lm_head"] = n(H, cfg.vocab_size)
    return params


class Target(nnx.Module):
    """Llama-family decoder with hidden-state taps (docs/design.md#target-model).

    Args:
      cfg: architecture.
      params: canonical parameter dict (see :mod:`dspark_jax.models.weights`); kernels
        ``[in, out]``, per-layer tensors stacked on axis 0.
      dtype: compute and storage dtype of the weights (float32 on CPU tests,
        bfloat16 on accelerators). Logits are always returned in float32.
      fingerprint: identifier of the exact weights (see
        :func:`dspark_jax.models.weights.params_fingerprint`), recorded in drafters.
      mesh: optional :class:`jax.sharding.Mesh`: each weight goes from the host straight to
        its shards (:func:`dspark_jax.models.sharding.tree_shardings`, docs/design.md#device-mesh),
        so a target larger than one device's memory never lands on one device.
        ``None``: the default device (as before).

    Raises:
      ValueError: a parameter is missing or has the wrong shape for ``cfg``.
    """

    def __init__(
        self, cfg: TargetConfig, params: dict[str, Any], dtype: Any = jnp.float32, fingerprint: str = "", mesh=None
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.fingerprint = fingerprint
        _check_params(cfg, params)
        if mesh is None:
            cast = lambda a, s=None: nnx.Param(jnp.asarray(a, dtype))
        else:
            from dspark_jax.models.sharding import place, tree_shardings

            shardings = tree_shardings(params, mesh, cfg)
            cast = lambda a, s: nnx.Param(place(np.asarray(a).astype(jnp.dtype(dtype)), s))
        sh = shardings if mesh is not None else {"layers": {}}
        self.embed = cast(params["embed"], sh.get("embed"))
        self.final_norm = cast(params["final_norm"], sh.get("final_norm"))
        self.lm_head = None if cfg.tie_embeddings else cast(params["lm_head"], sh.get("lm_head"))
        keys = _LAYER_KEYS + (("q_norm", "k_norm") if cfg.qk_norm else ())
        self.layers = nnx.Dict({k: cast(params["layers"][k], sh["layers"].get(k)) for k in keys})

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``[...]`` int32 token ids -> ``[..., H]`` embeddings."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def lm_head_weight(self) -> jax.Array:
        """``[H, V]`` output projection (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def lm_head_rows(self, ids: jax.Array) -> jax.Array:
        """``[N, H]`` output-projection rows of the token ids ``ids [N]`` (a draft vocabulary):
        a contiguous row gather of the embedding when tied, so that restricting the head costs
        ``N x H`` reads rather than a strided column gather of ``[H, V]``."""
        if self.lm_head is None:
            return jnp.take(self.embed[...], ids, axis=0)
        return jnp.take(self.lm_head[...], ids, axis=1).T

    def unembed(self, h: jax.Array) -> jax.Array:
        """Final norm + LM head: ``[..., H]`` -> ``[..., V]`` float32 logits.

        With a tied head on the CPU, 2 to :data:`ROW_REDUCE_MAX_TOKENS` positions (a verification
        pass, a small engine step) are unembedded by :func:`tied_head_row_reduce`, the rest by one
        dot; the two agree to float round-off.
        """
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_eps)
        n = int(np.prod(h.shape[:-1]))
        if self.lm_head is None and 1 < n <= ROW_REDUCE_MAX_TOKENS and current_platform() == "cpu":
            return tied_head_row_reduce(h, self.embed[...])
        return jnp.dot(h, self.lm_head_weight(), preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        taps: Sequence[int] = (),
        logit_index: jax.Array | None = None,
        attn_mask: jax.Array | None = None,
    ) -> TargetOutput:
        """Runs the decoder over a block of tokens.

        Args:
          tokens: ``[B, T]`` int32 token ids.
          positions: ``[B, T]`` int32 absolute positions (RoPE and cache slots).
          cache: KV cache ``[L, B, S, kvh, hd]``; the block's keys/values are
            written at ``positions`` and each query attends to every cache slot
            at a position <= its own. Without a cache attention is causal within
            the block (training and full-sequence scoring).
          taps: 0-based layer indices whose outputs are returned as features
            (tap ``i`` equals transformers' ``hidden_states[i + 1]`` for
            ``i < L - 1``).
          logit_index: optional ``[B]`` int32; when given only the logits at that
            block index are computed (prefill), shape ``[B, V]``.
          attn_mask: optional extra ``[B, T, T]`` bool mask for cache-less calls.

        Returns:
          :class:`TargetOutput`.
        """
        cfg = self.cfg
        x = self.embed_tokens(tokens).astype(self.dtype)
        taps = tuple(int(t) for t in taps)
        _check_taps(cfg, taps)
        layer_params = {k: v[...] for k, v in self.layers.items()}

        if cache is None:
            causal = positions[:, None, :] <= positions[:, :, None]
            mask = causal if attn_mask is None else causal & attn_mask

            def layer(h, p):
                q, k, v = _qkv(cfg, p, h, positions)
                h = _attn_out_and_mlp(cfg, p, h, attention(q, k, v, mask))
                return h, (h if taps else None)

            x, hidden = jax.lax.scan(layer, x, layer_params)
            new_cache = None
        else:
            # The cache rides in the scan carry and is written in place at the block's positions;
            # attention reads only the live blocks of the layer (attend: cached_attention on xla,
            # else the configured backend, docs/design.md#attention-backends).
            b_idx = jnp.arange(cache.k.shape[1])[:, None]
            wpos = jnp.where(positions < 0, cache.length, positions)  # out of range: dropped writes

            def cached_layer(carry, p):
                h, ck, cv, li = carry
                q, k, v = _qkv(cfg, p, h, positions)
                ck = kv_scatter(ck, (li, b_idx, wpos), k)
                cv = kv_scatter(cv, (li, b_idx, wpos), v)
                h = _attn_out_and_mlp(cfg, p, h, attend(q, ck, cv, li, positions, backend=cfg.attention_backend))
                return (h, ck, cv, li + 1), (h if taps else None)

            (x, nk, nv, _), hidden = jax.lax.scan(cached_layer, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
            new_cache = KVCache(nk, nv)
        features = _tap_features(hidden, taps)
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        return TargetOutput(self.unembed(x), features, new_cache)

    def forward_packed(
        self,
        tokens: jax.Array,
        rows: jax.Array,
        cols: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        num_rows: int,
        width: int,
        taps: Sequence[int] = (),
    ) -> TargetOutput:
        """Decoder pass over tokens of many requests packed into one sequence (serving).

        Packed token ``i`` belongs to cache row ``rows[i]`` (a request's decode slot) and
        sits at absolute position ``positions[i]``; ``cols[i]`` is its index inside its
        row's block (0 for the anchor). The projections and the MLP run over the ``K``
        packed tokens only, so their cost follows the token budget ``K``, not the number
        of rows times the block size (docs/design.md#static-shapes: one compiled pass per
        token-budget bucket). For attention the queries are scattered into a padded
        ``[num_rows, width]`` grid so that every row reads its own cache row once: each
        layer first writes the block's keys/values at ``(rows[i], positions[i])``, then a
        query at position ``p`` attends to its row's cache slots ``<= p``, i.e. the
        request's committed context plus the earlier tokens of its own block.

        Args:
          tokens: ``[K]`` int32 token ids.
          rows: ``[K]`` int32 cache rows in ``[0, num_rows)``.
          cols: ``[K]`` int32 in ``[0, width)``; distinct ``(row, col)`` for valid tokens.
          positions: ``[K]`` int32 absolute positions; a position outside
            ``[0, cache.length)`` marks a padding token: nothing is written for it and
            its outputs are garbage (finite).
          cache: KV cache ``[L, B, S, kvh, hd]`` with ``B >= num_rows``.
          num_rows: static number of leading cache rows attention reads.
          width: static maximum tokens per row in this pass.
          taps: layers whose outputs are returned as features (see :meth:`__call__`).

        Returns:
          :class:`TargetOutput` with ``logits [K, V]`` float32, ``features [K, n_taps * H]``
          (or None) and the updated cache.
        """
        cfg = self.cfg
        taps = tuple(int(t) for t in taps)
        geo = _packed_geometry(rows, cols, positions, cache.length, num_rows, width)
        layer_params = {k: v[...] for k, v in self.layers.items()}
        x = self.embed_tokens(tokens).astype(self.dtype)[None]  # [1, K, H]
        layer = functools.partial(_packed_layer, cfg, geo, bool(taps))
        _check_taps(cfg, taps)
        (x, nk, nv, _), hidden = jax.lax.scan(layer, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
        new_kv = (nk, nv)
        features = _tap_features(hidden, taps)
        return TargetOutput(self.unembed(x[0]), features, KVCache(*new_kv))

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache for ``batch`` rows of ``length`` positions."""
        c = self.cfg
        return KVCache.zeros(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, self.dtype)


def _qkv(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, positions: jax.Array):
    """A layer's pre-attention half: RMSNorm, q/k/v projections (qk-norm) and RoPE.

    Args:
      h: ``[B, T, H]`` hidden states; positions: ``[B, T]`` int32 RoPE positions.
    Returns:
      ``(q [B, T, nh, hd], k [B, T, kvh, hd], v [B, T, kvh, hd])``.
    """
    a = rms_norm(h, p["attn_norm"], cfg.rms_eps)
    b, t, _ = a.shape
    q = (a @ p["wq"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = (a @ p["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (a @ p["wv"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    return apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta), v


def _attn_out_and_mlp(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, attn: jax.Array) -> jax.Array:
    """A layer's second half: output projection of ``attn [B, T, nh*hd]`` added to ``h [B, T, H]``,
    then the SwiGLU MLP with its residual. Returns the new ``[B, T, H]``."""
    h = h + attn @ p["wo"]
    m = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
    return h + swiglu(m, p["w_gate"], p["w_up"], p["w_down"])


def _tap_features(hidden: jax.Array | None, taps: tuple[int, ...]) -> jax.Array | None:
    """The tapped layers' outputs ``hidden [L, ..., H]`` (a layer scan's ys) concatenated on the last axis,
    ``[..., n_taps * H]``; None without taps (the scan then returns no hidden states)."""
    if not taps or hidden is None:
        return None
    return jnp.concatenate([hidden[t] for t in taps], axis=-1)


def _check_taps(cfg: TargetConfig, taps: tuple[int, ...]) -> None:
    """Raises ValueError for a tap layer outside ``[0, num_layers)``."""
    for t in taps:
        if not 0 <= t < cfg.num_layers:
            raise ValueError(f"tap layer {t} out of range for a {cfg.num_layers}-layer target")


class _PackedGeometry(NamedTuple):
    """Where the ``K`` packed tokens of :meth:`Target.forward_packed` go (all traced int32/bool
    except the static sizes).

    Attributes:
      qrow: ``[K]`` cache row of each token; ``num_rows`` (out of range) for padding.
      cols: ``[K]`` index of each token inside its row's block.
      wpos: ``[K]`` cache slot written; ``s_len`` (out of range: dropped write) for padding.
      qpos: ``[R, W]`` int32, query grid slot ``(r, w)`` reads the cache slots ``<= qpos[r, w]``
        (-1: a padding slot, it reads nothing).
      grow / gcol: ``[K]`` clipped grid coordinates the attention output is gathered from.
      rope_pos: ``[1, K]`` RoPE positions (clipped into the cache).
      num_rows / width / s_len / k_tok: static R, W, S and K.
    """

    qrow: jax.Array
    cols: jax.Array
    wpos: jax.Array
    qpos: jax.Array
    grow: jax.Array
    gcol: jax.Array
    rope_pos: jax.Array
    num_rows: int
    width: int
    s_len: int
    k_tok: int


def _packed_geometry(
    rows: jax.Array, cols: jax.Array, positions: jax.Array, s_len: int, num_rows: int, width: int
) -> _PackedGeometry:
    """The scatter/gather indices and the query positions of a packed pass (see
    :meth:`Target.forward_packed` for the argument shapes); padding tokens (a position
    outside ``[0, s_len)``) write nothing and their queries see nothing."""
    valid = (positions >= 0) & (positions < s_len)
    wpos = jnp.where(valid, positions, s_len)  # out of range: dropped writes
    qrow = jnp.where(valid, rows, num_rows)
    qpos = jnp.full((num_rows, width), -1, jnp.int32).at[qrow, cols].set(positions, mode="drop")
    grow = jnp.clip(rows, 0, num_rows - 1)
    gcol = jnp.clip(cols, 0, width - 1)
    rope_pos = jnp.clip(positions, 0, s_len - 1)[None]
    return _PackedGeometry(qrow, cols, wpos, qpos, grow, gcol, rope_pos, num_rows, width, s_len, positions.shape[0])


def _packed_layer(
    cfg: TargetConfig, g: _PackedGeometry, keep_hidden: bool, carry: tuple, p: dict[str, jax.Array]
) -> tuple[tuple, jax.Array | None]:
    """One decoder layer of :meth:`Target.forward_packed` (a ``lax.scan`` body over layers).

    The full cache rides in the scan carry ``(h [1, K, H], k [L, B, S, kvh, hd], v, layer index)``
    and is updated in place (scatter at the layer index); attention reads only the first
    ``num_rows`` rows of the layer, and of those only the live blocks (:func:`attend` with
    ``cfg.attention_backend``; on xla :func:`~dspark_jax.models.layers.cached_attention`).
    Mapping the cache as scan xs/ys instead would copy every row of every layer each step, which
    dominates a serving step when most slots are idle.

    Returns:
      the new carry and the layer output ``[K, H]`` (None unless ``keep_hidden``).
    """
    h, ck_all, cv_all, li = carry
    q, ck_all, cv_all = packed_qkv(cfg, p, h, g.rope_pos, g.qrow, g.wpos, ck_all, cv_all, li)
    qg = jnp.zeros((g.num_rows, g.width) + q.shape[1:], q.dtype).at[g.qrow, g.cols].set(q, mode="drop")
    attn = attend(qg, ck_all, cv_all, li, g.qpos, backend=cfg.attention_backend)[g.grow, g.gcol]  # [K, nh*hd]
    h = packed_attn_out_and_mlp(cfg, p, h, attn)
    return (h, ck_all, cv_all, li + 1), (h[0] if keep_hidden else None)


def packed_qkv(cfg: TargetConfig, p: dict[str, jax.Array], h, rope_pos, row, wpos, ck_all, cv_all, li):
    """A packed layer's pre-attention half: RMSNorm, q/k/v projections (qk-norm), RoPE, and the
    scatter of the ``K`` new keys/values into layer ``li`` of the full cache at ``(row, wpos)``
    (``wpos`` out of range: padding, nothing written).

    Args:
      h: ``[1, K, H]`` hidden states; rope_pos: ``[1, K]`` positions; row / wpos: ``[K]`` int32.
      ck_all / cv_all: ``[L, B, S, kvh, hd]`` caches; li: int32 layer index.
    Returns:
      ``(q [K, nh, hd], ck_all, cv_all)``.
    """
    k_tok, kvh, hd = h.shape[1], cfg.num_kv_heads, cfg.head_dim
    a = rms_norm(h, p["attn_norm"], cfg.rms_eps)
    q = (a @ p["wq"]).reshape(1, k_tok, cfg.num_heads, hd)
    k = (a @ p["wk"]).reshape(1, k_tok, kvh, hd)
    v = (a @ p["wv"]).reshape(1, k_tok, kvh, hd)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    q = apply_rope(q, rope_pos, cfg.rope_theta)[0]
    k = apply_rope(k, rope_pos, cfg.rope_theta)[0]
    lidx = jnp.full_like(row, li)
    ck_all = kv_scatter(ck_all, (lidx, row, wpos), k)
    cv_all = kv_scatter(cv_all, (lidx, row, wpos), v[0])
    return q, ck_all, cv_all


def packed_attn_out_and_mlp(cfg: TargetConfig, p: dict[str, jax.Array], h, attn):
    """A packed layer's second half: output projection of ``attn [K, nh*hd]`` added to
    ``h [1, K, H]``, then the SwiGLU MLP with its residual. Returns the new ``[1, K, H]``."""
    h = h + (attn @ p["wo"])[None]
    m = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
    return h + swiglu(m, p["w_gate"], p["w_up"], p["w_down"])


def _check_params(cfg: TargetConfig, params: dict[str, Any]) -> None:
    L, H, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    want = {
        "attn_norm": (L, H),
        "wq": (L, H, qd),
        "wk": (L, H, kd),
        "wv": (L, H, kd),
        "wo": (L, qd, H),
        "mlp_norm": (L, H),
        "w_gate": (L, H, I),
        "w_up": (L, H, I),
        "w_down": (L, I, H),
    }
    if cfg.qk_norm:
        want.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    got = params.get("layers", {})
    problems = []
    for k, shape in want.items():
        if k not in got:
            problems.append(f"layers.{k} missing")
        elif tuple(got[k].shape) != shape:
            problems.append(f"layers.{k} has shape {tuple(got[k].shape)}, expected {shape}")
    embed: Any = params.get("embed")
    lm_head: Any = params.get("lm_head")
    if tuple(np.shape(embed)) != (cfg.vocab_size, H):
        problems.append(f"embed has shape {np.shape(embed)}, expected {(cfg.vocab_size, H)}")
    if not cfg.tie_embeddings and tuple(np.shape(lm_head)) != (H, cfg.vocab_size):
        problems.append("lm_head missing or misshapen")
    if problems:
        raise ValueError("target parameters do not match the config: " + "; ".join(problems))
