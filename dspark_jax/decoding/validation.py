"""Request validation: one place for every check of a decoding request's input.

Used by :mod:`dspark_jax.decoding.speculative`, :mod:`dspark_jax.commands.generate` and
:mod:`dspark_jax.api` (and meant for the serving engine, server and CLI): sampling settings
(NaN/inf included), prompts and their token ids, context limits, the number of speculative
tokens and per-request serving extras (seed, stop ids, logit bias, logprobs, min_tokens).
Every check raises :class:`~dspark_jax.errors.DSparkInputError` with one line naming the
setting, before any model is touched. Values the device arrays cannot hold are refused rather
than wrapped or saturated: integers (``top_k``, token ids, ``max_new_tokens``, seeds of the
serving engine) beyond int32, a temperature beyond float32's largest finite value. The
drafter/target pairing is checked by :func:`dspark_jax.drafters.base.check_compatible` (it
reads the drafter's config).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from dspark_jax.errors import DSparkInputError

__all__ = [
    "FLOAT32_MAX",
    "INT32_MAX",
    "INT32_MIN",
    "check_logit_bias",
    "check_logprobs",
    "check_max_new_tokens",
    "check_min_tokens",
    "check_num_speculative_tokens",
    "check_prompt",
    "check_prompts",
    "check_sampling",
    "check_seed",
    "check_seeds",
    "check_stop_token_ids",
]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest temperature the samplers can hold


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _as_float(x: float) -> float:
    """``float(x)``, with +-inf for an int too large for a float (``10**400``)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _numbers(value) -> np.ndarray | None:
    """``value`` (a number or an array of them) as flat float64, or None when it is not
    numeric (a string, None, an object). Python ints too large for int64 (``2**70``, an object
    array to numpy) are numbers too, so that range checks can name them."""
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if arr.dtype.kind == "O":
        if not all(isinstance(x, numbers.Real) for x in arr.flat):
            return None
        return np.array([_as_float(x) for x in arr.flat], np.float64)
    if arr.dtype.kind not in "biuf":
        return None
    return arr.astype(np.float64).reshape(-1)


def _shown(x: float) -> str:
    """A refused value for a message: ``2147483648`` rather than ``2147483648.0``."""
    return str(int(x)) if math.isfinite(x) and x.is_integer() else str(x)


def check_sampling(temperature=0.0, top_k=0, top_p=1.0) -> None:
    """Refuses sampling settings the samplers cannot honour (scalars or per-request sequences).

    A temperature so small that the temperature-scaled logits overflow float32 (``2e-38``; a
    subnormal one) is valid: it samples the T -> 0 limit, the greedy token, as
    :func:`~dspark_jax.models.sampling.process_logits` documents. A ``top_k`` at least the
    vocabulary size is off, as 0 is.

    Raises:
      DSparkInputError: a NaN/inf or negative temperature, or one above float32's largest
        finite value (:data:`FLOAT32_MAX`, about 3.4e38: float32 would hold it as inf); a
        top_p outside (0, 1] (NaN included); a top_k that is not an integer in
        ``[0, INT32_MAX]`` (the samplers hold it as int32). One line naming the setting.
    """
    arrays = {}
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        arr = _numbers(value)
        if arr is None:
            raise DSparkInputError(f"{name} must be a number, got {value!r}")
        bad = arr[~np.isfinite(arr)]
        if bad.size:
            raise DSparkInputError(f"{name} must be a finite number, got {float(bad[0])}")
        arrays[name] = arr
    t, p, k = arrays["temperature"], arrays["top_p"], arrays["top_k"]
    if np.any(t < 0):
        raise DSparkInputError(f"temperature must be >= 0 (0 is greedy), got {float(t[t < 0][0])}")
    if np.any(t > FLOAT32_MAX):
        raise DSparkInputError(
            f"temperature must be at most {FLOAT32_MAX:.7g} (float32's largest), got {float(t[t > FLOAT32_MAX][0])}"
        )
    if np.any((p <= 0) | (p > 1)):
        raise DSparkInputError(f"top_p must be in (0, 1], got {float(p[(p <= 0) | (p > 1)][0])}")
    bad_k = (k < 0) | (k != np.round(k)) | (k > INT32_MAX)
    if np.any(bad_k):
        raise DSparkInputError(f"top_k must be an integer in [0, {INT32_MAX}] (0 is off), got {_shown(k[bad_k][0])}")


def check_max_new_tokens(
    max_new_tokens, num_requests: int, name: str = "max_new_tokens", *, strict_int: bool = False
) -> np.ndarray:
    """``[num_requests]`` int64 caps on generated tokens (a shared int or one per request).

    Args:
      name: the setting's name in the message (the serving API calls it ``max_tokens``).
      strict_int: refuse a non-integral value (``3.5``, NaN, inf) instead of truncating it;
        integral floats (``3.0``) pass. The serving engine's ``max_tokens`` has always been
        checked so.
    Raises:
      DSparkInputError: a value < 1 or > ``INT32_MAX`` (a cap no context reaches; the device
        holds positions as int32), or, with ``strict_int``, not an integer.
    """
    as_float = _numbers(max_new_tokens)
    if strict_int and (as_float is None or not np.all(np.isfinite(as_float) & (as_float == np.round(as_float)))):
        raise DSparkInputError(f"{name} must be an integer >= 1, got {max_new_tokens!r}")
    if as_float is not None and np.any(as_float > INT32_MAX):
        raise DSparkInputError(f"{name} must be at most {INT32_MAX}, got {_shown(as_float[as_float > INT32_MAX][0])}")
    try:
        arr = np.asarray(max_new_tokens, np.int64)
    except (TypeError, ValueError, OverflowError):
        raise DSparkInputError(f"{name} must be an integer >= 1, got {max_new_tokens!r}") from None
    max_new = np.broadcast_to(arr, (num_requests,))
    if np.any(max_new < 1):
        raise DSparkInputError(f"{name} must be >= 1")
    return max_new


def check_prompt(
    ids: Sequence[int], vocab_size: int, max_len: int | None = None, name: str = "the prompt", why: str | None = None
) -> None:
    """One prompt: non-empty, integer token ids in ``[0, vocab_size)``, at most ``max_len`` tokens.

    Args:
      max_len: most prompt tokens that fit (None: no limit).
      name: how the message names the prompt (``"prompt 3"`` in a batch).
      why: what sets ``max_len`` (e.g. ``"cache_len 512, model context 2048"``); None: the
        target's context of ``max_len + 1`` tokens (one generated token must fit).
    Raises:
      DSparkInputError: empty, non-integer or out-of-vocabulary ids, or too long.
    """
    if ids is None or len(ids) == 0:
        raise DSparkInputError(f"{name} is empty: give at least one token")
    try:
        arr = np.asarray(ids, np.int64)
    except OverflowError:  # a Python int beyond int64: outside any vocabulary
        bad_id = next((t for t in ids if _is_int(t) and not INT64_MIN <= t <= INT64_MAX), None)
        if bad_id is None:
            raise DSparkInputError(f"{name}: token ids must be a flat list of integers") from None
        raise DSparkInputError(f"{name} has token id {bad_id} outside the vocabulary [0, {vocab_size})") from None
    except (TypeError, ValueError):
        raise DSparkInputError(f"{name}: token ids must be integers") from None
    if arr.ndim != 1:
        raise DSparkInputError(f"{name}: token ids must be a flat list of integers")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
        raise DSparkInputError(f"{name} has token id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
    if max_len is not None and len(arr) > max_len:
        if why is not None:
            raise DSparkInputError(f"{name} has {len(arr)} tokens but at most {max_len} fit ({why})")
        raise DSparkInputError(
            f"{name} has {len(arr)} tokens but the target's context is {max_len + 1}: shorten the prompt"
        )


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_position: int) -> None:
    """A batch of prompts (:func:`check_prompt` each, named ``prompt i``); each must leave room
    for one generated token in the target's context of ``max_position`` tokens.

    Raises:
      DSparkInputError: no prompts, or a bad prompt.
    """
    if not prompts:
        raise DSparkInputError("no prompts given")
    for i, p in enumerate(prompts):
        check_prompt(p, vocab_size, max_position - 1, name=f"prompt {i}")


def check_seed(seed, *, integral_floats: bool = False) -> int:
    """A request's PRNG seed: an integer in the int32 range.

    Args:
      integral_floats: also accept a real number with an integer value (``3.0``), as the
        serving engine's ``SamplingParams.seed`` always has.
    Raises:
      DSparkInputError: not an integer, or outside ``[INT32_MIN, INT32_MAX]``.
    """
    value = None
    if _is_int(seed):
        value = int(seed)
    elif integral_floats and isinstance(seed, numbers.Real) and float(seed).is_integer():  # NaN / inf: False
        value = int(float(seed))
    if value is None or not INT32_MIN <= value <= INT32_MAX:
        raise DSparkInputError(f"seed must be an integer in [{INT32_MIN}, {INT32_MAX}], got {seed!r}")
    return value


def check_seeds(seeds, num_requests: int) -> np.ndarray:
    """``[num_requests]`` int64 PRNG seeds of the decode API (a shared seed or one per request).

    Unlike :func:`check_seed` (the serving engine's int32 seeds) any int64 is taken, as
    :func:`jax.random.PRNGKey` takes it (without x64 it keeps the low 32 bits: ``2**32``
    gives seed 0's key); the training pipelines derive such seeds. Integral floats (``3.0``)
    pass.

    Raises:
      DSparkInputError: a seed that is not an integer, or outside ``[-2**63, 2**63 - 1]``.
    """
    out = []
    for seed in np.asarray(seeds, dtype=object).reshape(-1):  # the exact Python / numpy values
        value = None
        if _is_int(seed):
            value = int(seed)
        elif isinstance(seed, numbers.Real) and not isinstance(seed, bool) and float(seed).is_integer():
            value = int(float(seed))
        if value is None or not INT64_MIN <= value <= INT64_MAX:
            raise DSparkInputError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {seed!r}")
        out.append(value)
    return np.broadcast_to(np.asarray(out, np.int64).reshape(np.shape(seeds)), (num_requests,))


def check_stop_token_ids(ids, vocab_size: int | None = None) -> tuple[int, ...]:
    """Stop token ids: integers (inside the vocabulary when ``vocab_size`` is given).

    Raises:
      DSparkInputError: a non-integer id or one outside ``[0, vocab_size)``.
    """
    try:
        out = tuple(int(t) for t in ids)
    except (TypeError, ValueError):
        raise DSparkInputError("stop_token_ids must be integers") from None
    if vocab_size is not None:
        bad = [t for t in out if not 0 <= t < vocab_size]
        if bad:
            raise DSparkInputError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return out


def check_logit_bias(
    logit_bias, vocab_size: int, max_entries: int, bias_range: float | None = None
) -> dict[int, float]:
    """Validated ``{token_id: bias}`` of ``(token_id, bias)`` pairs or a dict (a repeated id: last wins).

    Args:
      bias_range: optional bound on ``|bias|`` (the OpenAI API's 100).
    Raises:
      DSparkInputError: not (id, bias) pairs, an id outside the vocabulary, a non-finite
        (or out-of-range) bias, or more than ``max_entries`` entries.
    """
    try:
        pairs = list(logit_bias.items()) if isinstance(logit_bias, dict) else [tuple(e) for e in logit_bias]
        out = {}
        for t, b in pairs:
            if not _is_int(t) or isinstance(b, (bool, str)):
                raise ValueError
            out[int(t)] = _as_float(b)  # an int too large for a float: inf, refused below
    except (TypeError, ValueError):
        raise DSparkInputError(
            "logit_bias must be a sequence of (token_id, bias) pairs with integer ids and numeric biases"
        ) from None
    for t, b in out.items():
        if not 0 <= t < vocab_size:
            raise DSparkInputError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
        if not math.isfinite(b):
            raise DSparkInputError(f"logit_bias for token {t} must be finite, got {b}")
        if bias_range is not None and abs(b) > bias_range:
            raise DSparkInputError(f"logit_bias for token {t} must be in [-{bias_range:g}, {bias_range:g}], got {b}")
    if len(out) > max_entries:
        raise DSparkInputError(f"logit_bias has {len(out)} entries; at most {max_entries} are supported")
    return out


def check_logprobs(n, max_n: int = 20) -> int | None:
    """``logprobs``: None (off) or an integer in ``[0, max_n]``. Raises DSparkInputError."""
    if n is not None and not (_is_int(n) and 0 <= n <= max_n):
        raise DSparkInputError(f"logprobs must be None or an integer in [0, {max_n}], got {n!r}")
    return n


def check_min_tokens(min_tokens, max_tokens: int) -> int:
    """``min_tokens``: an integer in ``[0, max_tokens]``. Raises DSparkInputError."""
    if not (_is_int(min_tokens) and min_tokens >= 0):
        raise DSparkInputError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    if min_tokens > max_tokens:
        raise DSparkInputError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
    return int(min_tokens)


def check_num_speculative_tokens(num_speculative_tokens, block_size: int | None = None) -> int | str:
    """``num_speculative_tokens``: an int (or numeric string) in ``[1, block_size]``, or ``"auto"``.

    There is no "unset" value: the decoding front door's default is ``"auto"``
    (:class:`~dspark_jax.decoding.request.DecodeRequest`), and a caller that wants whole blocks
    verified passes the block size.

    Args:
      num_speculative_tokens: draft tokens verified per round, an int, a numeric string or ``"auto"``
        (any case, surrounding spaces ignored).
      block_size: the drafter's block size (drafts per round); None: the range is not checked
        (a request checked before its drafter is known).
    Returns:
      ``"auto"`` or an int in ``[1, block_size]``.
    Raises:
      DSparkInputError: None, a value outside ``[1, block_size]`` or neither an int nor ``"auto"``.
    """
    n = num_speculative_tokens
    if n is None:
        raise DSparkInputError(
            "num_speculative_tokens must be an integer in [1, block size] or 'auto', got None "
            "(pass the drafter's block size to verify whole blocks)"
        )
    if isinstance(n, str):
        if n.strip().lower() == "auto":
            return "auto"
        try:
            n = int(n)
        except ValueError:
            raise DSparkInputError(f"num_speculative_tokens must be an integer or 'auto', got {n!r}") from None
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise DSparkInputError(f"num_speculative_tokens must be an integer or 'auto', got {n!r}")
    if int(n) < 1 or (block_size is not None and int(n) > block_size):
        hi = "block size" if block_size is None else str(block_size)
        raise DSparkInputError(
            f"num_speculative_tokens must be in [1, {hi}] for this drafter (its block size) or 'auto', got {n}"
        )
    return int(n)
