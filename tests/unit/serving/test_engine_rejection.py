"""The serving engine with rejection-sampling verification (the paper's): same output law as
plain decoding, the verify step replayed on the host (the shared models: conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams

BLOCK_SIZE, CACHE = 3, 64  # the shared engine's (conftest.py)


def test_rejection_engine_without_drafter(target, requests, reference, plain_programs, drive_one):
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


def test_rejection_verification_mode(rejection_engine, requests, reference, drive_one):
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
            assert np.all(q[np.arange(BLOCK_SIZE), drafts[:BLOCK_SIZE]] > 0)
            seq = np.zeros(CACHE, np.int32)
            seq[: len(ctx) + BLOCK_SIZE] = ctx + drafts[:BLOCK_SIZE].tolist()
            lg = full_logits(seq)[pos : pos + BLOCK_SIZE + 1]
            p = process_logits(jnp.asarray(lg[None], jnp.float32), samp)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), pos), 1)
            res = verify(
                key[None],
                jnp.asarray(drafts[None, :BLOCK_SIZE]),
                jnp.asarray(q[None]),
                p,
                jnp.asarray([ell], jnp.int32),
            )
            want = [int(t) for t in np.asarray(res.tokens[0]) if t >= 0]
            assert o.token_ids[n_pending:] == want and o.num_accepted == int(res.num_accepted[0])
            checked += 1
    assert checked >= 10 and eng.metrics()["accepted_tokens"] > 0
    eng.overlap = True
