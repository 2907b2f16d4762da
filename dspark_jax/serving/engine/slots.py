"""The engine's slot table: which request each logical slot holds, and which physical decode
row it occupies.

Logical slots are what callers see (``0 .. num_slots - 1``). Active requests are kept in
physical rows ``0 .. n - 1``: freeing a slot moves the last active row into the hole, so a
step only touches the first ``R`` rows (the smallest row bucket holding them). A request that
finished at prefill (first token a stop, no room, non-finite logits) holds a slot but no row
until :meth:`Engine.generate` reports it. Host bookkeeping only; the device rows are moved by
:func:`dspark_jax.serving.engine.step_programs.move_program`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np

from dspark_jax.decoding.auto_verify import reached_and_accepted
from dspark_jax.decoding.round import (
    FINISH_ERROR,
    FINISH_NAMES,
    FINISH_RUNNING,
    RoundStats,
    emit_counts,
    finish_codes,
    round_statistics,
)
from dspark_jax.serving.engine.requests import Prefix, Request, StepOutput

__all__ = ["Round", "SlotRecord", "SlotTable", "close_rounds"]


class Round(NamedTuple):
    """What one verification round kept for a request: ``tokens`` (after a stop or the length
    limit cut the block), ``reason`` (the finish reason or None), and the ``verified`` /
    ``accepted`` drafts among them (drafts after a cut are not counted)."""

    tokens: list[int]
    reason: str | None
    verified: int
    accepted: int


@dataclasses.dataclass
class SlotRecord:
    """Host state of one request in a slot.

    Attributes:
      request: the request.
      row: its physical row, or None (finished at prefill, not yet reported).
      prompt_len: prompt tokens.
      length: confirmed tokens (prompt + generated).
      end: the request ends when ``length`` reaches this.
      stops: ids that end it (EOS + ``stop_ids``).
      pending: tokens not yet handed out (the prefill token until the first step).
      done: finish reason when it finished at prefill.
      z: ``[block_size]`` raw confidence logits of the block verified next (None: no draft).
      hist: the last 3 blocks' ``z`` (the deployed scheduler reads 2-step-old confidences).
      last_z: the latest ``z`` the drafter produced for this request, however old (the
        forecast of a row that has not drafted lately); None before its first block.
      hits / seen: ``[block_size]`` this request's accepted drafts and verification-reached draft
        positions, decayed per verifying round (:meth:`observe_round`; None before its first).
      tokens: confirmed tokens by position (the catch-up re-runs them).
      stale_from: drafter context missing from this position on (None: current).
      min_tokens: stops cannot end the request before this many generated tokens.
      has_bias: the request has logit_bias entries.
      n_lp: ``SamplingParams.logprobs``.
      pending_lp: logprobs of ``pending``.
    """

    request: Request
    row: int | None
    prompt_len: int
    length: int
    end: int
    stops: frozenset
    pending: list
    done: str | None = None
    z: np.ndarray | None = None
    hist: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=3))
    last_z: np.ndarray | None = None
    hits: np.ndarray | None = None
    seen: np.ndarray | None = None
    tokens: list = dataclasses.field(default_factory=list)
    stale_from: int | None = None
    min_tokens: int = 0
    has_bias: bool = False
    n_lp: int | None = None
    pending_lp: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_prefix(cls, prefix: Prefix, stops: frozenset, end: int, has_bias: bool) -> SlotRecord:
        """The record of a prefilled request, without a row; ``done`` is set when it already
        finished: non-finite logits (``"error"``), a first token that stops it (``"stop"``,
        unless ``min_tokens``), or no room for more (``"length"``)."""
        req, sp = prefix.request, prefix.request.params
        rec = cls(
            req,
            None,
            prefix.prompt_len,
            prefix.prompt_len + 1,
            end,
            stops,
            [prefix.first_token],
            tokens=[int(t) for t in req.prompt_ids] + [prefix.first_token],
            min_tokens=int(sp.min_tokens),
            has_bias=has_bias,
            n_lp=sp.logprobs,
            pending_lp=[prefix.first_logprob] if sp.logprobs is not None else [],
        )
        if not prefix.finite:
            rec.done, rec.pending, rec.pending_lp = "error", [], []
        elif prefix.first_token in stops and rec.min_tokens == 0:
            rec.done = "stop"
        elif rec.length >= end:
            rec.done = "length"
        return rec

    def push_z(self, z: np.ndarray | None) -> None:
        """Records the confidence logits ``z [block_size]`` of the block verified next (None: the
        step did not draft): :attr:`z`, :attr:`hist` and :attr:`last_z`."""
        self.z = z
        self.hist.append(z)
        if z is not None:
            self.last_z = z

    def observe_round(self, verified: int, accepted: int, block_size: int, decay: float) -> None:
        """Adds one round that verified ``verified >= 1`` drafts and accepted ``accepted`` of them
        to :attr:`hits` / :attr:`seen` (older rounds first multiplied by ``decay``): position ``k``
        (1-based) was reached iff ``k <= verified`` and ``k <= accepted + 1``, a hit iff
        ``k <= accepted``; batch-1 ``auto``'s observations
        (:func:`~dspark_jax.decoding.auto_verify.observe_acceptance`), per request."""
        reached, hit = reached_and_accepted(np.arange(1, block_size + 1), verified, accepted)
        if self.hits is None or self.seen is None:
            self.hits, self.seen = np.zeros(block_size), np.zeros(block_size)
        self.seen = decay * self.seen + reached
        self.hits = decay * self.hits + hit

    def biased(self) -> bool:
        """Whether a step must apply this row's bias table (logit_bias, or min_tokens masking
        still active at the anchor position: ``length - prompt_len`` tokens generated)."""
        return self.has_bias or self.length - self.prompt_len < self.min_tokens


def close_rounds(
    records: list[SlotRecord], ypad: np.ndarray, acc: np.ndarray, finite: np.ndarray, ell: np.ndarray, block_size: int
) -> tuple[list[Round], RoundStats, np.ndarray]:
    """Applies one step's verification round to the ``n`` records of the occupied rows.

    Row ``r`` emitted ``ypad[r, :acc[r] + 1]`` (accepted drafts, then the correction or bonus
    token) after verifying ``ell[r]`` drafts. :func:`dspark_jax.decoding.round.emit_counts`
    cuts the tokens at the first stop id once ``min_tokens`` were generated (the stop kept)
    and at ``end``; non-finite logits end a request with ``"error"`` and nothing emitted;
    else a stop ends it with ``"stop"``, a full row with ``"length"``. Each record's
    ``length`` and ``tokens`` advance by its kept tokens.

    Args:
      ypad: ``[R >= n, G' + 1]`` int32 the step's tokens on the row grid; acc: ``[R]``
        int32 accepted drafts; finite: ``[R]`` bool; ell: ``[n]`` int32 verified drafts.
      block_size: block size (per-position statistics over ``max(block_size, 1)`` positions).
    Returns:
      ``(rounds, stats, kept)``: a :class:`Round` per record, the rows'
      :func:`~dspark_jax.decoding.round.round_statistics` (numpy) and ``[n]`` kept tokens.
    """
    n = len(records)
    tokens, acc, ok = ypad[:n], acc[:n], finite[:n].astype(bool)
    length = np.array([rec.length for rec in records], np.int64)
    stops = np.full((n, max([len(rec.stops) for rec in records] + [1])), -1, np.int64)
    for r, rec in enumerate(records):
        stops[r, : len(rec.stops)] = sorted(rec.stops)
    kept, stopped, full = emit_counts(
        tokens,
        acc + 1,
        ok,  # non-finite rows keep nothing (and end with "error")
        length,
        np.array([rec.end for rec in records], np.int64),
        stops,
        stops_from=np.array([rec.min_tokens - (rec.length - rec.prompt_len) for rec in records], np.int64),
        xp=np,
    )
    codes = finish_codes(np.where(ok, FINISH_RUNNING, FINISH_ERROR), stopped, full, xp=np)
    stats = round_statistics(ell, acc, acc + 1, kept, block_size, xp=np)
    rounds = []
    for r, rec in enumerate(records):
        new = [int(t) for t in tokens[r, : kept[r]]]
        rec.length += len(new)
        rec.tokens.extend(new)
        rounds.append(
            Round(new, FINISH_NAMES[int(codes[r])], int(stats.num_draft_tokens[r]), int(stats.num_accepted[r]))
        )
    return rounds, stats, kept


class SlotTable:
    """Logical slots -> :class:`SlotRecord`, and physical rows -> logical slots."""

    def __init__(self, num_slots: int):
        self.num_slots = int(num_slots)
        self._records: dict[int, SlotRecord] = {}
        self._row_slot: list[int] = []  # row r holds logical slot _row_slot[r]

    def __getitem__(self, slot: int) -> SlotRecord:
        return self._records[slot]

    def __contains__(self, slot) -> bool:
        return slot in self._records

    def __len__(self) -> int:
        return len(self._records)

    def free_slots(self) -> list[int]:
        """Free logical slots, ascending."""
        return [s for s in range(self.num_slots) if s not in self._records]

    def active_slots(self) -> list[int]:
        """Occupied logical slots, ascending (including ones finished but not yet reported)."""
        return sorted(self._records)

    @property
    def num_rows(self) -> int:
        """Occupied physical rows (requests being decoded)."""
        return len(self._row_slot)

    def row_slots(self) -> list[int]:
        """The logical slot of each occupied row, in row order."""
        return list(self._row_slot)

    def row_records(self) -> list[SlotRecord]:
        """The records of the occupied rows, in row order."""
        return [self._records[s] for s in self._row_slot]

    def add(self, slot: int, rec: SlotRecord) -> None:
        """Puts ``rec`` into free logical ``slot`` (without a row)."""
        self._records[int(slot)] = rec

    def next_row(self) -> int:
        """The row the next :meth:`place` assigns."""
        return len(self._row_slot)

    def place(self, slot: int) -> int:
        """Gives ``slot``'s record the next free row; returns it."""
        row = len(self._row_slot)
        self._records[int(slot)].row = row
        self._row_slot.append(int(slot))
        return row

    def report_unplaced(self) -> list[StepOutput]:
        """Removes the requests that finished at prefill (they never got a row) and returns their
        outputs."""
        outs = []
        for slot in [s for s, rec in self._records.items() if rec.row is None]:
            rec = self._records.pop(slot)
            lps = rec.pending_lp if rec.n_lp is not None else None
            outs.append(StepOutput(slot, rec.request.request_id, rec.pending, True, rec.done, 0, 0, lps))
        return outs

    def remove(self, slot: int) -> tuple[int, int] | None:
        """Frees ``slot`` (a free slot is a no-op). When its row was not the last one, the last
        row's request moves into it: returns ``(src_row, dst_row)`` of that move (the caller
        moves the device rows), else None."""
        rec = self._records.pop(int(slot), None)
        if rec is None or rec.row is None:
            return None
        last = len(self._row_slot) - 1
        move = None
        if rec.row != last:
            moved = self._row_slot[last]
            self._row_slot[rec.row] = moved
            self._records[moved].row = rec.row
            move = (last, rec.row)
        self._row_slot.pop()
        return move
