"""Prometheus metrics of the HTTP server (vLLM-like names, ``dspark:`` prefix;
docs/design.md#metrics).

Request-level series (successes by finish reason, rejections by status, aborts, prompt and
generated tokens, TTFT / TPOT / end-to-end / queue-time histograms, step time) are updated by
the engine thread and the handlers. The engine's cumulative counters
(:meth:`dspark_jax.serving.engine.Engine.metrics`) are read at scrape time from the engine
loop's last snapshot, so a scrape never calls into JAX.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics"]


class SnapshotSource(Protocol):
    """What the metrics read at scrape time (the engine loop)."""

    def snapshot(self) -> dict[str, Any]: ...


_LATENCY_BUCKETS = (
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

# (snapshot key, metric, help) of each exported series
_SPEC_COUNTERS = (
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
        "Returned tokens that came from target verification passes (finished requests; the prefill token excluded).",
    ),
    (
        "rounds",
        "dspark:spec_decode_num_rounds",
        "Target verification passes that gave a finished request at least one returned token.",
    ),
)
_ENGINE_COUNTERS = (
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
)
_POSITION_COUNTERS = (
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
)
_CALIBRATION_GAUGES = (
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
)


class ServerMetrics:
    """Prometheus metrics with vLLM-like names (``dspark:`` prefix), in their own registry.

    Request-level series are updated by the engine thread and the handlers; the engine's
    cumulative speculative counters (drafts, draft tokens, accepted tokens, per-position
    acceptance, online-calibration temperatures) are read at scrape time from the last
    snapshot the engine thread took, so a scrape never calls into JAX.
    """

    def __init__(self, loop: SnapshotSource, model_name: str):
        disable_created_metrics()  # no `_created` series (process-wide; as vLLM's exposition)
        self.registry = CollectorRegistry(auto_describe=True)
        lbl: dict[str, Any] = dict(labelnames=["model_name"], registry=self.registry)
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
        lat = _LATENCY_BUCKETS
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
        """The summed ``spec_decode`` counts of finished requests (any thread)."""
        with self._spec_lock:
            return dict(self.spec)

    def labels(self, **kw):
        """``model_name`` and ``kw`` as label values."""
        return dict(model_name=self.model_name, **kw)


class _EngineCollector:
    """Scrape-time gauges/counters from the engine loop's last snapshot."""

    def __init__(self, loop: SnapshotSource, model_name: str, server_metrics: ServerMetrics):
        self.loop, self.model_name, self.server_metrics = loop, model_name, server_metrics

    def describe(self):
        return []

    def _gauge(self, metric: str, doc: str, value) -> GaugeMetricFamily:
        g = GaugeMetricFamily(metric, doc, labels=["model_name"])
        g.add_metric([self.model_name], float(value))
        return g

    def _counter(self, metric: str, doc: str, value) -> CounterMetricFamily:
        c = CounterMetricFamily(metric, doc, labels=["model_name"])
        c.add_metric([self.model_name], float(value))
        return c

    def collect(self):
        snap = self.loop.snapshot()
        m = snap.get("engine", {})
        yield from self._occupancy(snap)
        yield from self._spec_decode(self.server_metrics.spec_snapshot())
        yield from self._engine_counters(m)
        yield from self._scheduler(m)
        yield from self._per_position(m)
        yield from self._histograms(m)
        if isinstance(m.get("compiles"), (int, float)):
            yield self._gauge(
                "dspark:engine_compiles", "Compiled step/prefill executables (constant after warm-up).", m["compiles"]
            )
        yield from self._calibration(m.get("calibration") or {})

    def _occupancy(self, snap: dict):
        yield self._gauge("dspark:num_requests_running", "Requests in decode slots.", snap["running"])
        yield self._gauge("dspark:num_requests_waiting", "Requests in the waiting queue.", snap["waiting"])
        yield self._gauge("dspark:num_slots", "Decode slots of the engine.", snap["num_slots"])
        yield self._gauge("dspark:num_free_slots", "Free decode slots.", snap["free_slots"])
        yield self._counter("dspark:engine_steps", "Engine generate() steps.", snap["steps"])

    def _spec_decode(self, spec: dict):
        """The finished requests' ``spec_decode`` sums (the responses' own numbers)."""
        for key, metric, doc in _SPEC_COUNTERS:
            yield self._counter(metric, doc, spec[key])
        yield self._gauge(
            "dspark:spec_decode_mean_accepted_length",
            "tau: returned tokens per target verification "
            "pass, the prefill token excluded (num_emitted_tokens / num_rounds; decode.Generation.tau).",
            spec["emitted"] / spec["rounds"] if spec["rounds"] else float("nan"),
        )
        yield self._gauge(
            "dspark:spec_decode_acceptance_rate",
            "Accepted / verified draft tokens (finished requests).",
            spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else float("nan"),
        )

    def _engine_counters(self, m: dict):
        for key, metric, doc in _ENGINE_COUNTERS:
            if m.get(key) is not None:
                yield self._counter(metric, doc, m[key])

    def _scheduler(self, m: dict):
        """Why the dspark policy drafts or not (:meth:`dspark_jax.serving.engine.planner.Planner.want_drafts`)."""
        dec = m.get("scheduler_decision")
        if dec:
            g = GaugeMetricFamily(
                "dspark:scheduler_expected_tokens_per_s",
                "The scheduler's expected output tokens/s of its next step with and without "
                "drafting (SPS table x forecast acceptance).",
                labels=["model_name", "mode"],
            )
            g.add_metric([self.model_name, "drafting"], float(dec["tokens_per_s_drafting"]))
            g.add_metric([self.model_name, "plain"], float(dec["tokens_per_s_plain"]))
            yield g
            yield self._gauge(
                "dspark:scheduler_catchup_seconds",
                "Catch-up cost priced into the last decision to resume drafting (0 unless suspended).",
                dec["catchup_seconds"],
            )
        if m.get("drafting_suspended") is not None:
            yield self._gauge(
                "dspark:scheduler_drafting_suspended",
                "1 while the drafter is suspended (plain steps without drafter context upkeep).",
                int(m["drafting_suspended"]),
            )

    def _per_position(self, m: dict):
        for key, metric, doc in _POSITION_COUNTERS:
            if m.get(key) is not None:
                c = CounterMetricFamily(metric, doc, labels=["model_name", "position"])
                for i, v in enumerate(_as_list(m[key])):
                    c.add_metric([self.model_name, str(i + 1)], float(v))
                yield c

    def _histograms(self, m: dict):
        for key, label, metric, doc in (
            ("budget_hist", "tokens", "dspark:engine_steps_by_budget", "Engine steps by packed-token budget."),
            ("rows_hist", "rows", "dspark:engine_steps_by_rows", "Engine steps by row bucket."),
        ):
            if isinstance(m.get(key), dict):
                c = CounterMetricFamily(metric, doc, labels=["model_name", label])
                for k, v in sorted(m[key].items()):
                    c.add_metric([self.model_name, str(k)], float(v))
                yield c

    def _calibration(self, cal: dict):
        for key, metric, doc in _CALIBRATION_GAUGES:
            if cal.get(key) is not None:
                g = GaugeMetricFamily(metric, doc, labels=["model_name", "position"])
                for i, v in enumerate(_as_list(cal[key])):
                    if v is not None and math.isfinite(float(v)):
                        g.add_metric([self.model_name, str(i + 1)], float(v))
                yield g


def _as_list(x) -> list:
    if hasattr(x, "tolist"):
        x = x.tolist()
    return list(x) if isinstance(x, (list, tuple)) else [x]
