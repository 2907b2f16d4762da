"""Decoding: plain autoregressive and lossless speculative (DSpark / DFlash); the compiled loops
themselves are :mod:`dspark_jax.decoding.loop`.

Both are single jitted loops (prefill, then a ``lax.while_loop`` of decode steps on device; static
shapes, everything variable a mask); speculative rounds draft ``block_size`` tokens, verify
``num_speculative_tokens`` of them in one target pass and rejection-sample
(docs/design.md#pipeline, docs/design.md#verification). Randomness is per request
(``fold_in(request_key, t)``), so a request's output does not depend on its batch-mates.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding import auto_verify
from dspark_jax.decoding.decode_profile import cached_cost_table
from dspark_jax.decoding.loop import AutoWidths, Batch, make_batch, run_autoregressive, run_speculative
from dspark_jax.decoding.results import BatchResult, Generation
from dspark_jax.decoding.validation import check_num_speculative_tokens, check_sampling
from dspark_jax.drafters.base import BlockDrafter, Drafter, prepare_drafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target

# Generation / BatchResult live in decoding.results; they stay importable from here, the
# documented home of the types these functions return.
__all__ = [
    "BatchResult",
    "Generation",
    "auto_cost_span",
    "default_cache_len",
    "generate_autoregressive",
    "generate_speculative",
    "speculate_batch",
]


def default_cache_len(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens, block_size: int = 0) -> int:
    """KV-cache length [tokens] the decode loops give these prompts when ``cache_len`` is not set.

    ``block_size``: the drafter's (0: plain decoding). E.g. to measure the cost table that
    ``num_speculative_tokens="auto"`` will use ahead of time
    (:func:`~dspark_jax.decoding.decode_profile.cached_cost_table`).

    Raises:
      DSparkInputError: as :func:`generate_autoregressive` for bad prompts / max_new_tokens.
    """
    return make_batch(target, prompts, max_new_tokens, block_size, None, (0.0, 0, 1.0), 0, None).cache_len


def generate_autoregressive(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed: int | Sequence[int] = 0,
    stop_ids: Sequence[int] | None = None,
    cache_len: int | None = None,
) -> BatchResult:
    """Plain decoding from the target: one target pass per token (the baseline).

    Args:
      target: the target model.
      prompts: ``B`` lists of token ids (non-empty, shorter than the context).
      max_new_tokens: per-request (or shared) cap on generated tokens.
      temperature / top_k / top_p: sampling settings (scalars or per request);
        temperature 0 is greedy.
      seed: per-request (or shared) PRNG seed, an integer in the int64 range.
      stop_ids: token ids that end a request (default: the target's EOS ids).
      cache_len: KV-cache length in tokens (default: just enough, rounded up).

    Returns:
      :class:`BatchResult`; seconds exclude compilation.

    Raises:
      DSparkInputError: empty prompt, unknown token id, prompt too long, NaN/inf or
        out-of-range sampling settings (:func:`~dspark_jax.decoding.validation.check_sampling`),
        a max_new_tokens outside ``[1, INT32_MAX]``, a seed that is not an int64.
      FloatingPointError: the target produced NaN/inf logits.
    """
    check_sampling(temperature, top_k, top_p)
    bt = make_batch(target, prompts, max_new_tokens, 0, cache_len, (temperature, top_k, top_p), seed, stop_ids)
    return run_autoregressive(target, bt)


def _auto_widths(target: Target, drafter: Drafter, cost_table, bt: Batch) -> AutoWidths:
    """The widths and costs ``num_speculative_tokens="auto"`` decodes ``bt`` with."""
    if not isinstance(drafter, BlockDrafter):
        raise DSparkInputError(
            f"num_speculative_tokens='auto' needs a block drafter (dspark/dflash), not {drafter.cfg.variant}"
        )
    widths = tuple(auto_verify.default_widths(drafter.cfg.block_size))
    table = cost_table if cost_table is not None else cached_cost_table(target, drafter, bt.cache_len)
    greedy = bool(np.all(np.asarray(bt.sampling.temperature) <= 0))
    span = auto_cost_span(bt.lens, bt.limit)
    t_verify, t_draft = table.auto_prices(widths, greedy, span)
    return AutoWidths(widths, jnp.asarray(t_verify), jnp.float32(t_draft))


def auto_cost_span(lens, limit) -> int:
    """The attention span [tokens] ``auto`` looks its costs up at (one set of costs for the whole
    loop): the live length halfway through the longest request, ``[B]`` prompt lengths ``lens``
    to ``limit`` (prompt + new tokens)."""
    lens, limit = np.asarray(lens, np.int64), np.asarray(limit, np.int64)
    return int(np.max(lens + (limit - lens) // 2))


def generate_speculative(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed: int | Sequence[int] = 0,
    stop_ids: Sequence[int] | None = None,
    num_speculative_tokens: int | str,
    cache_len: int | None = None,
    record_rounds: bool = False,
    cost_table=None,
) -> BatchResult:
    """Lossless speculative decoding with a DSpark/DFlash drafter.

    Output is distributed exactly as :func:`generate_autoregressive` with the same
    settings (token for token at temperature 0).

    Args:
      target / prompts / max_new_tokens / temperature / top_k / top_p / seed /
        stop_ids / cache_len: as in :func:`generate_autoregressive`.
      drafter: a drafter built for this target
        (see :func:`~dspark_jax.drafters.base.check_compatible`); its decode-time state is
        installed for ``target`` (:func:`~dspark_jax.drafters.base.prepare_drafter`).
      num_speculative_tokens: draft tokens verified per round, ``1..block_size`` (the
        drafter's block size ``drafter.cfg.block_size``; drafting always produces the full block), or ``"auto"``
        (:mod:`dspark_jax.decoding.auto_verify`: per round the width among a few compiled ones that
        maximises expected tokens/s from the calibrated confidences and the measured cost
        table, 0 when drafting does not pay; block drafters only). Required: pass
        ``drafter.cfg.block_size`` to verify whole blocks. ``"auto"`` chooses one width for the
        whole batch and is meant for one request at a time.
      record_rounds: also record every round's raw confidence logits and
        accepted/verified counts (:attr:`Generation.rounds`), e.g. for
        calibration reliability; costs ``[B, max_new_tokens, block_size]`` floats.
      cost_table: :class:`~dspark_jax.decoding.cost_table.CostTable` for ``"auto"`` (default: measured
        on first use for these model shapes and cache length: the programs and the ``auto`` loop's
        rounds, about a minute for SmolLM2-135M on 2 CPU cores; then reused, also by later processes).

    Returns:
      :class:`BatchResult` with tau, acceptance and per-position acceptance.

    Raises:
      DSparkInputError: bad prompts, a num_speculative_tokens that is None, outside the block or
        ``"auto"`` for a drafter without blocks, NaN/inf or out-of-range sampling settings, or a
        drafter for another target.
      FloatingPointError: the target produced NaN/inf logits.
    """
    prepare_drafter(target, drafter)
    block_size = drafter.cfg.block_size
    n_spec = check_num_speculative_tokens(num_speculative_tokens, block_size)
    check_sampling(temperature, top_k, top_p)
    bt = make_batch(target, prompts, max_new_tokens, block_size, cache_len, (temperature, top_k, top_p), seed, stop_ids)
    return speculate_batch(target, drafter, bt, n_spec, record_rounds=record_rounds, cost_table=cost_table)


def speculate_batch(
    target: Target,
    drafter: Drafter,
    bt: Batch,
    num_speculative_tokens: int | str,
    *,
    record_rounds: bool = False,
    cost_table=None,
) -> BatchResult:
    """:func:`generate_speculative` of a batch already checked and laid out
    (:func:`~dspark_jax.decoding.loop.make_batch` with the drafter's block size), for a drafter
    already prepared for ``target`` and a ``num_speculative_tokens`` already checked against its
    block (the decoding front door's path: :func:`~dspark_jax.decoding.request.decode` checks each
    of them once).

    Raises:
      DSparkInputError: ``"auto"`` for a drafter without blocks (eagle3).
    """
    if num_speculative_tokens == "auto":
        verify = _auto_widths(target, drafter, cost_table, bt)
    else:
        verify = int(num_speculative_tokens)
    return run_speculative(target, drafter, bt, verify, record_rounds=record_rounds)
