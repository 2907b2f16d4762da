"""End-to-end tests of the serving engine (:mod:`dspark_jax.serving.engine`) on stories260K.

* Exactness across batching (Gumbel-coupled verification): with requests joining and
  leaving mid-flight through 2 slots, every policy (plain, fixed block_size, threshold, greedy,
  deployed DSpark) emits, token for token, what ``decode.generate_autoregressive`` emits for
  the same request and seed, at temperature 0 and 1 with top-k / top-p.
* Stop ids, EOS and max_new_tokens inside the engine; input validation.
* No recompilation after warm-up while prompt lengths, budgets, policies and the set of
  active requests change (counted with ``jax.monitoring`` compile events).
* The scheduler's plan follows the host state it reads (confidences, room) and does not
  change when the draft token values on the device change (non-anticipation).

One engine (2 slots, block_size 3, buckets (1,1) (1,4) (2,2) (2,8)) is shared by every test so
that its handful of programs compile once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.decoding.speculative import generate_autoregressive
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target
from dspark_jax.models.weights import params_fingerprint
from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams, parse_policy
from dspark_jax.serving.engine.step_programs import ProgramCache

GAMMA = 3
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


@pytest.fixture(scope="module")
def target(stories260k):
    cfg, params, _ = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params))


@pytest.fixture(scope="module")
def tokenizer(stories260k):
    return stories260k[2]


@pytest.fixture(scope="module")
def drafter(target):
    """A drafter whose Markov head holds the target's bigram logits (W1 = I, W2 = bigram):
    good enough that drafts get accepted, so every acceptance path runs."""
    v = target.cfg.vocab_size
    cfg = DrafterConfig.for_target(
        target.cfg,
        block_size=GAMMA,
        num_layers=1,
        intermediate_size=64,
        markov_rank=v,
        target_fingerprint=target.fingerprint,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(0))
    x = np.stack([np.full(v, 1), np.arange(v)], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(2, dtype=np.int32), x.shape)
    bigram = np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1])
    d.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(bigram)
    d.final_norm[...] = d.final_norm[...] * 0.1
    rng = np.random.default_rng(0)
    d.conf_w[...] = jnp.asarray(rng.standard_normal(d.conf_w[...].shape).astype(np.float32) * 0.1)
    return d


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
def requests(tokenizer):
    return [Request(tokenizer.encode(t), SamplingParams(**s), f"r{i}") for i, (t, s) in enumerate(zip(TEXTS, SETTINGS))]


@pytest.fixture(scope="module")
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


def drive(engine, requests):
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
            assert o.num_accepted <= o.num_verified <= GAMMA
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        steps += 1
        assert steps < 1000
    assert engine.free_slots() == [0, 1]
    return toks, reasons


@pytest.mark.parametrize("policy", ["plain", "fixed:1", "fixed:3", "threshold:0.3", "greedy", "dspark"])
def test_policies_match_autoregressive(engine, requests, reference, policy):
    engine.set_policy(policy)
    engine.reset_metrics()
    toks, reasons = drive(engine, requests)
    for r in requests:
        ref, why = reference[r.request_id]
        assert toks[r.request_id] == ref, f"{policy} {r.request_id}: {toks[r.request_id]} != {ref}"
        assert reasons[r.request_id] == why
    m = engine.metrics()
    assert m["emitted_tokens"] == sum(len(t) for t in toks.values())
    assert m["accepted_tokens"] <= m["draft_tokens"]
    acc, reached = np.array(m["position_accepted"]), np.array(m["position_reached"])
    assert acc.sum() == m["accepted_tokens"] and np.all(acc <= reached) and np.all(reached[1:] <= acc[:-1])
    if policy == "plain":
        assert m["draft_tokens"] == 0 and m["draft_steps"] == 0
    if policy == "fixed:3":
        assert m["accepted_tokens"] > 0 and set(m["budget_hist"]) <= {1, 4, 2, 8}


@pytest.mark.parametrize("policy", ["plain", "fixed:3"])
def test_cancel_insert_and_sync_while_a_step_is_in_flight(engine, requests, reference, policy):
    """With ``overlap`` a step is queued on the device when ``generate`` returns (dispatched before
    the previous step's outputs were read). A request cancelled then yields
    nothing more, a request inserted into its slot gets exactly its own tokens, and ``sync``
    leaves the device state where the host's records say (anchor position = length - 1)."""
    engine.set_policy(policy)
    assert engine.overlap
    r0, r5, r2 = requests[0], requests[5], requests[2]
    engine.insert(engine.prefill(r0), 0)
    engine.insert(engine.prefill(r5), 1)
    toks: dict[str, list[int]] = {}

    def step():
        for o in engine.generate():
            toks.setdefault(o.request_id, []).extend(o.token_ids)

    for _ in range(3):
        step()
    engine.sync()  # the queued step's outputs come with the next generate()
    st = engine.device.state
    for slot in (0, 1):
        rec = engine.slots[slot]
        assert int(st.pos[rec.row]) == rec.length - 1 and int(st.anchor[rec.row]) == rec.tokens[-1]
    step()
    n5 = len(toks[r5.request_id])
    engine.free(1)  # cancelled while the next step is in flight
    engine.insert(engine.prefill(r2), 1)
    while engine.active_slots():
        step()
    assert len(toks[r5.request_id]) == n5 and toks[r5.request_id] == reference[r5.request_id][0][:n5]
    assert toks[r0.request_id] == reference[r0.request_id][0]
    assert toks[r2.request_id] == reference[r2.request_id][0]


@pytest.mark.parametrize("policy", ["fixed:3", "dspark"])
def test_speculative_steps_are_dispatched_before_the_previous_is_read(engine, requests, reference, policy, monkeypatch):
    """With ``overlap`` and ``speculative_ahead`` (opt-in) a speculative policy
    plans each step from what the host has read (the step in flight bounds each row's room) and
    dispatches it before reading the step in flight, as the plain policy does: nearly every read
    finds its successor queued (the dspark policy's: most, while drafting is not suspended), and
    every request's tokens and finish reason are still plain decoding's while rows join, finish
    and move."""
    from dspark_jax.serving.engine.inflight import InflightStep

    engine.set_policy(policy)
    engine.sync()
    engine.planner.idle_steps = 0
    monkeypatch.setattr(engine.planner, "speculative_ahead", True)  # opt-in
    queued = []  # at each read: the step queued behind it, if any
    read = InflightStep.read

    def recording_read(step, slots):
        queued.append(engine._inflight)
        return read(step, slots)

    monkeypatch.setattr(InflightStep, "read", recording_read)
    toks, reasons = drive(engine, requests)  # rows join, finish and move while a step is in flight
    for r in requests:
        assert (toks[r.request_id], reasons[r.request_id]) == reference[r.request_id], r.request_id
    ahead = sum(q is not None for q in queued)
    assert ahead >= (len(queued) - len(requests) if policy == "fixed:3" else len(queued) // 2)


@pytest.fixture(scope="module")
def plain_programs():
    """One program cache for the drafter-less engines (coupled and rejection mode compile to
    the same programs without a drafter)."""
    return ProgramCache()


def test_engine_without_drafter_matches_autoregressive(target, requests, reference, plain_programs):
    eng = Engine(
        target,
        None,
        EngineConfig(num_slots=2, cache_len=CACHE, policy="plain", prefill_buckets=(32,), prefill_chunk_tokens=0),
        program_cache=plain_programs,
    )
    toks, reasons = drive(eng, requests)
    for r in requests:
        assert toks[r.request_id] == reference[r.request_id][0]
        assert reasons[r.request_id] == reference[r.request_id][1]
    m = eng.metrics()
    assert m["suspended_steps"] == 0 and m["catchup_tokens"] == 0 and m["draft_steps"] == 0


def test_stop_ids_and_eos(engine, requests, reference):
    engine.set_policy("fixed:3")
    base = requests[5]
    ref = reference[base.request_id][0]
    stop = ref[6]
    first = ref.index(stop)
    req = Request(base.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=35, stop_ids=(stop,)), "s")
    toks, reasons = drive(engine, [req])
    assert toks["s"] == ref[: first + 1] and reasons["s"] == "stop"
    # an extra engine-wide EOS id behaves the same way
    eng2 = Engine(
        engine.target,
        engine.drafter,
        EngineConfig(
            num_slots=2,
            cache_len=CACHE,
            policy="fixed:3",
            buckets=(8,),
            prefill_buckets=(32,),
            eos_token_ids=(stop,),
            prefill_chunk_tokens=0,
        ),
        program_cache=engine.program_cache,
    )
    req = Request(base.prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=35), "e")
    toks, reasons = drive(eng2, [req])
    assert toks["e"] == ref[: first + 1] and reasons["e"] == "stop"


def test_no_recompile_after_warmup(engine, requests):
    from jax._src import monitoring

    events = []

    def listener(name, secs, **kw):
        if "compile" in name and "backend" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        before = engine.metrics()["compiles"]
        # logit_bias / logprobs / min_tokens are runtime flags of the same programs
        feats = [
            Request(
                r.prompt_ids,
                SamplingParams(
                    temperature=r.params.temperature,
                    max_new_tokens=12,
                    seed=i,
                    logit_bias=((5, -3.0),) * (i % 2),
                    logprobs=(3 if i % 3 else None),
                    min_tokens=4 * (i % 2),
                ),
                f"f{i}",
            )
            for i, r in enumerate(requests)
        ]
        for policy in ["dspark", "greedy", "plain", "threshold:0.9", "fixed:3"]:
            engine.set_policy(policy)
            drive(engine, requests[::-1])  # other prompt lengths / slot assignments / order
            drive(engine, feats)
        # cancel mid-flight (client disconnect) and start again
        engine.insert(engine.prefill(requests[2]), 1)
        engine.generate()
        engine.insert(engine.prefill(requests[0]), 0)
        engine.generate()
        engine.free(1)
        engine.free(1)
        engine.generate()
        engine.free(0)
        assert engine.free_slots() == [0, 1]
    finally:
        if hasattr(monitoring, "_unregister_event_duration_listener_by_callback"):
            monitoring._unregister_event_duration_listener_by_callback(listener)
    assert events == [], f"{len(events)} compilations after warm-up"
    assert engine.metrics()["compiles"] == before


def test_prefill_drafts_only_while_drafting(engine, requests, reference):
    """Prefill drafts the first block only while the engine drafts (its confidences are then
    known); a request prefilled without one and decoded speculatively is still exact."""
    engine.set_policy("plain")
    pre = engine.prefill(requests[0])
    assert pre.conf_logit is None
    engine.set_policy("fixed:3")
    drafted = engine.prefill(requests[1])
    assert drafted.conf_logit is not None and drafted.conf_logit.shape == (GAMMA,)
    engine.reset_metrics()
    engine.insert(pre, 0)
    toks = []
    while engine.active_slots():
        for o in engine.generate():
            toks += o.token_ids
    assert toks == reference[requests[0].request_id][0]
    assert engine.metrics()["draft_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_suspended_drafter_catches_up(engine, requests, reference, overlap):
    """Plain steps (and prefills) after ``suspend_after`` non-drafting steps skip the drafter
    context; when drafting resumes, the catch-up rebuilds it to what continuous upkeep would
    have written (same drafter KV at every confirmed position, same drafted confidences), and
    the output stays exact. With ``overlap`` the plain steps are dispatched before the previous
    step's outputs are read (the first suspended one marks where the context stops one token
    ahead of the host's records), and ``set_policy`` finishes the step in flight: one more plain,
    suspended step than without."""
    ref_eng = Engine(
        engine.target,
        engine.drafter,
        EngineConfig(
            num_slots=2,
            cache_len=CACHE,
            policy="plain",
            buckets=(8,),
            prefill_buckets=(32,),
            profile_iters=1,
            suspend_after=None,
            prefill_chunk_tokens=0,
        ),
        program_cache=engine.program_cache,
    )
    ref_eng.sps_table = engine.sps_table
    toks = {}
    for eng in (engine, ref_eng):
        eng.overlap = overlap
        eng.set_policy("plain")
        eng.reset_metrics()
        eng.planner.idle_steps = 0
        eng.insert(eng.prefill(requests[0]), 0)
        out = {0: [], 1: []}
        for i in range(9):
            if i == 7:  # joins while the drafter is suspended: prefill skips its context
                pre = eng.prefill(requests[2])
                assert pre.has_context is (eng is ref_eng)
                eng.insert(pre, 1)
            for o in eng.generate():
                out[o.slot] += o.token_ids
        eng.set_policy("fixed:3")
        for o in eng.generate():  # catch-up, then a step that drafts
            out[o.slot] += o.token_ids
        toks[id(eng)] = out
    m, m_ref = engine.metrics(), ref_eng.metrics()
    assert m["suspended_steps"] == 7 + overlap and m_ref["suspended_steps"] == 0
    # row 0: positions P0+2 .. P0+8 (7 tokens, 8 with overlap); row 1: its prompt and 2 generated tokens
    assert m["catchup_tokens"] == 7 + overlap + len(requests[2].prompt_ids) + 2 and m_ref["catchup_tokens"] == 0
    assert toks[id(engine)] == toks[id(ref_eng)]
    for slot in (0, 1):
        rec, rec_ref = engine.slots[slot], ref_eng.slots[slot]
        assert rec.length == rec_ref.length and rec.stale_from is None
        np.testing.assert_allclose(rec.z, rec_ref.z, rtol=1e-4, atol=1e-5)
        n = rec.length - 1
        for a, b in (
            (engine.device.state.dk, ref_eng.device.state.dk),
            (engine.device.state.dv, ref_eng.device.state.dv),
        ):
            np.testing.assert_allclose(
                np.asarray(a[:, rec.row, :n]), np.asarray(b[:, rec_ref.row, :n]), rtol=1e-4, atol=1e-5
            )
    for eng in (engine, ref_eng):
        while eng.active_slots():
            for o in eng.generate():
                toks[id(eng)][o.slot] += o.token_ids
        assert toks[id(eng)][0] == reference[requests[0].request_id][0]
        assert toks[id(eng)][1] == reference[requests[2].request_id][0]
    engine.overlap = True


def test_plan_follows_host_state_and_ignores_draft_values(engine, tokenizer):
    """The plan is a function of the host state it reads: each row's latest confidences and its
    room before ``max_new_tokens``. Raising / lowering one row's confidences or shrinking its room
    changes that row's verification length (and the bucket) as ``threshold:0.5`` says, while
    changing the drafted tokens on the device (non-anticipation) changes nothing."""
    engine.set_policy("threshold:0.5")
    sp = SamplingParams(temperature=0.0, max_new_tokens=30, min_tokens=30)  # no EOS: both rows stay
    for slot, text in enumerate(("One day", "The little dog")):
        engine.insert(engine.prefill(Request(tokenizer.encode(text), sp, f"p{slot}")), slot)
    engine.generate()  # both rows now hold a drafted block's confidences
    recs = [engine.slots[s] for s in (0, 1)]
    assert [rec.row for rec in recs] == [0, 1] and all(rec.z is not None for rec in recs)
    sure, unsure = np.full(GAMMA, 50.0), np.full(GAMMA, -50.0)
    # The shared engine has observed its random drafter's rejections; the observed/predicted
    # acceptance ratio would scale even z = 50 below the threshold. This test is about what the
    # plan reads, not calibration: ratio 1 while it runs.
    ratios, engine.calibrator.ratios = engine.calibrator.ratios, np.ones(GAMMA)

    def plan_with(z0, z1):
        recs[0].z, recs[1].z = z0.copy(), z1.copy()
        ell, rows, tokens, draft_next = engine.plan()
        return ell.tolist(), rows, tokens, draft_next

    assert plan_with(sure, sure) == ([GAMMA, GAMMA], 2, 8, True)
    assert plan_with(unsure, sure) == ([0, GAMMA], 2, 6, True)  # 2 + 3 tokens: budget 6 (below the ladder's 8)
    assert plan_with(sure, unsure) == ([GAMMA, 0], 2, 6, True)
    assert plan_with(unsure, unsure) == ([0, 0], 2, 2, True)
    end = recs[0].end
    recs[0].end = recs[0].length + 2  # room for the anchor's token and one draft
    assert plan_with(sure, sure) == ([1, GAMMA], 2, 6, True)
    recs[0].end = end
    before = plan_with(sure, unsure)
    st = engine.device.state
    engine.device.state = st._replace(
        draft=jnp.asarray(np.random.default_rng(0).integers(0, 512, st.draft.shape), jnp.int32)
    )
    assert plan_with(sure, unsure) == before
    engine.calibrator.ratios = ratios
    engine.free(0)
    engine.free(1)


def test_metrics_and_calibration_exported(engine, requests):
    engine.set_policy("fixed:3")
    engine.reset_metrics()
    drive(engine, requests[:3])
    m = engine.metrics()
    cal = m["calibration"]
    assert len(cal["temperatures"]) == GAMMA and all(t > 0 for t in cal["temperatures"])
    assert sum(cal["observations"]) > 0
    assert m["drafts"] > 0 and m["mean_accepted_length"] >= 1.0
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    assert engine.sps_table is not None and engine.sps_table.sps(2, 8, True) > 0


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
            parse_policy(p, GAMMA)
    with pytest.raises(DSparkInputError):
        parse_policy("dspark", 0)
    assert parse_policy("fixed:1", GAMMA) == ("fixed", 1) and parse_policy("threshold:0.5", 3) == ("threshold", 0.5)
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


# ------------------------------------------------------------------ issue 14: logit_bias, logprobs, min_tokens,
# verification modes, drafter kinds


@pytest.fixture(scope="module")
def full_logits(target):
    """``ids [CACHE] -> raw target logits [CACHE, V]`` of one full causal forward (no cache):
    the plain-decoding reference of the tests below."""
    graph, state = nnx.split(target)
    pos = jnp.arange(CACHE, dtype=jnp.int32)[None]
    fn = jax.jit(lambda st, ids: nnx.merge(graph, st)(ids[None], pos).logits[0])
    return lambda ids: np.asarray(fn(state, jnp.asarray(ids, jnp.int32)), np.float64)


def plain_reference(full_logits, target, prompt, sp: SamplingParams):
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


def test_logit_bias_matches_plain_decoding_with_bias(engine, target, tokenizer, full_logits):
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


def test_logprobs_are_target_raw_logprobs(engine, target, requests, full_logits):
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


def test_min_tokens_suppresses_stops(engine, target, requests, reference, full_logits):
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
        block_size=GAMMA,
        markov_rank=0,
        taps=eagle_taps(target.cfg),
        target_fingerprint=target.fingerprint,
    )
    with pytest.raises(DSparkInputError, match="eagle3") as e:
        Engine(target, build_drafter(cfg, nnx.Rngs(0)), EngineConfig(num_slots=1, cache_len=CACHE))
    assert "\n" not in str(e.value)
    with pytest.raises(DSparkInputError, match="verification"):
        Engine(target, None, EngineConfig(num_slots=1, cache_len=CACHE, policy="plain", verification="typical"))


def test_rejection_engine_without_drafter(target, requests, reference, plain_programs):
    """A drafter-less engine in rejection mode decodes plainly (no q is kept) with the coupled
    drafter-less engine's programs."""
    compiled = len(plain_programs)
    eng = Engine(
        target,
        None,
        EngineConfig(
            num_slots=2,
            cache_len=CACHE,
            policy="plain",
            prefill_buckets=(32,),
            verification="rejection",
            prefill_chunk_tokens=0,
        ),
        program_cache=plain_programs,
    )
    toks, reasons = drive_one(eng, requests[:1])
    assert toks["r0"] == reference["r0"][0] and eng.device.state.qprob is None
    assert compiled == 0 or (len(plain_programs) == compiled and eng.metrics()["compiles"] == 0)


@pytest.fixture(scope="module")
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


def test_rejection_verification_mode(rejection_engine, requests, reference):
    """verification="rejection": greedy output equals plain decoding exactly; at T>0 it runs
    with logit_bias (a banned token never appears) and accepts drafts. (Its output law is
    pinned by the shared distribution tests of tests/unit/test_verifier.py and by the PIT test
    below.)"""
    eng = rejection_engine
    assert eng.verification == "rejection" and eng.metrics()["verification"] == "rejection"
    greedy = [r for r in requests if r.params.temperature == 0.0]
    toks, reasons = drive_one(eng, greedy)
    for r in greedy:
        assert toks[r.request_id] == reference[r.request_id][0] and reasons[r.request_id] == reference[r.request_id][1]
    ban = reference[requests[1].request_id][0][:3]
    sampled = [
        Request(
            r.prompt_ids,
            SamplingParams(temperature=1.0, max_new_tokens=24, seed=i, logit_bias=tuple((t, -100.0) for t in ban)),
            f"t{i}",
        )
        for i, r in enumerate(requests[:4])
    ]
    eng.reset_metrics()
    toks, _ = drive_one(eng, sampled)
    assert all(t not in ban for v in toks.values() for t in v)
    m = eng.metrics()
    assert m["accepted_tokens"] > 0 and m["draft_tokens"] > m["accepted_tokens"]


def drive_one(engine, requests):
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


def test_rejection_mode_replays_verify(rejection_engine, tokenizer, full_logits):
    """verification="rejection" at T=1 (top-k 50), white box: every speculative step emits
    exactly what :func:`dspark_jax.decoding.verifier.verify` emits for the block on the device (drafts
    and their stored q), the target's p recomputed by plain full forwards at the block's
    positions, and the engine's round key ``fold_in(fold_in(PRNGKey(seed), P), 1)``. The
    output law then follows from verify's (tests/unit/test_verifier.py). Also: every draft has
    q > 0 under its stored q (it was drawn from it). Catches a misaligned p, q or key, which
    greedy decoding cannot see."""
    from dspark_jax.decoding.verifier import verify
    from dspark_jax.models.sampling import process_logits, sampling_arrays

    eng = rejection_engine
    eng.reset_metrics()
    eng.overlap = False  # white box: the device state read before each step is the host's
    samp = sampling_arrays(1, 1.0, 50, 1.0)
    checked = 0
    for seed, text in enumerate(["Lily went to the park and saw a big", "Once upon a time", "The sun was"]):
        prompt = tokenizer.encode(text)
        sp = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=40, seed=seed)
        eng.insert(eng.prefill(Request(prompt, sp, "x")), 0)
        while eng.active_slots():
            rec = eng.slots[0]
            st = eng.device.state
            drafts, q = np.asarray(st.draft[0]), np.asarray(st.qprob[0])
            pos, anchor = int(st.pos[0]), int(st.anchor[0])
            ctx, n_pending = list(rec.tokens), len(rec.pending)  # the prefill token rides the first step
            assert pos == len(ctx) - 1 and anchor == ctx[-1]
            (o,) = eng.generate()
            ell = o.num_verified
            if ell == 0 or o.finished:
                continue
            np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
            assert np.all(q[np.arange(GAMMA), drafts[:GAMMA]] > 0)
            seq = np.zeros(CACHE, np.int32)
            seq[: len(ctx) + GAMMA] = ctx + drafts[:GAMMA].tolist()
            lg = full_logits(seq)[pos : pos + GAMMA + 1]
            p = process_logits(jnp.asarray(lg[None], jnp.float32), samp)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), pos), 1)
            res = verify(
                key[None], jnp.asarray(drafts[None, :GAMMA]), jnp.asarray(q[None]), p, jnp.asarray([ell], jnp.int32)
            )
            want = [int(t) for t in np.asarray(res.tokens[0]) if t >= 0]
            assert o.token_ids[n_pending:] == want and o.num_accepted == int(res.num_accepted[0])
            checked += 1
    assert checked >= 10 and eng.metrics()["accepted_tokens"] > 0
    eng.overlap = True


def test_sps_table_is_stored_and_reused_by_a_new_engine(engine, target, drafter, tmp_path, monkeypatch):
    """Issue 26: a second engine of the same shapes (a later process) adopts the SPS table the
    first profiled, from disk, instead of profiling again; the weights' fingerprint is not part
    of the key (costs do not depend on weight values)."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    engine.set_policy("dspark")
    table = engine.profile_sps(iters=1)
    assert list((tmp_path / "costs").glob("sps_table-*.json"))
    cfg = EngineConfig(
        num_slots=2, cache_len=CACHE, policy="dspark", buckets=(8,), prefill_buckets=(32,), suspend_after=2
    )
    twin = Engine(target, drafter, cfg, program_cache=engine.program_cache)
    twin.ensure_sps_table()  # what warmup() does after compiling
    assert twin.table_source == "stored" and twin.sps_table is not None
    assert twin.sps_table.seconds == table.seconds and twin.sps_table.matches(twin.device.meta())
    assert table.spans() == [CACHE]  # one span by default: the (one-block) cache a step of inactive rows reads
    monkeypatch.setenv("DSPARK_REFRESH_COSTS", "1")
    assert twin.device.stored_table() is None  # a refresh measures again


def test_sps_is_profiled_at_the_spans_asked_for(target, tmp_path):
    """Issue 24: the SPS table is a function of the attention span. At one KV block every row
    is inactive; beyond, row 0 runs live with its anchor in the block below the span (reset
    before every timing, restored after; an idle engine only). A table file of the previous
    format is refused with a one-line error. (The step is faked: no program to compile.)"""
    eng = Engine(
        target,
        None,
        EngineConfig(num_slots=2, cache_len=600, policy="plain", profile_spans=[700, 1, 300], prefill_chunk_tokens=0),
    )
    assert eng.profile_spans == (256, 512, 600)
    seen = []

    def fake_step(rows, tokens, ell, active, draft_next):
        seen.append((bool(active[0]), int(np.asarray(eng.device.state.pos)[0])))
        eng.device.state = eng.device.state._replace(pos=eng.device.state.pos + 1)  # a step advances the row

    eng.device.run_step = fake_step
    table = eng.device.profile([(1, 1), (2, 2)], iters=2, spans=eng.profile_spans)
    assert table.spans() == [256, 512, 600] and table.covers_steps([(1, 1), (2, 2)], [False], [256, 512, 600])
    # warm calls, then 2 rotated rounds: row 0's position reset before each (inactive rows at their own)
    assert len(seen) == 3 * 2 * 3 and set(seen) == {(False, 0), (True, 256), (True, 512)}
    assert seen[:6] == [(False, 0), (False, 0), (True, 256), (True, 256), (True, 512), (True, 512)]
    assert np.asarray(eng.device.state.pos).tolist() == [0, 0]  # restored
    with pytest.raises(DSparkInputError, match="idle engine"):
        eng.device.profile([(1, 1)], iters=1, spans=[512], busy=1)
    assert eng.device.spans_now(eng.profile_spans, busy=1) == (256,)
    old = tmp_path / "sps.json"
    old.write_text('{"meta": {}, "entries": [{"rows": 1, "tokens": 1, "draft": false, "sps": 9.0}]}')
    with pytest.raises(DSparkInputError, match="previous format"):
        Engine(target, None, EngineConfig(num_slots=1, cache_len=300, policy="plain"), sps_table=old)


def test_dspark_policy_reports_its_decision(engine, requests, caplog):
    """The dspark policy exposes why it drafts or not (expected tokens/s both ways, the priced
    catch-up) and logs one line when it suspends and when it resumes drafting."""
    import logging

    engine.set_policy("dspark")
    engine.reset_metrics()
    with caplog.at_level(logging.INFO, logger="dspark_jax.serving.engine"):
        drive(engine, requests)  # records decisions (whether it drafts depends on timings)
        engine.set_policy("plain")  # never drafts: suspends after suspend_after=2 steps
        drive(engine, requests[:1])
        engine.set_policy("fixed:3")  # always drafts: resumes
        drive(engine, requests[:1])
        engine.set_policy("dspark")
    dec = engine.metrics()["scheduler_decision"]
    assert dec is not None and dec["tokens_per_s_drafting"] > 0 and dec["tokens_per_s_plain"] > 0
    wins = dec["tokens_per_s_drafting"] > dec["tokens_per_s_plain"]
    if dec["catchup_seconds"] == 0:
        assert dec["draft"] == wins
    else:  # resuming must also pay back the catch-up
        assert wins or not dec["draft"]
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_jax.serving.engine"]
    assert any(m.startswith("suspending drafting") and "tokens/s drafting vs" in m for m in lines), lines
    assert any(m.startswith("resuming drafting") for m in lines), lines


def test_program_cache_is_a_bounded_lru():
    """The engine's compile cache keeps at most ``max_size`` executables, dropping the least
    recently used; engine signatures get stable small ids."""
    cache = ProgramCache(max_size=2)
    a, b = cache.intern(("sig", 1)), cache.intern(("sig", 2))
    assert a != b and cache.intern(("sig", 1)) == a
    cache.put((a, "step"), "x")
    cache.put((a, "move"), "y")
    assert cache.get((a, "step")) == "x"  # now the most recently used
    cache.put((b, "step"), "z")  # drops (a, "move")
    assert (a, "move") not in cache and cache.get((a, "move")) is None
    assert len(cache) == 2 and cache.get((a, "step")) == "x" and cache.get((b, "step")) == "z"
    with pytest.raises(ValueError):
        ProgramCache(max_size=0)
