"""Batched, chunked prefill (:mod:`dspark_jax.serving.engine.prefill`, issue 14) on stories260K.

* Packing (host only): prompts FIFO into the token budget, each segment on a block boundary,
  long prompts split across passes (a boundary inside a prompt, one exactly at its end),
  several requests per pass, lanes reused, cancellation.
* Exactness: a request prefilled in chunks gives the prefix one-shot prefill gives (first
  token, caches, drafter context, first drafted block and its confidences, logprobs, bias),
  for chunk boundaries at several offsets and several requests packed in one pass; and the
  same decoded tokens (greedy and seeded T > 0) through the engine and through the server's
  engine loop; in rejection mode the first block's q too.
* No recompilation after warm-up (compile events counted as in
  ``tests/unit/serving/test_engine_exactness.py``).

One engine (3 slots, block_size 3, one prefill bucket of 32, a 12-token chunk of 4-token blocks
over 3 lanes) is shared, so that its handful of programs compile once.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams
from dspark_jax.serving.engine.prefill import ChunkedPrefill, PrefillEntry, PrefillQueue, chunk_ladder
from dspark_jax.serving.http.engine_loop import EngineLoop, TrackedRequest
from tests.helpers.engine_drive import drive


@pytest.fixture(scope="module")
def target(stories260k_target):
    return stories260k_target


@pytest.fixture(scope="module")
def drafter(stories260k_drafter):
    """The serving engine tests' bigram drafter (tests/conftest.py)."""
    return stories260k_drafter


@pytest.fixture(scope="module")
def tokenizer(stories260k):
    return stories260k[2]


CHUNK, BLOCK, LANES, SLOTS, CACHE = 12, 4, 3, 3, 64
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. "
    "One day, she saw a big red ball in the park and ran to get it."
)
# Prompt lengths per scenario (see test_queue_packs_fifo_in_aligned_blocks for the passes)
SCENARIOS = [[13, 5, 4, 12], [3, 5, 24, 1], [30, 2, 2], [1, 1, 1, 1]]


def _entry(n: int, tag=None) -> PrefillEntry:
    return PrefillEntry(Request(list(range(1, n + 1)), SamplingParams()), tag, np.arange(1, n + 1), ())


def _passes(lengths):
    q = PrefillQueue(chunk_ladder(CHUNK, BLOCK), (32,), LANES, BLOCK)
    entries = [_entry(n, i) for i, n in enumerate(lengths)]
    for e in entries:
        q.add(e)
    out = []
    while (plan := q.pack()) is not None:
        segs = []
        for e in plan.members:
            sel = (plan.pos >= 0) & (np.repeat(plan.blk_lane, BLOCK) == e.lane)
            segs.append((e.tag, e.lane, int(plan.pos[sel][0]), int(plan.pos[sel][-1]) + 1, e in plan.finishing))
            assert np.flatnonzero(sel)[0] % BLOCK == 0  # the segment starts on a block boundary
            assert np.array_equal(plan.tok[sel], e.ids[plan.pos[sel]])
            if e in plan.finishing:
                assert plan.last[e.lane] == np.flatnonzero(sel)[-1]
        out.append(segs)
    return out


def test_queue_packs_fifo_in_aligned_blocks():
    assert chunk_ladder(256, 16) == [64, 256] and chunk_ladder(12, 4) == [12] and chunk_ladder(16, 4) == [4, 16]
    with pytest.raises(DSparkInputError):
        chunk_ladder(10, 4)
    # (tag, lane, first position, end position, finishes) per pass
    assert _passes(SCENARIOS[0]) == [
        [(0, 0, 0, 12, False)],  # a boundary inside the prompt
        [(0, 0, 12, 13, True), (1, 1, 0, 5, True)],  # two requests in one pass
        [(2, 0, 0, 4, True), (3, 1, 0, 8, False)],
        [(3, 1, 8, 12, True)],
    ]
    assert _passes(SCENARIOS[1]) == [
        [(0, 0, 0, 3, True), (1, 1, 0, 5, True)],
        [(2, 0, 0, 12, False)],
        [(2, 0, 12, 24, True)],  # a split prompt ending exactly at the chunk's end
        [(3, 0, 0, 1, True)],
    ]
    assert _passes(SCENARIOS[2]) == [
        [(0, 0, 0, 12, False)],
        [(0, 0, 12, 24, False)],
        [(0, 0, 24, 30, True), (1, 1, 0, 2, True)],
        [(2, 0, 0, 2, True)],
    ]
    assert _passes(SCENARIOS[3]) == [[(0, 0, 0, 1, True), (1, 1, 0, 1, True), (2, 2, 0, 1, True)], [(3, 0, 0, 1, True)]]
    q = PrefillQueue([CHUNK], (32,), LANES, BLOCK)
    a, b = _entry(20, "a"), _entry(3, "b")
    q.add(a)
    q.add(b)
    plan = q.pack()
    assert plan is not None and plan.members == [a] and a.lane == 0
    assert q.cancel("a") and not q.cancel("a") and len(q) == 1
    plan = q.pack()
    assert plan is not None and plan.members == [b] and b.lane == 0 and plan.finishing == [b]
    assert q.pack() is None


@pytest.fixture(scope="module")
def engine(target, drafter):
    eng = Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=SLOTS,
            cache_len=CACHE,
            policy="fixed:3",
            buckets=(12,),
            row_buckets=(SLOTS,),
            prefill_buckets=(32,),
            profile_iters=1,
            suspend_after=None,
            prefill_chunk_tokens=0,
        ),
    )
    # small blocks, so that several requests share a 12-token pass
    eng.prefiller = ChunkedPrefill(
        eng.device, eng.planner, eng.limits, eng.prefill_buckets, CHUNK, lanes=LANES, block=BLOCK
    )
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def story(tokenizer):
    return tokenizer.encode(STORY)


def _requests(story, lengths, tag: str, **extra):
    settings = [
        dict(temperature=0.0, max_new_tokens=12),
        dict(temperature=1.0, max_new_tokens=10, seed=3),
        dict(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=14, seed=7, logprobs=2),
        dict(temperature=1.0, max_new_tokens=9, seed=11, logit_bias=((5, 8.0),), min_tokens=2),
    ]
    return [
        Request(story[i : i + n], SamplingParams(**{**settings[i % 4], **extra}), f"{tag}{i}")
        for i, n in enumerate(lengths)
    ]


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _same_prefix(chunked, one_shot):
    assert chunked.request is one_shot.request
    assert (chunked.prompt_len, chunked.bucket_len) == (one_shot.prompt_len, one_shot.bucket_len)
    assert (chunked.first_token, chunked.finite, chunked.has_context) == (
        one_shot.first_token,
        one_shot.finite,
        one_shot.has_context,
    )
    assert (chunked.conf_logit is None) == (one_shot.conf_logit is None)
    if one_shot.conf_logit is not None:
        _close(chunked.conf_logit, one_shot.conf_logit)
        assert np.array_equal(np.asarray(chunked.arrays.draft), np.asarray(one_shot.arrays.draft))
    if one_shot.first_logprob is not None:
        assert chunked.first_logprob is not None
        assert [i for i, _ in chunked.first_logprob[1]] == [i for i, _ in one_shot.first_logprob[1]]
        _close(chunked.first_logprob[0], one_shot.first_logprob[0])
    n = one_shot.prompt_len
    a, b = chunked.arrays, one_shot.arrays
    for x, y in ((a.tk, b.tk), (a.tv, b.tv)) + (((a.dk, b.dk), (a.dv, b.dv)) if one_shot.has_context else ()):
        assert x.shape == y.shape and x.dtype == y.dtype
        _close(x[:, :, :n], y[:, :, :n])
    assert np.array_equal(np.asarray(a.key), np.asarray(b.key)) and int(a.token) == int(b.token)
    for f, g in zip(jax.tree.leaves(chunked.bias), jax.tree.leaves(one_shot.bias)):
        assert np.array_equal(f, g)


@pytest.mark.parametrize("policy", ["fixed:3", "plain"])
def test_chunked_prefix_equals_one_shot(engine, story, policy):
    """Every scenario's chunked prefixes equal one-shot prefill's (drafting the first block
    under fixed:3, not under plain)."""
    engine.set_policy(policy)
    pre = engine.prefiller
    for k, lengths in enumerate(SCENARIOS):
        reqs = _requests(story, lengths, f"s{k}-")
        passes = pre.passes
        chunked = pre.prefill(reqs)
        assert pre.passes - passes == len(_passes(lengths))
        for c, r in zip(chunked, reqs):
            _same_prefix(c, engine.prefill(r))
    if policy != "plain":
        return
    # while the drafter is suspended (not drafting), both skip the drafter context
    engine.planner.suspend_after, engine.planner.idle_steps = 1, 5
    try:
        r = _requests(story, [20], "susp")[0]
        c, o = pre.prefill([r])[0], engine.prefill(r)
        assert not c.has_context and not o.has_context
        _same_prefix(c, o)
    finally:
        engine.planner.suspend_after, engine.planner.idle_steps = None, 0


@pytest.fixture(scope="module")
def decode_requests(story):
    return _requests(story, [30, 5, 13, 24, 3, 12], "d")


@pytest.fixture(scope="module")
def one_shot(engine, decode_requests):
    engine.set_policy("fixed:3")
    return drive(engine, decode_requests, chunked=False, slots=SLOTS)


@pytest.mark.parametrize("policy", ["fixed:3", "plain"])
def test_chunked_decode_matches_one_shot(engine, decode_requests, one_shot, policy):
    engine.set_policy(policy)
    assert drive(engine, decode_requests, chunked=True, slots=SLOTS) == one_shot


def test_engine_loop_chunked_matches_one_shot(engine, decode_requests, one_shot, story):
    """The server's engine thread with chunked prefill: same outputs; a request aborted while
    it is being prefilled ends with ``abort`` and frees its lane. Requests with numbers the
    prefill pass cannot hold (a top_k beyond int32, a token id beyond int64), submitted between
    good ones that share their pass, get a 400 and leave the others untouched (issue 27: the
    pass used to fail with OverflowError, a 500 for every request in it)."""
    engine.set_policy("fixed:3")
    passes = engine.prefiller.passes

    async def run():
        aloop = asyncio.get_running_loop()
        loop = EngineLoop(engine, None, max_queue=16)
        loop.start()
        tracked = [TrackedRequest(r, aloop, asyncio.Queue()) for r in decode_requests]
        doomed = TrackedRequest(_requests(story, [31], "x")[0], aloop, asyncio.Queue())
        bad = [
            TrackedRequest(_requests(story, [5], "k", top_k=2**31)[0], aloop, asyncio.Queue()),
            TrackedRequest(Request([1, 2**70], SamplingParams(), "i0"), aloop, asyncio.Queue()),
        ]
        loop.submit(doomed, tracked[0], bad[0], tracked[1], bad[1], *tracked[2:])
        loop.abort(doomed.request_id)
        got = {}
        for t in [doomed, *bad, *tracked]:
            toks, ev = [], None
            while ev is None or ev.kind == "delta":
                ev = await asyncio.wait_for(t.queue.get(), 120)
                toks += ev.token_ids
            got[t.request_id] = (toks, ev.finish_reason) if ev.kind != "error" else (ev.status, ev.message)
        snap = loop.snapshot()
        loop.stop()
        return got, snap

    got, snap = asyncio.run(run())
    assert got.pop("x0") == ([], "abort")
    status, message = got.pop("k0")
    assert status == 400 and "top_k must be an integer in [0, 2147483647]" in message
    status, message = got.pop("i0")
    assert status == 400 and "outside the vocabulary" in message
    assert got == one_shot and engine.prefiller.passes > passes
    assert all(len(toks) > 1 for toks, _ in one_shot.values())
    assert snap["waiting"] == 0 and len(engine.prefiller) == 0 and engine.free_slots() == [0, 1, 2]


def test_rejection_mode_first_block(target, drafter, story):
    """In rejection mode the first block's q comes out of a chunked pass as from one-shot
    prefill."""
    eng = Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=SLOTS,
            cache_len=CACHE,
            policy="fixed:3",
            row_buckets=(SLOTS,),
            prefill_buckets=(32,),
            suspend_after=None,
            verification="rejection",
            prefill_chunk_tokens=0,
        ),
    )
    pre = ChunkedPrefill(eng.device, eng.planner, eng.limits, eng.prefill_buckets, CHUNK, lanes=LANES, block=BLOCK)
    reqs = _requests(story, [13, 5], "q")
    for c, r in zip(pre.prefill(reqs), reqs):
        o = eng.prefill(r)
        _same_prefix(c, o)
        assert c.arrays.qprob is not None and c.arrays.qprob.shape == o.arrays.qprob.shape
        _close(c.arrays.qprob, o.arrays.qprob)


def test_no_recompile_after_warmup(engine, story):
    from jax._src import monitoring

    events = []

    def listener(name, secs, **kw):
        if "compile" in name and "backend" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = engine.metrics()["compiles"]
        for policy in ("fixed:3", "plain"):
            engine.set_policy(policy)
            for k, lengths in enumerate(SCENARIOS + [[32, 7], [2, 31, 9]]):
                drive(engine, _requests(story, lengths, f"n{k}-", max_new_tokens=3), chunked=True, slots=SLOTS)
    finally:
        if hasattr(monitoring, "_unregister_event_duration_listener_by_callback"):
            monitoring._unregister_event_duration_listener_by_callback(listener)
    assert events == [], f"{len(events)} compilations after warm-up"
    assert engine.metrics()["compiles"] == before


def test_bad_chunk_settings(engine):
    with pytest.raises(DSparkInputError):
        ChunkedPrefill(engine.device, engine.planner, engine.limits, engine.prefill_buckets, 10, block=4)
    with pytest.raises(DSparkInputError):
        ChunkedPrefill(engine.device, engine.planner, engine.limits, engine.prefill_buckets, 8, lanes=0, block=4)
    with pytest.raises(DSparkInputError):
        engine.prefiller.submit(Request([], SamplingParams()))
    assert len(engine.prefiller) == 0
    with pytest.raises(DSparkInputError):
        Engine(engine.target, None, EngineConfig(num_slots=1, cache_len=CACHE, prefill_chunk_tokens=-1))


def test_serve_flag():
    from dspark_jax.commands.serve import build_parser

    assert build_parser().parse_args(["--target", "x"]).prefill_chunk_tokens == 256  # the server's default
    assert build_parser().parse_args(["--target", "x", "--prefill-chunk-tokens", "0"]).prefill_chunk_tokens == 0
    assert "--prefill-chunk-tokens" in build_parser().format_help()
