"""The serving engine's device programs: one step, the drafter catch-up, insert and row move,
each a pure function over pytrees, compiled once per shape by the engine
(:class:`dspark_jax.serving.engine.device.EngineDevice`) into its bounded :class:`ProgramCache`
(prefill's programs, one-shot and chunked, are :mod:`dspark_jax.serving.engine.chunk_programs`).

One step, one jitted function, no host round-trip inside (paper Section 7;
docs/design.md#serving and docs/design.md#verification): pack the anchors and the chosen number of drafts of
every row -> one target pass -> sample the target's token at every packed position -> accept
(Gumbel-coupled: :func:`dspark_jax.decoding.verifier.verify_coupled_packed`; rejection
sampling: :func:`dspark_jax.decoding.verifier.verify_rejection_packed`) -> write target/drafter
caches -> draft the NEXT block of every row (:func:`dspark_jax.decoding.round.draft_tokens`,
skipped under ``lax.cond`` when the scheduler says drafting does not pay). Keys come from
:mod:`dspark_jax.decoding.round` (:func:`~dspark_jax.decoding.round.token_keys`), shared with
the single-request loops.
Everything variable (active rows, verification lengths, drafting, logit bias, logprobs) is a
mask or a runtime scalar, so a program compiles once per ``(rows, tokens)`` bucket. Runtime
inputs travel as small pytrees (:class:`StepInputs`, :class:`InsertInputs`) whose leaves, in
field order, are the compiled program's parameters (their paths name the HLO parameters); the
static shape of a step is a :class:`StepSpec`.

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
The paper's mode (docs/design.md#verification): drafts are drawn with independent
keys (``fold_in(fold_in(request_key, t), 2)``), each drafted block keeps its q
(``[num_slots, block_size, V]`` on the device), and a speculative step scatters the target's p of
the packed tokens to a ``[R, block_size + 1, V]`` grid and calls :func:`dspark_jax.decoding.verifier.verify`
with one key per row and anchor position ``P`` (``fold_in(fold_in(request_key, P), 1)``;
anchors strictly increase, so no round reuses noise). Output law: exactly plain sampling
(tested in ``tests/unit/decoding/test_verifier.py`` with the same law tests as coupled draws), but not
token-for-token plain decoding with the seed; acceptance ``1 - TV(p, q)``, higher at T > 0.
Plain (non-speculative) steps sample as coupled mode does. Greedy output is identical in both.
Online calibration observes the acceptance of the mode in use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.compile_cache import LRUCache
from dspark_jax.decoding.round import draft_tokens, rejection_round_keys, token_keys
from dspark_jax.decoding.verifier import verify_coupled_packed, verify_rejection_packed
from dspark_jax.models.layers import KVCache
from dspark_jax.models.sampling import SamplingArrays, logits_are_finite, process_logits
from dspark_jax.serving.engine.state import CACHE_FIELDS, DecodeState, PackedTokens, PrefixArrays

__all__ = [
    "ContextWrite",
    "DraftInputs",
    "InsertInputs",
    "ProgramCache",
    "StepInputs",
    "StepSpec",
    "apply_bias",
    "catchup_program",
    "insert_program",
    "move_program",
    "step_program",
]


# ------------------------------------------------------------------------------ building blocks


def apply_bias(logits, row, pos, ids, val, until):
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


def maybe_bias(use_bias, logits, row, pos, st):
    """:func:`apply_bias` under ``lax.cond``: free (one executable) when no row uses it."""
    return jax.lax.cond(use_bias, lambda x: apply_bias(x, row, pos, st[0], st[1], st[2]), lambda x: x, logits)


class DraftInputs(NamedTuple):
    """What drafting the next block of ``R`` rows reads (a pytree; :func:`draft`).

    Attributes:
      anchors / pos: ``[R]`` int32 each row's last confirmed token and its position.
      keys: ``[R, 2]`` uint32 the rows' PRNG keys.
      samp: the rows' :class:`~dspark_jax.models.sampling.SamplingArrays`.
      bias: the rows' ``(ids, val, until)`` ``[R, NB]`` bias tables; use_bias: ``[]`` bool, apply
        them.
    """

    anchors: Any
    pos: Any
    keys: Any
    samp: SamplingArrays
    bias: Any
    use_bias: Any


class ContextWrite(NamedTuple):
    """Packed tokens whose drafter context K/V a program writes (:func:`write_context`):
    ``features [K, F]`` (tapped), ``row [K]`` and ``pos [K]`` int32 (``pos < 0``: padding)."""

    features: Any
    row: Any
    pos: Any


def draft(target, drafter, inp: DraftInputs, dk, dv, mode):
    """Next block for every row of ``inp`` (:func:`dspark_jax.decoding.round.draft_tokens`) over the
    drafter context ``dk`` / ``dv``: ``[R, G]`` tokens, raw confidence logits and, in rejection
    mode, ``[R, G, V]`` q (else None).

    Draft position ``k`` predicts the token after position ``pos + k``, drawn with the
    per-position keys of :func:`~dspark_jax.decoding.round.draft_step_keys` (coupled: the key
    the target samples that token with, shared Gumbel noise; rejection: an independent one).
    The rows' logit bias (``bias = (ids, val, until)``) is added to the base logits, i.e. to
    q's logits (the Markov correction is additive), exactly as to the target's.
    """
    anchors, pos, keys, samp, bias, use_bias = inp
    r_ = anchors.shape[0]

    def adjust(logits, dpos):
        b = bias
        if drafter.cfg.draft_vocab_size:  # the table holds target ids; a draft vocabulary's logits are indexed by N
            b_ids, b_val, b_until = b
            d_ids = drafter.draft_index(b_ids)
            inside = d_ids < drafter.cfg.draft_vocab_size  # ids outside are never drafted anyway
            b = (jnp.where(inside, d_ids, 0), jnp.where(inside, b_val, 0.0), b_until)
        rows = jnp.broadcast_to(jnp.arange(r_, dtype=jnp.int32)[:, None], dpos.shape)
        return maybe_bias(use_bias, logits, rows, dpos, b)

    d = draft_tokens(target, drafter, anchors, pos, KVCache(dk, dv), keys, samp, step_keys=mode, adjust_logits=adjust)
    return d.tokens.astype(jnp.int32), d.confidence_logit, (d.probs if mode == "rejection" else None)


def write_context(drafter, ctx: ContextWrite, dk, dv):
    """Writes the drafter context K/V of ``ctx``'s ``[K]`` packed tokens into ``dk`` / ``dv``
    (``pos < 0``: padding, nothing written); returns the new ``(dk, dv)``."""
    cache = drafter.write_context(KVCache(dk, dv), ctx.features, ctx.row, ctx.pos)
    return cache.k, cache.v


def logprobs(raw_logits, emitted, n_top: int):
    """Target logprobs (raw mode): ``log_softmax`` of the raw logits ``[K, V]``, the emitted
    tokens' ``[K]`` logprobs and the ``n_top`` most likely ``(ids, logprobs)`` ``[K, n_top]``."""
    lsm = jax.nn.log_softmax(raw_logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lsm, jnp.maximum(emitted, 0)[:, None], axis=-1)[:, 0]
    top_v, top_i = jax.lax.top_k(lsm, n_top)
    return chosen, top_v, top_i.astype(jnp.int32)


# ------------------------------------------------------------------------------ the step


class _Packed(NamedTuple):
    """The ``[K]`` packed tokens of a step: row ``r`` holds its anchor and its first ``ell[r]``
    drafts at columns ``0 .. ell[r]``; ``pos == -1`` marks padding."""

    act: jax.Array  # [R] bool active rows
    n: jax.Array  # [R] int32 packed tokens per row (0 when inactive)
    row: jax.Array  # [K] int32
    valid: jax.Array  # [K] bool
    col: jax.Array  # [K] int32
    anchor: jax.Array  # [R] int32
    p0: jax.Array  # [R] int32 anchor positions
    drafts: jax.Array  # [R, G'] int32
    tok: jax.Array  # [K] int32
    pos: jax.Array  # [K] int32


def _pack(st: DecodeState, ell, active, r_: int, k_: int, width: int, block_size: int) -> _Packed:
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
        tok = jnp.where(col == 0, tok, drafts[row, jnp.clip(col - 1, 0, block_size - 1)])
    pos = jnp.where(valid, p0[row] + col, -1)
    return _Packed(act, n, row, valid, col, anchor, p0, drafts, tok, pos)


def _verify_packed(st: DecodeState, pk: _Packed, probs, prow, *, width: int, spec: StepSpec):
    """``(ypad [R, G'+1], acc [R])``: the target's token at every packed position of each row
    (-1 where nothing was packed) and the number of accepted drafts (``width``: the packed
    columns per row, 1 in a plain step)."""
    r_, block_size, mode = spec.rows, spec.block_size, spec.mode
    gp = max(block_size, 1)
    if width > 1 and mode == "rejection":
        # Rejection sampling: one round key per row and anchor position, independent of the
        # draft keys (fold_in(., 2)) and of every other round (anchor positions increase).
        res = verify_rejection_packed(
            lambda: rejection_round_keys(st.key[:r_], pk.p0),  # derived after the grid, as always
            pk.drafts[:, :block_size],
            st.qprob[:r_],
            probs,
            prow,
            pk.col,
            pk.n - 1,
        )
        return res.tokens, res.num_accepted
    # Coupled draws: the target's own sample at every packed position with plain decoding's
    # key; drafts were drawn with the same keys.
    keys = token_keys(st.key[:r_][pk.row], jnp.maximum(pk.pos, 0))
    lengths = pk.n - 1 if width > 1 else None
    # Greedy rows' distributions are one-hots (process_logits), whose draw is the argmax: when
    # every active row is greedy no noise is drawn (padding tokens' draws are dropped).
    all_greedy = jnp.all(~pk.act | (st.temperature[:r_] <= 0.0))
    drafts = pk.drafts[:, :block_size]
    return verify_coupled_packed(keys, probs, prow, pk.col, drafts, lengths, width=gp + 1, all_greedy=all_greedy)


def _packed_logprobs(want_lp, raw_logits, ypad, pk: _Packed, prow, r_: int, gp: int, n_top: int):
    """Raw target logprobs of every emitted token on the ``[R, G'+1]`` grid (zeros unless
    ``want_lp``)."""

    def lp_on(_):
        c, tv, ti = logprobs(raw_logits, ypad[pk.row, pk.col], n_top)
        return (
            jnp.zeros((r_, gp + 1), jnp.float32).at[prow, pk.col].set(c, mode="drop"),
            jnp.zeros((r_, gp + 1, n_top), jnp.float32).at[prow, pk.col].set(tv, mode="drop"),
            jnp.zeros((r_, gp + 1, n_top), jnp.int32).at[prow, pk.col].set(ti, mode="drop"),
        )

    def lp_off(_):
        return (
            jnp.zeros((r_, gp + 1), jnp.float32),
            jnp.zeros((r_, gp + 1, n_top), jnp.float32),
            jnp.zeros((r_, gp + 1, n_top), jnp.int32),
        )

    # Logprobs cost a log-softmax and a top-k over V per packed token: only when some row
    # asked (lax.cond: one executable, nothing computed otherwise).
    return jax.lax.cond(want_lp, lp_on, lp_off, None)


def _upkeep_and_draft(target, drafter, st, pk, ctx: ContextWrite, nxt: DraftInputs, new_q, draft_next, mode):
    """Writes the drafter context of the packed tokens (``ctx``) and drafts every active row's
    next block (under ``lax.cond`` on ``draft_next``; ``nxt``: the rows' new anchors, without
    their keys, read from ``st`` only when drafting; ``new_q``: the rows' current q or None).
    Returns ``(dk, dv, draft, conf, q)``."""
    r_ = pk.act.shape[0]
    dk, dv = write_context(drafter, ctx, st.dk, st.dv)

    def do_draft(_):
        t, z, q = draft(target, drafter, nxt._replace(keys=st.key[:r_]), dk[:, :r_], dv[:, :r_], mode)
        q = None if q is None else jnp.where(pk.act[:, None, None], q, new_q)
        return jnp.where(pk.act[:, None], t, pk.drafts), jnp.where(pk.act[:, None], z, st.conf[:r_]), q

    new_draft, new_conf, new_q = jax.lax.cond(draft_next, do_draft, lambda _: (pk.drafts, st.conf[:r_], new_q), None)
    return dk, dv, new_draft, new_conf, new_q


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The static shape of a step program (one compiled program per value).

    Attributes:
      rows / tokens: the bucket ``(R, K)``; ``K == R`` is a plain step.
      block_size: block size; mode: ``"coupled"`` or ``"rejection"`` verification; n_top: logprob
        alternatives.
    """

    rows: int
    tokens: int
    block_size: int
    mode: str = "coupled"
    n_top: int = 20


class StepInputs(NamedTuple):
    """The runtime inputs of one step (a pytree; its leaves are the step's parameters).

    Attributes:
      ell: ``[B]`` int32 drafts verified per row; active: ``[B]`` bool.
      draft_next / use_bias / want_lp: ``[]`` bool flags (draft the next block; apply the bias
        tables; compute logprobs).
    """

    ell: Any
    active: Any
    draft_next: Any
    use_bias: Any
    want_lp: Any


def step_program(t_state, d_state, st: DecodeState, inp: StepInputs, *, t_graph, d_graph, spec: StepSpec):
    """One engine step over the first ``spec.rows`` rows with ``spec.tokens`` packed tokens.

    Args:
      t_state / d_state: the target's / drafter's NNX state (``d_graph`` None: no drafter
        upkeep, the drafter-less engine's program).
      st: :class:`DecodeState` (donated).
      inp: :class:`StepInputs`; spec: :class:`StepSpec` (static).
    Returns:
      ``(new state, (ypad [R, G'+1] int32, acc [R] int32, finite [R] bool, conf [R, G'] f32,
      (logprob [R, G'+1], top values, top ids [R, G'+1, n_top])))``.
    """
    ell, active, draft_next, use_bias, want_lp = inp
    rows, tokens, block_size, mode, n_top = spec.rows, spec.tokens, spec.block_size, spec.mode, spec.n_top
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    r_, k_ = rows, tokens
    # Tokens per row: the anchor and up to block_size drafts, and never more than the budget
    # (a 1-row engine verifying 2 drafts attends over a [1, 3] grid, not [1, block_size + 1]).
    width = 1 if k_ == r_ else min(block_size + 1, k_)
    pk = _pack(st, ell, active, r_, k_, width, block_size)
    taps = drafter.cfg.taps if drafter is not None else ()
    out = target.forward_packed(
        pk.tok, pk.row, pk.col, pk.pos, KVCache(st.tk, st.tv), num_rows=r_, width=width, taps=taps
    )

    bias = (st.bias_ids[:r_], st.bias_val[:r_], st.bias_until[:r_])
    samp_r = SamplingArrays(st.temperature[:r_], st.top_k[:r_], st.top_p[:r_])
    samp_k = SamplingArrays(*(a[pk.row] for a in samp_r))
    probs = process_logits(maybe_bias(use_bias, out.logits, pk.row, pk.pos, bias), samp_k)
    prow = jnp.where(pk.valid, pk.row, r_)
    gp = max(block_size, 1)
    bad = (~logits_are_finite(out.logits)).astype(jnp.int32)
    finite = jnp.zeros((r_,), jnp.int32).at[prow].max(bad, mode="drop") == 0

    ypad, acc = _verify_packed(st, pk, probs, prow, width=width, spec=spec)
    acc = jnp.where(pk.act, acc, 0)
    new_anchor = jnp.where(pk.act, jnp.take_along_axis(ypad, acc[:, None], 1)[:, 0], pk.anchor)
    new_pos = jnp.where(pk.act, pk.p0 + acc + 1, pk.p0)
    lp = _packed_logprobs(want_lp, out.logits, ypad, pk, prow, r_, gp, n_top)

    dk, dv, new_draft, new_conf = st.dk, st.dv, pk.drafts, st.conf[:r_]
    new_q = st.qprob[:r_] if st.qprob is not None else None
    if drafter is not None:
        ctx = ContextWrite(out.features, prow, pk.pos)
        nxt = DraftInputs(new_anchor, new_pos, None, samp_r, bias, use_bias)
        dk, dv, new_draft, new_conf, new_q = _upkeep_and_draft(
            target, drafter, st, pk, ctx, nxt, new_q, draft_next, mode
        )

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


# ------------------------------------------------------------------------------ other programs


def catchup_program(
    t_state, d_state, st: DecodeState, packed: PackedTokens, *, t_graph, d_graph, rows: int, width: int
) -> DecodeState:
    """Rebuilds the drafter context KV of skipped positions (see :meth:`Engine._catch_up`).

    ``packed``: :class:`~dspark_jax.serving.engine.state.PackedTokens` of ``K = rows * width``
    slots, up to ``width`` already-confirmed tokens per row. The target cache already holds
    every position below each row's anchor, so one packed target pass with taps gives the same
    features those tokens had; their (recomputed, identical) target keys/values are written
    back in place.
    """
    tok, row, col, pos = packed
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state)
    out = target.forward_packed(
        tok, row, col, pos, KVCache(st.tk, st.tv), num_rows=rows, width=width, taps=drafter.cfg.taps
    )
    dk, dv = write_context(drafter, ContextWrite(out.features, row, pos), st.dk, st.dv)
    return st._replace(tk=out.cache.k, tv=out.cache.v, dk=dk, dv=dv)


class InsertInputs(NamedTuple):
    """Where and how a prefilled request is inserted (a pytree; its leaves are the insert
    program's parameters after the state and the prefix).

    Attributes:
      row: ``[]`` int32 decode row; pos: ``[]`` int32 its anchor's position (the prompt length);
      temperature / top_p: ``[]`` float32; top_k: ``[]`` int32; bias: the ``(ids, val, until)``
      ``[NB]`` bias table.
    """

    row: Any
    pos: Any
    temperature: Any
    top_k: Any
    top_p: Any
    bias: tuple


def insert_program(st: DecodeState, pre: PrefixArrays, inp: InsertInputs) -> DecodeState:
    """Writes a prefilled request (``pre``) into row ``inp.row`` (its anchor at ``inp.pos``)."""
    row, pos, temperature, top_k, top_p, (bias_ids, bias_val, bias_until) = inp
    z = jnp.int32(0)

    def put(cache, part):
        return (
            None if cache is None else jax.lax.dynamic_update_slice(cache, part.astype(cache.dtype), (z, row, z, z, z))
        )

    return DecodeState(
        tk=put(st.tk, pre.tk),
        tv=put(st.tv, pre.tv),
        dk=put(st.dk, pre.dk),
        dv=put(st.dv, pre.dv),
        anchor=st.anchor.at[row].set(pre.token),
        pos=st.pos.at[row].set(pos),
        key=st.key.at[row].set(pre.key),
        temperature=st.temperature.at[row].set(temperature),
        top_k=st.top_k.at[row].set(top_k),
        top_p=st.top_p.at[row].set(top_p),
        draft=st.draft.at[row].set(pre.draft),
        conf=st.conf.at[row].set(pre.conf),
        bias_ids=st.bias_ids.at[row].set(bias_ids),
        bias_val=st.bias_val.at[row].set(bias_val),
        bias_until=st.bias_until.at[row].set(bias_until),
        qprob=None if st.qprob is None else st.qprob.at[row].set(pre.qprob),
    )


def move_program(st: DecodeState, src, dst) -> DecodeState:
    """Copies row ``src`` of every field into row ``dst`` (freeing a slot moves the last
    active row into the hole). The row axis is found by field name: 1 for the KV caches
    (``[L, B, S, kvh, hd]``), 0 for everything else."""

    def mv(x, axis) -> Any:
        if x is None:
            return None
        part = jax.lax.dynamic_slice_in_dim(x, src, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(x, part, dst, axis)

    return type(st)(**{f: mv(x, 1 if f in CACHE_FIELDS else 0) for f, x in st._asdict().items()})


# ------------------------------------------------------------------------------ compiled programs


class ProgramCache(LRUCache):
    """The engine's least-recently-used cache of compiled executables: a
    :class:`~dspark_jax.decoding.compile_cache.LRUCache` (``get`` / ``put``) that also gives
    engine signatures small ids (:meth:`intern`).

    Args:
      max_size: executables kept (>= 1); the least recently used one is dropped beyond it
        (it is compiled again if needed). The default is generous: an engine compiles about
        ``row buckets x (token budgets + 2) + 2 x prefill buckets + 1`` programs per policy.

    Raises:
      ValueError: ``max_size < 1``.
    """

    def __init__(self, max_size: int = 512):
        super().__init__(int(max_size))
        self._signatures: dict[Hashable, int] = {}

    @property
    def max_size(self) -> int:
        """Executables kept at most (``maxsize``)."""
        return self.maxsize

    def intern(self, signature: Hashable) -> int:
        """A small id for an engine signature (hashed once, not at every lookup)."""
        return self._signatures.setdefault(signature, len(self._signatures))
