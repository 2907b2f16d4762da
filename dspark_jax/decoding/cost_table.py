"""Measured seconds of compiled programs, each at the attention span it read: the cost table.

docs/design.md#scheduler: the throughput objective ``Theta = tau * SPS`` needs the seconds of
the programs a decoder chooses between, measured on the machine that runs them. One table
holds them for both of its users, each entry keyed by a program and a span:

* batch-1 decoding (``num_speculative_tokens="auto"``, :mod:`dspark_jax.decoding.auto_verify`;
  measured by :func:`dspark_jax.decoding.decode_profile.measure_costs`): a plain autoregressive
  step ``("step",)``; a verification pass of ``w + 1`` tokens (anchor + ``w`` drafts, with the
  drafter context write and the rejection sampling) per compiled width ``("verify", w)``
  (``w = 0`` is the plain step of a speculative loop that keeps the drafter's context current);
  one drafting round ``("draft", "greedy")`` / ``("draft", "sampled")``; writing
  ``block_size + 1`` tokens' drafter context ``("context",)``; and one round of the ``auto``
  decode loop itself at each of its widths ``("round", w)`` (drafting included for ``w > 0``;
  timed inside the loop, where XLA overlaps and fuses what standalone calls cannot, so the
  prices ``auto`` decides by: :meth:`CostTable.auto_prices`). Accessors:
  :meth:`CostTable.verify_array`, :meth:`CostTable.draft_seconds`,
  :meth:`CostTable.bound_tokens_per_s`, ...;
* the serving engine (:mod:`dspark_jax.serving.engine`; measured by its
  ``EngineDevice.profile``): one step of every compiled bucket
  ``("engine_step", rows, packed tokens, draft)``; :meth:`CostTable.sps` is its steps/s, SPS(B).

The span of an entry is the live KV length [tokens] its call's cached attention read: whole
blocks of :data:`~dspark_jax.models.layers.ATTN_BLOCK` positions up to the highest live
position, at most the cache length (:func:`live_span`; ``cached_attention`` reads nothing
beyond), so that the table is a function of the span. A lookup at span ``s`` takes the nearest
measured span at or above ``s``, else the largest (:meth:`CostTable.span_for`). Profiling
measures one span by default; a list of spans costs one timing per program and span.

Both profilers time with :func:`time_programs` (medians of repeats that rotate the programs,
so that drift on a shared machine hits all of them alike). A table is stored as JSON
(:meth:`CostTable.to_json`, format :data:`FORMAT`) in the disk cache keyed by what it was
measured for (:func:`table_key`, :func:`stored_table`, :func:`store_table`;
:mod:`~dspark_jax.decoding.disk_cache`), or at a path (:meth:`CostTable.save` /
:meth:`CostTable.load`: the server's ``--sps-table``). A file of the previous SPS-table format
(steps/s without spans) is refused with a one-line error asking to re-profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from dspark_jax.decoding import disk_cache
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.layers import ATTN_BLOCK

__all__ = [
    "FORMAT",
    "CostTable",
    "live_span",
    "measured_spans",
    "store_table",
    "stored_table",
    "table_key",
    "time_programs",
]

_log = logging.getLogger(__name__)

FORMAT = 2
"""Version of the stored layout ``{"format", "meta", "entries": [{"program", "span", "seconds"}]}``
(1, implicit: the SPS table's steps/s per bucket, without spans)."""

_K = TypeVar("_K", bound=Hashable)

Program = tuple[Any, ...]  # ("verify", 3), ("engine_step", 2, 8, True), ...: a name, then its static arguments


def live_span(max_position: int, cache_len: int | None = None) -> int:
    """KV tokens a cached attention pass reads when its highest live position is ``max_position``:
    whole blocks of ``ATTN_BLOCK`` up to it (at least one), at most ``cache_len``."""
    span = -(-max(int(max_position) + 1, 1) // ATTN_BLOCK) * ATTN_BLOCK
    return span if cache_len is None else min(span, int(cache_len))


def measured_spans(spans: Iterable[int] | None, cache_len: int, default: int) -> tuple[int, ...]:
    """The spans to profile: each of ``spans`` [tokens] rounded up to whole KV blocks
    (:func:`live_span`) and clipped to ``cache_len``, sorted and unique; ``(default,)`` for None.

    Raises:
      DSparkInputError: a span below 1.
    """
    if spans is None:
        return (int(default),)
    spans = [int(s) for s in spans]
    if not spans or min(spans) < 1:
        raise DSparkInputError(f"attention spans must be >= 1 token, got {spans}")
    return tuple(sorted({live_span(s - 1, cache_len) for s in spans}))


def time_programs(
    calls: Mapping[_K, Callable[[], Any]],
    *,
    repeats: int,
    inner: int | None = 1,
    warm: int = 1,
    before: Callable[[_K], None] | None = None,
    budget_s: float = 2e-3,
) -> dict[_K, float]:
    """Median seconds of one call of each program: the timing routine of every profiler.

    Each program is first called ``warm`` times untimed (compilation, warm caches), then
    ``repeats`` rounds time every program once, in an order rotated by one per round, so that
    no program is always first and drift on a shared machine hits all of them alike.

    Args:
      calls: ``{name: fn}``; ``fn()`` runs the program once and blocks until it is done.
      repeats: timed rounds (at least 1); each value is their median.
      inner: calls per timing (the mean is kept); None: enough for ``budget_s`` [s] per timing
        of the slowest program (from its last warm call), at least 1.
      warm: untimed calls per program first (at least 1 when ``inner`` is None).
      before: ``before(name)``, untimed, before the warm calls and every timing of ``name``
        (e.g. to reset the state a program advances).
    Returns:
      ``{name: median seconds per call}`` in the order of ``calls``.
    """
    names = list(calls)
    warm = max(int(warm), 1 if inner is None else 0)
    last: dict[_K, float] = {}
    for n in names:
        if before is not None:
            before(n)
        for _ in range(warm):
            t0 = time.perf_counter()
            calls[n]()
            last[n] = time.perf_counter() - t0
    if inner is None:
        inner = max(1, int(budget_s / max(max(last.values(), default=0.0), 1e-6)))
    times: dict[_K, list[float]] = {n: [] for n in names}
    for r in range(max(1, int(repeats))):
        k = r % max(len(names), 1)
        for n in names[k:] + names[:k]:
            if before is not None:
                before(n)
            t0 = time.perf_counter()
            for _ in range(inner):
                calls[n]()
            times[n].append((time.perf_counter() - t0) / inner)
    return {n: statistics.median(v) for n, v in times.items()}


def _old_sps_format(obj: Any) -> bool:
    entries = obj.get("entries") if isinstance(obj, dict) and "format" not in obj else None
    return isinstance(entries, list) and any(isinstance(e, dict) and "sps" in e for e in entries)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Median seconds per call of compiled programs, each at the attention span it read.

    Attributes:
      meta: what the table was measured for (JSON scalars: device kind, model, drafter, shapes,
        cache length; :meth:`matches` compares it).
      seconds: ``{(program, span): seconds}``; ``program`` a tuple (a name, then its static
        arguments; see the module docstring), ``span`` [tokens] the live KV length it read.
    """

    meta: dict[str, Any]
    seconds: dict[tuple[Program, int], float]

    @functools.cached_property
    def _spans(self) -> dict[Program, list[int]]:
        out: dict[Program, list[int]] = {}
        for prog, span in self.seconds:
            out.setdefault(prog, []).append(span)
        return {p: sorted(s) for p, s in out.items()}

    # ------------------------------------------------------------------ any program

    def spans(self, program: Program | None = None) -> list[int]:
        """Ascending spans [tokens] measured for ``program`` (None: for any program)."""
        if program is not None:
            return list(self._spans.get(tuple(program), []))
        return sorted({s for _, s in self.seconds})

    def span_for(self, program: Program, span: int) -> int | None:
        """The measured span a lookup of ``program`` at ``span`` [tokens] uses: the nearest at or
        above ``span``, else the largest; None when ``program`` was not measured."""
        spans = self._spans.get(tuple(program))
        if not spans:
            return None
        i = bisect.bisect_left(spans, int(span))
        return spans[min(i, len(spans) - 1)]

    def get(self, program: Program, span: int = 0) -> float | None:
        """Seconds of ``program`` at ``span`` (:meth:`span_for`; 0: the smallest measured), or None."""
        s = self.span_for(program, span)
        return None if s is None else self.seconds[(tuple(program), s)]

    def cost(self, program: Program, span: int = 0) -> float:
        """Seconds of ``program`` at ``span`` (as :meth:`get`).

        Raises:
          ValueError: ``program`` was not measured.
        """
        t = self.get(program, span)
        if t is None:
            raise ValueError(f"the cost table has no measurement of {tuple(program)}")
        return t

    def covers(self, programs: Iterable[Program], spans: Iterable[int] = ()) -> bool:
        """True when every program was measured, at each of ``spans`` exactly."""
        spans = list(spans)
        return all(tuple(p) in self._spans and all((tuple(p), s) in self.seconds for s in spans) for p in programs)

    def matches(self, meta: Mapping[str, Any]) -> bool:
        """True when the table was measured for exactly this configuration (every key of ``meta``)."""
        return all(self.meta.get(k) == v for k, v in meta.items())

    # ------------------------------------------------------------------ batch-1 decoding

    @property
    def widths(self) -> tuple[int, ...]:
        """Verification widths measured, ascending."""
        return tuple(sorted(int(p[1]) for p in self._spans if p[0] == "verify"))

    def verify_array(self, widths: Sequence[int], span: int = 0) -> np.ndarray:
        """``[len(widths)]`` float32 seconds of a verification pass at each width, at ``span``.

        Raises:
          ValueError: a width the table did not measure.
        """
        got = [self.get(("verify", int(w)), span) for w in widths]
        missing = [w for w, t in zip(widths, got) if t is None]
        if missing:
            raise ValueError(f"cost table has no verification cost for widths {missing} (it has {list(self.widths)})")
        return np.asarray(got, np.float32)

    def step_seconds(self, span: int = 0) -> float:
        """Seconds of a plain autoregressive step (no drafter) at ``span``."""
        return self.cost(("step",), span)

    def draft_seconds(self, greedy: bool, span: int = 0) -> float:
        """Seconds of one drafting round at T=0 (``greedy``) or T>0, at ``span``."""
        return self.cost(("draft", "greedy" if greedy else "sampled"), span)

    def context_seconds(self, span: int = 0) -> float:
        """Seconds of writing ``block_size + 1`` tokens' drafter context at ``span``."""
        return self.cost(("context",), span)

    def round_array(self, widths: Sequence[int], span: int = 0) -> np.ndarray | None:
        """``[len(widths)]`` float32 seconds of one ``auto`` decode-loop round at each width at
        ``span`` (``("round", w)``), or None when the table has no loop rounds for all of them."""
        got = [self.get(("round", int(w)), span) for w in widths]
        return None if any(t is None for t in got) else np.asarray(got, np.float32)

    def auto_prices(self, widths: Sequence[int], greedy: bool, span: int = 0) -> tuple[np.ndarray, float]:
        """``(t_verify [len(widths)] float32, t_draft)`` seconds that ``num_speculative_tokens="auto"``
        decides by at ``span`` (:mod:`~dspark_jax.decoding.auto_verify`; ``widths[0] == 0``).

        With loop rounds (:meth:`round_array`) a drafting round at width ``w`` costs what the loop
        measured: ``t_draft + t_verify(w) = round(w)`` at T=0 (plus the sampled drafting's extra
        cost at T>0, priced by the standalone draft programs), ``t_verify(0) = round(0)``, and a
        wider pass never costs less than a narrower one (cumulative maximum over ``w >= 1``,
        against timing noise). Without them, the standalone programs' prices.

        Raises:
          ValueError: a width or program the table did not measure.
        """
        t_draft = self.draft_seconds(greedy, span)
        rounds = self.round_array(widths, span)
        if rounds is None:
            return self.verify_array(widths, span), t_draft
        base = self.draft_seconds(True, span)
        t_verify = rounds.copy()
        t_verify[1:] = np.maximum.accumulate(np.maximum(rounds[1:] - base, 1e-6))
        return t_verify.astype(np.float32), t_draft

    def bound_tokens_per_s(self, tau: float, width: int, greedy: bool = True, span: int = 0) -> float:
        """Expected tokens/s of speculative decoding at acceptance length ``tau`` [tokens/pass]
        verifying ``width`` drafts per round at ``span``: ``tau / (T_draft + T_verify(width))``."""
        return tau / (self.draft_seconds(greedy, span) + float(self.verify_array([width], span)[0]))

    @property
    def round_widths(self) -> tuple[int, ...]:
        """Widths whose ``auto`` loop round was measured, ascending (empty: none)."""
        return tuple(sorted(int(p[1]) for p in self._spans if p[0] == "round"))

    def decode_ms(self, span: int = 0) -> dict[str, Any]:
        """The batch-1 costs at ``span`` in milliseconds, the layout of ``benchmarks/decode_costs.py``'s
        JSON (``t_step_ms``, ``t_verify_ms`` by width, ``t_draft_ms``, ``t_draft_sampled_ms``,
        ``t_context_ms``, ``t_round_ms`` by width (empty without loop rounds), the ``span`` used and
        the ``cache_len`` of :attr:`meta`)."""
        ms = lambda s: round(1e3 * s, 4)
        return {
            "t_step_ms": ms(self.step_seconds(span)),
            "t_verify_ms": {w: ms(float(t)) for w, t in zip(self.widths, self.verify_array(self.widths, span))},
            "t_draft_ms": ms(self.draft_seconds(True, span)),
            "t_draft_sampled_ms": ms(self.draft_seconds(False, span)),
            "t_context_ms": ms(self.context_seconds(span)),
            "t_round_ms": {w: ms(self.cost(("round", w), span)) for w in self.round_widths},
            "span": self.span_for(("step",), span),
            "cache_len": self.meta.get("cache_len"),
        }

    @classmethod
    def from_decode_costs(
        cls,
        *,
        span: int,
        t_step: float,
        t_verify: Mapping[int, float],
        t_draft_greedy: float,
        t_draft_sampled: float,
        t_context: float,
        meta: Mapping[str, Any] | None = None,
    ) -> CostTable:
        """A batch-1 table of one span from its seconds (``t_verify``: width -> seconds)."""
        secs: dict[tuple[Program, int], float] = {(("step",), span): float(t_step)}
        secs.update({(("verify", int(w)), span): float(t) for w, t in t_verify.items()})
        secs[(("draft", "greedy"), span)] = float(t_draft_greedy)
        secs[(("draft", "sampled"), span)] = float(t_draft_sampled)
        secs[(("context",), span)] = float(t_context)
        return cls(dict(meta or {}), secs)

    # ------------------------------------------------------------------ the serving engine

    def sps(self, rows: int, tokens: int, draft: bool, span: int = 0) -> float:
        """Steps/s of the engine's bucket ``(rows, tokens)`` with(out) drafting at ``span``
        (0.0 when it was not profiled)."""
        t = self.get(("engine_step", int(rows), int(tokens), bool(draft)), span)
        return 0.0 if t is None else 1.0 / max(t, 1e-12)

    def budgets(self, rows: int, draft: bool | None = None) -> list[int]:
        """Sorted token budgets profiled for ``rows`` engine rows."""
        return sorted(
            {p[2] for p in self._spans if p[0] == "engine_step" and p[1] == rows and (draft is None or p[3] == draft)}
        )

    def covers_steps(
        self, buckets: Iterable[tuple[int, int]], drafts: Iterable[bool], spans: Iterable[int] = ()
    ) -> bool:
        """True when every engine bucket ``(rows, tokens)`` was profiled for every draft flag (at
        each of ``spans``)."""
        drafts = list(drafts)
        return self.covers([("engine_step", int(r), int(k), bool(d)) for r, k in buckets for d in drafts], spans)

    @classmethod
    def from_steps_per_s(
        cls, sps: Mapping[tuple[int, int, bool], float], span: int, meta: Mapping[str, Any] | None = None
    ) -> CostTable:
        """An engine table of one span from steps/s per ``(rows, tokens, draft)``."""
        return cls(
            dict(meta or {}),
            {(("engine_step", int(r), int(k), bool(d)), int(span)): 1.0 / v for (r, k, d), v in sps.items()},
        )

    # ------------------------------------------------------------------ stored form

    def to_json(self) -> dict[str, Any]:
        """The stored form (seconds exactly; :meth:`from_json` inverts it)."""
        entries = [{"program": list(p), "span": int(s), "seconds": t} for (p, s), t in self.seconds.items()]
        return {"format": FORMAT, "meta": dict(self.meta), "entries": entries}

    @classmethod
    def from_json(cls, obj: Any, source: str = "cost table") -> CostTable:
        """Inverse of :meth:`to_json`.

        Raises:
          DSparkInputError: a malformed table, another format, or an SPS table of the previous
            format (its one-line message asks to re-profile).
        """
        if _old_sps_format(obj):
            raise DSparkInputError(
                f"{source} is an SPS table of the previous format (steps/s without the attention span they were "
                "measured at): re-profile it (delete the file; the engine profiles and writes it again)"
            )
        try:
            if obj["format"] != FORMAT:
                raise DSparkInputError(f"{source} has format {obj['format']!r}, not {FORMAT}: re-profile it")
            seconds: dict[tuple[Program, int], float] = {}
            for e in obj["entries"]:
                prog, span, t = tuple(e["program"]), int(e["span"]), float(e["seconds"])
                if not prog or not isinstance(prog[0], str) or span < 1 or not (math.isfinite(t) and t >= 0):
                    raise ValueError(f"bad entry {e}")
                seconds[(prog, span)] = t
            return cls(dict(obj["meta"]), seconds)
        except (KeyError, TypeError, ValueError) as e:
            raise DSparkInputError(f"malformed {source}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Writes the table as JSON (:meth:`to_json`)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Reads a table written by :meth:`save`.

        Raises:
          DSparkInputError: missing or malformed file, or one of the previous format.
        """
        p = Path(path)
        if not p.exists():
            raise DSparkInputError(f"cost table {p} does not exist")
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise DSparkInputError(f"cost table {p} is not valid JSON: {e}") from None
        return cls.from_json(obj, f"cost table {p}")


def table_key(kind: str, **fields: Any) -> dict:
    """The disk-cache key of a table (:func:`~dspark_jax.decoding.disk_cache.cost_key` with the
    stored :data:`FORMAT`); ``fields``: what it was measured for (configs, dtypes, shapes, spans)."""
    return disk_cache.cost_key(kind, format=FORMAT, **fields)


def stored_table(key: dict) -> CostTable | None:
    """The table stored under ``key`` (:func:`table_key`), or None: none stored, the cache off, a
    refresh requested, or an unreadable file (logged; the caller measures again)."""
    obj = disk_cache.load_costs(key)
    if obj is None:
        return None
    try:
        return CostTable.from_json(obj, "the stored cost table")
    except DSparkInputError as e:
        _log.warning("ignoring %s; measuring again", e)
        return None


def store_table(key: dict, table: CostTable) -> Path | None:
    """Stores ``table`` under ``key`` for later processes; its path (None when the cache is off)."""
    return disk_cache.save_costs(key, table.to_json())
