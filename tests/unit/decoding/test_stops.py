"""Stop ids through the loops: a stop inside a verified block ends the output exactly there and
nothing after it is counted; tau and acceptance agree between the decode loop and the serving
engine / server for the same requests."""

from __future__ import annotations

import pytest

from tests.unit.decoding.helpers import (
    MAX_NEW,
    PROMPTS,
    SEEDS,
    ar_std,
    check_stats,
    spec_std,
    stop_token,
)


@pytest.mark.exactness
@pytest.mark.parametrize("name,target_name", [("bigram", "peaked"), ("perfect", "pure_bigram")])
def test_stop_inside_block(name, target_name, drafters, request):
    """(a) a stop id hit inside a verified block (with the perfect drafter always an
    accepted draft followed by more accepted drafts): the output ends exactly at its first
    occurrence, equals AR truncated there, finish_reason "stop", and nothing after it is
    counted."""
    target = request.getfixturevalue(target_name)
    ar = request.getfixturevalue("ar_peaked" if target_name == "peaked" else "ar_pure")
    stop = stop_token(ar)
    sp = spec_std(target, drafters[name], temperature=0, stop_ids=[stop])
    ar_stop = ar_std(target, temperature=0, stop_ids=[stop])
    n_stopped = 0
    for i, (a, s, a2) in enumerate(zip(ar.generations, sp.generations, ar_stop.generations)):
        ids = a.token_ids
        if stop in ids:
            want, reason = ids[: ids.index(stop) + 1], "stop"
            n_stopped += 1
        else:
            want, reason = ids, "length"
        assert s.token_ids == want and s.finish_reason == reason, f"row {i}"
        assert a2.token_ids == want and a2.finish_reason == reason, f"row {i}"
    assert n_stopped >= 4
    check_stats(sp, 4)
    check_stats(ar_stop, 1, speculative=False)


@pytest.mark.exactness
def test_perfect_drafter_acceptance_with_stop(pure_bigram, drafters, ar_pure):
    """(f) drafts after a stop are not counted: a perfect drafter keeps acceptance 1."""
    stop = stop_token(ar_pure)
    sp = spec_std(pure_bigram, drafters["perfect"], temperature=0, stop_ids=[stop])
    for i, g in enumerate(sp.generations):
        if g.num_draft_tokens:
            assert g.acceptance_rate == 1.0, (
                f"row {i}: perfect drafter, acceptance {g.num_accepted}/{g.num_draft_tokens} "
                f"(finish {g.finish_reason}, {len(g.token_ids)} tokens)"
            )


@pytest.mark.exactness
def test_one_tau_in_decode_engine_and_server(pure_bigram, drafters, ar_pure):
    """One definition of tau and acceptance: with a perfect drafter and a stop token inside
    accepted blocks, the Python API's numbers (decode, block_size G) equal the server's
    ``spec_decode`` for the same requests served by the engine verifying G drafts per step."""
    from types import SimpleNamespace

    from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams
    from dspark_jax.serving.http.detokenize import OutputState
    from dspark_jax.serving.http.engine_loop import TrackedRequest, event_from_output

    stop = stop_token(ar_pure)
    d = drafters["perfect"]
    num_verified = d.cfg.block_size
    # the same call as test_perfect_drafter_acceptance_with_stop (one compiled loop)
    res = spec_std(pure_bigram, d, temperature=0, stop_ids=[stop]).generations
    rows = [i for i, g in enumerate(res) if len(PROMPTS[i]) < 32 and MAX_NEW[i] > 8][:4]
    prompts, max_new, seeds, ref = (
        [PROMPTS[i] for i in rows],
        [MAX_NEW[i] for i in rows],
        [SEEDS[i] for i in rows],
        [res[i] for i in rows],
    )
    inside = [
        g.finish_reason == "stop" and len(g.token_ids) - 1 < g.num_target_passes * (num_verified + 1) for g in ref
    ]
    assert any(inside), "no stop inside a block: pick another stop token"
    eng = Engine(
        pure_bigram,
        d,
        EngineConfig(
            num_slots=1,
            cache_len=64,
            policy=f"fixed:{num_verified}",
            eos_token_ids=(),
            buckets=(num_verified + 1,),
            row_buckets=(1,),
            prefill_buckets=(32,),
            seed_calibration=False,
            profile_iters=1,
            suspend_after=None,
            prefill_chunk_tokens=0,
        ),
    )
    tok = SimpleNamespace(detokenizer=lambda skip_special_tokens=True: SimpleNamespace(step=lambda i: ""))
    for p, m, sd, g in zip(prompts, max_new, seeds, ref):
        req = Request(list(p), SamplingParams(temperature=0.0, seed=sd, max_new_tokens=m, stop_ids=(stop,)), "r")
        eng.insert(eng.prefill(req), 0)
        st = OutputState(TrackedRequest(req, None, None), tok)
        first = True
        while st.finish_reason is None:
            for out in eng.generate():
                st.feed(event_from_output(out, first))
                first = False
        assert st.token_ids == g.token_ids and st.finish_reason == g.finish_reason
        spec = st.spec_decode()
        assert spec["num_steps"] == g.num_target_passes
        assert (spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (g.num_draft_tokens, g.num_accepted)
        if g.num_target_passes:
            assert spec["tau"] == pytest.approx(g.tau) == pytest.approx((len(g.token_ids) - 1) / g.num_target_passes)
            assert spec["acceptance_rate"] == g.acceptance_rate == 1.0
        else:
            assert spec["tau"] is None
