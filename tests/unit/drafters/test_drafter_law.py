"""Monte Carlo exactness through the REAL drafter (backbone + Markov head + sampler) and verifier.

One speculative round from a fixed context, 200k samples per sampling setting:
drafts come from ``DSparkDrafter.draft_block`` + ``markov.sample_block`` (Markov bias randomised so
the second draft's proposal depends on the first), the target's distributions p for every
possible draft prefix come from the real ``Target`` through ``process_logits``, and
``verify`` decides. Emitted prefixes shorter than two tokens are completed by exact target
sampling (the next round's law), so the empirical law of the first two output tokens must
equal p(y1) p(y2 | y1): total variation < 0.01 at 200k samples. A proposal q that is not
exactly the distribution each draft was sampled from (e.g. a Markov bias applied to sampling
but not recorded in q) shifts that law and fails the test.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.decoding.verifier import verify
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.drafters.markov import sample_block
from dspark_jax.models.sampling import process_logits, sampling_arrays
from tests.helpers.tiny import LAW_TARGET, law_target

pytestmark = pytest.mark.exactness

V, G, N = LAW_TARGET.vocab_size, 3, 200_000
CTX = [1, 4, 2, 5]  # prompt; its last token is the anchor of the round
SETTINGS = [
    dict(temperature=0.5, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=1.0),
    dict(temperature=1.3, top_k=0, top_p=1.0),
    dict(temperature=1.0, top_k=3, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.8),
]


@pytest.fixture(scope="module")
def models():
    target = law_target()
    dcfg = DrafterConfig.for_target(target.cfg, block_size=G, num_layers=1, markov_rank=4, taps=(0, 1))
    drafter = DSparkDrafter(dcfg, nnx.Rngs(1))
    rng = np.random.default_rng(0)
    # Flatten the backbone's logits so proposals overlap the target (accepts and rejects both
    # happen), and give the Markov head a strong random bias so q_2 depends on x_1.
    drafter.final_norm[...] = jnp.full(drafter.final_norm.shape, 0.05, jnp.float32)
    drafter.markov_w2[...] = jnp.asarray(rng.normal(size=drafter.markov_w2.shape) * 1.5, jnp.float32)
    drafter.conf_w[...] = jnp.asarray(rng.normal(size=drafter.conf_w.shape), jnp.float32)
    return target, drafter


def _block(target, drafter):
    """Backbone output for the round whose anchor is CTX[-1] at position len(CTX) - 1."""
    ctx = jnp.asarray([CTX], jnp.int32)
    pos = jnp.arange(len(CTX), dtype=jnp.int32)[None]
    out = target(ctx, pos, target.init_cache(1, 16), taps=drafter.cfg.taps)
    dcache = drafter.extend_cache(drafter.init_cache(1, 16), out.features, pos)
    p = jnp.asarray([len(CTX) - 1], jnp.int32)
    return drafter.draft_block(target, ctx[:, -1], p, dcache)


def _target_probs(target, setting):
    """p for every draft prefix: ``[V**G, G+1, V]`` (row = draft sequence index), and the
    exact law of the first two tokens ``[V, V]``."""
    seqs = np.array(list(itertools.product(range(V), repeat=G)), np.int32)  # [V^G, G]
    toks = np.concatenate([np.tile(CTX, (len(seqs), 1)), seqs], 1)
    pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
    logits = target(jnp.asarray(toks), jnp.asarray(pos)).logits[:, len(CTX) - 1 :]  # [V^G, G+1, V]
    sa = sampling_arrays(len(seqs), **setting)
    p = np.asarray(process_logits(logits, sa), np.float64)
    p /= p.sum(-1, keepdims=True)
    # exact law of (y1, y2): p(y1) from any row, p(y2 | y1) from a row whose first draft is y1
    first = p[0, 0]
    second = np.stack([p[y1 * V ** (G - 1), 1] for y1 in range(V)])
    return p, first[:, None] * second, second


@pytest.fixture(scope="module")
def models_draft_vocab(models):
    """The same target with a drafter that drafts over 4 of the 6 ids (x = 1 and 4 never)."""
    target, _ = models
    tcfg = target.cfg
    dcfg = DrafterConfig.for_target(tcfg, block_size=G, num_layers=1, markov_rank=4, taps=(0, 1), draft_vocab_size=4)
    drafter = DSparkDrafter(dcfg, nnx.Rngs(2))
    drafter.set_draft_vocab(DRAFT_IDS)
    rng = np.random.default_rng(1)
    drafter.final_norm[...] = jnp.full(drafter.final_norm.shape, 0.05, jnp.float32)
    drafter.markov_w2[...] = jnp.asarray(rng.normal(size=drafter.markov_w2.shape) * 1.5, jnp.float32)
    return target, drafter


DRAFT_IDS = (0, 2, 3, 5)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s['temperature']}-k{s['top_k']}-p{s['top_p']}")
def test_two_token_law_through_real_drafter(models, setting):
    _check_two_token_law(*models, setting)


@pytest.mark.parametrize("setting", [SETTINGS[1], SETTINGS[3]], ids=["T1", "T1-k3"])
def test_two_token_law_with_draft_vocabulary(models_draft_vocab, setting):
    """Lossless with a reduced draft vocabulary: q is zero off it and verification corrects."""
    _check_two_token_law(*models_draft_vocab, setting, draft_ids=DRAFT_IDS)


def _check_two_token_law(target, drafter, setting, draft_ids=None):
    block = _block(target, drafter)
    p_all, law, cond2 = _target_probs(target, setting)

    @jax.jit
    def round_(keys):
        b = keys.shape[0]
        bb = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:]), block)
        sa = sampling_arrays(b, **setting)
        dk, vk = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        draft = sample_block(drafter, bb, jnp.full((b,), CTX[-1], jnp.int32), dk, sa)
        idx = jnp.sum(draft.tokens * (V ** jnp.arange(G - 1, -1, -1)), axis=1)
        res = verify(vk, draft.tokens, draft.probs, jnp.asarray(p_all, jnp.float32)[idx], jnp.full((b,), G))
        return draft, res

    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(N, dtype=jnp.uint32) + 1000 * SETTINGS.index(setting))
    draft, res = round_(keys)
    toks, n = np.asarray(res.tokens), np.asarray(res.num_emitted)
    y1 = toks[:, 0]
    rng = np.random.default_rng(SETTINGS.index(setting))
    # Complete one-token rounds with the exact next-round law p(y2 | y1).
    u = rng.random(N)
    cdf = np.cumsum(cond2[y1], axis=1)
    fill = np.minimum((u[:, None] > cdf).sum(1), V - 1)
    y2 = np.where(n >= 2, toks[:, 1], fill)
    emp = np.bincount(y1 * V + y2, minlength=V * V) / N
    tv2 = 0.5 * np.abs(emp - law.reshape(-1)).sum()
    tv1 = 0.5 * np.abs(np.bincount(y1, minlength=V) / N - law.sum(1)).sum()
    assert tv1 < 0.01 and tv2 < 0.01, (tv1, tv2)
    # The test is only meaningful if accepts, corrections and second-position outcomes all occur.
    acc = np.asarray(res.num_accepted)
    # (with a draft vocabulary, second-position accepts are rarer: 0.2% at top-k 3)
    assert 0.05 < (acc >= 1).mean() < 0.98 and (acc >= 2).mean() > (0.02 if draft_ids is None else 0.001), np.bincount(
        acc
    )
    if draft_ids is not None:  # never drafted off the draft vocabulary, q exactly 0 there
        off = np.setdiff1d(np.arange(V), draft_ids)
        assert not np.isin(np.asarray(draft.tokens), off).any()
        assert np.all(np.asarray(draft.probs)[..., off] == 0.0)


def test_recorded_q_is_the_sampling_law(models):
    """x_2 | x_1 from the sampler follows the recorded q_2 (which includes the Markov bias of x_1)."""
    target, drafter = models
    block = _block(target, drafter)
    b = 100_000
    bb = jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape[1:]), block)
    sa = sampling_arrays(b, temperature=1.0)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b, dtype=jnp.uint32))
    draft = jax.jit(lambda k: sample_block(drafter, bb, jnp.full((b,), CTX[-1], jnp.int32), k, sa))(keys)
    x, q = np.asarray(draft.tokens), np.asarray(draft.probs)
    # q_1 is the same for every row; q_2 depends only on x_1 and must differ across x_1 (Markov bias).
    np.testing.assert_allclose(q[:, 0], np.broadcast_to(q[0, 0], q[:, 0].shape), atol=1e-6)
    q2_by_x1 = {}
    for v in range(V):
        rows = np.nonzero(x[:, 0] == v)[0]
        if len(rows) < 2000:
            continue
        np.testing.assert_allclose(q[rows, 1], np.broadcast_to(q[rows[0], 1], (len(rows), V)), atol=1e-6)
        emp = np.bincount(x[rows, 1], minlength=V) / len(rows)
        assert 0.5 * np.abs(emp - q[rows[0], 1]).sum() < 0.03
        q2_by_x1[v] = q[rows[0], 1]
    assert len(q2_by_x1) >= 2
    vals = list(q2_by_x1.values())
    assert max(0.5 * np.abs(vals[0] - w).sum() for w in vals[1:]) > 0.05, "Markov bias had no effect"
    emp1 = np.bincount(x[:, 0], minlength=V) / b
    assert 0.5 * np.abs(emp1 - q[0, 0]).sum() < 0.01
