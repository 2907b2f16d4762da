"""One round of speculative decoding, piece by piece, as pure jit-friendly functions.

docs/design.md#pipeline / docs/design.md#verification / docs/design.md#metrics; paper Section 7. A round of a row whose
anchor (the last confirmed token, not yet seen by the target) sits at position ``P``:

1. PRNG keys (:func:`token_keys`, :func:`split_round_keys`, :func:`draft_step_keys`,
   :func:`rejection_round_keys`): the token after position ``t`` of a request is decided with
   keys derived from ``fold_in(request_key, t)``, so a request's output does not depend on
   its batch-mates, its row, or how long the process has run;
2. drafting (:func:`draft_tokens`): the drafter proposes ``block_size`` draft tokens;
3. verification (:func:`verify_pass`): one target pass over ``[anchor, x_1..x_n]``
   (``n`` = ``num_speculative_tokens``), lossless acceptance
   (:mod:`dspark_jax.decoding.verifier`), the drafter's context written;
4. emission (:func:`emit_counts`, :func:`append_tokens`, :func:`finish_codes`): accepted
   drafts plus the correction / bonus token, cut at the first stop id and at the length limit;
5. per-position statistics (:func:`round_statistics`).

The single-request loops of :mod:`dspark_jax.decoding.speculative` are built from these
pieces; they take ``[B]``-row arrays (any batch of rows: the serving engine's packed rows
fit), and the host-side ones (:func:`emit_counts`, :func:`round_statistics`) take the array
module as ``xp`` so the engine can run them on numpy read-backs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.decoding.verifier import verify
from dspark_jax.drafters.base import BlockDrafter, Draft
from dspark_jax.drafters.markov import sample_block
from dspark_jax.models.sampling import (
    SamplingArrays,
    draw_from_logits,
    logits_are_finite,
    process_logits,
    sample,
)
from dspark_jax.models.target import Target

__all__ = [
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_NAMES",
    "FINISH_RUNNING",
    "FINISH_STOP",
    "Prefilled",
    "RoundCaches",
    "RoundInputs",
    "RoundStats",
    "VerifiedRound",
    "append_tokens",
    "draft_step_keys",
    "draft_tokens",
    "emit_counts",
    "finish_codes",
    "is_stop",
    "next_token",
    "plain_step",
    "prefill",
    "rejection_round_keys",
    "round_statistics",
    "split_round_keys",
    "token_keys",
    "verify_at_width",
    "verify_pass",
]

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = 0, 1, 2, 3
FINISH_NAMES = {FINISH_RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}


# ------------------------------------------------------------------------------ PRNG keys


def token_keys(request_keys: jax.Array, pos: jax.Array) -> jax.Array:
    """Keys of the tokens after positions ``pos``: ``fold_in(request_key, pos)`` elementwise.

    Args:
      request_keys: ``[..., 2]`` uint32 request keys (``PRNGKey(seed)``), one per entry of ``pos``.
      pos: ``[...]`` int32 positions (>= 0).
    Returns:
      ``[..., 2]`` uint32: the key plain decoding samples the token after ``pos`` with.
    """
    flat = request_keys.reshape(-1, 2)
    out = jax.vmap(jax.random.fold_in)(flat, pos.reshape(-1).astype(jnp.uint32))
    return out.reshape(pos.shape + (2,))


def split_round_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Single-request loop: a round's ``[B, 2]`` key -> ``(draft_keys, verify_keys)``, each ``[B, 2]``.

    The round key is :func:`token_keys` of the anchor position, so drafting and rejection
    sampling use noise independent of each other and of every other round.
    """
    draft_keys, verify_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    return draft_keys, verify_keys


def draft_step_keys(request_keys: jax.Array, draft_pos: jax.Array, mode: Literal["coupled", "rejection"]) -> jax.Array:
    """Serving engine: per-position draft keys ``[R, G, 2]`` for draft positions ``draft_pos [R, G]``.

    Draft position ``k`` predicts the token after ``draft_pos[:, k] = P + k``. Coupled
    verification draws it with the key the target samples that token with
    (:func:`token_keys`, shared Gumbel noise); rejection sampling with an independent key
    (``fold_in(that, 2)``).
    """
    r, g = draft_pos.shape
    step_keys = token_keys(jnp.broadcast_to(request_keys[:, None], (r, g, 2)), draft_pos)
    if mode == "rejection":
        step_keys = token_keys(step_keys, jnp.full(draft_pos.shape, 2, jnp.int32))
    return step_keys


def rejection_round_keys(request_keys: jax.Array, anchor_pos: jax.Array) -> jax.Array:
    """Serving engine, rejection mode: ``[R, 2]`` verification keys ``fold_in(fold_in(key, P), 1)``.

    Independent of the draft keys (``fold_in(., 2)``) and of every other round (anchor
    positions strictly increase).
    """
    return token_keys(token_keys(request_keys, anchor_pos), jnp.ones(anchor_pos.shape, jnp.int32))


# ------------------------------------------------------------------------------ prefill


def next_token(logits: jax.Array, request_keys: jax.Array, pos: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """Plain decoding's token after ``pos``: ``sample(token_keys(request_keys, pos), process_logits(logits))``,
    or the logits' argmax when every row is greedy (the same ids, without the softmax or the random draw:
    :func:`~dspark_jax.models.sampling.draw_from_logits`).

    Args:
      logits: ``[B, V]`` the target's logits predicting the token after ``pos [B]``.
      request_keys: ``[B, 2]`` uint32. sampling: per-row settings.
    Returns:
      ``[B]`` int32 token ids.
    """
    return draw_from_logits(logits, sampling, lambda p: sample(token_keys(request_keys, pos), p))


class Prefilled(NamedTuple):
    """Output of :func:`prefill`: ``token [B]`` int32 first generated token, ``finite [B]`` bool
    (finite logits), the target's KV cache and the drafter's context cache (None without drafter)."""

    token: jax.Array
    finite: jax.Array
    tcache: Any
    dcache: Any


def prefill(target: Target, drafter, prompt, prompt_len, request_keys, sampling: SamplingArrays, cache_len: int, taps):
    """Prefill of ``B`` prompts: target caches, drafter context, and the first generated token.

    Args:
      prompt: ``[B, Tp]`` int32 right-padded prompts; prompt_len: ``[B]`` int32 true lengths.
      request_keys: ``[B, 2]`` uint32; cache_len: KV-cache positions; taps: the drafter's tapped layers.
    Returns:
      :class:`Prefilled`.
    """
    b, tp = prompt.shape
    pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))
    tcache = target.init_cache(b, cache_len)
    out = target(prompt, pos, tcache, taps=taps, logit_index=prompt_len - 1)
    dcache = None
    if drafter is not None:
        dcache = drafter.extend_cache(
            drafter.init_cache(b, cache_len),
            out.features,
            jnp.where(pos < prompt_len[:, None], pos, -1),
            target=target,
            tokens=prompt,
        )
    finite = logits_are_finite(out.logits)
    tok = next_token(out.logits, request_keys, prompt_len - 1, sampling)
    return Prefilled(tok, finite, out.cache, dcache)


# ------------------------------------------------------------------------------ drafting


def draft_tokens(
    target: Target,
    drafter,
    anchors: jax.Array,
    anchor_pos: jax.Array,
    cache,
    keys: jax.Array,
    sampling: SamplingArrays,
    *,
    step_keys: Literal["coupled", "rejection"] | None = None,
    adjust_logits: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> Draft:
    """One drafting round for every row, whatever the drafter kind (its ``draft``).

    DSpark / DFlash: one parallel backbone pass then the ``lax.scan`` Markov sampler;
    eagle3: ``block_size`` autoregressive single-token steps.

    Args:
      anchors: ``[B]`` int32 last confirmed tokens; anchor_pos: ``[B]`` int32 their positions.
      cache: the drafter's context cache.
      keys: ``[B, 2]`` per-row keys: the round's draft keys (single-request loop; the
        sampler folds in the block position), or the request keys with ``step_keys``.
      step_keys: None, or the serving engine's per-position keys (:func:`draft_step_keys`
        of ``keys`` at positions ``anchor_pos + k``). Block drafters only.
      adjust_logits: optional ``(logits [B, G, N], draft_pos [B, G]) -> logits`` applied to
        the backbone's base logits before sampling (the engine's per-request logit bias;
        the Markov correction is additive, so q moves exactly as the target's p). Block
        drafters only.
    Returns:
      :class:`~dspark_jax.drafters.base.Draft` with ``tokens [B, G]`` and ``probs [B, G, V]``.
    Raises:
      TypeError: ``step_keys`` or ``adjust_logits`` for a drafter that is not a
        :class:`~dspark_jax.drafters.base.BlockDrafter`.
    """
    if step_keys is None and adjust_logits is None:
        return drafter.draft(target, anchors, anchor_pos, cache, keys, sampling)
    if not isinstance(drafter, BlockDrafter):
        raise TypeError(f"step_keys / adjust_logits need a block drafter (dspark/dflash), not {drafter.cfg.variant}")
    block = drafter.draft_block(target, anchors, anchor_pos, cache)
    draft_pos = anchor_pos[:, None] + jnp.arange(drafter.cfg.block_size, dtype=jnp.int32)
    if adjust_logits is not None:
        block = block._replace(logits=adjust_logits(block.logits, draft_pos))
    per_pos = None if step_keys is None else draft_step_keys(keys, draft_pos, step_keys)
    return sample_block(drafter, block, anchors, keys, sampling, step_keys=per_pos)


# ------------------------------------------------------------------------------ verification


class RoundInputs(NamedTuple):
    """A round's per-row inputs (``B`` rows), fixed before anything is drafted.

    Attributes:
      running: ``[B]`` bool rows still decoding.
      anchor: ``[B]`` int32 last confirmed tokens (not yet seen by the target).
      anchor_pos: ``[B]`` int32 their positions ``P``.
      draft_keys / verify_keys: ``[B, 2]`` uint32 the round's drafting and verification keys
        (:func:`split_round_keys`).
      room: ``[B]`` int32 drafts that still fit before the length limit.
    """

    running: jax.Array
    anchor: jax.Array
    anchor_pos: jax.Array
    draft_keys: jax.Array
    verify_keys: jax.Array
    room: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundCaches:
    """The caches a round reads and writes (a pytree, carried through the loops).

    Attributes:
      target: the target's KV cache (:class:`~dspark_jax.models.layers.KVCache`).
      drafter: the drafter's context cache (its ``init_cache``'s type).
    """

    target: Any
    drafter: Any


class VerifiedRound(NamedTuple):
    """Output of :func:`verify_pass` (``B`` rows, block size ``G``).

    Attributes:
      caches: the target's KV cache and the drafter's context cache, written.
      tokens: ``[B, G + 1]`` int32 emitted tokens (accepted drafts, then the correction or
        bonus token), ``-1`` padding.
      num_emitted: ``[B]`` int32 ``num_accepted + 1``.
      num_accepted: ``[B]`` int32 accepted draft tokens.
      finite: ``[B]`` bool: the logits verification read were finite.
    """

    caches: RoundCaches
    tokens: jax.Array
    num_emitted: jax.Array
    num_accepted: jax.Array
    finite: jax.Array


def verify_pass(
    target: Target,
    drafter,
    caches: RoundCaches,
    r: RoundInputs,
    draft: Draft,
    num_verify: jax.Array,
    sampling: SamplingArrays,
    *,
    width: int,
) -> VerifiedRound:
    """Verification pass of ``width + 1`` tokens (anchor + ``width`` drafts) for every row.

    Rejection sampling (:func:`~dspark_jax.decoding.verifier.verify`, docs/design.md#rejection-sampling);
    the drafter's context of the verified tokens is written for running rows.
    Rejected positions stay in the caches as stale entries that attention masks by position
    and later writes overwrite.

    Args:
      caches: the target's KV cache and the drafter's context cache.
      r: :class:`RoundInputs` (``running``, ``anchor``, ``anchor_pos`` and ``verify_keys`` are read).
      draft: the round's :class:`~dspark_jax.drafters.base.Draft` (``tokens`` and their ``probs`` q
        are read).
      num_verify: ``[B]`` int32 verification lengths chosen without looking at the draft values
        (non-anticipation); clipped to ``width``.
      width: static verified drafts of this compiled pass (``<= drafter.cfg.block_size``).
    Returns:
      :class:`VerifiedRound`, tokens padded to ``block_size + 1`` so every width has one shape.
    """
    vtok, vpos = _verified_block(r, draft, width)
    out = target(vtok, vpos, caches.target, taps=drafter.cfg.taps)
    dcache = drafter.extend_cache(
        caches.drafter, out.features, jnp.where(r.running[:, None], vpos, -1), target=target, tokens=vtok
    )
    toks, res, finite = _judge(out.logits, r, draft, num_verify, sampling, width, drafter.cfg.block_size)
    return VerifiedRound(RoundCaches(out.cache, dcache), toks, res.num_emitted, res.num_accepted, finite)


def plain_step(target: Target, taps, tcache, anchor, anchor_pos, request_keys, sampling):
    """A round of ``"auto"`` that does not draft, but for the drafter's context write: the target's
    pass of ``anchor [B]`` at ``anchor_pos [B]`` with the tapped features that write reads, and the
    next token as :func:`~dspark_jax.decoding.verifier.verify` draws it at width 0
    (``sample(split(verify_key)[1], p_0)``, ``verify_key`` from :func:`split_round_keys`), but with
    neither the keys nor the random draw when every row is greedy (the same ids, bit for bit).
    With the context written it is :func:`verify_pass` at width 0 without drafts.

    Returns:
      ``(target cache, token [B] int32, finite [B] bool, features [B, 1, n_taps * H])``.
    """
    out = target(anchor[:, None], anchor_pos[:, None], tcache, taps=taps)
    if out.cache is None or out.features is None:  # a cached pass with taps returns both
        raise ValueError("plain_step needs the target's KV cache and taps")

    def sampled(p):  # the keys are derived only when some row samples
        _, verify_keys = split_round_keys(token_keys(request_keys, anchor_pos))
        return sample(jax.vmap(jax.random.split)(verify_keys)[:, 1], p)

    token = draw_from_logits(out.logits[:, 0], sampling, sampled)
    return out.cache, token, logits_are_finite(out.logits), out.features


def _verified_block(r: RoundInputs, draft: Draft, width: int) -> tuple[jax.Array, jax.Array]:
    """``(tokens, positions)`` ``[B, width + 1]`` of a verification pass: the anchor, then ``width`` drafts."""
    vtok = jnp.concatenate([r.anchor[:, None], draft.tokens[:, :width]], axis=1)
    return vtok, r.anchor_pos[:, None] + jnp.arange(width + 1, dtype=jnp.int32)


def _judge(logits, r: RoundInputs, draft: Draft, num_verify, sampling: SamplingArrays, width: int, block_size: int):
    """Rejection sampling of a pass's ``logits [B, width + 1, V]``: ``(tokens [B, G + 1] padded with -1,
    the verifier's result, finite [B])``; only the positions verification reads must be finite."""
    offs = jnp.arange(width + 1, dtype=jnp.int32)
    finite = logits_are_finite(jnp.where((offs[None, :] <= num_verify[:, None])[..., None], logits, 0.0))
    res = verify(
        r.verify_keys,
        draft.tokens[:, :width],
        draft.probs[:, :width],
        process_logits(logits, sampling),
        jnp.minimum(num_verify, width),
        jnp.all(sampling.temperature <= 0),  # every p one-hot: the next token needs no noise
    )
    toks = jnp.pad(res.tokens, ((0, 0), (0, block_size - width)), constant_values=-1)
    return toks, res, finite


def verify_at_width(
    target: Target,
    drafter,
    caches: RoundCaches,
    r: RoundInputs,
    draft: Draft,
    num_verify: jax.Array,
    sampling: SamplingArrays,
    *,
    width_index: jax.Array,
    widths: tuple[int, ...],
) -> VerifiedRound:
    """:func:`verify_pass` at a width chosen inside the loop: ``widths[width_index]``.

    Each width is its own compiled pass, run by a loop of zero or one trip (``lax.fori_loop`` with a
    traced bound, i.e. a ``while_loop``), one loop per width in sequence: a loop carries the caches
    and writes them in place, as the fixed-width decode loop does. A ``lax.switch`` over the widths
    did not: with the writes inside its branches XLA copied both caches into each branch every round,
    and with read-only branches and one write after the switch a 3-token round cost 3-6 ms more than
    the fixed loop's on SmolLM2-135M (2 CPU cores).

    Args:
      as :func:`verify_pass`; ``width_index``: ``[]`` int32 index into the static ascending ``widths``
      (each ``<= drafter.cfg.block_size``).
    Returns:
      :class:`VerifiedRound` of the chosen width (tokens padded to ``block_size + 1``).
    """
    b, block_size = r.anchor.shape[0], drafter.cfg.block_size
    zero = jnp.zeros((b,), jnp.int32)
    out = VerifiedRound(caches, jnp.full((b, block_size + 1), -1, jnp.int32), zero, zero, jnp.ones((b,), bool))
    for i, w in enumerate(widths):

        def once(_, v, w=w):
            return verify_pass(target, drafter, v.caches, r, draft, num_verify, sampling, width=w)

        out = jax.lax.fori_loop(0, (width_index == i).astype(jnp.int32), once, out)
    return out


# ------------------------------------------------------------------------------ emission


def is_stop(tokens, stop_ids, xp: Any = jnp):
    """``[B, W]`` bool: ``tokens [B, W]`` is one of ``stop_ids`` (``[S]`` shared or ``[B, S]``
    per row; pad with -1). Negative tokens (padding) never stop."""
    ids = stop_ids if stop_ids.ndim == 1 else stop_ids[:, None, :]
    return xp.any(tokens[..., None] == ids, axis=-1) & (tokens >= 0)


def emit_counts(tokens, num_new, running, length, end, stop_ids, *, stops_from=None, xp: Any = jnp):
    """How many of a round's new tokens each row keeps, honouring stop ids and the length limit.

    Args:
      tokens: ``[B, W]`` int32 new tokens (accepted drafts + correction/bonus, -1 padding).
      num_new: ``[B]`` int32 valid leading entries of ``tokens``.
      running: ``[B]`` bool rows still generating. length: ``[B]`` int32 confirmed tokens.
      end: ``[B]`` int32 length at which a row is full (prompt + max new tokens, capped by
        the context).
      stop_ids: ``[S]`` or ``[B, S]`` int32 (see :func:`is_stop`).
      stops_from: optional ``[B]`` int32: a stop id at index ``j < stops_from`` does not
        end the row (the engine's ``min_tokens``: ``min_tokens - generated``).
      xp: ``jax.numpy`` (on device) or ``numpy`` (host read-backs).
    Returns:
      ``(num_kept [B], stopped [B], full [B])``: tokens kept (through the first stop,
      within the room left), ended by a stop id, ended by the length limit.
    """
    w = tokens.shape[1]
    idx = xp.arange(w, dtype=xp.int32)
    valid = (idx[None, :] < num_new[:, None]) & running[:, None]
    stop_at = valid & is_stop(tokens, stop_ids, xp)
    if stops_from is not None:
        stop_at = stop_at & (idx[None, :] >= stops_from[:, None])
    first_stop = xp.where(xp.any(stop_at, 1), xp.argmax(stop_at, 1), w)
    room = end - length
    num_kept = xp.where(running, xp.minimum(xp.minimum(num_new, first_stop + 1), room), 0)
    stopped = running & (first_stop < num_kept)
    full = running & ~stopped & (length + num_kept >= end)
    return num_kept, stopped, full


def append_tokens(seq: jax.Array, length: jax.Array, tokens: jax.Array, num_kept: jax.Array) -> jax.Array:
    """Writes the first ``num_kept [B]`` of ``tokens [B, W]`` into ``seq [B, S]`` at ``length [B]``."""
    b, w = tokens.shape
    idx = jnp.arange(w, dtype=jnp.int32)
    write = idx[None, :] < num_kept[:, None]
    pos = jnp.where(write, length[:, None] + idx[None, :], seq.shape[1])
    return seq.at[jnp.arange(b)[:, None], pos].set(tokens, mode="drop")


def finish_codes(finish, stopped, full, xp: Any = jnp):
    """``[B]`` int32 FINISH_* codes after a round: stop, else length, else unchanged."""
    return xp.where(stopped, FINISH_STOP, xp.where(full, FINISH_LENGTH, finish)).astype(xp.int32)


# ------------------------------------------------------------------------------ statistics


class RoundStats(NamedTuple):
    """Per-row statistics of one round (docs/design.md#metrics), counting emitted tokens only.

    Attributes:
      num_draft_tokens: ``[B]`` draft tokens counted as verified: all ``num_verify``, but
        drafts after a stop inside the accepted drafts are discarded, not counted (else a
        perfect drafter would show acceptance < 1).
      num_accepted: ``[B]`` accepted drafts that were emitted.
      position_reached: ``[B, G]`` bool: positions 1..k-1 accepted, k verified and emitted.
      position_accepted: ``[B, G]`` bool: of those, position k accepted too.
    """

    num_draft_tokens: Any
    num_accepted: Any
    position_reached: Any
    position_accepted: Any


def round_statistics(num_verify, num_accepted, num_emitted, num_kept, block_size: int, xp: Any = jnp) -> RoundStats:
    """:class:`RoundStats` of a round from ``[B]`` verification lengths, accepted drafts,
    emitted tokens (``num_accepted + 1``) and kept tokens (:func:`emit_counts`).

    ``xp``: ``jax.numpy`` on device, ``numpy`` on host read-backs (the serving engine).
    """
    k = xp.arange(max(block_size, 1), dtype=xp.int32)[None, :]
    reached = (k < num_verify[:, None]) & (k <= num_accepted[:, None]) & (k < num_kept[:, None])
    accepted_at = reached & (k < num_accepted[:, None])
    n_draft = xp.where(num_kept < num_emitted, xp.minimum(num_verify, num_kept), num_verify)
    return RoundStats(n_draft, xp.minimum(num_accepted, num_kept), reached, accepted_at)
