"""The engine's scheduler: per step, how many drafts each row verifies, the compiled bucket the
step runs in, whether to draft the next block, and when the drafter is suspended, resumed and
caught up.

Policies (:func:`parse_policy`; docs/design.md#scheduler, paper Section 7): ``plain`` (no
drafts), ``fixed:G``, ``threshold:C``, ``greedy`` (the clean greedy Theta scheduler) and
``dspark`` (the deployed scheduler), all from :mod:`dspark_jax.serving.engine.scheduler`. The plan
is a function of host state only (confidences, lengths, the SPS table), never of draft token
values, which stay on the device: every policy is non-anticipating by construction. The SPS
table (a :class:`~dspark_jax.decoding.cost_table.CostTable`) is a function of the attention
span; every lookup is at the span the step reads (:meth:`Planner.live_span`).

Drafter suspension
------------------
A step also writes the drafter's context keys/values of every verified token (from the
target's tapped hidden states), so that drafting can resume at any step. When the policy has
not drafted for ``suspend_after`` consecutive steps (the throughput-aware policies stop
drafting when it does not pay; ``plain`` never drafts), plain steps drop that upkeep and run
the drafter-less engine's program, so a non-drafting engine costs what plain decoding costs.
The host keeps every request's confirmed tokens; when drafting resumes, a catch-up pass
re-runs the skipped tokens through the target (packed, taps on, the target cache already
holds their context) and writes their drafter context before the step, which then drafts
exactly as with continuous upkeep.
The throughput-aware policies price that catch-up (:func:`catchup_batches`) into their
decision to resume.

Probing
-------
A suspended policy has no fresh evidence: drafting stopped, so no confidence or acceptance
is observed, and a decision made on one unlucky round would last for the life of the server.
So while it does not draft, the policy *probes*: after ``probe_interval`` non-drafting steps
(``suspend_after`` at first, doubling after every probe that does not resume drafting, at
most :data:`MAX_PROBE_INTERVAL`; never stopping) and once the time spent since the last probe
is worth a drafting round (its extra seconds over a plain step, from the SPS table, at most
:data:`PROBE_BUDGET` of that time), one step drafts the next block and the following step
verifies at least one draft per row. The probe's confidences and the acceptance observed then
feed the same decision as always (forecast Theta, catch-up priced in); drafting resumes when
it pays, and the interval goes back to ``suspend_after``. A probe never changes which tokens
are emitted (verification is lossless), only where the time goes.

Planning ahead
--------------
With overlap, the engine plans and dispatches a step before the host has read the step still
in flight (:class:`Lookahead`): each row's length is then known only up to that step's
verified drafts, so its room is bounded by the most it can gain (a step never runs past a
row's end), and the block it verifies is forecast from the latest confidences the host has
read, one step older than a synchronous plan's. A plan made ahead while the drafter is
suspended cannot resume drafting (the catch-up re-runs tokens the host has not read yet): it
stays plain and sets :attr:`Planner.deferred`, and the engine plans the next step only once the
step in flight is read. Only where the time goes changes, never the tokens. It is opt-in
(:attr:`Planner.speculative_ahead`). Against planning after the read
(``benchmarks/engine_policies.py --ahead``), on 2 CPU cores: stories260K 1.47-1.66x at one slot,
SmolLM2 0.97x (fixed:2) and 1.03x (dspark), its long step slowed by the host's planning on the same
cores; on an H200 0.90-1.06x (stories260K and a SmolLM2-shaped target, 1 and 8 slots).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import cast

import numpy as np

from dspark_jax.decoding.auto_verify import forecast_acceptance
from dspark_jax.decoding.cost_table import CostTable
from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import scheduler as sch
from dspark_jax.serving.engine.online_calibration import OnlineCalibrator
from dspark_jax.serving.engine.slots import SlotRecord
from dspark_jax.serving.engine.state import PackedTokens

__all__ = [
    "MAX_PROBE_INTERVAL",
    "PROBE_BUDGET",
    "Lookahead",
    "Planner",
    "catchup_batches",
    "mark_stale",
    "parse_policy",
]

MAX_PROBE_INTERVAL = 512  # steps: the longest wait between two probes of a suspended policy
PROBE_BUDGET = 0.1  # a probe's extra seconds may be at most this share of the time since the last one

# The engine's logger: suspension / resumption lines are the engine's (tests filter on it).
_log = logging.getLogger("dspark_jax.serving.engine")


def parse_policy(policy: str, block_size: int) -> tuple[str, float | int | None]:
    """Parses a policy string.

    Args:
      policy: ``"plain"``, ``"fixed:G"`` (``1 <= G <= block_size``), ``"threshold:C"``
        (``0 <= C <= 1``), ``"greedy"`` or ``"dspark"``.
      block_size: the drafter's block size (0 without a drafter: only ``"plain"``).
    Returns:
      ``(name, argument)``.
    Raises:
      DSparkInputError: unknown policy, bad argument, or a speculative policy without drafter.
    """
    if not isinstance(policy, str):
        raise DSparkInputError(f"policy must be a string, got {policy!r}")
    name, _, arg = policy.strip().partition(":")
    name = name.lower()
    if name == "plain" and not arg:
        return "plain", None
    if name not in ("fixed", "threshold", "greedy", "dspark") or (name in ("greedy", "dspark") and arg):
        raise DSparkInputError(f"unknown policy {policy!r}: use plain, fixed:G, threshold:C, greedy or dspark")
    if block_size < 1:
        raise DSparkInputError(f"policy {policy!r} needs a drafter; without one use 'plain'")
    if name == "fixed":
        try:
            g = int(arg)
        except ValueError:
            raise DSparkInputError(f"policy {policy!r}: fixed:G needs an integer G") from None
        if not 1 <= g <= block_size:
            raise DSparkInputError(f"policy {policy!r}: G must be in [1, {block_size}] for this drafter")
        return "fixed", g
    if name == "threshold":
        try:
            c = float(arg)
        except ValueError:
            raise DSparkInputError(f"policy {policy!r}: threshold:C needs a number C") from None
        if not 0.0 <= c <= 1.0:
            raise DSparkInputError(f"policy {policy!r}: C must be in [0, 1]")
        return "threshold", c
    return name, None


def catchup_batches(records: Sequence[SlotRecord], rows: int, width: int) -> Iterator[PackedTokens]:
    """Packs the confirmed tokens whose drafter context is missing, for catch-up passes.

    Each record with ``stale_from`` set contributes positions ``[stale_from, length - 1)``
    (everything below its anchor), at most ``width`` per pass, as row ``r`` (its index).
    Yields :class:`~dspark_jax.serving.engine.state.PackedTokens` of ``rows * width`` numpy
    int32 slots and advances ``stale_from``; stops when nothing is left, then clears every
    ``stale_from``.
    """
    while True:
        tok, row, col, pos = (np.zeros(rows * width, np.int32) for _ in range(4))
        pos -= 1
        i = 0
        for r, rec in enumerate(records):
            if rec.stale_from is None:
                continue
            a = rec.stale_from
            b = min(a + width, rec.length - 1)
            k = b - a
            tok[i : i + k] = rec.tokens[a:b]
            row[i : i + k], col[i : i + k], pos[i : i + k] = r, np.arange(k), np.arange(a, b)
            i += k
            rec.stale_from = b
        if i == 0:
            break
        yield PackedTokens(tok, row, col, pos)
    for rec in records:
        rec.stale_from = None


@dataclasses.dataclass(frozen=True)
class Lookahead:
    """What a plan made before the step in flight is read knows of each row (see the module
    docstring, "Planning ahead").

    Attributes:
      advance: ``[n]`` int64 the most confirmed tokens each row gains from the step in flight
        (its verified drafts + 1; 0 for a row that joined after that step was dispatched).
      has_block: ``[n]`` bool whether the row holds a drafted block when the planned step runs
        (the step in flight drafted one; for a row that joined after it, its prefill did).
      may_draft: False when drafting would first need a catch-up (suspended drafter): a plan
        that would draft or probe is deferred instead (:attr:`Planner.deferred`).
    """

    advance: np.ndarray
    has_block: np.ndarray
    may_draft: bool = True


def mark_stale(records: Sequence[SlotRecord], advance=None) -> None:
    """Marks where each row's drafter context stops before a suspended step (one without that
    upkeep): at its anchor, ``length - 1`` (plus ``advance [n]``, the tokens each row gains from a
    step still in flight, which must then be exact), unless it already stops earlier."""
    for r, rec in enumerate(records):
        if rec.stale_from is None:
            rec.stale_from = rec.length - 1 + (0 if advance is None else int(advance[r]))


class Planner:
    """Policy state and decisions of one engine.

    Args:
      block_size: the drafter's block size (0: no drafter).
      has_drafter: whether the engine has a drafter (suspension needs one).
      ladder: packed-token budgets of speculative steps.
      row_buckets: compiled row counts (ascending, ending at ``num_slots``).
      calibrator: the engine's online confidence calibrator.
      suspend_after: see :class:`~dspark_jax.serving.engine.Engine` (None: never suspend).
      policy: the initial policy string.

    Raises:
      DSparkInputError: bad policy string.
    """

    def __init__(
        self,
        block_size: int,
        has_drafter: bool,
        ladder: Sequence[int],
        row_buckets: Sequence[int],
        calibrator: OnlineCalibrator,
        suspend_after: int | None,
        policy: str,
    ):
        self.block_size, self.has_drafter = block_size, has_drafter
        self.ladder, self.row_buckets = list(ladder), list(row_buckets)
        self.calibrator, self.suspend_after = calibrator, suspend_after
        self.sps_table: CostTable | None = None
        self.idle_steps = 0  # consecutive steps the policy chose not to draft (probes included)
        self._was_suspended = False
        self.decision: dict | None = None  # the dspark/greedy policy's last drafting decision
        self.probes = 0  # probes run (drafting rounds forced while not drafting)
        self.probe_interval = max(1, suspend_after or 16)
        self._since_probe = 0  # non-drafting steps since the last probe
        self._probe = 0  # 1: this step drafts as a probe; 2: this step verifies the probe's drafts
        self.deferred = False  # a plan made ahead wanted to draft while suspended (see Lookahead)
        # Speculative steps planned ahead (see "Planning ahead"): opt-in, since it paid only where
        # steps are short and the host shares the device's cores (stories260K on the CPU).
        self.speculative_ahead = False
        self.set_policy(policy)

    def set_policy(self, policy: str) -> None:
        """Switches the policy (the caller recompiles / re-profiles lazily).

        Raises:
          DSparkInputError: bad policy string.
        """
        self.name, self.arg = parse_policy(policy, self.block_size)
        self.policy = policy
        self._sps_cache: dict = {}
        # Whether the last step drafted; prefill drafts the first block only then (the
        # throughput-aware policies stop drafting when it does not pay).
        self.drafting = self.name != "plain"

    def set_table(self, table: CostTable | None) -> None:
        """Installs an SPS table (and forgets what was derived from the previous one)."""
        self.sps_table = table
        self._sps_cache = {}

    def adopt_table(self, meta: dict, buckets, given: CostTable | None, spans=()) -> bool:
        """Installs the current or the ``given`` SPS table if one was measured on ``meta`` and
        covers ``buckets`` (with and without drafting) at each of ``spans``; False when a new one
        must be profiled."""
        flags = [False] if self.block_size == 0 else [False, True]
        for t in (self.sps_table, given):
            if t is not None and t.matches(meta) and t.covers_steps(buckets, flags, spans):
                self.set_table(t)
                return True
        return False

    def budgets(self, rows: int) -> list[int]:
        """Compiled token budgets for ``rows`` rows under the current policy (``rows`` first): the
        ladder's budgets above ``rows`` (capped at a full block per row) and, below the ladder's first
        budget, ``rows * (d + 1)`` for ``d`` drafts per row (1 row, default ladder: 1, 2, 3, 4, 8, 9)."""
        g = self.block_size
        if self.name == "plain" or g == 0:
            return [rows]
        if self.name == "fixed":
            return [rows, rows * (cast(int, self.arg) + 1)]
        top = rows * (g + 1)
        # Below the ladder's first budget, whole drafts per row: at 1 row the default ladder would
        # otherwise start at 3 drafts, a step that costs more than the drafts a weak drafter lands.
        small = {rows * (d + 1) for d in range(1, g + 1) if rows * (d + 1) < self.ladder[0]}
        return sorted({rows} | small | {min(k, top) for k in self.ladder if k > rows})

    def rows_for(self, n: int) -> int:
        """The smallest row bucket holding ``n`` rows."""
        return next(r for r in self.row_buckets if r >= n)

    def _table(self) -> CostTable:
        if self.sps_table is None:
            raise RuntimeError("the dspark/greedy policies need an SPS table: call Engine.warmup() first")
        return self.sps_table

    def live_span(self, records: Sequence[SlotRecord], advance=None) -> int:
        """The attention span [tokens] a step over ``records`` reads at most: the longest row's
        confirmed tokens (plus ``advance [n]``, the most each gains from a step in flight) and a
        block of drafts (the SPS table's lookups take the nearest profiled span at or above it)."""
        lengths = np.array([rec.length for rec in records], np.int64)
        if advance is not None:
            lengths = lengths + advance
        return int(lengths.max(initial=0)) + self.block_size

    def sps_of_total(self, rows: int, n: int, draft: bool, span: int = 0) -> np.ndarray:
        """``[K_max + 1]`` SPS of the bucket a pass of ``t`` packed tokens runs in, at ``span``."""
        table = self._table()
        key = (rows, n, draft, table.span_for(("engine_step", rows, rows, draft), span))
        arr = self._sps_cache.get(key)
        if arr is None:
            budgets = self.budgets(rows)
            arr = np.zeros(budgets[-1] + 1)
            arr[n] = table.sps(rows, rows, draft, span)
            spec = budgets[1:]
            for t in range(n + 1, len(arr)):
                k = next((b for b in spec if b >= t), None)
                arr[t] = 0.0 if k is None else table.sps(rows, k, draft, span)
            self._sps_cache[key] = arr
        return arr

    # ------------------------------------------------------------------ suspension

    def plans_ahead(self, rows: int, tokens: int) -> bool:
        """Whether the engine may plan the next step before reading the one in flight, of bucket
        ``(rows, tokens)`` (see "Planning ahead"). The plain policy (or no drafter) always: every
        row steps once whatever it emits. A speculative policy too, except right after a plan
        made ahead deferred resuming (the resuming step's catch-up needs the tokens read) and
        while suspended after a step that verified drafts (a suspended step marks where each
        row's drafter context stops, which needs exact lengths), and only with
        :attr:`speculative_ahead` (default off)."""
        if self.name == "plain" or self.block_size == 0:
            return True
        return self.speculative_ahead and not self.deferred and (tokens == rows or not self.suspended())

    def suspended(self) -> bool:
        """Whether the policy has not drafted for ``suspend_after`` consecutive steps."""
        return self.has_drafter and self.suspend_after is not None and self.idle_steps >= self.suspend_after

    def suspend_now(self, rows: int, tokens: int, draft_next: bool) -> bool:
        """Whether this step runs without drafter context upkeep (a plain step, no drafting,
        while suspended)."""
        return tokens == rows and not draft_next and self.suspended()

    def record_step(self, rows: int, tokens: int, draft_next: bool) -> None:
        """Counts a step that did (not) draft or verify drafts; logs a suspension change. A
        probe's two steps count as not drafting unless the policy itself chose to draft."""
        chose = (draft_next or tokens > rows) and not self._probe
        if self._probe == 2 and draft_next:  # the probe's evidence says drafting pays
            chose = True
        if chose:
            self.idle_steps, self._since_probe = 0, 0
            self.probe_interval = max(1, self.suspend_after or 16)
        else:
            self.idle_steps += 1
            self._since_probe += 1
        if self._probe == 2 and not chose:  # a probe that did not resume: back off
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self._probe = 1 + self._probe if self._probe == 1 else 0
        self._log_drafting_change()

    def _probe_due(self, rows: int, span: int) -> bool:
        """Whether a non-drafting step should draft as a probe: ``probe_interval`` steps since
        the last one, and the drafting round's extra seconds (SPS table at ``span``) within
        :data:`PROBE_BUDGET` of the plain time spent since then."""
        if self._since_probe < self.probe_interval:
            return False
        table, budgets = self._table(), self.budgets(rows)
        secs = lambda k, d: 1.0 / max(table.sps(rows, k, d, span), 1e-9)  # seconds of a step
        plain = secs(rows, False)
        verify = min((b for b in budgets if b >= 2 * rows), default=budgets[-1])  # >= 1 draft per row
        extra = secs(rows, True) + secs(verify, False)
        return extra - 2 * plain <= PROBE_BUDGET * self._since_probe * plain

    def _log_drafting_change(self) -> None:
        """One log line when drafting is suspended or resumes, with the scheduler's reason."""
        now = self.suspended()
        if now == self._was_suspended:
            return
        self._was_suspended = now
        d = self.decision or {}
        why = (
            f"expected {d.get('tokens_per_s_drafting', float('nan')):.1f} tokens/s drafting vs "
            f"{d.get('tokens_per_s_plain', float('nan')):.1f} plain (SPS table)"
        )
        if now:
            _log.info("suspending drafting after %d steps without drafts: %s", self.idle_steps, why)
        else:
            _log.info(
                "resuming drafting: %s; catch-up %.3f s (%d probes so far)",
                why,
                d.get("catchup_seconds", 0.0),
                self.probes,
            )

    def _catchup_seconds(self, records: Sequence[SlotRecord], rows: int, span: int) -> float:
        """Resuming from suspension first costs the catch-up passes over the skipped tokens
        (one packed pass of the widest bucket per block_size + 1 of the longest gap)."""
        if not self.suspended():
            return 0.0
        gap = max((rec.length - 1 - rec.stale_from for rec in records if rec.stale_from is not None), default=0)
        w = self.block_size + 1
        return -(-gap // w) / max(self._table().sps(rows, rows * w, False, span), 1e-9)

    def want_drafts(
        self, records: Sequence[SlotRecord], rows: int, surv_fc: np.ndarray, cap_fc: np.ndarray, span: int | None = None
    ) -> bool:
        """Draft the next block? Compares the best forecast Theta of a drafting step with the
        Theta of a plain step (forecast survival: latest known confidences or the prior) at
        ``span`` (default :meth:`live_span`); when resuming, drafting must also win back the
        catch-up within a horizon of ``suspend_after`` steps' worth of tokens. Records the
        decision (:attr:`decision`)."""
        n = len(records)
        span = self.live_span(records) if span is None else span
        sps_d = self.sps_of_total(rows, n, True, span)
        k = sch.best_budget(surv_fc, cap_fc, sps_d, self.budgets(rows))
        _, _, probs = sch.candidate_order(surv_fc, cap_fc)
        theta_d = (n + float(np.sum(probs[: k - n]))) * sps_d[k]
        theta_p = n * self._table().sps(rows, rows, False, span)
        catchup_s = self._catchup_seconds(records, rows, span)
        horizon = n * max(self.suspend_after or 16, 1)  # tokens the decision is made for
        draft = theta_d > theta_p and catchup_s + horizon / theta_d < horizon / theta_p
        self.decision = {
            "tokens_per_s_drafting": theta_d,
            "tokens_per_s_plain": theta_p,
            "catchup_seconds": catchup_s,
            "draft": bool(draft),
            "probes": self.probes,
            "probe_interval": self.probe_interval,
        }
        return draft

    # ------------------------------------------------------------------ the plan

    def _forecast_survival(self, rec: SlotRecord, prior: np.ndarray, z: np.ndarray | None) -> np.ndarray:
        """``[G]`` survival forecast of a block whose own confidences are not known: the request's
        observed conditional acceptance (:attr:`SlotRecord.hits` / ``seen``) shrunk towards the
        calibrated confidences of an earlier block, ``z`` (its ``[G]`` raw logits), or without one
        towards the window's prior (:meth:`OnlineCalibrator.prior_acceptance`)
        (:func:`~dspark_jax.decoding.auto_verify.forecast_acceptance`, as batch-1 ``auto``);
        without observations, ``z``'s survival or ``prior``. One block's confidences alone are a
        noisy forecast of another's; the request's observed rate is not, once there are
        observations. The *next*, not yet drafted block is forecast from :attr:`SlotRecord.last_z`,
        the deployed budget from the block two steps old (:attr:`SlotRecord.hist`)."""
        observed = rec.hits is not None and rec.seen is not None
        if z is not None:
            conf = self.calibrator.confidence(z)
        elif observed:
            conf = self.calibrator.prior_acceptance()
        else:
            return prior
        return sch.survival(forecast_acceptance(conf, rec.hits, rec.seen) if observed else conf)

    def _throughput_lengths(self, records, rows, room, surv, cap, span, may_draft) -> tuple[np.ndarray, bool]:
        """``(lengths, draft_next)`` of the greedy / dspark policies."""
        prior = self.calibrator.prior_survival()

        fc = np.stack([self._forecast_survival(rec, prior, rec.last_z) for rec in records])
        draft_next = self.want_drafts(records, rows, fc, room, span)
        probe = not draft_next and self._probe == 0 and self._probe_due(rows, span)
        if (draft_next or probe) and not may_draft:
            draft_next, probe, self.deferred = False, False, True
        if probe:
            draft_next, self._probe, self._since_probe = True, 1, 0
            self.probes += 1
            self.decision = dict(self.decision or {}, probe=True, probes=self.probes)
        sps = self.sps_of_total(rows, len(records), draft_next, span)
        if self.name == "greedy":
            ell = sch.greedy_lengths(surv, cap, sps)
        else:
            # The deployed budget is fixed before the verified block's confidences exist, from the
            # block two steps old: forecast with the request's observed acceptance, since at one
            # row one stale block's confidences decide the whole budget.
            old = np.stack(
                [self._forecast_survival(rec, prior, rec.hist[0] if len(rec.hist) == 3 else None) for rec in records]
            )
            ell, _ = sch.deployed_lengths(old, surv, cap, sps, self.budgets(rows))
        if self._probe == 2:  # verify the probe's drafts: at least one per row that has them
            ell = np.maximum(ell, np.minimum(cap, 1))
        return ell, draft_next

    def _block_survival(self, records: Sequence[SlotRecord], la: Lookahead | None) -> tuple[np.ndarray, np.ndarray]:
        """``(has [n] bool, surv [n, G])``: which rows hold a block to verify, and its survival
        from its calibrated confidences; planned ahead, the block is not read yet: forecast from
        the latest confidences read (or the prior)."""
        g = self.block_size
        if la is None:
            has = np.array([rec.z is not None for rec in records], bool)
            z = np.stack([rec.z if rec.z is not None else np.zeros(g) for rec in records])
            return has, np.where(has[:, None], sch.survival(self.calibrator.confidence(z)), 0.0)
        prior = self.calibrator.prior_survival()
        latest = [rec.z if rec.z is not None else rec.last_z for rec in records]
        surv = np.stack([prior if z is None else sch.survival(self.calibrator.confidence(z)) for z in latest])
        has = np.asarray(la.has_block, bool)
        return has, np.where(has[:, None], surv, 0.0)

    def plan(
        self, records: Sequence[SlotRecord], lookahead: Lookahead | None = None
    ) -> tuple[np.ndarray, int, int, bool]:
        """The decision for the next step over the rows' ``records`` (row order).

        Args:
          records: the rows' records.
          lookahead: set when a step is still in flight (its outputs unread): what is known of
            each row then (:class:`Lookahead`); None: the records are current.
        Returns:
          ``(lengths [n] int32 drafts verified per active row, rows R, tokens K, draft_next)``.
          Depends on confidences and lengths only, never on draft token values (which stay
          on the device).
        """
        n = len(records)
        rows = self.rows_for(n)
        g = self.block_size
        if self.name == "plain" or g == 0:
            return np.zeros(n, np.int32), rows, rows, False
        advance = np.zeros(n, np.int64) if lookahead is None else np.asarray(lookahead.advance, np.int64)
        length = np.array([rec.length for rec in records], np.int64) + advance
        room = np.minimum(g, np.array([rec.end for rec in records], np.int64) - length - 1).clip(0)
        has, surv = self._block_survival(records, lookahead)
        cap = np.where(has, room, 0)
        budgets = self.budgets(rows)
        may_draft = lookahead is None or lookahead.may_draft
        draft_next = True
        if self.name in ("fixed", "threshold") and not may_draft:
            ell, draft_next, self.deferred = np.zeros(n, np.int32), False, True
        elif self.name == "fixed":
            ell = sch.fixed_lengths(cap, cast(int, self.arg))
        elif self.name == "threshold":
            ell = sch.threshold_lengths(surv, cap, cast(float, self.arg))
        else:
            span = self.live_span(records, advance)
            ell, draft_next = self._throughput_lengths(records, rows, room, surv, cap, span, may_draft)
        total = n + int(ell.sum())
        if total == n:
            return ell.astype(np.int32), rows, rows, draft_next
        spec = budgets[1:]
        if total > spec[-1]:
            ell = sch.fill_lengths(surv, np.minimum(cap, ell), spec[-1] - n)
            total = n + int(ell.sum())
        return ell.astype(np.int32), rows, next(b for b in spec if b >= total), draft_next
