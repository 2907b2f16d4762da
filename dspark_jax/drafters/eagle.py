"""Eagle3-style autoregressive baseline drafter (docs/design.md#baselines).

The paper compares DSpark with Eagle3 trained on the same data. This module is that
baseline in the same code base. It implements the :class:`~dspark_jax.drafters.base.Drafter`
protocol (``train_blocks`` for the trainer, ``init_cache`` / ``extend_cache`` /
``write_context`` / ``draft`` for the decode loops), so it trains, exports, loads and evaluates
through the same paths (``variant="eagle3"``). It is not a
:class:`~dspark_jax.drafters.base.BlockDrafter`: it has no block pass, no Markov or confidence
head and no draft vocabulary.

Architecture (Li et al., EAGLE-3; docs/design.md#baselines):

* fused target features ``g_t = [f_low ; f_mid ; f_high](t) W_fc`` from three tapped
  target layers (:func:`eagle_taps`), projected from ``3H`` to ``d``;
* one decoder layer whose input at position ``t`` is the pair
  ``[RMSNorm(emb(x_t)) ; RMSNorm(u_{t-1})]`` (width ``2d``) with ``u_{t-1}`` the
  hidden state preceding the token: the target's fused feature ``g_{t-1}`` for context
  tokens, the drafter's own previous output ``a_{t-1}`` inside a draft
  (``g_{-1} = 0``); residual stream starts from ``u_{t-1}``; causal attention with
  RoPE at absolute positions over the drafter's own KV cache;
* output ``a_t`` -> final norm -> the target's frozen LM head predicts ``x_{t+1}``.

Drafting is autoregressive: ``block_size`` sequential single-token steps, each sampling a
draft token and feeding it (and ``a``) to the next, so the draft cost grows linearly
with ``block_size`` (paper Section 3: ``T_draft ~ block_size``). ``q_k`` returned in
:class:`~dspark_jax.drafters.base.Draft` is exactly the distribution ``x_k`` was drawn from,
so verification stays lossless. No Markov or confidence head (confidence 1).

Training uses training-time test (EAGLE-3): step 1 is a causal pass over the whole
sequence with target features; step ``k >= 2`` replaces each position's input
feature by the drafter's step ``k-1`` output at the previous position, and the query
of the chain anchored at ``P`` (position ``P+k-1``) attends to the target-feature keys
at positions ``<= P`` plus the chain's own keys of steps ``2..k`` (the diagonal mask),
exactly what decoding sees. The outputs at anchor ``P`` + ``k-1`` form the block of
anchor ``P``, so the trainer's loss (CE + TV, position weights) applies unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.base import BlockOutput, Draft
from dspark_jax.models.layers import (
    _NEG_INF,
    apply_rope,
    attention,
    cache_write,
    kv_cache_write,
    kv_scatter,
    rms_norm,
    swiglu,
)
from dspark_jax.models.sampling import SamplingArrays, process_logits, sample
from dspark_jax.models.target import Target


class EagleCache(NamedTuple):
    """Static-shape decode state of the eagle3 drafter, indexed by absolute position.

    Attributes:
      k, v: ``[B, S, kvh, hd]`` keys (RoPE applied) / values of the layer input pair at
        each position (computed from target features once verified).
      feat: ``[B, S, d]`` fused target features ``g_t`` (read at ``P - 1`` to start a draft).
    """

    k: jax.Array
    v: jax.Array
    feat: jax.Array

    @property
    def length(self) -> int:
        return self.k.shape[1]


def eagle_taps(t: TargetConfig) -> tuple[int, ...]:
    """Low / mid / high tapped layers: EAGLE-3's ``(2, L // 2, L - 3)`` for ``L >= 8``.

    Shallower targets spread three distinct layers as far as the depth allows
    (stories260K, 5 layers: ``(1, 2, 3)``).
    """
    n = t.num_layers
    if n >= 8:
        return (2, n // 2, n - 3)
    return tuple(sorted({min(1, n - 1), n // 2, max(0, n - 2)}))


def _shift(x: jax.Array, n: int) -> jax.Array:
    """``y[:, t] = x[:, t - n]`` along axis 1, zeros for ``t < n``."""
    if n == 0:
        return x
    pad = jnp.zeros(x.shape[:1] + (n,) + x.shape[2:], x.dtype)
    return jnp.concatenate([pad, x[:, : x.shape[1] - n]], axis=1)


def _attend(q, k1, v1, m1, k2, v2, m2) -> jax.Array:
    """One softmax over shared keys ``k1`` and per-query keys ``k2`` (GQA).

    Args:
      q: ``[B, T, nh, hd]``.
      k1, v1: ``[B, S, kvh, hd]`` keys shared by all queries; ``m1``: ``[B|1, T, S]`` bool.
      k2, v2: ``[B, T, C, kvh, hd]`` keys of each query's own chain; ``m2``: ``[B|1, T, C]``.
        Every query must see at least one key.
    Returns:
      ``[B, T, nh * hd]`` in the dtype of ``q``.
    """
    b, t, nh, hd = q.shape
    g = k1.shape[2]
    qg = q.reshape(b, t, g, nh // g, hd)
    scale = 1.0 / jnp.sqrt(jnp.float32(hd))
    s1 = jnp.einsum("btgrd,bsgd->btgrs", qg, k1, preferred_element_type=jnp.float32) * scale
    s1 = jnp.where(m1[:, :, None, None, :], s1, _NEG_INF)
    s2 = jnp.einsum("btgrd,btcgd->btgrc", qg, k2, preferred_element_type=jnp.float32) * scale
    s2 = jnp.where(m2[:, :, None, None, :], s2, _NEG_INF)
    m = jnp.maximum(jnp.max(s1, -1, keepdims=True), jnp.max(s2, -1, keepdims=True))
    e1, e2 = jnp.exp(s1 - m), jnp.exp(s2 - m)
    den = jnp.sum(e1, -1, keepdims=True) + jnp.sum(e2, -1, keepdims=True)
    out = jnp.einsum("btgrs,bsgd->btgrd", e1.astype(v1.dtype), v1, preferred_element_type=jnp.float32) + jnp.einsum(
        "btgrc,btcgd->btgrd", e2.astype(v2.dtype), v2, preferred_element_type=jnp.float32
    )
    return (out / den).reshape(b, t, nh * hd).astype(q.dtype)


class EagleDrafter(nnx.Module):
    """Eagle3-style drafter weights and their forward functions (see the module doc).

    Args:
      cfg: :class:`DrafterConfig` with ``variant="eagle3"`` and ``num_layers=1``.
      rngs: ``nnx.Rngs`` for initialisation.
      dtype: parameter and compute dtype.
    Raises:
      ValueError: ``cfg`` is not an eagle3 config.
    """

    def __init__(self, cfg: DrafterConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        if cfg.variant != "eagle3":
            raise ValueError(f"EagleDrafter needs variant='eagle3', got {cfg.variant!r}")
        self.cfg = cfg
        self.dtype = dtype
        d = cfg.hidden_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def w(*shape):
            fn = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
            return nnx.Param(fn(rngs.params(), shape, dtype))

        self.fc = w(len(cfg.taps) * cfg.hidden_size, d)
        self.emb_norm = nnx.Param(jnp.ones((d,), dtype))
        self.hid_norm = nnx.Param(jnp.ones((d,), dtype))
        self.wq, self.wk, self.wv = w(2 * d, qd), w(2 * d, kd), w(2 * d, kd)
        # Residual branches start at zero: the untrained drafter passes its input feature through.
        self.wo = nnx.Param(jnp.zeros((qd, d), dtype))
        self.mlp_norm = nnx.Param(jnp.ones((d,), dtype))
        self.w_gate, self.w_up = w(d, cfg.intermediate_size), w(d, cfg.intermediate_size)
        self.w_down = nnx.Param(jnp.zeros((cfg.intermediate_size, d), dtype))
        self.final_norm = nnx.Param(jnp.ones((d,), dtype))
        # Export metadata of the Drafter protocol: no confidence head (never calibrated) and
        # the full vocabulary (no draft vocabulary).
        self.calibration: tuple[float, ...] | None = None
        self.calibration_greedy: tuple[float, ...] | None = None
        self.calibration_bias: tuple[float, ...] | None = None
        self.calibration_greedy_bias: tuple[float, ...] | None = None
        self.draft_vocab: tuple[int, ...] | None = None

    # -- layer pieces --------------------------------------------------------------------

    def fuse(self, features: jax.Array) -> jax.Array:
        """``[B, T, n_taps * H]`` tapped target states -> ``[B, T, d]`` fused features ``g``."""
        return features.astype(self.dtype) @ self.fc[...]

    def _qkv(self, hid: jax.Array, emb: jax.Array, positions: jax.Array):
        """Layer input pair ``[B, T, d]`` x2 -> q ``[B, T, nh, hd]``, k / v ``[B, T, kvh, hd]`` (RoPE'd)."""
        c = self.cfg
        b, t, _ = hid.shape
        x = jnp.concatenate(
            [
                rms_norm(emb.astype(self.dtype), self.emb_norm[...], c.rms_eps),
                rms_norm(hid, self.hid_norm[...], c.rms_eps),
            ],
            axis=-1,
        )
        q = (x @ self.wq[...]).reshape(b, t, c.num_heads, c.head_dim)
        k = (x @ self.wk[...]).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = (x @ self.wv[...]).reshape(b, t, c.num_kv_heads, c.head_dim)
        rope = lambda y: apply_rope(y, positions, c.rope_theta, c.rope_scaling)
        return rope(q), rope(k), v

    def _finish(self, hid: jax.Array, attn: jax.Array) -> jax.Array:
        """Residual from the input feature, attention output, SwiGLU MLP -> ``a`` ``[B, T, d]``."""
        h = hid + attn @ self.wo[...]
        return h + swiglu(
            rms_norm(h, self.mlp_norm[...], self.cfg.rms_eps), self.w_gate[...], self.w_up[...], self.w_down[...]
        )

    def base_logits(self, target: Target, h: jax.Array) -> jax.Array:
        """Final-normed ``[..., d]`` -> ``[..., V]`` float32 via the target's frozen LM head, soft-capped
        as the target's logits are (:meth:`~dspark_jax.models.target.Target.cap_logits`)."""
        w = jax.lax.stop_gradient(target.lm_head_weight())
        return target.cap_logits(jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32))

    def _normed(self, a: jax.Array) -> jax.Array:
        return rms_norm(a, self.final_norm[...], self.cfg.rms_eps)

    # -- export metadata -----------------------------------------------------------------

    def set_calibration(self, temperatures, greedy: bool = False, bias=None) -> None:
        """Only ``None`` is accepted (there is no confidence head to calibrate).

        Raises:
          ValueError: temperatures given.
        """
        if temperatures is not None or bias is not None:
            raise ValueError("this drafter has no confidence head to calibrate")

    def set_draft_vocab(self, ids) -> None:
        """Always refused: the eagle3 drafter drafts over the full vocabulary.

        Raises:
          ValueError: always.
        """
        raise ValueError("the eagle3 drafter drafts over the full vocabulary (draft_vocab_size=0)")

    def prepare_decoding(self, target: Target) -> None:
        """A no-op: without a draft vocabulary the full LM head is read in place (nothing to cache)."""

    def release_decoding(self) -> None:
        """A no-op (:meth:`prepare_decoding` installs nothing)."""

    # -- decoding --------------------------------------------------------------------------

    def init_cache(self, batch: int, length: int) -> EagleCache:
        """Empty :class:`EagleCache` of ``length`` positions."""
        c = self.cfg
        kv = jnp.zeros((batch, length, c.num_kv_heads, c.head_dim), self.dtype)
        return EagleCache(kv, kv, jnp.zeros((batch, length, c.hidden_size), self.dtype))

    def extend_cache(
        self,
        cache: EagleCache,
        features: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> EagleCache:
        """Writes verified context: fused features and the K/V of ``[emb(x_t) ; g_{t-1}]``.

        Args:
          cache: :class:`EagleCache`.
          features: ``[B, T, n_taps * H]`` target features at ``positions``.
          positions: ``[B, T]`` int32 absolute positions (``-1`` / out of range: dropped).
          target: the target (its token embedding).
          tokens: ``[B, T]`` int32 tokens at ``positions``.
        Raises:
          ValueError: ``target`` or ``tokens`` missing.
        """
        if target is None or tokens is None:
            raise ValueError("the eagle3 drafter's cache needs the target and the tokens at the new positions")
        feat = cache_write(cache.feat, self.fuse(features), positions)
        prev = positions - 1
        # g_{t-1}, read after the write so a window's own earlier positions are visible; g_{-1} = 0.
        u = jnp.take_along_axis(feat, jnp.clip(prev, 0, cache.length - 1)[..., None], axis=1)
        u = jnp.where((prev >= 0)[..., None], u, 0.0)
        _, k, v = self._qkv(u, target.embed_tokens(jnp.maximum(tokens, 0)), positions)
        return EagleCache(kv_cache_write(cache.k, k, positions), kv_cache_write(cache.v, v, positions), feat)

    def write_context(
        self,
        cache: EagleCache,
        features: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        *,
        target: Target | None = None,
        tokens: jax.Array | None = None,
    ) -> EagleCache:
        """:meth:`extend_cache` for ``K`` packed tokens of any rows.

        Args:
          cache: :class:`EagleCache`.
          features: ``[K, n_taps * H]`` target features of the tokens.
          rows / positions: ``[K]`` int32 cache row and absolute position of each token
            (``positions < 0``: padding, nothing written).
          target: the target (its token embedding).
          tokens: ``[K]`` int32 the tokens.
        Raises:
          ValueError: ``target`` or ``tokens`` missing.
        """
        if target is None or tokens is None:
            raise ValueError("the eagle3 drafter's cache needs the target and the tokens at the new positions")
        wpos = jnp.where(positions >= 0, positions, cache.length)  # out of range: dropped writes
        feat = cache.feat.at[rows, wpos].set(self.fuse(features).astype(cache.feat.dtype), mode="drop")
        prev = positions - 1
        # g_{t-1}, read after the write (as extend_cache); g_{-1} = 0.
        u = jnp.where((prev >= 0)[:, None], feat[rows, jnp.clip(prev, 0, cache.length - 1)], 0.0)
        emb = target.embed_tokens(jnp.maximum(tokens, 0))
        _, k, v = self._qkv(u[None], emb[None], jnp.maximum(positions, 0)[None])
        return EagleCache(kv_scatter(cache.k, (rows, wpos), k[0]), kv_scatter(cache.v, (rows, wpos), v[0]), feat)

    def draft(
        self,
        target: Target,
        anchors: jax.Array,
        anchor_pos: jax.Array,
        cache: EagleCache,
        keys: jax.Array,
        sampling: SamplingArrays,
        step_keys: jax.Array | None = None,
    ) -> Draft:
        """Drafts ``block_size`` tokens autoregressively (one decoder-layer step per token).

        Step ``k`` (position ``P + k - 1``) reads ``[emb(x_{k-1}) ; u]`` with ``u = g_{P-1}``
        at ``k = 1`` and the previous step's output after, attends to the cached context
        (positions ``< P``) and to this draft's earlier steps, and samples ``x_k`` from
        ``q_k = process_logits(U_k, sampling)``.

        Args:
          target: the frozen target (embedding and LM head).
          anchors: ``[B]`` int32 last confirmed token x_0.
          anchor_pos: ``[B]`` int32 its position P (context = cache positions < P).
          cache: :class:`EagleCache` filled by :meth:`extend_cache`.
          keys: ``[B, 2]`` uint32 per-row keys; step k uses ``fold_in(key, k)``
            (as :func:`dspark_jax.drafters.markov.sample_block` for block drafters).
          sampling: per-row temperature / top-k / top-p.
          step_keys: optional ``[B, block_size, 2]`` per-position keys replacing ``keys``.
        Returns:
          :class:`~dspark_jax.drafters.base.Draft` (``tokens [B, block_size]``, ``probs [B, block_size, V]``,
          confidence 1, confidence logit ``+inf``).
        """
        c = self.cfg
        g = c.block_size
        b = anchors.shape[0]
        if step_keys is None:
            step_keys = jax.vmap(lambda k: jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, k), out_axes=1)(
                jnp.arange(g, dtype=jnp.uint32)
            )
        step_keys = jnp.swapaxes(step_keys, 0, 1)  # [g, B, 2]
        slots = jnp.arange(cache.length, dtype=jnp.int32)
        m1 = (slots[None, :] < anchor_pos[:, None])[:, None, :]  # [B, 1, S]
        prev = anchor_pos - 1
        u0 = jnp.take_along_axis(cache.feat, jnp.clip(prev, 0, cache.length - 1)[:, None, None], axis=1)
        u0 = jnp.where((prev >= 0)[:, None, None], u0, 0.0)  # [B, 1, d]
        chain = jnp.zeros((b, 1, g, c.num_kv_heads, c.head_dim), self.dtype)
        steps = jnp.arange(g, dtype=jnp.int32)

        def step(carry, xs):
            u, x_prev, ck, cv = carry
            k_idx, kk = xs
            pos = (anchor_pos + k_idx)[:, None]
            q, kn, vn = self._qkv(u, target.embed_tokens(x_prev)[:, None], pos)
            ck = jax.lax.dynamic_update_slice_in_dim(ck, kn[:, :, None], k_idx, axis=2)
            cv = jax.lax.dynamic_update_slice_in_dim(cv, vn[:, :, None], k_idx, axis=2)
            m2 = jnp.broadcast_to((steps <= k_idx)[None, None, :], (b, 1, g))
            a = self._finish(u, _attend(q, cache.k, cache.v, m1, ck, cv, m2))
            probs = process_logits(self.base_logits(target, self._normed(a))[:, 0], sampling)
            x = jax.vmap(sample)(kk, probs).astype(jnp.int32)
            return (a, x, ck, cv), (x, probs)

        init = (u0, anchors.astype(jnp.int32), chain, chain)
        _, (tokens, probs) = jax.lax.scan(step, init, (steps, step_keys))
        tokens, probs = jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(probs, 0, 1)
        inf = jnp.full((b, g), jnp.inf, jnp.float32)
        return Draft(tokens, probs, jnp.ones((b, g), jnp.float32), inf)

    # -- training (training-time test) -------------------------------------------------------

    def train_blocks(
        self, target: Target, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *, remat: bool = False
    ) -> BlockOutput:
        """Training-time-test unroll over ``block_size`` steps; blocks gathered at ``anchors``.

        Args:
          features: ``[B, L, n_taps * H]`` tapped target states of the sequence.
          tokens: ``[B, L]`` int32 sequence.
          anchors: ``[B, A]`` int32 anchor positions P; block position k (1-based) is the
            step-k output at position ``P + k - 1`` (predicting token ``P + k``).
          remat: accepted as every drafter's; not used: the one layer's activations are small
            next to the vocabulary-sized loss head, which the trainer rematerialises itself.
        Returns:
          :class:`BlockOutput` with ``hidden [B, A, block_size, d]`` (final-normed) and
          ``logits [B, A, block_size, V]`` float32.
        """
        c = self.cfg
        b, L = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (b, L))
        emb = target.embed_tokens(tokens).astype(self.dtype)
        qi = jnp.arange(L, dtype=jnp.int32)
        u = _shift(self.fuse(features), 1)  # g_{t-1}, g_{-1} = 0
        q, k, v = self._qkv(u, emb, pos)
        a = self._finish(u, attention(q, k, v, jnp.broadcast_to(qi[None, :] <= qi[:, None], (b, L, L))))
        outs, ks, vs = [a], [k], [v]
        for step in range(2, c.block_size + 1):
            u = _shift(a, 1)  # the drafter's own a_{t-1}
            q, kn, vn = self._qkv(u, emb, pos)
            ks.append(kn)
            vs.append(vn)
            # Chain anchored at P = t - step + 1: context keys at positions <= P, then the chain's
            # own step-j keys at position P + j - 1 = t - (step - j), j = 2..step.
            m1 = (qi[None, :] <= (qi - step + 1)[:, None])[None]
            k2 = jnp.stack([_shift(ks[j - 1], step - j) for j in range(2, step + 1)], axis=2)
            v2 = jnp.stack([_shift(vs[j - 1], step - j) for j in range(2, step + 1)], axis=2)
            m2 = jnp.stack([qi >= step - j for j in range(2, step + 1)], axis=-1)[None]
            a = self._finish(u, _attend(q, k, v, m1, k2, v2, m2))
            outs.append(a)
        hs = jnp.stack(outs, axis=2)  # [B, L, block_size, d]
        src = jnp.minimum(anchors[..., None] + jnp.arange(c.block_size, dtype=jnp.int32), L - 1)  # [B, A, block_size]
        h = hs[jnp.arange(b)[:, None, None], src, jnp.arange(c.block_size)]
        h = self._normed(h)
        return BlockOutput(h, self.base_logits(target, h))
