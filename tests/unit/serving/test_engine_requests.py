"""The serving engine's requests and settings: input errors, the config it reads, the validation
rules, and per-request ``logit_bias`` / ``logprobs`` / ``min_tokens`` against plain decoding with
the same processing (the shared engine: conftest.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams, parse_policy

BLOCK_SIZE, CACHE = 3, 64  # the shared engine's (conftest.py)


def test_input_errors(engine, target, drafter):
    bad = [
        Request([], SamplingParams()),
        Request([1, 600], SamplingParams()),
        Request(list(range(1, 40)), SamplingParams()),
        Request([1, 2], SamplingParams(temperature=-1.0)),
        Request([1, 2], SamplingParams(top_p=0.0)),
        Request([1, 2], SamplingParams(max_new_tokens=0)),
        Request([1, 2], SamplingParams(seed=2**40)),
    ]
    for r in bad:
        with pytest.raises(DSparkInputError):
            engine.prefill(r)
    pre = engine.prefill(Request([1, 2, 3], SamplingParams(max_new_tokens=3)))
    with pytest.raises(DSparkInputError):
        engine.insert(pre, 5)
    engine.insert(pre, 0)
    with pytest.raises(DSparkInputError):
        engine.insert(pre, 0)
    engine.free(0)
    for p in ["fixed:0", "fixed:9", "fixed:x", "threshold:2", "greedy:1", "nope", ""]:
        with pytest.raises(DSparkInputError):
            parse_policy(p, BLOCK_SIZE)
    with pytest.raises(DSparkInputError):
        parse_policy("dspark", 0)
    assert parse_policy("fixed:1", BLOCK_SIZE) == ("fixed", 1) and parse_policy("threshold:0.5", 3) == (
        "threshold",
        0.5,
    )
    with pytest.raises(DSparkInputError):
        Engine(target, None, EngineConfig(num_slots=2, cache_len=CACHE, policy="dspark"))


def test_the_engine_reads_its_config(target, drafter):
    """The settings are the config's (its defaults the server's: chunked prefill, the policy from
    the drafter); anything else in its place is refused. Construction only: nothing compiles."""
    cfg = EngineConfig(num_slots=2, cache_len=CACHE, prefill_buckets=(32,), plan_ahead=True, suspend_after=None)
    eng = Engine(target, drafter, cfg)
    assert eng.config is cfg and eng.plan_ahead and eng.policy == "dspark" and eng.suspend_after is None
    assert eng.supports_chunked_prefill() and eng.prefiller is not None
    assert eng.prefiller.chunk_tokens == EngineConfig.prefill_chunk_tokens
    plain = Engine(target, None, dataclasses.replace(cfg, prefill_chunk_tokens=0, plan_ahead=False))
    assert plain.policy == "plain" and not plain.plan_ahead and not plain.supports_chunked_prefill()
    with pytest.raises(DSparkInputError, match="EngineConfig"):
        Engine(target, None, {"num_slots": 2})  # type: ignore[arg-type]


def test_request_validation_keeps_the_engine_rules():
    """The engine validates with decoding.validation's checks but keeps its own rules:
    integral floats pass as max_new_tokens / seed, non-integral ones are refused; stop ids
    outside the vocabulary are allowed (they never match)."""
    from dspark_jax.serving.engine.requests import RequestLimits, validate_request

    limits = RequestLimits(
        vocab_size=64,
        max_position=128,
        cache_len=64,
        max_prompt=32,
        max_logit_bias=4,
        max_stop_ids=4,
        n_top=20,
        eos_ids=(2,),
    )
    for sp in (SamplingParams(max_new_tokens=4.0), SamplingParams(seed=3.0), SamplingParams(stop_ids=(1000,))):
        validate_request(Request([1, 2], sp), limits)
    bad = {
        "max_new_tokens": [
            SamplingParams(max_new_tokens=3.5),
            SamplingParams(max_new_tokens=float("nan")),
            SamplingParams(max_new_tokens=0),
            SamplingParams(max_new_tokens=2**31),
            SamplingParams(max_new_tokens=2**70),
        ],
        "seed": [SamplingParams(seed=3.5), SamplingParams(seed=float("inf")), SamplingParams(seed=2**31)],
        # issue 27: beyond int32 / float32 (the prefill pass's arrays) is refused, not a crash
        "top_k": [SamplingParams(top_k=1.5), SamplingParams(top_k=float("inf")), SamplingParams(top_k=2**31)],
        "temperature": [SamplingParams(temperature="0.5"), SamplingParams(temperature=1e39)],  # type: ignore[arg-type]
        "logit_bias": [SamplingParams(logit_bias=((5, 10**400),)), SamplingParams(logit_bias=((2**70, 1.0),))],
        "prompt": [
            Request([], SamplingParams()),
            Request([1, 64], SamplingParams()),
            Request(list(range(33)), SamplingParams()),
            Request([1, 2**70], SamplingParams()),
        ],
    }
    for field, cases in bad.items():
        for case in cases:
            req = case if isinstance(case, Request) else Request([1, 2], case)
            with pytest.raises(DSparkInputError, match=field):
                validate_request(req, limits)
    # min_tokens near INT32_MAX: its stop masking's last position is capped to int32, not overflowed
    from dspark_jax.serving.engine.requests import bias_table

    sp = SamplingParams(max_new_tokens=2**31 - 1, min_tokens=2**31 - 1)
    validate_request(Request([1, 2], sp), limits)
    _, val, until = bias_table(sp, 2, limits)
    assert until[0] == 2**31 - 1 and val[0] == -np.inf


def test_logit_bias_matches_plain_decoding_with_bias(engine, target, tokenizer, full_logits, drive, plain_reference):
    """logit_bias at T=0 changes the greedy path exactly as plain decoding with the bias does,
    and speculative decoding (every policy) with the bias equals plain decoding with it; at
    T>0 too (coupled verification: same keys)."""
    prompt = tokenizer.encode("Once upon a time")
    base = SamplingParams(temperature=0.0, max_new_tokens=30)
    ref0, _, _ = plain_reference(full_logits, target, prompt, base)
    bias = (
        (ref0[2], -100.0),
        (ref0[0], -5.0),
        (int(np.argsort(full_logits(np.r_[prompt, np.zeros(CACHE - len(prompt), int)])[len(prompt) - 1])[-3]), 4.0),
    )
    cases = [
        SamplingParams(temperature=0.0, max_new_tokens=30, logit_bias=bias),
        SamplingParams(temperature=0.8, top_k=20, max_new_tokens=30, seed=4, logit_bias=bias),
    ]
    for sp in cases:
        ref, why, _ = plain_reference(full_logits, target, prompt, sp)
        if sp.temperature == 0:
            assert ref != ref0 and ref0[2] not in ref
        for policy in ("plain", "fixed:3", "dspark"):
            engine.set_policy(policy)
            toks, reasons = drive(engine, [Request(prompt, sp, "b")])
            assert toks["b"] == ref, f"{policy} T={sp.temperature}"
            assert reasons["b"] == why


def test_logprobs_are_target_raw_logprobs(engine, target, requests, full_logits, plain_reference):
    """logprobs: the target's log-softmax of its raw logits at every emitted position (prefill
    token included), within 1e-4 of plain decoding's, top-n sorted; None when not asked."""
    engine.set_policy("fixed:3")
    base = requests[2]
    sp = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=20, seed=7, logprobs=5, logit_bias=((13, 2.0),)
    )
    other = Request(requests[0].prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=10), "no-lp")
    zero = Request(requests[1].prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=5, logprobs=0), "zero")
    got = {"lp": [], "no-lp": [], "zero": []}
    toks = {"lp": [], "no-lp": [], "zero": []}
    engine.insert(engine.prefill(Request(base.prompt_ids, sp, "lp")), 0)
    engine.insert(engine.prefill(other), 1)
    pending = [zero]
    while engine.active_slots() or pending:
        if pending and engine.free_slots():
            engine.insert(engine.prefill(pending.pop()), engine.free_slots()[0])
        for o in engine.generate():
            toks[o.request_id] += o.token_ids
            if o.request_id == "no-lp":
                assert o.logprobs is None
            else:
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                got[o.request_id] += o.logprobs
    ref, _, ref_lp = plain_reference(full_logits, target, base.prompt_ids, sp)
    assert toks["lp"] == ref and len(got["lp"]) == len(ref)
    for j, (t, (lp, top)) in enumerate(zip(ref, got["lp"])):
        assert abs(lp - ref_lp[j, t]) < 1e-4
        order = np.argsort(-ref_lp[j])[:5]
        assert [i for i, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref_lp[j, order], atol=1e-4)
    assert all(top == [] for _, top in got["zero"]) and len(got["zero"]) == 5


def test_min_tokens_suppresses_stops(engine, target, requests, reference, full_logits, drive, plain_reference):
    """min_tokens: EOS / stop ids are masked out of sampling (and cannot end the request)
    before min_tokens tokens; afterwards they stop it as usual. Spec == plain with masking."""
    base = requests[5]
    ref = reference[base.request_id][0]
    stop = ref[1]
    sp = SamplingParams(temperature=0.0, max_new_tokens=35, stop_ids=(stop,), min_tokens=12)
    want, why, _ = plain_reference(full_logits, target, base.prompt_ids, sp)
    assert stop not in want[:12] and len(want) > 12
    for policy in ("plain", "fixed:3"):
        engine.set_policy(policy)
        toks, reasons = drive(engine, [Request(base.prompt_ids, sp, "m")])
        assert toks["m"] == want and reasons["m"] == why
    # without min_tokens the same request stops at once
    toks, reasons = drive(
        engine, [Request(base.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=35, stop_ids=(stop,)), "n")]
    )
    assert toks["n"] == ref[:2] and reasons["n"] == "stop"


def test_new_sampling_params_are_validated(engine):
    cases = {
        "logit_bias": [
            SamplingParams(logit_bias=((512, 1.0),)),
            SamplingParams(logit_bias=((-1, 1.0),)),
            SamplingParams(logit_bias=((3, float("nan")),)),
            SamplingParams(logit_bias=((3, float("inf")),)),
            SamplingParams(logit_bias=((3,),)),
        ],
        "logprobs": [SamplingParams(logprobs=21), SamplingParams(logprobs=-1)],
        "min_tokens": [SamplingParams(min_tokens=5, max_new_tokens=4), SamplingParams(min_tokens=-1)],
    }
    for field, params in cases.items():
        for sp in params:
            with pytest.raises(DSparkInputError, match=field):
                engine.prefill(Request([1, 2, 3], sp))
    too_many = SamplingParams(logit_bias=tuple((i, 1.0) for i in range(engine.max_logit_bias + 1)))
    with pytest.raises(DSparkInputError, match="logit_bias"):
        engine.prefill(Request([1, 2, 3], too_many))


def test_eagle3_drafter_is_refused_at_start(target):
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.drafters.eagle import eagle_taps

    cfg = DrafterConfig.for_target(
        target.cfg,
        variant="eagle3",
        num_layers=1,
        block_size=BLOCK_SIZE,
        markov_rank=0,
        taps=eagle_taps(target.cfg),
        target_fingerprint=target.fingerprint,
    )
    with pytest.raises(DSparkInputError, match="eagle3") as e:
        Engine(target, build_drafter(cfg, nnx.Rngs(0)), EngineConfig(num_slots=1, cache_len=CACHE))
    assert "\n" not in str(e.value)
    with pytest.raises(DSparkInputError, match="verification"):
        Engine(target, None, EngineConfig(num_slots=1, cache_len=CACHE, policy="plain", verification="typical"))
