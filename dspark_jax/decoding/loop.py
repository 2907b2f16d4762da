"""The compiled decoding loops behind :mod:`dspark_jax.decoding.speculative`: plain autoregressive
and lossless speculative (DSpark / DFlash), their host-side batch layout and their compile cache.

Both loops are single jitted functions: prefill, then a ``lax.while_loop`` whose
body is one decode step for every row of the batch, entirely on device (no host
round-trip per token or per block). Shapes are static: a ``[B, S]`` token
buffer, KV caches of ``S`` positions, blocks of ``block_size + 1`` verified tokens;
everything variable (prompt lengths, verification lengths, finished rows) is a
mask.

Speculative step (docs/design.md#pipeline / docs/design.md#verification), built from the pieces of
:mod:`dspark_jax.decoding.round`: with ``P`` the position of the anchor (the last
confirmed token, not yet seen by the target), draft ``block_size`` tokens (one backbone
pass + ``lax.scan`` Markov sampler), verify ``[anchor, x_1..x_n]`` at positions
``P..P+n`` in one target pass (``n = num_speculative_tokens``), rejection-sample, emit
accepted drafts + correction/bonus, write the new target features into the drafter's
context cache. Rejected positions stay in the caches as stale entries that attention
masks by position and later writes overwrite.

Randomness is per request: the token after position ``t`` is decided with keys
derived from ``fold_in(request_key, t)``, so a request's output does not depend
on its batch-mates, its row, or how long the process has run.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import auto_verify
from dspark_jax.decoding.auto_verify import AutoWidths
from dspark_jax.decoding.compile_cache import LRUCache
from dspark_jax.decoding.results import BatchResult, DecodeStats, Generation, RoundLog, generations
from dspark_jax.decoding.round import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_RUNNING,
    FINISH_STOP,
    RoundCaches,
    RoundInputs,
    VerifiedRound,
    append_tokens,
    draft_tokens,
    emit_counts,
    finish_codes,
    is_stop,
    next_token,
    plain_step,
    prefill,
    round_statistics,
    split_round_keys,
    token_keys,
    verify_pass,
)
from dspark_jax.decoding.validation import check_max_new_tokens, check_prompts, check_seeds
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.layers import KVCache
from dspark_jax.models.sampling import SamplingArrays, logits_are_finite, sampling_arrays
from dspark_jax.models.target import Target

__all__ = ["STEP_BUCKET", "AutoWidths", "Batch", "make_batch", "run_autoregressive", "run_speculative"]


class _Loop(NamedTuple):
    seq: jax.Array  # [B, S] int32 tokens (prompt + generated), -1 elsewhere
    length: jax.Array  # [B] confirmed tokens; the anchor is seq[length - 1]
    finish: jax.Array  # [B] FINISH_* code, 0 while running
    tcache: KVCache
    dcache: KVCache | None
    stats: DecodeStats
    step: jax.Array
    rounds: RoundLog | None = None
    auto: Any = None  # auto_verify.AutoState with num_speculative_tokens="auto", else None


class _Inputs(NamedTuple):
    """A call's device inputs, one pytree argument of the compiled loops (:class:`Batch` on device)."""

    prompt: jax.Array  # [B, Tp] int32 right-padded prompts
    prompt_len: jax.Array  # [B] int32
    limit: jax.Array  # [B] int32 prompt + max new tokens, capped by the context
    sampling: SamplingArrays  # per-request temperature / top-k / top-p
    keys: jax.Array  # [B, 2] request keys
    stop: jax.Array  # [S] int32 stop ids (-2: none)


def _start(target, drafter, x: _Inputs, cache_len: int, taps, block_size: int) -> _Loop:
    """Prefill (:func:`~dspark_jax.decoding.round.prefill`) -> the loop's initial state."""
    prompt, prompt_len, limit, stop_ids = x.prompt, x.prompt_len, x.limit, x.stop
    b, tp = prompt.shape
    pre = prefill(target, drafter, prompt, prompt_len, x.keys, x.sampling, cache_len, taps)
    pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))
    seq = jnp.full((b, cache_len), -1, jnp.int32)
    seq = seq.at[:, :tp].set(jnp.where(pos < prompt_len[:, None], prompt, -1))
    seq = seq.at[jnp.arange(b), prompt_len].set(pre.token, mode="drop")
    length = prompt_len + 1
    finish = jnp.where(
        is_stop(pre.token, stop_ids),
        FINISH_STOP,
        jnp.where(length >= jnp.minimum(limit, cache_len), FINISH_LENGTH, FINISH_RUNNING),
    )
    finish = jnp.where(pre.finite, finish, FINISH_ERROR).astype(jnp.int32)
    stats = DecodeStats.zeros(b, block_size)
    return _Loop(seq, length, finish, pre.tcache, pre.dcache, stats, jnp.zeros((), jnp.int32))


def _emit(state: _Loop, tokens, n_new, x: _Inputs, cache_len: int):
    """Appends up to ``n_new`` of ``tokens [B, W]`` honouring stop ids and limits.

    Returns the new (seq, length, finish, n_kept).
    """
    running = state.finish == FINISH_RUNNING
    end = jnp.minimum(x.limit, cache_len)
    n_keep, stopped, full = emit_counts(tokens, n_new, running, state.length, end, x.stop)
    seq = append_tokens(state.seq, state.length, tokens, n_keep)
    return seq, state.length + n_keep, finish_codes(state.finish, stopped, full), n_keep


def _running(s: _Loop, max_steps: int):
    return jnp.any(s.finish == FINISH_RUNNING) & (s.step < max_steps)


@partial(jax.jit, static_argnames=("t_graph", "cache_len", "max_steps"))
def _ar_decode(t_state, x: _Inputs, *, t_graph, cache_len: int, max_steps: int):
    target = nnx.merge(t_graph, t_state)
    init = _start(target, None, x, cache_len, (), 1)

    def body(s: _Loop):
        p = s.length - 1
        anchor = jnp.take_along_axis(s.seq, p[:, None], 1)
        out = target(anchor, p[:, None], s.tcache)
        finite = logits_are_finite(out.logits[:, 0])
        tok = next_token(out.logits[:, 0], x.keys, p, x.sampling)
        running = s.finish == FINISH_RUNNING
        seq, length, finish, n_keep = _emit(s, tok[:, None], jnp.ones_like(p), x, cache_len)
        finish = jnp.where(running & ~finite, FINISH_ERROR, finish)
        st = s.stats
        stats = st._replace(num_passes=st.num_passes + running, num_emitted=st.num_emitted + n_keep)
        return _Loop(seq, length, finish, out.cache, None, stats, s.step + 1)

    return jax.lax.while_loop(partial(_running, max_steps=max_steps), body, init)


class _Round(NamedTuple):
    """A round's verification: the verified pass, ``num_verify [B]``, the drafts' raw
    confidence logits ``[B, block_size]`` (for :class:`RoundLog`), the compiled pass width
    ``[]`` int32 and whether the round drafted ``[]`` bool (for :class:`DecodeStats`)."""

    verified: VerifiedRound
    num_verify: jax.Array
    conf_logit: jax.Array
    width: jax.Array
    drafted: jax.Array


def _fixed_round(target, drafter, s: _Loop, x: _Inputs, r: RoundInputs, *, width: int) -> _Round:
    """A round verifying ``min(num_speculative_tokens, room)`` drafts of every running row in a
    pass of static ``width + 1`` tokens (``width`` = num_speculative_tokens: a shorter fixed
    length costs a shorter pass, not a block-wide one with fewer accepts)."""
    d = draft_tokens(target, drafter, r.anchor, r.anchor_pos, s.dcache, r.draft_keys, x.sampling)
    # Verification length: fixed by limits only, never by draft values (non-anticipation).
    ell = jnp.where(r.running, jnp.clip(r.room, 0, width), 0)
    res = verify_pass(target, drafter, RoundCaches(s.tcache, s.dcache), r, d, ell, x.sampling, width=width)
    return _Round(res, ell, d.confidence_logit, jnp.int32(width), jnp.ones((), bool))


def _close_round(s: _Loop, r: _Round, running, x: _Inputs, cache_len: int, new_auto) -> _Loop:
    """Emission, finish codes, statistics and the optional round log of one round."""
    v = r.verified
    seq, length, finish, n_keep = _emit(s, v.tokens, v.num_emitted, x, cache_len)
    finish = jnp.where(running & ~v.finite, FINISH_ERROR, finish)
    block_size = s.stats.position_reached.shape[1]
    rs = round_statistics(r.num_verify, v.num_accepted, v.num_emitted, n_keep, block_size)
    stats = s.stats.add(running, n_keep, rs, r.width, r.drafted)
    rounds = s.rounds
    if rounds is not None:
        rounds = RoundLog(
            rounds.conf_logit.at[:, s.step].set(r.conf_logit),
            rounds.num_accepted.at[:, s.step].set(rs.num_accepted),
            rounds.num_draft_tokens.at[:, s.step].set(rs.num_draft_tokens),
        )
    return _Loop(seq, length, finish, v.caches.target, v.caches.drafter, stats, s.step + 1, rounds, new_auto)


@partial(
    jax.jit,
    static_argnames=(
        "t_graph",
        "d_graph",
        "cache_len",
        "max_steps",
        "record_rounds",
        "width",
    ),
)
def _spec_decode(
    t_state,
    d_state,
    x: _Inputs,
    auto: AutoWidths | None,
    *,
    t_graph,
    d_graph,
    cache_len: int,
    max_steps: int,
    record_rounds: bool,
    width: int,
):
    """The speculative loop: ``width`` drafts verified per round, or ``"auto"``'s widths and costs
    (``auto``, then ``width`` is unread)."""
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    block_size = drafter.cfg.block_size
    init = _start(target, drafter, x, cache_len, drafter.cfg.taps, block_size)
    b = x.prompt.shape[0]
    if record_rounds:
        zeros = jnp.zeros((b, max_steps), jnp.int32)
        init = init._replace(rounds=RoundLog(jnp.zeros((b, max_steps, block_size), jnp.float32), zeros, zeros))
    if auto is not None:
        first = auto_verify.first_round_drafts(auto, block_size)
        floor = auto_verify.probe_floor(auto.t_draft, auto.t_verify[0])
        init = init._replace(auto=auto_verify.init_auto_state(b, block_size, auto.probe_every, first, floor))
    else:
        floor = jnp.zeros((), jnp.int32)

    def body(s: _Loop):
        r_in = _round_inputs(s, x, cache_len)
        running = r_in.running
        if auto is None:
            return _close_round(s, _fixed_round(target, drafter, s, x, r_in, width=width), running, x, cache_len, None)

        aw = auto

        def drafting(s: _Loop) -> _Loop:
            caches = RoundCaches(s.tcache, s.dcache)
            res, ell, zlog, new_auto = auto_verify.auto_round(target, drafter, s.auto, caches, r_in, x.sampling, aw)
            r = _Round(res, ell, zlog, jnp.asarray(aw.widths, jnp.int32)[new_auto.width], s.auto.draft_on)
            return _close_round(s, r, running, x, cache_len, new_auto)

        # A round without drafts is the suspended loop's (a request that does not draft first starts there).
        s = jax.lax.cond(s.auto.draft_on, drafting, lambda s: s, s)
        return _suspended(target, drafter, s, x, cache_len, max_steps, floor)

    return jax.lax.while_loop(partial(_running, max_steps=max_steps), body, init)


def _round_inputs(s: _Loop, x: _Inputs, cache_len: int) -> RoundInputs:
    """The round's :class:`RoundInputs` from the loop state."""
    p = s.length - 1
    anchor = jnp.take_along_axis(s.seq, p[:, None], 1)[:, 0]
    draft_keys, verify_keys = split_round_keys(token_keys(x.keys, p))
    room = jnp.minimum(x.limit, cache_len) - s.length - 1
    return RoundInputs(s.finish == FINISH_RUNNING, anchor, p, draft_keys, verify_keys, room)


CONTEXT_CHUNK = 16
"""Rounds without drafts whose drafter context is written in one pass (a write reads the context
projections' weights once whatever its length, and runs the same few operations)."""


class _Plain(NamedTuple):
    """The carry of the suspended stretch: all that a round without drafts changes."""

    seq: jax.Array
    length: jax.Array
    finish: jax.Array
    tcache: KVCache
    dcache: KVCache | None
    step: jax.Array
    num_passes: jax.Array  # [B] DecodeStats.num_passes
    num_emitted: jax.Array  # [B] DecodeStats.num_emitted
    chunk_start: jax.Array  # [] step of the chunk's first round
    features: jax.Array  # [B, CONTEXT_CHUNK, n_taps * H] the chunk's tapped features, not yet written
    ctx_pos: jax.Array  # [B, CONTEXT_CHUNK] int32 their positions (-1: nothing to write)
    ctx_tok: jax.Array  # [B, CONTEXT_CHUNK] int32 their tokens


def _plain_round(target, drafter, t: _Plain, *, x: _Inputs, cache_len: int) -> _Plain:
    """A round of ``"auto"`` while drafting is suspended: a width-0 pass
    (:func:`~dspark_jax.decoding.round.plain_step`) and its emission; its tapped features wait in the
    chunk for the drafter's context write (:func:`_suspended`)."""
    p = t.length - 1
    anchor = jnp.take_along_axis(t.seq, p[:, None], 1)[:, 0]
    running = t.finish == FINISH_RUNNING
    tcache, tok, finite, feats = plain_step(target, drafter.cfg.taps, t.tcache, anchor, p, x.keys, x.sampling)
    j = t.step - t.chunk_start
    features = jax.lax.dynamic_update_slice_in_dim(t.features, feats.astype(t.features.dtype), j, axis=1)
    ctx_pos = jax.lax.dynamic_update_slice_in_dim(t.ctx_pos, jnp.where(running, p, -1)[:, None], j, axis=1)
    ctx_tok = jax.lax.dynamic_update_slice_in_dim(t.ctx_tok, anchor[:, None], j, axis=1)
    end = jnp.minimum(x.limit, cache_len)
    n_keep, stopped, full = emit_counts(tok[:, None], jnp.ones_like(p), running, t.length, end, x.stop)
    seq = append_tokens(t.seq, t.length, tok[:, None], n_keep)
    finish = jnp.where(running & ~finite, FINISH_ERROR, finish_codes(t.finish, stopped, full))
    return _Plain(
        seq, t.length + n_keep, finish, tcache, t.dcache, t.step + 1, t.num_passes + running,
        t.num_emitted + n_keep, t.chunk_start, features, ctx_pos, ctx_tok,
    )  # fmt: skip


def _context_chunk(target, drafter, t: _Plain, *, x: _Inputs, cache_len: int, stop) -> _Plain:
    """Up to :data:`CONTEXT_CHUNK` rounds without drafts (:func:`_plain_round`), then the drafter's
    context of their tokens in one write (the positions of rows that were not running: none)."""
    t = t._replace(chunk_start=t.step, ctx_pos=jnp.full_like(t.ctx_pos, -1))
    end = jnp.minimum(stop, t.step + CONTEXT_CHUNK)
    t = jax.lax.while_loop(
        lambda u: jnp.any(u.finish == FINISH_RUNNING) & (u.step < end),
        partial(_plain_round, target, drafter, x=x, cache_len=cache_len),
        t,
    )
    return t._replace(dcache=drafter.extend_cache(t.dcache, t.features, t.ctx_pos, target=target, tokens=t.ctx_tok))


def _suspended(target, drafter, s: _Loop, x: _Inputs, cache_len: int, max_steps: int, min_room) -> _Loop:
    """The rounds of ``"auto"`` up to its next drafting round (none when ``s.auto.draft_on``), run
    by a loop of their own whose carry is only what such a round changes.

    Each round is :func:`~dspark_jax.decoding.auto_verify.auto_round` without drafts, its drafter
    context written with that of up to :data:`CONTEXT_CHUNK` rounds in one pass (the same values to
    rounding: the drafts it feeds are the drafter's, the output law is the target's); what
    it would do to the rest of the state is applied once after the loop, in closed form: a round
    without drafts adds 1 to ``num_passes`` and to ``verify_width_rounds[:, 0]`` of each running row
    and nothing to the other statistics, writes zeros into a :class:`RoundLog` column that is
    still zero (each step's column is written once), and
    :func:`~dspark_jax.decoding.auto_verify.schedule` only counts it (``idle + 1``, width 0,
    drafting again once ``idle >= wait``; its decayed sums are multiplied by 1 and added 0).
    ``min_room`` ([] int32, :func:`~dspark_jax.decoding.auto_verify.probe_floor`): a probe that would
    leave every running row fewer tokens than that is not made.
    """
    a = s.auto
    # Drafting resumes once idle + k >= wait after k rounds; the loop bound is that step. A probe is
    # skipped when no running row would then have min_room tokens left (probe_floor: fewer rounds
    # than a probe's price is spread over): the rounds run plain to the end.
    probe = s.step + a.wait - a.idle
    room = jnp.max(jnp.where(s.finish == FINISH_RUNNING, jnp.minimum(x.limit, cache_len) - s.length, 0))
    late = room - (probe - s.step) < min_room
    stop = jnp.where(a.draft_on, s.step, jnp.minimum(jnp.where(late, max_steps, probe), max_steps))
    b, f = s.seq.shape[0], len(drafter.cfg.taps) * target.cfg.hidden_size
    pending = jnp.full((b, CONTEXT_CHUNK), -1, jnp.int32)
    init = _Plain(
        s.seq, s.length, s.finish, s.tcache, s.dcache, s.step, s.stats.num_passes, s.stats.num_emitted,
        s.step, jnp.zeros((b, CONTEXT_CHUNK, f), target.dtype), pending, pending,
    )  # fmt: skip
    t = jax.lax.while_loop(
        lambda t: jnp.any(t.finish == FINISH_RUNNING) & (t.step < stop),
        partial(_context_chunk, target, drafter, x=x, cache_len=cache_len, stop=stop),
        init,
    )
    k = t.step - s.step
    idle = a.idle + k
    auto = a._replace(
        draft_on=jnp.where(k > 0, idle >= a.wait, a.draft_on), idle=idle, width=jnp.where(k > 0, 0, a.width)
    )
    st = s.stats
    stats = st._replace(
        num_passes=t.num_passes,
        num_emitted=t.num_emitted,
        verify_width_rounds=st.verify_width_rounds.at[:, 0].add(t.num_passes - st.num_passes),
    )
    return _Loop(t.seq, t.length, t.finish, t.tcache, t.dcache, stats, t.step, s.rounds, auto)


# Compiled loops by shape signature, shared by every call in the process; bounded so that
# a long-lived process (a notebook sweeping prompt lengths) does not keep them all.
_COMPILED = LRUCache(maxsize=32)
STEP_BUCKET = 64  # [steps] granularity of the loops' static step bound


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class Batch(NamedTuple):
    """Host-side inputs of one call of a decode loop (:func:`make_batch`)."""

    prompt: np.ndarray  # [B, Tp] int32 right-padded prompts
    lens: np.ndarray  # [B] int32 prompt lengths
    limit: np.ndarray  # [B] int32 prompt + max new tokens, capped by the context
    cache_len: int
    stop: jax.Array  # [S] int32 stop ids (-2: none)
    sampling: SamplingArrays
    keys: jax.Array  # [B, 2] request keys
    max_steps: int


def _cache_len(cfg, lens: np.ndarray, max_new: np.ndarray, tp: int, block_size: int, cache_len: int | None) -> int:
    if cache_len is None:
        need = int((lens + max_new).max()) + block_size + 2
        cache_len = min(_round_up(max(need, tp + 1), 64), _round_up(cfg.max_position, 1))
        return max(cache_len, min(tp + 1, cfg.max_position))
    if cache_len <= int(lens.max()):
        raise DSparkInputError(
            f"cache_len={cache_len} leaves no room to generate after the longest prompt ({int(lens.max())} tokens)"
        )
    return cache_len


def make_batch(
    target: Target, prompts, max_new_tokens, block_size: int, cache_len, sampling_kw, seed, stop_ids
) -> Batch:
    """Validates a call's inputs and lays them out (:mod:`dspark_jax.decoding.validation`).

    ``block_size`` (0 for plain decoding): drafts a round may write past the last kept token.
    """
    cfg = target.cfg
    check_prompts(prompts, cfg.vocab_size, cfg.max_position)
    b = len(prompts)
    max_new = check_max_new_tokens(max_new_tokens, b)
    lens = np.array([len(p) for p in prompts], np.int32)
    tp = _round_up(int(lens.max()), 32)
    cache_len = _cache_len(cfg, lens, max_new, tp, block_size, cache_len)
    tp = min(tp, cache_len)
    prompt = np.zeros((b, tp), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    limit = np.minimum(lens.astype(np.int64) + max_new, cfg.max_position).astype(np.int32)
    stop = jnp.asarray(list(stop_ids if stop_ids is not None else cfg.eos_ids) or [-2], jnp.int32)
    sampling = sampling_arrays(b, *sampling_kw)
    keys = _keys(check_seeds(seed, b), b)
    # The loops' step bound is static: bucketed like the default cache length, so a new
    # max_new_tokens reuses the compiled loop (every step emits >= 1 token per running row, so a
    # row always reaches its own limit first; the bound never cuts a generation short).
    max_steps = _round_up(int(np.max(limit - lens)), STEP_BUCKET)
    return Batch(prompt, lens, limit, cache_len, stop, sampling, keys, max_steps)


def _device_inputs(bt: Batch) -> _Inputs:
    return _Inputs(jnp.asarray(bt.prompt), jnp.asarray(bt.lens), jnp.asarray(bt.limit), bt.sampling, bt.keys, bt.stop)


def _generations(state: _Loop, lens, speculative: bool) -> list[Generation]:
    return generations(state.seq, state.length, state.finish, lens, state.stats, state.rounds, speculative)


def _keys(seeds, b: int) -> jax.Array:
    seeds = np.broadcast_to(np.asarray(seeds, np.int64), (b,))
    # jax.random.PRNGKey keeps a seed's low 32 bits (without x64); one vectorised call gives the
    # same keys as a per-seed loop, which cost ~0.5 ms a seed (12 s for 24,000 requests).
    low = (seeds & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    return _seed_keys(jnp.asarray(low))


_seed_keys = jax.jit(jax.vmap(jax.random.PRNGKey))


def _run(fn, args, kwargs, key):
    """AOT-compiles once per shape signature, then times only the execution."""
    t0 = time.perf_counter()
    # The arguments' layouts are part of the signature: a target sharded over a mesh
    # (Target(mesh=...)) needs its own program.
    key = key + (tuple(x.sharding for x in jax.tree.leaves(args) if isinstance(x, jax.Array)),)
    compiled = _COMPILED.get_or_build(key, lambda: fn.lower(*args, **kwargs).compile())
    t1 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return out, t2 - t1, t1 - t0


def run_autoregressive(target: Target, bt: Batch) -> BatchResult:
    """Plain decoding of the laid-out batch ``bt`` (:func:`make_batch` with ``block_size=0``):
    compiled once per shape signature, then run; seconds exclude compilation."""
    t_graph, t_state = nnx.split(target)
    args = (t_state, _device_inputs(bt))
    statics = dict(t_graph=t_graph, cache_len=bt.cache_len, max_steps=bt.max_steps)
    key = ("ar", bt.prompt.shape, bt.stop.shape, *statics.values())
    state, secs, csecs = _run(_ar_decode, args, statics, key)
    return BatchResult(_generations(state, bt.lens, speculative=False), secs, csecs, bt.cache_len)


def run_speculative(
    target: Target,
    drafter,
    bt: Batch,
    num_speculative_tokens: int | AutoWidths,
    *,
    record_rounds: bool = False,
) -> BatchResult:
    """Speculative decoding of the laid-out batch ``bt`` (:func:`make_batch` with the drafter's
    block size): ``num_speculative_tokens`` drafts verified per round (an int in
    ``[1, block_size]``, static: each length compiles its own, shorter, verification pass), or
    ``"auto"``'s :class:`AutoWidths` (:func:`~dspark_jax.decoding.auto_verify.auto_round`).
    Compiled once per shape signature, then run; seconds exclude compilation.

    Returns:
      :class:`BatchResult` whose ``num_speculative_tokens`` is the int, or ``"auto"``.
    """
    (t_graph, t_state), (d_graph, d_state) = nnx.split(target), nnx.split(drafter)
    if isinstance(num_speculative_tokens, AutoWidths):
        auto, width = num_speculative_tokens, drafter.cfg.block_size
    else:
        auto, width = None, int(num_speculative_tokens)
    args = (t_state, d_state, _device_inputs(bt), auto)
    statics = dict(
        t_graph=t_graph,
        d_graph=d_graph,
        cache_len=bt.cache_len,
        max_steps=bt.max_steps,
        record_rounds=bool(record_rounds),
        width=width,
    )
    auto_key = None if auto is None else (auto.widths, auto.probe_every)
    key = ("spec", bt.prompt.shape, bt.stop.shape, auto_key, *statics.values())
    state, secs, csecs = _run(_spec_decode, args, statics, key)
    n_spec = "auto" if auto is not None else width
    return BatchResult(_generations(state, bt.lens, speculative=True), secs, csecs, bt.cache_len, n_spec)
