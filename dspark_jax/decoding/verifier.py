"""Lossless verification of draft blocks: rejection sampling and coupled draws.

docs/design.md#verification names two serving modes; both live here, side by side,
and are covered by the same distribution tests (``tests/unit/decoding/test_verifier.py``):

* :func:`verify` -- rejection sampling (the paper's mode, highest acceptance), below;
* :func:`verify_coupled` / :func:`coupled_accept` -- coupled draws: draft and target sample
  every position with the SAME key (Gumbel noise); a draft is accepted iff it equals the
  target's own sample, so every response equals plain decoding with its seed, token for
  token, at some acceptance cost at T > 0 (``P(x == y)`` under shared noise instead of
  ``1 - TV(p, q)``).

The serving engine verifies PACKED rows (``K`` tokens of ``R`` rows in one target pass, row
``rows[i]`` and block position ``cols[i]`` per token): :func:`verify_coupled_packed` and
:func:`verify_rejection_packed` are the same two modes on that layout.

Rejection sampling: Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding", Alg. 1) and Chen et al. 2023 ("Accelerating Large
Language Model Decoding with Speculative Sampling", Alg. 2, "modified rejection sampling").

For one row with verification length ``L`` (``0 <= L <= G``), walk ``k = 0 .. L-1``:

* draft token ``x_k ~ q_k`` is accepted with probability ``min(1, p_k(x_k) / q_k(x_k))``;
* at the first rejection ``k``, emit a correction ``~ norm(max(0, p_k - q_k))`` and stop;
* if all ``L`` verified drafts pass, emit a bonus token ``~ p_L``.

Each emitted token is then distributed exactly as plain sampling from the target (paper
Appendix A1), *provided* that whether position ``k`` is verified (``k < L``) does not depend
on the value of ``x_k`` or anything computed from it (non-anticipation,
docs/design.md#non-anticipation). ``lengths`` is the scheduler's choice; this module trusts it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.models.sampling import _categorical, sample_or_argmax

__all__ = [
    "VerifyOutput",
    "coupled_accept",
    "verify",
    "verify_coupled",
    "verify_coupled_packed",
    "verify_rejection_packed",
]


class VerifyOutput(NamedTuple):
    """Result of :func:`verify` for a batch of ``B`` rows with block size ``G``.

    Attributes:
      num_accepted: ``[B] int32`` accepted draft tokens, in ``[0, lengths[b]]``.
      next_token: ``[B] int32`` the correction token (sampled from
        ``norm(max(0, p_k - q_k))`` at the first rejection ``k``) or, if every verified
        draft was accepted, the bonus token sampled from ``target_probs[b, lengths[b]]``.
      tokens: ``[B, G+1] int32`` the emitted tokens: ``num_accepted`` drafts, then
        ``next_token``, then ``-1`` padding.
      num_emitted: ``[B] int32`` ``num_accepted + 1``.
      accepted: ``[B, G] bool`` ``accepted[b, k]`` iff draft ``k`` is part of the output,
        i.e. ``k < num_accepted[b]`` (verified, passed, and no earlier rejection).
    """

    num_accepted: jax.Array
    next_token: jax.Array
    tokens: jax.Array
    num_emitted: jax.Array
    accepted: jax.Array


def _draw(key, dist, all_greedy):
    """``_categorical(key, dist)``, or without the noise when ``all_greedy`` (``[]`` bool or None):
    a greedy round's ``dist`` has one positive entry, whose Gumbel-max draw is its argmax whatever
    the noise."""
    return _categorical(key, dist) if all_greedy is None else sample_or_argmax(key, dist, all_greedy)


def _verify_row(key, draft_tokens, draft_probs, target_probs, length, all_greedy=None):
    """One row. Shapes: ``[G] int32, [G, V], [G+1, V], [] int32``; see :func:`verify`."""
    g, v = draft_probs.shape
    key_accept, key_sample = jax.random.split(key)
    length = jnp.clip(length, 0, g).astype(jnp.int32)
    pos = jnp.arange(g, dtype=jnp.int32)
    verified = pos < length

    # Padding positions (k >= length) are replaced before any arithmetic, so garbage or
    # NaN there can never reach the result (jnp.where selects; it does not multiply).
    tok = jnp.where(verified, jnp.clip(draft_tokens, 0, v - 1), 0).astype(jnp.int32)
    p_x = jnp.take_along_axis(target_probs[:g], tok[:, None], axis=-1)[:, 0]
    q_x = jnp.take_along_axis(draft_probs, tok[:, None], axis=-1)[:, 0]
    p_x = jnp.where(verified, p_x, 0.0)
    q_x = jnp.where(verified, q_x, 1.0)

    # Accept iff u < p/q with u ~ U[0, 1), written as u * q < p: robust at q = 0 (a token
    # with q = 0 cannot have been drawn; the test then accepts iff p > 0), and NaN fails.
    u = jax.random.uniform(key_accept, (g,), dtype=jnp.float32)
    passes = (u * q_x < p_x) & verified
    num_accepted = jnp.sum(jnp.cumprod(passes.astype(jnp.int32)), dtype=jnp.int32)
    rejected = num_accepted < length

    # Distribution of the next token: residual at the first rejection, else the bonus p_L.
    p_n = target_probs[num_accepted]
    q_n = draft_probs[jnp.minimum(num_accepted, g - 1)]
    residual = jnp.maximum(p_n - jnp.where(rejected, q_n, 0.0), 0.0)
    mass = jnp.sum(residual)
    # max(0, p - q) can sum to 0 when p == q numerically (then rejection had probability
    # ~0 anyway); fall back to p. ``~(mass > 0)`` also catches NaN from a bad q.
    dist = jnp.where(rejected & (mass > 0.0), residual, p_n)
    next_token = _draw(key_sample, dist, all_greedy)

    out_pos = jnp.arange(g + 1, dtype=jnp.int32)
    drafts_padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)])
    tokens = jnp.where(out_pos < num_accepted, drafts_padded, jnp.where(out_pos == num_accepted, next_token, -1))
    return VerifyOutput(
        num_accepted=num_accepted,
        next_token=next_token,
        tokens=tokens,
        num_emitted=num_accepted + 1,
        accepted=pos < num_accepted,
    )


def _plain_row(key, target_probs, all_greedy=None):
    """``G == 0``: no drafts; the output is one plain sample from ``target_probs[0]``."""
    _, key_sample = jax.random.split(key)
    next_token = _draw(key_sample, target_probs[0], all_greedy)
    return VerifyOutput(
        num_accepted=jnp.zeros((), jnp.int32),
        next_token=next_token,
        tokens=next_token[None],
        num_emitted=jnp.ones((), jnp.int32),
        accepted=jnp.zeros((0,), bool),
    )


@jax.jit
def verify(
    keys: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    lengths: jax.Array,
    all_greedy: jax.Array | None = None,
) -> VerifyOutput:
    """Rejection-sampling verification of a batch of draft blocks (lossless).

    Implements docs/design.md#verification (Leviathan et al. 2023, Alg. 1; Chen et
    al. 2023, Alg. 2): accept ``x_k`` iff ``u_k * q_k(x_k) < p_k(x_k)`` with
    ``u_k ~ U[0, 1)`` (i.e. with probability ``min(1, p_k(x_k) / q_k(x_k))``); at the first
    rejection sample from ``norm(max(0, p_k - q_k))`` (falling back to ``p_k`` if that is
    all zero); if all ``lengths[b]`` verified drafts pass, sample the bonus from
    ``p_{lengths[b]}``. The accept uniforms and the correction / bonus draw use independent
    keys split from the row key, and row ``b`` uses only ``keys[b]``:
    ``key_accept, key_sample = jax.random.split(keys[b])``;
    ``u = jax.random.uniform(key_accept, (G,))``; the next token is
    ``sample(key_sample, dist)`` (so with ``lengths[b] == 0`` it equals
    ``sample(key_sample, target_probs[b, 0])``).

    Greedy (one-hot ``p`` and ``q``) reduces to: accept iff ``x_k == argmax p_k``;
    correction ``argmax p_k``; bonus ``argmax p_L``. ``lengths[b] == 0`` is plain decoding:
    ``next_token ~ target_probs[b, 0]``.

    Args:
      keys: ``[B, 2] uint32`` per-row PRNG keys (typed keys ``[B]`` also accepted).
      draft_tokens: ``[B, G] int32``; ``draft_tokens[b, k]`` was drawn from
        ``draft_probs[b, k]``.
      draft_probs: ``[B, G, V] float32``, exactly the distributions q the drafts were drawn
        from (e.g. :func:`dspark_jax.models.sampling.process_logits` of the drafter's logits).
      target_probs: ``[B, G+1, V] float32``, the target's processed distributions p:
        position ``k`` predicts the token drafted at ``k``; position ``lengths[b]`` is the
        bonus distribution.
      lengths: ``[B] int32`` verification lengths (dynamic), clipped to ``[0, G]``.
        Positions ``k >= lengths[b]`` are padding: their tokens and probabilities never
        influence the result (any values, NaN included). ``lengths`` must be chosen without
        looking at the drafted tokens it admits (non-anticipation).
      all_greedy: optional ``[]`` bool, True only if every row's ``target_probs`` are one-hots
        (:func:`~dspark_jax.models.sampling.process_logits` at temperature 0): then the correction /
        bonus token is drawn without its Gumbel noise over the vocabulary, the same ids bit for bit
        (with a one-hot ``p`` its distribution, ``p`` or ``max(0, p - q)``, has one positive entry
        whatever ``q``); a batch-level ``lax.cond``.

    Returns:
      :class:`VerifyOutput`.
    """
    b, g = draft_tokens.shape
    if draft_probs.shape[:2] != (b, g) or target_probs.shape[:2] != (b, g + 1):
        raise ValueError(
            f"shape mismatch: draft_tokens {draft_tokens.shape}, draft_probs "
            f"{draft_probs.shape}, target_probs {target_probs.shape} (expected [B, G], "
            "[B, G, V], [B, G+1, V])"
        )
    draft_probs = jnp.asarray(draft_probs, jnp.float32)
    target_probs = jnp.asarray(target_probs, jnp.float32)
    if g == 0:
        return jax.vmap(functools.partial(_plain_row, all_greedy=all_greedy))(keys, target_probs)
    return jax.vmap(functools.partial(_verify_row, all_greedy=all_greedy))(
        keys,
        jnp.asarray(draft_tokens, jnp.int32),
        draft_probs,
        target_probs,
        jnp.asarray(lengths, jnp.int32),
    )


def coupled_accept(draft_tokens: jax.Array, target_tokens: jax.Array, lengths: jax.Array) -> VerifyOutput:
    """Coupled-draw verification given the target's own samples (the serving engine's path).

    docs/design.md#verification, coupled draws. ``target_tokens[b, j]`` is the
    target's sample for block position ``j`` (the token after position ``P + j``) drawn with
    the key the drafter used for ``draft_tokens[b, j]``. Draft ``j`` is accepted iff it
    equals ``target_tokens[b, j]`` and every earlier verified draft was accepted; the
    emitted tokens are ``target_tokens[b, :num_accepted + 1]`` (accepted drafts equal the
    target's samples; the last one is the correction or, after full acceptance, the bonus).
    So the output is exactly the target's sample at every position: lossless for ANY draft
    distribution, and equal to plain decoding with the same keys.

    Args:
      draft_tokens: ``[B, G] int32``.
      target_tokens: ``[B, G+1] int32`` target samples at block positions ``0..G`` (entries
        past ``lengths[b]`` are never read into the result beyond ``-1`` padding).
      lengths: ``[B] int32`` verification lengths, clipped to ``[0, G]``; must not depend
        on the draft values (non-anticipation).

    Returns:
      :class:`VerifyOutput` (``tokens`` padded with ``-1`` after the next token).
    """
    b, g = draft_tokens.shape
    if target_tokens.shape != (b, g + 1):
        raise ValueError(
            f"shape mismatch: draft_tokens {draft_tokens.shape}, target_tokens "
            f"{target_tokens.shape} (expected [B, G], [B, G+1])"
        )
    target_tokens = jnp.asarray(target_tokens, jnp.int32)
    length = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, g)
    k = jnp.arange(g, dtype=jnp.int32)
    match = (jnp.asarray(draft_tokens, jnp.int32) == target_tokens[:, :g]) & (k[None, :] < length[:, None])
    num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], 1)[:, 0]
    out_pos = jnp.arange(g + 1, dtype=jnp.int32)
    tokens = jnp.where(out_pos[None, :] <= num_accepted[:, None], target_tokens, -1)
    return VerifyOutput(
        num_accepted=num_accepted,
        next_token=next_token,
        tokens=tokens,
        num_emitted=num_accepted + 1,
        accepted=k[None, :] < num_accepted[:, None],
    )


@jax.jit
def verify_coupled(
    keys: jax.Array, draft_tokens: jax.Array, target_probs: jax.Array, lengths: jax.Array
) -> VerifyOutput:
    """Coupled-draw verification of a batch of draft blocks (lossless;
    docs/design.md#coupled-draws, second serving mode).

    The target's token at block position ``j`` of row ``b`` is
    ``sampling.sample(keys[b, j], target_probs[b, j])`` (Gumbel-max); the draft
    ``draft_tokens[b, j]`` must have been drawn with the same ``keys[b, j]`` from its q
    (e.g. ``markov.sample_block(step_keys=keys[:, :G])``) for acceptance to be high, but
    correctness holds for any drafts: see :func:`coupled_accept`.

    Args:
      keys: ``[B, G+1, 2] uint32`` per-position keys (the serving engine uses
        ``fold_in(request_key, P + j)``, the key plain decoding samples that token with).
      draft_tokens: ``[B, G] int32``.
      target_probs: ``[B, G+1, V] float32`` processed target distributions.
      lengths: ``[B] int32``, clipped to ``[0, G]``; non-anticipating.

    Returns:
      :class:`VerifyOutput`.
    """
    b, g = draft_tokens.shape
    if target_probs.shape[:2] != (b, g + 1) or keys.shape[:2] != (b, g + 1):
        raise ValueError(
            f"shape mismatch: keys {keys.shape}, draft_tokens {draft_tokens.shape}, "
            f"target_probs {target_probs.shape} (expected [B, G+1, 2], [B, G], [B, G+1, V])"
        )
    y = jax.vmap(jax.vmap(_categorical))(keys, jnp.asarray(target_probs, jnp.float32))
    return coupled_accept(draft_tokens, y, lengths)


def verify_coupled_packed(
    token_keys: jax.Array,
    target_probs: jax.Array,
    rows: jax.Array,
    cols: jax.Array,
    draft_tokens: jax.Array,
    lengths: jax.Array | None,
    *,
    width: int,
    all_greedy: jax.Array | bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Coupled-draw verification of packed rows (the serving engine's default mode).

    docs/design.md#verification, coupled draws, as :func:`verify_coupled` but on the
    engine's packed layout: the target's own sample at every packed token (Gumbel-max with
    plain decoding's key for that token), scattered to an ``[R, width]`` grid, then
    :func:`coupled_accept`.

    Args:
      token_keys: ``[K, 2]`` uint32 key of each packed token's NEXT token
        (``fold_in(request_key, pos)``; the drafts were drawn with the same keys).
      target_probs: ``[K, V]`` float32 processed target distributions of the packed tokens.
      rows / cols: ``[K]`` int32 row and block position (0 = anchor) of each packed token;
        ``rows[i] >= R`` marks padding (dropped).
      draft_tokens: ``[R, G]`` int32 drafts of the rows (``G = width - 1``).
      lengths: ``[R]`` int32 verification lengths (non-anticipating), or None for a plain
        step (anchors only: nothing accepted).
      width: static grid width (``G + 1``).
      all_greedy: ``[]`` bool, True only when every packed distribution that is not padding is
        greedy (a one-hot): the samples are then argmaxes, with no noise drawn
        (:func:`~dspark_jax.models.sampling.sample_or_argmax`; the same tokens).
    Returns:
      ``(tokens [R, width] int32, num_accepted [R] int32)``: the target's samples on the grid
      (``-1`` where no token was packed) and the accepted drafts; the emitted tokens are
      ``tokens[r, :num_accepted[r] + 1]``.
    """
    r = draft_tokens.shape[0]
    y = sample_or_argmax(token_keys, target_probs, jnp.asarray(all_greedy))
    grid = jnp.full((r, width), -1, jnp.int32).at[rows, cols].set(y, mode="drop")
    if lengths is None:
        return grid, jnp.zeros((r,), jnp.int32)
    return grid, coupled_accept(draft_tokens, grid, lengths).num_accepted


def verify_rejection_packed(
    round_keys: jax.Array | Callable[[], jax.Array],
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    rows: jax.Array,
    cols: jax.Array,
    lengths: jax.Array,
) -> VerifyOutput:
    """Rejection-sampling verification of packed rows: :func:`verify` after scattering the
    packed target distributions ``target_probs [K, V]`` to the ``[R, G + 1, V]`` grid.

    Args:
      round_keys: ``[R, 2]`` one key per row and round, independent of the draft keys; or a
        function of no arguments returning them, called after the scatter (the serving
        engine derives its keys there, so its compiled step keeps the order of operations
        it always had).
      draft_tokens: ``[R, G]`` int32; draft_probs: ``[R, G, V]`` their q.
      rows / cols: ``[K]`` int32 (``rows[i] >= R``: padding, dropped). lengths: ``[R]`` int32.
    Returns:
      :class:`VerifyOutput` (``tokens [R, G + 1]``).
    """
    r, g = draft_tokens.shape
    p_grid = jnp.zeros((r, g + 1, target_probs.shape[-1]), jnp.float32).at[rows, cols].set(target_probs, mode="drop")
    keys = round_keys() if callable(round_keys) else round_keys
    return verify(keys, draft_tokens, draft_probs, p_grid, lengths)
