"""A dispatched engine step whose outputs the host has not read yet.

JAX dispatches a compiled step asynchronously. The engine keeps the next step queued on the device
while the host does the previous step's work (closing its rounds, building the outputs, freeing
finished rows) and while the caller does its own (detokenizing, streaming, admitting requests), so
the device does not wait for the host between steps (docs/design.md#serving). A step therefore
remembers which request each of its rows held when it was dispatched: by the time its outputs are
read, rows may have finished, been freed, moved or reused by a new request, and those rows'
outputs are dropped. A row the device stepped once more after it finished only wasted that work:
its state is reset when the row is next inserted, and a plain step after the last position of a
row still writes inside that row's cache (``end <= cache_len``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import numpy as np

from dspark_jax.decoding.auto_verify import ACCEPTANCE_DECAY
from dspark_jax.serving.engine.counters import EngineMetrics
from dspark_jax.serving.engine.online_calibration import OnlineCalibrator
from dspark_jax.serving.engine.planner import Lookahead
from dspark_jax.serving.engine.requests import StepOutput, lp_entry
from dspark_jax.serving.engine.slots import Round, SlotRecord, SlotTable, close_rounds

__all__ = ["InflightStep", "StepHost", "close_step"]


@dataclasses.dataclass
class StepHost:
    """One step's outputs read back, restricted to the rows still holding their request.

    Attributes:
      rows: ``[(slot, record)]`` of those rows, in row order at dispatch.
      ell: ``[n]`` int32 drafts each verified.
      ypad / acc / finite / conf: ``[n, G' + 1]`` int32 tokens, ``[n]`` int32 accepted drafts,
        ``[n]`` bool finite logits, ``[n, G']`` float32 the next block's confidence logits.
      lp: ``(chosen [n, G' + 1], top values [n, G' + 1, n_top], top ids)`` logprobs, or three Nones.
    """

    rows: list[tuple[int, SlotRecord]]
    ell: np.ndarray
    ypad: np.ndarray
    acc: np.ndarray
    finite: np.ndarray
    conf: np.ndarray
    lp: tuple


@dataclasses.dataclass
class InflightStep:
    """A step dispatched to the device (:meth:`~dspark_jax.serving.engine.Engine.generate`).

    Attributes:
      out: the step program's device outputs ``(ypad, acc, finite, conf, logprobs)``.
      rows: ``[(slot, record)]`` of the rows ``0..n-1`` at dispatch.
      ell: ``[n]`` int32 drafts verified per row; bucket: ``(rows R, tokens K)``.
      draft_next: the step drafted the next block; want_lp: logprobs were asked for;
      suspended: it ran without drafter context upkeep; t0: ``time.perf_counter()`` at dispatch [s].
    """

    out: Any
    rows: list[tuple[int, SlotRecord]]
    ell: np.ndarray
    bucket: tuple[int, int]
    draft_next: bool
    want_lp: bool
    suspended: bool
    t0: float

    def __post_init__(self) -> None:
        # Queue the read-back right behind this step: started at read time, on an accelerator it
        # would wait behind the next step, dispatched before this one is read.
        for a in jax.tree.leaves(self.out[:4] + ((self.out[4],) if self.want_lp else ())):
            a.copy_to_host_async()

    def lookahead(self, records: list[SlotRecord], drafts: bool, may_draft: bool) -> Lookahead:
        """What a plan made before this step is read knows of ``records`` (the rows now):
        a row this step holds gains at most its verified drafts + 1 tokens and holds a drafted
        block iff this step drafts (``drafts``: the engine has a drafter); a row that joined after
        it is current. ``may_draft``: see :class:`~dspark_jax.serving.engine.planner.Lookahead`."""
        mine = {id(rec): r for r, (_, rec) in enumerate(self.rows)}
        idx = [mine.get(id(rec)) for rec in records]
        advance = np.array([0 if r is None else int(self.ell[r]) + 1 for r in idx], np.int64)
        has = np.array(
            [rec.z is not None if r is None else (drafts and self.draft_next) for r, rec in zip(idx, records)], bool
        )
        return Lookahead(advance, has, may_draft)

    def read(self, slots: SlotTable) -> StepHost:
        """Blocks until the step is done and reads back what the host needs, for the rows whose
        request still holds the slot it held at dispatch (the same record object: a slot freed
        and reused by a new request does not count)."""
        ypad, acc, finite, conf = jax.device_get(self.out[:4])
        # The logprob arrays are only read back when some row asked for them.
        lp = tuple(jax.device_get(self.out[4])) if self.want_lp else (None, None, None)
        keep = [r for r, (slot, rec) in enumerate(self.rows) if slot in slots and slots[slot] is rec]
        idx = np.asarray(keep, np.int64)
        lp = tuple(None if a is None else np.asarray(a)[idx] for a in lp)
        return StepHost(
            rows=[self.rows[r] for r in keep],
            ell=self.ell[idx],
            ypad=np.asarray(ypad)[idx],
            acc=np.asarray(acc)[idx],
            finite=np.asarray(finite)[idx],
            conf=np.asarray(conf)[idx],
            lp=lp,
        )


def _step_output(slot: int, rec: SlotRecord, r: int, rnd: Round, host: StepHost, next_z: bool) -> StepOutput:
    """Row ``r``'s output (``rnd``: its round, :func:`~dspark_jax.serving.engine.slots.close_rounds`):
    its kept tokens, counters and logprobs; the record gets the next block's confidences
    (``next_z``: the step drafted one)."""
    lpc, lpv, lpi = host.lp
    toks = rec.pending + rnd.tokens
    rec.pending = []
    lps = None
    if rec.n_lp is not None:
        lps = rec.pending_lp + [lp_entry(lpc[r, j], lpv[r, j], lpi[r, j], rec.n_lp) for j in range(len(rnd.tokens))]
        rec.pending_lp = []
    rec.push_z(np.asarray(host.conf[r], np.float64) if next_z else None)
    done = rnd.reason is not None
    return StepOutput(slot, rec.request.request_id, toks, done, rnd.reason, rnd.verified, rnd.accepted, lps)


def close_step(
    host: StepHost, draft_next: bool, block_size: int, calibrator: OnlineCalibrator, metrics: EngineMetrics
) -> list[StepOutput]:
    """Closes a step's verification rounds on the host: online calibration observes each verified
    row's confidences (those of the block it verified, ``record.z``) against its accepted drafts;
    the rows' records advance (:func:`~dspark_jax.serving.engine.slots.close_rounds`) and get the next
    block's confidences. Returns one :class:`StepOutput` per row of ``host``."""
    if not host.rows:
        return []
    recs = [rec for _, rec in host.rows]
    ell, acc = host.ell, host.acc
    verified = ell > 0
    if block_size and verified.any():
        zs = np.stack([cast(np.ndarray, rec.z) for rec, v in zip(recs, verified) if v])  # verified: drafted
        calibrator.observe(zs, ell[verified], acc[verified])
        calibrator.update()
        for rec, e, a in zip(recs, ell, acc):
            if e > 0:
                rec.observe_round(int(e), int(a), block_size, ACCEPTANCE_DECAY)
    rounds, stats, kept = close_rounds(recs, host.ypad, acc, host.finite, ell, block_size)
    metrics.add_rounds(ell, stats, kept)
    next_z = bool(draft_next and block_size)
    return [_step_output(slot, rec, r, rounds[r], host, next_z) for r, (slot, rec) in enumerate(host.rows)]
