"""SPS(B): steps per second of the serving engine's compiled step, per bucket.

docs/design.md#scheduler: the throughput objective ``Theta = tau * SPS(B)`` needs the speed of
one engine step as a function of its size. The engine compiles a small set of buckets
``(rows R, packed tokens K)``; a step also either drafts the next block or not. At start-up
each bucket is timed (a few iterations after compilation, median wall time) and the table
keeps steps/s per ``(R, K, draft)``. The table is saved as JSON together with what it was
measured for (device kind, model name and weights fingerprint, drafter, slots, block_size, cache
length) and reused by a later engine only when all of that matches.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from dspark_jax.errors import DSparkInputError

__all__ = ["SPSTable", "profile_buckets"]


@dataclasses.dataclass
class SPSTable:
    """Measured steps/s per compiled bucket.

    Attributes:
      meta: what the table was measured for: ``device_kind``, ``model``, ``fingerprint``,
        ``drafter``, ``num_slots``, ``block_size``, ``cache_len`` (a dict of JSON scalars).
      entries: ``{(rows, tokens, draft): steps_per_second}``.
    """

    meta: dict
    entries: dict = dataclasses.field(default_factory=dict)

    def sps(self, rows: int, tokens: int, draft: bool) -> float:
        """Steps/s of bucket ``(rows, tokens)`` (0.0 when it was not profiled)."""
        return float(self.entries.get((int(rows), int(tokens), bool(draft)), 0.0))

    def budgets(self, rows: int, draft: bool | None = None) -> list[int]:
        """Sorted token budgets profiled for ``rows``."""
        return sorted({k for (r, k, d) in self.entries if r == rows and (draft is None or d == draft)})

    def covers(self, buckets: Iterable[tuple[int, int]], drafts: Iterable[bool]) -> bool:
        """True when every ``(rows, tokens)`` bucket is present for every draft flag."""
        return all((r, k, d) in self.entries for r, k in buckets for d in drafts)

    def matches(self, meta: dict) -> bool:
        """True when the table was measured for exactly this configuration."""
        return all(self.meta.get(k) == v for k, v in meta.items())

    def to_json(self) -> dict:
        return {
            "meta": self.meta,
            "entries": [
                {"rows": r, "tokens": k, "draft": d, "sps": v} for (r, k, d), v in sorted(self.entries.items())
            ],
        }

    @classmethod
    def from_json(cls, obj: dict) -> SPSTable:
        """Inverse of :meth:`to_json`.

        Raises:
          DSparkInputError: malformed table.
        """
        try:
            entries = {(int(e["rows"]), int(e["tokens"]), bool(e["draft"])): float(e["sps"]) for e in obj["entries"]}
            return cls(dict(obj["meta"]), entries)
        except (KeyError, TypeError, ValueError) as e:
            raise DSparkInputError(f"malformed SPS table: {e}") from None

    def save(self, path: str | Path) -> None:
        """Writes the table as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> SPSTable:
        """Reads a table written by :meth:`save`.

        Raises:
          DSparkInputError: missing or malformed file.
        """
        p = Path(path)
        if not p.exists():
            raise DSparkInputError(f"SPS table {p} does not exist")
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DSparkInputError(f"SPS table {p} is not valid JSON: {e}") from None
        return cls.from_json(obj)


def profile_buckets(
    run: Callable[[int, int, bool], None],
    buckets: Iterable[tuple[int, int]],
    drafts: Iterable[bool],
    meta: dict,
    iters: int = 5,
    warm: int = 1,
) -> SPSTable:
    """Times ``run(rows, tokens, draft)`` (one blocking engine step) per bucket.

    Args:
      run: executes one already-compiled step and blocks until it is done.
      buckets: ``(rows, tokens)`` pairs.
      drafts: draft flags to time for every bucket.
      meta: stored as :attr:`SPSTable.meta`.
      iters: timed iterations per entry (the median is kept).
      warm: untimed iterations first.
    Returns:
      :class:`SPSTable`.
    """
    entries = {}
    for r, k in buckets:
        for d in drafts:
            for _ in range(warm):
                run(r, k, d)
            times = []
            for _ in range(max(1, iters)):
                t0 = time.perf_counter()
                run(r, k, d)
                times.append(time.perf_counter() - t0)
            entries[(int(r), int(k), bool(d))] = 1.0 / max(float(np.median(times)), 1e-9)
    return SPSTable(dict(meta), entries)
