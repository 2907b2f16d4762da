"""Logit processing and sampling shared by plain decoding, the drafter and the verifier.

docs/design.md#verification: temperature / top-k / top-p are applied to the
target's logits to give p, and q is *exactly* the distribution a draft token was drawn
from. Losslessness therefore needs one function that turns logits into a sampling
distribution, used identically everywhere: :func:`process_logits`. Plain autoregressive
sampling, the drafter's proposal q and the verifier's p all go through it.

Conventions
-----------
* Batch-first. Sampling parameters are per row (per request): arrays of shape ``[B]``,
  broadcast over any middle axes of the logits (e.g. the ``G`` positions of a block).
* Randomness is explicit and per row: ``keys`` has shape ``[B, 2]`` (raw ``uint32`` keys
  from :func:`jax.random.PRNGKey` / :func:`jax.random.split`; new-style typed keys of
  shape ``[B]`` from :func:`jax.random.key` work too). Row ``b`` only ever consumes
  ``keys[b]``, so a request's output never depends on its batch-mates.
* Everything is jit-compatible with static shapes; no Python loops over tokens.

Non-finite logits
-----------------
``-inf`` is a supported logit: it bans a token (probability exactly 0), as long as
at least one logit of the distribution is finite. ``NaN`` and ``+inf`` are not supported:
the output of :func:`process_logits` for such a distribution is unspecified (typically
NaN in sampled rows; greedy rows, and sampled rows with a ``+inf``, pick the first ``+inf``
or a NaN row's last id). Callers that can
receive such logits should check :func:`logits_are_finite` outside ``jit`` and raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "SamplingArrays",
    "first_argmax",
    "logits_are_finite",
    "process_logits",
    "sample",
    "sample_or_argmax",
    "sample_subset",
    "sampling_arrays",
    "split_keys",
]


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters (a pytree: it can cross ``jit`` boundaries).

    Attributes:
      temperature: ``[B] float32``. ``<= 0`` means greedy (one-hot at the argmax); so does, per
        distribution, one small enough that the scaled logits overflow (:func:`process_logits`).
      top_k: ``[B] int32``. ``<= 0`` (or ``>= V``) means off.
      top_p: ``[B] float32``. ``>= 1`` means off. Values ``<= 0`` keep only the top token.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def sampling_arrays(
    batch: int,
    temperature: float | Sequence[float] | np.ndarray = 1.0,
    top_k: int | Sequence[int] | np.ndarray = 0,
    top_p: float | Sequence[float] | np.ndarray = 1.0,
) -> SamplingArrays:
    """Builds :class:`SamplingArrays` for a batch of ``batch`` rows.

    Each argument is either a Python scalar (shared by all rows) or a length-``batch``
    sequence (one value per row).

    Returns:
      ``SamplingArrays(temperature [B] f32, top_k [B] int32, top_p [B] f32)``.
    """

    def _full(value, dtype, name):
        arr = np.asarray(value, dtype=dtype)
        if arr.ndim == 0:
            arr = np.full((batch,), arr, dtype=dtype)
        if arr.shape != (batch,):
            raise ValueError(f"{name} has shape {arr.shape}, expected () or ({batch},)")
        return jnp.asarray(arr)

    return SamplingArrays(
        temperature=_full(temperature, np.float32, "temperature"),
        top_k=_full(top_k, np.int32, "top_k"),
        top_p=_full(top_p, np.float32, "top_p"),
    )


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
    """Reshapes a ``[B]`` parameter to ``[B, 1, ..., 1]`` (``ndim`` axes in total)."""
    return jnp.reshape(x, x.shape + (1,) * (ndim - 1))


def _order_keys(x: jax.Array) -> jax.Array:
    """``float32 -> uint32`` keys ordered as the floats (``-inf`` < ... < ``-0.0`` < ``+0.0`` < ... < ``+inf``)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    negative = lax.shift_right_logical(bits, jnp.uint32(31)) == 1
    return bits ^ jnp.where(negative, jnp.uint32(0xFFFFFFFF), jnp.uint32(0x80000000))


def _largest_passing(pred, shape: tuple[int, ...], num_bits: int) -> jax.Array:
    """The largest ``t`` in ``[0, 2**num_bits)`` (uint32, shape ``shape``) with ``pred(t)`` true, for
    a ``pred`` that is true up to some point and false after it, elementwise; 0 where it is never
    true. Built bit by bit from the most significant one: ``num_bits`` evaluations of ``pred``."""

    def body(i, t):
        cand = t | lax.shift_left(jnp.uint32(1), (num_bits - 1 - i).astype(jnp.uint32))
        return jnp.where(pred(cand), cand, t)

    return lax.fori_loop(0, num_bits, body, jnp.zeros(shape, jnp.uint32))


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask, axis=-1, keepdims=True, dtype=jnp.int32)


def _tie_cut(tie: jax.Array, ids: jax.Array, need: jax.Array) -> jax.Array:
    """The id of the ``need``-th (1-based, by id) token of ``tie`` (``need`` <= its count); when a
    row keeps every tie that is just its largest id, and the search over ids runs only under a
    ``lax.cond`` when some row keeps fewer."""
    last = jnp.max(jnp.where(tie, ids, -1), axis=-1, keepdims=True).astype(jnp.uint32)
    uids = ids.astype(jnp.uint32)
    num_bits = max(1, (ids.shape[-1] - 1).bit_length())

    def search(_):
        return _largest_passing(lambda j: _count(tie & (uids < j)) < need, need.shape, num_bits)

    return lax.cond(jnp.any(_count(tie) > need), search, lambda _: last, None)


def _prefix_mask(keys: jax.Array, uids: jax.Array, cut_key: jax.Array, cut_id: jax.Array) -> jax.Array:
    """The ranking prefix that ends at the token ``(cut_key, cut_id)``."""
    return (keys > cut_key) | ((keys == cut_key) & (uids <= cut_id))


def _top_k_mask(keys: jax.Array, ids: jax.Array, k_eff: jax.Array) -> jax.Array:
    """The ``k_eff`` first tokens of the ranking (``1 <= k_eff <= V``)."""
    cut_key = _largest_passing(lambda t: _count(keys >= t) >= k_eff, k_eff.shape, 32)
    tie = keys == cut_key
    cut_id = _tie_cut(tie, ids, k_eff - _count(keys > cut_key))
    return _prefix_mask(keys, ids.astype(jnp.uint32), cut_key, cut_id)


def _top_p_mask(keys: jax.Array, ids: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """The nucleus of ``probs`` (zero outside the top-k): the ranking positions whose mass strictly
    before them is ``< top_p``, at least one.

    ``cut_key`` is the largest logit ``L`` with ``mass(logit >= L) >= top_p``, capped at the
    maximum (``top_p <= 0``); every token above it is kept, and of the ``n`` tokens tied at it
    (equal logits, equal probabilities ``p``) the first ``ceil((top_p - mass(logit > L)) / p)``
    by id, clipped to ``[1, n]``. Where even the whole mass is ``< top_p`` (rounding), the search
    finds 0 and everything is kept.
    """

    def mass(mask):
        return jnp.sum(jnp.where(mask, probs, 0.0), axis=-1, keepdims=True)

    found = _largest_passing(lambda t: mass(keys >= t) >= top_p, top_p.shape, 32)
    cut_key = jnp.minimum(found, jnp.max(keys, axis=-1, keepdims=True))
    tie = (keys == cut_key) & (probs > 0.0)
    p_tie = jnp.max(jnp.where(tie, probs, 0.0), axis=-1, keepdims=True)
    before = top_p - mass(keys > cut_key)
    wanted = jnp.where(p_tie > 0.0, jnp.ceil(before / jnp.where(p_tie > 0.0, p_tie, 1.0)), 1.0)
    n_tie = _count(tie)
    need = jnp.minimum(jnp.clip(wanted, 1.0, float(keys.shape[-1])).astype(jnp.int32), n_tie)
    cut_id = _tie_cut(tie, ids, jnp.maximum(need, 1))
    keep = _prefix_mask(keys, ids.astype(jnp.uint32), cut_key, cut_id)
    return jnp.where(n_tie > 0, keep, keys > cut_key)


def filter_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to ``-inf``) the tokens outside the top-k, then outside the top-p nucleus.

    Args:
      scaled: ``[B, ..., V] f32`` temperature-scaled logits.
      top_k: ``[B, 1, ..., 1] int32`` (``<= 0`` or ``>= V``: off).
      top_p: ``[B, 1, ..., 1] f32`` (``>= 1``: off).

    Tokens are ranked by scaled logit, descending, equal logits by token id (lower id first).
    The kept set is always a prefix of that ranking of length ``n = max(1, min(k_eff, n_p))``
    where ``k_eff`` is the top-k size and ``n_p`` the smallest prefix of the
    top-k-renormalised distribution whose mass reaches ``top_p`` (vLLM / HF order:
    temperature, top-k, then top-p on the filtered distribution). Ties at the cut are
    therefore broken deterministically by token id and exactly ``n`` tokens are kept.

    Sort-free: each cut is a threshold ``(logit, token id)`` found by bisection, on the
    logit's bits (32 steps of a count, or of a masked sum of the probabilities, over V) and,
    only where a tie straddles the cut, on the token id (``ceil(log2 V)`` steps). Each search
    runs under a ``lax.cond`` that skips it when no row uses its filter. Agrees with a stable
    sort plus cumsum except where the nucleus mass is within float32 rounding of ``top_p``
    (the masses are sums over V, not a cumsum, so they round differently).
    """
    v = scaled.shape[-1]
    # Canonicalise -0.0 to +0.0 so the keys' order agrees with IEEE ``==``.
    scaled = jnp.where(scaled == 0.0, jnp.zeros_like(scaled), scaled)
    keys = _order_keys(scaled)
    ids = lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
    row_shape = scaled.shape[:-1] + (1,)
    top_k = jnp.broadcast_to(top_k, row_shape)
    top_p = jnp.broadcast_to(top_p, row_shape)
    k_on = (top_k > 0) & (top_k < v)
    p_on = top_p < 1.0
    everything = jnp.ones(scaled.shape, bool)

    in_top_k = lax.cond(jnp.any(k_on), lambda: _top_k_mask(keys, ids, jnp.where(k_on, top_k, v)), lambda: everything)
    in_top_k = in_top_k | ~k_on

    def nucleus():
        probs = jax.nn.softmax(jnp.where(in_top_k, scaled, -jnp.inf), axis=-1)
        return _top_p_mask(keys, ids, probs, jnp.where(p_on, top_p, 1.0)) | ~p_on

    keep = in_top_k & lax.cond(jnp.any(p_on), nucleus, lambda: everything)
    return jnp.where(keep, scaled, -jnp.inf)


@jax.jit
def process_logits(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Turns logits into the sampling distribution (the one function used everywhere).

    docs/design.md#verification: p (target) and q (drafter) are both produced by
    this function, so the verifier compares exactly the distributions that were sampled.

    Order (as vLLM / HF): temperature, then top-k, then top-p (the nucleus is computed on
    the temperature-scaled, top-k-renormalised distribution; the smallest prefix of the
    ranking whose mass is ``>= top_p`` is kept, always at least one token; ties ranked by
    token id, lower first). ``temperature <= 0`` gives exactly ``one_hot(argmax(logits))``
    (first index on ties); top-k / top-p cannot change a greedy row. So does a distribution
    whose scaled logits overflow float32 (a positive temperature below about
    ``|max logit| / 3.4e38``, such as ``2e-38``): that one-hot is its exact T -> 0 limit (ties
    aside, which go to the lowest id), where ``logits / T`` would give NaN.

    The top-k / top-p threshold searches (no sort, :func:`filter_top_k_top_p`) run under
    ``lax.cond`` only when some sampled (non-greedy) row actually uses them; otherwise this is
    an elementwise scale plus a softmax. (Do not ``vmap`` this function over the batch: a vmapped ``lax.cond``
    executes both branches. It already handles the batch and any middle axes.)

    Args:
      logits: ``[B, ..., V]`` float logits (cast to float32). ``-inf`` bans a token; see the
        module docstring for NaN / ``+inf``.
      params: :class:`SamplingArrays` with ``[B]`` leaves, broadcast over middle axes.

    Returns:
      ``[B, ..., V] float32`` probabilities (each distribution sums to 1 up to rounding).
    """
    logits = jnp.asarray(logits, jnp.float32)
    nd = logits.ndim
    v = logits.shape[-1]
    temperature = _per_row(jnp.asarray(params.temperature, jnp.float32), nd)
    top_k = _per_row(jnp.asarray(params.top_k, jnp.int32), nd)
    top_p = _per_row(jnp.asarray(params.top_p, jnp.float32), nd)

    greedy_row = temperature <= 0.0
    scaled = logits / jnp.where(greedy_row, 1.0, temperature)
    # A temperature so small that the scaled logits overflow (|max logit| / T > float32's max,
    # e.g. T = 2e-38) would give softmax NaN (and the sampler token 0). Its exact T -> 0 limit is
    # the greedy one-hot: every other distinct logit is at least ulp(max) / T ~ 2e31 below the
    # max, so its probability is exactly 0 in float32. Such a distribution is therefore greedy.
    greedy = greedy_row | jnp.isinf(jnp.max(scaled, axis=-1, keepdims=True))

    uses_filter = (~greedy) & (((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    filtered = lax.cond(
        jnp.any(uses_filter),
        lambda x: filter_top_k_top_p(x, top_k, top_p),
        lambda x: x,
        scaled,
    )
    probs = jax.nn.softmax(filtered, axis=-1)
    one_hot = jax.nn.one_hot(first_argmax(logits), v, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def logits_are_finite(logits: jax.Array, allow_neg_inf: bool = True) -> jax.Array:
    """Per-row check that :func:`process_logits` gives a valid distribution.

    Args:
      logits: ``[B, ..., V]`` logits.
      allow_neg_inf: if True (default), ``-inf`` (a banned token) is allowed provided every
        distribution of the row keeps at least one finite logit. If False, every entry must
        be finite.

    Returns:
      ``[B] bool``: True where the row has no NaN / ``+inf`` (and, per the flag, no
      ``-inf`` / at least one finite logit per distribution). Callers raise
      :class:`dspark_jax.errors.DSparkInputError` (or similar) outside ``jit`` on False.
    """
    logits = jnp.asarray(logits)
    finite = jnp.isfinite(logits)
    if allow_neg_inf:
        ok = finite | (logits == -jnp.inf)
        ok_dist = jnp.all(ok, axis=-1) & jnp.any(finite, axis=-1)
    else:
        ok_dist = jnp.all(finite, axis=-1)
    return jnp.all(jnp.reshape(ok_dist, (logits.shape[0], -1)), axis=-1)


def _is_single_key(key: jax.Array) -> bool:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 0
    return key.ndim == 1


def _categorical(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One draw per distribution of ``probs [..., V]`` with a single key."""
    probs = jnp.asarray(probs, jnp.float32)
    log_probs = jnp.where(probs > 0.0, jnp.log(jnp.where(probs > 0.0, probs, 1.0)), -jnp.inf)
    # jax.random.categorical's draw (Gumbel-max over the same noise), with first_argmax for its
    # variadic argmax (0.8 ms of 49,152 entries on a CPU); log_probs holds no NaN, so the same ids.
    return first_argmax(jax.random.gumbel(key, log_probs.shape, log_probs.dtype) + log_probs)


@jax.jit
def sample(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """Draws token ids from probabilities; zero-probability tokens are never drawn.

    Gumbel-max (``jax.random.categorical``) on ``log(probs)`` with ``-inf`` for zeros.
    ``probs`` need not be normalised (the draw is from ``probs / probs.sum(-1)``).

    Args:
      keys: either per-row keys ``[B, 2] uint32`` (or typed ``[B]``), in which case row
        ``b`` of ``probs`` uses only ``keys[b]``; or one key ``[2]`` (typed: ``[]``) for all
        of ``probs``.
      probs: ``[B, ..., V]`` (per-row keys) or ``[..., V]`` (single key) float32.

    Returns:
      ``int32`` token ids of shape ``probs.shape[:-1]``.
    """
    if _is_single_key(keys):
        return _categorical(keys, probs)
    return jax.vmap(_categorical)(keys, probs)


def sample_or_argmax(keys: jax.Array, probs: jax.Array, all_greedy: jax.Array) -> jax.Array:
    """:func:`sample`, with the Gumbel noise skipped when every distribution is greedy.

    A greedy distribution from :func:`process_logits` is exactly a one-hot, whose Gumbel-max
    draw is its argmax whatever the noise; so under ``all_greedy`` this returns
    :func:`first_argmax` (the same ids, bit for bit) and draws no random bits. The noise of a
    ``V``-wide vocabulary is most of a token draw's cost on CPU (a threefry pass over
    ``[..., V]``). Batch-level ``lax.cond``: one executable, one branch executed.

    Args:
      keys / probs: as :func:`sample`.
      all_greedy: ``[]`` bool. True only if every distribution of ``probs`` that matters is a
        one-hot (e.g. every active row has temperature ``<= 0``); the caller guarantees it.

    Returns:
      ``int32`` token ids of shape ``probs.shape[:-1]``.
    """
    return lax.cond(all_greedy, first_argmax, lambda p: sample(keys, p), probs)


def draw_from_logits(logits: jax.Array, params: SamplingArrays, draw: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``draw(process_logits(logits, params))``, or :func:`first_argmax` of ``logits`` when every row is
    greedy: the same ids bit for bit (a greedy distribution is the one-hot of that argmax), without the
    softmax, the one-hot and the draw over the vocabulary (about 0.15 ms a token for 49,152 entries on a CPU).

    Args:
      logits: ``[B, ..., V]`` logits. params: per-row settings (:class:`SamplingArrays`).
      draw: ``[B, ..., V]`` float32 probabilities -> ``[B, ...]`` int32 ids, traced only for the
        sampled branch (e.g. ``lambda p: sample(keys, p)``).
    Returns:
      ``int32`` token ids of shape ``logits.shape[:-1]``.
    """
    return lax.cond(
        jnp.all(jnp.asarray(params.temperature) <= 0),
        first_argmax,
        lambda x: draw(process_logits(x, params)),
        jnp.asarray(logits, jnp.float32),
    )


def first_argmax(x: jax.Array) -> jax.Array:
    """``[..., N]`` -> ``[...]`` int32: the first index of the maximum, as ``jnp.argmax``.

    Two plain reductions (max, then the smallest index holding it) instead of ``argmax``'s
    variadic (value, index) reduction, which XLA's CPU backend runs several times slower. Same
    result for every input without NaN (a NaN row gives ``N - 1`` here, its first NaN there).
    """
    m = jnp.max(x, axis=-1, keepdims=True)
    idx = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == m, idx, x.shape[-1] - 1), axis=-1)


def _subset_noise_is_exact(key: jax.Array) -> bool:
    """Whether :func:`_subset_gumbel` can compute ``jax.random.gumbel``'s noise at chosen
    indices (static): raw ``uint32 [2]`` threefry keys, partitionable random bits (each value a
    function of the key and its index alone), low-dynamic-range Gumbel. Unknown flags: False."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    return (
        key.dtype == jnp.uint32
        and key.shape == (2,)
        and bool(getattr(jax.config, "jax_threefry_partitionable", False))
        and getattr(jax.config, "jax_default_prng_impl", "") == "threefry2x32"
        and not getattr(jax.config, "jax_high_dynamic_range_gumbel", True)
    )


def _subset_gumbel(key: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
    """``[N]`` float32: ``jax.random.gumbel(key, (vocab_size,))[ids]``, bit for bit, computing
    only the N values asked for.

    With partitionable threefry the 32 random bits of index ``i`` are ``threefry2x32(key,
    (0, i))``'s two words XOR-ed; ``uniform`` keeps 23 of them as a float in ``[tiny, 1)`` and
    ``gumbel`` is ``-log(-log(u))``: the same operations here, at ``ids`` only. Other PRNG
    configurations gather from the full noise (same values, V-sized cost).
    """
    if not _subset_noise_is_exact(key):
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)[ids]
    from jax.extend.random import threefry2x32_p

    key = jnp.asarray(key)
    lo = ids.astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(key[0], key[1], jnp.zeros_like(lo), lo)
    mantissa = lax.shift_right_logical(b1 ^ b2, jnp.uint32(32 - 23))
    floats = lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32) - jnp.float32(1.0)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    u = lax.max(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def sample_subset(keys: jax.Array, probs: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
    """:func:`sample` of a distribution that is zero outside a subset of the vocabulary, at the
    subset's cost (a draft vocabulary, docs/design.md#draft-vocabulary).

    ``ids[sample_subset(keys, probs, ids, V)]`` equals ``sample(keys, full)`` token for token, where
    ``full [B, V]`` holds ``probs`` at ``ids`` and zeros elsewhere: the same per-token Gumbel noise
    (computed at ``ids`` only, :func:`_subset_gumbel`) and the same tie-breaking (lowest id), so a
    draft drawn this way keeps the coupled draws of the serving engine (the target samples the same
    position with the same key over the full vocabulary).

    Args:
      keys: ``[B, 2]`` uint32 per-row keys (typed ``[B]`` keys work, at the full-vocabulary cost).
      probs: ``[B, N]`` float32 probabilities over the subset (need not be normalised).
      ids: ``[N]`` int32 ascending distinct target ids of the subset (all ``< vocab_size``).
      vocab_size: V, the size of the full vocabulary.
    Returns:
      ``[B]`` int32 indices into ``ids`` (zero-probability entries are never drawn).
    Raises:
      ValueError: ``probs`` is not ``[B, N]`` with ``N = len(ids)``.
    """
    if probs.ndim != 2 or probs.shape[-1] != ids.shape[0]:
        raise ValueError(f"sample_subset needs probs [B, {ids.shape[0]}], got {probs.shape}")

    def one(key, p):
        p = jnp.asarray(p, jnp.float32)
        log_p = jnp.where(p > 0.0, jnp.log(jnp.where(p > 0.0, p, 1.0)), -jnp.inf)
        return first_argmax(_subset_gumbel(key, ids, vocab_size) + log_p)

    return jax.vmap(one)(keys, probs)


def split_keys(keys: jax.Array, num: int = 2) -> jax.Array:
    """Splits each row key into ``num`` keys: ``[B, 2] -> [num, B, 2]`` (row-local)."""
    return jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, num))(keys), 1, 0)
