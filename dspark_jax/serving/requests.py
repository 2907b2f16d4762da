"""What callers hand the serving engine and get back: requests, sampling settings, step outputs,
prefilled requests, and the validation of a request against an engine's limits.

:class:`SamplingParams`, :class:`Request`, :class:`StepOutput` and :class:`Prefix` are the
engine's public data types (re-exported by :mod:`dspark_jax.serving.engine`). The per-request
logit-bias table (``logit_bias`` entries and ``min_tokens``' masking of stop ids, DESIGN.md
"Pipeline" (serve), issue 14) is built here on the host; the device applies it
(:func:`dspark_jax.serving.programs.apply_bias`).

Per-request logit processing
----------------------------
``SamplingParams.logit_bias`` and ``min_tokens`` (EOS / stop ids at ``-inf`` while fewer than
``min_tokens`` tokens were generated) form a sparse per-row table ``(ids, val, until)``
of ``max_logit_bias + max_stop_ids`` entries, added to the RAW logits of the target (p) and
of the drafter (q: its base logits, the Markov correction being additive) before
temperature / top-k / top-p, so both modes stay lossless for the biased target. The step
applies it under ``lax.cond`` only when some active row needs it. ``logprobs`` are the
target's ``log_softmax`` of its raw logits at every emitted position (vLLM's default "raw"
mode: before bias / temperature / filtering), with the top ``n <= 20``; the step computes
them (log-softmax + top-k over V per packed token) under ``lax.cond`` only when some active
row asked, and the host reads them back only then. Both flags are runtime scalars: no
recompilation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dspark_jax.errors import DSparkInputError

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "Prefix",
    "Request",
    "RequestLimits",
    "SamplingParams",
    "StepOutput",
    "bias_table",
    "logit_bias",
    "lp_entry",
    "no_bias",
    "stop_ids",
    "validate_request",
]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
      temperature: >= 0; 0 is greedy.
      top_k: >= 0; 0 is off.
      top_p: in (0, 1]; 1 is off.
      seed: PRNG seed in the int32 range (same meaning as ``decode.generate_*(seed=...)``).
      max_tokens: >= 1, generated tokens at most.
      stop_token_ids: extra ids that end the request (EOS ids are added by the engine).
      logit_bias: ``((token_id, bias), ...)``: ``bias`` is added to the raw logit of
        ``token_id`` before temperature / top-k / top-p, identically for the target's p and
        the drafter's q (so verification stays lossless); at most ``Engine.max_logit_bias``
        entries, finite biases (a repeated id: the last entry wins).
      logprobs: None (off) or ``n`` in ``[0, 20]``: every emitted token comes with its
        logprob and the ``n`` most likely (id, logprob) alternatives. Logprobs are the
        TARGET's ``log_softmax`` of its RAW logits at that position (vLLM's default "raw"
        mode: before logit_bias / min_tokens / temperature / top-k / top-p), never the
        drafter's.
      min_tokens: EOS ids and ``stop_token_ids`` are masked out of sampling (logit -inf, as
        vLLM does) and cannot end the request before ``min_tokens`` tokens were generated;
        ``<= max_tokens``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    min_tokens: int = 0


@dataclasses.dataclass
class Request:
    """A generation request: prompt token ids, sampling settings and a caller id."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""


@dataclasses.dataclass
class StepOutput:
    """What one :meth:`Engine.generate` produced for one slot.

    Attributes:
      slot: the logical slot.
      request_id: the request's id.
      token_ids: new tokens this step (the stop token included; the first token sampled at
        prefill is delivered with the slot's first step).
      finished: True when the request ended this step (its slot is free afterwards).
      finish_reason: ``"stop"``, ``"length"``, ``"error"`` or None while running.
      num_verified / num_accepted: draft tokens verified / accepted for this slot this step.
      logprobs: None unless the request set ``SamplingParams.logprobs``; else aligned with
        ``token_ids``: per token ``(logprob, [(id, logprob), ...] top-n, most likely first)``
        from the target's log-softmax of its raw logits (see :class:`SamplingParams`).
    """

    slot: int
    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_verified: int
    num_accepted: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class Prefix:
    """A prefilled request ready for :meth:`Engine.insert` (device caches + first token).

    ``conf_logit`` (``[gamma]`` raw confidence logits of the first drafted block) is None when
    prefill did not draft: no drafter, or the engine was not drafting at the time.
    ``has_context`` is False when prefill skipped the drafter context because the drafter was
    suspended (the prompt is caught up if drafting resumes).
    """

    request: Request
    prompt_len: int
    bucket_len: int
    first_token: int
    finite: bool
    conf_logit: np.ndarray | None
    arrays: Any = dataclasses.field(repr=False, default=None)
    has_context: bool = True
    first_logprob: tuple[float, list[tuple[int, float]]] | None = None
    bias: Any = dataclasses.field(repr=False, default=None)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What an engine can serve, for :func:`validate_request`.

    Attributes:
      vocab_size / max_position: the target's vocabulary and context length.
      cache_len: KV cache positions per slot.
      max_prompt: the largest prefill bucket (prompt tokens at most).
      max_logit_bias / max_stop_ids: capacities of the per-row bias table.
      n_top: most logprob alternatives (``min(20, vocab_size)``).
      eos_ids: ids that end every request.
    """

    vocab_size: int
    max_position: int
    cache_len: int
    max_prompt: int
    max_logit_bias: int
    max_stop_ids: int
    n_top: int
    eos_ids: tuple[int, ...]

    @property
    def table_size(self) -> int:
        """Entries of a request's bias table (``NB``)."""
        return max(1, self.max_logit_bias + self.max_stop_ids)


def _is_int(x) -> bool:
    """An integer value (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def lp_entry(chosen, top_v, top_i, n: int) -> tuple[float, list[tuple[int, float]]]:
    """One token's ``(logprob, [(id, logprob)] * n)`` from device arrays."""
    return float(chosen), [(int(top_i[m]), float(top_v[m])) for m in range(n)]


def stop_ids(p: SamplingParams, eos_ids: tuple[int, ...]) -> frozenset:
    """The ids that end a request: the engine's EOS ids and ``p.stop_token_ids``."""
    return frozenset(eos_ids) | frozenset(int(t) for t in p.stop_token_ids)


def _check_prompt(ids, limits: RequestLimits) -> None:
    if ids is None or len(ids) == 0:
        raise DSparkInputError("the prompt is empty: give at least one token")
    try:
        arr = np.asarray(ids, np.int64)
    except (TypeError, ValueError):
        raise DSparkInputError("prompt token ids must be integers") from None
    if arr.ndim != 1:
        raise DSparkInputError("prompt token ids must be a flat list of integers")
    bad = arr[(arr < 0) | (arr >= limits.vocab_size)]
    if bad.size:
        raise DSparkInputError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {limits.vocab_size})")
    limit = min(limits.cache_len - 1, limits.max_position - 1, limits.max_prompt)
    if len(arr) > limit:
        raise DSparkInputError(
            f"the prompt has {len(arr)} tokens but at most {limit} fit "
            f"(cache_len {limits.cache_len}, model context {limits.max_position}, "
            f"largest prefill bucket {limits.max_prompt})"
        )


def _check_sampling(p: SamplingParams) -> None:
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise DSparkInputError(f"temperature must be a finite number >= 0, got {p.temperature}")
    if int(p.top_k) != p.top_k or p.top_k < 0:
        raise DSparkInputError(f"top_k must be an integer >= 0, got {p.top_k}")
    if not (0.0 < p.top_p <= 1.0):
        raise DSparkInputError(f"top_p must be in (0, 1], got {p.top_p}")
    if int(p.max_tokens) != p.max_tokens or p.max_tokens < 1:
        raise DSparkInputError(f"max_tokens must be an integer >= 1, got {p.max_tokens}")
    if int(p.seed) != p.seed or not INT32_MIN <= p.seed <= INT32_MAX:
        raise DSparkInputError(f"seed must be an integer in [{INT32_MIN}, {INT32_MAX}], got {p.seed}")
    try:
        [int(t) for t in p.stop_token_ids]
    except (TypeError, ValueError):
        raise DSparkInputError("stop_token_ids must be integers") from None


def _check_extras(p: SamplingParams, limits: RequestLimits) -> None:
    """logit_bias, logprobs and min_tokens (issue 14)."""
    logit_bias(p, limits)
    n_lp = p.logprobs
    if n_lp is not None and not (_is_int(n_lp) and 0 <= n_lp <= 20):
        raise DSparkInputError(f"logprobs must be None or an integer in [0, 20], got {n_lp!r}")
    if n_lp is not None and n_lp > limits.n_top:
        raise DSparkInputError(f"logprobs must be <= {limits.n_top} (the vocabulary size), got {n_lp}")
    if not (_is_int(p.min_tokens) and p.min_tokens >= 0):
        raise DSparkInputError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
    if p.min_tokens > p.max_tokens:
        raise DSparkInputError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    n_stops = len(stop_ids(p, limits.eos_ids)) if p.min_tokens else 0
    if n_stops > limits.max_stop_ids:
        raise DSparkInputError(
            f"min_tokens with {n_stops} EOS/stop_token_ids: at most {limits.max_stop_ids} are supported"
        )


def validate_request(request: Request, limits: RequestLimits) -> None:
    """Checks that an engine with ``limits`` can serve ``request``.

    Raises:
      DSparkInputError: params not a :class:`SamplingParams`, an empty prompt, a token id
        outside the vocabulary, a prompt too long for the cache / model / prefill buckets, or
        bad sampling settings (temperature, top-k, top-p, max_tokens, seed, stop ids,
        logit_bias, logprobs, min_tokens).
    """
    if not isinstance(request.params, SamplingParams):
        raise DSparkInputError("request.params must be a SamplingParams")
    _check_prompt(request.prompt_ids, limits)
    _check_sampling(request.params)
    _check_extras(request.params, limits)


def logit_bias(p: SamplingParams, limits: RequestLimits) -> dict[int, float]:
    """Validated ``{token_id: bias}`` of ``p.logit_bias`` (a repeated id: last wins).

    Raises:
      DSparkInputError: not (id, bias) pairs, an id outside the vocabulary, a non-finite
        bias, or more than ``max_logit_bias`` entries.
    """
    lb = p.logit_bias
    v = limits.vocab_size
    try:
        pairs = list(lb.items()) if isinstance(lb, dict) else [tuple(e) for e in lb]
        out = {}
        for t, b in pairs:
            if not _is_int(t) or isinstance(b, (bool, str)):
                raise ValueError
            out[int(t)] = float(b)
    except (TypeError, ValueError):
        raise DSparkInputError(
            "logit_bias must be a sequence of (token_id, bias) pairs with integer ids and numeric biases"
        ) from None
    for t, b in out.items():
        if not 0 <= t < v:
            raise DSparkInputError(f"logit_bias token id {t} is outside the vocabulary [0, {v})")
        if not math.isfinite(b):
            raise DSparkInputError(f"logit_bias for token {t} must be finite, got {b}")
    if len(out) > limits.max_logit_bias:
        raise DSparkInputError(f"logit_bias has {len(out)} entries; at most {limits.max_logit_bias} are supported")
    return out


def no_bias(nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An empty bias table: ``ids [NB]`` int32 zeros, ``val [NB]`` float32 zeros, ``until
    [NB]`` int32 ``INT32_MIN`` (padding entries never apply)."""
    return np.zeros(nb, np.int32), np.zeros(nb, np.float32), np.full(nb, INT32_MIN, np.int32)


def bias_table(p: SamplingParams, prompt_len: int, limits: RequestLimits):
    """The request's ``(ids, val, until)`` ``[NB]`` bias table (see
    :func:`dspark_jax.serving.programs.apply_bias`): logit_bias entries (always on:
    ``until = INT32_MAX``), then, with ``min_tokens``, every EOS / stop id at ``-inf`` for the
    positions predicting generated tokens ``0 .. min_tokens - 1``."""
    ids, val, until = no_bias(limits.table_size)
    i = 0
    for t, b in logit_bias(p, limits).items():
        ids[i], val[i], until[i] = t, b, INT32_MAX
        i += 1
    if p.min_tokens:
        for t in sorted(t for t in stop_ids(p, limits.eos_ids) if 0 <= t < limits.vocab_size):
            ids[i], val[i], until[i] = t, -np.inf, prompt_len + int(p.min_tokens) - 1
            i += 1
    return ids, val, until
