"""Device programs of prefill: batched, chunked prefill and its degenerate case, one-shot
prefill (docs/design.md#serving).

One compiled ``prefill_chunk`` pass runs a fixed budget of ``T`` packed prompt tokens of up to
``P`` requests through the target over a staging area of ``P`` lanes (each a target KV row, and
the drafter's context KV row when there is a drafter, of ``S`` positions, ``S`` the largest
prefill bucket): the host (:class:`dspark_jax.serving.engine.prefill.PrefillQueue`) packs waiting
prompts FIFO into the budget and splits a long prompt across passes, so that a long prompt
never stalls the decode steps for more than one chunk. For every lane whose prompt ends in the
pass the program computes the first token at the last prompt position (sampled with the
request's key and bias, like every later token), its raw logprobs, finiteness, and the
drafter's first block with its confidences; ``prefill_extract`` then cuts the lane into
ordinary :class:`~dspark_jax.serving.engine.state.PrefixArrays` of the request's prefill bucket,
which :func:`~dspark_jax.serving.engine.step_programs.insert_program` consumes.

One-shot prefill (:meth:`dspark_jax.serving.engine.Engine.prefill`) is the same pass in its
degenerate shape (:func:`one_shot_pass_program`): one lane, one block of ``T`` tokens, ``T``
the request's prefill bucket, over a fresh staging area of exactly ``T`` positions, which then
is the request's prefix (no extraction program); it compiles once per prefill bucket.

Lane-aligned blocks
-------------------
The packed tokens form ``T / g`` blocks of ``g`` consecutive tokens, each holding tokens of one
lane only (the host starts every request's segment at a multiple of ``g``). A layer writes the
keys/values of all ``T`` tokens into their lanes, then every block attends to its lane's first
``span`` cache positions (``span``: a prefill bucket covering every packed position): the
attention costs ``T x span`` whatever the number of lanes, where one ``[P, T]`` query grid
(:meth:`~dspark_jax.models.target.Target.forward_packed`) would cost ``P x T x span``. Only the
finishing lanes' last hidden states go through the LM head. Everything variable (lanes,
positions, which lanes finish, drafting, context upkeep) is a runtime array or flag, so a pass
compiles once per ``(T, span)`` and the extraction once per prefill bucket.

Exactness: a token's keys/values and hidden states are those of a whole-prompt pass (same
positions, same causal context), so a request prefilled in chunks gets the same first token and
the same caches as one prefilled in one shot, up to float rounding between matmul shapes (which
can only flip exact near-ties).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.round import token_keys
from dspark_jax.models import sharding as shd
from dspark_jax.models.layer_stack import run_layers
from dspark_jax.models.layers import KVCache, attention
from dspark_jax.models.sampling import SamplingArrays, logits_are_finite, process_logits, sample
from dspark_jax.models.target import attention_options, layer_window, packed_attn_out_and_mlp, packed_qkv
from dspark_jax.serving.engine.state import PrefixArrays
from dspark_jax.serving.engine.step_programs import (
    ContextWrite,
    DraftInputs,
    apply_bias,
    draft,
    logprobs,
    write_context,
)

__all__ = [
    "ChunkInputs",
    "ChunkOutputs",
    "ChunkSpec",
    "LaneSampling",
    "PackedChunk",
    "StageState",
    "chunk_forward",
    "extract_program",
    "init_stage",
    "one_shot_pass_program",
    "prefill_chunk_program",
    "stage_shardings",
]


class StageState(NamedTuple):
    """The staging area of chunked prefill: ``P`` lanes of ``S`` positions."""

    tk: Any  # [L, P, S, kvh, hd] target keys
    tv: Any
    dk: Any  # [N, P, S, kvh, hd] drafter context keys (None without drafter)
    dv: Any


class ChunkOutputs(NamedTuple):
    """Per-lane results of a pass (meaningful for the lanes whose prompt ended in it)."""

    token: jax.Array  # [P] int32 first token
    finite: jax.Array  # [P] bool its logits were finite
    key: jax.Array  # [P, 2] uint32 request keys
    draft: jax.Array  # [P, G'] int32 first block (zeros where not drafted)
    conf: jax.Array  # [P, G'] f32 its raw confidence logits
    qprob: Any  # [P, G, V] f32 its q (rejection mode with a drafter) or None
    logprob: jax.Array  # [P] f32 raw logprob of the first token
    top_values: jax.Array  # [P, n_top] f32
    top_ids: jax.Array  # [P, n_top] int32


def init_stage(target, drafter, lanes: int, length: int) -> StageState:
    """Zero staging caches of ``lanes`` rows and ``length`` positions (no drafter rows
    without a drafter)."""
    tc = target.init_cache(lanes, length)
    if drafter is None:
        return StageState(tc.k, tc.v, None, None)
    dc = drafter.init_cache(lanes, length)
    return StageState(tc.k, tc.v, dc.k, dc.v)


def stage_shardings(mesh, target_cfg, drafter_cfg) -> StageState:
    """Shardings of a :class:`StageState` on ``mesh``: caches over their KV heads, as the
    decode state's (:func:`dspark_jax.serving.engine.state.state_shardings`)."""

    def cache(cfg):
        return shd.cache_sharding(mesh, cfg.num_kv_heads, (1, 1, 1, cfg.num_kv_heads, cfg.head_dim))

    t = cache(target_cfg)
    d = cache(drafter_cfg) if drafter_cfg is not None else None
    return StageState(t, t, d, d)


# ------------------------------------------------------------------------------ the packed pass


class _ChunkGeometry(NamedTuple):
    """Where the ``T`` packed tokens of :func:`chunk_forward` go.

    Attributes:
      lane: ``[T]`` staging lane of each token; blk_lane: ``[T / g]`` lane of each block.
      wpos: ``[T]`` cache slot written (``S``, out of range, for padding: dropped write).
      rope_pos: ``[1, T]`` RoPE positions (clipped into the cache).
      mask: ``[T / g, g, span]`` bool, token ``(b, i)`` may read lane slot ``s`` (causally; a
        sliding layer narrows it to its window with ``qpos``).
      qpos: ``[T / g, g]`` int32 absolute position of each token (< 0: padding).
      span / block / k_tok: static attention span, block size g and T.
    """

    lane: jax.Array
    blk_lane: jax.Array
    wpos: jax.Array
    rope_pos: jax.Array
    mask: jax.Array
    qpos: jax.Array
    span: int
    block: int
    k_tok: int


def _geometry(pos, blk_lane, s_len: int, span: int, block: int) -> _ChunkGeometry:
    k_tok = pos.shape[0]
    lane = jnp.repeat(blk_lane, block, total_repeat_length=k_tok)
    wpos = jnp.where(pos >= 0, pos, s_len)
    qpos = pos.reshape(k_tok // block, block)
    mask = jnp.arange(span, dtype=jnp.int32)[None, None, :] <= qpos[:, :, None]  # padding sees nothing
    rope_pos = jnp.clip(pos, 0, s_len - 1)[None]
    return _ChunkGeometry(lane, blk_lane, wpos, rope_pos, mask, qpos, span, block, k_tok)


def _chunk_layer(cfg, g: _ChunkGeometry, keep_hidden: bool, stacks: dict, carry: tuple, p: dict[str, jax.Array]):
    """One decoder layer of :func:`chunk_forward` (a ``lax.scan`` body over layers; the whole
    staging cache rides in the carry and is updated in place, as in the target's packed pass)."""
    h, ck_all, cv_all, li = carry
    k_tok, nblk, hd = g.k_tok, g.k_tok // g.block, cfg.head_dim
    q, ck_all, cv_all = packed_qkv(cfg, p, h, g.rope_pos, g.lane, g.wpos, ck_all, cv_all, li)
    # Every block reads its lane's first `span` slots: the lane's earlier chunks and the
    # tokens just written (its own and the earlier blocks of the same lane).
    ck = ck_all[li, g.blk_lane, : g.span]  # [T / g, span, kvh, hd]
    cv = cv_all[li, g.blk_lane, : g.span]
    mask, window = g.mask, layer_window(cfg, li)
    if window is not None:
        mask = mask & (jnp.arange(g.span, dtype=jnp.int32)[None, None, :] > g.qpos[:, :, None] - window)
    attn = attention(q.reshape(nblk, g.block, cfg.num_heads, hd), ck, cv, mask, **attention_options(cfg))
    attn = attn.reshape(k_tok, -1)
    h = packed_attn_out_and_mlp(cfg, p, h, attn, stacks)
    return (h, ck_all, cv_all, li + 1), (h[0] if keep_hidden else None)


def chunk_forward(target, tok, pos, blk_lane, cache: KVCache, *, span: int, block: int, taps=()):
    """Target pass over ``T`` packed prompt tokens in lane-aligned blocks (see the module doc).

    Args:
      target: the :class:`~dspark_jax.models.target.Target`.
      tok / pos: ``[T]`` int32 token ids and absolute positions (``pos < 0``: padding, which
        writes nothing and whose outputs are garbage, finite).
      blk_lane: ``[T / block]`` int32 staging lane of each block of ``block`` tokens.
      cache: the staging KV ``[L, P, S, kvh, hd]``.
      span: static number of lane slots attention reads (> every valid position).
      taps: target layers whose outputs are returned as features.
    Returns:
      ``(hidden [T, H] before the final norm, features [T, n_taps * H] or None, new cache)``.
    """
    cfg = target.cfg
    taps = tuple(int(t) for t in taps)
    geo = _geometry(pos, blk_lane, cache.length, span, block)
    layer_params, stacks = target.scan_params(), target.mlp_stacks()
    x = target.embed_tokens(tok).astype(target.dtype)[None]  # [1, T, H]

    def layer(carry, p):
        return _chunk_layer(cfg, geo, bool(taps), stacks, carry, p)

    (x, nk, nv, _), hidden = run_layers(layer, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
    features = jnp.concatenate([hidden[t] for t in taps], axis=-1) if taps and hidden is not None else None
    return x[0], features, KVCache(nk, nv)


# ------------------------------------------------------------------------------ programs


def _first_tokens(raw, keys, prompt_len, samp, bias, n_top: int):
    """The first token of every lane from its last prompt position's raw logits ``[P, V]``
    (biased, sampled with key ``fold_in(request_key, prompt_len - 1)`` as plain decoding's):
    ``(token [P], finite [P], (logprob, top values, top ids))``."""
    rows = jnp.arange(raw.shape[0], dtype=jnp.int32)
    logits = apply_bias(raw, rows, prompt_len - 1, *bias)
    token = sample(token_keys(keys, prompt_len - 1), process_logits(logits, samp)).astype(jnp.int32)
    return token, logits_are_finite(raw), logprobs(raw, token, n_top)


def _chunk_drafter(target, drafter, ctx: ContextWrite, stage, first: DraftInputs, flags, span, init):
    """Drafter context of the packed tokens (``ctx``; skipped while suspended) and the first block
    of the finishing lanes (``first``: their first tokens after their prompts; their bias tables
    always apply: an empty one changes nothing; ``flags = (do_draft [P], do_context, mode)``).
    Returns ``(dk, dv, (draft, conf, q))``."""
    do_draft, do_context, mode = flags
    dk, dv = jax.lax.cond(
        do_context,
        lambda _: write_context(drafter, ctx, stage.dk, stage.dv),
        lambda _: (stage.dk, stage.dv),
        None,
    )

    def run(_):
        ctx_k, ctx_v = dk[:, :, :span], dv[:, :, :span]
        return draft(target, drafter, first._replace(use_bias=jnp.bool_(True)), ctx_k, ctx_v, mode)

    d, conf, q = jax.lax.cond(jnp.any(do_draft), run, lambda _: init, None)
    d = jnp.where(do_draft[:, None], d, init[0])
    conf = jnp.where(do_draft[:, None], conf, init[1])
    q = None if q is None else jnp.where(do_draft[:, None, None], q, init[2])
    return dk, dv, (d, conf, q)


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """The static shape of a chunked-prefill pass (one compiled program per value).

    Attributes:
      span / block: attention span and lane-aligned block size; block_size / mode / n_top: as
        :class:`~dspark_jax.serving.engine.step_programs.StepSpec`.
    """

    span: int
    block: int
    block_size: int
    mode: str = "coupled"
    n_top: int = 20


class PackedChunk(NamedTuple):
    """The packed prompt tokens of a pass.

    Attributes:
      tok / pos: ``[T]`` int32 packed prompt tokens and positions (``-1``: padding);
      blk_lane: ``[T / block]`` int32 lane of each block; last: ``[P]`` int32 index in ``tok``
      of each lane's last prompt token (any for lanes not finishing).
    """

    tok: Any
    pos: Any
    blk_lane: Any
    last: Any


class LaneSampling(NamedTuple):
    """Per-lane sampling of the first token: prompt_len / seed / top_k ``[P]`` int32,
    temperature / top_p ``[P]`` float32, do_draft ``[P]`` bool (draft the lane's first block)."""

    prompt_len: Any
    seed: Any
    temperature: Any
    top_k: Any
    top_p: Any
    do_draft: Any


class ChunkInputs(NamedTuple):
    """The runtime inputs of a pass (a pytree; its leaves are the program's parameters).

    Attributes:
      packed: :class:`PackedChunk`; lanes: :class:`LaneSampling`; do_context: ``[]`` bool,
      write the drafter context of the packed tokens; bias: the ``(ids, val, until)``
      ``[P, NB]`` bias tables.
    """

    packed: PackedChunk
    lanes: LaneSampling
    do_context: Any
    bias: tuple


def prefill_chunk_program(t_state, d_state, stage: StageState, inp: ChunkInputs, *, t_graph, d_graph, spec: ChunkSpec):
    """One chunked-prefill pass (see the module doc).

    Args:
      stage: :class:`StageState` (donated).
      inp: :class:`ChunkInputs`; spec: :class:`ChunkSpec` (static).
    Returns:
      ``(new stage, ChunkOutputs)``.
    """
    (tok, pos, blk_lane, last), lanes_in, do_context, bias = inp
    prompt_len, seed, temperature, top_k, top_p, do_draft = lanes_in
    span, block, block_size, mode, n_top = spec.span, spec.block, spec.block_size, spec.mode, spec.n_top
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    taps = drafter.cfg.taps if drafter is not None else ()
    hidden, feats, cache = chunk_forward(
        target, tok, pos, blk_lane, KVCache(stage.tk, stage.tv), span=span, block=block, taps=taps
    )
    raw = target.unembed(hidden[last])  # [P, V]: only the finishing positions reach the LM head
    keys = jax.vmap(jax.random.PRNGKey)(seed)
    samp = SamplingArrays(temperature, top_k, top_p)
    token, finite, lp = _first_tokens(raw, keys, prompt_len, samp, bias, n_top)
    lanes, gp = last.shape[0], max(block_size, 1)
    init = (
        jnp.zeros((lanes, gp), jnp.int32),
        jnp.zeros((lanes, gp), jnp.float32),
        jnp.zeros((lanes, block_size, target.cfg.vocab_size), jnp.float32)
        if (mode == "rejection" and block_size)
        else None,
    )
    dk, dv, blk = stage.dk, stage.dv, init
    if drafter is not None:
        lane = jnp.repeat(blk_lane, block, total_repeat_length=tok.shape[0])
        ctx, first = ContextWrite(feats, lane, pos), DraftInputs(token, prompt_len, keys, samp, bias, None)
        dk, dv, blk = _chunk_drafter(target, drafter, ctx, stage, first, (do_draft, do_context, mode), span, init)
    out = ChunkOutputs(token, finite, keys, blk[0], blk[1], blk[2], *lp)
    return StageState(cache.k, cache.v, dk, dv), out


def extract_program(stage: StageState, out: ChunkOutputs, lane, *, p_len: int) -> PrefixArrays:
    """Lane ``lane`` of a pass as the :class:`PrefixArrays` of a prompt in bucket ``p_len``
    (positions past the prompt hold stale values, which decode masks and overwrites)."""

    def cut(x):
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, lane, 1, axis=1)[:, :, :p_len]

    return PrefixArrays(
        cut(stage.tk),
        cut(stage.tv),
        cut(stage.dk),
        cut(stage.dv),
        out.key[lane],
        out.token[lane],
        out.draft[lane],
        out.conf[lane],
        None if out.qprob is None else out.qprob[lane],
    )


def one_shot_pass_program(t_state, d_state, inp: ChunkInputs, *, t_graph, d_graph, spec: ChunkSpec):
    """One-shot prefill of one request: chunked prefill's degenerate pass (see the module doc).

    One lane and one block: ``spec.span == spec.block == T``, the request's prefill bucket; the
    staging area is created here (zeros, ``T`` positions), so the pass's lane is the prefix.

    Args:
      inp: :class:`ChunkInputs` of one lane: ``tok / pos [T]`` int32 (the prompt, then padding
        with position ``-1``), ``blk_lane`` ``[1]`` zeros, ``last [1]`` the prompt length minus
        one, :class:`LaneSampling` and bias tables of one lane.
      spec: :class:`ChunkSpec` (static).
    Returns:
      ``(PrefixArrays of bucket T, finite [] bool, (logprob [1] f32, top values [1, n_top] f32,
      top ids [1, n_top] int32))``.
    """
    target = nnx.merge(t_graph, t_state)
    drafter = nnx.merge(d_graph, d_state) if d_graph is not None else None
    stage = init_stage(target, drafter, 1, spec.span)
    stage, out = prefill_chunk_program(t_state, d_state, stage, inp, t_graph=t_graph, d_graph=d_graph, spec=spec)
    arrays = extract_program(stage, out, 0, p_len=spec.span)
    return arrays, out.finite[0], (out.logprob, out.top_values, out.top_ids)
