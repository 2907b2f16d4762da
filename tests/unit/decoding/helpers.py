"""Shared helpers of the decode-loop tests (``tests/unit/decoding/``) and of the model-family tests
that compare speculative with plain decoding: drafters built for a target, the checks every
result must pass, the tiny targets and the 16-row "standard batch", a hand-made cost table.

Compilation dominates the run time, so calls share a few shape signatures: every tiny
call uses the 16-row "standard batch" (same prompt buffer, cache and step count), and all
tiny targets / drafters share one config (their weights are arguments, not constants).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dspark_jax.config import TargetConfig
from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative
from dspark_jax.models.target import random_params
from tests.helpers.drafters import assert_same_outputs, bigram_drafter, bigram_table, random_drafter  # noqa: F401


# ======================================================================================
# Checks shared by all tests
# ======================================================================================
def check_stats(res, num_verified: int, speculative=True):
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
            assert 1.0 <= g.tau <= (num_verified + 1 if speculative else 1.0)
        if not speculative:
            assert g.acceptance_rate is None and g.position_acceptance == []
            continue
        G = len(g.position_reached)
        reached, acc = np.array(g.position_reached), np.array(g.position_accepted)
        assert g.num_accepted <= g.num_draft_tokens <= num_verified * g.num_target_passes, f"row {i}"
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
        assert np.all(reached[num_verified:] == 0), f"row {i}: positions past block_size={num_verified} reached"
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
    """The standard batch through the speculative loop, verifying whole blocks unless told otherwise."""
    kw = {"num_speculative_tokens": drafter.cfg.block_size, **kw}
    return generate_speculative(target, drafter, PROMPTS, max_new_tokens=MAX_NEW, seed=SEEDS, **kw)


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
# COSTLY: verification dear enough that "auto" chooses among the widths, drafting cheap enough that
# a request's first round drafts (auto_verify.first_round_drafts).
CHEAP, COSTLY = cost_table((1.0, 1.02, 1.04, 1.08), 0.1), cost_table((1.0, 1.2, 1.6, 2.4), 0.3)


def stop_token(ar) -> int:
    """The token that most often first appears strictly inside the outputs."""
    counts = Counter()
    for g in ar.generations:
        ids = g.token_ids
        for t in set(ids[1:-1]):
            if ids.index(t) >= 1:
                counts[t] += 1
    return counts.most_common(1)[0][0]
