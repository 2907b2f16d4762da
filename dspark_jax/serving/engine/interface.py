"""The engine contract the HTTP server drives: :class:`EngineInterface`, implemented by the
:class:`~dspark_jax.serving.engine.Engine` and by :class:`~dspark_jax.serving.engine.fake.FakeEngine`
(no JAX; tests and demos of the server).

Slots are the engine's decode rows: :meth:`~EngineInterface.prefill` a
:class:`~dspark_jax.serving.engine.requests.Request`, :meth:`~EngineInterface.insert` the prefix
into a free slot, :meth:`~EngineInterface.generate` one step for every occupied slot,
:meth:`~EngineInterface.free` a slot. Admission goes through the engine's prefill queue
(:meth:`~EngineInterface.queue_prefill`, :meth:`~EngineInterface.run_prefill`,
:meth:`~EngineInterface.cancel_prefill`): one prefill pass per call, batched and chunked where the
engine :meth:`~EngineInterface.supports_chunked_prefill`, else one-shot prefill of each queued
request (:class:`OneShotPrefill`); the caller's loop is the same either way.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable
from typing import Any

from dspark_jax.serving.engine.requests import Prefix, Request, StepOutput

__all__ = ["EngineInterface", "OneShotPrefill", "PrefillResult"]

# What one prefill pass hands back per finished request: its tag and its prefix, or the
# exception that ended it (DSparkInputError: the request was refused; anything else: a failure).
PrefillResult = tuple[Any, "Prefix | Exception"]


class EngineInterface(abc.ABC):
    """A continuous-batching engine as the HTTP server's engine thread uses it.

    Attributes (set by implementations):
      num_slots: decode slots (requests decoded together).
      cache_len: positions per slot (prompt + generated tokens).
      max_logit_bias: ``SamplingParams.logit_bias`` entries a request may have.
      target: the target model, or anything with ``cfg.vocab_size`` and ``cfg.max_position``.
    """

    num_slots: int
    cache_len: int
    max_logit_bias: int
    target: Any

    # ---- slots

    @abc.abstractmethod
    def prefill(self, request: Request) -> Any:
        """The prefilled ``request``, for :meth:`insert` (the engine's own prefix type).

        Raises:
          DSparkInputError: a request this engine cannot serve."""

    @abc.abstractmethod
    def insert(self, prefix: Any, slot: int) -> None:
        """Puts a prefilled request into free ``slot``.

        Raises:
          DSparkInputError: the slot is out of range or busy."""

    @abc.abstractmethod
    def generate(self) -> list[StepOutput]:
        """One step for every occupied slot: a :class:`StepOutput` per slot that produced tokens or
        finished (finished slots are free afterwards)."""

    @abc.abstractmethod
    def free(self, slot: int) -> None:
        """Releases ``slot`` (a free slot: no-op)."""

    @abc.abstractmethod
    def free_slots(self) -> list[int]:
        """Free slots, ascending."""

    @abc.abstractmethod
    def active_slots(self) -> list[int]:
        """Occupied slots, ascending."""

    @abc.abstractmethod
    def metrics(self) -> dict:
        """Cumulative counters (at least ``steps`` and ``compiles``)."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """Compiles what serving needs (a no-op where nothing compiles)."""

    # ---- capabilities

    @abc.abstractmethod
    def supports_chunked_prefill(self) -> bool:
        """Whether :meth:`run_prefill` runs batched, chunked prefill passes (a long prompt then
        takes several calls) rather than one-shot prefill of each queued request."""

    # ---- admission

    @abc.abstractmethod
    def queue_prefill(self, request: Request, tag: Hashable) -> None:
        """Queues ``request`` (known by ``tag``) for :meth:`run_prefill`.

        Raises:
          DSparkInputError: a request this engine cannot serve (nothing is queued)."""

    @abc.abstractmethod
    def run_prefill(self) -> list[PrefillResult]:
        """Runs one prefill pass over the queue: ``(tag, prefix)`` for each request whose prompt
        ended in it, or ``(tag, exception)`` for each request it failed (those leave the queue)."""

    @abc.abstractmethod
    def cancel_prefill(self, tag: Hashable) -> None:
        """Drops ``tag``'s request from the prefill queue (a no-op if it is not there)."""


class OneShotPrefill:
    """A prefill queue of one-shot prefill: :meth:`step` prefills every queued request, one at a
    time, in order (the queue of an engine without chunked prefill).

    Args:
      prefill: ``request -> prefix`` (the engine's one-shot prefill).
      check: ``request -> None``, raising ``DSparkInputError`` for a request the engine refuses
        (run by :meth:`submit`).
    """

    def __init__(self, prefill: Callable[[Request], Any], check: Callable[[Request], None]):
        self._prefill, self._check = prefill, check
        self._queue: list[tuple[Hashable, Request]] = []

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, request: Request, tag: Hashable) -> None:
        """Queues ``request`` after checking it.

        Raises:
          DSparkInputError: what ``check`` raises."""
        self._check(request)
        self._queue.append((tag, request))

    def cancel(self, tag: Hashable) -> None:
        """Drops ``tag``'s request (a no-op if it is not queued)."""
        self._queue = [(t, r) for t, r in self._queue if t is not tag]

    def step(self) -> list[PrefillResult]:
        """``(tag, prefix or the exception its prefill raised)`` of every queued request; the
        queue is empty afterwards."""
        queue, self._queue = self._queue, []
        out: list[PrefillResult] = []
        for tag, request in queue:
            try:
                out.append((tag, self._prefill(request)))
            except Exception as e:  # this request fails; the others are prefilled
                out.append((tag, e))
        return out
