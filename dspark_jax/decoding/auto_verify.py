"""Automatic verification length at batch 1: ``num_speculative_tokens="auto"``.

DSpark's scheduler idea (docs/design.md#scheduler: maximise ``Theta = tau * SPS``) applied to
single-request decoding, where on hardware like a 2-core CPU a verification pass of ``l + 1``
tokens is not free (a 9-token pass costs about two plain steps) and a drafting round is not
free either. Per round, from the drafter's calibrated confidences ``c_k`` and a measured
:class:`~dspark_jax.decoding.cost_table.CostTable`:

* the verification length is chosen among a few compiled widths ``0 = w_0 < w_1 < ...``
  (``0`` = a plain step, the drafts discarded) by extending while the expected tokens per
  second ``(1 + sum_{j<=l} a_j) / T_verify(l)`` grows, with ``a_j = prod_{i<=j} c_i``;
* whether the *next* round drafts at all compares the best expected rate with drafting,
  ``max_l (1 + sum_{j<=l} a_j) / (T_draft + T_verify(l))``, against a plain step's
  ``1 / T_step`` (this round's confidences predict the next round's); while not drafting,
  every ``probe_every``-th round drafts anyway to refresh the prediction.

Non-anticipation (docs/design.md#non-anticipation): whether draft position ``k`` is verified must
not depend on the value of ``x_k``. ``c_j`` depends on ``x_{j-1}`` (through the Markov
embedding), so the extension from ``w_i`` to ``w_{i+1}`` is decided from ``a_{w_i + 1}``
and ``c_{w_i + 1}`` only (the gain of the chunk is estimated as a geometric series with
ratio ``c_{w_i + 1}``): that depends on ``x_1 .. x_{w_i}``, all of which are already going
to be verified, and never on a token of the chunk itself. Each chunk is then verified
whole. The stopping rule is thus a stopping time of the draft sequence and the output law
is exactly the target's (tested in tests/unit/test_decode.py).

Everything here is traced inside the decode loop (pure ``jnp``; widths are static);
:func:`auto_round` is one such round of :mod:`dspark_jax.decoding.speculative`'s loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.round import RoundInputs, VerifiedRound, commit_round, draft_tokens, verify_block
from dspark_jax.drafters.base import Draft
from dspark_jax.models.sampling import SamplingArrays

__all__ = ["AutoState", "auto_round", "choose_width", "default_widths", "init_auto_state", "should_draft"]


def default_widths(block_size: int) -> tuple[int, ...]:
    """Compiled verification widths for a drafter with ``block_size`` draft tokens per round:
    0 (plain step), then powers of two, then the block size (e.g. 8 -> ``(0, 1, 2, 4, 8)``)."""
    ws = {0, block_size}
    w = 1
    while w < block_size:
        ws.add(w)
        w *= 2
    return tuple(sorted(ws))


def _chunk_gain(a: jax.Array, c: jax.Array, lo: int, hi: int) -> jax.Array:
    """Expected accepted drafts at positions ``lo+1 .. hi`` (1-based) estimated from
    ``a_{lo+1}`` and ``c_{lo+1}`` only: ``a_{lo+1} * sum_{m < hi-lo} c_{lo+1}^m``.

    ``a, c``: ``[B, G]`` survival and conditional confidences; returns ``[B]``.
    """
    a1, c1 = a[:, lo], c[:, lo]
    m = jnp.arange(hi - lo, dtype=jnp.float32)
    return a1 * jnp.sum(c1[:, None] ** m[None, :], axis=-1)


def choose_width(conf: jax.Array, running: jax.Array, widths: Sequence[int], t_verify: jax.Array) -> jax.Array:
    """Index into ``widths`` of this round's verification width (non-anticipating greedy).

    Args:
      conf: ``[B, G]`` float32 calibrated confidences ``c_k`` of the round's drafts.
      running: ``[B]`` bool rows still decoding (the others do not count).
      widths: static ascending widths starting at 0, each ``<= G``.
      t_verify: ``[len(widths)]`` float32 seconds of a verification pass of ``w + 1`` tokens.
    Returns:
      ``[]`` int32 index ``i``; the batch verifies ``widths[i]`` drafts per row.
    """
    conf = jnp.clip(conf.astype(jnp.float32), 0.0, 1.0)
    run = running.astype(jnp.float32)
    a = jnp.cumprod(conf, axis=1)
    n = jnp.sum(run)
    idx = jnp.zeros((), jnp.int32)
    go = jnp.ones((), bool)
    expected = n  # expected emitted tokens at the current width: one per row + accepted drafts
    for i in range(1, len(widths)):
        lo, hi = widths[i - 1], widths[i]
        cand = expected + jnp.sum(run * _chunk_gain(a, conf, lo, hi))
        go = go & (cand * t_verify[i - 1] > expected * t_verify[i])  # rate grows: cand/T_i > exp/T_{i-1}
        idx = jnp.where(go, i, idx)
        # Once the chunk is admitted its positions' survivals are known exactly (they depend only
        # on tokens that are now all verified).
        expected = jnp.where(go, expected + jnp.sum(run * jnp.sum(a[:, lo:hi], axis=1)), expected)
    return idx


def should_draft(
    conf: jax.Array, running: jax.Array, widths: Sequence[int], t_verify: jax.Array, t_draft: jax.Array
) -> jax.Array:
    """Whether drafting pays next round, predicted from this round's confidences.

    Compares ``max_w (n + sum_r sum_{j<=w} a_{r,j}) / (T_draft + T_verify(w))`` over the
    widths ``w >= 1`` with a plain step's ``n / T_verify(0)``. Any function of past rounds
    keeps the output law (it only decides whether to draft, not what is verified).

    Args:
      conf / running / widths / t_verify: as in :func:`choose_width`.
      t_draft: ``[]`` float32 seconds of one drafting round.
    Returns:
      ``[]`` bool.
    """
    a = jnp.cumprod(jnp.clip(conf.astype(jnp.float32), 0.0, 1.0), axis=1)
    run = running.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(run), 1.0)
    plain = n / t_verify[0]
    best = jnp.zeros((), jnp.float32)
    for i in range(1, len(widths)):
        tokens = n + jnp.sum(run * jnp.sum(a[:, : widths[i]], axis=1))
        best = jnp.maximum(best, tokens / (t_draft + t_verify[i]))
    return best > plain


class AutoState(NamedTuple):
    """Loop state of ``num_speculative_tokens="auto"`` (scalars shared by the batch).

    Attributes:
      draft_on: ``[]`` bool: this round drafts.
      idle: ``[]`` int32 rounds since the last drafting round.
      width: ``[]`` int32 index into the widths of the width verified last round (statistics).
    """

    draft_on: jax.Array
    idle: jax.Array
    width: jax.Array


def init_auto_state() -> AutoState:
    """The first round drafts."""
    return AutoState(jnp.ones((), bool), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def auto_round(
    target,
    drafter,
    state: AutoState,
    tcache,
    dcache,
    r: RoundInputs,
    sampling: SamplingArrays,
    costs: tuple[jax.Array, jax.Array],
    *,
    widths: Sequence[int],
    probe_every: int,
) -> tuple[VerifiedRound, jax.Array, jax.Array, AutoState]:
    """One round with an automatic verification width (module docstring).

    Drafts (under ``lax.cond``, only when ``state.draft_on``), chooses the width from the
    confidences (:func:`choose_width`), verifies with that width's compiled pass
    (``lax.switch``), and decides whether the next round drafts (:func:`should_draft`).

    Args:
      state: :class:`AutoState`. tcache / dcache: the target's KV cache and the drafter's context cache.
      r: :class:`~dspark_jax.decoding.round.RoundInputs` of the round.
      costs: ``(t_verify [len(widths)], t_draft [])`` float32 seconds.
      widths: static ascending widths from 0.
      probe_every: while not drafting, draft anyway every this many rounds.
    Returns:
      ``(verified round, num_verify [B] int32, raw confidence logits [B, G], next AutoState)``.
    """
    t_verify, t_draft = costs
    b = r.anchor.shape[0]
    block_size = drafter.cfg.block_size
    v = drafter.cfg.vocab_size

    def drafted(_):
        return draft_tokens(target, drafter, r.anchor, r.anchor_pos, dcache, r.draft_keys, sampling)

    def skipped(_):
        z = jnp.zeros((b, block_size), jnp.float32)
        return Draft(jnp.zeros((b, block_size), jnp.int32), jnp.zeros((b, block_size, v), jnp.float32), z, z)

    d = jax.lax.cond(state.draft_on, drafted, skipped, None)
    # Width from confidences only, chunk by chunk (non-anticipating, module docstring).
    wi = jnp.where(state.draft_on, choose_width(d.confidence, r.running, widths, t_verify), 0)
    ell = jnp.where(r.running, jnp.clip(jnp.minimum(jnp.asarray(widths, jnp.int32)[wi], r.room), 0, block_size), 0)
    taps = drafter.cfg.taps
    # The branches only read the caches, which are written once after the switch: a branch that
    # wrote them would make XLA copy both caches into it every round.
    branches = [partial(verify_block, target, width=w, block_size=block_size, taps=taps) for w in widths]
    pending = jax.lax.switch(wi, branches, tcache, r, d, ell, sampling)
    res = commit_round(target, drafter, tcache, dcache, r.running, pending)
    pays = should_draft(d.confidence, r.running, widths, t_verify, t_draft)
    idle = jnp.where(state.draft_on, 0, state.idle + 1)
    draft_next = jnp.where(state.draft_on, pays, idle >= probe_every)
    return res, ell, d.confidence_logit, AutoState(draft_next, idle, wi)
