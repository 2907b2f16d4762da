"""The target model: a Llama-family decoder in Flax NNX with a static KV cache.

Implements docs/design.md#target-model: RMSNorm, RoPE (with its scalings), GQA, SwiGLU, optional Qwen2
q/k/v biases and Qwen3 q/k-norm, and per-layer sliding-window attention (Mistral, Qwen3 sliding layers,
Gemma), with per-layer weights stacked on a leading axis and the layer loop run by ``lax.scan`` (one
compiled layer body whatever the depth). The Gemma 2/3 differences are data in :class:`~dspark_jax.config.TargetConfig`:
``1 + w`` norms, the scaled embedding, the GELU-tanh MLP, sandwich norms, soft-caps, the query scale and
a per-layer RoPE (a scan input beside the stacked weights); Gemma 4's layers of two shapes scan by
pattern period (:mod:`dspark_jax.models.gemma4`). The forward pass can return the hidden states of
chosen layers ("taps"), which the drafter consumes as context features (docs/design.md#context-features).
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
from dspark_jax.models import layer_stack
from dspark_jax.models.attention import attend
from dspark_jax.models.gemma4 import grouped_forward, init_grouped_cache, random_grouped_params, refuse
from dspark_jax.models.head import row_reduce_head, tied_head_row_reduce
from dspark_jax.models.layer_stack import layer_inputs, per_layer_layout, run_layers, stacked_weights, store_layers
from dspark_jax.models.layers import KVCache, apply_rope, apply_rope_table, attention, kv_scatter, rms_norm
from dspark_jax.models.moe import feed_forward, split_mixed_mlp
from dspark_jax.models.rope import rope_table
from dspark_jax.models.weights import MOE_KEYS, check_target_params, target_param_shapes

_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
_BIAS_KEYS = ("bq", "bk", "bv")
_SANDWICH_KEYS = ("post_attn_norm", "post_mlp_norm")
# The per-layer RoPE inverse frequencies ride in the scan's per-layer inputs under this key.
ROPE_FREQ_KEY = "rope_freq"


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


FULL_WINDOW = 1 << 30
"""A full-attention layer's entry in the per-layer window table of a model with sliding layers
(wider than any cache, small enough that ``position - FULL_WINDOW`` stays in int32)."""


def layer_window_table(cfg: TargetConfig) -> jax.Array | None:
    """``[L]`` int32 window of every layer (:data:`FULL_WINDOW` for a full-attention layer), or
    None when no layer slides (the programs of such a model carry no window at all)."""
    if not cfg.has_sliding_layers:
        return None
    return jnp.asarray([FULL_WINDOW if w is None else w for w in cfg.layer_windows()], jnp.int32)


def layer_window(cfg: TargetConfig, li: jax.Array) -> jax.Array | int | None:
    """The sliding window of layer ``li``: None when no layer slides; a static int when every
    layer slides by the same window (Mistral: what the Pallas kernel path takes); else the int32
    scalar ``layer_window_table(cfg)[li]`` (traced)."""
    if not cfg.has_sliding_layers:
        return None
    if cfg.uniform_window is not None:
        return cfg.uniform_window
    table = layer_window_table(cfg)
    assert table is not None
    return table[li]


def random_params(cfg: TargetConfig, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Random float32 parameters in the canonical layout (for tests and dry runs)."""
    if cfg.grouped_attention:
        return random_grouped_params(cfg, seed, scale)
    rng = np.random.default_rng(seed)
    L, H, I, Ld = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers - cfg.num_sparse_layers
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def n(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    one = np.float32(1 - cfg.norm_offset)  # norm weights near 1 after the offset

    layers = {
        "attn_norm": one + n(L, H),
        "wq": n(L, H, qd),
        "wk": n(L, H, kd),
        "wv": n(L, H, kd),
        "wo": n(L, qd, H),
        "mlp_norm": one + n(L, H),
        "w_gate": n(Ld, H, I),
        "w_up": n(Ld, H, I),
        "w_down": n(Ld, I, H),
    }
    if cfg.qk_norm:
        layers["q_norm"] = one + n(L, cfg.head_dim)
        layers["k_norm"] = one + n(L, cfg.head_dim)
    if cfg.qkv_bias:
        layers.update(bq=n(L, qd), bk=n(L, kd), bv=n(L, kd))
    if cfg.o_bias:
        layers["bo"] = n(L, H)
    if cfg.sandwich_norms:
        layers["post_attn_norm"] = one + n(L, H)
        layers["post_mlp_norm"] = one + n(L, H)
    if cfg.num_sparse_layers:  # the dense MLP keys stack the dense layers only (none: absent)
        shapes = target_param_shapes(cfg)["layers"]
        layers = {k: v for k, v in layers.items() if k in shapes} | {k: n(*shapes[k]) for k in MOE_KEYS}
    params = {"embed": n(cfg.vocab_size, H) * 10, "layers": layers, "final_norm": one + n(H)}
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
      layer_layout: ``auto`` (default), ``stacked`` or ``per_layer``: the per-layer weights as one
        ``[L, ...]`` array each under a layer scan, or as buffers of their own under an unrolled
        layer loop, which XLA's CPU backend runs faster (:mod:`~dspark_jax.models.layer_stack`;
        ``auto``: per layer for float32 on a CPU without a mesh). The logits are the same.

    Raises:
      ValueError: a parameter is missing or has the wrong shape for ``cfg``; an unknown or
        unsupported ``layer_layout``.
    """

    def __init__(
        self,
        cfg: TargetConfig,
        params: dict[str, Any],
        dtype: Any = jnp.float32,
        fingerprint: str = "",
        mesh=None,
        layer_layout: str = "auto",
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.fingerprint = fingerprint
        check_target_params(cfg, params)
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
        keys = _LAYER_KEYS + (("q_norm", "k_norm") if cfg.qk_norm else ()) + (_BIAS_KEYS if cfg.qkv_bias else ())
        keys += ("bo",) if cfg.o_bias else ()
        keys += _SANDWICH_KEYS if cfg.sandwich_norms else ()
        keys = tuple(k for k in keys + MOE_KEYS if k in target_param_shapes(cfg)["layers"])
        keys = tuple(target_param_shapes(cfg)["layers"]) if cfg.grouped_attention else keys
        self.per_layer = per_layer_layout(layer_layout, cfg, mesh, dtype)
        self.layers = store_layers({k: params["layers"][k] for k in keys}, self.per_layer, cast, sh["layers"])

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``[...]`` int32 token ids -> ``[..., H]`` input embeddings (times ``cfg.embed_scale``,
        cast to the embedding's dtype first, as transformers scales Gemma's)."""
        if tokens.size == 1:
            # XLA turns a one-index gather into a dynamic-slice, which the SPMD partitioner serves on a
            # vocabulary-sharded table by all-gathering the whole table (the GPU decode step did); the
            # same id gathered twice stays a gather, looked up where the row lives and reduced.
            twice = jnp.take(self.embed[...], jnp.broadcast_to(tokens.reshape(1), (2,)), axis=0)
            e = twice[:1].reshape(*tokens.shape, twice.shape[-1])
        else:
            e = jnp.take(self.embed[...], tokens, axis=0)
        return e if self.cfg.embed_scale == 1.0 else e * jnp.asarray(self.cfg.embed_scale, e.dtype)

    def scan_params(self) -> dict[str, jax.Array] | list[dict[str, jax.Array]]:
        """The per-layer inputs of the layer loop (:func:`~.layer_stack.run_layers`): the weights
        ``{key: [L, ...]}`` (or, per-layer layout, a list of ``L`` dicts of one layer's), the RoPE
        (:data:`ROPE_FREQ_KEY` ``[L, head_dim / 2]`` float32) when it differs between layers, and with
        dense and sparse layers mixed their MLP slots for the weights (:func:`.moe.split_mixed_mlp`)."""
        p = layer_inputs(self.layers)
        freqs = jnp.asarray(layer_inv_freqs(self.cfg)) if self.cfg.per_layer_rope else None
        if isinstance(p, list):
            return p if freqs is None else [q | {ROPE_FREQ_KEY: freqs[i]} for i, q in enumerate(p)]
        if freqs is not None:
            p[ROPE_FREQ_KEY] = freqs
        return split_mixed_mlp(self.cfg, p)[0]

    def layer_weights(self) -> dict[str, jax.Array]:
        """The per-layer weights stacked, ``{key: [L, ...]}`` (with the per-layer layout a copy,
        made on each call: for code outside the decode loop)."""
        return stacked_weights(self.layers)

    def mlp_stacks(self) -> dict[str, jax.Array]:
        """With dense and sparse layers mixed (``cfg.mixed_mlp``), the two groups' MLP weights, each
        stacked over its own layers, which the scan indexes (:func:`.moe.split_mixed_mlp`); else ``{}``."""
        return split_mixed_mlp(self.cfg, self.layer_weights())[1] if self.cfg.mixed_mlp else {}

    def final_normed(self, h: jax.Array) -> jax.Array:
        """The final RMSNorm of ``h [..., H]`` (same dtype)."""
        return rms_norm(h, self.final_norm[...], self.cfg.rms_eps, self.cfg.norm_offset)

    def cap_logits(self, logits: jax.Array) -> jax.Array:
        """``cfg.final_logit_softcap``'s ``c * tanh(logits / c)`` on float32 logits (identity without one)."""
        c = self.cfg.final_logit_softcap
        return logits if c is None else jnp.tanh(logits / jnp.float32(c)) * jnp.float32(c)

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

        With a tied head on the CPU, 2 to :data:`.head.ROW_REDUCE_MAX_TOKENS` positions (a verification
        pass, a small engine step) are unembedded by :func:`tied_head_row_reduce`, the rest by one
        dot; the two agree to float round-off. ``cfg.final_logit_softcap`` applies (:meth:`cap_logits`).
        """
        h = self.final_normed(h)
        if self.lm_head is None and row_reduce_head(h):
            return self.cap_logits(tied_head_row_reduce(h, self.embed[...]))
        if self.lm_head is None:  # contracted in place: XLA's CPU backend fuses a transposed copy into the dot
            dims = (((h.ndim - 1,), (1,)), ((), ()))
            return self.cap_logits(jax.lax.dot_general(h, self.embed[...], dims, preferred_element_type=jnp.float32))
        return self.cap_logits(jnp.dot(h, self.lm_head[...], preferred_element_type=jnp.float32))

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
          cache: KV cache ``[L, B, S, kvh, hd]`` (Gemma 4: :func:`.gemma4.init_grouped_cache`); the block's
            keys/values are written at ``positions`` and each query attends to every cache slot at a
            position <= its own (on a sliding layer, within its window: ``> position - sliding_window``).
            Without a cache attention is causal within the block (training, scoring), likewise windowed.
          taps: 0-based layer indices whose outputs are returned as features (tap ``i`` equals
            transformers' ``hidden_states[i + 1]`` for ``i < L - 1``; tap ``L - 1`` is the last layer's
            output before the final norm, as DeepSpec's target cache and speculators' extraction store
            it, while transformers' ``hidden_states[L]`` is after it).
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
        layer_params, stacks = self.scan_params(), self.mlp_stacks()

        if cfg.grouped_attention:  # Gemma 4: two attention shapes (models.gemma4)
            x, hidden, new_cache = grouped_forward(self, tokens, positions, cache, taps, attn_mask)
        elif cache is None:
            causal = positions[:, None, :] <= positions[:, :, None]
            mask = causal if attn_mask is None else causal & attn_mask
            windows = layer_window_table(cfg)

            def layer(h, xs):
                p, w = (xs, None) if windows is None else xs
                m = mask if w is None else mask & (positions[:, None, :] > positions[:, :, None] - w)
                q, k, v = _qkv(cfg, p, h, positions)
                h = _attn_out_and_mlp(cfg, p, h, attention(q, k, v, m, **attention_options(cfg)), stacks)
                return h, (h if taps else None)

            x, hidden = run_layers(layer, x, layer_params, windows)
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
                w, be = layer_window(cfg, li), cfg.attention_backend
                a = attend(q, ck, cv, li, positions, backend=be, window=w, **attention_options(cfg))
                h = _attn_out_and_mlp(cfg, p, h, a, stacks)
                return (h, ck, cv, li + 1), (h if taps else None)

            (x, nk, nv, _), hidden = run_layers(cached_layer, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
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
        refuse(cfg, "the serving engine's packed pass")
        taps = tuple(int(t) for t in taps)
        geo = _packed_geometry(rows, cols, positions, cache.length, num_rows, width)
        layer_params = self.scan_params()
        x = self.embed_tokens(tokens).astype(self.dtype)[None]  # [1, K, H]
        layer = functools.partial(_packed_layer, cfg, geo, bool(taps), self.mlp_stacks())
        _check_taps(cfg, taps)
        (x, nk, nv, _), hidden = run_layers(layer, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
        new_kv = (nk, nv)
        features = _tap_features(hidden, taps)
        return TargetOutput(self.unembed(x[0]), features, KVCache(*new_kv))

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache for ``batch`` rows of ``length`` positions."""
        c = self.cfg
        if c.grouped_attention:
            return init_grouped_cache(c, batch, length, self.dtype)
        return KVCache.zeros(c.num_layers, batch, length, c.num_kv_heads, c.head_dim, self.dtype)


def _qkv(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, positions: jax.Array):
    """A layer's pre-attention half: RMSNorm, q/k/v projections (qk-norm) and RoPE.

    Args:
      h: ``[B, T, H]`` hidden states; positions: ``[B, T]`` int32 RoPE positions.
    Returns:
      ``(q [B, T, nh, hd], k [B, T, kvh, hd], v [B, T, kvh, hd])``.
    """
    a = rms_norm(h, p["attn_norm"], cfg.rms_eps, cfg.norm_offset)
    b, t, _ = a.shape
    q, k, v = _projections(cfg, p, a)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps, cfg.norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps, cfg.norm_offset)
    return _rope(cfg, p, q, positions), _rope(cfg, p, k, positions), v


def _projections(cfg: TargetConfig, p: dict[str, jax.Array], a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The q/k/v projections of the normed ``a [..., H]`` (plus their biases when ``cfg.qkv_bias``):
    ``([..., nh*hd], [..., kvh*hd], [..., kvh*hd])``."""
    q, k, v = layer_stack.qkv_projections(p, a, cfg.num_heads * cfg.head_dim)
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    return q, k, v


def _rope(cfg: TargetConfig, p: dict[str, jax.Array], x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE of ``x [B, T, heads, hd]`` at ``positions [B, T]``: the layer's own frequencies
    (``p[ROPE_FREQ_KEY]``) when they differ between layers, else those of ``cfg.rope_theta`` and
    ``cfg.rope_scaling`` (a constant table)."""
    if ROPE_FREQ_KEY in p:
        return apply_rope_table(x, positions, p[ROPE_FREQ_KEY])
    return apply_rope(x, positions, cfg.rope_theta, cfg.rope_scaling)


def layer_inv_freqs(cfg: TargetConfig) -> np.ndarray:
    """``[L, head_dim / 2]`` float32 RoPE inverse frequencies of every layer: ``cfg.sliding_rope_theta``
    unscaled on sliding layers, ``cfg.rope_theta`` with ``cfg.rope_scaling`` on the others
    (:func:`~dspark_jax.models.rope.rope_table`).

    Raises:
      ValueError: a scaling with a cos/sin factor (YaRN's attention factor) on per-layer RoPE.
    """
    full, mscale = rope_table(float(cfg.rope_theta), cfg.head_dim, cfg.rope_scaling)
    if mscale != 1.0:
        raise ValueError("per-layer RoPE with a cos/sin attention factor (YaRN) is not implemented")
    local, _ = rope_table(float(cfg.sliding_rope_theta or cfg.rope_theta), cfg.head_dim, None)
    return np.stack([local if w is not None else full for w in cfg.layer_windows()]).astype(np.float32)


def attention_options(cfg: TargetConfig) -> dict[str, Any]:
    """The static ``scale`` / ``softcap`` keywords of the attention functions for ``cfg``
    (empty for the default scale without a soft-cap, so those programs are unchanged)."""
    opts: dict[str, Any] = {}
    if cfg.query_scale is not None:
        opts["scale"] = float(cfg.query_scale)
    if cfg.attn_logit_softcap is not None:
        opts["softcap"] = float(cfg.attn_logit_softcap)
    return opts


def _residual_mlp(
    cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, attn_out: jax.Array, stacks: dict[str, jax.Array]
) -> jax.Array:
    """The residual adds around attention (``attn_out``: after ``wo``, before its bias) and the feed-forward
    (:func:`~dspark_jax.models.moe.feed_forward`; ``stacks``: :meth:`Target.mlp_stacks`), with
    Gemma's sandwich norms when ``cfg.sandwich_norms``. ``h``/result: ``[..., H]``."""
    off, eps = cfg.norm_offset, cfg.rms_eps
    if cfg.o_bias:
        attn_out = attn_out + p["bo"]
    if cfg.sandwich_norms:
        attn_out = rms_norm(attn_out, p["post_attn_norm"], eps, off)
    h = h + attn_out
    m = feed_forward(cfg, p, rms_norm(h, p["mlp_norm"], eps, off), stacks)
    if cfg.sandwich_norms:
        m = rms_norm(m, p["post_mlp_norm"], eps, off)
    return h + m


def _attn_out_and_mlp(cfg: TargetConfig, p: dict[str, jax.Array], h: jax.Array, attn: jax.Array, stacks) -> jax.Array:
    """A layer's second half: output projection of ``attn [B, T, nh*hd]`` added to ``h [B, T, H]``,
    then the feed-forward with its residual (:func:`_residual_mlp`). Returns the new ``[B, T, H]``."""
    return _residual_mlp(cfg, p, h, layer_stack.out_projection(p, attn), stacks)


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
    cfg: TargetConfig, g: _PackedGeometry, keep_hidden: bool, stacks: dict, carry: tuple, p: dict[str, jax.Array]
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
    window = layer_window(cfg, li)
    attn = attend(
        qg, ck_all, cv_all, li, g.qpos, backend=cfg.attention_backend, window=window, **attention_options(cfg)
    )
    attn = attn[g.grow, g.gcol]  # [K, nh*hd]
    h = packed_attn_out_and_mlp(cfg, p, h, attn, stacks)
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
    a = rms_norm(h, p["attn_norm"], cfg.rms_eps, cfg.norm_offset)
    q, k, v = _projections(cfg, p, a)
    q = q.reshape(1, k_tok, cfg.num_heads, hd)
    k = k.reshape(1, k_tok, kvh, hd)
    v = v.reshape(1, k_tok, kvh, hd)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_eps, cfg.norm_offset)
        k = rms_norm(k, p["k_norm"], cfg.rms_eps, cfg.norm_offset)
    q = _rope(cfg, p, q, rope_pos)[0]
    k = _rope(cfg, p, k, rope_pos)[0]
    lidx = jnp.full_like(row, li)
    ck_all = kv_scatter(ck_all, (lidx, row, wpos), k)
    cv_all = kv_scatter(cv_all, (lidx, row, wpos), v[0])
    return q, ck_all, cv_all


def packed_attn_out_and_mlp(cfg: TargetConfig, p: dict[str, jax.Array], h, attn, stacks):
    """A packed layer's second half: output projection of ``attn [K, nh*hd]`` added to
    ``h [1, K, H]``, then the feed-forward with its residual (``stacks``: :meth:`Target.mlp_stacks`).
    Returns the new ``[1, K, H]``."""
    return _residual_mlp(cfg, p, h, layer_stack.out_projection(p, attn)[None], stacks)
