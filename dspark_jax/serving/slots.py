"""The engine's slot table: which request each logical slot holds, and which physical decode
row it occupies.

Logical slots are what callers see (``0 .. num_slots - 1``). Active requests are kept in
physical rows ``0 .. n - 1``: freeing a slot moves the last active row into the hole, so a
step only touches the first ``R`` rows (the smallest row bucket holding them). A request that
finished at prefill (first token a stop, no room, non-finite logits) holds a slot but no row
until :meth:`Engine.generate` reports it. Host bookkeeping only; the device rows are moved by
:func:`dspark_jax.serving.programs.move_program`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import numpy as np

from dspark_jax.serving.requests import Prefix, Request

__all__ = ["Round", "SlotRecord", "SlotTable"]


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
      stops: ids that end it (EOS + ``stop_token_ids``).
      pending: tokens not yet handed out (the prefill token until the first step).
      done: finish reason when it finished at prefill.
      z: ``[gamma]`` raw confidence logits of the block verified next (None: no draft).
      hist: the last 3 blocks' ``z`` (the deployed scheduler reads 2-step-old confidences).
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

    def advance(self, emitted: list[int], accepted: int, verified: int, finite: bool) -> Round:
        """Applies one verification round: ``emitted`` (the accepted drafts and the correction
        or bonus token), ``accepted`` of ``verified`` drafts. Cuts at the first stop id once
        ``min_tokens`` were generated (the stop kept) and at ``end``; non-finite logits end
        the request with ``"error"`` and nothing emitted. Updates ``length`` and ``tokens``."""
        new, reason = list(emitted), None
        if not finite:
            new, reason = [], "error"
        keep = len(new)
        gen = self.length - self.prompt_len  # tokens generated before new[0]
        for j, t in enumerate(new):
            if t in self.stops and gen + j >= self.min_tokens:
                keep, reason = j + 1, "stop"
                break
        keep = min(keep, self.end - self.length)
        new = new[:keep]
        self.length += keep
        if reason is None and self.length >= self.end:
            reason = "length"
        n_ver = min(verified, keep) if keep < accepted + 1 else verified
        self.tokens.extend(new)
        return Round(new, reason, n_ver, min(accepted, keep))

    def biased(self) -> bool:
        """Whether a step must apply this row's bias table (logit_bias, or min_tokens masking
        still active at the anchor position: ``length - prompt_len`` tokens generated)."""
        return self.has_bias or self.length - self.prompt_len < self.min_tokens


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

    def pop_unplaced(self) -> list[tuple[int, SlotRecord]]:
        """Removes and returns the ``(slot, record)`` pairs without a row (finished at prefill)."""
        done = [s for s, rec in self._records.items() if rec.row is None]
        return [(s, self._records.pop(s)) for s in done]

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
