"""Tiny random targets (V = 16) where acceptance is high, so every path of the speculative loop runs:
greedy speculative decoding equals plain decoding on the standard batch (max_new_tokens reached
inside a block, the context end, one-token prompts), with fixed lengths below the block, ``auto``,
a draft vocabulary, DFlash; batch-independence (at T = 0 and, with per-request seeds, bit for bit
at T = 1); NaN weights."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target
from dspark_jax.training.data import draft_vocabulary
from tests.unit.decoding.helpers import (
    ALONE_ROWS,
    CHEAP,
    COSTLY,
    MAX_NEW,
    MAX_POS,
    PROMPTS,
    SEEDS,
    TINY,
    V,
    ar_std,
    assert_same_outputs,
    bigram_table,
    check_stats,
    cost_table,
    random_drafter,
    spec_std,
    tiny_params,
)


def test_standard_batch_shapes(ar_peaked):
    """The edge rows behave as designed (the checks below rely on it)."""
    gens = ar_peaked.generations
    assert len(gens[0].token_ids) == MAX_POS - 60 and gens[0].finish_reason == "length"
    assert len(gens[1].token_ids) == 1 and gens[1].finish_reason == "length"
    for i in range(2, 16):
        assert len(gens[i].token_ids) == MAX_NEW[i] and gens[i].finish_reason == "length"
    # rows 2-6 share a prompt: greedy outputs are prefixes of each other
    for i in range(2, 6):
        assert gens[i].token_ids == gens[6].token_ids[: MAX_NEW[i]]
    check_stats(ar_peaked, 1, speculative=False)


@pytest.mark.exactness
@pytest.mark.parametrize("name,target_name", [("random", "peaked"), ("bigram", "peaked"), ("perfect", "pure_bigram")])
def test_tiny_speculative_equals_autoregressive(name, target_name, drafters, request):
    """Greedy speculative == greedy AR on every row of the standard batch: includes the
    context end (b/c), max_new_tokens 1..13 inside blocks, a one-token prompt."""
    target = request.getfixturevalue(target_name)
    ar = request.getfixturevalue("ar_peaked" if target_name == "peaked" else "ar_pure")
    sp = spec_std(target, drafters[name], temperature=0)
    assert_same_outputs(ar, sp)
    check_stats(sp, 4)
    total = lambda f: sum(getattr(g, f) for g in sp.generations)
    assert total("num_draft_tokens") > 0
    rate = total("num_accepted") / total("num_draft_tokens")
    if name == "bigram":
        assert rate > 0.2, rate  # the accept path is well covered
    if name == "perfect":
        assert rate == 1.0, rate
        # a full block of block_size drafts + bonus per pass wherever the room allows it
        g = sp.generations[8]
        assert g.num_target_passes == -(-(len(g.token_ids) - 1) // 5)


@pytest.mark.exactness
@pytest.mark.parametrize("table", [CHEAP, COSTLY], ids=["cheap", "costly"])
def test_auto_num_speculative_tokens_greedy(table, peaked, drafters, ar_peaked):
    """num_speculative_tokens="auto": greedy output equals AR whatever widths it picks."""
    sp = spec_std(peaked, drafters["bigram"], temperature=0, num_speculative_tokens="auto", cost_table=table)
    assert_same_outputs(ar_peaked, sp)
    passes = sum(g.num_target_passes for g in sp.generations)
    verified = sum(g.num_draft_tokens for g in sp.generations)
    assert 0 < verified < 4 * passes if table is COSTLY else verified > 2 * passes, (verified, passes)
    check_stats(sp, 4)
    # passes by compiled width: only the table's widths, and the costly table picks narrower ones
    hist = np.sum([g.verify_width_rounds for g in sp.generations], axis=0)
    assert hist.sum() == passes and hist[3] == 0, hist
    assert (hist[:4].sum() > 0) if table is COSTLY else (hist[4] > hist[:4].sum()), hist


@pytest.mark.exactness
def test_auto_suspended_drafting_runs_plain_rounds(peaked, drafters, ar_peaked):
    """A drafter that never pays, its drafting round priced at 50 plain steps: not even the first
    round drafts (auto_verify.first_round_drafts), the rounds run as plain steps in a loop of their
    own and rows finish inside it at their own lengths. Greedy output equals AR; every round is a
    width-0 pass (no probe for 50 / PROBE_BUDGET = 2,500 rounds: auto_verify.probe_floor)."""
    never = cost_table((1.0, 1.5, 2.0, 3.0), 50.0)
    sp = spec_std(peaked, drafters["bigram"], temperature=0, num_speculative_tokens="auto", cost_table=never)
    assert_same_outputs(ar_peaked, sp)
    check_stats(sp, 4)
    assert max(g.num_target_passes for g in sp.generations) > 9  # past the first probe's unpriced wait
    for i, g in enumerate(sp.generations):
        if g.num_target_passes == 0:
            continue
        assert g.num_drafting_rounds == 0 and g.num_draft_tokens == 0, (i, g.num_drafting_rounds)
        assert g.verify_width_rounds[0] == g.num_target_passes, (i, g.verify_width_rounds)


@pytest.mark.exactness
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_auto_suspended_rounds_statistics_and_log(temperature, peaked, drafters):
    """The suspended stretches' closed-form bookkeeping, against the round log: with a drafter that
    never pays (drafting cheap, 0.1 of a step, verification dear), a row drafts exactly at rounds
    8, 25, 58 (not in the first round: auto_verify.first_round_drafts; probes after 8, 16, 32 rounds
    without drafts), which are the only rows of its log
    with confidences; every other round is a width-0 pass that verifies and accepts nothing; the
    statistics are the log's sums."""
    never = cost_table((1.0, 50.0, 60.0, 70.0), 0.1)
    kw = dict(temperature=temperature, num_speculative_tokens="auto", cost_table=never)
    sp = spec_std(peaked, drafters["bigram"], record_rounds=True, **kw)
    check_stats(sp, 4)
    plain = spec_std(peaked, drafters["bigram"], **kw)  # the log leaves the tokens and statistics alone
    for i, (g, h) in enumerate(zip(sp.generations, plain.generations)):
        n, log = g.num_target_passes, g.rounds
        assert (g.token_ids, g.num_target_passes, g.num_draft_tokens) == (
            h.token_ids,
            h.num_target_passes,
            h.num_draft_tokens,
        )
        assert g.verify_width_rounds == h.verify_width_rounds and g.position_reached == h.position_reached, i
        probes = [r for r in (8, 25, 58) if r < n]
        drafted = [r for r in range(n) if np.any(log["conf_logit"][r] != 0)]
        assert drafted == probes and g.num_drafting_rounds == len(probes), (i, drafted, n)
        quiet = np.setdiff1d(np.arange(n), probes)
        assert not np.any(log["verified"][quiet]) and not np.any(log["accepted"][quiet]), i
        assert g.num_draft_tokens == log["verified"].sum() and g.num_accepted == log["accepted"].sum(), i
        assert sum(g.verify_width_rounds) == n and sum(g.verify_width_rounds[1:]) <= len(probes), i


@pytest.mark.exactness
@pytest.mark.parametrize("block_size", [1, 2])
def test_gamma_smaller_than_block(block_size, peaked, drafters, ar_peaked):
    sp = spec_std(peaked, drafters["bigram"], temperature=0, num_speculative_tokens=block_size)
    assert_same_outputs(ar_peaked, sp)
    check_stats(sp, block_size)
    assert max(g.tau for g in sp.generations if g.num_target_passes) <= block_size + 1
    for g in sp.generations:  # a fixed length below the block runs a pass of that width (not block-wide)
        assert g.verify_width_rounds == [0] * block_size + [g.num_target_passes] + [0] * (4 - block_size)
        assert g.num_drafting_rounds == g.num_target_passes
    assert sum(g.num_accepted for g in sp.generations) > 0


@pytest.mark.exactness
def test_draft_vocabulary_and_width_greedy(peaked, ar_peaked):
    """A drafter that drafts over 6 of the 16 ids and is wider than the target decodes
    exactly like the target at T=0 (the output law at T>0: tests/unit/test_drafter_law.py)."""
    # The draft vocabulary of the AR outputs (as the trainer builds it from its data), and a
    # bigram Markov head restricted to it, so that drafts are often accepted.
    toks = [[0] + g.token_ids for g in ar_peaked.generations]
    width = max(map(len, toks))
    data = {
        "tokens": np.array([t + [0] * (width - len(t)) for t in toks]),
        "lengths": np.array(list(map(len, toks))),
        "prompt_lengths": np.ones(len(toks), np.int64),
    }
    ids = draft_vocabulary(data, 6, V)
    d = random_drafter(peaked, seed=9, draft_vocab=ids, width=48, markov_rank=7)
    # W1 has a row per target token (markov_w1_rows="target"), W2 a column per draft token.
    assert d.markov_w2.shape == (7, 6) and d.markov_w1.shape == (V, 7) and d.proj_out.shape == (48, 32)
    big = bigram_table(peaked)
    row = np.full(V, 6)  # W1[v]: one-hot of v's draft index, or of the shared row 6 outside the vocabulary
    row[np.asarray(ids)] = np.arange(6)
    d.markov_w1[...] = jnp.eye(7, dtype=jnp.float32)[row]
    d.markov_w2[...] = jnp.asarray(np.concatenate([big[ids][:, ids], big[:, ids].mean(0, keepdims=True)]))
    d.final_norm[...] = d.final_norm[...] * 0.1
    sp = spec_std(peaked, d, temperature=0)
    assert_same_outputs(ar_peaked, sp)
    check_stats(sp, 4)
    assert sum(g.num_accepted for g in sp.generations) > 0


@pytest.mark.exactness
def test_dflash_drafter(peaked, ar_peaked):
    d = random_drafter(peaked, variant="dflash", seed=7)
    assert d.markov_w2 is None and d.cfg.num_block_positions == 5
    sp = spec_std(peaked, d, temperature=0)
    assert_same_outputs(ar_peaked, sp)
    check_stats(sp, 4)


@pytest.mark.exactness
def test_context_limit(peaked, drafters, ar_peaked):
    """(c) generation stops at the context end without error; a prompt that fills the
    context is refused."""
    sp = spec_std(peaked, drafters["bigram"], temperature=0)
    for res in (ar_peaked, sp):
        assert len(PROMPTS[0]) + len(res.generations[0].token_ids) == MAX_POS
        assert len(res.generations[1].token_ids) == 1
    for fn in (
        lambda p: generate_autoregressive(peaked, p, max_new_tokens=4),
        lambda p: generate_speculative(peaked, drafters["bigram"], p, max_new_tokens=4, num_speculative_tokens=4),
    ):
        for n in (MAX_POS, MAX_POS + 5):
            with pytest.raises(DSparkInputError, match="context"):
                fn([[3] * n])


@pytest.mark.exactness
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_alone_equals_in_batch(temperature, peaked, drafters):
    """(e) a request's output does not depend on its batch-mates: alone (batch of 1) and
    in the standard batch of 16 (other prompts, max_new_tokens and seeds) it is identical,
    also at T = 1 (randomness is per request)."""
    kw = dict(temperature=temperature)
    batch_ar = ar_std(peaked, **kw)
    batch_sp = spec_std(peaked, drafters["bigram"], **kw)
    for i in ALONE_ROWS:
        one = dict(max_new_tokens=MAX_NEW[i], seed=SEEDS[i], **kw)
        a = generate_autoregressive(peaked, [PROMPTS[i]], **one).generations[0]
        s = generate_speculative(peaked, drafters["bigram"], [PROMPTS[i]], num_speculative_tokens=4, **one)
        s = s.generations[0]
        assert a.token_ids == batch_ar.generations[i].token_ids, f"row {i} AR"
        assert s.token_ids == batch_sp.generations[i].token_ids, f"row {i} speculative"
        assert dataclasses.asdict(s) == dataclasses.asdict(batch_sp.generations[i])
        if temperature == 0:
            assert s.token_ids == a.token_ids
    if temperature > 0:
        check_stats(batch_sp, 4)
        # different seeds give different samples (the seeds are really used)
        again = ar_std(peaked, temperature=temperature)
        assert [g.token_ids for g in again.generations] == [g.token_ids for g in batch_ar.generations]
        other = generate_autoregressive(
            peaked, PROMPTS, max_new_tokens=MAX_NEW, seed=[s + 1 for s in SEEDS], temperature=temperature
        )
        assert [g.token_ids for g in other.generations] != [g.token_ids for g in batch_ar.generations]


@pytest.mark.exactness
def test_temperature_whose_scaled_logits_overflow_decodes_greedily(peaked, drafters, ar_peaked):
    """Issue 27: T = 2e-38 (``logits / T`` overflows float32) decodes exactly as T = 0, plainly
    and speculatively (it used to emit token 0), also beside ordinary sampled rows."""
    greedy = [g.token_ids for g in ar_peaked.generations]
    temps = [2e-38] * 15 + [1.0]
    for res in (ar_std(peaked, temperature=temps), spec_std(peaked, drafters["bigram"], temperature=temps)):
        assert [g.token_ids for g in res.generations][:15] == greedy[:15]


@pytest.mark.exactness
def test_nan_weights(drafters):
    """(i) NaN weights -> FloatingPointError with a clear message (not garbage tokens)."""
    p = tiny_params("peaked")
    p["layers"]["wq"][1, 3, 5] = np.nan
    bad = Target(TINY, p)
    with pytest.raises(FloatingPointError, match="NaN"):
        ar_std(bad, temperature=0)
    with pytest.raises(FloatingPointError, match="NaN"):
        spec_std(bad, drafters["bigram"], temperature=0)
    with pytest.raises(FloatingPointError, match="NaN"):
        spec_std(bad, drafters["bigram"], temperature=1.0)
