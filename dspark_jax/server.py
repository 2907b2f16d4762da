"""OpenAI-compatible HTTP server over the continuous-batching speculative engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and Prometheus ``GET /metrics``.

Architecture (DESIGN.md, "serve"): one background thread, :class:`EngineLoop`, owns the
:class:`~dspark_jax.engine.Engine` and is the only thread that touches JAX. Each iteration
it (1) frees the slots of aborted requests (client disconnects), (2) admits waiting
requests into free slots (``prefill`` + ``insert``), (3) runs one speculative step for all
active slots (``generate``), detokenizes, applies stop strings and hands each request its
new text with ``loop.call_soon_threadsafe`` to an ``asyncio.Queue``. The asyncio side
only validates, tokenizes, enqueues and formats, so it never blocks on the engine. The
waiting queue is bounded (``max_queue``): a full queue answers 429. Invalid requests get
400 with a reason. Shutdown (uvicorn's graceful drain, then the app's lifespan end) stops
the thread after failing whatever is still queued with 503.

Exactness: the engine's output for a request depends only on its prompt, sampling
parameters and seed, never on its batch-mates (the exactness issue). Stop strings are
matched token by token on the detokenized text (the shortest prefix of the generated ids
whose text contains a stop string ends the request), so the response is the same whether
the engine emitted those tokens in one step or several.

Per-request speculative metrics are returned in a ``spec_decode`` object beside
``usage``: ``num_steps`` (target verification passes the request took part in),
``num_draft_tokens`` (draft tokens verified), ``num_accepted_tokens``,
``acceptance_rate`` = accepted / verified and ``tau`` = 1 + accepted / steps, the tokens a
verification pass gives the request (accepted drafts + the bonus/correction token; DESIGN.md,
"Metrics").
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
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from .errors import DSparkInputError

log = logging.getLogger("dspark_jax.server")

__all__ = ["EngineLoop", "QueueFullError", "ServerClosedError", "create_app"]

SEED_RANGE = (-(2**31), 2**31 - 1)  # the engine's PRNG seeds are int32
MAX_STOP_STRINGS = 16


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class ServerClosedError(RuntimeError):
    """The engine loop is stopped or stopping (HTTP 503)."""


# --------------------------------------------------------------------------- request tracking


@dataclasses.dataclass
class RequestEvent:
    """What the engine thread hands a request's asyncio queue.

    ``kind``: ``"delta"`` (new text/ids, more to come), ``"final"`` (the request ended;
    ``finish_reason`` is ``stop``/``length``/``abort``), ``"error"`` (``message`` and the
    HTTP ``status`` it maps to).
    """

    kind: Literal["delta", "final", "error"]
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    message: str = ""
    status: int = 500


@dataclasses.dataclass(eq=False)
class TrackedRequest:
    """A request between the HTTP handler and the engine thread.

    The engine thread writes the progress fields; the handler only reads them after
    the final event (the queue hand-off orders the accesses).
    """

    request: Any  # dspark_jax.engine.Request
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    slot: int | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # after stop-string truncation
    num_engine_tokens: int = 0  # tokens the engine emitted (before stop-string truncation)
    text: str = ""
    sent_text: str = ""  # prefix of ``text`` already handed out as deltas
    num_steps: int = 0
    num_verified: int = 0
    num_accepted: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    done: bool = False  # set by the engine thread when the final/error event is queued

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def spec_decode(self) -> dict[str, Any]:
        """Per-request speculative metrics (DESIGN.md, "Metrics")."""
        return {
            "num_steps": self.num_steps,
            "num_draft_tokens": self.num_verified,
            "num_accepted_tokens": self.num_accepted,
            "acceptance_rate": (self.num_accepted / self.num_verified) if self.num_verified else None,
            "tau": (1.0 + self.num_accepted / self.num_steps) if self.num_steps else None,
        }

    def _put(self, ev: RequestEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


# --------------------------------------------------------------------------- metrics


class ServerMetrics:
    """Prometheus metrics with vLLM-like names (``dspark:`` prefix), in their own registry.

    Request-level series are updated by the engine thread and the handlers; the engine's
    cumulative speculative counters (drafts, draft tokens, accepted tokens, per-position
    acceptance, online-calibration temperatures) are read at scrape time from the last
    snapshot the engine thread took, so a scrape never calls into JAX.
    """

    def __init__(self, loop: "EngineLoop", model_name: str):
        disable_created_metrics()  # no `_created` series (process-wide; as vLLM's exposition)
        self.registry = CollectorRegistry(auto_describe=True)
        lbl = dict(labelnames=["model_name"], registry=self.registry)
        self.model_name = model_name
        self.request_success = Counter("dspark:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.request_rejected = Counter("dspark:request_rejected", "Requests refused (HTTP status).",
                                        ["model_name", "status"], registry=self.registry)
        self.request_aborted = Counter("dspark:request_aborted", "Requests aborted by a client disconnect.", **lbl)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prefilled prompt tokens.", **lbl)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated (returned) tokens.", **lbl)
        lat = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "Time to first token (arrival to first "
                              "token handed to the client).", buckets=lat, **lbl)
        self.tpot = Histogram("dspark:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", buckets=lat, **lbl)
        self.e2e = Histogram("dspark:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=lat + (160.0, 320.0, 640.0), **lbl)
        self.queue_time = Histogram("dspark:request_queue_time_seconds", "Arrival to admission into a slot.",
                                    buckets=lat + (160.0, 320.0, 640.0), **lbl)
        self.step_seconds = Histogram("dspark:engine_step_seconds", "Wall time of one engine generate() step.",
                                      buckets=lat, **lbl)
        self.registry.register(_EngineCollector(loop, model_name))

    def labels(self, **kw):
        return dict(model_name=self.model_name, **kw)


class _EngineCollector:
    """Scrape-time gauges/counters from the engine loop's last snapshot."""

    def __init__(self, loop: "EngineLoop", model_name: str):
        self.loop, self.model_name = loop, model_name

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
        for key, metric, doc in (
                ("drafts", "dspark:spec_decode_num_drafts", "Request-steps that verified at least one draft token."),
                ("draft_tokens", "dspark:spec_decode_num_draft_tokens", "Draft tokens verified."),
                ("accepted_tokens", "dspark:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
                ("emitted_tokens", "dspark:spec_decode_num_emitted_tokens", "Tokens emitted by the engine "
                                                                            "(prefill tokens, accepted drafts, "
                                                                            "corrections and bonus tokens)."),
                ("rounds", "dspark:spec_decode_num_rounds", "Request-steps (target verification passes summed "
                                                            "over requests)."),
                ("packed_tokens", "dspark:engine_packed_tokens", "Tokens in verification passes (anchors + drafts)."),
                ("draft_steps", "dspark:engine_draft_steps", "Engine steps that ran the drafter."),
                ("suspended_steps", "dspark:engine_suspended_steps",
                 "Plain engine steps that skipped drafter context upkeep (drafter suspended)."),
                ("catchup_tokens", "dspark:engine_catchup_tokens",
                 "Tokens re-run through the target to rebuild skipped drafter context."),
                ("step_seconds", "dspark:engine_busy_seconds", "Seconds spent inside engine steps."),
        ):
            if m.get(key) is not None:
                yield counter(metric, doc, m[key])
        for key, metric, doc in (
                ("position_accepted", "dspark:spec_decode_num_accepted_tokens_per_pos",
                 "Accepted draft tokens by block position (1-based)."),
                ("position_reached", "dspark:spec_decode_num_verified_tokens_per_pos",
                 "Verified draft tokens by block position (1-based)."),
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
                ("mean_accepted_length", "dspark:spec_decode_mean_accepted_length",
                 "Cumulative tau: tokens per request-step (accepted drafts + 1)."),
                ("acceptance_rate", "dspark:spec_decode_acceptance_rate", "Cumulative accepted / verified drafts."),
                ("compiles", "dspark:engine_compiles", "Compiled step/prefill executables (constant after warm-up)."),
        ):
            if isinstance(m.get(key), (int, float)):
                yield gauge(metric, doc, m[key])
        cal = m.get("calibration") or {}
        for key, metric, doc in (
                ("temperatures", "dspark:calibration_temperature",
                 "Online-calibrated confidence temperature T_k by block position (1-based)."),
                ("predicted", "dspark:calibration_predicted_acceptance",
                 "Sliding-window mean calibrated confidence c_k by block position."),
                ("observed", "dspark:calibration_observed_acceptance",
                 "Sliding-window observed conditional acceptance by block position."),
                ("observations", "dspark:calibration_window_observations",
                 "Observations in the calibration window by block position."),
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
    """The background thread that drives an :class:`~dspark_jax.engine.Engine`.

    Args:
      engine: a warmed-up engine (``prefill/insert/generate/free``); only this thread
        calls it after :meth:`start`.
      tokenizer: ``decode(ids, skip_special_tokens=True)`` gives response text.
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
        self._aborts: set[str] = set()
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

    def submit(self, tracked: TrackedRequest) -> None:
        """Queues a request for admission.

        Raises:
          QueueFullError: ``max_queue`` requests are already waiting.
          ServerClosedError: the loop is stopping or not running.
        """
        with self._cv:
            if self._stopping or self._thread is None:
                raise ServerClosedError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({len(self._waiting)} requests waiting, "
                                     f"max_queue={self.max_queue}, {self.num_slots} slots busy): retry later")
            self._waiting.append(tracked)
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to drop a request (waiting or running) and free its slot."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Slot occupancy, queue length, step count and the engine's cumulative metrics."""
        with self._cv:
            return {"num_slots": self.num_slots, "running": self._snap_running, "free_slots": self._snap_free,
                    "waiting": len(self._waiting), "steps": self._steps, "engine": dict(self._engine_metrics),
                    "alive": self.alive, "last_error": self.last_error}

    # ---- engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._waiting or self._aborts or self._running):
                        self._cv.wait()
                    if self._stopping:
                        break
                    aborts, self._aborts = self._aborts, set()
                    dropped = [t for t in self._waiting if t.request_id in aborts]
                    if dropped:
                        self._waiting = collections.deque(t for t in self._waiting if t.request_id not in aborts)
                for t in dropped:
                    self._finish(t, "abort")
                for slot, t in list(self._running.items()):
                    if t.request_id in aborts:
                        self._finish(t, "abort")
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
                self.metrics.request_rejected.labels(**self.metrics.labels(status="400")).inc()
                t._put(RequestEvent("error", message=str(e), status=400))
                continue
            except Exception as e:  # noqa: BLE001 - a failed prefill must not take the server down
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
        except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
            log.exception("engine step failed")
            self.last_error = f"{type(e).__name__}: {e}"
            for t in list(self._running.values()):
                t.finish_reason = "error"
                self._free_slot(t)
                t.done = True
                t._put(RequestEvent("error", message=f"engine step failed: {type(e).__name__}: {e}", status=500))
            return
        now = time.monotonic()
        self._steps += 1
        self.metrics.step_seconds.labels(**self.metrics.labels()).observe(now - t0)
        for out in outs:
            t = self._running.get(out.slot)
            if t is None or t.request_id != out.request_id:
                continue
            self._route(t, out, now)

    def _route(self, t: TrackedRequest, out, now: float) -> None:
        # A request that ended at prefill (first token EOS, max_tokens 1) is reported with no
        # verification pass behind it: it counts no step.
        if not (t.num_steps == 0 and out.finished and len(out.token_ids) <= 1 and not out.num_verified):
            t.num_steps += 1
        t.num_verified += int(out.num_verified)
        t.num_accepted += int(out.num_accepted)
        new = [int(i) for i in out.token_ids]
        t.num_engine_tokens += len(new)
        finish = out.finish_reason if out.finished else None
        if out.finished and finish is None:
            finish = "stop"
        if finish == "error":
            self._free_slot(t)
            t.done = True
            t._put(RequestEvent("error", message="the engine reported an error for this request", status=500))
            return
        start = len(t.token_ids)
        ids = t.token_ids + new
        if t.stop:
            cut = None
            for k in range(start + 1, len(ids) + 1):  # the shortest prefix whose text holds a stop string
                text_k = self.tokenizer.decode(ids[:k], skip_special_tokens=True)
                hits = [i for i in (text_k.find(s) for s in t.stop) if i >= 0]
                if hits:
                    cut = (k, text_k[:min(hits)])
                    break
            if cut is not None:
                ids, text = ids[:cut[0]], cut[1]
                finish = "stop"
            else:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.token_ids, t.text = ids, text
        if new and t.first_token_at is None:
            t.first_token_at = now
            self.metrics.ttft.labels(**self.metrics.labels()).observe(now - t.arrival)
        if finish is not None:
            self._finish(t, finish)
            return
        delta = self._safe_delta(t)
        if delta or new:
            t._put(RequestEvent("delta", text=delta, token_ids=new))

    def _safe_delta(self, t: TrackedRequest) -> str:
        """New text that can no longer change: holds back a trailing partial UTF-8
        character (U+FFFD) and anything that could be the start of a stop string."""
        text = t.text
        if not text.startswith(t.sent_text):
            return ""  # the tokenizer rewrote earlier text (rare): wait for the final event
        end = len(text)
        while end > len(t.sent_text) and text[end - 1] == "\ufffd":
            end -= 1
        if t.stop:
            hold = max(len(s) for s in t.stop) - 1
            end = max(len(t.sent_text), min(end, len(text) - hold))
        delta = text[len(t.sent_text):end]
        t.sent_text += delta
        return delta

    def _finish(self, t: TrackedRequest, reason: str) -> None:
        if t.slot is not None:
            self._free_slot(t)
        t.finish_reason = reason
        t.finished_at = time.monotonic()
        t.done = True
        m = self.metrics
        if reason == "abort":
            m.request_aborted.labels(**m.labels()).inc()
            t._put(RequestEvent("final", finish_reason="abort"))
            return
        m.request_success.labels(**m.labels(finished_reason=reason)).inc()
        m.generation_tokens.labels(**m.labels()).inc(len(t.token_ids))
        m.e2e.labels(**m.labels()).observe(t.finished_at - t.arrival)
        if t.first_token_at is not None and len(t.token_ids) > 1:
            m.tpot.labels(**m.labels()).observe((t.finished_at - t.first_token_at) / (len(t.token_ids) - 1))
        delta = t.text[len(t.sent_text):] if t.text.startswith(t.sent_text) else ""
        t.sent_text = t.text
        t._put(RequestEvent("final", text=delta, finish_reason=reason))

    def _free_slot(self, t: TrackedRequest) -> None:
        slot, t.slot = t.slot, None
        if slot is None:
            return
        self._running.pop(slot, None)
        try:
            if slot in self.engine.active_slots():
                self.engine.free(slot)
        except Exception:  # noqa: BLE001
            log.exception("freeing slot %d failed", slot)

    def _update_snapshot(self) -> None:
        metrics = _safe_metrics(self.engine)
        try:
            free = len(self.engine.free_slots())
        except Exception:  # noqa: BLE001
            free = self.num_slots - len(self._running)
        with self._cv:
            self._engine_metrics = metrics
            self._snap_running = len(self._running)
            self._snap_free = free


def _safe_metrics(engine) -> dict:
    try:
        return dict(engine.metrics())
    except Exception:  # noqa: BLE001 - metrics must never break serving
        log.exception("engine.metrics() failed")
        return {}


# --------------------------------------------------------------------------- protocol


class _APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_response(status: int, message: str, param: str | None = None,
                    kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extensions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="maximum generated tokens")
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    return_token_ids: bool = Field(False, description="add the generated token ids to each choice")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerConfig:
    """Static facts the handlers need.

    ``context_len``: prompt + generated tokens must fit (the engine's cache length).
    ``default_max_tokens``: used when a request gives no ``max_tokens`` (capped to the
    room left in the context). ``chat_template``: overrides the tokenizer's template.
    """

    model_name: str
    context_len: int
    vocab_size: int
    default_max_tokens: int = 256
    chat_template: str | None = None
    policy: str = ""


def create_app(loop: EngineLoop, tokenizer, config: ServerConfig, *, sampling_params_cls=None,
               request_cls=None) -> FastAPI:
    """Builds the FastAPI app around a started-or-not :class:`EngineLoop`.

    The app's lifespan starts the loop (if needed) and stops it at shutdown. The
    engine's ``SamplingParams``/``Request`` classes default to :mod:`dspark_jax.engine`'s.
    """
    if sampling_params_cls is None or request_cls is None:
        from .engine import Request as request_cls, SamplingParams as sampling_params_cls  # noqa: N813

    metrics = loop.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="dspark_jax", version="0.1.0", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.config = config

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: HTTPRequest, exc: RequestValidationError):
        errs = exc.errors()
        parts, param = [], None
        for e in errs[:4]:
            if e.get("type") == "json_invalid":
                parts.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})")
                continue
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}")
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
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dspark_jax", "max_model_len": config.context_len}]}

    def sampling(req: _SamplingRequest, prompt_len: int, max_tokens: int | None):
        if req.n != 1:
            raise _APIError(400, "n must be 1: one completion per request is supported", "n")
        if req.presence_penalty or req.frequency_penalty:
            raise _APIError(400, "presence_penalty and frequency_penalty are not supported (would change the "
                                 "target's distribution)", "presence_penalty")
        if req.logprobs not in (None, False, 0):
            raise _APIError(400, "logprobs are not supported", "logprobs")
        room = config.context_len - prompt_len
        if room < 1:
            raise _APIError(400, f"the prompt has {prompt_len} tokens; the context length is {config.context_len} "
                                 "and leaves no room to generate", "prompt")
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, room)
        elif prompt_len + max_tokens > config.context_len:
            raise _APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context "
                                 f"length {config.context_len}", "max_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise _APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not s for s in stop):
            raise _APIError(400, "stop strings must not be empty", "stop")
        stop_ids = tuple(int(i) for i in (req.stop_token_ids or ()))
        bad = [i for i in stop_ids if not 0 <= i < config.vocab_size]
        if bad:
            raise _APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})",
                            "stop_token_ids")
        seed = req.seed if req.seed is not None else secrets.randbits(31)
        params = sampling_params_cls(temperature=float(req.temperature), top_k=max(int(req.top_k), 0),
                                     top_p=float(req.top_p), seed=int(seed), max_tokens=int(max_tokens),
                                     stop_token_ids=stop_ids)
        return params, tuple(stop)

    def check_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise _APIError(400, "the prompt is empty", "prompt")
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise _APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})",
                            "prompt")
        return ids

    def completion_prompt(req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise _APIError(400, "one prompt per request is supported (got a batch of "
                                     f"{len(p)})", "prompt")
            p = p[0]
        if req.echo or (req.best_of not in (None, 1)) or req.suffix:
            raise _APIError(400, "echo, best_of > 1 and suffix are not supported", "echo")
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
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise _APIError(400, f"messages[{i}].content: only text parts are supported",
                                        f"messages.{i}.content")
                    parts.append(part["text"])
                c = "".join(parts)
            msgs.append({"role": m.role, "content": c or ""})
        if not any(m["content"].strip() for m in msgs):
            raise _APIError(400, "the messages are empty", "messages")
        try:
            if config.chat_template is not None:
                from .tokenizer import render_chat_template

                def piece(i):
                    return "" if i is None else tokenizer.id_to_piece(i)

                text = render_chat_template(config.chat_template, msgs,
                                            add_generation_prompt=req.add_generation_prompt,
                                            bos_token=piece(tokenizer.bos_id),
                                            eos_token=piece(tokenizer.eos_ids[0] if tokenizer.eos_ids else None))
            else:
                text = tokenizer.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt)
        except DSparkInputError as e:
            raise _APIError(400, str(e), "messages") from None
        return check_ids(tokenizer.encode(text, add_bos=False))

    async def run(http: HTTPRequest, ids: list[int], req: _SamplingRequest, max_tokens: int | None, chat: bool):
        params, stop = sampling(req, len(ids), max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        aloop = asyncio.get_running_loop()
        tracked = TrackedRequest(request=request_cls(prompt_ids=ids, params=params, request_id=rid), stop=stop,
                                 loop=aloop, queue=asyncio.Queue())
        try:
            loop.submit(tracked)
        except QueueFullError as e:
            raise _APIError(429, str(e), None, "rate_limit_error") from None
        except ServerClosedError as e:
            raise _APIError(503, str(e), None, "server_error") from None
        watcher = asyncio.create_task(_watch_disconnect(http, tracked, loop))
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(tracked, watcher, loop, config, chat, created, include_usage, req.return_token_ids),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            while True:
                ev = await tracked.queue.get()
                if ev.kind == "error":
                    raise _APIError(ev.status, ev.message, None,
                                    "invalid_request_error" if ev.status == 400 else "server_error")
                if ev.kind == "final":
                    break
        finally:
            watcher.cancel()
            if not tracked.done:
                loop.abort(rid)
        if ev.finish_reason == "abort":  # the client is gone; nobody reads this
            return _error_response(499, "client disconnected")
        choice: dict[str, Any] = {"index": 0, "finish_reason": ev.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": tracked.text}
        else:
            choice["text"] = tracked.text
        if req.return_token_ids:
            choice["token_ids"] = tracked.token_ids
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": config.model_name, "choices": [choice], "usage": _usage(tracked),
                "spec_decode": tracked.spec_decode()}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HTTPRequest):
        ids = completion_prompt(req)
        return await run(http, ids, req, req.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: HTTPRequest):
        ids = chat_prompt(req)
        return await run(http, ids, req, req.max_completion_tokens or req.max_tokens, chat=True)

    return app


def _usage(t: TrackedRequest) -> dict[str, int]:
    n_prompt = len(t.request.prompt_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": len(t.token_ids),
            "total_tokens": n_prompt + len(t.token_ids)}


async def _watch_disconnect(http: HTTPRequest, tracked: TrackedRequest, loop: EngineLoop) -> None:
    """Waits for the client to go away, then aborts the request (frees its slot)."""
    try:
        while True:
            msg = await http.receive()
            if msg["type"] == "http.disconnect":
                break
    except asyncio.CancelledError:
        return
    except Exception:  # noqa: BLE001 - a broken receive channel means the client is gone
        pass
    if not tracked.done:
        loop.abort(tracked.request_id)


async def _sse(tracked: TrackedRequest, watcher: asyncio.Task, loop: EngineLoop, config: ServerConfig, chat: bool,
               created: int, include_usage: bool, return_token_ids: bool) -> AsyncIterator[str]:
    """OpenAI chunk stream: ``data: {json}\\n\\n`` per event, then ``data: [DONE]``."""
    rid = tracked.request_id
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, ids: list[int] | None = None, first: bool = False,
              extra: dict | None = None) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if return_token_ids and ids is not None:
            choice["token_ids"] = ids
        body = {"id": rid, "object": obj, "created": created, "model": config.model_name, "choices": [choice]}
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield chunk("", None, first=True)
        sent_ids = 0
        while True:
            ev = await tracked.queue.get()
            if ev.kind == "error":
                err = {"error": {"message": ev.message, "type": "server_error" if ev.status >= 500
                                 else "invalid_request_error", "param": None, "code": ev.status}}
                yield f"data: {json.dumps(err)}\n\n"
                break
            if ev.kind == "final":
                if ev.finish_reason == "abort":
                    return
                ids = tracked.token_ids[sent_ids:]
                if ev.text or ids:
                    yield chunk(ev.text, None, ids)
                final_extra = {"usage": _usage(tracked), "spec_decode": tracked.spec_decode()}
                yield chunk(None if chat else "", ev.finish_reason, [] if return_token_ids else None,
                            extra=final_extra)
                if include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": config.model_name,
                            "choices": [], **final_extra}
                    yield f"data: {json.dumps(body)}\n\n"
                break
            ids = ev.token_ids
            sent_ids += len(ids)
            if ev.text or return_token_ids:
                yield chunk(ev.text, None, ids)
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        if not tracked.done:
            loop.abort(rid)
