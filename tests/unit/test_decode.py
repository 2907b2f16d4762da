"""Exactness tests of the decode loops (:mod:`dspark_jax.decoding.speculative`).

docs/design.md#verification and docs/design.md#metrics, through the REAL jitted loops:

* stories260K (a real trained model): greedy autoregressive decoding reproduces the
  published golden ids; speculative decoding equals it token for token on 50 TinyStories
  prompts with several drafters (random with a random Markov head, a bigram "oracle",
  and -- marked slow -- the quickly trained one of ``conftest.stories260k_export``).
* tiny random targets (V = 16) where acceptance is high, so every path of the loop runs:
  stops inside accepted blocks, max_new_tokens reached inside a block, the context end,
  block_size = 1 and block_size < block size, DFlash, batch-independence (at T = 0 and, with
  per-request seeds, bit for bit at T = 1), metric invariants, input errors, NaN weights.
* the law of the first generated tokens at T > 0 (plain and top-k/top-p) from thousands
  of seeds, against the exact law enumerated from the target, for both loops.

Compilation dominates the run time, so calls share a few shape signatures: every tiny
call uses the 16-row "standard batch" (same prompt buffer, cache and step count), and all
tiny targets / drafters share one config (their weights are arguments, not constants).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.drafters.base import check_compatible
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.sampling import process_logits, sampling_arrays
from dspark_jax.models.target import Target, random_params
from dspark_jax.training.data import draft_vocabulary

GOLDEN = [
    1,
    403,
    407,
    261,
    378,
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
    433,
    426,
    385,
    328,
    432,
    358,
    394,
    261,
    370,
    432,
]


# ======================================================================================
# Drafters (swappable: every helper takes any DSparkDrafter built for the target)
# ======================================================================================
def random_drafter(
    target: Target,
    *,
    block_size=4,
    seed=0,
    variant="dspark",
    markov_rank=None,
    num_layers=1,
    intermediate_size=64,
    scale=0.5,
    draft_vocab=None,
    width=0,
) -> DSparkDrafter:
    """A randomly initialised drafter whose zero-initialised parts (residual output
    projections, Markov W2, confidence weights) are randomised too, so that the
    backbone, the Markov correction and the confidence head all act. ``draft_vocab``:
    target ids of a reduced draft vocabulary; ``width``: a backbone width other than H."""
    t = target.cfg
    cfg = DrafterConfig.for_target(
        t,
        block_size=block_size,
        variant=variant,
        num_layers=num_layers,
        intermediate_size=intermediate_size,
        markov_rank=t.vocab_size if markov_rank is None else markov_rank,
        target_fingerprint=getattr(target, "fingerprint", ""),
        draft_vocab_size=len(draft_vocab) if draft_vocab is not None else 0,
        width=width,
    )
    d = DSparkDrafter(cfg, nnx.Rngs(seed))
    if draft_vocab is not None:
        d.set_draft_vocab(draft_vocab)
    rng = np.random.default_rng(seed + 1000)

    def rnd(var, s):
        var[...] = jnp.asarray(rng.standard_normal(var[...].shape).astype(np.float32) * s)

    rnd(d.layers["wo"], scale / np.sqrt(cfg.num_heads * cfg.head_dim))
    rnd(d.layers["w_down"], scale / np.sqrt(cfg.intermediate_size))
    if cfg.markov:
        rnd(d.markov_w2, 2.0)
    if cfg.has_confidence:
        rnd(d.conf_w, 0.3)
    return d


def bigram_table(target: Target, bos: int | None = None) -> np.ndarray:
    """``[V, V]`` target logits of the next token given a one-token context ``[x]``
    (or ``[bos, x]``)."""
    v = target.cfg.vocab_size
    x = np.arange(v, dtype=np.int32)[:, None]
    if bos is not None:
        x = np.concatenate([np.full_like(x, bos), x], axis=1)
    pos = np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape)
    return np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1])


def bigram_drafter(target: Target, *, alpha=1.0, base_scale=0.1, bos=None, **kw) -> DSparkDrafter:
    """A drafter whose Markov head holds the target's bigram logits (``W1 = I``,
    ``W2 = alpha * bigram``): a good, but not perfect, proposal. ``base_scale`` scales the
    backbone's base logits (0: none, the proposal is the bigram alone)."""
    d = random_drafter(target, **kw)
    assert d.cfg.markov_rank == target.cfg.vocab_size
    d.markov_w1[...] = jnp.eye(target.cfg.vocab_size, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(alpha * bigram_table(target, bos))
    d.final_norm[...] = d.final_norm[...] * base_scale
    return d


# ======================================================================================
# Checks shared by all tests
# ======================================================================================
def assert_same_outputs(ar, sp, rows=None):
    rows = range(len(ar.generations)) if rows is None else rows
    for i in rows:
        a, s = ar.generations[i], sp.generations[i]
        assert s.token_ids == a.token_ids, f"row {i}: speculative {s.token_ids} != autoregressive {a.token_ids}"
        assert s.finish_reason == a.finish_reason, f"row {i}"


def check_stats(res, gamma_used: int, speculative=True):
    """docs/design.md#metrics invariants of every generation of a result."""
    for i, g in enumerate(res.generations):
        n = len(g.token_ids)
        assert n >= 1, f"row {i}"
        if g.num_target_passes == 0:
            assert n == 1 and np.isnan(g.tau)  # only the prefill token
        else:
            # tau = tokens emitted by the verification passes / passes (the prefill token
            # and the prefill pass are both excluded); stopped tokens never counted.
            assert g.tau == pytest.approx((n - 1) / g.num_target_passes, rel=1e-12), f"row {i}"
            assert 1.0 <= g.tau <= (gamma_used + 1 if speculative else 1.0)
        if not speculative:
            assert g.acceptance_rate is None and g.position_acceptance == []
            continue
        G = len(g.position_reached)
        reached, acc = np.array(g.position_reached), np.array(g.position_accepted)
        assert g.num_accepted <= g.num_draft_tokens <= gamma_used * g.num_target_passes, f"row {i}"
        assert g.num_accepted <= n - 1, f"row {i}"
        if g.num_draft_tokens:
            assert 0.0 <= g.acceptance_rate <= 1.0
            assert g.acceptance_rate == pytest.approx(g.num_accepted / g.num_draft_tokens)
        else:
            assert g.acceptance_rate is None
        assert acc.sum() == g.num_accepted, f"row {i}: per-position accepts {acc} vs {g.num_accepted}"
        assert np.all(acc <= reached), f"row {i}"
        assert np.all(reached[1:] <= acc[:-1]), f"row {i}: reached {reached} accepted {acc}"
        assert reached[0] <= g.num_target_passes
        assert np.all(reached[gamma_used:] == 0), f"row {i}: positions past block_size={gamma_used} reached"
        # every emitted token is an accepted draft or the one correction/bonus of a pass
        assert n - 1 <= g.num_accepted + g.num_target_passes
        # the cost-table bound's mix (benchmarks/speedup.py): one compiled width per pass, and a
        # pass verifies no more drafts than its width
        hist = np.array(g.verify_width_rounds)
        assert len(hist) == G + 1 and hist.sum() == g.num_target_passes, f"row {i}: {hist}"
        assert g.num_draft_tokens <= int(np.dot(np.arange(G + 1), hist)), f"row {i}"
        assert 0 <= g.num_drafting_rounds <= g.num_target_passes, f"row {i}"
        for k in range(G):
            pa = g.position_acceptance[k]
            assert (pa is None) == (reached[k] == 0)
            if pa is not None:
                assert pa == pytest.approx(acc[k] / reached[k])


# ======================================================================================
# stories260K (real model)
# ======================================================================================
@pytest.fixture(scope="module")
def s260k(stories260k):
    from dspark_jax.models.weights import params_fingerprint

    cfg, params, tok = stories260k
    return Target(cfg, params, fingerprint=params_fingerprint(params)), tok


@pytest.mark.exactness
def test_stories260k_greedy_golden(s260k):
    target, tok = s260k
    assert tok.encode("Once upon a time") == GOLDEN[:5]
    # Both prompts in one call (one compilation); [1] alone gives the same ids.
    res = generate_autoregressive(target, [GOLDEN[:5], [1]], max_new_tokens=35, temperature=0)
    assert res.generations[0].token_ids == GOLDEN[5:40]
    assert res.generations[1].token_ids == GOLDEN[1:36]
    assert all(g.finish_reason == "length" for g in res.generations)
    check_stats(res, 1, speculative=False)


@pytest.fixture(scope="module")
def s260k_prompts(s260k):
    from dspark_jax.evaluation.prompts import tinystories_openings

    _, tok = s260k
    prompts = [tok.encode(t) for t in tinystories_openings()[:50]]
    assert len(prompts) == 50
    return prompts


@pytest.fixture(scope="module")
def s260k_ar(s260k, s260k_prompts):
    target, _ = s260k
    return generate_autoregressive(target, s260k_prompts, max_new_tokens=48, temperature=0)


# "trained" uses the session's quickly trained drafter (conftest.stories260k_export).
@pytest.fixture(scope="module", params=["random", "bigram", pytest.param("trained", marks=pytest.mark.slow)])
def s260k_drafter(request, s260k):
    target, _ = s260k
    if request.param == "random":
        return random_drafter(target, block_size=4, markov_rank=target.cfg.vocab_size)
    if request.param == "bigram":  # same config as "random": shares its compilation
        return bigram_drafter(target, block_size=4, alpha=3.0, base_scale=0.0, bos=1)
    from dspark_jax.drafters.checkpoint import load_drafter

    _, summary = request.getfixturevalue("stories260k_export")
    return load_drafter(summary["export_dir"])[0]


@pytest.mark.exactness
def test_stories260k_speculative_equals_autoregressive(s260k, s260k_prompts, s260k_ar, s260k_drafter):
    target, _ = s260k
    sp = generate_speculative(target, s260k_drafter, s260k_prompts, max_new_tokens=48, temperature=0)
    assert_same_outputs(s260k_ar, sp)
    check_stats(sp, s260k_drafter.cfg.block_size)
    check_stats(s260k_ar, 1, speculative=False)
    assert sum(g.num_draft_tokens for g in sp.generations) > 0


# ======================================================================================
# Tiny targets and the standard batch
# ======================================================================================
V = 16
MAX_POS = 64
TINY = TargetConfig(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=MAX_POS,
    tie_embeddings=False,
    bos_id=None,
    eos_ids=(),
    name="tiny",
)


def tiny_params(kind: str, seed=1):
    """``peaked``: a random target with low-entropy, mostly bigram-like predictions
    (a bigram drafter gets ~30-40% acceptance); ``bigram``: attention and MLP outputs are
    zero, so the next token depends on the current token only and a bigram drafter is
    perfect at T = 0."""
    p = random_params(TINY, seed=seed, scale=0.15)
    p["embed"] = p["embed"] / (10 * 0.15)  # unit-variance embeddings
    p["lm_head"] = p["lm_head"] * (0.8 / 0.15)  # peaked logits
    if kind == "bigram":
        p["layers"]["wo"][:] = 0.0
        p["layers"]["w_down"][:] = 0.0
    return p


@pytest.fixture(scope="module")
def peaked():
    # No fingerprint: every tiny target shares one compiled loop (the fingerprint is a
    # static attribute of the module, so distinct fingerprints would recompile).
    return Target(TINY, tiny_params("peaked"))


@pytest.fixture(scope="module")
def pure_bigram():
    return Target(TINY, tiny_params("bigram"))


def standard_batch(seed=0):
    """16 prompts + per-row max_new_tokens, one shape signature for every tiny call.

    Row 0: a 60-token prompt with max_new 20 (stops at the 64-token context end);
    row 1: a 63-token prompt (room for exactly one token); rows 2-6: one prompt with
    max_new 1, 2, 3, 7, 13; rows 7-9: max_new 24 (also decoded alone); rows 10-15: short
    prompts (one of length 1) with assorted max_new.
    """
    rng = np.random.default_rng(seed)
    r = lambda n: [int(x) for x in rng.integers(0, V, n)]
    prompts, max_new = [r(60), r(63)], [20, 5]
    shared = r(6)
    for m in (1, 2, 3, 7, 13):
        prompts.append(shared)
        max_new.append(m)
    for n, m in [(5, 24), (9, 24), (3, 24), (1, 17), (12, 5), (7, 9), (2, 16), (10, 11), (4, 19)]:
        prompts.append(r(n))
        max_new.append(m)
    return prompts, max_new


PROMPTS, MAX_NEW = standard_batch()
SEEDS = [1000 + i for i in range(16)]
ALONE_ROWS = (7, 8, 9)


def ar_std(target, **kw):
    return generate_autoregressive(target, PROMPTS, max_new_tokens=MAX_NEW, seed=SEEDS, **kw)


def spec_std(target, drafter, **kw):
    return generate_speculative(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, seed=SEEDS, **kw)


@pytest.fixture(scope="module")
def drafters(peaked, pure_bigram):
    """All share one config (one compiled speculative loop)."""
    return {
        "random": random_drafter(peaked, seed=3),
        "bigram": bigram_drafter(peaked, seed=4),
        "perfect": bigram_drafter(pure_bigram, alpha=50.0, base_scale=0.0, seed=5),
    }


@pytest.fixture(scope="module")
def ar_peaked(peaked):
    return ar_std(peaked, temperature=0)


@pytest.fixture(scope="module")
def ar_pure(pure_bigram):
    return ar_std(pure_bigram, temperature=0)


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


def cost_table(t_verify, t_draft=0.5):
    """A hand-made cost table for the tiny drafters' widths (0, 1, 2, 4) [seconds]."""
    from dspark_jax.decoding.cost_table import CostTable

    return CostTable.from_decode_costs(
        span=64,
        t_step=t_verify[0],
        t_verify=dict(zip((0, 1, 2, 4), t_verify)),
        t_draft_greedy=t_draft,
        t_draft_sampled=t_draft,
        t_context=0.0,
        meta={"cache_len": 64},
    )


# Verification nearly free: long widths win; costly: the width follows the confidences.
CHEAP, COSTLY = cost_table((1.0, 1.02, 1.04, 1.08), 0.1), cost_table((1.0, 1.5, 2.0, 3.0), 0.3)


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
    """A drafter that never pays: after the first round drafting is suspended and the rounds up to
    each probe (8 rounds, then 16) run as plain steps in a loop of their own; rows finish inside
    that loop at their own lengths. Greedy output equals AR; every round without drafts is a
    width-0 pass; a row drafts in the first round and at most in the probe of round 9."""
    never = cost_table((1.0, 1.5, 2.0, 3.0), 50.0)
    sp = spec_std(peaked, drafters["bigram"], temperature=0, num_speculative_tokens="auto", cost_table=never)
    assert_same_outputs(ar_peaked, sp)
    check_stats(sp, 4)
    for i, g in enumerate(sp.generations):
        if g.num_target_passes == 0:
            continue
        assert g.num_drafting_rounds == 1 + (g.num_target_passes > 9), (i, g.num_drafting_rounds, g.num_target_passes)
        assert g.verify_width_rounds[0] >= g.num_target_passes - g.num_drafting_rounds, (i, g.verify_width_rounds)


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


def _stop_token(ar) -> int:
    """The token that most often first appears strictly inside the outputs."""
    counts = Counter()
    for g in ar.generations:
        ids = g.token_ids
        for t in set(ids[1:-1]):
            if ids.index(t) >= 1:
                counts[t] += 1
    return counts.most_common(1)[0][0]


@pytest.mark.exactness
@pytest.mark.parametrize("name,target_name", [("bigram", "peaked"), ("perfect", "pure_bigram")])
def test_stop_inside_block(name, target_name, drafters, request):
    """(a) a stop id hit inside a verified block (with the perfect drafter always an
    accepted draft followed by more accepted drafts): the output ends exactly at its first
    occurrence, equals AR truncated there, finish_reason "stop", and nothing after it is
    counted."""
    target = request.getfixturevalue(target_name)
    ar = request.getfixturevalue("ar_peaked" if target_name == "peaked" else "ar_pure")
    stop = _stop_token(ar)
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
    stop = _stop_token(ar_pure)
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

    from dspark_jax.serving.engine import Engine, Request, SamplingParams
    from dspark_jax.serving.http.detokenize import OutputState
    from dspark_jax.serving.http.engine_loop import TrackedRequest, event_from_output

    stop = _stop_token(ar_pure)
    d = drafters["perfect"]
    g_used = d.cfg.block_size
    # the same call as test_perfect_drafter_acceptance_with_stop (one compiled loop)
    res = spec_std(pure_bigram, d, temperature=0, stop_ids=[stop]).generations
    rows = [i for i, g in enumerate(res) if len(PROMPTS[i]) < 32 and MAX_NEW[i] > 8][:4]
    prompts, max_new, seeds, ref = (
        [PROMPTS[i] for i in rows],
        [MAX_NEW[i] for i in rows],
        [SEEDS[i] for i in rows],
        [res[i] for i in rows],
    )
    assert any(g.finish_reason == "stop" and len(g.token_ids) - 1 < g.num_target_passes * (g_used + 1) for g in ref), (
        "no stop inside a block: pick another stop token"
    )
    eng = Engine(
        pure_bigram,
        d,
        num_slots=1,
        cache_len=64,
        policy=f"fixed:{g_used}",
        eos_token_ids=(),
        buckets=(g_used + 1,),
        row_buckets=(1,),
        prefill_buckets=(32,),
        seed_calibration=False,
        profile_iters=1,
        suspend_after=None,
    )
    tok = SimpleNamespace(detokenizer=lambda skip_special_tokens=True: SimpleNamespace(step=lambda i: ""))
    for p, m, sd, g in zip(prompts, max_new, seeds, ref):
        req = Request(list(p), SamplingParams(temperature=0.0, seed=sd, max_tokens=m, stop_token_ids=(stop,)), "r")
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
        lambda p: generate_speculative(peaked, drafters["bigram"], p, max_new_tokens=4),
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
        s = generate_speculative(peaked, drafters["bigram"], [PROMPTS[i]], **one).generations[0]
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


def test_input_errors(peaked, drafters):
    """(g) bad prompts / settings raise DSparkInputError before any compilation."""
    d = drafters["bigram"]
    calls = [
        lambda p, **k: generate_autoregressive(peaked, p, **k),
        lambda p, **k: generate_speculative(peaked, d, p, **k),
    ]
    for fn in calls:
        for bad, match in [
            ([[]], "empty"),
            ([[1, 2], []], "empty"),
            ([[1, V]], "outside the vocabulary"),
            ([[-1, 3]], "outside the vocabulary"),
            ([], "no prompts"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn(bad, max_new_tokens=4)
        with pytest.raises(DSparkInputError, match="max_new_tokens"):
            fn([[1, 2]], max_new_tokens=0)
        # NaN/inf settings are refused (they used to decode <unk> tokens), per request too
        for kw, match in [
            (dict(temperature=float("nan")), "temperature must be a finite number"),
            (dict(temperature=[0.5, float("inf")]), "temperature must be a finite number"),
            (dict(top_p=float("nan")), "top_p must be a finite number"),
            (dict(top_k=float("inf")), "top_k must be a finite number"),
            (dict(temperature=-1.0), "temperature must be >= 0"),
            (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn([[1, 2], [3, 4]], max_new_tokens=4, **kw)
        # numbers the device arrays cannot hold are refused, never wrapped (issue 27)
        for kw, match in [
            (dict(top_k=2**31), r"top_k must be an integer in \[0, 2147483647\] \(0 is off\), got 2147483648"),
            (dict(top_k=[0, 2**70]), "top_k must be an integer in"),
            (dict(temperature=1e39), "temperature must be at most 3.4"),
            (dict(max_new_tokens=2**31), "max_new_tokens must be at most 2147483647, got 2147483648"),
            (dict(max_new_tokens=[4, 2**70]), "max_new_tokens must be at most 2147483647"),
            (dict(seed=2**70), "seed must be an integer in"),
            (dict(seed=[1, 2.5]), "seed must be an integer in"),
        ]:
            with pytest.raises(DSparkInputError, match=match):
                fn([[1, 2], [3, 4]], **{"max_new_tokens": 4, **kw})
        with pytest.raises(DSparkInputError, match="token id 1180591620717411303424 outside the vocabulary"):
            fn([[1, 2**70]], max_new_tokens=4)
    for g in (0, 5, -1):
        with pytest.raises(DSparkInputError, match=r"num_speculative_tokens must be in \[1, 4\]"):
            generate_speculative(peaked, d, [[1, 2]], max_new_tokens=4, num_speculative_tokens=g)


def test_incompatible_drafter(peaked):
    """(h) a drafter built for another vocabulary / width / depth / weights is refused."""
    from dspark_jax.models.weights import params_fingerprint

    p = tiny_params("peaked")
    fp_target = Target(TINY, p, fingerprint=params_fingerprint(p))
    others = {
        "vocabulary": dataclasses.replace(TINY, vocab_size=V + 1),
        "hidden size": dataclasses.replace(TINY, hidden_size=48),
        "layers": dataclasses.replace(TINY, num_layers=4),
    }
    for what, cfg in others.items():
        d = DSparkDrafter(DrafterConfig.for_target(cfg, block_size=2, num_layers=1, markov_rank=4), nnx.Rngs(0))
        for t in (peaked, fp_target):
            with pytest.raises(DSparkInputError, match=what):
                check_compatible(t, d)
            with pytest.raises(DSparkInputError, match=what):
                generate_speculative(t, d, [[1, 2, 3]], max_new_tokens=4)
    # same architecture, other weights (recorded fingerprint differs)
    d = DSparkDrafter(
        DrafterConfig.for_target(
            TINY, block_size=2, num_layers=1, markov_rank=4, target_fingerprint="0123456789abcdef"
        ),
        nnx.Rngs(0),
    )
    with pytest.raises(DSparkInputError, match="weights"):
        generate_speculative(fp_target, d, [[1, 2, 3]], max_new_tokens=4)
    check_compatible(peaked, d)  # a target without a fingerprint cannot be checked: allowed


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


def test_request_keys_are_prng_keys_of_the_seeds():
    """The loops' vectorised request keys equal ``jax.random.PRNGKey(seed)`` seed by seed,
    including negative seeds and seeds past 32 bits (whose low 32 bits PRNGKey keeps)."""
    import jax

    from dspark_jax.decoding.loop import _keys

    seeds = [0, 1, -1, -5, 2**31 - 1, 2**31, 2**32, 2**32 + 7, 2**63 - 1, -(2**63), 123456789012345, 7]
    want = np.stack([np.asarray(jax.random.PRNGKey(s)) for s in seeds])
    np.testing.assert_array_equal(np.asarray(_keys(np.asarray(seeds, np.int64), len(seeds))), want)
    np.testing.assert_array_equal(np.asarray(_keys(np.int64(9), 3)), np.stack([np.asarray(jax.random.PRNGKey(9))] * 3))


# ======================================================================================
# The law at T > 0 through the real loops
# ======================================================================================
DIST_PROMPT = [3, 7, 1, 12]
N_LAW = 12000  # rows per sampling setting
SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=6, top_p=0.9)]


def exact_law(target, prompt, temperature, top_k, top_p, n_tokens=3) -> np.ndarray:
    """Exact ``[V] * n_tokens`` joint law of the first generated tokens, by enumerating
    every prefix through one cache-less target pass (causal: position t sees <= t)."""
    assert n_tokens == 3
    v = target.cfg.vocab_size
    y1, y2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    seqs = np.concatenate(
        [np.broadcast_to(prompt, (v * v, len(prompt))), y1.reshape(-1, 1), y2.reshape(-1, 1)], axis=1
    ).astype(np.int32)
    pos = np.broadcast_to(np.arange(seqs.shape[1], dtype=np.int32), seqs.shape)
    logits = target(jnp.asarray(seqs), jnp.asarray(pos)).logits[:, len(prompt) - 1 :]  # [V*V, 3, V]
    probs = np.asarray(process_logits(logits, sampling_arrays(v * v, temperature, top_k, top_p)), np.float64)
    probs /= probs.sum(-1, keepdims=True)
    p1 = probs[0, 0]
    p2 = probs[::v, 1]  # rows with y1 = i (any y2)
    p3 = probs[:, 2].reshape(v, v, v)
    law = p1[:, None, None] * p2[:, :, None] * p3
    return law / law.sum()


def counts_of(tokens: np.ndarray, rows, n_tokens=3) -> np.ndarray:
    """``[V] * n_tokens`` counts of the first ``n_tokens`` generated tokens (``tokens``: ``[rows, T]``)."""
    counts = np.zeros((V,) * n_tokens)
    np.add.at(counts, tuple(tokens[rows, :n_tokens].T), 1)
    return counts


# Pearson chi-square tests on outcomes with expected count >= 5, the rest pooled into one
# bin (a TV bound over ~4000 mostly tiny outcomes is far too loose to catch a real bug).
# The upper 1e-6 quantile of chi2(df) by Wilson-Hilferty (no scipy dependency): the seeds
# are fixed, so a pass/fail flip needs a code change, and a false alarm has odds ~1e-6.
Z_TAIL = 4.75


def chi2_quantile(df: int) -> float:
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_TAIL * np.sqrt(c)) ** 3


def _bins(law, n):
    return law.reshape(-1) * n >= 5


def _binned(x, keep):
    x = x.reshape(-1)
    return np.append(x[keep], x[~keep].sum())


def chi2_goodness(counts, law, keep) -> tuple[float, float]:
    """``(statistic, 1e-6 critical value)`` of counts against an exact law."""
    n = counts.sum()
    obs, exp = _binned(counts, keep), _binned(law, keep) * n
    m = exp > 0
    assert obs[~m].sum() == 0, "an outcome of probability 0 was generated"
    return float(((obs[m] - exp[m]) ** 2 / exp[m]).sum()), chi2_quantile(int(m.sum()) - 1)


def chi2_two_sample(c1, c2, keep) -> tuple[float, float]:
    """``(statistic, critical value)`` of homogeneity of two equal-size samples."""
    a, b = _binned(c1, keep), _binned(c2, keep)
    m = (a + b) > 0
    return float(((a[m] - b[m]) ** 2 / (a[m] + b[m])).sum()), chi2_quantile(max(int(m.sum()) - 1, 1))


def law_decodes() -> dict:
    """The law's decodes, one batch per loop: N_LAW rows per sampling setting, seeds 0..2N-1,
    max_new 6 (the first round verifies the full block_size = 4). ``{name: DecodeResult}`` for
    ``ar``, ``spec-bigram``, ``spec-random``, ``spec-bigram-auto`` and ``bf16-spec-bigram``
    (``tests/law_worker.py`` runs it)."""
    peaked = Target(TINY, tiny_params("peaked"))
    drafters = {"random": random_drafter(peaked, seed=3), "bigram": bigram_drafter(peaked, seed=4)}
    b = N_LAW * len(SETTINGS)
    kw = dict(
        max_new_tokens=6,
        seed=list(range(b)),
        cache_len=32,
        temperature=[s["temperature"] for s in SETTINGS for _ in range(N_LAW)],
        top_k=[s["top_k"] for s in SETTINGS for _ in range(N_LAW)],
        top_p=[s["top_p"] for s in SETTINGS for _ in range(N_LAW)],
    )
    prompts = [DIST_PROMPT] * b
    out = {"ar": generate_autoregressive(peaked, prompts, **kw)}
    out |= {
        f"spec-{name}": generate_speculative(peaked, drafters[name], prompts, **kw) for name in ("bigram", "random")
    }
    out["spec-bigram-auto"] = generate_speculative(
        peaked, drafters["bigram"], prompts, num_speculative_tokens="auto", cost_table=COSTLY, **kw
    )
    # bfloat16 target and drafter (the same weights, rounded): the sampled half of the contract
    peaked16 = Target(TINY, tiny_params("peaked"), dtype=jnp.bfloat16)
    out["bf16-spec-bigram"] = generate_speculative(peaked16, in_dtype(drafters["bigram"], jnp.bfloat16), prompts, **kw)
    return out


def in_dtype(drafter: DSparkDrafter, dtype) -> DSparkDrafter:
    """``drafter``'s weights in a drafter built for ``dtype`` (each parameter rounded to the dtype that
    ``dtype``'s build gives it: the compute weights to ``dtype``, any kept in float32 unchanged)."""
    out = DSparkDrafter(drafter.cfg, nnx.Rngs(0), dtype=dtype)
    ref = nnx.state(out, nnx.Param)
    nnx.update(out, jax.tree.map(lambda a, r: a.astype(r.dtype), nnx.state(drafter, nnx.Param), ref))
    return out


@pytest.fixture(scope="module")
def law_runs(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """:func:`law_decodes` in a process of its own at the user's XLA flags (it is run-bound):
    ``{name: {"tokens": [rows, 6], "lengths", "accepted", "drafted": [rows]}}``."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import user_xla_env

    out = tmp_path_factory.mktemp("law") / "law.npz"
    worker = Path(__file__).resolve().parents[1] / "law_worker.py"
    p = subprocess.run(
        [sys.executable, str(worker), str(out)],
        env=user_xla_env(),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=worker.parents[1],
    )
    assert p.returncode == 0, p.stderr[-4000:]
    runs: dict[str, dict[str, np.ndarray]] = {}
    with np.load(out) as z:
        for key in z.files:
            name, field = key.split("/")
            runs.setdefault(name, {})[field] = z[key]
    return runs


@pytest.mark.exactness
@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(SETTINGS)), ids=["T1", "T0.7-k6-p0.9"])
def test_law_of_first_tokens(setting, peaked, law_runs):
    """The joint law of the first 3 generated tokens (prefill token, then the first
    verification round with block_size = 4: accept / correction / bonus paths) equals the exact
    law for AR and for speculative decoding with two drafters; later single positions
    agree between speculative and AR."""
    bf16 = {k: v for k, v in law_runs.items() if k.startswith("bf16-")}
    law_runs = {k: v for k, v in law_runs.items() if k not in bf16}
    sp = {k.removeprefix("spec-"): v for k, v in law_runs.items() if k.startswith("spec-")}
    s = SETTINGS[setting]
    law = exact_law(peaked, DIST_PROMPT, **s)
    keep = _bins(law, N_LAW)
    rows = np.arange(setting * N_LAW, (setting + 1) * N_LAW)
    for k, r in law_runs.items():
        assert (r["lengths"][rows] == 6).all(), k
    # Power: sampling at a 10% wrong temperature makes the statistic noncentral chi2 with
    # noncentrality lam = N * sum (p' - p)^2 / p; mean - 4 sd must exceed the critical value.
    off = exact_law(peaked, DIST_PROMPT, **{**s, "temperature": s["temperature"] * 1.1})
    lo, hi = _binned(law, keep), _binned(off, keep)
    df, crit = keep.sum(), chi2_goodness(law * N_LAW, law, keep)[1]
    # (mass where the exact law has none would be detected with certainty: infinite)
    lam = N_LAW * np.where(lo > 0, (hi - lo) ** 2 / np.where(lo > 0, lo, 1.0), np.where(hi > 0, np.inf, 0.0)).sum()
    assert lam == np.inf or df + lam - 4 * np.sqrt(2 * (df + 2 * lam)) > crit, (lam, crit)
    counts = {k: counts_of(r["tokens"], rows) for k, r in law_runs.items()}
    for k, c in counts.items():
        stat, crit = chi2_goodness(c, law, keep)
        assert stat < crit, f"{k}: chi2 {stat:.1f} >= {crit:.1f} against the exact law"
    for k in sp:
        stat, crit = chi2_two_sample(counts[f"spec-{k}"], counts["ar"], keep)
        assert stat < crit, f"spec-{k} vs ar: chi2 {stat:.1f} >= {crit:.1f}"
    # later positions (from the first round's accepted drafts / bonus, or the second
    # round): single-token marginals, speculative vs AR
    for pos in (3, 4, 5):
        m_ar = np.bincount(law_runs["ar"]["tokens"][rows, pos], minlength=V)
        for k, r in sp.items():
            m_sp = np.bincount(r["tokens"][rows, pos], minlength=V)
            stat, crit = chi2_two_sample(m_sp, m_ar, (m_ar + m_sp) >= 10)
            assert stat < crit, (k, pos, stat, crit)
    for k, r in sp.items():
        acc = r["accepted"][rows].sum() / r["drafted"][rows].sum()
        assert 0.0 < acc < 1.0, (k, acc)
    # bfloat16 (docs/design.md#numerics): sampled tokens follow the law of the bfloat16 target's passes
    # (here its cache-less pass: the cached passes round differently, far below this test's power).
    law16 = exact_law(Target(TINY, tiny_params("peaked"), dtype=jnp.bfloat16), DIST_PROMPT, **s)
    for k, r in bf16.items():
        stat, crit = chi2_goodness(counts_of(r["tokens"], rows), law16, _bins(law16, N_LAW))
        assert stat < crit, f"{k}: chi2 {stat:.1f} >= {crit:.1f} against the bfloat16 target's law"
        assert 0.0 < r["accepted"][rows].sum() / r["drafted"][rows].sum() < 1.0, k


# ======================================================================================
# The round's pieces (decoding.round) and the loops' plumbing
# ======================================================================================
def test_round_emission_and_statistics_agree_on_host_and_device():
    """emit_counts / round_statistics give the same numbers with numpy (the serving engine's
    host read-backs) and jax.numpy (the decode loops), per-row stop ids and min_tokens
    (``stops_from``) included."""
    from dspark_jax.decoding.round import emit_counts, round_statistics

    rng = np.random.default_rng(0)
    b, g = 64, 4
    tokens = rng.integers(0, 6, (b, g + 1)).astype(np.int32)
    num_acc = rng.integers(0, g + 1, b).astype(np.int32)
    num_verify = np.maximum(num_acc, rng.integers(0, g + 1, b)).astype(np.int32)
    num_new = num_acc + 1
    tokens[np.arange(g + 1)[None, :] >= num_new[:, None]] = -1
    running = rng.random(b) < 0.9
    length = rng.integers(3, 10, b).astype(np.int32)
    end = length + rng.integers(1, 8, b).astype(np.int32)
    for stop_ids, stops_from in [
        (np.array([2, 3], np.int32), None),
        (rng.integers(-1, 6, (b, 2)).astype(np.int32), rng.integers(0, 4, b).astype(np.int32)),
    ]:
        args = (tokens, num_new, running, length, end, stop_ids)
        host = emit_counts(*args, stops_from=stops_from, xp=np)
        dev = emit_counts(*map(jnp.asarray, args), stops_from=None if stops_from is None else jnp.asarray(stops_from))
        for h, d in zip(host, dev):
            np.testing.assert_array_equal(h, np.asarray(d))
        kept = host[0]
        assert np.all(kept <= np.minimum(num_new, end - length) * running)
        rs_h = round_statistics(num_verify, num_acc, num_new, kept, g, xp=np)
        rs_d = round_statistics(*map(jnp.asarray, (num_verify, num_acc, num_new, kept)), g)
        for h, d in zip(rs_h, rs_d):
            np.testing.assert_array_equal(h, np.asarray(d))
        assert np.all(rs_h.num_draft_tokens <= num_verify) and np.all(rs_h.num_accepted <= kept)


def test_num_speculative_tokens_has_one_spelling():
    """The verification length is ``num_speculative_tokens`` only (the old ``gamma=`` alias is gone:
    ``gamma`` was also the block size)."""
    from dspark_jax.decoding.validation import resolve_num_speculative_tokens

    assert resolve_num_speculative_tokens(None, 4) == "auto"
    assert resolve_num_speculative_tokens(None, 4, default=None) == 4
    assert resolve_num_speculative_tokens(" 3", 4) == 3 and resolve_num_speculative_tokens("AUTO", 4) == "auto"
    with pytest.raises(DSparkInputError, match="must be an integer or 'auto'"):
        resolve_num_speculative_tokens("three", 4)
    with pytest.raises(TypeError, match="gamma"):
        generate_speculative(None, None, [[1]], gamma=2)  # type: ignore[call-arg]


def test_compile_cache_is_bounded():
    from dspark_jax.decoding.compile_cache import LRUCache
    from dspark_jax.decoding.loop import _COMPILED

    assert isinstance(_COMPILED, LRUCache) and _COMPILED.maxsize <= 64
    cache = LRUCache(maxsize=2)
    built = []
    for k in ("a", "b", "a", "c", "b"):
        cache.get_or_build(k, lambda k=k: built.append(k) or k)
    assert built == ["a", "b", "c", "b"] and len(cache) == 2 and "c" in cache and "a" not in cache


def test_a_new_max_new_tokens_reuses_the_compiled_loops(peaked, drafters, monkeypatch):
    """The loops' static step bound is bucketed (issue 24): another ``max_new_tokens`` at the same
    cache length compiles nothing new, and every request still stops at its own limit."""
    from dspark_jax.decoding import loop
    from dspark_jax.decoding.compile_cache import LRUCache

    monkeypatch.setattr(loop, "_COMPILED", LRUCache(maxsize=8))
    kw = dict(cache_len=64, temperature=0.0, stop_ids=[])
    spec = {n: generate_speculative(peaked, drafters["bigram"], [[1, 2, 3]], max_new_tokens=n, **kw) for n in (9, 20)}
    ar = {n: generate_autoregressive(peaked, [[1, 2, 3]], max_new_tokens=n, **kw) for n in (9, 20)}
    assert len(loop._COMPILED) == 2  # one speculative loop and one plain loop
    for n in (9, 20):
        ids = ar[n].generations[0].token_ids
        assert len(ids) == n and spec[n].generations[0].token_ids == ids
    assert ar[20].generations[0].token_ids[:9] == ar[9].generations[0].token_ids
