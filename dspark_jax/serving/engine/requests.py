"""What callers hand the serving engine and get back: requests, sampling settings, step outputs,
prefilled requests, and the validation of a request against an engine's limits.

:class:`SamplingParams`, :class:`Request`, :class:`StepOutput` and :class:`Prefix` are the
engine's public data types (re-exported by :mod:`dspark_jax.serving.engine`). The per-request
logit-bias table (``logit_bias`` entries and ``min_tokens``' masking of stop ids, docs/design.md#serving)
is built here on the host; the device applies it
(:func:`dspark_jax.serving.engine.step_programs.apply_bias`).

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
from typing import Any

import numpy as np

from dspark_jax.decoding.validation import (
    INT32_MAX,
    INT32_MIN,
    check_logit_bias,
    check_logprobs,
    check_max_new_tokens,
    check_min_tokens,
    check_prompt,
    check_sampling,
    check_seed,
    check_stop_token_ids,
)
from dspark_jax.errors import DSparkInputError

__all__ = [
    "Prefix",
    "Request",
    "RequestLimits",
    "SamplingParams",
    "StepOutput",
    "bias_table",
    "logit_bias",
    "lp_entry",
    "no_bias",
    "stop_set",
    "validate_request",
]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, in the package's vocabulary (the names and defaults of
    :class:`~dspark_jax.decoding.request.DecodeRequest`; the HTTP server maps OpenAI's names onto
    them, docs/serving.md#one-request-vocabulary).

    Attributes:
      temperature: in ``[0, FLOAT32_MAX]``; 0 (the default) is greedy, and so is one small enough that the
        scaled logits overflow float32 (``2e-38``; :func:`~dspark_jax.models.sampling.process_logits`).
      top_k: an integer in ``[0, INT32_MAX]``; 0 (or at least the vocabulary size) is off.
      top_p: in (0, 1]; 1 is off.
      seed: PRNG seed in the int32 range (same meaning as ``decode.generate_*(seed=...)``, whose
        seeds may be any int64: the engine keeps them in int32 device arrays).
      max_new_tokens: in ``[1, INT32_MAX]``, generated tokens at most.
      stop_ids: extra ids that end the request (EOS ids are added by the engine).
      logit_bias: ``((token_id, bias), ...)``: ``bias`` is added to the raw logit of
        ``token_id`` before temperature / top-k / top-p, identically for the target's p and
        the drafter's q (so verification stays lossless); at most ``Engine.max_logit_bias``
        entries, finite biases (a repeated id: the last entry wins).
      logprobs: None (off) or ``n`` in ``[0, 20]``: every emitted token comes with its
        logprob and the ``n`` most likely (id, logprob) alternatives. Logprobs are the
        TARGET's ``log_softmax`` of its RAW logits at that position (vLLM's default "raw"
        mode: before logit_bias / min_tokens / temperature / top-k / top-p), never the
        drafter's.
      min_tokens: EOS ids and ``stop_ids`` are masked out of sampling (logit -inf, as
        vLLM does) and cannot end the request before ``min_tokens`` tokens were generated;
        ``<= max_new_tokens``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()
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

    ``conf_logit`` (``[block_size]`` raw confidence logits of the first drafted block) is None when
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


def lp_entry(chosen, top_v, top_i, n: int) -> tuple[float, list[tuple[int, float]]]:
    """One token's ``(logprob, [(id, logprob)] * n)`` from device arrays."""
    return float(chosen), [(int(top_i[m]), float(top_v[m])) for m in range(n)]


def stop_set(p: SamplingParams, eos_ids: tuple[int, ...]) -> frozenset:
    """The ids that end a request: the engine's EOS ids and ``p.stop_ids``."""
    return frozenset(eos_ids) | frozenset(int(t) for t in p.stop_ids)


def _check_prompt(ids, limits: RequestLimits) -> None:
    limit = min(limits.cache_len - 1, limits.max_position - 1, limits.max_prompt)
    why = (
        f"cache_len {limits.cache_len}, model context {limits.max_position}, largest prefill bucket {limits.max_prompt}"
    )
    check_prompt(ids, limits.vocab_size, limit, why=why)


def _check_sampling(p: SamplingParams) -> None:
    check_sampling(p.temperature, p.top_k, p.top_p)
    # The engine has always taken integral floats (max_new_tokens=3.0, seed=3.0) and refused 3.5.
    check_max_new_tokens(p.max_new_tokens, 1, "max_new_tokens", strict_int=True)
    check_seed(p.seed, integral_floats=True)
    check_stop_token_ids(p.stop_ids)  # ids outside the vocabulary never match: allowed


def _check_extras(p: SamplingParams, limits: RequestLimits) -> None:
    """Checks the OpenAI extras (logit_bias, logprobs and min_tokens) against ``limits``."""
    logit_bias(p, limits)
    n_lp = check_logprobs(p.logprobs, 20)
    if n_lp is not None and n_lp > limits.n_top:
        raise DSparkInputError(f"logprobs must be <= {limits.n_top} (the vocabulary size), got {n_lp}")
    check_min_tokens(p.min_tokens, p.max_new_tokens)
    n_stops = len(stop_set(p, limits.eos_ids)) if p.min_tokens else 0
    if n_stops > limits.max_stop_ids:
        raise DSparkInputError(f"min_tokens with {n_stops} EOS/stop_ids: at most {limits.max_stop_ids} are supported")


def validate_request(request: Request, limits: RequestLimits) -> None:
    """Checks that an engine with ``limits`` can serve ``request``, with the checks of
    :mod:`dspark_jax.decoding.validation`.

    Raises:
      DSparkInputError: params not a :class:`SamplingParams`, an empty prompt, a token id
        outside the vocabulary, a prompt too long for the cache / model / prefill buckets, or
        bad sampling settings (temperature, top-k, top-p, max_new_tokens, seed, stop ids,
        logit_bias, logprobs, min_tokens).
    """
    if not isinstance(request.params, SamplingParams):
        raise DSparkInputError("request.params must be a SamplingParams")
    _check_prompt(request.prompt_ids, limits)
    _check_sampling(request.params)
    _check_extras(request.params, limits)


def logit_bias(p: SamplingParams, limits: RequestLimits) -> dict[int, float]:
    """Validated ``{token_id: bias}`` of ``p.logit_bias`` (a repeated id: last wins;
    :func:`~dspark_jax.decoding.validation.check_logit_bias`).

    Raises:
      DSparkInputError: not (id, bias) pairs, an id outside the vocabulary, a non-finite
        bias, or more than ``max_logit_bias`` entries.
    """
    return check_logit_bias(p.logit_bias, limits.vocab_size, limits.max_logit_bias)


def no_bias(nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An empty bias table: ``ids [NB]`` int32 zeros, ``val [NB]`` float32 zeros, ``until
    [NB]`` int32 ``INT32_MIN`` (padding entries never apply)."""
    return np.zeros(nb, np.int32), np.zeros(nb, np.float32), np.full(nb, INT32_MIN, np.int32)


def bias_table(p: SamplingParams, prompt_len: int, limits: RequestLimits):
    """The request's ``(ids, val, until)`` ``[NB]`` bias table (see
    :func:`dspark_jax.serving.engine.step_programs.apply_bias`): logit_bias entries (always on:
    ``until = INT32_MAX``), then, with ``min_tokens``, every EOS / stop id at ``-inf`` for the
    positions predicting generated tokens ``0 .. min_tokens - 1``."""
    ids, val, until = no_bias(limits.table_size)
    i = 0
    for t, b in logit_bias(p, limits).items():
        ids[i], val[i], until[i] = t, b, INT32_MAX
        i += 1
    if p.min_tokens:
        for t in sorted(t for t in stop_set(p, limits.eos_ids) if 0 <= t < limits.vocab_size):
            # Capped to int32 (a min_tokens near INT32_MAX): no cache reaches that position anyway.
            ids[i], val[i], until[i] = t, -np.inf, min(prompt_len + int(p.min_tokens) - 1, INT32_MAX)
            i += 1
    return ids, val, until
