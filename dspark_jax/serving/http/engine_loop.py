"""The engine thread of the HTTP server: :class:`EngineLoop` owns the
:class:`~dspark_jax.serving.engine.Engine` and is the only thread that touches JAX.

Each iteration it (1) frees the slots of aborted requests (client disconnects, stop strings),
(2) admits waiting requests: it queues them in the engine's prefill queue (as many as slots are
left for them), runs ONE prefill pass and inserts the requests whose prompt ended in it (with the
engine's batched, chunked prefill a long prompt thus delays the streams by one chunk per step, not
its whole prefill; with one-shot prefill the pass prefills every queued request); (3) runs one
speculative step for all active slots (``generate``) and hands each request its new token ids
(and logprobs, speculative counts) as a :class:`RequestEvent`, with
``loop.call_soon_threadsafe``, to the request's ``asyncio.Queue``. It never detokenizes
(:mod:`dspark_jax.serving.http.detokenize` does, on the asyncio side).

Admission: the loop holds at most ``num_slots + max_queue`` requests (choices) at a time, those
in slots (or being prefilled into one) and those waiting for one. A submission that does not fit
raises :class:`QueueFullError` (HTTP 429); one that could never fit (more choices than that
total) :class:`~dspark_jax.errors.DSparkInputError` (HTTP 400). ``max_queue=0`` means no waiting
queue: requests are admitted while slots are free. Stopping fails whatever is still queued or
running with 503. docs/design.md#serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
import traceback
from typing import Any, Literal

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine.interface import EngineInterface
from dspark_jax.serving.http.prometheus import ServerMetrics

__all__ = [
    "EngineLoop",
    "QueueFullError",
    "RequestEvent",
    "ServerClosedError",
    "TrackedRequest",
    "event_from_output",
]

log = logging.getLogger("dspark_jax.serving.http.server")


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class ServerClosedError(RuntimeError):
    """The engine loop is stopped or stopping (HTTP 503)."""


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


def event_from_output(out, first: bool) -> RequestEvent:
    """The :class:`RequestEvent` of one engine ``StepOutput`` (not an error); ``first``: the
    request's first output (it carries the token sampled at prefill)."""
    finish = (out.finish_reason or "stop") if out.finished else None
    lps = out.logprobs
    return RequestEvent(
        "final" if finish else "delta",
        token_ids=[int(i) for i in out.token_ids],
        logprobs=list(lps) if lps is not None else None,
        num_verified=int(out.num_verified),
        num_accepted=int(out.num_accepted),
        with_prefill_token=first,
        finish_reason=finish,
    )


# --------------------------------------------------------------------------- the engine thread


class EngineLoop:
    """The background thread that drives an :class:`~dspark_jax.serving.engine.Engine`.

    Args:
      engine: a warmed-up :class:`~dspark_jax.serving.engine.interface.EngineInterface` (the
        :class:`~dspark_jax.serving.engine.Engine`, or the fake one); only this thread calls it
        after :meth:`start`.
      tokenizer: kept for callers (the loop itself never detokenizes).
      max_queue: requests allowed to wait for a slot (0: none, admitted only while slots are
        free); beyond them :meth:`submit` raises :class:`QueueFullError`. May be changed at
        run time.
      model_name: the ``model`` label of the metrics.
    """

    def __init__(self, engine: EngineInterface, tokenizer, *, max_queue: int = 256, model_name: str = "dspark"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = int(max_queue)
        self.num_slots = int(engine.num_slots)
        self._cv = threading.Condition()
        self._waiting: collections.deque[TrackedRequest] = collections.deque()
        self._aborts: dict[str, bool] = {}  # request id -> count it as a client abort
        self._running: dict[int, TrackedRequest] = {}
        self._prefilling: list[TrackedRequest] = []  # in the engine's prefill queue
        # Submitted and not ended (waiting, being prefilled, in a slot, or between those on the
        # engine thread), under _cv: admission counts these, not just the waiting queue, so
        # that free slots are room too and a request moving into a slot is never counted twice.
        self._held = 0
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
          DSparkInputError: more requests than the loop can ever hold (``num_slots +
            max_queue``).
          QueueFullError: fewer than ``len(tracked)`` places left: free slots plus free places
            in the waiting queue.
          ServerClosedError: the loop is stopping or not running.
        """
        with self._cv:
            if self._stopping or self._thread is None:
                raise ServerClosedError("the server is shutting down")
            capacity = self.num_slots + self.max_queue
            if len(tracked) > capacity:
                raise DSparkInputError(
                    f"{len(tracked)} choices can never run at once here: the server holds {self.num_slots} "
                    f"running and at most {self.max_queue} waiting requests"
                )
            if self._held + len(tracked) > capacity:
                waiting = len(self._waiting)
                raise QueueFullError(
                    f"the waiting queue is full ({waiting} requests waiting, max_queue={self.max_queue}, "
                    f"{self._held - waiting} of {self.num_slots} slots busy): retry later"
                )
            self._held += len(tracked)
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
                "waiting": len(self._waiting) + len(self._prefilling),
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
                    while not (self._stopping or self._waiting or self._aborts or self._running or self._prefilling):
                        self._cv.wait()
                    if self._stopping:
                        break
                    aborts, self._aborts = self._aborts, {}
                    dropped = [t for t in self._waiting if t.request_id in aborts]
                    if dropped:
                        self._waiting = collections.deque(t for t in self._waiting if t.request_id not in aborts)
                dropped += [t for t in self._prefilling if t.request_id in aborts]
                for t in dropped:
                    self._cancel_prefill(t)
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
                pending = list(self._waiting) + self._prefilling + list(self._running.values())
                self._waiting.clear()
                self._prefilling = []
            for t in pending:
                if t.slot is not None:
                    self._free_slot(t)
                self._end(t, RequestEvent("error", message="the server is shutting down", status=503))
            self._running.clear()
            self._update_snapshot()

    def _admit(self) -> None:
        """Queues waiting requests for prefill while slots are left for them, runs one prefill
        pass (:meth:`~dspark_jax.serving.engine.interface.EngineInterface.run_prefill`: a chunk of
        the batched, chunked prefill, or one-shot prefill of each queued request) and inserts the
        requests it finished into free slots."""
        while len(self._running) + len(self._prefilling) < self.num_slots:
            with self._cv:
                if not self._waiting:
                    break
                t = self._waiting.popleft()
            try:
                self.engine.queue_prefill(t.request, tag=t)
            except Exception as e:  # DSparkInputError: refused (400); else a bug in validation (500)
                self._fail_prefill(t, e, "queueing")
                continue
            self._prefilling.append(t)
        if not self._prefilling:
            return
        for t, prefix in self.engine.run_prefill():
            self._prefilling.remove(t)
            if isinstance(prefix, Exception):
                self._fail_prefill(t, prefix, "prefill")
                continue
            slot = next(s for s in range(self.num_slots) if s not in self._running)
            try:
                self.engine.insert(prefix, slot)
            except Exception as e:
                self._fail_prefill(t, e, "insert")
                continue
            self._placed(t, slot)

    def _fail_prefill(self, t: TrackedRequest, e: Exception, what: str) -> None:
        """Ends ``t`` with 400 for a refused request (``DSparkInputError``), else 500 (logged)."""
        if isinstance(e, DSparkInputError):
            self._end(t, RequestEvent("error", message=str(e), status=400))
            return
        log.error("%s of %s failed", what, t.request_id, exc_info=e)
        self._end(t, RequestEvent("error", message=f"prefill failed: {type(e).__name__}: {e}", status=500))

    def _placed(self, t: TrackedRequest, slot: int) -> None:
        t.slot = slot
        t.admitted_at = time.monotonic()
        self._running[slot] = t
        m = self.metrics
        m.queue_time.labels(**m.labels()).observe(t.admitted_at - t.arrival)
        m.prompt_tokens.labels(**m.labels()).inc(len(t.request.prompt_ids))

    def _cancel_prefill(self, t: TrackedRequest) -> None:
        """Takes ``t`` out of the engine's prefill queue (a no-op if it is not there)."""
        if t in self._prefilling:
            self._prefilling.remove(t)
            self.engine.cancel_prefill(t)

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outs = self.engine.generate()
        except Exception as e:
            log.exception("engine step failed")
            self.last_error = f"{type(e).__name__}: {e}"
            for t in list(self._running.values()):
                self._free_slot(t)
                self._end(t, RequestEvent("error", message=f"engine step failed: {type(e).__name__}: {e}", status=500))
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
            message = "the engine reported an error for this request (non-finite logits)"
            self._end(t, RequestEvent("error", message=message, status=500))
            return
        ev = event_from_output(out, first=not t.started)
        t.started = True
        if finish is None:
            t._put(ev)
            return
        self._free_slot(t)
        self._end(t, ev)

    def _abort(self, t: TrackedRequest, count: bool) -> None:
        if t.slot is not None:
            self._free_slot(t)
        if count:
            self.metrics.request_aborted.labels(**self.metrics.labels()).inc()
        self._end(t, RequestEvent("final", finish_reason="abort"))

    def _end(self, t: TrackedRequest, ev: RequestEvent) -> None:
        """Hands ``t`` its last event (final or error): ``done``, and its place is free for
        :meth:`submit` (its slot, if it had one, was freed before)."""
        with self._cv:
            if not t.done:
                self._held -= 1
            t.done = True
        t._put(ev)

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
