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
  ``1 / T_step``, with the acceptances forecast from the request's observed rates, shrunk towards
  this round's confidences (:func:`forecast_acceptance`); while not drafting, every
  ``probe_every``-th round drafts anyway to refresh the forecast (a probe that does not pay
  doubles that wait, up to ``PROBE_BACKOFF_MAX`` times; no wait is shorter than the
  :func:`probe_floor` that keeps probes under ``PROBE_BUDGET`` of the time; a request's first round drafts
  only if a good drafter would pay at these prices, :func:`first_round_drafts`), and drafting also stops when the
  drafting rounds so far delivered fewer tokens per priced second than plain steps
  (:func:`realized_pays`);
* the confidences are first corrected by what this request has shown so far
  (:func:`corrected_confidence`): per position, the observed over the predicted acceptances of
  the verified drafts, discounted by ``ACCEPTANCE_DECAY`` per drafting round and shrunk towards
  the pooled ratio of all positions, itself shrunk to 1, by a prior of ``ACCEPTANCE_PRIOR``
  accepted tokens. A drafter calibrated on other prompts can be confident on a prompt it mostly
  gets wrong (a HumanEval prompt at tau 1.09 with 2 drafts had ``auto`` verify 8 in every round);
  temperature scaling alone cannot bring a positive logit below 1/2, the ratio can.

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

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.round import RoundCaches, RoundInputs, VerifiedRound, draft_tokens, verify_at_width
from dspark_jax.drafters.base import Draft
from dspark_jax.models.sampling import SamplingArrays

__all__ = [
    "ACCEPTANCE_DECAY",
    "ACCEPTANCE_PRIOR",
    "FIRST_ROUND_ACCEPTANCE",
    "FORECAST_PRIOR",
    "PROBE_BACKOFF_MAX",
    "PROBE_BUDGET",
    "REALIZED_DECAY",
    "REALIZED_MIN_ROUNDS",
    "AutoState",
    "AutoWidths",
    "acceptance_ratio",
    "auto_round",
    "choose_width",
    "corrected_confidence",
    "default_widths",
    "first_round_drafts",
    "forecast_acceptance",
    "init_auto_state",
    "observe_acceptance",
    "reached_and_accepted",
    "realized_pays",
    "schedule",
    "should_draft",
]

ACCEPTANCE_PRIOR = 8.0  # [accepted tokens] pseudo-observations at ratio 1 per position
FORECAST_PRIOR = 16.0  # [observations] weight of this round's confidences in the next round's forecast
ACCEPTANCE_DECAY = 0.98  # per drafting round: older rounds fade (half-life ~34 drafting rounds)
REALIZED_DECAY = 0.8  # per drafting round, of the realized rate's sums (half-life ~3 drafting rounds)
REALIZED_MIN_ROUNDS = 2.0  # [drafting rounds] (decayed) before the realized rate can stop drafting
PROBE_BACKOFF_MAX = 16  # a probe that does not pay doubles the wait, up to this many times probe_every
PROBE_BUDGET = 0.02  # probes' drafting, at most this share of the plain steps' time between them
FIRST_ROUND_ACCEPTANCE = 0.7  # per draft position (tau 3.2 at 8 drafts): the first round drafts if that pays


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


@partial(jax.tree_util.register_dataclass, data_fields=["t_verify", "t_draft"], meta_fields=["widths", "probe_every"])
@dataclasses.dataclass(frozen=True)
class AutoWidths:
    """What ``num_speculative_tokens="auto"`` verifies with (:func:`auto_round`).

    A pytree: the widths and the probe interval are static (each set compiles its own loop), the
    costs are traced (new costs reuse the compiled loop).

    Attributes:
      widths: ascending verification widths from 0 (static).
      t_verify: ``[len(widths)]`` float32 seconds of a round verifying each width.
      t_draft: ``[]`` float32 seconds of drafting one block.
      probe_every: while not drafting, draft anyway after this many rounds (static).
    """

    widths: tuple[int, ...]
    t_verify: jax.Array
    t_draft: jax.Array
    probe_every: int = 8


class AutoState(NamedTuple):
    """Loop state of ``num_speculative_tokens="auto"``.

    Attributes:
      draft_on: ``[]`` bool: this round drafts (shared by the batch).
      idle: ``[]`` int32 rounds since the last drafting round.
      wait: ``[]`` int32 rounds without drafts before the next probe: ``probe_every``, doubled by
        every probe that does not pay (up to ``PROBE_BACKOFF_MAX`` times), reset when one does.
      width: ``[]`` int32 index into the widths of the width verified last round (statistics).
      hits: ``[B, G]`` float32 discounted count of accepted drafts per position, among the
        verified drafts that verification reached (the conditional acceptances).
      predicted: ``[B, G]`` float32 discounted sum of their calibrated confidences ``c_k``.
      seen: ``[B, G]`` float32 discounted count of those drafts (observations).
      gain / spent / rounds: ``[]`` float32 discounted sums, over drafting rounds, of the tokens
        the running rows emitted, of their priced seconds (``T_draft + T_verify(w)`` a row) and of
        the rounds (:func:`realized_pays`).
    """

    draft_on: jax.Array
    idle: jax.Array
    wait: jax.Array
    width: jax.Array
    hits: jax.Array
    predicted: jax.Array
    seen: jax.Array
    gain: jax.Array
    spent: jax.Array
    rounds: jax.Array


def init_auto_state(
    batch: int,
    block_size: int,
    probe_every: int = 8,
    draft_first: jax.Array | bool = True,
    min_wait: jax.Array | int = 0,
) -> AutoState:
    """A request's first state: no acceptance observed yet (ratio 1). The first round drafts if
    ``draft_first`` (:func:`first_round_drafts`); else the first probe waits ``max(probe_every, min_wait)``
    rounds (``min_wait``: :func:`probe_floor`), as after a probe that did not pay."""
    z = jnp.zeros((batch, block_size), jnp.float32)
    f = jnp.zeros((), jnp.float32)
    i = jnp.zeros((), jnp.int32)
    first = jnp.asarray(draft_first, bool)
    wait = jnp.where(first, probe_every, jnp.maximum(probe_every, min_wait)).astype(jnp.int32)
    return AutoState(first, i, wait, i, z, z, z, f, f, f)


def first_round_drafts(auto: AutoWidths, block_size: int) -> jax.Array:
    """Whether a request's first round drafts: :func:`should_draft` with every draft position
    accepted at :data:`FIRST_ROUND_ACCEPTANCE` (a good drafter's rate; nothing is observed yet).

    A drafting round whose price no plausible acceptance repays (on a CPU, a tiny target's block
    costs several plain steps) is then not spent on the first round of every request: its first
    probe waits like any probe (:func:`init_auto_state`). ``[]`` bool.
    """
    conf = jnp.full((1, block_size), FIRST_ROUND_ACCEPTANCE, jnp.float32)
    return should_draft(conf, jnp.ones((1,), bool), auto.widths, auto.t_verify, auto.t_draft)


def realized_pays(gain, spent, rounds, t_step, min_rounds: float = REALIZED_MIN_ROUNDS):
    """Whether the drafting rounds so far emitted tokens faster than plain steps would have:
    ``gain / spent >= 1 / t_step`` (tokens over priced seconds, discounted by ``REALIZED_DECAY`` a
    drafting round), or fewer than ``min_rounds`` (discounted) drafting rounds observed yet.

    The per-position forecast (:func:`forecast_acceptance`) prices the deep positions, which
    verification seldom reaches, by the drafter's own confidences; this rate is what drafting
    actually delivered at the widths chosen. ``[]`` float32 arguments; returns ``[]`` bool.
    """
    return (rounds < min_rounds) | (gain * t_step >= spent)


def corrected_confidence(conf: jax.Array, state: AutoState, prior: float = ACCEPTANCE_PRIOR) -> jax.Array:
    """``[B, G]`` confidences ``c_k * rho_k``, clipped to [0, 1], where

        rho = (H + prior) / (P + prior),   rho_k = (hits_k + prior * rho) / (predicted_k + prior)

    (``H``, ``P``: the row's sums over the positions). ``rho_k`` is this request's observed over
    predicted conditional acceptance at position ``k`` so far (:func:`observe_acceptance`), shrunk
    towards the row's pooled ratio ``rho``, itself shrunk towards 1: deep positions, which
    verification seldom reaches, follow what the first ones show. It depends on past rounds only,
    so a width chosen from the corrected confidences is still a stopping time of the draft sequence.
    """
    return jnp.clip(conf.astype(jnp.float32) * acceptance_ratio(state.hits, state.predicted, prior), 0.0, 1.0)


def acceptance_ratio(hits, predicted, prior: float = ACCEPTANCE_PRIOR):
    """``[..., G]`` observed over predicted acceptance per block position, shrunk:
    ``rho_k = (hits_k + prior * rho) / (predicted_k + prior)`` with the pooled
    ``rho = (H + prior) / (P + prior)`` (``H``, ``P``: sums over the last axis), itself shrunk to 1.

    ``hits`` / ``predicted``: ``[..., G]`` (weighted) counts of accepted drafts and sums of their
    predicted confidences over the same observations. NumPy or JAX arrays (the serving engine's
    :class:`~dspark_jax.serving.engine.online_calibration.OnlineCalibrator` uses it on the host,
    :func:`corrected_confidence` inside the decode loop)."""
    pooled = (hits.sum(axis=-1, keepdims=True) + prior) / (predicted.sum(axis=-1, keepdims=True) + prior)
    return (hits + prior * pooled) / (predicted + prior)


def reached_and_accepted(k, num_verify, num_accepted):
    """Which draft positions a verification round observed: position ``k`` (1-based) was reached
    iff ``k <= num_verify`` and ``k <= num_accepted + 1``, and accepted iff ``k <= num_accepted``.
    Broadcasting NumPy or JAX arrays (batch-1 ``auto``'s :func:`observe_acceptance`, the serving
    engine's online calibration and per-request counts); returns ``(reached, accepted)`` bool."""
    return (k <= num_verify) & (k <= num_accepted + 1), k <= num_accepted


def observe_acceptance(
    state: AutoState,
    conf: jax.Array,
    num_verify: jax.Array,
    num_accepted: jax.Array,
    running: jax.Array,
    decay: float = ACCEPTANCE_DECAY,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The next ``(hits, predicted, seen)`` after a round (each ``[B, G]`` float32).

    Draft position ``k`` (1-based) of a running row is an observation iff ``k <= num_verify``
    and ``k <= num_accepted + 1`` (verification reached it); its label is ``k <= num_accepted``
    and its prediction the calibrated ``conf[:, k - 1]`` (uncorrected). A row that verified
    drafts first multiplies its sums by ``decay``; rounds without drafts leave them as they are,
    so a request that stopped drafting remembers why.

    Args:
      conf: ``[B, G]`` calibrated confidences of the round's drafts.
      num_verify / num_accepted: ``[B]`` int32 drafts verified and accepted this round.
      running: ``[B]`` bool.
    """
    k = jnp.arange(1, conf.shape[1] + 1, dtype=jnp.int32)[None, :]
    reached, accepted = reached_and_accepted(k, num_verify[:, None], num_accepted[:, None])
    seen = reached & running[:, None]
    hit = seen & accepted
    keep = jnp.where(running & (num_verify > 0), decay, 1.0)[:, None]
    hits = keep * state.hits + hit.astype(jnp.float32)
    predicted = keep * state.predicted + jnp.where(seen, conf.astype(jnp.float32), 0.0)
    return hits, predicted, keep * state.seen + seen.astype(jnp.float32)


def forecast_acceptance(conf, hits, seen, prior: float = FORECAST_PRIOR):
    """``[..., G]`` conditional acceptances expected of the *next* round: per position the request's
    observed rate ``(hits_k + prior * conf_k) / (seen_k + prior)``, shrunk towards its latest
    corrected confidence ``conf_k`` by ``prior`` observations.

    One round's confidences alone are a noisy forecast of the next round's (a hard token stops
    drafting for ``probe_every`` rounds); the observed rate is not, once there are observations.
    ``hits`` / ``seen``: the request's decayed counts (:class:`AutoState`; the serving engine's
    :meth:`~dspark_jax.serving.engine.slots.SlotRecord.observe_round`). NumPy or JAX arrays.
    """
    return (hits + prior * conf) / (seen + prior)


def probe_floor(t_draft, t_step) -> jax.Array:
    """The fewest rounds without drafts between two probes, ``ceil(T_draft / (PROBE_BUDGET * T_step))``
    (``[]`` int32, capped at 2^20): a probe that does not pay costs about one drafting round more than
    the plain step it replaces, so on a target whose drafting round costs several plain steps (a tiny
    model on a CPU) the probes stay under :data:`PROBE_BUDGET` of plain decoding's time.

    Args:
      t_draft / t_step: ``[]`` float32 seconds of a drafting round and of a plain step.
    """
    rounds = jnp.ceil(t_draft / (PROBE_BUDGET * jnp.maximum(t_step, 1e-9)))
    return jnp.clip(rounds, 0, 2**20).astype(jnp.int32)


def schedule(
    state: AutoState, pays, emitted, price, t_step, probe_every: int, min_wait: jax.Array | int = 0
) -> AutoState:
    """``state`` after a round, as to drafting: whether the next round drafts, the idle count, the
    probes' wait (:class:`AutoState`) and the realized rate's sums.

    Args:
      state: the round's state (``draft_on``: it drafted).
      pays: ``[]`` bool :func:`should_draft` of the forecast (read only after a drafting round).
      emitted: ``[]`` tokens the running rows emitted this round. price: ``[]`` seconds it was
        priced at (``T_draft + T_verify(w)`` a running row). t_step: ``[]`` seconds of a plain step.
      probe_every: the probes' first wait [rounds].
      min_wait: ``[]`` int32 the fewest rounds any wait lasts (:func:`probe_floor`).
    """
    on = state.draft_on
    keep = jnp.where(on, REALIZED_DECAY, 1.0)
    gain = keep * state.gain + jnp.where(on, emitted, 0.0)
    spent = keep * state.spent + jnp.where(on, price, 0.0)
    rounds = keep * state.rounds + on.astype(jnp.float32)
    pays = pays & realized_pays(gain, spent, rounds, t_step)
    idle = jnp.where(on, 0, state.idle + 1)
    # A drafting round after rounds without drafts is a probe: one that does not pay doubles the wait.
    probe = on & (state.idle > 0)
    backoff = jnp.minimum(2 * state.wait, PROBE_BACKOFF_MAX * probe_every)
    wait = jnp.maximum(jnp.where(probe & ~pays, backoff, probe_every), min_wait)
    wait = jnp.where(on, wait, state.wait)
    draft_next = jnp.where(on, pays, idle >= state.wait)
    return state._replace(draft_on=draft_next, idle=idle, wait=wait, gain=gain, spent=spent, rounds=rounds)


def auto_round(
    target,
    drafter,
    state: AutoState,
    caches: RoundCaches,
    r: RoundInputs,
    sampling: SamplingArrays,
    auto: AutoWidths,
) -> tuple[VerifiedRound, jax.Array, jax.Array, AutoState]:
    """One round with an automatic verification width (module docstring).

    Drafts (under ``lax.cond``, only when ``state.draft_on``), chooses the width from the
    corrected confidences (:func:`corrected_confidence`, :func:`choose_width`), verifies with that
    width's compiled pass (:func:`~dspark_jax.decoding.round.verify_at_width`), records the round's
    acceptances (:func:`observe_acceptance`) and decides whether the next round drafts
    (:func:`should_draft` of :func:`forecast_acceptance`).

    Args:
      state: :class:`AutoState`. caches: the target's KV cache and the drafter's context cache.
      r: :class:`~dspark_jax.decoding.round.RoundInputs` of the round.
      auto: :class:`AutoWidths`: the static ascending widths from 0 and probe interval (while not
        drafting, draft anyway after that many rounds; the wait doubles after each probe that does
        not pay: :class:`AutoState`), the costs ``t_verify [len(widths)]`` and ``t_draft []``
        float32 seconds.
    Returns:
      ``(verified round, num_verify [B] int32, raw confidence logits [B, G], next AutoState)``.
    """
    widths, probe_every = auto.widths, auto.probe_every
    t_verify, t_draft = auto.t_verify, auto.t_draft
    b = r.anchor.shape[0]
    block_size = drafter.cfg.block_size
    v = drafter.cfg.vocab_size

    def drafted(_):
        return draft_tokens(target, drafter, r.anchor, r.anchor_pos, caches.drafter, r.draft_keys, sampling)

    def skipped(_):
        z = jnp.zeros((b, block_size), jnp.float32)
        return Draft(jnp.zeros((b, block_size), jnp.int32), jnp.zeros((b, block_size, v), jnp.float32), z, z)

    d = jax.lax.cond(state.draft_on, drafted, skipped, None)
    conf = corrected_confidence(d.confidence, state)
    # Width from confidences only, chunk by chunk (non-anticipating, module docstring).
    wi = jnp.where(state.draft_on, choose_width(conf, r.running, widths, t_verify), 0)
    ell = jnp.where(r.running, jnp.clip(jnp.minimum(jnp.asarray(widths, jnp.int32)[wi], r.room), 0, block_size), 0)
    res = verify_at_width(target, drafter, caches, r, d, ell, sampling, width_index=wi, widths=tuple(widths))
    hits, predicted, seen = observe_acceptance(state, d.confidence, ell, res.num_accepted, r.running)
    after = state._replace(hits=hits, predicted=predicted, seen=seen)
    forecast = forecast_acceptance(corrected_confidence(d.confidence, after), after.hits, after.seen)
    pays = should_draft(forecast, r.running, widths, t_verify, t_draft)
    run = r.running.astype(jnp.float32)
    nxt = schedule(
        state._replace(width=wi, hits=hits, predicted=predicted, seen=seen),
        pays,
        jnp.sum(run * res.num_emitted),
        jnp.sum(run) * (t_draft + t_verify[wi]),
        t_verify[0],
        probe_every,
        probe_floor(t_draft, t_verify[0]),
    )
    return res, ell, d.confidence_logit, nxt
