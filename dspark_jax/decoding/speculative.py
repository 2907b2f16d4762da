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
from collections.abc import Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import auto_verify
from dspark_jax.decoding.verifier import verify
from dspark_jax.drafters.base import BlockDrafter, Drafter, check_compatible
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.layers import KVCache
from dspark_jax.models.sampling import SamplingArrays, logits_are_finite, process_logits, sample, sampling_arrays
from dspark_jax.models.target import Target

FINISH_RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = 0, 1, 2, 3
FINISH_NAMES = {FINISH_RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ERROR: "error"}


__all__ = [
    "BatchResult",
    "DecodeStats",
    "Generation",
    "RoundLog",
    "check_compatible",
    "check_sampling",
    "draft_tokens",
    "generate_autoregressive",
    "generate_speculative",
    "resolve_num_speculative_tokens",
]


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
    seq: jax.Array  # [B, S] int32 tokens (prompt + generated), -1 elsewhere
    length: jax.Array  # [B] confirmed tokens; the anchor is seq[length - 1]
    finish: jax.Array  # [B] FINISH_* code, 0 while running
    tcache: KVCache
    dcache: KVCache | None
    stats: DecodeStats
    step: jax.Array
    rounds: RoundLog | None = None
    auto: Any = None  # _Auto with num_speculative_tokens="auto", else None


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
        dcache = drafter.extend_cache(
            drafter.init_cache(b, cache_len),
            out.features,
            jnp.where(pos < prompt_len[:, None], pos, -1),
            target=target,
            tokens=prompt,
        )
    finite = logits_are_finite(out.logits)
    tok = sample(_row_keys(base_keys, prompt_len - 1), process_logits(out.logits, sampling))
    seq = jnp.full((b, cache_len), -1, jnp.int32)
    seq = seq.at[:, :tp].set(jnp.where(pos < prompt_len[:, None], prompt, -1))
    seq = seq.at[jnp.arange(b), prompt_len].set(tok, mode="drop")
    length = prompt_len + 1
    finish = jnp.where(
        _is_stop(tok, stop_ids),
        FINISH_STOP,
        jnp.where(length >= jnp.minimum(limit, cache_len), FINISH_LENGTH, FINISH_RUNNING),
    )
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


def draft_tokens(
    target: Target, drafter, anchors: jax.Array, anchor_pos: jax.Array, cache, keys: jax.Array, sampling: SamplingArrays
):
    """One drafting round for every row, whatever the drafter kind (its ``draft``).

    DSpark / DFlash: one parallel backbone pass then the ``lax.scan`` Markov sampler;
    eagle3: ``gamma`` autoregressive single-token steps.

    Args:
      anchors: ``[B]`` int32 last confirmed tokens; anchor_pos: ``[B]`` int32 their positions.
      cache: the drafter's context cache; keys: ``[B, 2]`` per-row draft keys.
    Returns:
      :class:`~dspark_jax.drafters.base.Draft` with ``tokens [B, gamma]`` and ``probs [B, gamma, V]``.
    """
    return drafter.draft(target, anchors, anchor_pos, cache, keys, sampling)


@partial(jax.jit, static_argnames=("t_graph", "cache_len", "max_steps"))
def _ar_decode(
    t_state, prompt, prompt_len, limit, sampling, base_keys, stop_ids, *, t_graph, cache_len: int, max_steps: int
):
    target = nnx.merge(t_graph, t_state)
    seq, length, finish, tcache, _ = _prefill(
        target, None, prompt, prompt_len, limit, sampling, base_keys, stop_ids, cache_len, ()
    )
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


class _Auto(NamedTuple):
    """Loop state of ``num_speculative_tokens="auto"`` (:mod:`dspark_jax.decoding.auto_verify`)."""

    draft_on: jax.Array  # [] bool: this round drafts
    idle: jax.Array  # [] int32 rounds since the last drafting round
    width: jax.Array  # [] int32 index of the width verified last round (for statistics)


def _verify_pass(
    target, drafter, w: int, gamma: int, s: _Loop, anchor, p, drafts, dprobs, verify_keys, ell, sampling, *, taps
):
    """Verification pass of ``w + 1`` tokens (anchor + ``w`` drafts) for every row, with the
    drafter's context written; outputs padded to ``gamma + 1`` so every width has one shape."""
    running = s.finish == FINISH_RUNNING
    offs = jnp.arange(w + 1, dtype=jnp.int32)
    vtok = jnp.concatenate([anchor[:, None], drafts[:, :w]], axis=1)
    vpos = p[:, None] + offs
    out = target(vtok, vpos, s.tcache, taps=taps)
    # Only positions that verification can read must be finite (anchor .. ell).
    finite = logits_are_finite(jnp.where((offs[None, :] <= ell[:, None])[..., None], out.logits, 0.0))
    res = verify(verify_keys, drafts[:, :w], dprobs[:, :w], process_logits(out.logits, sampling), jnp.minimum(ell, w))
    dcache = drafter.extend_cache(
        s.dcache, out.features, jnp.where(running[:, None], vpos, -1), target=target, tokens=vtok
    )
    toks = jnp.pad(res.tokens, ((0, 0), (0, gamma - w)), constant_values=-1)
    return out.cache, dcache, toks, res.num_emitted, res.num_accepted, finite


@partial(
    jax.jit, static_argnames=("t_graph", "d_graph", "cache_len", "max_steps", "record_rounds", "widths", "probe_every")
)
def _spec_decode(
    t_state,
    d_state,
    prompt,
    prompt_len,
    limit,
    sampling,
    base_keys,
    stop_ids,
    max_verify,
    costs=None,
    *,
    t_graph,
    d_graph,
    cache_len: int,
    max_steps: int,
    record_rounds: bool = False,
    widths: tuple[int, ...] | None = None,
    probe_every: int = 8,
):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    gamma = drafter.cfg.gamma
    taps = drafter.cfg.taps
    seq, length, finish, tcache, dcache = _prefill(
        target, drafter, prompt, prompt_len, limit, sampling, base_keys, stop_ids, cache_len, taps
    )
    b = prompt.shape[0]
    rounds = None
    if record_rounds:
        rounds = RoundLog(
            jnp.zeros((b, max_steps, gamma), jnp.float32),
            jnp.zeros((b, max_steps), jnp.int32),
            jnp.zeros((b, max_steps), jnp.int32),
        )
    auto = None
    if widths is not None:
        auto = _Auto(jnp.ones((), bool), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        t_verify, t_draft = costs[0], costs[1]
    init = _Loop(seq, length, finish, tcache, dcache, _zero_stats(b, gamma), jnp.zeros((), jnp.int32), rounds, auto)
    offs = jnp.arange(gamma + 1, dtype=jnp.int32)

    def cond(s: _Loop):
        return jnp.any(s.finish == FINISH_RUNNING) & (s.step < max_steps)

    def body(s: _Loop):
        running = s.finish == FINISH_RUNNING
        p = s.length - 1
        anchor = jnp.take_along_axis(s.seq, p[:, None], 1)[:, 0]
        keys = _row_keys(base_keys, p)
        draft_keys, verify_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        room = jnp.minimum(limit, cache_len) - s.length - 1
        new_auto = None
        if widths is None:
            d = draft_tokens(target, drafter, anchor, p, s.dcache, draft_keys, sampling)
            drafts, dprobs, conf, zlog = d.tokens, d.probs, d.confidence, d.confidence_logit
            # Verification length: fixed by limits only, never by draft values (non-anticipation).
            ell = jnp.where(running, jnp.clip(jnp.minimum(max_verify, room), 0, gamma), 0)
            tcache, dcache, toks, n_emit, n_acc, finite = _verify_pass(
                target, drafter, gamma, gamma, s, anchor, p, drafts, dprobs, verify_keys, ell, sampling, taps=taps
            )
        else:
            v = drafter.cfg.vocab_size

            def drafted(_):
                d = draft_tokens(target, drafter, anchor, p, s.dcache, draft_keys, sampling)
                return d.tokens, d.probs, d.confidence, d.confidence_logit

            def skipped(_):
                z = jnp.zeros((b, gamma), jnp.float32)
                return jnp.zeros((b, gamma), jnp.int32), jnp.zeros((b, gamma, v), jnp.float32), z, z

            drafts, dprobs, conf, zlog = jax.lax.cond(s.auto.draft_on, drafted, skipped, None)
            # Width from confidences only, chunk by chunk (auto_verify: non-anticipating).
            wi = jnp.where(s.auto.draft_on, auto_verify.choose_width(conf, running, widths, t_verify), 0)
            ell = jnp.where(running, jnp.clip(jnp.minimum(jnp.asarray(widths, jnp.int32)[wi], room), 0, gamma), 0)
            branches = [partial(_verify_pass, target, drafter, w, gamma, taps=taps) for w in widths]
            tcache, dcache, toks, n_emit, n_acc, finite = jax.lax.switch(
                wi, branches, s, anchor, p, drafts, dprobs, verify_keys, ell, sampling
            )
            pays = auto_verify.should_draft(conf, running, widths, t_verify, t_draft)
            idle = jnp.where(s.auto.draft_on, 0, s.auto.idle + 1)
            draft_next = jnp.where(s.auto.draft_on, pays, idle >= probe_every)
            new_auto = _Auto(draft_next, idle, wi)
        seq, length, finish, n_keep = _emit(s, toks, n_emit, limit, stop_ids, cache_len)
        finish = jnp.where(running & ~finite, FINISH_ERROR, finish)
        k = offs[:gamma][None, :]
        emitted_pos = k < n_keep[:, None]
        reached = (k < ell[:, None]) & (k <= n_acc[:, None]) & emitted_pos
        pos_acc = reached & (k < n_acc[:, None])
        # A stop inside the accepted drafts discards the rest of the block: drafts after it
        # are not counted as verified (else a perfect drafter would show acceptance < 1).
        n_verified = jnp.where(n_keep < n_emit, jnp.minimum(ell, n_keep), ell)
        n_accepted = jnp.minimum(n_acc, n_keep)
        st = s.stats
        stats = DecodeStats(
            passes=st.passes + running,
            emitted=st.emitted + n_keep,
            verified=st.verified + n_verified,
            accepted=st.accepted + n_accepted,
            reached=st.reached + reached,
            pos_accepted=st.pos_accepted + pos_acc,
        )
        rounds = s.rounds
        if rounds is not None:
            rounds = RoundLog(
                rounds.conf_logit.at[:, s.step].set(zlog),
                rounds.accepted.at[:, s.step].set(n_accepted),
                rounds.verified.at[:, s.step].set(n_verified),
            )
        return _Loop(seq, length, finish, tcache, dcache, stats, s.step + 1, rounds, new_auto)

    return jax.lax.while_loop(cond, body, init)


@dataclasses.dataclass
class Generation:
    """Result of one request.

    Attributes:
      token_ids: generated token ids (prompt excluded), stop token included.
      finish_reason: ``"stop"`` (stop/EOS token), ``"length"`` (max_new_tokens or
        context end) or ``"error"`` (non-finite logits).
      num_target_passes: target verification passes after prefill.
      tau: mean tokens emitted per target verification pass. THE definition used by
        ``generate --json``, the Python API, the server (``spec_decode.tau``) and its
        ``/metrics`` (``dspark:spec_decode_mean_accepted_length``): ``(len(token_ids) - 1) /
        num_target_passes``. The first generated token comes from prefill; each pass
        emits its accepted drafts plus the correction/bonus token, fewer when a stop (token
        or string) or the length limit ends the request inside the block (nothing after
        the stop is counted, and a pass that adds no token to the output is not a pass).
        NaN here (None in JSON outputs) when no pass ran.
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


def _prepare(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens, gamma: int, cache_len: int | None):
    cfg = target.cfg
    if not prompts:
        raise DSparkInputError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise DSparkInputError(f"prompt {i} is empty: give at least one token")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise DSparkInputError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(p) >= cfg.max_position:
            raise DSparkInputError(
                f"prompt {i} has {len(p)} tokens but the target's context is {cfg.max_position}: shorten the prompt"
            )
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
            f"cache_len={cache_len} leaves no room to generate after the longest prompt ({int(lens.max())} tokens)"
        )
    tp = min(tp, cache_len)
    prompt = np.zeros((b, tp), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    limit = np.minimum(lens.astype(np.int64) + max_new, cfg.max_position).astype(np.int32)
    return prompt, lens, limit, cache_len


def check_sampling(temperature=0.0, top_k=0, top_p=1.0) -> None:
    """Refuses sampling settings the samplers cannot honour (scalars or per-request sequences).

    Raises:
      DSparkInputError: a NaN/inf or negative temperature, a top_p outside (0, 1] (NaN
        included), or a top_k that is not an integer >= 0. One line naming the setting.
    """
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        try:
            arr = np.asarray(value, np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise DSparkInputError(f"{name} must be a number, got {value!r}") from None
        bad = arr[~np.isfinite(arr)]
        if bad.size:
            raise DSparkInputError(f"{name} must be a finite number, got {float(bad[0])}")
    t = np.asarray(temperature, np.float64).reshape(-1)
    if np.any(t < 0):
        raise DSparkInputError(f"temperature must be >= 0 (0 is greedy), got {float(t[t < 0][0])}")
    p = np.asarray(top_p, np.float64).reshape(-1)
    if np.any((p <= 0) | (p > 1)):
        raise DSparkInputError(f"top_p must be in (0, 1], got {float(p[(p <= 0) | (p > 1)][0])}")
    k = np.asarray(top_k, np.float64).reshape(-1)
    if np.any((k < 0) | (k != np.round(k))):
        raise DSparkInputError(
            f"top_k must be an integer >= 0 (0 is off), got {float(k[(k < 0) | (k != np.round(k))][0])}"
        )


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
        gens.append(
            Generation(
                token_ids=ids,
                finish_reason=FINISH_NAMES[int(finish[i])] or "length",
                num_target_passes=passes,
                tau=emitted / passes if passes else float("nan"),
                acceptance_rate=(int(st.accepted[i]) / int(st.verified[i])) if speculative and st.verified[i] else None,
                position_acceptance=[(float(a) / float(r)) if r else None for a, r in zip(acc, reached)]
                if speculative
                else [],
                num_accepted=int(st.accepted[i]),
                num_verified=int(st.verified[i]),
                position_reached=reached.tolist() if speculative else [],
                position_accepted=acc.tolist() if speculative else [],
                rounds=None
                if rl is None
                else {
                    "conf_logit": rl.conf_logit[i, :passes],
                    "accepted": rl.accepted[i, :passes],
                    "verified": rl.verified[i, :passes],
                },
            )
        )
    return gens


def _check_finite(gens: list[Generation]) -> None:
    for i, g in enumerate(gens):
        if g.finish_reason == "error":
            raise FloatingPointError(
                f"request {i}: the target produced NaN/inf logits after {len(g.token_ids)} tokens "
                "(check the weights and dtype)"
            )


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
      seed: per-request (or shared) PRNG seed.
      stop_ids: token ids that end a request (default: the target's EOS ids).
      cache_len: KV-cache length in tokens (default: just enough, rounded up).

    Returns:
      :class:`BatchResult`; seconds exclude compilation.

    Raises:
      DSparkInputError: empty prompt, unknown token id, prompt too long, NaN/inf or
        out-of-range sampling settings (:func:`check_sampling`).
      FloatingPointError: the target produced NaN/inf logits.
    """
    check_sampling(temperature, top_k, top_p)
    prompt, lens, limit, cache_len = _prepare(target, prompts, max_new_tokens, 0, cache_len)
    b = prompt.shape[0]
    stop = jnp.asarray(list(stop_ids if stop_ids is not None else target.cfg.eos_ids) or [-2], jnp.int32)
    sampling = sampling_arrays(b, temperature, top_k, top_p)
    t_graph, t_state = nnx.split(target)
    max_steps = int(np.max(limit - lens))
    args = (t_state, jnp.asarray(prompt), jnp.asarray(lens), jnp.asarray(limit), sampling, _keys(seed, b), stop)
    statics = dict(t_graph=t_graph, cache_len=cache_len, max_steps=max_steps)
    key = ("ar", prompt.shape, stop.shape, *statics.values())
    state, secs, csecs = _run(_ar_decode, args, statics, key)
    gens = _results(state, lens, 1, speculative=False)
    _check_finite(gens)
    return BatchResult(gens, secs, csecs)


_COST_TABLES: dict[Any, Any] = {}


def _cost_table(target: Target, drafter: Drafter, cache_len: int):
    """Measured once per model shapes and cache length (costs do not depend on weight values)."""
    from dspark_jax.decoding.cost_table import measure_costs

    key = (target.cfg, jnp.dtype(target.dtype).name, drafter.cfg, jnp.dtype(drafter.dtype).name, cache_len)
    if key not in _COST_TABLES:
        if len(_COST_TABLES) >= 8:  # bounded: a long-lived process sees few distinct shapes
            _COST_TABLES.pop(next(iter(_COST_TABLES)))
        _COST_TABLES[key] = measure_costs(target, drafter, cache_len=cache_len, repeats=5)
    return _COST_TABLES[key]


def resolve_num_speculative_tokens(num_speculative_tokens, gamma, block_size: int, default="auto"):
    """``num_speculative_tokens`` (int or ``"auto"``), with the deprecated ``gamma`` alias.

    Returns:
      ``"auto"`` or an int in ``[1, block_size]``.
    Raises:
      DSparkInputError: both given, or a value outside ``[1, block_size]`` / not ``"auto"``.
    """
    if gamma is not None:
        if num_speculative_tokens is not None:
            raise DSparkInputError("give num_speculative_tokens or its deprecated alias gamma, not both")
        num_speculative_tokens = gamma
    n = default if num_speculative_tokens is None else num_speculative_tokens
    if n is None:
        return block_size
    if isinstance(n, str):
        if n.strip().lower() == "auto":
            return "auto"
        try:
            n = int(n)
        except ValueError:
            raise DSparkInputError(f"num_speculative_tokens must be an integer or 'auto', got {n!r}") from None
    if isinstance(n, bool) or not 1 <= int(n) <= block_size:
        raise DSparkInputError(
            f"num_speculative_tokens (alias gamma) must be in [1, {block_size}] for this "
            f"drafter (its block size) or 'auto', got {n}"
        )
    return int(n)


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
    num_speculative_tokens: int | str | None = None,
    gamma: int | None = None,
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
      drafter: a drafter built for this target (see :func:`check_compatible`).
      num_speculative_tokens: draft tokens verified per round, ``1..drafter.cfg.gamma`` (the
        drafter's block size; drafting always produces the full block), or ``"auto"``
        (:mod:`dspark_jax.decoding.auto_verify`: per round the width among a few compiled ones that
        maximises expected tokens/s from the calibrated confidences and the measured cost
        table, 0 when drafting does not pay). Default: the block size. ``"auto"`` chooses one
        width for the whole batch and is meant for one request at a time.
      gamma: deprecated alias of ``num_speculative_tokens``.
      record_rounds: also record every round's raw confidence logits and
        accepted/verified counts (:attr:`Generation.rounds`), e.g. for
        calibration reliability; costs ``[B, max_new_tokens, gamma]`` floats.
      cost_table: :class:`~dspark_jax.decoding.cost_table.CostTable` for ``"auto"`` (default: measured
        on first use for these model shapes and cache length, a few seconds, then reused).

    Returns:
      :class:`BatchResult` with tau, acceptance and per-position acceptance.

    Raises:
      DSparkInputError: bad prompts, bad num_speculative_tokens, NaN/inf or out-of-range
        sampling settings, or a drafter for another target.
      FloatingPointError: the target produced NaN/inf logits.
    """
    check_compatible(target, drafter)
    g_max = drafter.cfg.gamma
    n_spec = resolve_num_speculative_tokens(num_speculative_tokens, gamma, g_max, default=g_max)
    check_sampling(temperature, top_k, top_p)
    prompt, lens, limit, cache_len = _prepare(target, prompts, max_new_tokens, g_max, cache_len)
    b = prompt.shape[0]
    stop = jnp.asarray(list(stop_ids if stop_ids is not None else target.cfg.eos_ids) or [-2], jnp.int32)
    sampling = sampling_arrays(b, temperature, top_k, top_p)
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter)
    max_steps = int(np.max(limit - lens))
    widths, costs = None, None
    if n_spec == "auto":
        if not isinstance(drafter, BlockDrafter):
            raise DSparkInputError(
                f"num_speculative_tokens='auto' needs a block drafter (dspark/dflash), not {drafter.cfg.variant}"
            )
        widths = auto_verify.default_widths(g_max)
        table = cost_table if cost_table is not None else _cost_table(target, drafter, cache_len)
        greedy = bool(np.all(np.asarray(sampling.temperature) <= 0))
        costs = (
            jnp.asarray(table.verify_array(widths)),
            jnp.float32(table.t_draft_greedy if greedy else table.t_draft_sampled),
        )
    args = (
        t_state,
        d_state,
        jnp.asarray(prompt),
        jnp.asarray(lens),
        jnp.asarray(limit),
        sampling,
        _keys(seed, b),
        stop,
        jnp.int32(g_max if n_spec == "auto" else n_spec),
        costs,
    )
    statics = dict(
        t_graph=t_graph,
        d_graph=d_graph,
        cache_len=cache_len,
        max_steps=max_steps,
        record_rounds=bool(record_rounds),
        widths=widths,
    )
    key = ("spec", prompt.shape, stop.shape, *statics.values())
    state, secs, csecs = _run(_spec_decode, args, statics, key)
    gens = _results(state, lens, g_max, speculative=True)
    _check_finite(gens)
    return BatchResult(gens, secs, csecs)
