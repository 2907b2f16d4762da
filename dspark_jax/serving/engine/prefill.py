"""Prefill: one path, batched and chunked (docs/design.md#serving).

Every prefill is a pass of one program
(:func:`dspark_jax.serving.engine.chunk_programs.prefill_chunk_program`): packed prompt tokens
of up to ``lanes`` requests, in lane-aligned blocks, through the target (and the drafter's
context), sampling the first token of each request whose prompt ends in the pass and drafting
its first block while the engine drafts. That request comes back as a
:class:`~dspark_jax.serving.engine.requests.Prefix` (its caches cut to its prefill bucket), which
:meth:`Engine.insert` consumes.

* :class:`ChunkedPrefill` (the server's default): a FIFO of waiting requests
  (:class:`PrefillQueue`); per :meth:`ChunkedPrefill.step`, ONE pass of at most ``chunk_tokens``
  packed prompt tokens from up to ``lanes`` requests, splitting a long prompt across passes. The
  server's engine thread (:class:`dspark_jax.serving.http.engine_loop.EngineLoop`) alternates one
  pass with one decode step, so a stream never waits more than one chunk.
* One-shot prefill (:meth:`dspark_jax.serving.engine.Engine.prefill`,
  :meth:`PrefillPasses.one_shot`) is the degenerate case: the request alone, in one lane and one
  pass of its prefill bucket, whose staging area is its prefix
  (:func:`~dspark_jax.serving.engine.chunk_programs.one_shot_pass_program`). A long prompt then
  stalls the decoding streams for its whole prefill.

A request gets the same prefix (tokens, caches up to float rounding) whichever way, and in
however many chunks, it is prefilled (see :mod:`dspark_jax.serving.engine.chunk_programs`).

Static shapes: a chunked pass compiles once per ``(T, span)``: ``T`` from a small ladder of
token budgets (:func:`chunk_ladder`: ``chunk_tokens`` and a quarter of it), ``span`` (the
attention span) from the engine's prefill buckets; the extraction of a finished lane once per
prefill bucket; the one-shot pass once per prefill bucket. :meth:`ChunkedPrefill.warmup` and
:meth:`PrefillPasses.warmup_one_shot` compile them all, so nothing compiles afterwards.

Usage::

    eng = Engine(target, drafter, EngineConfig(num_slots=8, cache_len=2048, prefill_chunk_tokens=256))
    eng.warmup()
    eng.prefiller.submit(request, tag="r0")
    while len(eng.prefiller):
        for tag, prefix in eng.prefiller.step():   # one pass
            eng.insert(prefix, eng.free_slots()[0])
        eng.generate()                              # one decode step
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, cast

import jax
import numpy as np

from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.serving.engine.chunk_programs import (
    ChunkInputs,
    ChunkSpec,
    LaneSampling,
    PackedChunk,
    extract_program,
    init_stage,
    one_shot_pass_program,
    prefill_chunk_program,
    stage_shardings,
)
from dspark_jax.serving.engine.requests import (
    Prefix,
    Request,
    RequestLimits,
    bias_table,
    lp_entry,
    no_bias,
    validate_request,
)

__all__ = [
    "ChunkPlan",
    "ChunkedPrefill",
    "PrefillEntry",
    "PrefillPasses",
    "PrefillQueue",
    "chunk_ladder",
    "chunked_prefill",
]

ALIGN = 16  # tokens per lane-aligned block (a request's segment starts at a multiple of it)


def chunk_ladder(chunk_tokens: int, block: int) -> list[int]:
    """Compiled token budgets of a pass: ``chunk_tokens`` and, when it is at least ``4 *
    block``, the largest multiple of ``block`` up to a quarter of it (a short prompt alone
    then does not pay for a full chunk).

    Raises:
      DSparkInputError: ``chunk_tokens`` not a positive multiple of ``block``.
    """
    if chunk_tokens < 1 or block < 1 or chunk_tokens % block:
        raise DSparkInputError(f"prefill chunk tokens must be a positive multiple of {block}, got {chunk_tokens}")
    small = (chunk_tokens // 4) // block * block
    return sorted({chunk_tokens} | ({small} if small >= block else set()))


@dataclasses.dataclass(eq=False)
class PrefillEntry:
    """A waiting request in the :class:`PrefillQueue`.

    Attributes:
      request / tag: the request and the caller's handle for it.
      ids: ``[n]`` int32 prompt; done: prompt tokens already prefilled.
      bias: its ``(ids, val, until)`` bias table; lane: its staging lane once started.
      context: every pass so far also wrote its drafter context.
    """

    request: Request
    tag: Any
    ids: np.ndarray
    bias: tuple
    done: int = 0
    lane: int | None = None
    context: bool = True


@dataclasses.dataclass
class ChunkPlan:
    """One pass: ``tokens`` packed tokens (``tok / pos [T]``, ``pos == -1`` padding), the lane
    of each block (``blk_lane [T / block]``), the attention ``span``, ``last [P]`` (index of
    each finishing lane's last prompt token), the entries in the pass and those finishing."""

    tokens: int
    span: int
    tok: np.ndarray
    pos: np.ndarray
    blk_lane: np.ndarray
    last: np.ndarray
    members: list[PrefillEntry]
    finishing: list[PrefillEntry]


class PrefillQueue:
    """Host-side FIFO of waiting prompts, packed into passes.

    Args:
      ladder: compiled token budgets (ascending multiples of ``block``; the largest is the
        per-pass budget).
      spans: compiled attention spans (the engine's prefill buckets; the largest bounds a
        prompt).
      lanes: staging lanes ``P`` (requests per pass at most).
      block: lane-aligned block size ``g``.
    """

    def __init__(self, ladder, spans, lanes: int, block: int):
        self.ladder, self.spans = sorted(ladder), sorted(spans)
        self.lanes, self.block = int(lanes), int(block)
        self._entries: list[PrefillEntry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: PrefillEntry) -> None:
        self._entries.append(entry)

    def cancel(self, tag) -> bool:
        """Drops the entry with ``tag`` (its lane is free for the next pass); False if absent."""
        n = len(self._entries)
        self._entries = [e for e in self._entries if e.tag is not tag]
        return len(self._entries) < n

    def clear(self) -> list[PrefillEntry]:
        """Drops every entry; returns them."""
        out, self._entries = self._entries, []
        return out

    def pack(self) -> ChunkPlan | None:
        """The next pass (None when nothing waits): prompts FIFO, each from where it stopped,
        each segment starting on a block boundary, until the budget or the lanes run out; the
        last one may be split (it keeps its lane and is first next time). Advances the entries
        and removes the finishing ones from the queue."""
        if not self._entries:
            return None
        g, budget = self.block, self.ladder[-1]
        tok, pos = np.zeros(budget, np.int32), np.full(budget, -1, np.int32)
        blk, last = np.zeros(budget // g, np.int32), np.zeros(self.lanes, np.int32)
        busy = {e.lane for e in self._entries if e.lane is not None}
        free = [lane for lane in range(self.lanes) if lane not in busy]
        used, members, finishing = 0, [], []
        for e in self._entries:
            if used >= budget or (e.lane is None and not free):
                break
            if e.lane is None:
                e.lane = free.pop(0)
            n = min(len(e.ids) - e.done, budget - used)
            tok[used : used + n] = e.ids[e.done : e.done + n]
            pos[used : used + n] = np.arange(e.done, e.done + n)
            nb = -(-n // g)
            blk[used // g : used // g + nb] = e.lane
            e.done += n
            members.append(e)
            if e.done == len(e.ids):
                last[e.lane] = used + n - 1
                finishing.append(e)
            used += nb * g
        self._entries = [e for e in self._entries if e not in finishing]
        t = next(r for r in self.ladder if r >= used)
        span = next(s for s in self.spans if s > int(pos.max()))
        return ChunkPlan(t, span, tok[:t], pos[:t], blk[: t // g], last, members, finishing)


class PrefillPasses:
    """The prefill passes of one engine: what every pass shares (whether it drafts and keeps the
    drafter context, its lanes' sampling inputs, the :class:`Prefix` a finishing lane becomes)
    and the degenerate pass, one-shot prefill (:meth:`one_shot`, behind
    :meth:`dspark_jax.serving.engine.Engine.prefill`); :class:`ChunkedPrefill` adds the queue and
    the staging lanes.

    Args:
      device: the engine's :class:`~dspark_jax.serving.engine.device.EngineDevice` (models, program
        cache, mesh).
      planner: the engine's :class:`~dspark_jax.serving.engine.planner.Planner` (whether prefill
        drafts the first block, and whether the drafter context is kept).
      limits: the engine's :class:`RequestLimits` (validation, bias tables).
      prefill_buckets: the engine's prefill buckets (prefix lengths and attention spans).
    """

    def __init__(self, device, planner, limits: RequestLimits, prefill_buckets):
        self.device, self.planner, self.limits = device, planner, limits
        self.prefill_buckets = sorted(prefill_buckets)

    def bucket(self, n: int) -> int:
        """The prefill bucket of an ``n``-token prompt (the smallest that holds it)."""
        return next(b for b in self.prefill_buckets if b >= n)

    def modes(self) -> tuple[bool, bool]:
        """``(drafting, context)`` of a pass run now: whether its finishing requests draft their
        first block (the engine drafts), and whether it writes the drafter context (always
        without a drafter; not while the drafter is suspended; drafting implies it)."""
        d = self.device
        drafting = bool(d.block_size) and self.planner.drafting
        return drafting, d.drafter is None or drafting or not self.planner.suspended()

    def entry(self, request: Request, tag: Any) -> PrefillEntry:
        """A validated :class:`PrefillEntry` of ``request``.

        Raises:
          DSparkInputError: empty prompt, unknown token id, prompt too long for the prefill
            buckets / ``cache_len`` / the model, or bad sampling settings.
        """
        validate_request(request, self.limits)
        ids = np.asarray(request.prompt_ids, np.int32)
        return PrefillEntry(request, tag, ids, bias_table(request.params, len(ids), self.limits))

    def lane_args(self, finishing: list[PrefillEntry], lanes: int, drafting: bool) -> tuple[LaneSampling, tuple]:
        """The :class:`LaneSampling` ``[lanes]`` of the finishing entries (defaults elsewhere;
        ``do_draft`` says which lanes draft their first block) and their ``(ids, val, until)``
        ``[lanes, NB]`` bias tables."""
        p, nb = lanes, self.limits.table_size
        plen, seed, top_k = np.ones(p, np.int32), np.zeros(p, np.int32), np.zeros(p, np.int32)
        temp, top_p, drafted = np.ones(p, np.float32), np.ones(p, np.float32), np.zeros(p, bool)
        b_ids, b_val, b_until = (np.tile(x, (p, 1)) for x in no_bias(nb))
        for e in finishing:
            lane, sp = cast(int, e.lane), e.request.params
            plen[lane], seed[lane], top_k[lane] = len(e.ids), sp.seed, sp.top_k
            temp[lane], top_p[lane] = sp.temperature, sp.top_p
            drafted[lane] = drafting and e.context  # drafting needs the whole prompt's context
            b_ids[lane], b_val[lane], b_until[lane] = e.bias
        return LaneSampling(plen, seed, temp, top_k, top_p, drafted), (b_ids, b_val, b_until)

    def idle_inputs(self, tokens: int, lanes: int, block: int) -> ChunkInputs:
        """An all-padding pass of ``tokens`` tokens over ``lanes`` lanes in blocks of ``block``
        (changes nothing): the example arguments of the pass programs."""
        z = np.zeros(tokens, np.int32)
        packed = PackedChunk(z, z - 1, np.zeros(tokens // block, np.int32), np.zeros(lanes, np.int32))
        lane_in, bias = self.lane_args([], lanes, False)
        return ChunkInputs(packed, lane_in, np.bool_(False), bias)

    @staticmethod
    def prefix(e: PrefillEntry, lane: int, p_len: int, arrays, host: tuple, drafted) -> Prefix:
        """The :class:`Prefix` of entry ``e``, finished in ``lane`` of a pass (``arrays``: its
        :class:`~dspark_jax.serving.engine.state.PrefixArrays` of bucket ``p_len``; ``host``: the
        pass's per-lane ``(token, finite, conf, logprob, top values, top ids)`` read back, the
        logprob ones may be None when ``e`` asked for none; ``drafted [P]`` bool)."""
        tok, finite, conf, c, tv, ti = host
        sp = e.request.params
        first_lp = lp_entry(c[lane], tv[lane], ti[lane], sp.logprobs) if sp.logprobs is not None else None
        z = np.asarray(conf[lane], np.float64) if drafted[lane] else None
        return Prefix(
            e.request, len(e.ids), p_len, int(tok[lane]), bool(finite[lane]), z, arrays, e.context, first_lp, e.bias
        )

    # ------------------------------------------------------------------ one-shot prefill

    def one_shot(self, request: Request) -> Prefix:
        """Prefills ``request`` alone in one pass, chunked prefill's degenerate one (one lane, one
        block of its prefill bucket:
        :func:`~dspark_jax.serving.engine.chunk_programs.one_shot_pass_program`), drafting the
        first block and writing the drafter context as :meth:`modes` says.

        Raises:
          DSparkInputError: as :meth:`entry`.
        """
        e = self.entry(request, request)
        n, p_len = len(e.ids), self.bucket(len(e.ids))
        drafting, context = self.modes()
        e.lane, e.context = 0, context
        lanes, bias = self.lane_args([e], 1, drafting)
        tok, pos = np.zeros(p_len, np.int32), np.full(p_len, -1, np.int32)
        tok[:n], pos[:n] = e.ids, np.arange(n)
        packed = PackedChunk(tok, pos, np.zeros(1, np.int32), np.full(1, n - 1, np.int32))
        d = self.device
        inp = ChunkInputs(packed, lanes, np.bool_(context), bias)
        arrays, finite, lp = self._one_shot_exe(p_len)(d.t_state, d.d_state, inp)
        # The logprob arrays are only read back when the request asked for them.
        want = lp if request.params.logprobs is not None else (None, None, None)
        t, f, conf, lp_host = jax.device_get((arrays.token, finite, arrays.conf, want))
        host = (np.reshape(t, 1), np.reshape(f, 1), np.asarray(conf)[None], *lp_host)
        return self.prefix(e, 0, p_len, arrays, host, lanes.do_draft)

    def _one_shot_exe(self, p_len: int):
        d = self.device

        def make():
            spec = ChunkSpec(p_len, p_len, d.block_size, d.mode, d.n_top)
            fn = partial(one_shot_pass_program, t_graph=d.t_graph, d_graph=d.d_graph, spec=spec)
            return fn, (d.t_state, d.d_state, self.idle_inputs(p_len, 1, p_len))

        return d._get(("prefill", p_len), make)

    def warmup_one_shot(self, examples: dict) -> None:
        """Compiles the one-shot pass of every prefill bucket; ``examples`` (bucket ->
        :class:`~dspark_jax.serving.engine.state.PrefixArrays`, the insert programs' example
        arguments) gets an all-padding pass's prefix for every bucket it lacks."""
        d = self.device
        for p in self.prefill_buckets:
            exe = self._one_shot_exe(p)
            if p not in examples:
                examples[p] = exe(d.t_state, d.d_state, self.idle_inputs(p, 1, p))[0]


class ChunkedPrefill(PrefillPasses):
    """Batched, chunked prefill of one engine (see the module doc).

    Args:
      device / planner / limits / prefill_buckets: as :class:`PrefillPasses`; the staging area
        lives beside the device's decode state.
      chunk_tokens: prompt tokens per pass at most.
      lanes: requests per pass at most (staging rows; default ``min(4, chunk_tokens //
        block)``).
      block: lane-aligned block size (default ``gcd(chunk_tokens, 16)``).

    Raises:
      DSparkInputError: ``chunk_tokens`` not a positive multiple of ``block``, or ``lanes < 1``.
    """

    def __init__(
        self,
        device,
        planner,
        limits: RequestLimits,
        prefill_buckets,
        chunk_tokens: int,
        *,
        lanes: int | None = None,
        block: int | None = None,
    ):
        chunk_tokens = int(chunk_tokens)
        block = int(block) if block is not None else math.gcd(max(chunk_tokens, 1), ALIGN)
        ladder = chunk_ladder(chunk_tokens, block)
        lanes = int(lanes) if lanes is not None else min(4, chunk_tokens // block)
        if lanes < 1:
            raise DSparkInputError(f"prefill lanes must be >= 1, got {lanes}")
        super().__init__(device, planner, limits, prefill_buckets)
        self.chunk_tokens, self.lanes, self.block = chunk_tokens, lanes, block
        self.queue = PrefillQueue(ladder, self.prefill_buckets, lanes, block)
        d = device
        self.stage = init_stage(d.target, d.drafter, lanes, self.prefill_buckets[-1])
        self._shardings = None
        if d.mesh is not None:
            d_cfg = d.drafter.cfg if d.drafter is not None else None
            st = stage_shardings(d.mesh, d.target.cfg, d_cfg)
            self.stage = shd.place(self.stage, st)
            self._shardings = (st, shd.replicated(d.mesh))
        self._example = None  # a pass's outputs: the extraction programs' example argument
        self.passes = 0  # passes run (benchmarks read it)

    def __len__(self) -> int:
        """Requests waiting or being prefilled."""
        return len(self.queue)

    @property
    def ladder(self) -> list[int]:
        return self.queue.ladder

    # ------------------------------------------------------------------ requests

    def submit(self, request: Request, tag: Any = None) -> None:
        """Queues ``request`` (``tag``: returned with its prefix; default the request).

        Raises:
          DSparkInputError: the request is invalid for the engine (as :meth:`Engine.prefill`).
        """
        self.queue.add(self.entry(request, request if tag is None else tag))

    def cancel(self, tag: Any) -> bool:
        """Drops a waiting or half-prefilled request; False if it is not queued."""
        return self.queue.cancel(tag)

    def step(self) -> list[tuple[Any, Prefix]]:
        """Runs one pass; returns ``(tag, Prefix)`` of every request whose prompt ended in it."""
        plan = self.queue.pack()
        if plan is None:
            return []
        d = self.device
        drafting, context = self.modes()
        for e in plan.members:
            e.context = e.context and context
        lanes, bias = self.lane_args(plan.finishing, self.lanes, drafting)
        inp = ChunkInputs(PackedChunk(plan.tok, plan.pos, plan.blk_lane, plan.last), lanes, np.bool_(context), bias)
        self.stage, out = self._chunk_exe(plan.tokens, plan.span)(d.t_state, d.d_state, self.stage, inp)
        self.passes += 1
        if not plan.finishing:
            return []
        host = jax.device_get((out.token, out.finite, out.conf, out.logprob, out.top_values, out.top_ids))
        done = []
        for e in plan.finishing:
            lane, p_len = cast(int, e.lane), self.bucket(len(e.ids))
            arrays = self._extract_exe(p_len, out)(self.stage, out, np.int32(lane))
            done.append((e.tag, self.prefix(e, lane, p_len, arrays, host, lanes.do_draft)))
        return done

    def prefill(self, requests) -> list[Prefix]:
        """Prefills ``requests`` (submitted now, after anything already queued) in as many
        passes as needed; returns their prefixes in order (tests, benchmarks).

        Raises:
          DSparkInputError: an invalid request (nothing is queued then).
        """
        for r in requests:
            validate_request(r, self.limits)
        tags = [object() for _ in requests]
        for r, tag in zip(requests, tags):
            self.submit(r, tag)
        got: dict[int, Prefix] = {}
        while len(self.queue) and not all(id(t) in got for t in tags):
            got.update((id(tag), p) for tag, p in self.step())
        return [got[id(t)] for t in tags]

    # ------------------------------------------------------------------ device programs

    def _chunk_exe(self, tokens: int, span: int):
        d = self.device

        def make():
            spec = ChunkSpec(span, self.block, d.block_size, d.mode, d.n_top)
            fn = partial(prefill_chunk_program, t_graph=d.t_graph, d_graph=d.d_graph, spec=spec)
            return fn, (d.t_state, d.d_state, self.stage, self.idle_inputs(tokens, self.lanes, self.block))

        key = ("prefill_chunk", tokens, span, self.lanes, self.block)
        return d._get(key, make, donate=(2,), out_shardings=self._shardings)

    def _extract_exe(self, p_len: int, out):
        d = self.device

        def make():
            return partial(extract_program, p_len=p_len), (self.stage, out, np.int32(0))

        shardings = None if d.mesh is None else d.out_shardings("prefill")[0]
        return d._get(("prefill_extract", p_len, self.lanes), make, out_shardings=shardings)

    def warmup(self) -> None:
        """Compiles the pass of every ``(T, span)`` and the extraction of every prefill bucket
        (one all-padding pass, which changes nothing, provides their example outputs)."""
        for t in self.ladder:
            for s in self.prefill_buckets:
                self._chunk_exe(t, s)
        if self._example is None:
            d, t, s = self.device, self.ladder[0], self.prefill_buckets[0]
            idle = self.idle_inputs(t, self.lanes, self.block)
            self.stage, self._example = self._chunk_exe(t, s)(d.t_state, d.d_state, self.stage, idle)
        for p in self.prefill_buckets:
            self._extract_exe(p, self._example)


def chunked_prefill(engine, chunk_tokens: int) -> ChunkedPrefill | None:
    """The :class:`ChunkedPrefill` of ``engine`` (an :class:`~dspark_jax.serving.engine.Engine`
    under construction: its device, planner, limits and prefill buckets) with ``chunk_tokens``
    per pass, or None for 0 (one-shot prefill only).

    Raises:
      DSparkInputError: ``chunk_tokens`` negative or not a multiple of its block size.
    """
    chunk_tokens = int(chunk_tokens)
    if chunk_tokens < 0:
        raise DSparkInputError(f"prefill_chunk_tokens must be >= 0 (0: one-shot prefill), got {chunk_tokens}")
    if chunk_tokens == 0:
        return None
    return ChunkedPrefill(engine.device, engine.planner, engine.limits, engine.prefill_buckets, chunk_tokens)
