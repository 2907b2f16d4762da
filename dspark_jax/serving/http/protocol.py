"""The OpenAI-compatible request protocol of the HTTP server: request models, the server's
static configuration, and the translation of a validated request into prompt token ids and the
engine's :class:`~dspark_jax.serving.engine.requests.SamplingParams` (chat messages:
:mod:`dspark_jax.serving.http.chat`).

Every field the server does not honour is refused with 400 naming it (the request models
forbid undeclared fields), and so is a value of the wrong JSON type (strict mode: a boolean is
not an integer, a numeric string not a number; an integer is a number); declared fields with
values the engine cannot honour (``presence_penalty`` != 0, ``echo``, ...) are refused too,
and so are numbers its device arrays cannot hold (a ``top_k`` beyond int32, a ``temperature``
beyond float32, a token id beyond int64): a 400 naming the field, before anything reaches the engine, so a bad request
never fails the others prefilled with it. ``max_tokens`` defaults as in vLLM:
16 for completions, the rest of the context for chat (``ServerConfig.default_max_tokens``
overrides both). ``n`` > 1 runs ``n`` requests: choice ``i`` is the same request with
``seed + i`` wrapped into int32 (:func:`choice_seed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark_jax.decoding.validation import (
    FLOAT32_MAX,
    INT32_MAX,
    check_logit_bias,
    check_min_tokens,
    check_prompt,
    check_stop_token_ids,
)
from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine.requests import SamplingParams

__all__ = [
    "LOGIT_BIAS_RANGE",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "SEED_RANGE",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SamplingRequest",
    "ServerConfig",
    "StreamOptions",
    "check_prompt_ids",
    "choice_seed",
    "completion_prompt",
    "default_max_request_bytes",
    "sampling_params",
]

SEED_RANGE = (-(2**31), 2**31 - 1)  # the engine's PRNG seeds are int32
MAX_STOP_STRINGS = 16
MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
LOGIT_BIAS_RANGE = 100.0


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice ``i`` of a request with ``seed``: ``seed + i`` wrapped into int32."""
    lo = SEED_RANGE[0]
    return (int(seed) + int(i) - lo) % 2**32 + lo


class APIError(Exception):
    """A request the server refuses: HTTP ``status``, OpenAI error ``kind`` and the offending
    ``param`` (None when no single field is at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Strict(BaseModel):
    """Refuses undeclared fields (a field the server does not honour is a 400, never ignored) and
    values of the wrong JSON type (strict mode, every field of every request model): a boolean is
    not an integer, a numeric string is not a number, ``3.0`` is not an integer; an integer is a
    number (OpenAI's ``number`` fields take integers)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = Field(
        False,
        description="stream a last chunk with ``usage`` (and ``choices: []``); "
        "every other chunk then has ``usage: null``",
    )


class SamplingRequest(_Strict):
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
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=FLOAT32_MAX,
        allow_inf_nan=False,
        description="default 1 (OpenAI's; the package's SamplingParams defaults to 0); 0 = greedy; so small that "
        "the scaled logits overflow float32 (2e-38): greedy too",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1 = off (so is any k >= the vocabulary size)")
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


class CompletionRequest(SamplingRequest):
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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="log-probability of each token")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; needs logprobs: true"
    )
    add_generation_prompt: bool = True


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
      max_request_bytes: the largest request body taken (413 above it, before it is parsed or
        tokenized); None: :func:`default_max_request_bytes` of ``context_len``; 0: no limit.
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
    max_request_bytes: int | None = None

    @property
    def request_byte_limit(self) -> int | None:
        """The body limit in bytes, or None for no limit (``max_request_bytes`` resolved)."""
        if self.max_request_bytes is None:
            return default_max_request_bytes(self.context_len)
        return self.max_request_bytes or None


def default_max_request_bytes(context_len: int) -> int:
    """The default request body limit: 64 bytes per token of the context (a prompt that fits
    is far shorter: text, escaped JSON or token ids) plus 64 KiB for the other fields (stop
    strings, ``logit_bias``, message framing)."""
    return 64 * int(context_len) + 64 * 1024


@contextlib.contextmanager
def _refused(param: str) -> Iterator[None]:
    """Turns a :mod:`dspark_jax.decoding.validation` refusal into a 400 naming ``param``."""
    try:
        yield
    except DSparkInputError as e:
        raise APIError(400, str(e), param) from None


# --------------------------------------------------------------------------- sampling parameters


def _max_tokens(req: SamplingRequest, prompt_len: int, max_tokens: int | None, chat: bool, cfg: ServerConfig) -> int:
    """The request's ``max_tokens``, defaulted (vLLM) and checked against the context."""
    room = cfg.context_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; the context length is {cfg.context_len} "
            "and leaves no room to generate",
            "prompt" if not chat else "messages",
        )
    if max_tokens is None:
        default = cfg.default_max_tokens if cfg.default_max_tokens is not None else (room if chat else 16)
        max_tokens = min(default, room)
    elif prompt_len + max_tokens > cfg.context_len:
        # chat's max_completion_tokens takes precedence over max_tokens (the handler passes it)
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds the context length {cfg.context_len}",
            name,
        )
    with _refused("min_tokens"):
        check_min_tokens(req.min_tokens, max_tokens)
    return max_tokens


def _stops(req: SamplingRequest, cfg: ServerConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(stop strings, stop token ids)``, checked."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    with _refused("stop_token_ids"):
        stop_ids = check_stop_token_ids(req.stop_token_ids or (), cfg.vocab_size)
    return tuple(stop), stop_ids


def _logit_bias(req: SamplingRequest, cfg: ServerConfig) -> dict[int, float]:
    """``{token id: bias}`` of ``req.logit_bias``, checked (ids in the vocabulary, biases in
    ``[-100, 100]``, at most ``max_logit_bias`` entries)."""
    pairs = []
    for key, value in (req.logit_bias or {}).items():  # JSON object keys are strings
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
    with _refused("logit_bias"):
        return check_logit_bias(pairs, cfg.vocab_size, cfg.max_logit_bias, bias_range=LOGIT_BIAS_RANGE)


def _n_logprobs(req: SamplingRequest, chat: bool) -> int | None:
    """Logprob alternatives per token, or None when logprobs are off."""
    if not chat:
        return getattr(req, "logprobs", None)
    top = getattr(req, "top_logprobs", None)
    on = bool(getattr(req, "logprobs", False))
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def sampling_params(
    req: SamplingRequest, prompt_len: int, max_tokens: int | None, chat: bool, cfg: ServerConfig
) -> tuple[list[SamplingParams], tuple[str, ...], int | None]:
    """``(params per choice, stop strings, logprobs n or None)`` of a validated request: the
    package's :class:`SamplingParams` (``max_tokens`` -> ``max_new_tokens``, ``stop_token_ids`` ->
    ``stop_ids``; the request's ``temperature`` defaults to OpenAI's 1.0).

    Choice ``i`` gets :func:`choice_seed` ``(seed, i)`` (a request without a seed gets a random
    one).

    Raises:
      APIError: 400 for penalties != 0, ``stream_options`` without streaming, no room in the
        context, bad ``max_tokens`` / ``min_tokens`` / stops / ``logit_bias`` /
        ``top_logprobs``.
    """
    if req.presence_penalty or req.frequency_penalty:
        raise APIError(
            400,
            "presence_penalty and frequency_penalty must be 0 (penalties would change the target's distribution)",
            "presence_penalty" if req.presence_penalty else "frequency_penalty",
        )
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be given with stream: true", "stream_options")
    max_tokens = _max_tokens(req, prompt_len, max_tokens, chat, cfg)
    stop, stop_ids = _stops(req, cfg)
    bias = _logit_bias(req, cfg)
    n_lp = _n_logprobs(req, chat)
    seed = req.seed if req.seed is not None else secrets.randbits(31)
    # OpenAI's names become the package's here, and only here (docs/serving.md#one-request-vocabulary).
    kw: dict = dict(
        temperature=float(req.temperature),
        top_k=max(int(req.top_k), 0),
        top_p=float(req.top_p),
        max_new_tokens=int(max_tokens),
        stop_ids=stop_ids,
    )
    if bias:
        kw["logit_bias"] = tuple(sorted(bias.items()))
    if n_lp is not None:
        kw["logprobs"] = int(n_lp)
    if req.min_tokens:
        kw["min_tokens"] = int(req.min_tokens)
    params = [SamplingParams(seed=choice_seed(seed, i), **kw) for i in range(req.n)]
    return params, stop, n_lp


# --------------------------------------------------------------------------- prompts


def check_prompt_ids(ids: list[int], cfg: ServerConfig, param: str = "prompt") -> list[int]:
    """``ids``, checked against the vocabulary (400 naming ``param`` otherwise)."""
    with _refused(param):
        check_prompt(ids, cfg.vocab_size)
    return ids


def completion_prompt(req: CompletionRequest, tokenizer, cfg: ServerConfig) -> list[int]:
    """The prompt token ids of a completion request (text is encoded with the tokenizer).

    Raises:
      APIError: 400 for a batch of prompts, ``echo``, ``best_of`` != 1, ``suffix``, an empty
        prompt or ids outside the vocabulary.
    """
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, f"one prompt per request is supported (got a batch of {len(p)})", "prompt")
        p = p[0]
    if req.echo:
        raise APIError(400, "echo is not supported", "echo")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of must be 1 (use n for several choices)", "best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if isinstance(p, str):
        if not p.strip():
            raise APIError(400, "the prompt is empty: give some text to continue", "prompt")
        return check_prompt_ids(tokenizer.encode(p), cfg)
    return check_prompt_ids([int(i) for i in p], cfg)  # type: ignore[arg-type]  # a flat list of ids here
