"""Serving engine: continuous batching with lossless, throughput-scheduled speculative decoding.

The shape of a JAX serving engine (JetStream style): :meth:`Engine.prefill` a request,
:meth:`Engine.insert` it into a free decode slot, :meth:`Engine.generate` one step for all
active slots, :meth:`Engine.free` a slot (:class:`~dspark_jax.serving.engine.interface.EngineInterface`).
docs/design.md#serving, #verification and #scheduler; paper Section 7.

Usage::

    from dspark_jax.api import load_target, load_drafter
    from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams

    target, tok = load_target("stories260k")
    drafter, _ = load_drafter("runs/stories260k/export")
    eng = Engine(target, drafter, EngineConfig(num_slots=8, cache_len=512, policy="dspark"))
    eng.warmup()                                  # compiles every bucket, profiles SPS
    req = Request(tok.encode("Once upon a time"), SamplingParams(temperature=0.8, seed=1), "r0")
    eng.insert(eng.prefill(req), eng.free_slots()[0])
    text_ids = []
    while eng.active_slots():
        for out in eng.generate():                # StepOutput per slot with new tokens
            text_ids += out.token_ids
    print(tok.decode(text_ids), eng.metrics()["mean_accepted_length"])

Static shapes
-------------
``num_slots`` decode rows and ``cache_len`` cache positions are fixed; both models' KV caches
and all per-row state live on the device between steps and are donated to every program
(:mod:`dspark_jax.serving.engine.device`). Active requests are kept in rows ``0..n-1``
(:mod:`dspark_jax.serving.engine.slots`), so a step only touches the first ``R`` rows, ``R`` the
smallest row bucket holding them. A step is compiled per bucket ``(R, K)``: ``K == R`` is a
plain step (every row verifies only its anchor), ``K > R`` a speculative step over ``K``
packed tokens (:meth:`dspark_jax.models.target.Target.forward_packed`). Everything variable is
a mask or a runtime scalar, so after :meth:`Engine.warmup` no step recompiles, whatever the
prompt lengths (prefill pads to buckets), budgets or set of active requests. One step is one
jitted function (:func:`dspark_jax.serving.engine.step_programs.step_program`); the host then reads back,
once, the emitted tokens and the next block's raw confidence logits, and runs the scheduler
(:mod:`dspark_jax.serving.engine.planner`), which never sees draft token values.

Drafter suspension (:mod:`dspark_jax.serving.engine.planner`): a step also writes the drafter's
context keys/values of every verified token, so that drafting can resume at any step; after
``suspend_after`` consecutive non-drafting steps, plain steps drop that upkeep (the
drafter-less program) and a catch-up pass rebuilds the skipped context when drafting resumes.

Verification (:mod:`dspark_jax.serving.engine.step_programs`): Gumbel-coupled by default, so every response
equals, token for token, plain autoregressive sampling with the request's seed whatever the
policy, batch-mates or slot; or the paper's rejection sampling (same output law, higher
acceptance at T > 0). Per-request ``logit_bias`` / ``min_tokens`` / ``logprobs``
(:mod:`dspark_jax.serving.engine.requests`) are runtime flags of the same programs: no recompilation.

Finish handling lives in the engine: EOS ids (the target's plus ``eos_token_ids``) and each
request's ``stop_ids`` end it with ``"stop"`` (the stop token is included, tokens drafted
after it are dropped), ``max_new_tokens`` / the context end with ``"length"`` (verification lengths
are capped so a step never runs past them), non-finite logits with ``"error"``. A finished
slot is released by the engine at the end of the :meth:`Engine.generate` call that reports it
(calling :meth:`Engine.free` on it afterwards is a harmless no-op).
"""

from __future__ import annotations

import os
import time

import numpy as np

from dspark_jax.decoding.cost_table import CostTable, measured_spans
from dspark_jax.drafters.base import prepare_drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target
from dspark_jax.serving.config import EngineConfig
from dspark_jax.serving.engine.counters import EngineMetrics
from dspark_jax.serving.engine.device import EngineDevice, prefill_bucket_list, row_bucket_list, token_ladder
from dspark_jax.serving.engine.inflight import InflightStep, close_step
from dspark_jax.serving.engine.interface import EngineInterface, OneShotPrefill, PrefillResult
from dspark_jax.serving.engine.online_calibration import OnlineCalibrator
from dspark_jax.serving.engine.planner import Planner, catchup_batches, mark_stale, parse_policy
from dspark_jax.serving.engine.prefill import PrefillPasses, chunked_prefill
from dspark_jax.serving.engine.requests import (
    Prefix,
    Request,
    RequestLimits,
    SamplingParams,
    StepOutput,
    bias_table,
    logit_bias,
    stop_set,
    validate_request,
)
from dspark_jax.serving.engine.slots import SlotRecord, SlotTable
from dspark_jax.serving.engine.state import PrefixArrays
from dspark_jax.serving.engine.step_programs import ProgramCache

__all__ = ["Engine", "EngineConfig", "Prefix", "Request", "SamplingParams", "StepOutput", "parse_policy"]


class Engine(EngineInterface):
    """Continuous-batching speculative decoding engine (see the module docstring).

    Args:
      target: the target model.
      drafter: a DSpark/DFlash drafter for it (None: only the ``"plain"`` policy); its decode-time
        state is installed for ``target`` (:func:`~dspark_jax.drafters.base.prepare_drafter`).
      config: the :class:`~dspark_jax.serving.config.EngineConfig` (sizes, policy,
        buckets, verification, chunked prefill, ...; its defaults are the server's).
      sps_table: the SPS table, a :class:`~dspark_jax.decoding.cost_table.CostTable` (or a path to one,
        :meth:`~dspark_jax.decoding.cost_table.CostTable.load`); reused when it was measured for this
        device, model, drafter and shape and covers every bucket at every profiled span, else re-profiled.
      mesh: tensor-parallel serving (docs/design.md#device-mesh): a
        :class:`jax.sharding.Mesh` or a spec such as ``"model:8"``; weights, KV caches and
        programs are sharded over ``model`` (:class:`~dspark_jax.serving.engine.device.EngineDevice`),
        outputs equal the one-device engine's up to float rounding. ``None``: one device.
      program_cache: the :class:`~dspark_jax.serving.engine.step_programs.ProgramCache` holding the
        compiled programs (default: a new one owned by this engine); engines over the same
        models may share one (their programs are keyed by everything that shapes them).

    Raises:
      DSparkInputError: bad sizes, unknown policy or verification mode, a drafter for
        another target, a drafter kind the engine cannot serve (eagle3, which drafts from its
        own cache: evaluate it with :mod:`dspark_jax.decoding.speculative`), or a mesh with
        ``data``/``fsdp`` axes larger than 1 (the engine shards over ``model`` only).

    Attributes:
      device: the :class:`~dspark_jax.serving.engine.device.EngineDevice`: the donated
        :class:`~dspark_jax.serving.engine.state.DecodeState` (``device.state``, read and
        replaced between steps), the placed model states (``device.t_state`` / ``device.d_state``)
        and the compiled programs (``device.step_exe(rows, tokens)``, ``device.run_step(...)``).
      slots: the host's :class:`~dspark_jax.serving.engine.slots.SlotTable` (logical slot ->
        :class:`~dspark_jax.serving.engine.slots.SlotRecord`, rows ``0..n-1`` packed).
      planner: the :class:`~dspark_jax.serving.engine.planner.Planner` (policy, SPS table,
        ``idle_steps`` of the drafter suspension).
      prefill_passes: the :class:`~dspark_jax.serving.engine.prefill.PrefillPasses` behind
        :meth:`prefill` (one-shot prefill: one request alone in one pass of its prefill bucket).
    """

    def __init__(
        self,
        target: Target,
        drafter: DSparkDrafter | None = None,
        config: EngineConfig | None = None,
        *,
        sps_table=None,
        mesh=None,
        program_cache: ProgramCache | None = None,
    ):
        c = self.config = config if config is not None else EngineConfig()
        if not isinstance(c, EngineConfig):
            raise DSparkInputError(f"config must be an EngineConfig, got {type(c).__name__}")
        self._configure(target, drafter, c.num_slots, c.cache_len, c.verification, c.max_logit_bias, c.max_stop_ids)
        self.eos_ids = tuple(sorted(set(int(t) for t in target.cfg.eos_ids) | set(int(t) for t in c.eos_token_ids)))
        self.ladder = token_ladder(c.buckets)
        self.profile_iters = int(c.profile_iters)
        self.row_buckets = row_bucket_list(c.row_buckets, self.num_slots)
        self.prefill_buckets = prefill_bucket_list(c.prefill_buckets, self.cache_len)
        suspend_after = c.suspend_after
        if suspend_after is not None and suspend_after < 0:
            raise DSparkInputError(f"suspend_after must be >= 0 or None, got {suspend_after}")
        self.suspend_after = suspend_after
        self._examples: dict[int, PrefixArrays] = {}
        self._n_top = min(20, target.cfg.vocab_size)
        self.limits = RequestLimits(
            vocab_size=target.cfg.vocab_size,
            max_position=target.cfg.max_position,
            cache_len=self.cache_len,
            max_prompt=self.prefill_buckets[-1],
            max_logit_bias=self.max_logit_bias,
            max_stop_ids=self.max_stop_ids,
            n_top=self._n_top,
            eos_ids=self.eos_ids,
        )
        self.program_cache = program_cache if program_cache is not None else ProgramCache()
        self.device = EngineDevice(
            target,
            drafter,
            num_slots=self.num_slots,
            cache_len=self.cache_len,
            mode=c.verification,
            nb=self._nb,
            n_top=self._n_top,
            mesh=mesh,
            cache=self.program_cache,
        )
        self.mesh = self.device.mesh
        self.calibrator = OnlineCalibrator.seeded(
            max(self.block_size, 1),
            drafter if c.seed_calibration else None,
            window=c.calibration_window,
            lr=c.calibration_lr,
        )
        self.slots = SlotTable(self.num_slots)
        self._warm = False
        self.table_source: str | None = None  # where the SPS table came from (given, stored, profiled)
        self._given_table = (
            CostTable.load(os.fspath(sps_table)) if isinstance(sps_table, (str, os.PathLike)) else sps_table
        )
        self.profile_spans = measured_spans(c.profile_spans, self.cache_len, self.device.base_span)
        self._metrics = EngineMetrics(self.block_size)
        self.planner = Planner(
            self.block_size,
            drafter is not None,
            self.ladder,
            self.row_buckets,
            self.calibrator,
            suspend_after,
            c.policy_for(drafter is not None),
        )
        self.prefill_passes = PrefillPasses(self.device, self.planner, self.limits, self.prefill_buckets)
        self.planner.speculative_ahead = bool(c.plan_ahead)
        self.prefiller = chunked_prefill(self, c.prefill_chunk_tokens)
        self._one_shot = OneShotPrefill(self.prefill, lambda r: validate_request(r, self.limits))
        # _inflight: the step queued on the device, outputs unread; _ready: outputs closed by sync()
        self._overlap, self._inflight, self._ready = bool(c.overlap), None, []

    def _configure(self, target, drafter, num_slots, cache_len, verification, max_logit_bias, max_stop_ids) -> None:
        """Validates and stores the models, sizes and verification mode."""
        if verification not in ("coupled", "rejection"):
            raise DSparkInputError(f"verification must be 'coupled' or 'rejection', got {verification!r}")
        EngineDevice.check_servable(drafter, target.cfg)
        if max_logit_bias < 0 or max_stop_ids < 0:
            raise DSparkInputError(
                f"max_logit_bias and max_stop_ids must be >= 0, got {max_logit_bias}, {max_stop_ids}"
            )
        self.verification = verification
        self.max_logit_bias, self.max_stop_ids = int(max_logit_bias), int(max_stop_ids)
        self._nb = max(1, self.max_logit_bias + self.max_stop_ids)
        if num_slots < 1:
            raise DSparkInputError(f"num_slots must be >= 1, got {num_slots}")
        if cache_len < 2:
            raise DSparkInputError(f"cache_len must be >= 2, got {cache_len}")
        if drafter is not None:
            prepare_drafter(target, drafter)
        self.target, self.drafter = target, drafter
        self.num_slots, self.cache_len = int(num_slots), int(cache_len)
        self.block_size = drafter.cfg.block_size if drafter is not None else 0

    # ------------------------------------------------------------------ configuration

    @property
    def overlap(self) -> bool:
        """Whether the next step stays queued on the device while the host works (``config.overlap``
        at first); setting it first finishes the step in flight (:meth:`sync`)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.sync()
        self._overlap = bool(on)

    @property
    def plan_ahead(self) -> bool:
        """Whether speculative steps are planned before the step in flight is read
        (``config.plan_ahead`` at first; :attr:`Planner.speculative_ahead`); setting it first
        finishes the step in flight (:meth:`sync`)."""
        return self.planner.speculative_ahead

    @plan_ahead.setter
    def plan_ahead(self, on: bool) -> None:
        self.sync()
        self.planner.speculative_ahead = bool(on)

    @property
    def policy(self) -> str:
        """The current policy string."""
        return self.planner.policy

    @property
    def policy_name(self) -> str:
        """``plain``, ``fixed``, ``threshold``, ``greedy`` or ``dspark``."""
        return self.planner.name

    @property
    def policy_arg(self) -> float | int | None:
        """``G`` of ``fixed:G``, ``C`` of ``threshold:C``, else None."""
        return self.planner.arg

    @property
    def sps_table(self) -> CostTable | None:
        """The SPS table the dspark/greedy policies schedule with (None before warm-up)."""
        return self.planner.sps_table

    @sps_table.setter
    def sps_table(self, table: CostTable | None) -> None:
        self.planner.set_table(table)

    def set_policy(self, policy: str) -> None:
        """Switches the verification-length policy (compiles/profiles missing buckets lazily).

        Raises:
          DSparkInputError: bad policy string.
        """
        self.sync()
        self.planner.set_policy(policy)
        self._warm = False

    def budgets(self, rows: int) -> list[int]:
        """Compiled token budgets for ``rows`` rows under the current policy (``rows`` first)."""
        return self.planner.budgets(rows)

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every compiled ``(rows, tokens)`` step shape of the current policy (the row buckets times
        their packed-token budgets; not ``config.buckets``, which are the budgets)."""
        return [(r, k) for r in self.row_buckets for k in self.budgets(r)]

    # ------------------------------------------------------------------ slots

    @property
    def num_active(self) -> int:
        return len(self.slots)

    def free_slots(self) -> list[int]:
        """Free logical slots, ascending."""
        return self.slots.free_slots()

    def active_slots(self) -> list[int]:
        """Occupied logical slots, ascending (including ones finished but not yet reported)."""
        return self.slots.active_slots()

    # ------------------------------------------------------------------ compiled programs

    def warmup(self) -> None:
        """Compiles every bucket (steps, prefill, insert, row moves) and makes sure an SPS
        table covers the current policy's buckets (profiling when needed). After it, no step
        recompiles."""
        self.sync()
        bare = self.row_buckets if (self.drafter is not None and self.suspend_after is not None) else []
        self.prefill_passes.warmup_one_shot(self._examples)
        self.device.compile_all(self.step_shapes(), bare, self._examples)
        if self.prefiller is not None:
            self.prefiller.warmup()
        self.ensure_sps_table()
        self._warm = True

    def ensure_sps_table(self) -> None:
        """Installs the SPS table of the throughput-aware policies (``greedy``, ``dspark``; a
        no-op for the others): the one in use or given, else the one stored on disk for this
        engine's shapes, else profiled now (:meth:`profile_sps`); :attr:`table_source` says which.
        Each must cover every bucket at every span profiled now. :meth:`warmup` calls it."""
        if self.policy_name in ("greedy", "dspark"):
            need, meta = self.step_shapes(), self.device.meta()
            spans = self.device.spans_now(self.profile_spans, len(self.slots))
            if self.planner.adopt_table(meta, need, self._given_table, spans):
                self.table_source = self.table_source or "given"
            elif self.planner.adopt_table(meta, need, self.device.stored_table(), spans):
                self.table_source = "stored"
            else:
                self.profile_sps(spans=spans)

    def profile_sps(self, iters: int | None = None, spans=None) -> CostTable:
        """Times one step of every bucket of the current policy, with and without drafting, at
        each of ``spans`` (default :attr:`profile_spans`;
        :meth:`~dspark_jax.serving.engine.device.EngineDevice.profile`), and stores the table for
        later processes (:mod:`~dspark_jax.decoding.disk_cache`). Returns (and installs) the SPS
        table, a :class:`~dspark_jax.decoding.cost_table.CostTable`. At the default span (one KV
        block) every row is inactive, so no request's state changes: safe at any time.

        Raises:
          DSparkInputError: a span beyond one KV block while requests hold slots.
        """
        self.sync()
        iters = self.profile_iters if iters is None else iters
        spans = self.profile_spans if spans is None else spans
        table = self.device.profile(self.step_shapes(), iters, spans, busy=len(self.slots))
        self.sps_table, self.table_source = table, "profiled"
        self.device.store_table(table)
        return table

    # ------------------------------------------------------------------ requests

    def prefill(self, request: Request) -> Prefix:
        """Runs the target (and drafter) over the prompt and samples the first token: chunked
        prefill's degenerate pass, the request alone in one lane of its prefill bucket
        (:meth:`~dspark_jax.serving.engine.prefill.PrefillPasses.one_shot`). The returned prefix
        also holds the drafter context and the first drafted block while the engine drafts.

        Raises:
          DSparkInputError: empty prompt, unknown token id, prompt too long for
            ``cache_len`` / the model, or bad sampling settings.
        """
        return self.prefill_passes.one_shot(request)

    def supports_chunked_prefill(self) -> bool:
        """Whether :meth:`run_prefill` runs batched, chunked prefill (:attr:`prefiller`, from
        ``config.prefill_chunk_tokens > 0``) rather than one-shot prefill of each request."""
        return self.prefiller is not None

    def _prefill_queue(self):
        return self.prefiller if self.prefiller is not None else self._one_shot

    def queue_prefill(self, request: Request, tag) -> None:
        """Queues ``request`` (known by ``tag``) for :meth:`run_prefill`.

        Raises:
          DSparkInputError: as :meth:`prefill` (nothing is queued then).
        """
        self._prefill_queue().submit(request, tag=tag)

    def run_prefill(self) -> list[PrefillResult]:
        """One prefill pass over the queue: ``(tag, Prefix)`` of each request whose prompt ended in
        it, ``(tag, exception)`` of each it failed: with chunked prefill a failed pass fails every
        queued request (they share its lanes), with one-shot prefill just the one."""
        try:
            return [(tag, out) for tag, out in self._prefill_queue().step()]
        except Exception as e:  # only a chunked pass raises (one-shot prefill hands back its errors)
            return [(entry.tag, e) for entry in self.prefiller.queue.clear()] if self.prefiller else []

    def cancel_prefill(self, tag) -> None:
        """Drops ``tag``'s request from the prefill queue (a no-op if it is not there)."""
        self._prefill_queue().cancel(tag)

    def _check_insert(self, prefix: Prefix, slot: int) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.num_slots):
            raise DSparkInputError(f"slot must be in [0, {self.num_slots}), got {slot}")
        if slot in self.slots:
            raise DSparkInputError(f"slot {slot} is busy: free it first")
        if (
            not isinstance(prefix, Prefix)
            or prefix.bucket_len not in self.prefill_buckets
            or (prefix.arrays is not None and (prefix.arrays.qprob is None) != (self.device.state.qprob is None))
        ):
            raise DSparkInputError("insert needs a Prefix made by this engine's prefill")

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Puts a prefilled request into free logical ``slot``.

        Raises:
          DSparkInputError: slot out of range or busy, or a prefix of another engine.
        """
        self._check_insert(prefix, slot)
        sp = prefix.request.params
        stops = stop_set(sp, self.eos_ids)
        end = min(prefix.prompt_len + int(sp.max_new_tokens), self.target.cfg.max_position, self.cache_len)
        rec = SlotRecord.from_prefix(prefix, stops, end, bool(logit_bias(sp, self.limits)))
        self._metrics.emitted_tokens += len(rec.pending)
        self.slots.add(int(slot), rec)
        if rec.done is not None:
            return
        bias = prefix.bias if prefix.bias is not None else bias_table(sp, prefix.prompt_len, self.limits)
        self.device.run_insert(prefix.bucket_len, prefix.arrays, self.slots.next_row(), prefix.prompt_len, sp, bias)
        self.slots.place(int(slot))
        rec.stale_from = None if prefix.has_context else 0
        rec.push_z(prefix.conf_logit)

    def free(self, slot: int) -> None:
        """Releases ``slot`` (finished, cancelled, disconnected, or a stop string was hit).
        A free slot is a no-op."""
        move = self.slots.remove(int(slot))
        if move is not None:
            src, dst = move
            self.device.run_move(src, dst)

    # ------------------------------------------------------------------ scheduling

    def plan(self) -> tuple[np.ndarray, int, int, bool]:
        """The scheduler's decision for the next step, from host state only.

        Returns:
          ``(lengths [n] int32 drafts verified per active row, rows R, tokens K, draft_next)``.
          Depends on confidences and lengths only, never on draft token values (which stay
          on the device).
        """
        return self.planner.plan(self.slots.row_records())

    def _catch_up(self) -> None:
        """Writes the drafter context of every position a suspended step skipped.

        Each active row whose context stops at ``stale_from`` gets its confirmed tokens at
        positions ``[stale_from, anchor)`` re-run through the target (packed, ``block_size + 1``
        tokens per row per pass, taps on) and their context keys/values written, so that
        drafting resumes exactly as if upkeep had never stopped. Costs about one packed
        target pass per ``block_size + 1`` skipped tokens of the longest gap.
        """
        records = self.slots.row_records()
        if self.drafter is None or all(rec.stale_from is None for rec in records):
            return
        rows = self.planner.rows_for(len(records))
        for packed in catchup_batches(records, rows, self.block_size + 1):
            self.device.run_catchup(rows, packed)
            self._metrics.add_catchup(int(np.sum(packed.pos >= 0)))

    # ------------------------------------------------------------------ decoding

    def _dispatch(self, prev: InflightStep | None = None) -> InflightStep:
        """Plans the next step and dispatches it (asynchronously): the drafter-less program while
        suspended (marking where each row's drafter context stops), else catch-up first, then the
        full step. ``prev``: the step still in flight, whose outputs the host has not read
        (:meth:`~dspark_jax.serving.engine.planner.Planner.plans_ahead` said this may go ahead of
        it; the plan bounds what each row gains from it, a
        :class:`~dspark_jax.serving.engine.planner.Lookahead`)."""
        t0 = time.perf_counter()
        recs = self.slots.row_records()
        la = None
        if prev is not None:
            # After a suspended step, drafting would first need the catch-up of tokens not read yet.
            la = prev.lookahead(recs, self.block_size > 0, may_draft=not prev.suspended)
        else:
            self.planner.deferred = False
        ell, rows, tokens, draft_next = self.planner.plan(recs, la)
        self.planner.drafting = bool(draft_next)
        n = len(recs)
        ell_b, active = np.zeros(self.num_slots, np.int32), np.arange(self.num_slots) < n
        ell_b[:n] = ell
        if n + int(ell.sum()) > tokens or (tokens == rows and ell.any()):
            raise RuntimeError(f"scheduler plan {ell.tolist()} does not fit bucket ({rows}, {tokens})")
        use_bias = any(rec.biased() for rec in recs)  # a stale length only errs towards True
        want_lp = any(rec.n_lp is not None for rec in recs)
        suspended = self.planner.suspend_now(rows, tokens, draft_next)
        if suspended:
            # Planned ahead only after a plain step, whose advance of 1 a row is then exact.
            mark_stale(recs, None if la is None else la.advance)
            out = self.device.run_bare_step(rows, ell_b, active, use_bias, want_lp)
        else:
            self._catch_up()
            out = self.device.run_step(rows, tokens, ell_b, active, draft_next, use_bias, want_lp)
        self.planner.record_step(rows, tokens, draft_next)
        pairs = list(zip(self.slots.row_slots(), recs))
        return InflightStep(out, pairs, ell, (rows, tokens), bool(draft_next), want_lp, suspended, t0)

    def _finish(self, step: InflightStep) -> list[StepOutput]:
        """Reads ``step``'s outputs (blocking until it is done) and closes its rounds: the rows'
        outputs, online calibration and counters; frees the finished rows."""
        host = step.read(self.slots)
        rows, tokens = step.bucket
        n_all = len(step.rows)
        self._metrics.add_step(
            rows, tokens, n_all + int(step.ell.sum()), step.draft_next, step.suspended, time.perf_counter() - step.t0
        )
        outs = close_step(host, step.draft_next, self.block_size, self.calibrator, self._metrics)
        for o in outs:
            if o.finished:
                self.free(o.slot)
        return outs

    def sync(self) -> None:
        """Waits for the step in flight, if any, and closes it: afterwards the device state
        (:attr:`device`) matches the host's records. Its outputs are returned by the next
        :meth:`generate`. Called before anything that runs other programs on the decode state or
        changes the policy (:meth:`warmup`, :meth:`profile_sps`, :meth:`set_policy`)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._ready.extend(self._finish(step))

    def generate(self) -> list[StepOutput]:
        """One speculative (or plain) step for every active slot.

        With ``overlap`` (the default), the next step is already queued on the device when this
        returns (planned and dispatched before this step's outputs were read,
        :meth:`~dspark_jax.serving.engine.planner.Planner.plans_ahead`, else right after this step's
        rounds were closed), so the device does not wait for the host's or the
        caller's work between steps (:mod:`~dspark_jax.serving.engine.inflight`). A request
        inserted after a call joins the step after the queued one.

        Returns:
          one :class:`StepOutput` per slot that produced tokens or finished. Finished slots
          are free when this returns.
        """
        if not self._warm:
            self.warmup()
        outs = self.slots.report_unplaced() + self._ready
        self._ready = []
        step, self._inflight = self._inflight, None
        if step is None:
            if self.slots.num_rows == 0:
                return outs
            step = self._dispatch()
        if self.overlap and self.slots.num_rows > 0 and self.planner.plans_ahead(*step.bucket):
            self._inflight = self._dispatch(prev=step)
        outs += self._finish(step)
        if self.overlap and self._inflight is None and self.slots.num_rows > 0:
            self._inflight = self._dispatch()
        return outs

    # ------------------------------------------------------------------ metrics

    def reset_metrics(self) -> None:
        """Zeroes the cumulative counters (not the calibration)."""
        self._metrics.reset()

    def metrics(self) -> dict:
        """Cumulative counters (docs/design.md#metrics): those of
        :meth:`~dspark_jax.serving.engine.counters.EngineMetrics.counters` (steps, rounds, drafts, draft /
        accepted / emitted / packed tokens, tau as ``mean_accepted_length``, per-position
        acceptance, bucket histograms, suspension and catch-up counts, ...), plus ``policy``,
        ``verification``, ``num_active``, ``scheduler_decision`` (expected tokens/s drafting vs
        plain and the priced catch-up of the last dspark/greedy decision), ``drafting_suspended``,
        ``calibration`` (online temperatures, predicted vs observed: the acceptance of the
        verification mode in use) and ``compiles``.
        """
        decision = self.planner.decision
        return {
            "policy": self.policy,
            "verification": self.verification,
            "num_active": self.num_active,
            # The dspark/greedy policy's last drafting decision: expected tokens/s with and without
            # drafting (SPS table x forecast acceptance), the catch-up it priced in; None before one.
            "scheduler_decision": dict(decision) if decision else None,
            "drafting_suspended": self.planner.suspended(),
            **self._metrics.counters(),
            "calibration": self.calibrator.stats(),
            "compiles": self.device.compiles,
        }
