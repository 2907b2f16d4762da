"""OpenAI-compatible HTTP server over the continuous-batching speculative engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and Prometheus ``GET /metrics``.

Architecture (DESIGN.md, "serve"): one background thread, :class:`EngineLoop`, owns the
:class:`~dspark_jax.serving.engine.Engine` and is the only thread that touches JAX. Each iteration
it (1) frees the slots of aborted requests (client disconnects, stop strings), (2) admits
waiting requests into free slots (``prefill`` + ``insert``), (3) runs one speculative step
for all active slots (``generate``) and hands each request its new token ids (and logprobs,
speculative counts) with ``loop.call_soon_threadsafe`` to an ``asyncio.Queue``. It never
detokenizes. The asyncio side validates, tokenizes, enqueues, and per request
(:class:`OutputState`) detokenizes incrementally (``Tokenizer.detokenizer``: UTF-8-safe,
O(1) per token, never a half character), matches stop strings and formats. The waiting
queue is bounded (``max_queue``): a full queue answers 429. Shutdown (uvicorn's graceful
drain, then the app's lifespan end) stops the thread after failing whatever is still
queued with 503.

Requests: every field the server does not honour is refused with 400 naming it (the
request models forbid undeclared fields); declared fields with values the engine cannot
honour (``presence_penalty`` != 0, ``echo``, ...) are refused too. A ``model`` other than
the served name gets 404 (as vLLM). ``max_tokens`` defaults as in vLLM: 16 for
completions, the rest of the context for chat (``--default-max-tokens`` overrides both).
``n`` > 1 runs ``n`` requests: choice ``i`` is exactly what the same request with
``seed + i`` (wrapped into int32) returns as its only choice. ``logit_bias``,
``logprobs`` / ``top_logprobs`` and ``min_tokens`` are passed to the engine
(:class:`~dspark_jax.serving.engine.SamplingParams`); logprobs are the target's raw log-softmax
(vLLM's default). ``min_tokens`` also holds back stop strings until that many tokens
were generated (as vLLM).

Exactness: the engine's output for a request depends only on its prompt, sampling
parameters and seed, never on its batch-mates (the exactness issue). A stop string ends
the request at the first token whose text completes an occurrence (the text is cut
before it; the token is kept in ``token_ids``), so the response is the same whether the
engine emitted those tokens in one step or several.

Per-request speculative metrics are returned in a ``spec_decode`` object beside
``usage``: ``num_steps`` (target verification passes that gave the response at least
one token), ``num_draft_tokens`` (draft tokens verified, none counted after a stop),
``num_accepted_tokens`` (accepted drafts in the response), ``acceptance_rate`` = accepted
/ verified and ``tau`` = ``(completion_tokens - 1) / num_steps``: returned tokens per
verification pass, the first token (sampled at prefill) excluded. This is
:class:`dspark_jax.decoding.speculative.Generation`'s tau, the one definition (``generate --json``, the
Python API and ``/metrics``' ``dspark:spec_decode_mean_accepted_length`` use it too).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import secrets
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from dspark_jax import __version__
from dspark_jax.errors import DSparkInputError

log = logging.getLogger("dspark_jax.serving.server")

__all__ = [
    "EngineLoop",
    "OutputState",
    "QueueFullError",
    "ServerClosedError",
    "ServerConfig",
    "choice_seed",
    "create_app",
]

SEED_RANGE = (-(2**31), 2**31 - 1)  # the engine's PRNG seeds are int32
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
LOGIT_BIAS_RANGE = 100.0


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class ServerClosedError(RuntimeError):
    """The engine loop is stopped or stopping (HTTP 503)."""


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice ``i`` of a request with ``seed``: ``seed + i`` wrapped into int32."""
    lo = SEED_RANGE[0]
    return (int(seed) + int(i) - lo) % 2**32 + lo


# --------------------------------------------------------------------------- request tracking


@dataclasses.dataclass
class RequestEvent:
    """What the engine thread hands a request's asyncio queue: one engine output.

    ``kind``: ``"delta"`` (new tokens, more to come), ``"final"`` (the request ended;
    ``finish_reason`` is ``stop``/``length``/``abort``), ``"error"`` (``message`` and the
    HTTP ``status`` it maps to). ``index``: the choice. ``token_ids`` / ``logprobs``: as
    ``StepOutput`` (logprobs None unless requested). ``num_verified`` / ``num_accepted``:
    the step's draft counts. ``with_prefill_token``: ``token_ids[0]`` was sampled at
    prefill (the request's first output), so not by this step's verification pass.
    """

    kind: Literal["delta", "final", "error"]
    index: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    num_verified: int = 0
    num_accepted: int = 0
    with_prefill_token: bool = False
    finish_reason: str | None = None
    message: str = ""
    status: int = 500


@dataclasses.dataclass(eq=False)
class TrackedRequest:
    """An engine request between the HTTP handler and the engine thread (one per choice).

    The engine thread writes ``slot``/``admitted_at``/``started``/``done``; the handler
    reads ``done`` only to decide whether an abort is still needed.
    """

    request: Any  # dspark_jax.serving.engine.Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    slot: int | None = None
    admitted_at: float | None = None
    started: bool = False  # the first output (with the prefill token) was handed out
    done: bool = False  # set by the engine thread when the final/error event is queued

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _put(self, ev: RequestEvent) -> None:
        ev.index = self.index
        # RuntimeError: the event loop is closed, nobody is listening any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)


@dataclasses.dataclass
class Update:
    """What one engine output adds to a choice: ``text`` safe to send now (complete
    characters, nothing that could still become a stop string), the ``token_ids`` kept
    (after a stop-string cut), their ``logprobs`` (or None) and ``finish_reason`` (None
    while running)."""

    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None


class OutputState:
    """One choice's output on the asyncio side: incremental detokenization, stop
    strings, logprobs and speculative counts.

    Args:
      tracked: the engine request.
      tokenizer: a :class:`dspark_jax.models.tokenizer.Tokenizer` (``detokenizer()``).
      stop: stop strings (non-empty).
      min_tokens: stop strings are not matched before this many generated tokens.
    """

    def __init__(self, tracked: TrackedRequest, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tracked = tracked
        self.detok = tokenizer.detokenizer(skip_special_tokens=True)
        self.stop = tuple(stop)
        self.hold = max((len(x) for x in self.stop), default=1) - 1
        self.min_tokens = int(min_tokens)
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out
        self.token_ids: list[int] = []
        self.logprobs: list | None = None
        self.num_steps = self.num_emitted = self.num_verified = self.num_accepted = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def index(self) -> int:
        return self.tracked.index

    def feed(self, ev: RequestEvent) -> Update:
        """Applies one ``delta``/``final`` event (see :class:`RequestEvent`)."""
        ids = [int(i) for i in ev.token_ids]
        keep, finish = len(ids), (ev.finish_reason or "stop") if ev.kind == "final" else None
        for j, tid in enumerate(ids):
            before = len(self.text)
            self.text += self.detok.step(tid)
            if self.stop and len(self.token_ids) + j + 1 >= self.min_tokens and len(self.text) > before:
                # an occurrence that ends in this token's text (earlier ones were found earlier,
                # or held back by min_tokens)
                hits = [k for k in (self.text.find(x, max(0, before - len(x) + 1)) for x in self.stop) if k >= 0]
                if hits:
                    self.text, keep, finish = self.text[: min(hits)], j + 1, "stop"
                    break
        pre = 1 if ev.with_prefill_token else 0
        total_pass, kept_pass = max(0, len(ids) - pre), max(0, keep - pre)
        n_ver, n_acc = int(ev.num_verified), int(ev.num_accepted)
        if kept_pass < total_pass:  # a stop string inside the block: nothing after it counts
            n_ver, n_acc = min(n_ver, kept_pass), min(n_acc, kept_pass)
        if kept_pass:
            self.num_steps += 1
            self.num_emitted += kept_pass
        self.num_verified += n_ver
        self.num_accepted += n_acc
        new_ids = ids[:keep]
        new_lps = None
        if ev.logprobs is not None:
            new_lps = list(ev.logprobs[:keep])
            self.logprobs = (self.logprobs or []) + new_lps
        self.token_ids += new_ids
        if new_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if finish is not None:
            end = len(self.text)
            self.finish_reason, self.finished_at = finish, time.monotonic()
        else:
            end = max(self.sent, len(self.text) - self.hold)
        text, self.sent = self.text[self.sent : end], end
        return Update(text, new_ids, new_lps, finish)

    def spec_decode(self) -> dict[str, Any]:
        """Per-choice speculative metrics (tau as :class:`dspark_jax.decoding.speculative.Generation`)."""
        return _spec_dict(self.num_steps, self.num_emitted, self.num_verified, self.num_accepted)


def event_from_output(out, first: bool) -> RequestEvent:
    """The :class:`RequestEvent` of one engine ``StepOutput`` (not an error); ``first``: the
    request's first output (it carries the token sampled at prefill)."""
    finish = (out.finish_reason or "stop") if out.finished else None
    lps = getattr(out, "logprobs", None)
    return RequestEvent(
        "final" if finish else "delta",
        token_ids=[int(i) for i in out.token_ids],
        logprobs=list(lps) if lps is not None else None,
        num_verified=int(out.num_verified),
        num_accepted=int(out.num_accepted),
        with_prefill_token=first,
        finish_reason=finish,
    )


def _spec_dict(steps: int, emitted: int, verified: int, accepted: int) -> dict[str, Any]:
    return {
        "num_steps": steps,
        "num_draft_tokens": verified,
        "num_accepted_tokens": accepted,
        "acceptance_rate": (accepted / verified) if verified else None,
        "tau": (emitted / steps) if steps else None,
    }


# --------------------------------------------------------------------------- metrics


class ServerMetrics:
    """Prometheus metrics with vLLM-like names (``dspark:`` prefix), in their own registry.

    Request-level series are updated by the engine thread and the handlers; the engine's
    cumulative speculative counters (drafts, draft tokens, accepted tokens, per-position
    acceptance, online-calibration temperatures) are read at scrape time from the last
    snapshot the engine thread took, so a scrape never calls into JAX.
    """

    def __init__(self, loop: EngineLoop, model_name: str):
        disable_created_metrics()  # no `_created` series (process-wide; as vLLM's exposition)
        self.registry = CollectorRegistry(auto_describe=True)
        lbl = dict(labelnames=["model_name"], registry=self.registry)
        self.model_name = model_name
        self.request_success = Counter(
            "dspark:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_rejected = Counter(
            "dspark:request_rejected",
            "Requests refused (HTTP status).",
            ["model_name", "status"],
            registry=self.registry,
        )
        self.request_aborted = Counter("dspark:request_aborted", "Requests aborted by a client disconnect.", **lbl)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prefilled prompt tokens.", **lbl)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated (returned) tokens.", **lbl)
        lat = (
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
            20.0,
            40.0,
            80.0,
        )
        self.ttft = Histogram(
            "dspark:time_to_first_token_seconds",
            "Time to first token (arrival to first token handed to the client).",
            buckets=lat,
            **lbl,
        )
        self.tpot = Histogram(
            "dspark:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=lat,
            **lbl,
        )
        self.e2e = Histogram(
            "dspark:e2e_request_latency_seconds", "Arrival to last token.", buckets=lat + (160.0, 320.0, 640.0), **lbl
        )
        self.queue_time = Histogram(
            "dspark:request_queue_time_seconds",
            "Arrival to admission into a slot.",
            buckets=lat + (160.0, 320.0, 640.0),
            **lbl,
        )
        self.step_seconds = Histogram(
            "dspark:engine_step_seconds", "Wall time of one engine generate() step.", buckets=lat, **lbl
        )
        # Speculative counts of the responses (summed over finished requests, the same numbers
        # as each response's ``spec_decode``: after stop strings and stop tokens).
        self._spec_lock = threading.Lock()
        self.spec = {"rounds": 0, "emitted": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.registry.register(_EngineCollector(loop, model_name, self))

    def add_spec(self, rounds: int, emitted: int, draft_tokens: int, accepted_tokens: int) -> None:
        """Adds one finished request's ``spec_decode`` counts (any thread)."""
        with self._spec_lock:
            self.spec["rounds"] += rounds
            self.spec["emitted"] += emitted
            self.spec["draft_tokens"] += draft_tokens
            self.spec["accepted_tokens"] += accepted_tokens

    def spec_snapshot(self) -> dict[str, int]:
        with self._spec_lock:
            return dict(self.spec)

    def labels(self, **kw):
        return dict(model_name=self.model_name, **kw)


class _EngineCollector:
    """Scrape-time gauges/counters from the engine loop's last snapshot."""

    def __init__(self, loop: EngineLoop, model_name: str, server_metrics: ServerMetrics):
        self.loop, self.model_name, self.server_metrics = loop, model_name, server_metrics

    def describe(self):
        return []

    def collect(self):
        snap = self.loop.snapshot()
        m = snap.get("engine", {})
        name = self.model_name

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], float(value))
            return c

        yield gauge("dspark:num_requests_running", "Requests in decode slots.", snap["running"])
        yield gauge("dspark:num_requests_waiting", "Requests in the waiting queue.", snap["waiting"])
        yield gauge("dspark:num_slots", "Decode slots of the engine.", snap["num_slots"])
        yield gauge("dspark:num_free_slots", "Free decode slots.", snap["free_slots"])
        yield counter("dspark:engine_steps", "Engine generate() steps.", snap["steps"])
        spec = self.server_metrics.spec_snapshot()
        for key, metric, doc in (
            (
                "draft_tokens",
                "dspark:spec_decode_num_draft_tokens",
                "Draft tokens verified (finished requests; drafts after a stop are not counted).",
            ),
            (
                "accepted_tokens",
                "dspark:spec_decode_num_accepted_tokens",
                "Draft tokens accepted and returned (finished requests).",
            ),
            (
                "emitted",
                "dspark:spec_decode_num_emitted_tokens",
                "Returned tokens that came from target "
                "verification passes (finished requests; "
                "the prefill token excluded).",
            ),
            (
                "rounds",
                "dspark:spec_decode_num_rounds",
                "Target verification passes that gave a finished request at least one returned token.",
            ),
        ):
            yield counter(metric, doc, spec[key])
        yield gauge(
            "dspark:spec_decode_mean_accepted_length",
            "tau: returned tokens per target verification "
            "pass, the prefill token excluded (num_emitted_tokens / num_rounds; decode.Generation.tau).",
            spec["emitted"] / spec["rounds"] if spec["rounds"] else float("nan"),
        )
        yield gauge(
            "dspark:spec_decode_acceptance_rate",
            "Accepted / verified draft tokens (finished requests).",
            spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else float("nan"),
        )
        for key, metric, doc in (
            ("drafts", "dspark:spec_decode_num_drafts", "Request-steps that verified at least one draft token."),
            (
                "emitted_tokens",
                "dspark:engine_emitted_tokens",
                "Tokens the engine emitted (prefill tokens, "
                "accepted drafts, corrections and bonus tokens; "
                "before stop strings).",
            ),
            (
                "rounds",
                "dspark:engine_rounds",
                "Engine request-steps (target verification passes summed over requests).",
            ),
            ("packed_tokens", "dspark:engine_packed_tokens", "Tokens in verification passes (anchors + drafts)."),
            ("draft_steps", "dspark:engine_draft_steps", "Engine steps that ran the drafter."),
            (
                "suspended_steps",
                "dspark:engine_suspended_steps",
                "Plain engine steps that skipped drafter context upkeep (drafter suspended).",
            ),
            (
                "catchup_tokens",
                "dspark:engine_catchup_tokens",
                "Tokens re-run through the target to rebuild skipped drafter context.",
            ),
            ("step_seconds", "dspark:engine_busy_seconds", "Seconds spent inside engine steps."),
        ):
            if m.get(key) is not None:
                yield counter(metric, doc, m[key])
        dec = m.get("scheduler_decision")
        if dec:  # why the dspark policy drafts or not (engine.Engine._want_drafts)
            g = GaugeMetricFamily(
                "dspark:scheduler_expected_tokens_per_s",
                "The scheduler's expected output tokens/s of its next step with and without "
                "drafting (SPS table x forecast acceptance).",
                labels=["model_name", "mode"],
            )
            g.add_metric([name, "drafting"], float(dec["tokens_per_s_drafting"]))
            g.add_metric([name, "plain"], float(dec["tokens_per_s_plain"]))
            yield g
            yield gauge(
                "dspark:scheduler_catchup_seconds",
                "Catch-up cost priced into the last decision to resume drafting (0 unless suspended).",
                dec["catchup_seconds"],
            )
        if m.get("drafting_suspended") is not None:
            yield gauge(
                "dspark:scheduler_drafting_suspended",
                "1 while the drafter is suspended (plain steps without drafter context upkeep).",
                int(m["drafting_suspended"]),
            )
        for key, metric, doc in (
            (
                "position_accepted",
                "dspark:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by block position (1-based).",
            ),
            (
                "position_reached",
                "dspark:spec_decode_num_verified_tokens_per_pos",
                "Verified draft tokens by block position (1-based).",
            ),
        ):
            if m.get(key) is not None:
                c = CounterMetricFamily(metric, doc, labels=["model_name", "position"])
                for i, v in enumerate(_as_list(m[key])):
                    c.add_metric([name, str(i + 1)], float(v))
                yield c
        for key, label, metric, doc in (
            ("budget_hist", "tokens", "dspark:engine_steps_by_budget", "Engine steps by packed-token budget."),
            ("rows_hist", "rows", "dspark:engine_steps_by_rows", "Engine steps by row bucket."),
        ):
            if isinstance(m.get(key), dict):
                c = CounterMetricFamily(metric, doc, labels=["model_name", label])
                for k, v in sorted(m[key].items()):
                    c.add_metric([name, str(k)], float(v))
                yield c
        for key, metric, doc in (
            ("compiles", "dspark:engine_compiles", "Compiled step/prefill executables (constant after warm-up)."),
        ):
            if isinstance(m.get(key), (int, float)):
                yield gauge(metric, doc, m[key])
        cal = m.get("calibration") or {}
        for key, metric, doc in (
            (
                "temperatures",
                "dspark:calibration_temperature",
                "Online-calibrated confidence temperature T_k by block position (1-based).",
            ),
            (
                "predicted",
                "dspark:calibration_predicted_acceptance",
                "Sliding-window mean calibrated confidence c_k by block position.",
            ),
            (
                "observed",
                "dspark:calibration_observed_acceptance",
                "Sliding-window observed conditional acceptance by block position.",
            ),
            (
                "observations",
                "dspark:calibration_window_observations",
                "Observations in the calibration window by block position.",
            ),
        ):
            if cal.get(key) is not None:
                g = GaugeMetricFamily(metric, doc, labels=["model_name", "position"])
                for i, v in enumerate(_as_list(cal[key])):
                    if v is not None and math.isfinite(float(v)):
                        g.add_metric([name, str(i + 1)], float(v))
                yield g


def _as_list(x) -> list:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return list(x) if isinstance(x, (list, tuple)) else [x]


# --------------------------------------------------------------------------- the engine thread


class EngineLoop:
    """The background thread that drives an :class:`~dspark_jax.serving.engine.Engine`.

    Args:
      engine: a warmed-up engine (``prefill/insert/generate/free/active_slots/free_slots/
        metrics``, ``num_slots``); only this thread calls it after :meth:`start`.
      tokenizer: kept for callers (the loop itself never detokenizes).
      max_queue: waiting requests (not yet in a slot) beyond which :meth:`submit`
        raises :class:`QueueFullError`; may be changed at run time.
      model_name: the ``model`` label of the metrics.
    """

    def __init__(self, engine, tokenizer, *, max_queue: int = 256, model_name: str = "dspark"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = int(max_queue)
        self.num_slots = int(engine.num_slots)
        self._cv = threading.Condition()
        self._waiting: collections.deque[TrackedRequest] = collections.deque()
        self._aborts: dict[str, bool] = {}  # request id -> count it as a client abort
        self._running: dict[int, TrackedRequest] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._engine_metrics: dict = {}
        self._snap_running = 0
        self._snap_free = self.num_slots
        self.last_error: str | None = None
        self.metrics = ServerMetrics(self, model_name)

    # ---- asyncio side (any thread)

    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is None:
            self._engine_metrics = _safe_metrics(self.engine)
            self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stops the thread after the current step; queued and running requests get a 503 error."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, *tracked: TrackedRequest) -> None:
        """Queues requests for admission, all or none (the ``n`` choices of one HTTP request).

        Raises:
          QueueFullError: fewer than ``len(tracked)`` places left in the waiting queue.
          ServerClosedError: the loop is stopping or not running.
        """
        with self._cv:
            if self._stopping or self._thread is None:
                raise ServerClosedError("the server is shutting down")
            if len(self._waiting) + len(tracked) > self.max_queue:
                raise QueueFullError(
                    f"the waiting queue is full ({len(self._waiting)} requests waiting, "
                    f"max_queue={self.max_queue}, {self.num_slots} slots busy): retry later"
                )
            self._waiting.extend(tracked)
            self._cv.notify_all()

    def abort(self, request_id: str, count: bool = True) -> None:
        """Asks the engine thread to drop a request (waiting or running) and free its slot.

        ``count``: a client abort (``dspark:request_aborted``); False when the request
        ended on the asyncio side (a stop string)."""
        with self._cv:
            self._aborts[request_id] = self._aborts.get(request_id, False) or count
            self._cv.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Slot occupancy, queue length, step count and the engine's cumulative metrics."""
        with self._cv:
            return {
                "num_slots": self.num_slots,
                "running": self._snap_running,
                "free_slots": self._snap_free,
                "waiting": len(self._waiting),
                "steps": self._steps,
                "engine": dict(self._engine_metrics),
                "alive": self.alive,
                "last_error": self.last_error,
            }

    # ---- engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._waiting or self._aborts or self._running):
                        self._cv.wait()
                    if self._stopping:
                        break
                    aborts, self._aborts = self._aborts, {}
                    dropped = [t for t in self._waiting if t.request_id in aborts]
                    if dropped:
                        self._waiting = collections.deque(t for t in self._waiting if t.request_id not in aborts)
                for t in dropped:
                    self._abort(t, aborts[t.request_id])
                for _slot, t in list(self._running.items()):
                    if t.request_id in aborts:
                        self._abort(t, aborts[t.request_id])
                self._admit()
                self._update_snapshot()
                if self._running:
                    self._step()
                    self._update_snapshot()
        except BaseException:  # pragma: no cover - a bug in the loop itself; keep the server answering
            self.last_error = traceback.format_exc()
            log.error("engine loop crashed:\n%s", self.last_error)
        finally:
            with self._cv:
                self._stopping = True
                pending = list(self._waiting) + list(self._running.values())
                self._waiting.clear()
            for t in pending:
                if t.slot is not None:
                    self._free_slot(t)
                t.done = True
                t._put(RequestEvent("error", message="the server is shutting down", status=503))
            self._running.clear()
            self._update_snapshot()

    def _admit(self) -> None:
        while True:
            free = [s for s in range(self.num_slots) if s not in self._running]
            if not free:
                return
            with self._cv:
                if not self._waiting:
                    return
                t = self._waiting.popleft()
            try:
                prefix = self.engine.prefill(t.request)
                self.engine.insert(prefix, free[0])
            except DSparkInputError as e:
                t.done = True
                t._put(RequestEvent("error", message=str(e), status=400))
                continue
            except Exception as e:
                log.exception("prefill of %s failed", t.request_id)
                t.done = True
                t._put(RequestEvent("error", message=f"prefill failed: {type(e).__name__}: {e}", status=500))
                continue
            t.slot = free[0]
            t.admitted_at = time.monotonic()
            self._running[t.slot] = t
            m = self.metrics
            m.queue_time.labels(**m.labels()).observe(t.admitted_at - t.arrival)
            m.prompt_tokens.labels(**m.labels()).inc(len(t.request.prompt_ids))

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outs = self.engine.generate()
        except Exception as e:
            log.exception("engine step failed")
            self.last_error = f"{type(e).__name__}: {e}"
            for t in list(self._running.values()):
                self._free_slot(t)
                t.done = True
                t._put(RequestEvent("error", message=f"engine step failed: {type(e).__name__}: {e}", status=500))
            return
        self._steps += 1
        self.metrics.step_seconds.labels(**self.metrics.labels()).observe(time.monotonic() - t0)
        for out in outs:
            t = self._running.get(out.slot)
            if t is None or t.request_id != out.request_id:
                continue
            self._route(t, out)

    def _route(self, t: TrackedRequest, out) -> None:
        finish = out.finish_reason if out.finished else None
        if out.finished and finish is None:
            finish = "stop"
        if finish == "error":
            self._free_slot(t)
            t.done = True
            t._put(
                RequestEvent(
                    "error", message="the engine reported an error for this request (non-finite logits)", status=500
                )
            )
            return
        ev = event_from_output(out, first=not t.started)
        t.started = True
        if finish is not None:
            self._free_slot(t)
            t.done = True
        t._put(ev)

    def _abort(self, t: TrackedRequest, count: bool) -> None:
        if t.slot is not None:
            self._free_slot(t)
        t.done = True
        if count:
            self.metrics.request_aborted.labels(**self.metrics.labels()).inc()
        t._put(RequestEvent("final", finish_reason="abort"))

    def _free_slot(self, t: TrackedRequest) -> None:
        slot, t.slot = t.slot, None
        if slot is None:
            return
        self._running.pop(slot, None)
        try:
            if slot in self.engine.active_slots():
                self.engine.free(slot)
        except Exception:
            log.exception("freeing slot %d failed", slot)

    def _update_snapshot(self) -> None:
        metrics = _safe_metrics(self.engine)
        try:
            free = len(self.engine.free_slots())
        except Exception:
            free = self.num_slots - len(self._running)
        with self._cv:
            self._engine_metrics = metrics
            self._snap_running = len(self._running)
            self._snap_free = free


def _safe_metrics(engine) -> dict:
    try:
        return dict(engine.metrics())
    except Exception:
        log.exception("engine.metrics() failed")
        return {}


# --------------------------------------------------------------------------- protocol


class _APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


class _Strict(BaseModel):
    """Refuses undeclared fields: a field the server does not honour is a 400, never ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = Field(
        False,
        description="stream a last chunk with ``usage`` (and ``choices: []``); "
        "every other chunk then has ``usage: null``",
    )


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extensions).

    Every declared field is honoured; fields that are declared only to refuse values the
    engine cannot honour say so (``presence_penalty``/``frequency_penalty`` must be 0).
    """

    model: str | None = Field(None, description="must be the served name (GET /v1/models); omitted: that one")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="maximum generated tokens (default: 16 for completions, the rest of the context for chat)",
    )
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = Field(
        None,
        ge=SEED_RANGE[0],
        le=SEED_RANGE[1],
        description="PRNG seed; choice i of n uses seed + i (wrapped into int32)",
    )
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices; choice i = the same request with seed + i")
    presence_penalty: float = Field(
        0.0, allow_inf_nan=False, description="only 0 (penalties would change the target's distribution)"
    )
    frequency_penalty: float = Field(0.0, allow_inf_nan=False, description="only 0")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit (target and drafter alike)"
    )
    min_tokens: int = Field(
        0, ge=0, description="EOS, stop_token_ids and stop strings cannot end the request before this many tokens"
    )
    return_token_ids: bool = Field(False, description="add the generated token ids to each choice")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="log-probability of each token and of its n most likely alternatives"
    )
    echo: bool = Field(False, description="only false")
    best_of: int | None = Field(None, description="only 1")
    suffix: str | None = Field(None, description="only null")


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="log-probability of each token")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; needs logprobs: true"
    )
    add_generation_prompt: bool = True


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerConfig:
    """Static facts the handlers need.

    Attributes:
      model_name: the served name: ``/v1/models`` lists it, a request naming another
        model gets 404.
      context_len: prompt + generated tokens must fit (the engine's cache length).
      vocab_size: token ids must be in ``[0, vocab_size)``.
      default_max_tokens: None: vLLM's defaults for a request without ``max_tokens``
        (16 for completions, the rest of the context for chat); an int overrides both
        (capped to the room left in the context).
      chat_template: overrides the tokenizer's template.
      policy: reported by ``/health``.
      api_key: when set, every ``/v1`` route needs ``Authorization: Bearer <api_key>``
        (401 otherwise, as vLLM's ``--api-key``).
      auth_health_metrics: with ``api_key``, ``/health`` and ``/metrics`` need it too.
      max_logit_bias: most ``logit_bias`` entries per request (the engine's limit).
    """

    model_name: str
    context_len: int
    vocab_size: int
    default_max_tokens: int | None = None
    chat_template: str | None = None
    policy: str = ""
    api_key: str | None = None
    auth_health_metrics: bool = False
    max_logit_bias: int = 1024


def create_app(
    loop: EngineLoop, tokenizer, config: ServerConfig, *, sampling_params_cls=None, request_cls=None
) -> FastAPI:
    """Builds the FastAPI app around a started-or-not :class:`EngineLoop`.

    The app's lifespan starts the loop (if needed) and stops it at shutdown. The
    engine's ``SamplingParams``/``Request`` classes default to :mod:`dspark_jax.serving.engine`'s.
    The loop's engine may be any object with the engine's interface (tests inject a fake).
    """
    if sampling_params_cls is None or request_cls is None:
        from dspark_jax.serving.engine import Request as request_cls
        from dspark_jax.serving.engine import SamplingParams as sampling_params_cls

    metrics = loop.metrics
    piece_cache: dict[int, str] = {}

    def token_str(i: int) -> str:
        s = piece_cache.get(i)
        if s is None:
            s = piece_cache[i] = tokenizer.decode([int(i)], skip_special_tokens=False)
        return s

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="dspark_jax", version=__version__, lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.config = config

    if config.api_key:
        expected = f"Bearer {config.api_key}".encode()
        protected_extra = ("/health", "/metrics") if config.auth_health_metrics else ()

        @app.middleware("http")
        async def _auth(request: HTTPRequest, call_next):
            path = request.url.path
            if request.method != "OPTIONS" and (path.startswith("/v1") or path in protected_extra):
                given = request.headers.get("authorization", "").encode()
                if not secrets.compare_digest(given, expected):
                    metrics.request_rejected.labels(**metrics.labels(status="401")).inc()
                    resp = _error_response(
                        401,
                        "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
                        None,
                        "authentication_error",
                    )
                    resp.headers["WWW-Authenticate"] = "Bearer"
                    return resp
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: HTTPRequest, exc: RequestValidationError):
        errs = exc.errors()
        parts, param = [], None
        for e in errs[:4]:
            if e.get("type") == "json_invalid":
                parts.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})")
                continue
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            name = ".".join(loc) or "body"
            param = param or (".".join(loc) or None)
            if e.get("type") == "extra_forbidden":
                parts.append(f"{name}: unsupported parameter (this server does not honour it)")
            else:
                parts.append(f"{name}: {e.get('msg', 'invalid')}")
        metrics.request_rejected.labels(**metrics.labels(status="400")).inc()
        return _error_response(400, "; ".join(parts) or "invalid request", param)

    @app.exception_handler(_APIError)
    async def _api_error(_req: HTTPRequest, exc: _APIError):
        metrics.request_rejected.labels(**metrics.labels(status=str(exc.status))).inc()
        return _error_response(exc.status, exc.message, exc.param, exc.kind)

    @app.get("/health")
    async def health():
        snap = loop.snapshot()
        body = {k: snap[k] for k in ("num_slots", "running", "free_slots", "waiting", "steps")}
        body["status"] = "ok" if snap["alive"] else "stopped"
        body["policy"] = config.policy
        return JSONResponse(body, status_code=200 if snap["alive"] else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "dspark_jax",
                    "root": config.model_name,
                    "parent": None,
                    "max_model_len": config.context_len,
                }
            ],
        }

    def check_model(req: _SamplingRequest) -> None:
        if req.model is not None and req.model != config.model_name:
            raise _APIError(
                404,
                f"The model `{req.model}` does not exist (this server serves `{config.model_name}`).",
                "model",
                "NotFoundError",
            )

    def sampling(req: _SamplingRequest, prompt_len: int, max_tokens: int | None, chat: bool):
        """``(params per choice, stop strings, logprobs n or None)`` of a validated request."""
        if req.presence_penalty or req.frequency_penalty:
            raise _APIError(
                400,
                "presence_penalty and frequency_penalty must be 0 (penalties would change the target's distribution)",
                "presence_penalty" if req.presence_penalty else "frequency_penalty",
            )
        if req.stream_options is not None and not req.stream:
            raise _APIError(400, "stream_options can only be given with stream: true", "stream_options")
        room = config.context_len - prompt_len
        if room < 1:
            raise _APIError(
                400,
                f"the prompt has {prompt_len} tokens; the context length is {config.context_len} "
                "and leaves no room to generate",
                "prompt" if not chat else "messages",
            )
        if max_tokens is None:
            default = config.default_max_tokens if config.default_max_tokens is not None else (room if chat else 16)
            max_tokens = min(default, room)
        elif prompt_len + max_tokens > config.context_len:
            raise _APIError(
                400,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"length {config.context_len}",
                "max_tokens",
            )
        if req.min_tokens > max_tokens:
            raise _APIError(400, f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise _APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not s for s in stop):
            raise _APIError(400, "stop strings must not be empty", "stop")
        stop_ids = tuple(int(i) for i in (req.stop_token_ids or ()))
        bad = [i for i in stop_ids if not 0 <= i < config.vocab_size]
        if bad:
            raise _APIError(
                400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})", "stop_token_ids"
            )
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise _APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            if not 0 <= tid < config.vocab_size:
                raise _APIError(
                    400, f"logit_bias token id {tid} is outside the vocabulary [0, {config.vocab_size})", "logit_bias"
                )
            if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
                raise _APIError(400, f"logit_bias[{key!r}] = {value}: biases must be in [-100, 100]", "logit_bias")
            bias[tid] = float(value)
        if len(bias) > config.max_logit_bias:
            raise _APIError(400, f"logit_bias has {len(bias)} entries; at most {config.max_logit_bias}", "logit_bias")
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise _APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            n_lp = (req.top_logprobs or 0) if req.logprobs else None
        else:
            n_lp = req.logprobs
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        kw = dict(
            temperature=float(req.temperature),
            top_k=max(int(req.top_k), 0),
            top_p=float(req.top_p),
            max_tokens=int(max_tokens),
            stop_token_ids=stop_ids,
        )
        if bias:
            kw["logit_bias"] = tuple(sorted(bias.items()))
        if n_lp is not None:
            kw["logprobs"] = int(n_lp)
        if req.min_tokens:
            kw["min_tokens"] = int(req.min_tokens)
        try:
            params = [sampling_params_cls(seed=choice_seed(seed, i), **kw) for i in range(req.n)]
        except TypeError as e:  # an engine without logit_bias / logprobs / min_tokens
            field = next((k for k in ("logit_bias", "logprobs", "min_tokens") if k in str(e)), None)
            raise _APIError(400, f"{field or 'a sampling parameter'} is not supported by this engine", field) from None
        return params, tuple(stop), n_lp

    def check_ids(ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise _APIError(400, "the prompt is empty", param)
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise _APIError(
                400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})", param
            )
        return ids

    def completion_prompt(req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise _APIError(400, f"one prompt per request is supported (got a batch of {len(p)})", "prompt")
            p = p[0]
        if req.echo:
            raise _APIError(400, "echo is not supported", "echo")
        if req.best_of not in (None, 1):
            raise _APIError(400, "best_of must be 1 (use n for several choices)", "best_of")
        if req.suffix:
            raise _APIError(400, "suffix is not supported", "suffix")
        if isinstance(p, str):
            if not p.strip():
                raise _APIError(400, "the prompt is empty: give some text to continue", "prompt")
            return check_ids(tokenizer.encode(p))
        return check_ids([int(i) for i in p])

    def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise _APIError(400, "messages must not be empty", "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            c = m.content
            if isinstance(c, list):
                parts = []
                for part in c:
                    if (
                        part.get("type") != "text"
                        or not isinstance(part.get("text"), str)
                        or set(part) - {"type", "text"}
                    ):
                        raise _APIError(
                            400, f"messages[{i}].content: only text parts are supported", f"messages.{i}.content"
                        )
                    parts.append(part["text"])
                c = "".join(parts)
            msgs.append({"role": m.role, "content": c or ""})
        if not any(m["content"].strip() for m in msgs):
            raise _APIError(400, "the messages are empty", "messages")
        try:
            if config.chat_template is not None:
                from dspark_jax.models.tokenizer import render_chat_template

                def piece(i):
                    return "" if i is None else tokenizer.id_to_piece(i)

                text = render_chat_template(
                    config.chat_template,
                    msgs,
                    add_generation_prompt=req.add_generation_prompt,
                    bos_token=piece(tokenizer.bos_id),
                    eos_token=piece(tokenizer.eos_ids[0] if tokenizer.eos_ids else None),
                )
            else:
                text = tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
        except DSparkInputError as e:
            raise _APIError(400, str(e), "messages") from None
        return check_ids(tokenizer.encode(text, add_bos=False), "messages")

    def logprobs_obj(chat: bool, lps: list | None, offset: int) -> tuple[dict | None, int]:
        """OpenAI's logprobs object for some tokens, and the text offset after them."""
        if lps is None:
            return None, offset
        if chat:
            content = []
            for tid, (lp, top) in lps:
                t = token_str(tid)
                content.append(
                    {
                        "token": t,
                        "logprob": _finite_lp(lp),
                        "bytes": list(t.encode("utf-8")),
                        "top_logprobs": [
                            {
                                "token": token_str(a),
                                "logprob": _finite_lp(b),
                                "bytes": list(token_str(a).encode("utf-8")),
                            }
                            for a, b in top
                        ],
                    }
                )
            return {"content": content}, offset
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, (lp, top) in lps:
            t = token_str(tid)
            tokens.append(t)
            token_lps.append(_finite_lp(lp))
            tops.append({token_str(a): _finite_lp(b) for a, b in top})
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def finish_metrics(st: OutputState) -> None:
        m = metrics
        m.request_success.labels(**m.labels(finished_reason=st.finish_reason)).inc()
        m.generation_tokens.labels(**m.labels()).inc(len(st.token_ids))
        arrival = st.tracked.arrival
        now = st.finished_at or time.monotonic()
        m.e2e.labels(**m.labels()).observe(now - arrival)
        if st.first_token_at is not None:
            m.ttft.labels(**m.labels()).observe(st.first_token_at - arrival)
            if len(st.token_ids) > 1:
                m.tpot.labels(**m.labels()).observe((now - st.first_token_at) / (len(st.token_ids) - 1))
        m.add_spec(st.num_steps, st.num_emitted, st.num_verified, st.num_accepted)

    def apply(st: OutputState, ev: RequestEvent) -> Update:
        up = st.feed(ev)
        if up.finish_reason is not None:
            if not st.tracked.done:  # a stop string: the engine is still generating for it
                loop.abort(st.tracked.request_id, count=False)
            finish_metrics(st)
        return up

    async def run(http: HTTPRequest, ids: list[int], req: _SamplingRequest, max_tokens: int | None, chat: bool):
        params, stop, n_lp = sampling(req, len(ids), max_tokens, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        tracked = [
            TrackedRequest(
                request=request_cls(prompt_ids=ids, params=p, request_id=rid if len(params) == 1 else f"{rid}-{i}"),
                loop=aloop,
                queue=queue,
                index=i,
            )
            for i, p in enumerate(params)
        ]
        states = [OutputState(t, tokenizer, stop, req.min_tokens) for t in tracked]
        try:
            loop.submit(*tracked)
        except QueueFullError as e:
            raise _APIError(429, str(e), None, "rate_limit_error") from None
        except ServerClosedError as e:
            raise _APIError(503, str(e), None, "server_error") from None
        watcher = asyncio.create_task(_watch_disconnect(http, tracked, loop))
        created = int(time.time())
        ctx = _StreamCtx(
            rid,
            created,
            config.model_name,
            chat,
            req.return_token_ids,
            n_lp is not None,
            bool(req.stream_options and req.stream_options.include_usage),
        )
        if req.stream:
            return StreamingResponse(
                _sse(states, queue, watcher, loop, ctx, apply, logprobs_obj),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )
        try:
            while any(st.finish_reason is None for st in states):
                ev = await queue.get()
                st = states[ev.index]
                if st.finish_reason is not None:
                    continue  # the engine's answer to our stop-string abort
                if ev.kind == "error":
                    raise _APIError(
                        ev.status, ev.message, None, "invalid_request_error" if ev.status == 400 else "server_error"
                    )
                if ev.finish_reason == "abort":  # the client is gone; nobody reads this
                    return _error_response(499, "client disconnected")
                apply(st, ev)
        finally:
            watcher.cancel()
            for t, st in zip(tracked, states):
                if not t.done and st.finish_reason is None:
                    loop.abort(t.request_id, count=False)
        choices = []
        for st in states:
            choice: dict[str, Any] = {
                "index": st.index,
                "finish_reason": st.finish_reason,
                "logprobs": logprobs_obj(chat, _zip_lps(st.token_ids, st.logprobs), 0)[0],
            }
            if chat:
                choice["message"] = {"role": "assistant", "content": st.text}
            else:
                choice["text"] = st.text
            if req.return_token_ids:
                choice["token_ids"] = st.token_ids
            choices.append(choice)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": _usage(len(ids), states),
            "spec_decode": _spec_total(states),
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HTTPRequest):
        check_model(req)
        ids = completion_prompt(req)
        return await run(http, ids, req, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: HTTPRequest):
        check_model(req)
        ids = chat_prompt(req)
        return await run(http, ids, req, req.max_completion_tokens or req.max_tokens, chat=True)

    return app


def _finite_lp(x: float) -> float:
    """JSON has no -inf: clamp as vLLM does."""
    x = float(x)
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _zip_lps(ids: list[int], lps: list | None) -> list | None:
    return None if lps is None else list(zip(ids, lps))


def _usage(n_prompt: int, states: list[OutputState]) -> dict[str, int]:
    n_gen = sum(len(st.token_ids) for st in states)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


def _spec_total(states: list[OutputState]) -> dict[str, Any]:
    return _spec_dict(
        sum(st.num_steps for st in states),
        sum(st.num_emitted for st in states),
        sum(st.num_verified for st in states),
        sum(st.num_accepted for st in states),
    )


async def _watch_disconnect(http: HTTPRequest, tracked: list[TrackedRequest], loop: EngineLoop) -> None:
    """Waits for the client to go away, then aborts the request's choices (frees their slots)."""
    try:
        while True:
            msg = await http.receive()
            if msg["type"] == "http.disconnect":
                break
    except asyncio.CancelledError:
        return
    except Exception:
        pass
    for t in tracked:
        if not t.done:
            loop.abort(t.request_id)


@dataclasses.dataclass
class _StreamCtx:
    rid: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool
    logprobs: bool
    include_usage: bool


async def _sse(
    states: list[OutputState],
    queue: asyncio.Queue,
    watcher: asyncio.Task,
    loop: EngineLoop,
    ctx: _StreamCtx,
    apply,
    logprobs_obj,
) -> AsyncIterator[str]:
    """OpenAI chunk stream: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``.

    Per choice: (chat) a first chunk with the role, content chunks, one chunk with its
    ``finish_reason`` (and its ``spec_decode``). With ``stream_options.include_usage``
    every chunk has ``usage: null`` and a last chunk has ``choices: []`` and the usage of
    the whole request (and its ``spec_decode``), as OpenAI and vLLM do.
    """
    obj = "chat.completion.chunk" if ctx.chat else "text_completion"
    offsets = [0] * len(states)

    def chunk(
        index: int,
        text: str | None,
        finish: str | None,
        ids: list[int] | None = None,
        lps=None,
        first: bool = False,
        extra: dict | None = None,
    ) -> str:
        if ctx.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
        if ctx.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        body: dict[str, Any] = {
            "id": ctx.rid,
            "object": obj,
            "created": ctx.created,
            "model": ctx.model,
            "choices": [choice],
        }
        if ctx.include_usage:
            body["usage"] = None
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if ctx.chat:
            for st in states:
                yield chunk(st.index, "", None, first=True)
        while any(st.finish_reason is None for st in states):
            ev = await queue.get()
            st = states[ev.index]
            if st.finish_reason is not None:
                continue
            if ev.kind == "error":
                err = {
                    "error": {
                        "message": ev.message,
                        "type": "server_error" if ev.status >= 500 else "invalid_request_error",
                        "param": None,
                        "code": ev.status,
                    }
                }
                yield f"data: {json.dumps(err)}\n\n"
                break
            if ev.finish_reason == "abort":
                return
            up = apply(st, ev)
            lps = None
            if ctx.logprobs and up.token_ids:
                lps, offsets[st.index] = logprobs_obj(ctx.chat, _zip_lps(up.token_ids, up.logprobs), offsets[st.index])
            if up.text or (up.token_ids and (ctx.return_token_ids or ctx.logprobs)):
                yield chunk(st.index, up.text, None, up.token_ids, lps)
            if up.finish_reason is not None:
                yield chunk(
                    st.index,
                    None if ctx.chat else "",
                    up.finish_reason,
                    [] if ctx.return_token_ids else None,
                    extra={"spec_decode": st.spec_decode()},
                )
        else:
            if ctx.include_usage:
                n_prompt = len(states[0].tracked.request.prompt_ids)
                body = {
                    "id": ctx.rid,
                    "object": obj,
                    "created": ctx.created,
                    "model": ctx.model,
                    "choices": [],
                    "usage": _usage(n_prompt, states),
                    "spec_decode": _spec_total(states),
                }
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        for st in states:
            if not st.tracked.done and st.finish_reason is None:
                loop.abort(st.tracked.request_id)
