"""Decoding loops: plain autoregressive and lossless speculative (DSpark / DFlash).

Both loops are single jitted functions: prefill, then a ``lax.while_loop`` whose
body is one decode step for every row of the batch, entirely on device (no host
round-trip per token or per block). Shapes are static: a ``[B, S]`` token
buffer, KV caches of ``S`` positions, blocks of ``gamma + 1`` verified tokens;
everything variable (prompt lengths, verification lengths, finished rows) is a
mask.

Speculative step (DESIGN.md "Pipeline" / "Verification"): with ``P`` the
position of the anchor (the last confirmed token, not yet seen by the target):
draft ``gamma`` tokens (one backbone pass + ``lax.scan`` Markov sampler), verify
``[anchor, x_1..x_gamma]`` at positions ``P..P+gamma`` in one target pass,
rejection-sample, emit accepted drafts + correction/bonus, write the new target
features into the drafter's context cache. Rejected positions stay in the caches
as stale entries that attention masks by position and later writes overwrite.

Randomness is per request: the token after position ``t`` is decided with keys
derived from ``fold_in(request_key, t)``, so a request's output does not depend
on its batch-mates, its row, or how long the process has run.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .drafter import Drafter
from .errors import DSparkInputError
from .layers import KVCache
from .markov import sample_block
from .sampling import SamplingArrays, logits_are_finite, process_logits, sample, sampling_arrays
from .target import Target
from .verifier import verify

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = 0, 1, 2, 3
FINISH_NAMES = {FINISH_RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}


class DecodeStats(NamedTuple):
    """Per-row speculative metrics (DESIGN.md "Metrics"), counting emitted tokens only.

    Attributes:
      passes: ``[B]`` target verification passes (prefill excluded).
      emitted: ``[B]`` tokens emitted by those passes.
      verified: ``[B]`` draft tokens submitted for verification.
      accepted: ``[B]`` accepted draft tokens that were emitted.
      reached: ``[B, gamma]`` blocks whose positions 1..k-1 were accepted and k verified.
      pos_accepted: ``[B, gamma]`` of those, blocks where position k was accepted too.
    """

    passes: jax.Array
    emitted: jax.Array
    verified: jax.Array
    accepted: jax.Array
    reached: jax.Array
    pos_accepted: jax.Array


class RoundLog(NamedTuple):
    """Optional per-round record of speculative decoding (``record_rounds=True``).

    Round ``r`` of row ``b`` is loop step ``r``; rows run from step 0 until they
    finish, so a row's rounds are ``0 .. passes[b] - 1``.

    Attributes:
      conf_logit: ``[B, R, gamma]`` float32 raw confidence logits z_k of the round's
        draft (before calibration), for reliability of the predicted survival.
      accepted: ``[B, R]`` int32 accepted drafts that were emitted.
      verified: ``[B, R]`` int32 drafts counted as verified (as in :class:`DecodeStats`);
        position k (1-based) of the round survived iff ``k <= accepted``, and it
        counts as an observation iff ``k <= verified``.
    """

    conf_logit: jax.Array
    accepted: jax.Array
    verified: jax.Array


class _Loop(NamedTuple):
    seq: jax.Array       # [B, S] int32 tokens (prompt + generated), -1 elsewhere
    length: jax.Array    # [B] confirmed tokens; the anchor is seq[length - 1]
    finish: jax.Array    # [B] FINISH_* code, 0 while running
    tcache: KVCache
    dcache: KVCache | None
    stats: DecodeStats
    step: jax.Array
    rounds: RoundLog | None = None


def _row_keys(base: jax.Array, pos: jax.Array) -> jax.Array:
    """``[B, 2]`` request keys, ``[B]`` positions -> ``[B, 2]`` keys for the token after ``pos``."""
    return jax.vmap(jax.random.fold_in)(base, pos.astype(jnp.uint32))


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1) & (tokens >= 0)


def _prefill(target, drafter, prompt, prompt_len, limit, sampling, base_keys, stop_ids, cache_len, taps):
    b, tp = prompt.shape
    pos = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))
    tcache = target.init_cache(b, cache_len)
    out = target(prompt, pos, tcache, taps=taps, logit_index=prompt_len - 1)
    dcache = None
    if drafter is not None:
        dcache = drafter.extend_cache(drafter.init_cache(b, cache_len), out.features,
                                      jnp.where(pos < prompt_len[:, None], pos, -1), target=target, tokens=prompt)
    finite = logits_are_finite(out.logits)
    tok = sample(_row_keys(base_keys, prompt_len - 1), process_logits(out.logits, sampling))
    seq = jnp.full((b, cache_len), -1, jnp.int32)
    seq = seq.at[:, :tp].set(jnp.where(pos < prompt_len[:, None], prompt, -1))
    seq = seq.at[jnp.arange(b), prompt_len].set(tok, mode="drop")
    length = prompt_len + 1
    finish = jnp.where(_is_stop(tok, stop_ids), FINISH_STOP,
                       jnp.where(length >= jnp.minimum(limit, cache_len), FINISH_LENGTH, FINISH_RUNNING))
    finish = jnp.where(finite, finish, FINISH_ERROR)
    return seq, length, finish.astype(jnp.int32), out.cache, dcache


def _emit(state: _Loop, tokens, n_new, limit, stop_ids, cache_len):
    """Appends up to ``n_new`` of ``tokens [B, W]`` honouring stop ids and limits.

    Returns the new (seq, length, finish, n_kept).
    """
    b, w = tokens.shape
    idx = jnp.arange(w, dtype=jnp.int32)
    running = state.finish == FINISH_RUNNING
    valid = (idx[None, :] < n_new[:, None]) & running[:, None]
    stop_at = valid & _is_stop(tokens, stop_ids)
    first_stop = jnp.where(jnp.any(stop_at, 1), jnp.argmax(stop_at, 1), w)
    room = jnp.minimum(limit, cache_len) - state.length
    n_keep = jnp.where(running, jnp.minimum(jnp.minimum(n_new, first_stop + 1), room), 0)
    write = idx[None, :] < n_keep[:, None]
    pos = jnp.where(write, state.length[:, None] + idx[None, :], cache_len)
    seq = state.seq.at[jnp.arange(b)[:, None], pos].set(tokens, mode="drop")
    length = state.length + n_keep
    stopped = running & (first_stop < n_keep)
    full = running & ~stopped & (length >= jnp.minimum(limit, cache_len))
    finish = jnp.where(stopped, FINISH_STOP, jnp.where(full, FINISH_LENGTH, state.finish))
    return seq, length, finish.astype(jnp.int32), n_keep


def _zero_stats(b: int, gamma: int) -> DecodeStats:
    z = jnp.zeros((b,), jnp.int32)
    zg = jnp.zeros((b, max(gamma, 1)), jnp.int32)
    return DecodeStats(z, z, z, z, zg, zg)


def draft_tokens(target: Target, drafter, anchors: jax.Array, anchor_pos: jax.Array, cache,
                 keys: jax.Array, sampling: SamplingArrays):
    """One drafting round for every row, whatever the drafter kind.

    DSpark / DFlash: one parallel backbone pass then the ``lax.scan`` Markov sampler;
    eagle3: ``gamma`` autoregressive single-token steps (:meth:`EagleDrafter.draft`).

    Args:
      anchors: ``[B]`` int32 last confirmed tokens; anchor_pos: ``[B]`` int32 their positions.
      cache: the drafter's context cache; keys: ``[B, 2]`` per-row draft keys.
    Returns:
      :class:`~dspark_jax.markov.Draft` with ``tokens [B, gamma]`` and ``probs [B, gamma, V]``.
    """
    if drafter.cfg.variant == "eagle3":
        return drafter.draft(target, anchors, anchor_pos, cache, keys, sampling)
    block = drafter.draft_block(target, anchors, anchor_pos, cache)
    return sample_block(drafter, block, anchors, keys, sampling)


@partial(jax.jit, static_argnames=("t_graph", "cache_len", "max_steps"))
def _ar_decode(t_state, prompt, prompt_len, limit, sampling, base_keys, stop_ids,
               *, t_graph, cache_len: int, max_steps: int):
    target = nnx.merge(t_graph, t_state)
    seq, length, finish, tcache, _ = _prefill(target, None, prompt, prompt_len, limit, sampling,
                                              base_keys, stop_ids, cache_len, ())
    b = prompt.shape[0]
    init = _Loop(seq, length, finish, tcache, None, _zero_stats(b, 1), jnp.zeros((), jnp.int32))

    def cond(s: _Loop):
        return jnp.any(s.finish == FINISH_RUNNING) & (s.step < max_steps)

    def body(s: _Loop):
        p = s.length - 1
        anchor = jnp.take_along_axis(s.seq, p[:, None], 1)
        out = target(anchor, p[:, None], s.tcache)
        finite = logits_are_finite(out.logits[:, 0])
        tok = sample(_row_keys(base_keys, p), process_logits(out.logits[:, 0], sampling))
        running = s.finish == FINISH_RUNNING
        seq, length, finish, n_keep = _emit(s, tok[:, None], jnp.ones_like(p), limit, stop_ids, cache_len)
        finish = jnp.where(running & ~finite, FINISH_ERROR, finish)
        st = s.stats
        stats = st._replace(passes=st.passes + running, emitted=st.emitted + n_keep)
        return _Loop(seq, length, finish, out.cache, None, stats, s.step + 1)

    return jax.lax.while_loop(cond, body, init)


@partial(jax.jit, static_argnames=("t_graph", "d_graph", "cache_len", "max_steps", "record_rounds"))
def _spec_decode(t_state, d_state, prompt, prompt_len, limit, sampling,
                 base_keys, stop_ids, max_verify, *, t_graph, d_graph, cache_len: int, max_steps: int,
                 record_rounds: bool = False):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    gamma = drafter.cfg.gamma
    taps = drafter.cfg.taps
    seq, length, finish, tcache, dcache = _prefill(target, drafter, prompt, prompt_len, limit, sampling,
                                                   base_keys, stop_ids, cache_len, taps)
    b = prompt.shape[0]
    rounds = None
    if record_rounds:
        rounds = RoundLog(jnp.zeros((b, max_steps, gamma), jnp.float32),
                          jnp.zeros((b, max_steps), jnp.int32), jnp.zeros((b, max_steps), jnp.int32))
    init = _Loop(seq, length, finish, tcache, dcache, _zero_stats(b, gamma), jnp.zeros((), jnp.int32), rounds)
    offs = jnp.arange(gamma + 1, dtype=jnp.int32)

    def cond(s: _Loop):
        return jnp.any(s.finish == FINISH_RUNNING) & (s.step < max_steps)

    def body(s: _Loop):
        running = s.finish == FINISH_RUNNING
        p = s.length - 1
        anchor = jnp.take_along_axis(s.seq, p[:, None], 1)[:, 0]
        keys = _row_keys(base_keys, p)
        draft_keys, verify_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        draft = draft_tokens(target, drafter, anchor, p, s.dcache, draft_keys, sampling)
        # Verification length: fixed by limits only, never by draft values (non-anticipation).
        room = jnp.minimum(limit, cache_len) - s.length - 1
        ell = jnp.where(running, jnp.clip(jnp.minimum(max_verify, room), 0, gamma), 0)
        vtok = jnp.concatenate([anchor[:, None], draft.tokens], axis=1)
        vpos = p[:, None] + offs
        out = target(vtok, vpos, s.tcache, taps=taps)
        # Only positions that verification can read must be finite (anchor .. ell).
        finite = logits_are_finite(jnp.where((offs[None, :] <= ell[:, None])[..., None], out.logits, 0.0))
        tprobs = process_logits(out.logits, sampling)
        res = verify(verify_keys, draft.tokens, draft.probs, tprobs, ell)
        seq, length, finish, n_keep = _emit(s, res.tokens, res.num_emitted, limit, stop_ids, cache_len)
        finish = jnp.where(running & ~finite, FINISH_ERROR, finish)
        dcache = drafter.extend_cache(s.dcache, out.features, jnp.where(running[:, None], vpos, -1),
                                      target=target, tokens=vtok)
        k = offs[:gamma][None, :]
        emitted_pos = k < n_keep[:, None]
        reached = (k < ell[:, None]) & (k <= res.num_accepted[:, None]) & emitted_pos
        pos_acc = reached & (k < res.num_accepted[:, None])
        # A stop inside the accepted drafts discards the rest of the block: drafts after it
        # are not counted as verified (else a perfect drafter would show acceptance < 1).
        n_verified = jnp.where(n_keep < res.num_emitted, jnp.minimum(ell, n_keep), ell)
        n_accepted = jnp.minimum(res.num_accepted, n_keep)
        st = s.stats
        stats = DecodeStats(
            passes=st.passes + running, emitted=st.emitted + n_keep,
            verified=st.verified + n_verified, accepted=st.accepted + n_accepted,
            reached=st.reached + reached, pos_accepted=st.pos_accepted + pos_acc)
        rounds = s.rounds
        if rounds is not None:
            rounds = RoundLog(rounds.conf_logit.at[:, s.step].set(draft.confidence_logit),
                              rounds.accepted.at[:, s.step].set(n_accepted),
                              rounds.verified.at[:, s.step].set(n_verified))
        return _Loop(seq, length, finish, out.cache, dcache, stats, s.step + 1, rounds)

    return jax.lax.while_loop(cond, body, init)


@dataclasses.dataclass
class Generation:
    """Result of one request.

    Attributes:
      token_ids: generated token ids (prompt excluded), stop token included.
      finish_reason: ``"stop"`` (stop/EOS token), ``"length"`` (max_new_tokens or
        context end) or ``"error"`` (non-finite logits).
      num_target_passes: target verification passes after prefill.
      tau: mean tokens emitted per target pass (accepted drafts + bonus/correction).
      acceptance_rate: accepted drafts / verified drafts (None when nothing verified).
      position_acceptance: conditional acceptance per block position k (None where
        position k was never reached).
      num_accepted / num_verified: accepted and verified draft tokens.
      position_reached / position_accepted: per block position k, blocks whose
        positions 1..k-1 were accepted and k verified / of those, blocks where k was
        accepted too (``position_accepted[k-1]`` = rounds with >= k accepted drafts).
      rounds: with ``record_rounds=True``, per-round numpy arrays of this request
        (see :class:`RoundLog`): ``conf_logit [n, gamma]``, ``accepted [n]``,
        ``verified [n]`` for its ``n = num_target_passes`` rounds; else None.
    """

    token_ids: list[int]
    finish_reason: str
    num_target_passes: int
    tau: float
    acceptance_rate: float | None
    position_acceptance: list[float | None]
    num_accepted: int = 0
    num_verified: int = 0
    position_reached: list[int] = dataclasses.field(default_factory=list)
    position_accepted: list[int] = dataclasses.field(default_factory=list)
    rounds: dict[str, np.ndarray] | None = None


@dataclasses.dataclass
class BatchResult:
    """Generations of a batch plus timing (seconds, tokens/s; compilation excluded)."""

    generations: list[Generation]
    seconds: float
    compile_seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(len(g.token_ids) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


_COMPILED: dict[Any, Any] = {}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _prepare(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens, gamma: int,
             cache_len: int | None):
    cfg = target.cfg
    if not prompts:
        raise DSparkInputError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise DSparkInputError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise DSparkInputError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(p) >= cfg.max_position:
            raise DSparkInputError(
                f"prompt {i} has {len(p)} tokens but the target's context is {cfg.max_position}: "
                "shorten the prompt")
    b = len(prompts)
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (b,))
    if np.any(max_new < 1):
        raise DSparkInputError("max_new_tokens must be >= 1")
    lens = np.array([len(p) for p in prompts], np.int32)
    tp = _round_up(int(lens.max()), 32)
    if cache_len is None:
        need = int((lens + max_new).max()) + gamma + 2
        cache_len = min(_round_up(max(need, tp + 1), 64), _round_up(cfg.max_position, 1))
        cache_len = max(cache_len, min(tp + 1, cfg.max_position))
    elif cache_len <= int(lens.max()):
        raise DSparkInputError(
            f"cache_len={cache_len} leaves no room to generate after the longest prompt ({int(lens.max())} tokens)")
    tp = min(tp, cache_len)
    prompt = np.zeros((b, tp), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    limit = np.minimum(lens.astype(np.int64) + max_new, cfg.max_position).astype(np.int32)
    return prompt, lens, limit, cache_len


def _keys(seeds, b: int) -> jax.Array:
    seeds = np.broadcast_to(np.asarray(seeds, np.int64), (b,))
    # Host-side stack of distinct seeds: jnp.stack over B device arrays is superlinear
    # (88 s for 8000 requests); this is ~0.1 ms per distinct seed, same keys.
    uniq, inv = np.unique(seeds, return_inverse=True)
    keys = np.stack([np.asarray(jax.random.PRNGKey(int(s))) for s in uniq])
    return jnp.asarray(keys[inv.reshape(-1)])


def _run(fn, args, kwargs, key):
    """AOT-compiles once per shape signature, then times only the execution."""
    t0 = time.perf_counter()
    # The arguments' layouts are part of the signature: a target sharded over a mesh
    # (Target(mesh=...)) needs its own program.
    key = key + (tuple(x.sharding for x in jax.tree.leaves(args) if isinstance(x, jax.Array)),)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = fn.lower(*args, **kwargs).compile()
        _COMPILED[key] = compiled
    t1 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    return out, t2 - t1, t1 - t0


def _results(state: _Loop, lens, gamma: int, speculative: bool) -> list[Generation]:
    seq, length, finish = (np.asarray(x) for x in (state.seq, state.length, state.finish))
    st = jax.tree.map(np.asarray, state.stats)
    rl = None if state.rounds is None else jax.tree.map(np.asarray, state.rounds)
    gens = []
    for i in range(seq.shape[0]):
        ids = seq[i, lens[i] : length[i]].tolist()
        passes = int(st.passes[i])
        emitted = int(st.emitted[i])
        reached, acc = st.reached[i], st.pos_accepted[i]
        gens.append(Generation(
            token_ids=ids,
            finish_reason=FINISH_NAMES[int(finish[i])] or "length",
            num_target_passes=passes,
            tau=emitted / passes if passes else float("nan"),
            acceptance_rate=(int(st.accepted[i]) / int(st.verified[i])) if speculative and st.verified[i] else None,
            position_acceptance=[(float(a) / float(r)) if r else None for a, r in zip(acc, reached)]
            if speculative else [],
            num_accepted=int(st.accepted[i]), num_verified=int(st.verified[i]),
            position_reached=reached.tolist() if speculative else [],
            position_accepted=acc.tolist() if speculative else [],
            rounds=None if rl is None else {
                "conf_logit": rl.conf_logit[i, :passes], "accepted": rl.accepted[i, :passes],
                "verified": rl.verified[i, :passes]},
        ))
    return gens


def _check_finite(gens: list[Generation]) -> None:
    for i, g in enumerate(gens):
        if g.finish_reason == "error":
            raise FloatingPointError(
                f"request {i}: the target produced NaN/inf logits after {len(g.token_ids)} tokens "
                "(check the weights and dtype)")


def generate_autoregressive(target: Target, prompts: Sequence[Sequence[int]], *,
                            max_new_tokens: int | Sequence[int] = 64, temperature=0.0, top_k=0,
                            top_p=1.0, seed: int | Sequence[int] = 0,
                            stop_ids: Sequence[int] | None = None,
                            cache_len: int | None = None) -> BatchResult:
    """Plain decoding from the target: one target pass per token (the baseline).

    Args:
      target: the target model.
      prompts: ``B`` lists of token ids (non-empty, shorter than the context).
      max_new_tokens: per-request (or shared) cap on generated tokens.
      temperature / top_k / top_p: sampling settings (scalars or per request);
        temperature 0 is greedy.
      seed: per-request (or shared) PRNG seed.
      stop_ids: token ids that end a request (default: the target's EOS ids).
      cache_len: KV-cache length in tokens (default: just enough, rounded up).

    Returns:
      :class:`BatchResult`; seconds exclude compilation.

    Raises:
      DSparkInputError: empty prompt, unknown token id, prompt too long.
      FloatingPointError: the target produced NaN/inf logits.
    """
    prompt, lens, limit, cache_len = _prepare(target, prompts, max_new_tokens, 0, cache_len)
    b = prompt.shape[0]
    stop = jnp.asarray(list(stop_ids if stop_ids is not None else target.cfg.eos_ids) or [-2], jnp.int32)
    sampling = sampling_arrays(b, temperature, top_k, top_p)
    t_graph, t_state = nnx.split(target)
    max_steps = int(np.max(limit - lens))
    args = (t_state, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(limit), sampling,
            _keys(seed, b), stop)
    statics = dict(t_graph=t_graph, cache_len=cache_len, max_steps=max_steps)
    key = ("ar", prompt.shape, stop.shape, *statics.values())
    state, secs, csecs = _run(_ar_decode, args, statics, key)
    gens = _results(state, lens, 1, speculative=False)
    _check_finite(gens)
    return BatchResult(gens, secs, csecs)


def generate_speculative(target: Target, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int | Sequence[int] = 64, temperature=0.0, top_k=0,
                         top_p=1.0, seed: int | Sequence[int] = 0,
                         stop_ids: Sequence[int] | None = None, gamma: int | None = None,
                         cache_len: int | None = None, record_rounds: bool = False) -> BatchResult:
    """Lossless speculative decoding with a DSpark/DFlash drafter.

    Output is distributed exactly as :func:`generate_autoregressive` with the same
    settings (token for token at temperature 0).

    Args:
      target / prompts / max_new_tokens / temperature / top_k / top_p / seed /
        stop_ids / cache_len: as in :func:`generate_autoregressive`.
      drafter: a drafter built for this target (see :func:`check_compatible`).
      gamma: verification length per round, ``1..drafter.cfg.gamma`` (default:
        the drafter's block size). Drafting always produces the full block.
      record_rounds: also record every round's raw confidence logits and
        accepted/verified counts (:attr:`Generation.rounds`), e.g. for
        calibration reliability; costs ``[B, max_new_tokens, gamma]`` floats.

    Returns:
      :class:`BatchResult` with tau, acceptance and per-position acceptance.

    Raises:
      DSparkInputError: bad prompts, bad gamma, or a drafter for another target.
      FloatingPointError: the target produced NaN/inf logits.
    """
    check_compatible(target, drafter)
    g_max = drafter.cfg.gamma
    gamma = g_max if gamma is None else int(gamma)
    if not 1 <= gamma <= g_max:
        raise DSparkInputError(f"gamma must be in [1, {g_max}] for this drafter, got {gamma}")
    prompt, lens, limit, cache_len = _prepare(target, prompts, max_new_tokens, g_max, cache_len)
    b = prompt.shape[0]
    stop = jnp.asarray(list(stop_ids if stop_ids is not None else target.cfg.eos_ids) or [-2], jnp.int32)
    sampling = sampling_arrays(b, temperature, top_k, top_p)
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    max_steps = int(np.max(limit - lens))
    args = (t_state, d_state, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(limit), sampling,
            _keys(seed, b), stop, jnp.int32(gamma))
    statics = dict(t_graph=t_graph, d_graph=d_graph, cache_len=cache_len, max_steps=max_steps,
                   record_rounds=bool(record_rounds))
    key = ("spec", prompt.shape, stop.shape, *statics.values())
    state, secs, csecs = _run(_spec_decode, args, statics, key)
    gens = _results(state, lens, g_max, speculative=True)
    _check_finite(gens)
    return BatchResult(gens, secs, csecs)


def check_compatible(target: Target, drafter: Drafter) -> None:
    """Refuses a drafter built for another target.

    Raises:
      DSparkInputError: vocab size, hidden size, depth/tapped layers or weights
        fingerprint differ between the drafter's recorded target and ``target``.
    """
    t, d = target.cfg, drafter.cfg
    if d.vocab_size != t.vocab_size:
        raise DSparkInputError(
            f"drafter was trained for a vocabulary of {d.vocab_size} tokens but the target has {t.vocab_size}")
    if d.hidden_size != t.hidden_size:
        raise DSparkInputError(
            f"drafter expects target hidden size {d.hidden_size} but the target has {t.hidden_size}")
    if d.target_num_layers != t.num_layers or max(d.taps) >= t.num_layers:
        raise DSparkInputError(
            f"drafter taps layers {list(d.taps)} of a {d.target_num_layers}-layer target but the "
            f"target has {t.num_layers} layers")
    fp = getattr(target, "fingerprint", "")
    if d.target_fingerprint and fp and d.target_fingerprint != fp:
        raise DSparkInputError(
            f"drafter was trained for target '{d.target_name}' (weights {d.target_fingerprint}) but "
            f"these target weights are {fp}: train a drafter for this target")
