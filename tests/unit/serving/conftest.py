"""The serving engine's tests share one stories260K engine (2 slots, block_size 3, buckets (1,1)
(1,4) (2,2) (2,8)) and its reference decodes, compiled once per test process (session-scoped: the
CI runs ``pytest -n 3 --dist loadfile``, so a module-scoped engine would compile once per file),
and the drivers ``drive`` / ``drive_one`` / ``plain_reference`` as fixtures. The tests that use it:
``test_engine_exactness.py`` (outputs equal plain decoding under batching, no recompiles,
suspension, the plan), ``test_engine_requests.py`` (request settings, validation, the config),
``test_engine_rejection.py`` (rejection-sampling verification) and ``test_engine_metrics.py``
(metrics, the SPS table, the program cache). A test may switch the engine's policy; each sets
the one it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.speculative import generate_autoregressive
from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams
from dspark_jax.serving.engine.step_programs import ProgramCache

BLOCK_SIZE = 3
CACHE = 64

TEXTS = [
    "Once upon a time",
    "The little dog",
    "Lily went to the park and saw a big",
    "One day",
    "Tom had a red ball. He",
    "The sun was",
]
SETTINGS = [
    dict(temperature=0.0, max_new_tokens=30, seed=0),
    dict(temperature=1.0, max_new_tokens=25, seed=3),
    dict(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=40, seed=7),
    dict(temperature=1.0, top_p=0.5, max_new_tokens=200, seed=11),  # runs into the cache end
    dict(temperature=0.5, top_k=5, max_new_tokens=1, seed=5),  # only the prefill token
    dict(temperature=0.0, max_new_tokens=35, seed=2),
]


@pytest.fixture(scope="session")
def target(stories260k_target):
    return stories260k_target


@pytest.fixture(scope="session")
def tokenizer(stories260k):
    return stories260k[2]


@pytest.fixture(scope="session")
def drafter(stories260k_drafter):
    """The bigram drafter (tests/conftest.py), block_size :data:`BLOCK_SIZE`."""
    assert stories260k_drafter.cfg.block_size == BLOCK_SIZE
    return stories260k_drafter


@pytest.fixture(scope="session")
def engine(target, drafter):
    # suspend_after=2: every test also runs the drafter-free plain steps and the catch-up.
    eng = Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=2,
            cache_len=CACHE,
            policy="fixed:3",
            buckets=(8,),
            prefill_buckets=(32,),
            profile_iters=1,
            suspend_after=2,
            prefill_chunk_tokens=0,
        ),
    )
    eng.warmup()
    eng.set_policy("dspark")
    eng.warmup()
    return eng


@pytest.fixture(scope="session")
def requests(tokenizer):
    return [Request(tokenizer.encode(t), SamplingParams(**s), f"r{i}") for i, (t, s) in enumerate(zip(TEXTS, SETTINGS))]


@pytest.fixture(scope="session")
def reference(target, requests):
    """Plain autoregressive decoding of every request (one batched call)."""
    prompts = [r.prompt_ids for r in requests]
    p = [r.params for r in requests]
    max_new = [min(x.max_new_tokens, CACHE - len(r.prompt_ids)) for x, r in zip(p, requests)]
    res = generate_autoregressive(
        target,
        prompts,
        max_new_tokens=max_new,
        temperature=[x.temperature for x in p],
        top_k=[x.top_k for x in p],
        top_p=[x.top_p for x in p],
        seed=[x.seed for x in p],
    )
    return {r.request_id: (g.token_ids, g.finish_reason) for r, g in zip(requests, res.generations)}


@pytest.fixture(scope="session")
def plain_programs():
    """One program cache for the drafter-less engines (coupled and rejection mode compile to
    the same programs without a drafter)."""
    return ProgramCache()


@pytest.fixture(scope="session")
def full_logits(target):
    """``ids [CACHE] -> raw target logits [CACHE, V]`` of one full causal forward (no cache):
    the plain-decoding reference of the tests below."""
    graph, state = nnx.split(target)
    pos = jnp.arange(CACHE, dtype=jnp.int32)[None]
    fn = jax.jit(lambda st, ids: nnx.merge(graph, st)(ids[None], pos).logits[0])
    return lambda ids: np.asarray(fn(state, jnp.asarray(ids, jnp.int32)), np.float64)


@pytest.fixture(scope="session")
def rejection_engine(target, drafter):
    """One slot, rejection-sampling verification (its own programs: the state carries q)."""
    return Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=1,
            cache_len=CACHE,
            policy="fixed:3",
            buckets=(8,),
            prefill_buckets=(32,),
            profile_iters=1,
            suspend_after=None,
            verification="rejection",
            prefill_chunk_tokens=0,
        ),
    )


def _drive(engine, requests):
    """Feeds requests one per step into the highest free slot (joins mid-flight); collects
    every request's tokens and finish reason."""
    pending = list(requests)
    toks, reasons = {}, {}
    steps = 0
    while pending or engine.active_slots():
        free = engine.free_slots()
        if pending and free:
            engine.insert(engine.prefill(pending.pop(0)), free[-1])
        for o in engine.generate():
            assert o.request_id not in reasons, "no output after finishing"
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            assert o.num_accepted <= o.num_verified <= BLOCK_SIZE
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
        assert steps < 1000
    assert engine.free_slots() == [0, 1]
    return toks, reasons


@pytest.fixture(scope="session")
def drive():
    """:func:`_drive`."""
    return _drive


def _drive_one(engine, requests):
    """Requests one after another through slot 0."""
    toks, reasons = {}, {}
    for r in requests:
        engine.insert(engine.prefill(r), 0)
        while engine.active_slots():
            for o in engine.generate():
                toks.setdefault(o.request_id, []).extend(o.token_ids)
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
    return toks, reasons


@pytest.fixture(scope="session")
def drive_one():
    """:func:`_drive_one`."""
    return _drive_one


def _plain_reference(full_logits, target, prompt, sp: SamplingParams):
    """Plain autoregressive decoding with logit_bias / min_tokens applied to the raw logits
    (then temperature / top-k / top-p via ``process_logits``), the token after position ``t``
    drawn with ``fold_in(PRNGKey(seed), t)`` like ``generate_autoregressive``. Returns
    ``(tokens, finish_reason, raw_logprobs [n, V])``."""
    from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

    stops = set(target.cfg.eos_ids) | set(sp.stop_ids)
    ids, out, lps = list(prompt), [], []
    key = jax.random.PRNGKey(sp.seed)
    end = min(len(prompt) + sp.max_new_tokens, CACHE)
    samp = sampling_arrays(1, sp.temperature, sp.top_k, sp.top_p)
    while len(ids) < end:
        buf = np.zeros(CACHE, np.int32)
        buf[: len(ids)] = ids
        raw = full_logits(buf)[len(ids) - 1]
        lg = raw.copy()
        for t, b in sp.logit_bias:
            lg[t] += b
        if len(out) < sp.min_tokens:
            lg[sorted(stops)] = -np.inf
        probs = process_logits(jnp.asarray(lg[None], jnp.float32), samp)
        tok = int(sample(jax.random.fold_in(key, len(ids) - 1)[None], probs)[0])
        lps.append(raw - np.logaddexp.reduce(raw))
        out.append(tok)
        ids.append(tok)
        if tok in stops and len(out) - 1 >= sp.min_tokens:
            return out, "stop", np.stack(lps)
    return out, "length", np.stack(lps)


@pytest.fixture(scope="session")
def plain_reference():
    """:func:`_plain_reference`."""
    return _plain_reference
