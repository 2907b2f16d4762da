"""Serving engine: continuous batching with lossless, throughput-scheduled speculative decoding.

The shape of a JAX serving engine (JetStream style): :meth:`Engine.prefill` a request,
:meth:`Engine.insert` it into a free decode slot, :meth:`Engine.generate` one step for all
active slots, :meth:`Engine.free` a slot. DESIGN.md "Pipeline" (serve), "Verification" and
"Scheduler"; paper Section 7.

Usage::

    from dspark_jax.api import load_target, load_drafter
    from dspark_jax.serving.engine import Engine, Request, SamplingParams

    target, tok = load_target("stories260k")
    drafter, _ = load_drafter("runs/stories260k/export")
    eng = Engine(target, drafter, num_slots=8, cache_len=512, policy="dspark")
    eng.warmup()                                  # compiles every bucket, profiles SPS
    req = Request(tok.encode("Once upon a time"), SamplingParams(temperature=0.8, seed=1), "r0")
    eng.insert(eng.prefill(req), eng.free_slots()[0])
    text_ids = []
    while eng.active_slots():
        for out in eng.generate():                # StepOutput per slot with new tokens
            text_ids += out.token_ids
    print(tok.decode(text_ids), eng.metrics()["mean_accepted_length"])

Static shapes
-------------
``num_slots`` decode rows and ``cache_len`` cache positions are fixed. The target's and the
drafter's KV caches (``[L, num_slots, cache_len, kvh, hd]``) and all per-row state live on the
device between steps and are donated to every step. Logical slots (what callers see) map to
physical rows; active requests are kept in rows ``0..n-1`` (freeing a slot moves the last
active row into the hole), so a step only touches the first ``R`` rows, ``R`` the smallest
row bucket (powers of two and ``num_slots``) holding them. A step is compiled per bucket
``(R, K)``: ``K == R`` is a plain step (every row verifies only its anchor), ``K > R`` a
speculative step over ``K`` packed tokens (``rows[i]``, ``positions[i]`` per token; queries are
scattered into an ``[R, gamma + 1]`` grid for attention so each row reads only its own cache,
see :meth:`dspark_jax.models.target.Target.forward_packed`). Everything variable (which rows are
active, verification lengths, how many packed tokens are real, whether to draft) is a mask or
a runtime scalar, so after :meth:`Engine.warmup` no step recompiles, whatever the prompt
lengths (prefill pads to power-of-two buckets), budgets or set of active requests.

One step, one jitted function, no host round-trip inside: pack the anchors and the chosen
number of drafts of every row -> one target pass -> sample the target's token at every packed
position -> accept -> write target/drafter caches -> draft the NEXT block of every row (one
backbone pass + ``lax.scan`` Markov sampler; skipped under ``lax.cond`` when the scheduler
says drafting does not pay). The host then reads back, once, the emitted tokens and the next
block's raw confidence logits, and runs the (numpy) scheduler for the next step. The host
never sees draft token values before they are verified, so every policy is non-anticipating
by construction (:mod:`dspark_jax.decoding.scheduler`).

Drafter suspension
------------------
A step also writes the drafter's context keys/values of every verified token (from the
target's tapped hidden states), so that drafting can resume at any step. When the policy has
not drafted for ``suspend_after`` consecutive steps (the throughput-aware policies stop
drafting when it does not pay; ``plain`` never drafts), plain steps drop that upkeep and run
the drafter-less engine's program, so a non-drafting engine costs what plain decoding costs.
The host keeps every request's confirmed tokens; when drafting resumes, a catch-up pass
re-runs the skipped tokens through the target (packed, taps on, the target cache already
holds their context) and writes their drafter context before the step, which then drafts
exactly as with continuous upkeep.

Exactness (Gumbel-coupled verification, ``verification="coupled"``, the default)
----------------------------------------------------------------------------------
The token after position ``t`` of a request is ``sample(fold_in(request_key, t), p_t)``, the
same key derivation as :func:`dspark_jax.decoding.speculative.generate_autoregressive`
(``request_key = PRNGKey(seed)``), where ``sample`` is a Gumbel-max draw and ``p_t`` the
target's processed distribution (temperature/top-k/top-p). The drafter draws its draft for the
same position with the SAME key (``markov.sample_block(step_keys=...)``), i.e. with the same
Gumbel noise. Verification samples the target's own token ``y_j`` at every packed position
``P + j`` of a row and accepts draft ``x_{j+1}`` iff ``x_{j+1} == y_j`` (and all earlier ones
were accepted); the first mismatch emits ``y_j`` (the correction), full acceptance emits
``y_l`` (the bonus). By induction every emitted token equals the target's Gumbel-max sample
given the true prefix: accepted drafts equal it by the acceptance test, and the correction or
bonus is it. So the output is, token for token, plain autoregressive sampling with that seed,
whatever the verification lengths, the policy, the batch-mates or the slot, at any
temperature/top-k/top-p. (In floating point this holds up to rounding differences between
matmul shapes, which can only flip exact near-ties.) The draft acceptance rate under this
coupling is ``P(x == y)`` for shared Gumbel noise rather than ``1 - TV(p, q)``. The
acceptance test itself is :func:`dspark_jax.decoding.verifier.coupled_accept`.

Rejection-sampling verification (``verification="rejection"``)
---------------------------------------------------------------
The paper's mode (DESIGN.md "Verification (lossless)"): drafts are drawn with independent
keys (``fold_in(fold_in(request_key, t), 2)``), each drafted block keeps its q
(``[num_slots, gamma, V]`` on the device), and a speculative step scatters the target's p of
the packed tokens to a ``[R, gamma + 1, V]`` grid and calls :func:`dspark_jax.decoding.verifier.verify`
with one key per row and anchor position ``P`` (``fold_in(fold_in(request_key, P), 1)``;
anchors strictly increase, so no round reuses noise). Output law: exactly plain sampling
(tested in ``tests/test_verifier.py`` with the same law tests as coupled draws), but not
token-for-token plain decoding with the seed; acceptance ``1 - TV(p, q)``, higher at T > 0.
Plain (non-speculative) steps sample as coupled mode does. Greedy output is identical in both.
Online calibration observes the acceptance of the mode in use.

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

Drafter kinds: DSpark / DFlash drafters (:class:`~dspark_jax.drafters.dspark.Drafter`). Eagle3
(:class:`~dspark_jax.drafters.eagle.EagleDrafter`, autoregressive over its own cache) is refused at
construction with a :class:`DSparkInputError`; evaluate it with :mod:`dspark_jax.decoding.speculative`.

Finish handling lives in the engine: EOS ids (the target's plus ``eos_token_ids``) and each
request's ``stop_token_ids`` end it with ``"stop"`` (the stop token is included, tokens drafted
after it are dropped), ``max_tokens`` / the context end with ``"length"`` (verification lengths
are capped so a step never runs past them), non-finite logits with ``"error"``. A finished
slot is released by the engine at the end of the :meth:`Engine.generate` call that reports it
(calling :meth:`Engine.free` on it afterwards is a harmless no-op).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import scheduler as sch
from dspark_jax.decoding.online_calibration import OnlineCalibrator
from dspark_jax.decoding.sps import SPSTable, profile_buckets
from dspark_jax.decoding.verifier import coupled_accept, verify
from dspark_jax.drafters.base import BlockDrafter, check_compatible
from dspark_jax.drafters.dspark import Drafter
from dspark_jax.drafters.markov import sample_block
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.models.layers import KVCache
from dspark_jax.models.sampling import SamplingArrays, logits_are_finite, process_logits, sample
from dspark_jax.models.target import Target

__all__ = ["Engine", "Prefix", "Request", "SamplingParams", "StepOutput", "parse_policy"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_log = logging.getLogger("dspark_jax.serving.engine")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
      temperature: >= 0; 0 is greedy.
      top_k: >= 0; 0 is off.
      top_p: in (0, 1]; 1 is off.
      seed: PRNG seed in the int32 range (same meaning as ``decode.generate_*(seed=...)``).
      max_tokens: >= 1, generated tokens at most.
      stop_token_ids: extra ids that end the request (EOS ids are added by the engine).
      logit_bias: ``((token_id, bias), ...)``: ``bias`` is added to the raw logit of
        ``token_id`` before temperature / top-k / top-p, identically for the target's p and
        the drafter's q (so verification stays lossless); at most ``Engine.max_logit_bias``
        entries, finite biases (a repeated id: the last entry wins).
      logprobs: None (off) or ``n`` in ``[0, 20]``: every emitted token comes with its
        logprob and the ``n`` most likely (id, logprob) alternatives. Logprobs are the
        TARGET's ``log_softmax`` of its RAW logits at that position (vLLM's default "raw"
        mode: before logit_bias / min_tokens / temperature / top-k / top-p), never the
        drafter's.
      min_tokens: EOS ids and ``stop_token_ids`` are masked out of sampling (logit -inf, as
        vLLM does) and cannot end the request before ``min_tokens`` tokens were generated;
        ``<= max_tokens``.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
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

    ``conf_logit`` (``[gamma]`` raw confidence logits of the first drafted block) is None when
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


class _State(NamedTuple):
    tk: jax.Array  # [L, B, S, kvh, hd] target keys
    tv: jax.Array
    dk: Any  # [N, B, S, kvh, hd] drafter context keys (None without drafter)
    dv: Any
    anchor: jax.Array  # [B] int32 last confirmed token (not yet in the target cache)
    pos: jax.Array  # [B] int32 its position
    key: jax.Array  # [B, 2] uint32 request keys
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] f32
    draft: jax.Array  # [B, G'] int32 next block's drafts (G' = max(gamma, 1))
    conf: jax.Array  # [B, G'] f32 their raw confidence logits
    # Sparse additive logit bias (logit_bias and min_tokens' stop masking), applied to the
    # logits predicting the token after position ``pos`` iff ``pos < bias_until``:
    bias_ids: jax.Array  # [B, NB] int32 token ids (padding: id 0, until INT32_MIN)
    bias_val: jax.Array  # [B, NB] f32 additive bias (-inf masks)
    bias_until: jax.Array  # [B, NB] int32
    qprob: Any  # [B, G, V] f32 q of the drafts (rejection mode only, else None)


class _PrefixArrays(NamedTuple):
    tk: jax.Array
    tv: jax.Array
    dk: Any
    dv: Any
    key: jax.Array
    token: jax.Array
    draft: jax.Array
    conf: jax.Array
    qprob: Any  # [G, V] (rejection mode) or None


def parse_policy(policy: str, gamma: int) -> tuple[str, float | int | None]:
    """Parses a policy string.

    Args:
      policy: ``"plain"``, ``"fixed:G"`` (``1 <= G <= gamma``), ``"threshold:C"``
        (``0 <= C <= 1``), ``"greedy"`` or ``"dspark"``.
      gamma: the drafter's block size (0 without a drafter: only ``"plain"``).
    Returns:
      ``(name, argument)``.
    Raises:
      DSparkInputError: unknown policy, bad argument, or a speculative policy without drafter.
    """
    if not isinstance(policy, str):
        raise DSparkInputError(f"policy must be a string, got {policy!r}")
    name, _, arg = policy.strip().partition(":")
    name = name.lower()
    if name == "plain" and not arg:
        return "plain", None
    if name not in ("fixed", "threshold", "greedy", "dspark") or (name in ("greedy", "dspark") and arg):
        raise DSparkInputError(f"unknown policy {policy!r}: use plain, fixed:G, threshold:C, greedy or dspark")
    if gamma < 1:
        raise DSparkInputError(f"policy {policy!r} needs a drafter; without one use 'plain'")
    if name == "fixed":
        try:
            g = int(arg)
        except ValueError:
            raise DSparkInputError(f"policy {policy!r}: fixed:G needs an integer G") from None
        if not 1 <= g <= gamma:
            raise DSparkInputError(f"policy {policy!r}: G must be in [1, {gamma}] for this drafter")
        return "fixed", g
    if name == "threshold":
        try:
            c = float(arg)
        except ValueError:
            raise DSparkInputError(f"policy {policy!r}: threshold:C needs a number C") from None
        if not 0.0 <= c <= 1.0:
            raise DSparkInputError(f"policy {policy!r}: C must be in [0, 1]")
        return "threshold", c
    return name, None


# ------------------------------------------------------------------------------ device code


def _fold(keys: jax.Array, pos: jax.Array) -> jax.Array:
    """``[..., 2]`` keys, ``[...]`` positions -> ``fold_in(key, pos)`` elementwise."""
    flat_k = keys.reshape(-1, 2)
    out = jax.vmap(jax.random.fold_in)(flat_k, pos.reshape(-1).astype(jnp.uint32))
    return out.reshape(pos.shape + (2,))


def _apply_bias(logits, row, pos, ids, val, until):
    """Adds the sparse per-row logit bias to ``logits [..., V]``.

    ``row`` / ``pos`` ``[...]`` (the shape of ``logits`` without V): the row of each
    distribution and the position whose NEXT token it predicts; ``ids / val / until``
    ``[R, NB]``. Entry ``e`` of row ``r`` adds ``val[r, e]`` to logit ``ids[r, e]`` iff
    ``pos < until[r, e]`` (``logit_bias``: until = INT32_MAX; min_tokens' stop masking:
    ``-inf`` until the position of the ``min_tokens``-th generated token). Padding entries
    never apply (until = INT32_MIN) and add exactly 0.
    """
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    r, p = row.reshape(-1), pos.reshape(-1)
    on = p[:, None] < until[r]
    add = jnp.where(on, val[r], 0.0).astype(flat.dtype)
    flat = flat.at[jnp.arange(flat.shape[0])[:, None], ids[r]].add(add)
    return flat.reshape(shape)


def _maybe_bias(use_bias, logits, row, pos, st):
    """:func:`_apply_bias` under ``lax.cond``: free (one executable) when no row uses it."""
    return jax.lax.cond(use_bias, lambda x: _apply_bias(x, row, pos, st[0], st[1], st[2]), lambda x: x, logits)


def _draft(target, drafter, anchors, pos, keys, samp, dk, dv, bias, use_bias, mode):
    """Next block for every row: ``[R, G]`` tokens, raw confidence logits and, in rejection
    mode, ``[R, G, V]`` q (else None).

    Draft position ``k`` predicts the token after position ``pos + k``. Coupled mode draws it
    with the key the target samples that token with (``fold_in(request_key, pos + k)``, shared
    Gumbel noise); rejection mode with an independent key (``fold_in(that, 2)``). The rows'
    logit bias (``bias = (ids, val, until)``) is added to the base logits, i.e. to q's logits
    (the Markov correction is additive), exactly as to the target's.
    """
    g = drafter.cfg.gamma
    r_ = anchors.shape[0]
    block = drafter.draft_block(target, anchors, pos, KVCache(dk, dv))
    dpos = pos[:, None] + jnp.arange(g, dtype=jnp.int32)
    if drafter.cfg.draft_vocab_size:  # the table holds target ids; a draft vocabulary's logits are indexed by N
        b_ids, b_val, b_until = bias
        d_ids = drafter.draft_index(b_ids)
        inside = d_ids < drafter.cfg.draft_vocab_size  # ids outside are never drafted anyway
        bias = (jnp.where(inside, d_ids, 0), jnp.where(inside, b_val, 0.0), b_until)
    block = block._replace(
        logits=_maybe_bias(
            use_bias, block.logits, jnp.broadcast_to(jnp.arange(r_, dtype=jnp.int32)[:, None], dpos.shape), dpos, bias
        )
    )
    step_keys = _fold(jnp.broadcast_to(keys[:, None], (r_, g, 2)), dpos)
    if mode == "rejection":
        step_keys = _fold(step_keys, jnp.full(dpos.shape, 2, jnp.int32))
    d = sample_block(drafter, block, anchors, keys, samp, step_keys=step_keys)
    return d.tokens.astype(jnp.int32), d.confidence_logit, (d.probs if mode == "rejection" else None)


def _write_context(drafter, features, row, pos, dk, dv):
    """Writes the drafter context K/V of ``[K]`` packed tokens (tapped ``features [K, F]``) at
    ``(row, pos)``; ``pos < 0`` marks padding (nothing written)."""
    cache = drafter.write_context(KVCache(dk, dv), features, row, pos)
    return cache.k, cache.v


def _logprobs(raw_logits, emitted, n_top: int):
    """Target logprobs (raw mode): ``log_softmax`` of the raw logits ``[K, V]``, the emitted
    tokens' ``[K]`` logprobs and the ``n_top`` most likely ``(ids, logprobs)`` ``[K, n_top]``."""
    lsm = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, jnp.maximum(emitted, 0)[:, None], axis=-1)[:, 0]
    top_v, top_i = jax.lax.top_k(lsm, n_top)
    return chosen, top_v, top_i.astype(jnp.int32)


def _step_impl(
    t_state,
    d_state,
    st: _State,
    ell,
    active,
    draft_next,
    use_bias,
    want_lp,
    *,
    t_graph,
    d_graph,
    rows: int,
    tokens: int,
    gamma: int,
    mode: str = "coupled",
    n_top: int = 20,
):
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    r_, k_ = rows, tokens
    width = 1 if k_ == r_ else gamma + 1
    act = active[:r_]
    n = jnp.where(act, 1 + jnp.clip(ell[:r_], 0, width - 1), 0)
    ends = jnp.cumsum(n)
    starts = ends - n
    i = jnp.arange(k_, dtype=jnp.int32)
    row = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1), r_ - 1).astype(jnp.int32)
    valid = i < ends[-1]
    col = jnp.where(valid, i - starts[row], 0)
    anchor, p0 = st.anchor[:r_], st.pos[:r_]
    drafts = st.draft[:r_]
    tok = anchor[row]
    if width > 1:
        tok = jnp.where(col == 0, tok, drafts[row, jnp.clip(col - 1, 0, gamma - 1)])
    pos = jnp.where(valid, p0[row] + col, -1)
    taps = drafter.cfg.taps if drafter is not None else ()
    out = target.forward_packed(tok, row, col, pos, KVCache(st.tk, st.tv), num_rows=r_, width=width, taps=taps)

    bias = (st.bias_ids[:r_], st.bias_val[:r_], st.bias_until[:r_])
    samp_r = SamplingArrays(st.temperature[:r_], st.top_k[:r_], st.top_p[:r_])
    samp_k = SamplingArrays(*(a[row] for a in samp_r))
    probs = process_logits(_maybe_bias(use_bias, out.logits, row, pos, bias), samp_k)
    prow = jnp.where(valid, row, r_)
    gp = max(gamma, 1)
    bad = (~logits_are_finite(out.logits)).astype(jnp.int32)
    finite = jnp.zeros((r_,), jnp.int32).at[prow].max(bad, mode="drop") == 0

    if width > 1 and mode == "rejection":
        # Rejection sampling (verifier.verify): p on the [R, G+1] grid; one round key per
        # row and anchor position, independent of the draft keys (fold_in(., 2)) and of
        # every other round (anchor positions strictly increase).
        p_grid = jnp.zeros((r_, gamma + 1, probs.shape[-1]), jnp.float32).at[prow, col].set(probs, mode="drop")
        vkeys = _fold(_fold(st.key[:r_], p0), jnp.ones((r_,), jnp.int32))
        res = verify(vkeys, drafts[:, :gamma], st.qprob[:r_], p_grid, n - 1)
        ypad, acc = res.tokens, res.num_accepted
    else:
        # Coupled draws (verifier.coupled_accept): the target's own sample at every packed
        # position with plain decoding's key; drafts were drawn with the same keys.
        keys = _fold(st.key[:r_][row], jnp.maximum(pos, 0))
        y = sample(keys, probs)
        ypad = jnp.full((r_, gp + 1), -1, jnp.int32).at[prow, col].set(y, mode="drop")
        if width > 1:
            acc = coupled_accept(drafts[:, :gamma], ypad, n - 1).num_accepted
        else:
            acc = jnp.zeros((r_,), jnp.int32)
    acc = jnp.where(act, acc, 0)
    new_anchor = jnp.where(act, jnp.take_along_axis(ypad, acc[:, None], 1)[:, 0], anchor)
    new_pos = jnp.where(act, p0 + acc + 1, p0)

    def lp_on(_):
        c, tv, ti = _logprobs(out.logits, ypad[row, col], n_top)
        return (
            jnp.zeros((r_, gp + 1), jnp.float32).at[prow, col].set(c, mode="drop"),
            jnp.zeros((r_, gp + 1, n_top), jnp.float32).at[prow, col].set(tv, mode="drop"),
            jnp.zeros((r_, gp + 1, n_top), jnp.int32).at[prow, col].set(ti, mode="drop"),
        )

    def lp_off(_):
        return (
            jnp.zeros((r_, gp + 1), jnp.float32),
            jnp.zeros((r_, gp + 1, n_top), jnp.float32),
            jnp.zeros((r_, gp + 1, n_top), jnp.int32),
        )

    # Logprobs cost a log-softmax and a top-k over V per packed token: only when some row
    # asked (lax.cond: one executable, nothing computed otherwise).
    lp = jax.lax.cond(want_lp, lp_on, lp_off, None)

    dk, dv, new_draft, new_conf = st.dk, st.dv, drafts, st.conf[:r_]
    new_q = st.qprob[:r_] if st.qprob is not None else None
    if drafter is not None:
        dk, dv = _write_context(drafter, out.features, prow, pos, dk, dv)

        def do_draft(_):
            t, z, q = _draft(
                target, drafter, new_anchor, new_pos, st.key[:r_], samp_r, dk[:, :r_], dv[:, :r_], bias, use_bias, mode
            )
            q = None if q is None else jnp.where(act[:, None, None], q, new_q)
            return jnp.where(act[:, None], t, drafts), jnp.where(act[:, None], z, st.conf[:r_]), q

        new_draft, new_conf, new_q = jax.lax.cond(draft_next, do_draft, lambda _: (drafts, st.conf[:r_], new_q), None)

    new_st = st._replace(
        tk=out.cache.k,
        tv=out.cache.v,
        dk=dk,
        dv=dv,
        anchor=st.anchor.at[:r_].set(new_anchor),
        pos=st.pos.at[:r_].set(new_pos),
        draft=st.draft.at[:r_].set(new_draft),
        conf=st.conf.at[:r_].set(new_conf),
        qprob=st.qprob if (st.qprob is None or drafter is None) else st.qprob.at[:r_].set(new_q),
    )
    return new_st, (ypad, acc, finite, new_conf, lp)


def _catchup_impl(t_state, d_state, st: _State, tok, row, col, pos, *, t_graph, d_graph, rows: int, width: int):
    """Rebuilds the drafter context KV of skipped positions (see :meth:`Engine._catch_up`).

    ``tok/row/col/pos`` ``[rows * width]`` pack up to ``width`` already-confirmed tokens per
    row (``pos == -1``: padding). The target cache already holds every position below each
    row's anchor, so one packed target pass with taps gives the same features those tokens
    had; their (recomputed, identical) target keys/values are written back in place.
    """
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    out = target.forward_packed(
        tok, row, col, pos, KVCache(st.tk, st.tv), num_rows=rows, width=width, taps=drafter.cfg.taps
    )
    dk, dv = _write_context(drafter, out.features, row, pos, st.dk, st.dv)
    return st._replace(tk=out.cache.k, tv=out.cache.v, dk=dk, dv=dv)


def _prefill_impl(
    t_state,
    d_state,
    tokens,
    prompt_len,
    seed,
    temperature,
    top_k,
    top_p,
    do_draft,
    do_context,
    bias_ids,
    bias_val,
    bias_until,
    *,
    t_graph,
    d_graph,
    gamma: int,
    mode: str = "coupled",
    n_top: int = 20,
):
    """Prefill of one request: caches, the first token (biased like every later one), its
    raw target logprobs (one row: always computed, cheap) and optionally the first block."""
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    p_len = tokens.shape[1]
    pos = jnp.arange(p_len, dtype=jnp.int32)[None]
    key = jax.random.PRNGKey(seed)
    taps = drafter.cfg.taps if drafter is not None else ()
    out = target(tokens, pos, target.init_cache(1, p_len), taps=taps, logit_index=prompt_len[None] - 1)
    samp = SamplingArrays(temperature[None], top_k[None], top_p[None])
    bias = (bias_ids[None], bias_val[None], bias_until[None])
    zero = jnp.zeros((1,), jnp.int32)
    logits = _apply_bias(out.logits, zero, prompt_len[None] - 1, *bias)
    tok = sample(
        jax.random.fold_in(key, (prompt_len - 1).astype(jnp.uint32))[None], process_logits(logits, samp)
    ).astype(jnp.int32)
    lp = _logprobs(out.logits, tok, n_top)
    finite = logits_are_finite(out.logits)[0]
    gp = max(gamma, 1)
    dk = dv = None
    draft, conf = jnp.zeros((1, gp), jnp.int32), jnp.zeros((1, gp), jnp.float32)
    q = jnp.zeros((1, gamma, target.cfg.vocab_size), jnp.float32) if (mode == "rejection" and gamma) else None
    if drafter is not None:
        empty = drafter.init_cache(1, p_len)
        # The drafter context is skipped (lax.cond, one executable) while the drafter is
        # suspended; drafting implies context.
        dc = jax.lax.cond(
            do_context | do_draft,
            lambda _: drafter.extend_cache(empty, out.features, jnp.where(pos < prompt_len, pos, -1)),
            lambda _: empty,
            None,
        )
        dk, dv = dc.k, dc.v
        # Drafting the first block costs a drafter pass plus gamma LM-head rows; skipped (under
        # lax.cond, one executable) while the scheduler is not drafting.
        draft, conf, q = jax.lax.cond(
            do_draft,
            lambda _: _draft(
                target, drafter, tok, prompt_len[None], key[None], samp, dk, dv, bias, jnp.bool_(True), mode
            ),
            lambda _: (draft, conf, q),
            None,
        )
    return (
        _PrefixArrays(out.cache.k, out.cache.v, dk, dv, key, tok[0], draft[0], conf[0], None if q is None else q[0]),
        finite,
        lp,
    )


def _insert_impl(
    st: _State, pre: _PrefixArrays, row, pos, temperature, top_k, top_p, bias_ids, bias_val, bias_until
) -> _State:
    z = jnp.int32(0)

    def put(cache, part):
        return (
            None if cache is None else jax.lax.dynamic_update_slice(cache, part.astype(cache.dtype), (z, row, z, z, z))
        )

    return _State(
        put(st.tk, pre.tk),
        put(st.tv, pre.tv),
        put(st.dk, pre.dk),
        put(st.dv, pre.dv),
        st.anchor.at[row].set(pre.token),
        st.pos.at[row].set(pos),
        st.key.at[row].set(pre.key),
        st.temperature.at[row].set(temperature),
        st.top_k.at[row].set(top_k),
        st.top_p.at[row].set(top_p),
        st.draft.at[row].set(pre.draft),
        st.conf.at[row].set(pre.conf),
        st.bias_ids.at[row].set(bias_ids),
        st.bias_val.at[row].set(bias_val),
        st.bias_until.at[row].set(bias_until),
        None if st.qprob is None else st.qprob.at[row].set(pre.qprob),
    )


def _move_impl(st: _State, src, dst) -> _State:
    def mv(x, axis):
        if x is None:
            return None
        part = jax.lax.dynamic_slice_in_dim(x, src, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(x, part, dst, axis)

    return _State(*(mv(x, 1 if i < 4 else 0) for i, x in enumerate(st)))


# Compiled executables shared by engines with identical models and shapes (tests build
# several engines over one model; a server builds one).
_COMPILED: dict[Any, Any] = {}


@dataclasses.dataclass
class _Slot:
    request: Request
    row: int | None
    prompt_len: int
    length: int  # confirmed tokens (prompt + generated)
    end: int  # the request ends when length reaches this
    stops: frozenset
    pending: list
    done: str | None = None  # finished at prefill
    z: np.ndarray | None = None  # raw confidence logits of the block verified next
    hist: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=3))
    tokens: list = dataclasses.field(default_factory=list)  # confirmed tokens by position
    stale_from: int | None = None  # drafter context missing from this position on (None: current)
    min_tokens: int = 0  # stops cannot end the request before this many generated tokens
    has_bias: bool = False  # the request has logit_bias entries
    n_lp: int | None = None  # SamplingParams.logprobs
    pending_lp: list = dataclasses.field(default_factory=list)  # logprobs of ``pending``

    def biased(self) -> bool:
        """Whether a step must apply this row's bias table (logit_bias, or min_tokens masking
        still active at the anchor position: ``length - prompt_len`` tokens generated)."""
        return self.has_bias or self.length - self.prompt_len < self.min_tokens


def _is_int(x) -> bool:
    """An integer value (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _lp_entry(chosen, top_v, top_i, n: int) -> tuple[float, list[tuple[int, float]]]:
    """One token's ``(logprob, [(id, logprob)] * n)`` from device arrays."""
    return float(chosen), [(int(top_i[m]), float(top_v[m])) for m in range(n)]


def _serving_mesh(mesh):
    """``None`` / a :class:`jax.sharding.Mesh` / a spec string -> ``None`` or a mesh whose
    non-``model`` axes have size 1.

    Raises:
      DSparkInputError: bad spec, or ``data``/``fsdp`` larger than 1.
    """
    if mesh is None or (isinstance(mesh, str) and not mesh.strip()):
        return None
    if not isinstance(mesh, jax.sharding.Mesh):
        try:
            spec = shd.parse_mesh(mesh)
            if "model" not in spec and -1 not in spec.values():
                spec["model"] = -1
            mesh = shd.make_mesh(spec)
        except ValueError as e:
            raise DSparkInputError(str(e)) from None
    extra = {a: n for a, n in dict(mesh.shape).items() if a != "model" and n > 1}
    if extra:
        raise DSparkInputError(
            f"the engine shards over 'model' only (tensor parallel); mesh "
            f"{shd.describe(mesh)} also splits {', '.join(extra)}: use mesh=model:N"
        )
    return mesh


def _pow2_upto(limit: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v < limit:
        out.append(v)
        v *= 2
    return out + [limit]


class Engine:
    """Continuous-batching speculative decoding engine (see the module docstring).

    Args:
      target: the target model.
      drafter: a DSpark/DFlash drafter for it (None: only the ``"plain"`` policy).
      num_slots: decode slots (concurrent requests).
      cache_len: KV cache positions per slot (prompt + generated tokens must fit).
      policy: ``"plain"``, ``"fixed:G"``, ``"threshold:C"``, ``"greedy"`` or ``"dspark"``
        (see :mod:`dspark_jax.decoding.scheduler`).
      buckets: packed-token budgets of speculative steps (default 4, 8, 16, 32, 64, 128);
        for ``R`` rows the compiled budgets are ``R`` (plain step) and
        ``min(k, R * (gamma + 1))`` for every ``k > R`` here (``fixed:G`` uses exactly
        ``R * (G + 1)``).
      sps_table: an :class:`SPSTable` (or a path to one); reused when it was measured for
        this device, model, drafter and shape and covers every bucket, else re-profiled.
      eos_token_ids: extra ids that end every request (the target's EOS ids always do).
      seed_calibration: start online calibration from the drafter's offline temperatures
        (:attr:`Drafter.calibration`) instead of ones.
      profile_iters: timed iterations per bucket when profiling SPS.
      calibration_window: observations per position kept by online calibration.
      calibration_lr: its learning rate (0 freezes the temperatures).
      row_buckets: compiled row counts (default powers of two and ``num_slots``; must end
        at ``num_slots``).
      prefill_buckets: compiled prompt lengths (default powers of two from 16 and
        ``cache_len``); the largest bounds the prompt length.
      suspend_after: after this many consecutive steps in which the policy chose not to
        draft, plain steps stop keeping the drafter context current (they become exactly a
        drafter-less engine's step); when drafting resumes, the skipped positions are caught
        up first (:meth:`_catch_up`, one packed target pass per ``gamma + 1`` skipped tokens
        per row). ``None`` never suspends.
      verification: ``"coupled"`` (default: draft and target share per-position noise, a
        draft is accepted iff it equals the target's own sample, so every response equals
        plain decoding with its seed) or ``"rejection"`` (the paper's rejection sampling,
        higher acceptance at T > 0, same output law; keeps each drafted block's q,
        ``[num_slots, gamma, V]`` float32, on the device). DESIGN.md "Verification
        (lossless)"; :mod:`dspark_jax.decoding.verifier`.
      max_logit_bias: capacity of ``SamplingParams.logit_bias`` per request (static: the
        per-row bias table has ``max_logit_bias + max_stop_ids`` entries).
      max_stop_ids: capacity for EOS + ``stop_token_ids`` of a request with ``min_tokens``.
      mesh: tensor-parallel serving (DESIGN.md "Scale: a device mesh"): a
        :class:`jax.sharding.Mesh` or a spec such as ``"model:8"``
        (:func:`dspark_jax.models.sharding.make_mesh`). The target's and the drafter's weights are
        sharded over ``model`` by :func:`dspark_jax.models.sharding.tree_shardings` (heads, MLP,
        vocabulary), both KV caches over their KV heads (replicated where ``model`` does not
        divide them), the small per-row state replicated; every program is compiled with
        these output shardings, so the state keeps its layout between steps and no step
        recompiles. Outputs equal the one-device engine's (up to float rounding in sharded
        reductions). ``None`` (default): no mesh, the default device, as before.

    Raises:
      DSparkInputError: bad sizes, unknown policy or verification mode, a drafter for
        another target, a drafter kind the engine cannot serve (eagle3), or a mesh with
        ``data``/``fsdp`` axes larger than 1 (the engine shards over ``model`` only).
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        num_slots: int = 8,
        cache_len: int = 1024,
        policy: str = "dspark",
        buckets=None,
        sps_table=None,
        eos_token_ids=(),
        seed_calibration: bool = True,
        profile_iters: int = 3,
        calibration_window: int = 2048,
        calibration_lr: float = 0.05,
        row_buckets=None,
        prefill_buckets=None,
        suspend_after: int | None = 16,
        verification: str = "coupled",
        max_logit_bias: int = 300,
        max_stop_ids: int = 64,
        mesh=None,
    ):
        if verification not in ("coupled", "rejection"):
            raise DSparkInputError(f"verification must be 'coupled' or 'rejection', got {verification!r}")
        if drafter is not None and not isinstance(drafter, BlockDrafter):
            raise DSparkInputError(
                f"the serving engine cannot serve a {getattr(drafter.cfg, 'variant', type(drafter).__name__)} "
                "drafter (it drafts autoregressively from its own cache); serve a dspark/dflash drafter, "
                "or evaluate eagle3 with dspark_jax.decoding.speculative / dspark_jax.eval"
            )
        if max_logit_bias < 0 or max_stop_ids < 0:
            raise DSparkInputError(
                f"max_logit_bias and max_stop_ids must be >= 0, got {max_logit_bias}, {max_stop_ids}"
            )
        self.verification = verification
        self.max_logit_bias, self.max_stop_ids = int(max_logit_bias), int(max_stop_ids)
        self._nb = max(1, self.max_logit_bias + self.max_stop_ids)
        if num_slots < 1:
            raise DSparkInputError(f"num_slots must be >= 1, got {num_slots}")
        if cache_len < 2:
            raise DSparkInputError(f"cache_len must be >= 2, got {cache_len}")
        if drafter is not None:
            check_compatible(target, drafter)
        self.target, self.drafter = target, drafter
        self.num_slots, self.cache_len = int(num_slots), int(cache_len)
        self.gamma = drafter.cfg.gamma if drafter is not None else 0
        self.eos_ids = tuple(
            sorted(set(int(t) for t in target.cfg.eos_ids) | set(int(t) for t in (eos_token_ids or ())))
        )
        self.ladder = sorted(set(int(b) for b in (buckets if buckets is not None else (4, 8, 16, 32, 64, 128))))
        if any(b < 1 for b in self.ladder):
            raise DSparkInputError(f"token buckets must be >= 1, got {self.ladder}")
        self.profile_iters = int(profile_iters)
        self.row_buckets = sorted(set(int(r) for r in row_buckets)) if row_buckets else _pow2_upto(self.num_slots)
        if self.row_buckets[0] < 1 or self.row_buckets[-1] != self.num_slots:
            raise DSparkInputError(
                f"row buckets must be >= 1 and end at num_slots={self.num_slots}, got {self.row_buckets}"
            )
        self.prefill_buckets = (
            sorted(set(int(b) for b in prefill_buckets))
            if prefill_buckets
            else [b for b in _pow2_upto(self.cache_len, 16) if b <= self.cache_len]
        )
        if self.prefill_buckets[0] < 1 or self.prefill_buckets[-1] > self.cache_len:
            raise DSparkInputError(
                f"prefill buckets must be in [1, cache_len={self.cache_len}], got {self.prefill_buckets}"
            )
        if suspend_after is not None and suspend_after < 0:
            raise DSparkInputError(f"suspend_after must be >= 0 or None, got {suspend_after}")
        self.suspend_after = suspend_after
        self._idle_steps = 0
        self._was_suspended = False
        self._decision: dict | None = None  # the dspark/greedy policy's last drafting decision
        self._examples: dict[int, _PrefixArrays] = {}
        self._t_graph, self._t_state = nnx.split(target)
        self._d_graph, self._d_state = nnx.split(drafter) if drafter is not None else (None, None)
        self.mesh = _serving_mesh(mesh)
        if self.mesh is not None:
            self._t_state = shd.place(self._t_state, shd.tree_shardings(self._t_state, self.mesh, target.cfg))
            if drafter is not None:
                self._d_state = shd.place(self._d_state, shd.tree_shardings(self._d_state, self.mesh, drafter.cfg))
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), (self._t_state, self._d_state))
        self._n_top = min(20, target.cfg.vocab_size)
        # Without a drafter both modes compile to the same programs (plain steps only).
        self._sig = (
            self._t_graph,
            self._d_graph,
            str(shapes),
            self.num_slots,
            self.cache_len,
            verification if drafter is not None else "",
            self._nb,
            self._n_top,
            self.mesh,
        )
        init = drafter.calibration if (drafter is not None and seed_calibration) else None
        self.calibrator = OnlineCalibrator(max(self.gamma, 1), init, window=calibration_window, lr=calibration_lr)
        self._state = self._init_state()
        self._slots: dict[int, _Slot] = {}
        self._row_slot: list[int] = []
        self._compiled: dict[Any, Any] = {}
        self._compiles = 0
        self._warm = False
        self._sps_cache: dict = {}
        self.sps_table: SPSTable | None = None
        self._given_table = (
            SPSTable.load(sps_table) if isinstance(sps_table, (str,)) or hasattr(sps_table, "__fspath__") else sps_table
        )
        self._reset_metrics()
        self.set_policy(policy)

    # ------------------------------------------------------------------ configuration

    def set_policy(self, policy: str) -> None:
        """Switches the verification-length policy (compiles/profiles missing buckets lazily).

        Raises:
          DSparkInputError: bad policy string.
        """
        self.policy_name, self.policy_arg = parse_policy(policy, self.gamma)
        self.policy = policy
        self._sps_cache = {}
        self._warm = False
        # Whether the last step drafted; prefill drafts the first block only then (the
        # throughput-aware policies stop drafting when it does not pay).
        self._drafting = self.policy_name != "plain"

    def budgets(self, rows: int) -> list[int]:
        """Compiled token budgets for ``rows`` rows under the current policy (``rows`` first)."""
        g = self.gamma
        if self.policy_name == "plain" or g == 0:
            return [rows]
        if self.policy_name == "fixed":
            return [rows, rows * (self.policy_arg + 1)]
        top = rows * (g + 1)
        return sorted({rows} | {min(k, top) for k in self.ladder if k > rows})

    def buckets(self) -> list[tuple[int, int]]:
        """Every ``(rows, tokens)`` bucket of the current policy."""
        return [(r, k) for r in self.row_buckets for k in self.budgets(r)]

    def _meta(self) -> dict:
        dev = jax.devices()[0]
        return {
            "device_kind": f"{dev.platform}:{dev.device_kind}",
            "model": self.target.cfg.name,
            "fingerprint": getattr(self.target, "fingerprint", ""),
            "drafter": None
            if self.drafter is None
            else f"{self.drafter.cfg.variant}-g{self.gamma}-n{self.drafter.cfg.num_layers}",
            "dtype": str(self.target.dtype.__name__ if hasattr(self.target.dtype, "__name__") else self.target.dtype),
            "num_slots": self.num_slots,
            "gamma": self.gamma,
            "cache_len": self.cache_len,
            **({} if self.mesh is None else {"mesh": shd.describe(self.mesh)}),
        }

    # ------------------------------------------------------------------ slots

    @property
    def num_active(self) -> int:
        return len(self._slots)

    def free_slots(self) -> list[int]:
        """Free logical slots, ascending."""
        return [s for s in range(self.num_slots) if s not in self._slots]

    def active_slots(self) -> list[int]:
        """Occupied logical slots, ascending (including ones finished but not yet reported)."""
        return sorted(self._slots)

    # ------------------------------------------------------------------ state & compilation

    def _init_state(self) -> _State:
        t, b, s = self.target, self.num_slots, self.cache_len
        tc = t.init_cache(b, s)
        dk = dv = None
        if self.drafter is not None:
            dc = self.drafter.init_cache(b, s)
            dk, dv = dc.k, dc.v
        gp = max(self.gamma, 1)
        nb = self._nb
        q = (
            jnp.zeros((b, self.gamma, t.cfg.vocab_size), jnp.float32)
            if (self.verification == "rejection" and self.gamma)
            else None
        )
        st = _State(
            tc.k,
            tc.v,
            dk,
            dv,
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b, 2), jnp.uint32),
            jnp.ones((b,), jnp.float32),
            jnp.zeros((b,), jnp.int32),
            jnp.ones((b,), jnp.float32),
            jnp.zeros((b, gp), jnp.int32),
            jnp.zeros((b, gp), jnp.float32),
            jnp.zeros((b, nb), jnp.int32),
            jnp.zeros((b, nb), jnp.float32),
            jnp.full((b, nb), _INT32_MIN, jnp.int32),
            q,
        )
        if self.mesh is not None:
            st = shd.place(st, self._state_shardings(_State))
        return st

    def _state_shardings(self, kind):
        """Shardings of a :class:`_State` or :class:`_PrefixArrays` (``kind``) on the mesh: KV
        caches over their KV heads (``[L, B, S, kvh, hd]``), everything else replicated (and
        None where the state holds None: no drafter, or no q outside rejection mode)."""
        mesh, repl = self.mesh, shd.replicated(self.mesh)

        def cache(cfg):
            return shd.cache_sharding(mesh, cfg.num_kv_heads, (1, 1, 1, cfg.num_kv_heads, cfg.head_dim))

        t = cache(self.target.cfg)
        d = cache(self.drafter.cfg) if self.drafter is not None else None
        rest = {f: repl for f in kind._fields[4:]}
        if not (self.verification == "rejection" and self.gamma):
            rest["qprob"] = None
        return kind(t, t, d, d, **rest)

    def _out_shardings(self, kind):
        """``out_shardings`` of the program ``kind`` (``step``, ``prefill``, ...)."""
        repl = shd.replicated(self.mesh)
        if kind in ("step", "bare_step"):
            return self._state_shardings(_State), repl
        if kind == "prefill":  # (prefix arrays, finite, logprobs)
            return self._state_shardings(_PrefixArrays), repl, repl
        return self._state_shardings(_State)  # catchup, insert, move

    def _compile(self, key, fn, args, donate=()):
        full = self._sig + key
        exe = _COMPILED.get(full)
        if exe is None:
            kw = {} if self.mesh is None else {"out_shardings": self._out_shardings(key[0])}
            exe = jax.jit(fn, donate_argnums=donate, **kw).lower(*args).compile()
            _COMPILED[full] = exe
            self._compiles += 1
        self._compiled[key] = exe
        return exe

    def _step_exe(self, rows: int, tokens: int):
        key = ("step", rows, tokens)
        exe = self._compiled.get(key)
        if exe is None:
            fn = partial(
                _step_impl,
                t_graph=self._t_graph,
                d_graph=self._d_graph,
                rows=rows,
                tokens=tokens,
                gamma=self.gamma,
                mode=self.verification,
                n_top=self._n_top,
            )
            b = self.num_slots
            args = (
                self._t_state,
                self._d_state,
                self._state,
                np.zeros(b, np.int32),
                np.zeros(b, bool),
                np.bool_(False),
                np.bool_(False),
                np.bool_(False),
            )
            exe = self._compile(key, fn, args, donate=(2,))
        return exe

    def _bare_step_exe(self, rows: int):
        """A plain step without drafter context upkeep: the drafter-less engine's program
        (the drafter caches ride along untouched)."""
        key = ("bare_step", rows)
        exe = self._compiled.get(key)
        if exe is None:
            fn = partial(
                _step_impl,
                t_graph=self._t_graph,
                d_graph=None,
                rows=rows,
                tokens=rows,
                gamma=self.gamma,
                mode=self.verification,
                n_top=self._n_top,
            )
            b = self.num_slots
            args = (
                self._t_state,
                None,
                self._state,
                np.zeros(b, np.int32),
                np.zeros(b, bool),
                np.bool_(False),
                np.bool_(False),
                np.bool_(False),
            )
            exe = self._compile(key, fn, args, donate=(2,))
        return exe

    def _catchup_exe(self, rows: int):
        key = ("catchup", rows)
        exe = self._compiled.get(key)
        if exe is None:
            w = self.gamma + 1
            fn = partial(_catchup_impl, t_graph=self._t_graph, d_graph=self._d_graph, rows=rows, width=w)
            z = np.zeros(rows * w, np.int32)
            exe = self._compile(key, fn, (self._t_state, self._d_state, self._state, z, z, z, z), donate=(2,))
        return exe

    def _prefill_exe(self, p_len: int):
        key = ("prefill", p_len)
        exe = self._compiled.get(key)
        if exe is None:
            fn = partial(
                _prefill_impl,
                t_graph=self._t_graph,
                d_graph=self._d_graph,
                gamma=self.gamma,
                mode=self.verification,
                n_top=self._n_top,
            )
            args = (
                self._t_state,
                self._d_state,
                np.zeros((1, p_len), np.int32),
                np.int32(1),
                np.int32(0),
                np.float32(1),
                np.int32(0),
                np.float32(1),
                np.bool_(True),
                np.bool_(True),
            ) + self._no_bias()
            exe = self._compile(key, fn, args)
        return exe

    def _insert_exe(self, p_len: int, pre: _PrefixArrays):
        key = ("insert", p_len)
        exe = self._compiled.get(key)
        if exe is None:
            args = (
                self._state,
                pre,
                np.int32(0),
                np.int32(0),
                np.float32(1),
                np.int32(0),
                np.float32(1),
            ) + self._no_bias()
            exe = self._compile(key, _insert_impl, args, donate=(0,))
        return exe

    def _move_exe(self):
        exe = self._compiled.get(("move",))
        if exe is None:
            exe = self._compile(("move",), _move_impl, (self._state, np.int32(0), np.int32(0)), donate=(0,))
        return exe

    def _no_bias(self):
        """An empty per-row bias table (``ids, val, until`` ``[NB]``)."""
        nb = self._nb
        return (np.zeros(nb, np.int32), np.zeros(nb, np.float32), np.full(nb, _INT32_MIN, np.int32))

    def _run_step(self, rows, tokens, ell, active, draft_next, use_bias=False, want_lp=False):
        exe = self._step_exe(rows, tokens)
        self._state, out = exe(
            self._t_state,
            self._d_state,
            self._state,
            ell,
            active,
            np.bool_(draft_next),
            np.bool_(use_bias),
            np.bool_(want_lp),
        )
        return out

    def warmup(self) -> None:
        """Compiles every bucket (steps, prefill, insert, row moves) and makes sure an SPS
        table covers the current policy's buckets (profiling when needed). After it, no step
        recompiles."""
        for r, k in self.buckets():
            self._step_exe(r, k)
        if self.drafter is not None and self.suspend_after is not None:
            for r in self.row_buckets:
                self._bare_step_exe(r)
                self._catchup_exe(r)
        for p in self.prefill_buckets:
            if p not in self._examples:
                exe = self._prefill_exe(p)
                self._examples[p], _, _ = exe(
                    self._t_state,
                    self._d_state,
                    np.zeros((1, p), np.int32),
                    np.int32(1),
                    np.int32(0),
                    np.float32(1),
                    np.int32(0),
                    np.float32(1),
                    np.bool_(False),
                    np.bool_(False),
                    *self._no_bias(),
                )
            self._insert_exe(p, self._examples[p])
        self._move_exe()
        self._ensure_table()
        self._warm = True

    def _drafts_flags(self) -> list[bool]:
        return [False] if self.gamma == 0 else [False, True]

    def _ensure_table(self) -> None:
        if self.policy_name not in ("greedy", "dspark"):
            return
        need = self.buckets()
        for t in (self.sps_table, self._given_table):
            if t is not None and t.matches(self._meta()) and t.covers(need, self._drafts_flags()):
                self.sps_table = t
                return
        self.profile_sps()

    def profile_sps(self, iters: int | None = None) -> SPSTable:
        """Times one step of every bucket of the current policy, with and without drafting.

        Safe at any time: profiling steps run with every row inactive, so no request's state
        changes. Returns (and installs) the :class:`SPSTable`.
        """
        b = self.num_slots
        ell, active = np.zeros(b, np.int32), np.zeros(b, bool)

        def run(r, k, d):
            out = self._run_step(r, k, ell, active, d)
            jax.block_until_ready(out)

        self.sps_table = profile_buckets(
            run,
            self.buckets(),
            self._drafts_flags(),
            self._meta(),
            iters=self.profile_iters if iters is None else iters,
        )
        self._sps_cache = {}
        return self.sps_table

    # ------------------------------------------------------------------ requests

    def _validate(self, request: Request) -> None:
        ids = request.prompt_ids
        p = request.params
        cfg = self.target.cfg
        if not isinstance(p, SamplingParams):
            raise DSparkInputError("request.params must be a SamplingParams")
        if ids is None or len(ids) == 0:
            raise DSparkInputError("the prompt is empty: give at least one token")
        try:
            arr = np.asarray(ids, np.int64)
        except (TypeError, ValueError):
            raise DSparkInputError("prompt token ids must be integers") from None
        if arr.ndim != 1:
            raise DSparkInputError("prompt token ids must be a flat list of integers")
        bad = arr[(arr < 0) | (arr >= cfg.vocab_size)]
        if bad.size:
            raise DSparkInputError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {cfg.vocab_size})")
        limit = min(self.cache_len - 1, cfg.max_position - 1, self.prefill_buckets[-1])
        if len(arr) > limit:
            raise DSparkInputError(
                f"the prompt has {len(arr)} tokens but at most {limit} fit "
                f"(cache_len {self.cache_len}, model context {cfg.max_position}, "
                f"largest prefill bucket {self.prefill_buckets[-1]})"
            )
        if not (math.isfinite(p.temperature) and p.temperature >= 0):
            raise DSparkInputError(f"temperature must be a finite number >= 0, got {p.temperature}")
        if int(p.top_k) != p.top_k or p.top_k < 0:
            raise DSparkInputError(f"top_k must be an integer >= 0, got {p.top_k}")
        if not (0.0 < p.top_p <= 1.0):
            raise DSparkInputError(f"top_p must be in (0, 1], got {p.top_p}")
        if int(p.max_tokens) != p.max_tokens or p.max_tokens < 1:
            raise DSparkInputError(f"max_tokens must be an integer >= 1, got {p.max_tokens}")
        if int(p.seed) != p.seed or not _INT32_MIN <= p.seed <= _INT32_MAX:
            raise DSparkInputError(f"seed must be an integer in [{_INT32_MIN}, {_INT32_MAX}], got {p.seed}")
        try:
            [int(t) for t in p.stop_token_ids]
        except (TypeError, ValueError):
            raise DSparkInputError("stop_token_ids must be integers") from None
        self._logit_bias(p)
        n_lp = p.logprobs
        if n_lp is not None and not (_is_int(n_lp) and 0 <= n_lp <= 20):
            raise DSparkInputError(f"logprobs must be None or an integer in [0, 20], got {n_lp!r}")
        if n_lp is not None and n_lp > self._n_top:
            raise DSparkInputError(f"logprobs must be <= {self._n_top} (the vocabulary size), got {n_lp}")
        if not (_is_int(p.min_tokens) and p.min_tokens >= 0):
            raise DSparkInputError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}")
        if p.min_tokens > p.max_tokens:
            raise DSparkInputError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
        if p.min_tokens and len(self._stops(p)) > self.max_stop_ids:
            raise DSparkInputError(
                f"min_tokens with {len(self._stops(p))} EOS/stop_token_ids: at most {self.max_stop_ids} are supported"
            )

    def _stops(self, p: SamplingParams) -> frozenset:
        return frozenset(self.eos_ids) | frozenset(int(t) for t in p.stop_token_ids)

    def _logit_bias(self, p: SamplingParams) -> dict[int, float]:
        """Validated ``{token_id: bias}`` of ``p.logit_bias`` (a repeated id: last wins).

        Raises:
          DSparkInputError: not (id, bias) pairs, an id outside the vocabulary, a non-finite
            bias, or more than ``max_logit_bias`` entries.
        """
        lb = p.logit_bias
        v = self.target.cfg.vocab_size
        try:
            pairs = list(lb.items()) if isinstance(lb, dict) else [tuple(e) for e in lb]
            out = {}
            for t, b in pairs:
                if not _is_int(t) or isinstance(b, (bool, str)):
                    raise ValueError
                out[int(t)] = float(b)
        except (TypeError, ValueError):
            raise DSparkInputError(
                "logit_bias must be a sequence of (token_id, bias) pairs with integer ids and numeric biases"
            ) from None
        for t, b in out.items():
            if not 0 <= t < v:
                raise DSparkInputError(f"logit_bias token id {t} is outside the vocabulary [0, {v})")
            if not math.isfinite(b):
                raise DSparkInputError(f"logit_bias for token {t} must be finite, got {b}")
        if len(out) > self.max_logit_bias:
            raise DSparkInputError(f"logit_bias has {len(out)} entries; at most {self.max_logit_bias} are supported")
        return out

    def _bias_table(self, p: SamplingParams, prompt_len: int):
        """The request's ``(ids, val, until)`` ``[NB]`` bias table (see :func:`_apply_bias`):
        logit_bias entries (always on), then, with ``min_tokens``, every EOS / stop id at
        ``-inf`` for the positions predicting generated tokens ``0 .. min_tokens - 1``."""
        ids, val, until = self._no_bias()
        i = 0
        for t, b in self._logit_bias(p).items():
            ids[i], val[i], until[i] = t, b, _INT32_MAX
            i += 1
        if p.min_tokens:
            for t in sorted(t for t in self._stops(p) if 0 <= t < self.target.cfg.vocab_size):
                ids[i], val[i], until[i] = t, -np.inf, prompt_len + int(p.min_tokens) - 1
                i += 1
        return ids, val, until

    def prefill(self, request: Request) -> Prefix:
        """Runs the target (and drafter) over the prompt and samples the first token.

        Raises:
          DSparkInputError: empty prompt, unknown token id, prompt too long for
            ``cache_len`` / the model, or bad sampling settings.
        """
        self._validate(request)
        ids = np.asarray(request.prompt_ids, np.int32)
        n = len(ids)
        p_len = next(b for b in self.prefill_buckets if b >= n)
        buf = np.zeros((1, p_len), np.int32)
        buf[0, :n] = ids
        sp = request.params
        drafted = bool(self.gamma) and self._drafting
        context = drafted or not self._suspended()  # always True without a drafter
        bias = self._bias_table(sp, n)
        pre, finite, lp = self._prefill_exe(p_len)(
            self._t_state,
            self._d_state,
            buf,
            np.int32(n),
            np.int32(sp.seed),
            np.float32(sp.temperature),
            np.int32(sp.top_k),
            np.float32(sp.top_p),
            np.bool_(drafted),
            np.bool_(context),
            *bias,
        )
        tok, finite, conf = jax.device_get((pre.token, finite, pre.conf))
        first_lp = None
        if sp.logprobs is not None:
            c, tv, ti = jax.device_get(lp)
            first_lp = _lp_entry(c[0], tv[0], ti[0], sp.logprobs)
        return Prefix(
            request,
            n,
            p_len,
            int(tok),
            bool(finite),
            np.asarray(conf, np.float64) if drafted else None,
            pre,
            has_context=context,
            first_logprob=first_lp,
            bias=bias,
        )

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Puts a prefilled request into free logical ``slot``.

        Raises:
          DSparkInputError: slot out of range or busy, or a prefix of another engine.
        """
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.num_slots):
            raise DSparkInputError(f"slot must be in [0, {self.num_slots}), got {slot}")
        if slot in self._slots:
            raise DSparkInputError(f"slot {slot} is busy: free it first")
        if (
            not isinstance(prefix, Prefix)
            or prefix.bucket_len not in self.prefill_buckets
            or (prefix.arrays is not None and (prefix.arrays.qprob is None) != (self._state.qprob is None))
        ):
            raise DSparkInputError("insert needs a Prefix made by this engine's prefill")
        req, sp = prefix.request, prefix.request.params
        end = min(prefix.prompt_len + int(sp.max_tokens), self.target.cfg.max_position, self.cache_len)
        stops = self._stops(sp)
        rec = _Slot(
            req,
            None,
            prefix.prompt_len,
            prefix.prompt_len + 1,
            end,
            stops,
            [prefix.first_token],
            tokens=[int(t) for t in req.prompt_ids] + [prefix.first_token],
            min_tokens=int(sp.min_tokens),
            has_bias=bool(self._logit_bias(sp)),
            n_lp=sp.logprobs,
            pending_lp=[prefix.first_logprob] if sp.logprobs is not None else [],
        )
        if not prefix.finite:
            rec.done, rec.pending, rec.pending_lp = "error", [], []
        elif prefix.first_token in stops and rec.min_tokens == 0:
            rec.done = "stop"
        elif rec.length >= end:
            rec.done = "length"
        self._metrics["emitted_tokens"] += len(rec.pending)
        self._slots[int(slot)] = rec
        if rec.done is not None:
            return
        row = len(self._row_slot)
        exe = self._insert_exe(prefix.bucket_len, prefix.arrays)
        bias = prefix.bias if prefix.bias is not None else self._bias_table(sp, prefix.prompt_len)
        self._state = exe(
            self._state,
            prefix.arrays,
            np.int32(row),
            np.int32(prefix.prompt_len),
            np.float32(sp.temperature),
            np.int32(sp.top_k),
            np.float32(sp.top_p),
            *bias,
        )
        rec.row = row
        rec.z = prefix.conf_logit
        rec.stale_from = None if prefix.has_context else 0
        rec.hist.append(rec.z)
        self._row_slot.append(int(slot))

    def free(self, slot: int) -> None:
        """Releases ``slot`` (finished, cancelled, disconnected, or a stop string was hit).
        A free slot is a no-op."""
        rec = self._slots.pop(int(slot), None)
        if rec is None or rec.row is None:
            return
        last = len(self._row_slot) - 1
        if rec.row != last:
            moved = self._row_slot[last]
            self._state = self._move_exe()(self._state, np.int32(last), np.int32(rec.row))
            self._row_slot[rec.row] = moved
            self._slots[moved].row = rec.row
        self._row_slot.pop()

    # ------------------------------------------------------------------ scheduling

    def _rows_for(self, n: int) -> int:
        return next(r for r in self.row_buckets if r >= n)

    def _sps_of_total(self, rows: int, n: int, draft: bool) -> np.ndarray:
        """``[K_max + 1]`` SPS of the bucket a pass of ``t`` packed tokens runs in."""
        key = (rows, n, draft)
        arr = self._sps_cache.get(key)
        if arr is None:
            budgets = self.budgets(rows)
            arr = np.zeros(budgets[-1] + 1)
            arr[n] = self.sps_table.sps(rows, rows, draft)
            spec = budgets[1:]
            for t in range(n + 1, len(arr)):
                k = next((b for b in spec if b >= t), None)
                arr[t] = 0.0 if k is None else self.sps_table.sps(rows, k, draft)
            self._sps_cache[key] = arr
        return arr

    def _want_drafts(self, rows: int, n: int, surv_fc: np.ndarray, cap_fc: np.ndarray) -> bool:
        """Draft the next block? Compares the best forecast Theta of a drafting step with the
        Theta of a plain step (forecast survival: latest known confidences or the prior)."""
        sps_d = self._sps_of_total(rows, n, True)
        k = sch.best_budget(surv_fc, cap_fc, sps_d, self.budgets(rows))
        _, _, probs = sch.candidate_order(surv_fc, cap_fc)
        theta_d = (n + float(np.sum(probs[: k - n]))) * sps_d[k]
        theta_p = n * self.sps_table.sps(rows, rows, False)
        # Resuming from suspension first costs the catch-up passes over the skipped tokens
        # (one packed pass of the widest bucket per gamma + 1 of the longest gap): drafting
        # must win that back within a horizon of `suspend_after` steps' worth of tokens.
        catchup_s = 0.0
        if self._suspended():
            gap = max(
                (
                    rec.length - 1 - rec.stale_from
                    for rec in map(self._slots.get, self._row_slot)
                    if rec.stale_from is not None
                ),
                default=0,
            )
            w = self.gamma + 1
            catchup_s = -(-gap // w) / max(self.sps_table.sps(rows, rows * w, False), 1e-9)
        horizon = n * max(self.suspend_after or 16, 1)  # tokens the decision is made for
        draft = theta_d > theta_p and catchup_s + horizon / theta_d < horizon / theta_p
        self._decision = {
            "tokens_per_s_drafting": theta_d,
            "tokens_per_s_plain": theta_p,
            "catchup_seconds": catchup_s,
            "draft": bool(draft),
        }
        return draft

    def plan(self) -> tuple[np.ndarray, int, int, bool]:
        """The scheduler's decision for the next step, from host state only.

        Returns:
          ``(lengths [n] int32 drafts verified per active row, rows R, tokens K, draft_next)``.
          Depends on confidences and lengths only, never on draft token values (which stay
          on the device).
        """
        slots = [self._slots[s] for s in self._row_slot]
        n = len(slots)
        rows = self._rows_for(n)
        g = self.gamma
        name = self.policy_name
        if name == "plain" or g == 0:
            return np.zeros(n, np.int32), rows, rows, False
        room = np.array([min(g, rec.end - rec.length - 1) for rec in slots], np.int64).clip(0)
        has = np.array([rec.z is not None for rec in slots], bool)
        cap = np.where(has, room, 0)
        z = np.stack([rec.z if rec.z is not None else np.zeros(g) for rec in slots])
        surv = np.where(has[:, None], sch.survival(self.calibrator.confidence(z)), 0.0)
        budgets = self.budgets(rows)
        draft_next = True
        if name == "fixed":
            ell = sch.fixed_lengths(cap, self.policy_arg)
        elif name == "threshold":
            ell = sch.threshold_lengths(surv, cap, self.policy_arg)
        else:
            prior = self.calibrator.prior_survival()

            def surv_of(zz):
                return prior if zz is None else sch.survival(self.calibrator.confidence(zz))

            latest = [next((h for h in reversed(rec.hist) if h is not None), None) for rec in slots]
            fc = np.stack([surv_of(zz) for zz in latest])
            draft_next = self._want_drafts(rows, n, fc, room)
            sps = self._sps_of_total(rows, n, draft_next)
            if name == "greedy":
                ell = sch.greedy_lengths(surv, cap, sps)
            else:
                old = np.stack([surv_of(rec.hist[0] if len(rec.hist) == 3 else None) for rec in slots])
                ell, _ = sch.deployed_lengths(old, surv, cap, sps, budgets)
        total = n + int(ell.sum())
        if total == n:
            return ell.astype(np.int32), rows, rows, draft_next
        spec = budgets[1:]
        if total > spec[-1]:
            ell = sch.fill_lengths(surv, np.minimum(cap, ell), spec[-1] - n)
            total = n + int(ell.sum())
        return ell.astype(np.int32), rows, next(b for b in spec if b >= total), draft_next

    # ------------------------------------------------------------------ drafter suspension

    def _suspended(self) -> bool:
        """Whether the policy has not drafted for ``suspend_after`` consecutive steps."""
        return self.drafter is not None and self.suspend_after is not None and self._idle_steps >= self.suspend_after

    def _log_drafting_change(self) -> None:
        """One log line when drafting is suspended or resumes, with the scheduler's reason."""
        now = self._suspended()
        if now == self._was_suspended:
            return
        self._was_suspended = now
        d = self._decision or {}
        why = (
            f"expected {d.get('tokens_per_s_drafting', float('nan')):.1f} tokens/s drafting vs "
            f"{d.get('tokens_per_s_plain', float('nan')):.1f} plain (SPS table)"
        )
        if now:
            _log.info("suspending drafting after %d steps without drafts: %s", self._idle_steps, why)
        else:
            _log.info("resuming drafting: %s; catch-up %.3f s", why, d.get("catchup_seconds", 0.0))

    def _suspend_now(self, rows: int, tokens: int, draft_next: bool) -> bool:
        """Whether this step runs without drafter context upkeep (a plain step, no drafting,
        while suspended)."""
        return tokens == rows and not draft_next and self._suspended()

    def _catch_up(self) -> None:
        """Writes the drafter context of every position a suspended step skipped.

        Each active row whose context stops at ``stale_from`` gets its confirmed tokens at
        positions ``[stale_from, anchor)`` re-run through the target (packed, ``gamma + 1``
        tokens per row per pass, taps on) and their context keys/values written, so that
        drafting resumes exactly as if upkeep had never stopped. Costs about one packed
        target pass per ``gamma + 1`` skipped tokens of the longest gap.
        """
        slots = [self._slots[s] for s in self._row_slot]
        if self.drafter is None or all(rec.stale_from is None for rec in slots):
            return
        rows = self._rows_for(len(slots))
        w = self.gamma + 1
        exe = self._catchup_exe(rows)
        m = self._metrics
        while True:
            tok, row, col, pos = (np.zeros(rows * w, np.int32) for _ in range(4))
            pos -= 1
            i = 0
            for r, rec in enumerate(slots):
                if rec.stale_from is None:
                    continue
                a = rec.stale_from
                b = min(a + w, rec.length - 1)
                k = b - a
                tok[i : i + k] = rec.tokens[a:b]
                row[i : i + k], col[i : i + k], pos[i : i + k] = r, np.arange(k), np.arange(a, b)
                i += k
                rec.stale_from = b
            if i == 0:
                break
            self._state = exe(self._t_state, self._d_state, self._state, tok, row, col, pos)
            m["catchup_passes"] += 1
            m["catchup_tokens"] += i
        for rec in slots:
            rec.stale_from = None

    # ------------------------------------------------------------------ decoding

    def generate(self) -> list[StepOutput]:
        """One speculative (or plain) step for every active slot.

        Returns:
          one :class:`StepOutput` per slot that produced tokens or finished. Finished slots
          are free when this returns.
        """
        if not self._warm:
            self.warmup()
        outs: list[StepOutput] = []
        for slot in [s for s, rec in self._slots.items() if rec.row is None]:
            rec = self._slots.pop(slot)
            outs.append(
                StepOutput(
                    slot,
                    rec.request.request_id,
                    rec.pending,
                    True,
                    rec.done,
                    0,
                    0,
                    rec.pending_lp if rec.n_lp is not None else None,
                )
            )
        n = len(self._row_slot)
        if n == 0:
            return outs
        t0 = time.perf_counter()
        ell, rows, tokens, draft_next = self.plan()
        self._drafting = bool(draft_next)
        b, g = self.num_slots, self.gamma
        ell_b = np.zeros(b, np.int32)
        ell_b[:n] = ell
        active = np.zeros(b, bool)
        active[:n] = True
        if n + int(ell.sum()) > tokens or (tokens == rows and ell.any()):
            raise RuntimeError(f"scheduler plan {ell.tolist()} does not fit bucket ({rows}, {tokens})")
        recs = [self._slots[s] for s in self._row_slot]
        use_bias = any(rec.biased() for rec in recs)
        want_lp = any(rec.n_lp is not None for rec in recs)
        if self._suspend_now(rows, tokens, draft_next):
            for rec in recs:
                if rec.stale_from is None:
                    rec.stale_from = rec.length - 1
            self._state, out = self._bare_step_exe(rows)(
                self._t_state, None, self._state, ell_b, active, np.bool_(False), np.bool_(use_bias), np.bool_(want_lp)
            )
            m_bare = 1
        else:
            self._catch_up()
            out = self._run_step(rows, tokens, ell_b, active, draft_next, use_bias, want_lp)
            m_bare = 0
        self._idle_steps = 0 if (draft_next or tokens > rows) else self._idle_steps + 1
        self._log_drafting_change()
        # The logprob arrays are only read back when some row asked for them.
        ypad, acc, finite, conf = jax.device_get(out[:4])
        lpc, lpv, lpi = jax.device_get(out[4]) if want_lp else (None, None, None)
        m = self._metrics
        m["steps"] += 1
        m["step_seconds"] += time.perf_counter() - t0
        m["budget_hist"][tokens] = m["budget_hist"].get(tokens, 0) + 1
        m["rows_hist"][rows] = m["rows_hist"].get(rows, 0) + 1
        m["draft_steps"] += int(draft_next)
        m["suspended_steps"] += m_bare
        m["packed_tokens"] += n + int(ell.sum())
        verified_rows = ell > 0
        if g and verified_rows.any():
            zs = np.stack([self._slots[s].z for s, v in zip(self._row_slot, verified_rows) if v])
            self.calibrator.observe(zs, ell[verified_rows], acc[:n][verified_rows])
            self.calibrator.update()
        finished = []
        for r, slot in enumerate(list(self._row_slot)):
            rec = self._slots[slot]
            a, l_r = int(acc[r]), int(ell[r])
            new = [int(t) for t in ypad[r, : a + 1]]
            reason = None
            if not finite[r]:
                new, reason = [], "error"
            keep = len(new)
            gen = rec.length - rec.prompt_len  # tokens generated before new[0]
            for j, t in enumerate(new):
                if t in rec.stops and gen + j >= rec.min_tokens:
                    keep, reason = j + 1, "stop"
                    break
            keep = min(keep, rec.end - rec.length)
            new = new[:keep]
            rec.length += keep
            if reason is None and rec.length >= rec.end:
                reason = "length"
            n_ver = min(l_r, keep) if keep < a + 1 else l_r
            n_acc = min(a, keep)
            if l_r:
                m["drafts"] += 1
                k = np.arange(max(g, 1))
                reached = (k < l_r) & (k <= a) & (k < keep)
                m["pos_reached"] += reached
                m["pos_accepted"] += reached & (k < a)
            m["draft_tokens"] += n_ver
            m["accepted_tokens"] += n_acc
            m["emitted_tokens"] += keep
            m["round_tokens"] += keep
            m["rounds"] += 1
            rec.tokens.extend(new)
            toks = rec.pending + new
            rec.pending = []
            lps = None
            if rec.n_lp is not None:
                lps = rec.pending_lp + [_lp_entry(lpc[r, j], lpv[r, j], lpi[r, j], rec.n_lp) for j in range(keep)]
                rec.pending_lp = []
            rec.z = np.asarray(conf[r], np.float64) if (draft_next and g) else None
            rec.hist.append(rec.z)
            outs.append(StepOutput(slot, rec.request.request_id, toks, reason is not None, reason, n_ver, n_acc, lps))
            if reason is not None:
                finished.append(slot)
        for slot in finished:
            self.free(slot)
        return outs

    # ------------------------------------------------------------------ metrics

    def _reset_metrics(self) -> None:
        g = max(self.gamma, 1)
        self._metrics = {
            "steps": 0,
            "rounds": 0,
            "drafts": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "emitted_tokens": 0,
            "round_tokens": 0,
            "packed_tokens": 0,
            "draft_steps": 0,
            "step_seconds": 0.0,
            "suspended_steps": 0,
            "catchup_passes": 0,
            "catchup_tokens": 0,
            "pos_reached": np.zeros(g, np.int64),
            "pos_accepted": np.zeros(g, np.int64),
            "budget_hist": {},
            "rows_hist": {},
        }

    def reset_metrics(self) -> None:
        """Zeroes the cumulative counters (not the calibration)."""
        self._reset_metrics()

    def metrics(self) -> dict:
        """Cumulative counters (DESIGN.md "Metrics").

        Keys: ``steps`` (engine steps), ``rounds`` (request-steps: target verification passes
        summed over requests), ``drafts`` (rounds that verified >= 1 draft, vLLM's
        num_drafts), ``draft_tokens`` (verified drafts), ``accepted_tokens``,
        ``emitted_tokens`` (including first tokens from prefill), ``packed_tokens``,
        ``draft_steps``, ``step_seconds``, ``suspended_steps`` (plain steps without drafter
        context upkeep), ``catchup_passes`` / ``catchup_tokens`` (target passes and tokens that
        rebuilt skipped drafter context), ``mean_accepted_length`` (tau: tokens per round),
        ``acceptance_rate``, ``position_reached`` / ``position_accepted`` / ``position_acceptance``
        (per block position), ``budget_hist`` / ``rows_hist`` (chosen buckets),
        ``calibration`` (online temperatures, predicted vs observed: the acceptance of the
        verification mode in use), ``compiles``, ``policy``, ``verification``, ``num_active``,
        ``scheduler_decision`` (expected tokens/s drafting vs plain and the priced catch-up of
        the last dspark/greedy decision) and ``drafting_suspended``.
        """
        m = self._metrics
        reached, acc = m["pos_reached"], m["pos_accepted"]
        step_emitted = m["emitted_tokens"]
        return {
            "policy": self.policy,
            "verification": self.verification,
            "num_active": self.num_active,
            # The dspark/greedy policy's last drafting decision: expected tokens/s with and without
            # drafting (SPS table x forecast acceptance), the catch-up it priced in; None before one.
            "scheduler_decision": dict(self._decision) if self._decision else None,
            "drafting_suspended": self._suspended(),
            "steps": m["steps"],
            "rounds": m["rounds"],
            "drafts": m["drafts"],
            "draft_tokens": m["draft_tokens"],
            "accepted_tokens": m["accepted_tokens"],
            "emitted_tokens": step_emitted,
            "packed_tokens": m["packed_tokens"],
            "draft_steps": m["draft_steps"],
            "step_seconds": m["step_seconds"],
            "suspended_steps": m["suspended_steps"],
            "catchup_passes": m["catchup_passes"],
            "catchup_tokens": m["catchup_tokens"],
            # tau as decode.Generation defines it: tokens the verification rounds emitted (a stop
            # inside an accepted block cuts it) per round; the prefill token is not a round's.
            "mean_accepted_length": m["round_tokens"] / m["rounds"] if m["rounds"] else None,
            "acceptance_rate": m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else None,
            "position_reached": reached.tolist(),
            "position_accepted": acc.tolist(),
            "position_acceptance": [float(a) / r if r else None for a, r in zip(acc, reached)],
            "budget_hist": dict(sorted(m["budget_hist"].items())),
            "rows_hist": dict(sorted(m["rows_hist"].items())),
            "calibration": self.calibrator.stats(),
            "compiles": self._compiles,
        }
