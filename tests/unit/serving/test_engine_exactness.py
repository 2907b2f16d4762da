"""The serving engine (:mod:`dspark_jax.serving.engine`) on stories260K, exactness across batching:
with requests joining and leaving mid-flight through 2 slots, every policy (plain, fixed, threshold,
greedy, deployed DSpark) emits, token for token, what ``generate_autoregressive`` emits for the same
request and seed, at temperature 0 and 1 with top-k / top-p (Gumbel-coupled verification); with a
step in flight; without a drafter; with stop ids and EOS; with the drafter suspended and caught up.
No recompilation after warm-up (counted with ``jax.monitoring`` compile events). The scheduler's
plan follows the host state it reads and not the draft token values on the device
(non-anticipation). The shared engine: conftest.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams

BLOCK_SIZE, CACHE = 3, 64  # the shared engine's (conftest.py)


@pytest.mark.parametrize("policy", ["plain", "fixed:1", "fixed:3", "threshold:0.3", "greedy", "dspark"])
def test_policies_match_autoregressive(engine, requests, reference, policy, drive):
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
def test_speculative_steps_are_dispatched_before_the_previous_is_read(
    engine, requests, reference, policy, monkeypatch, drive
):
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


def test_engine_without_drafter_matches_autoregressive(target, requests, reference, plain_programs, drive):
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


def test_stop_ids_and_eos(engine, requests, reference, drive):
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


def test_no_recompile_after_warmup(engine, requests, drive):
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
    assert drafted.conf_logit is not None and drafted.conf_logit.shape == (BLOCK_SIZE,)
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
    sure, unsure = np.full(BLOCK_SIZE, 50.0), np.full(BLOCK_SIZE, -50.0)
    # The shared engine has observed its random drafter's rejections; the observed/predicted
    # acceptance ratio would scale even z = 50 below the threshold. This test is about what the
    # plan reads, not calibration: ratio 1 while it runs.
    ratios, engine.calibrator.ratios = engine.calibrator.ratios, np.ones(BLOCK_SIZE)

    def plan_with(z0, z1):
        recs[0].z, recs[1].z = z0.copy(), z1.copy()
        ell, rows, tokens, draft_next = engine.plan()
        return ell.tolist(), rows, tokens, draft_next

    assert plan_with(sure, sure) == ([BLOCK_SIZE, BLOCK_SIZE], 2, 8, True)
    assert plan_with(unsure, sure) == ([0, BLOCK_SIZE], 2, 6, True)  # 2 + 3 tokens: budget 6 (below the ladder's 8)
    assert plan_with(sure, unsure) == ([BLOCK_SIZE, 0], 2, 6, True)
    assert plan_with(unsure, unsure) == ([0, 0], 2, 2, True)
    end = recs[0].end
    recs[0].end = recs[0].length + 2  # room for the anchor's token and one draft
    assert plan_with(sure, sure) == ([1, BLOCK_SIZE], 2, 6, True)
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
