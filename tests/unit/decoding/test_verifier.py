"""Exactness tests for dspark_jax.decoding.verifier (lossless rejection-sampling verification).

docs/design.md#verification: the output must be distributed exactly as plain
sampling from the target. Three layers of evidence:

1. the math, by enumeration: an independent numpy implementation of the rejection rule
   enumerates every draft outcome x accept/reject x residual draw and gives the exact law
   of one round's output; the first token has law p and the first two stream tokens have
   law p(y1) p(y2 | y1);
2. the implementation, by Monte Carlo: >= 200k vmapped rounds of :func:`verify` (drafts
   sampled from a Markov drafter q, target second-position law depending on the first
   token, temperatures / top-k / top-p through ``process_logits``) match both;
3. properties (hypothesis) and targeted cases: greedy, lengths = 0, padding garbage,
   per-row independence, independent accept / residual randomness, non-anticipation.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from dspark_jax.decoding.verifier import (
    VerifyOutput,
    coupled_accept,
    verify,
    verify_coupled,
    verify_coupled_packed,
    verify_rejection_packed,
)
from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

pytestmark = pytest.mark.exactness

V = 4  # vocabulary of the law tests
G = 2  # block size of the law tests
N_MC = 200_000


# ======================================================================================
# Small target / drafter "models" (tables of distributions) built through process_logits
# ======================================================================================
def make_tables(seed, temperature, top_k, top_p, v=V):
    """Target p1 [V], p2 [V, V] (p2[y1] = law of token 2 given token 1), p3 [V, V, V]
    (law of token 3 given tokens 1, 2); Markov drafter q1 [V], q2 [V, V] (q2[x] = law of
    the next draft given the previous token x). All through the same process_logits."""
    rng = np.random.default_rng(seed)
    n_rows = 1 + v + v * v

    def dists(logits):
        params = sampling_arrays(n_rows, temperature=temperature, top_k=top_k, top_p=top_p)
        probs = np.asarray(process_logits(logits.astype(np.float32), params), np.float64)
        return probs / probs.sum(-1, keepdims=True)  # exact float64 laws for enumeration

    # A drafter that roughly imitates the target (logits + noise): accept, reject,
    # correction and bonus paths all carry mass.
    target_logits = rng.normal(size=(n_rows, v)) * 1.5
    pt = dists(target_logits)
    pd = dists(target_logits + rng.normal(size=(n_rows, v)) * 0.8)
    p1, p2, p3 = pt[0], pt[1 : 1 + v], pt[1 + v :].reshape(v, v, v)
    q1, q2 = pd[0], pd[1 : 1 + v]
    return p1, p2, p3, q1, q2


# ======================================================================================
# 1. Independent numpy implementation of the rejection rule (the math, by enumeration)
# ======================================================================================
def _residual(p, q):
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def analytic_round_law(p1, p2, p3, q1, q2, length):
    """Exact law of one round's emitted sequence (tuple of ids) for G = 2 and a fixed
    verification length in {0, 1, 2}: sum over draft outcomes x accept/reject x residual."""
    v = len(p1)
    law = defaultdict(float)
    if length == 0:
        for c in range(v):
            law[(c,)] += p1[c]
        return dict(law)
    r1 = _residual(p1, q1)
    for x1 in range(v):
        if q1[x1] == 0:
            continue
        a1 = min(1.0, p1[x1] / q1[x1])
        for c in range(v):
            law[(c,)] += q1[x1] * (1 - a1) * r1[c]
        if length == 1:
            for b in range(v):
                law[(x1, b)] += q1[x1] * a1 * p2[x1][b]
            continue
        r2 = _residual(p2[x1], q2[x1])
        for x2 in range(v):
            if q2[x1][x2] == 0:
                continue
            a2 = min(1.0, p2[x1][x2] / q2[x1][x2])
            w = q1[x1] * a1 * q2[x1][x2]
            for c in range(v):
                law[(x1, c)] += w * (1 - a2) * r2[c]
            for b in range(v):
                law[(x1, x2, b)] += w * a2 * p3[x1, x2][b]
    return dict(law)


def stream_laws(round_law, p2):
    """Law of the first stream token and of the first two stream tokens, given one round's
    law; when the round emits one token the next round (lossless) supplies p2[y1]."""
    v = p2.shape[0]
    first = np.zeros(v)
    joint = np.zeros((v, v))
    for seq, pr in round_law.items():
        first[seq[0]] += pr
        if len(seq) >= 2:
            joint[seq[0], seq[1]] += pr
        else:
            joint[seq[0]] += pr * p2[seq[0]]
    return first, joint


SAMPLING_CONFIGS = [
    # (temperature, top_k, top_p)
    (0.5, 0, 1.0),
    (1.0, 0, 1.0),
    (1.3, 0, 1.0),
    (1.0, 3, 1.0),
    (1.3, 0, 0.8),
    (0.7, 3, 0.9),
]


@pytest.mark.parametrize("config", SAMPLING_CONFIGS + [(0.0, 0, 1.0)])
@pytest.mark.parametrize("length", [0, 1, 2])
def test_rejection_rule_is_exact_by_enumeration(config, length):
    p1, p2, p3, q1, q2 = make_tables(11, *config)
    law = analytic_round_law(p1, p2, p3, q1, q2, length)
    assert abs(sum(law.values()) - 1.0) < 1e-9
    first, joint = stream_laws(law, p2)
    np.testing.assert_allclose(first, p1, atol=1e-12)
    np.testing.assert_allclose(joint, p1[:, None] * p2, atol=1e-12)


def test_resampling_from_full_target_would_be_biased():
    """Paper Appendix A1: resampling from p (not the residual) gives P(A) = 0.64, not 0.7."""
    p, q = np.array([0.7, 0.3]), np.array([0.5, 0.5])
    accept = np.minimum(1, p / q)
    reject_mass = (q * (1 - accept)).sum()
    assert np.isclose(q[0] * accept[0] + reject_mass * p[0], 0.64)
    assert np.isclose(q[0] * accept[0] + reject_mass * _residual(p, q)[0], 0.7)


# ======================================================================================
# 2. Monte Carlo of the implementation
# ======================================================================================
def _rows(table, n):
    return jnp.broadcast_to(table, (n,) + table.shape)


@functools.partial(jax.jit, static_argnums=(0, 8))
def simulate_two_tokens(n, key, p1, p2, p3, q1, q2, length_probs, mode="rejection"):
    """n independent samples of the first two stream tokens.

    ``mode="rejection"``: :func:`verify`; ``mode="coupled"``: :func:`verify_coupled`, where
    the drafter draws stream position ``j`` with the key the target samples it with (one
    key per sample and stream position, as the serving engine's ``fold_in(request_key, t)``);
    round 2 redrafts position 1 with position 1's key.

    Round 1: the Markov drafter draws x1 ~ q1, x2 ~ q2[x1]; the verification length is
    drawn from ``length_probs`` independently of the drafts (non-anticipating); the target
    gives p1, p2[x1], p3[x1, x2]. If round 1 emits a single token y1, round 2 drafts
    z ~ q2[y1], verifies it (length 1) against p2[y1] and contributes its first token.

    Returns (y1, y2, round-1 num_emitted, round-1 tokens [n, G+1]).
    """
    kx1, kx2, klen, kv1, kz, kv2 = jax.random.split(key, 6)
    if mode == "coupled":
        k0, k1, k2 = (jax.random.split(k, n) for k in (kx1, kx2, kv1))
        x1 = sample(k0, _rows(q1, n))
        x2 = sample(k1, q2[x1])
        lengths = sample(klen, _rows(length_probs, n))
        out = verify_coupled(
            jnp.stack([k0, k1, k2], axis=1),
            jnp.stack([x1, x2], axis=1),
            jnp.stack([_rows(p1, n), p2[x1], p3[x1, x2]], axis=1),
            lengths,
        )
        y1 = out.tokens[:, 0]
        z = sample(k1, q2[y1])
        out2 = verify_coupled(
            jnp.stack([k1, k2], axis=1), z[:, None], jnp.stack([p2[y1], p3[y1, z]], axis=1), jnp.ones((n,), jnp.int32)
        )
        y2 = jnp.where(out.num_emitted >= 2, out.tokens[:, 1], out2.tokens[:, 0])
        return y1, y2, out.num_emitted, out.tokens
    x1 = sample(kx1, _rows(q1, n))
    q2_x1 = q2[x1]
    x2 = sample(kx2, q2_x1)
    lengths = sample(klen, _rows(length_probs, n))
    out = verify(
        jax.random.split(kv1, n),
        jnp.stack([x1, x2], axis=1),
        jnp.stack([_rows(q1, n), q2_x1], axis=1),
        jnp.stack([_rows(p1, n), p2[x1], p3[x1, x2]], axis=1),
        lengths,
    )
    y1 = out.tokens[:, 0]
    z = sample(kz, q2[y1])
    out2 = verify(
        jax.random.split(kv2, n),
        z[:, None],
        q2[y1][:, None],
        jnp.stack([p2[y1], p3[y1, z]], axis=1),
        jnp.ones((n,), jnp.int32),
    )
    y2 = jnp.where(out.num_emitted >= 2, out.tokens[:, 1], out2.tokens[:, 0])
    return y1, y2, out.num_emitted, out.tokens


def _tv(a, b):
    return 0.5 * np.abs(np.asarray(a) - np.asarray(b)).sum()


def _as_f32(*tables):
    return [jnp.asarray(t, jnp.float32) for t in tables]


LENGTH_POLICIES = {
    "fixed2": [0.0, 0.0, 1.0],
    "uniform012": [1 / 3, 1 / 3, 1 / 3],
}


# Coupled draws' token law does not involve the lengths: one length policy is enough.
@pytest.mark.parametrize(
    "policy,mode", [(p, "rejection") for p in sorted(LENGTH_POLICIES)] + [("uniform012", "coupled")]
)
@pytest.mark.parametrize("config", SAMPLING_CONFIGS)
def test_monte_carlo_law_of_first_two_tokens(config, policy, mode):
    """Both serving verification modes (docs/design.md#verification) under the same
    law test: first token ~ p1, first two ~ p1(y1) p2(y2 | y1)."""
    p1, p2, p3, q1, q2 = make_tables(11, *config)
    length_probs = jnp.asarray(LENGTH_POLICIES[policy], jnp.float32)
    seed = 1000 + 10 * SAMPLING_CONFIGS.index(config) + sorted(LENGTH_POLICIES).index(policy)
    seed += 500 * (mode == "coupled")
    y1, y2, n_em, tokens = jax.device_get(
        simulate_two_tokens(N_MC, jax.random.PRNGKey(seed), *_as_f32(p1, p2, p3, q1, q2), length_probs, mode)
    )
    first = np.bincount(y1, minlength=V) / N_MC
    joint = np.bincount(y1 * V + y2, minlength=V * V).reshape(V, V) / N_MC
    assert _tv(first, p1) < 0.01
    assert _tv(joint, p1[:, None] * p2) < 0.01
    if mode == "coupled":
        # Coupled acceptance is P(x == y) under shared noise: below rejection's 1 - TV, > 0.
        assert 0.0 < float(np.mean(n_em > 1)) < 1.0
        return
    # The whole round's law (which tokens, how many) matches the enumeration too:
    # a mixture over the independently drawn lengths.
    law = defaultdict(float)
    for length, w in enumerate(LENGTH_POLICIES[policy]):
        if w > 0:
            for seq, pr in analytic_round_law(p1, p2, p3, q1, q2, length).items():
                law[seq] += w * pr
    mc = defaultdict(float)
    seqs, counts = np.unique(np.where(np.arange(G + 1) < n_em[:, None], tokens, -1), axis=0, return_counts=True)
    for seq, c in zip(seqs, counts):
        mc[tuple(int(t) for t in seq if t >= 0)] = c / N_MC
    assert set(mc) <= {k for k in law if law[k] > 0}
    assert 0.5 * sum(abs(law[k] - mc.get(k, 0)) for k in law) < 0.015


def test_greedy_monte_carlo_is_deterministic_target_argmax():
    p1, p2, p3, q1, q2 = make_tables(12, 0.0, 0, 1.0)
    y1, y2, _, _ = jax.device_get(
        simulate_two_tokens(
            N_MC,
            jax.random.PRNGKey(5),
            *_as_f32(p1, p2, p3, q1, q2),
            jnp.asarray(LENGTH_POLICIES["uniform012"], jnp.float32),
        )
    )
    a1 = int(np.argmax(p1))
    assert np.all(y1 == a1) and np.all(y2 == int(np.argmax(p2[a1])))


def test_accept_and_residual_randomness_are_independent():
    """Conditional on rejection the correction follows norm(max(0, p - q)) exactly, and
    conditional on acceptance the bonus follows p_bonus: a reused uniform would skew both
    (rejection selects large u)."""
    n = N_MC
    p = jnp.asarray([0.6, 0.25, 0.1, 0.05], jnp.float32)
    q = jnp.asarray([0.1, 0.2, 0.3, 0.4], jnp.float32)
    bonus = jnp.asarray([0.1, 0.2, 0.3, 0.4], jnp.float32)
    kd, kv = jax.random.split(jax.random.PRNGKey(3))
    x = sample(kd, _rows(q, n))
    out = jax.device_get(
        verify(
            jax.random.split(kv, n),
            x[:, None],
            _rows(q, n)[:, None],
            jnp.stack([_rows(p, n), _rows(bonus, n)], axis=1),
            jnp.ones((n,), jnp.int32),
        )
    )
    rej = out.num_accepted == 0
    p_np, q_np = np.asarray(p, np.float64), np.asarray(q, np.float64)
    accept_rate = np.minimum(p_np, q_np).sum()
    assert abs((~rej).mean() - accept_rate) < 0.005
    corr = np.bincount(out.next_token[rej], minlength=4) / rej.sum()
    assert _tv(corr, _residual(p_np, q_np)) < 0.01
    bon = np.bincount(out.next_token[~rej], minlength=4) / (~rej).sum()
    assert _tv(bon, np.asarray(bonus)) < 0.01


# ======================================================================================
# 3. Non-anticipation (docs/design.md#non-anticipation)
# ======================================================================================
def simulate_scheduled_round(key, target, draft, length_rule, n=N_MC):
    """One-token-block rounds (G = 1) where a scheduler picks the verification length.

    Args:
      key: PRNG key.
      target, draft: ``[V]`` distributions p and q.
      length_rule: ``(draft_tokens [n, 1] int32, key) -> lengths [n] int32``. A
        non-anticipating rule must not look at ``draft_tokens``.
      n: number of independent rounds.

    Returns:
      ``[n] int32`` first emitted token of each round.
    """
    target = jnp.asarray(target, jnp.float32)
    draft = jnp.asarray(draft, jnp.float32)
    kd, kr, kv = jax.random.split(key, 3)
    x = sample(kd, _rows(draft, n))[:, None]
    lengths = jnp.asarray(length_rule(x, kr), jnp.int32)
    out = verify(
        jax.random.split(kv, n),
        x,
        _rows(draft, n)[:, None],
        jnp.stack([_rows(target, n), _rows(target, n)], axis=1),
        lengths,
    )
    return np.asarray(out.tokens[:, 0])


A, B = 0, 1
NA_TARGET, NA_DRAFT = [0.7, 0.3], [0.5, 0.5]


def test_anticipating_scheduler_breaks_losslessness():
    # verify only when A was drawn: P(A) = 0.5 * 1 + 0.5 * 0.7 = 0.85
    out = simulate_scheduled_round(
        jax.random.PRNGKey(21),
        NA_TARGET,
        NA_DRAFT,
        lambda x, k: (x[:, 0] == A).astype(jnp.int32),
    )
    assert abs((out == A).mean() - 0.85) < 0.005


@pytest.mark.parametrize(
    "rule",
    [
        lambda x, k: jnp.ones(x.shape[0], jnp.int32),
        lambda x, k: jnp.zeros(x.shape[0], jnp.int32),
        lambda x, k: jax.random.bernoulli(k, 0.5, (x.shape[0],)).astype(jnp.int32),
        lambda x, k: jax.random.bernoulli(k, 0.2, (x.shape[0],)).astype(jnp.int32),
    ],
    ids=["fixed1", "fixed0", "coin0.5", "coin0.2"],
)
def test_non_anticipating_scheduler_is_lossless(rule):
    out = simulate_scheduled_round(jax.random.PRNGKey(22), NA_TARGET, NA_DRAFT, rule)
    assert abs((out == A).mean() - 0.7) < 0.005


# ======================================================================================
# 4. Targeted cases
# ======================================================================================
def _one_hot(ids, v):
    return np.eye(v, dtype=np.float32)[np.asarray(ids)]


def test_greedy_reduces_to_argmax_matching():
    v = 6
    # target argmaxes per position (G = 3 -> 4 distributions); drafts per row
    t_arg = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]])
    drafts = np.array([[1, 2, 3], [1, 0, 3], [4, 2, 3], [1, 2, 5], [5, 5, 5]], np.int32)
    lengths = np.array([3, 3, 3, 2, 1], np.int32)
    out = jax.device_get(
        verify(
            jax.random.split(jax.random.PRNGKey(0), 5),
            drafts,
            _one_hot(drafts, v),
            _one_hot(t_arg, v),
            lengths,
        )
    )
    np.testing.assert_array_equal(out.num_accepted, [3, 1, 0, 2, 1])
    np.testing.assert_array_equal(out.next_token, [4, 2, 1, 3, 0])
    np.testing.assert_array_equal(
        out.tokens,
        [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1], [5, 0, -1, -1]],
    )
    np.testing.assert_array_equal(out.num_emitted, out.num_accepted + 1)
    # deterministic whatever the key
    for seed in range(3):
        again = verify(
            jax.random.split(jax.random.PRNGKey(seed + 1), 5),
            drafts,
            _one_hot(drafts, v),
            _one_hot(t_arg, v),
            lengths,
        )
        np.testing.assert_array_equal(np.asarray(again.tokens), out.tokens)


def _random_block(seed, b, g, v, zero_frac=0.3):
    """Random q, p (with some exact zeros), drafts drawn from q, lengths, keys (numpy)."""
    rng = np.random.default_rng(seed)

    def dists(shape):
        logits = rng.normal(size=shape) * 1.5
        logits[rng.random(shape) < zero_frac] = -np.inf
        logits[..., 0] = np.where(np.isinf(logits[..., 0]), 0.0, logits[..., 0])
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(np.float32)

    q = dists((b, g, v))
    p = dists((b, g + 1, v))
    drafts = np.stack([[rng.choice(v, p=q[i, k] / q[i, k].sum()) for k in range(g)] for i in range(b)]).astype(np.int32)
    lengths = rng.integers(0, g + 1, size=b).astype(np.int32)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(seed % (2**31)), b))
    return keys, drafts, q, p, lengths


def _poison_padding(drafts, q, p, lengths, seed=0):
    rng = np.random.default_rng(seed)
    drafts, q, p = drafts.copy(), q.copy(), p.copy()
    b, g, v = q.shape
    for i in range(b):
        L = lengths[i]
        drafts[i, L:] = rng.choice([-7, v + 3, 10**6, 0], size=g - L)
        q[i, L:] = np.nan
        p[i, L + 1 :] = np.nan
    return drafts, q, p


def _assert_same(a: VerifyOutput, b: VerifyOutput, rows=slice(None)):
    for name in VerifyOutput._fields:
        np.testing.assert_array_equal(
            np.asarray(getattr(a, name))[rows], np.asarray(getattr(b, name))[rows], err_msg=name
        )


def test_all_greedy_skips_only_the_noise():
    """``all_greedy=True`` (every target distribution one-hot) draws the correction / bonus token
    without its Gumbel noise: the same output, bit for bit, for random and one-hot drafts (any q,
    lengths 0..G, rejections and full acceptances), and for G = 0."""
    b, g, v = 32, 4, 12
    keys, drafts, q, p, lengths = _random_block(7, b, g, v)
    t_arg = np.argmax(p, axis=-1)
    t_arg[::2, :g] = drafts[::2]  # every other row accepts its drafts, the others mostly reject
    p1 = _one_hot(t_arg, v)
    for qq in (q, _one_hot(drafts, v)):
        want = verify(keys, drafts, qq, p1, lengths)
        got = verify(keys, drafts, qq, p1, lengths, jnp.asarray(True))
        _assert_same(want, got)
    assert 0 < int(np.sum(np.asarray(want.num_accepted) < lengths)) < b  # both kinds of rows ran
    empty = np.zeros((b, 0), np.int32)
    args = (keys, empty, np.zeros((b, 0, v), np.float32), p1[:, :1], lengths * 0)
    _assert_same(verify(*args), verify(*args, jnp.asarray(True)))


def test_padding_garbage_and_nan_do_not_change_results():
    keys, drafts, q, p, lengths = _random_block(1, 6, 4, 5)
    lengths = np.array([0, 1, 2, 3, 4, 2], np.int32)
    ref = verify(keys, drafts, q, p, lengths)
    for seed in range(3):
        d2, q2, p2 = _poison_padding(drafts, q, p, lengths, seed)
        _assert_same(ref, verify(keys, d2, q2, p2, lengths))


def test_rows_are_independent_of_batch_mates():
    keys, drafts, q, p, lengths = _random_block(2, 6, 4, 5)
    ref = verify(keys, drafts, q, p, lengths)
    _, d_o, q_o, p_o, l_o = _random_block(3, 6, 4, 5)
    k_o = np.asarray(jax.random.split(jax.random.PRNGKey(77), 6))
    for r in range(6):
        mixed = [x.copy() for x in (k_o, d_o, q_o, p_o, l_o)]
        for m, src in zip(mixed, (keys, drafts, q, p, lengths)):
            m[r] = src[r]
        _assert_same(ref, verify(*mixed), rows=r)


def test_lengths_zero_is_plain_sampling():
    keys, drafts, q, p, _ = _random_block(4, 6, 4, 5)
    lengths = np.array([0, 2, 0, 4, 0, 1], np.int32)
    out = verify(keys, drafts, q, p, lengths)
    zero = lengths == 0
    np.testing.assert_array_equal(np.asarray(out.num_accepted)[zero], 0)
    # documented key use: the draw uses the second half of split(row key)
    sample_keys = np.asarray(jax.vmap(lambda k: jax.random.split(k)[1])(keys))
    plain = np.asarray(sample(sample_keys, p[:, 0]))
    np.testing.assert_array_equal(np.asarray(out.next_token)[zero], plain[zero])
    all_zero = verify(keys, drafts, q, p, np.zeros(6, np.int32))
    np.testing.assert_array_equal(np.asarray(all_zero.next_token), plain)
    # G = 0 (no drafts at all) agrees
    g0 = verify(keys, drafts[:, :0], q[:, :0], p[:, :1], np.zeros(6, np.int32))
    np.testing.assert_array_equal(np.asarray(g0.next_token), plain)
    assert g0.tokens.shape == (6, 1) and g0.accepted.shape == (6, 0)
    # and in law: lengths = 0 samples from p0
    n = N_MC
    p0 = jnp.asarray([0.1, 0.0, 0.6, 0.3], jnp.float32)
    out = verify(
        jax.random.split(jax.random.PRNGKey(8), n),
        jnp.zeros((n, 1), jnp.int32),
        jnp.full((n, 1, 4), jnp.nan),
        jnp.stack([_rows(p0, n), _rows(p0, n)], 1),
        jnp.zeros((n,), jnp.int32),
    )
    freq = np.bincount(np.asarray(out.next_token), minlength=4) / n
    assert freq[1] == 0 and _tv(freq, np.asarray(p0)) < 0.01


def test_zero_residual_falls_back_to_target():
    """If max(0, p - q) has zero mass at a rejection (possible only through rounding, when
    q slightly exceeds p everywhere), the draw falls back to p. Forced here with a q
    that over-covers p (sums to 2.7), so the residual is exactly 0 everywhere."""
    n = 256
    p = np.broadcast_to(np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]], np.float32), (n, 2, 3))
    q = np.full((n, 1, 3), 0.9, np.float32)
    out = jax.device_get(
        verify(
            jax.random.split(jax.random.PRNGKey(0), n),
            np.ones((n, 1), np.int32),
            q,
            p,
            np.ones((n,), np.int32),
        )
    )
    rej = out.num_accepted == 0
    assert 50 < rej.sum() < 200  # P(reject) = 1 - 0.5 / 0.9
    assert set(out.next_token[rej].tolist()) == {1, 2}  # from p, never the p = 0 token


def test_no_recompilation_across_lengths():
    keys, drafts, q, p, lengths = _random_block(5, 3, 4, 5)
    verify(keys, drafts, q, p, lengths)
    size = verify._cache_size()
    for L in ([0, 0, 0], [4, 4, 4], [1, 3, 2]):
        verify(keys, drafts, q, p, np.asarray(L, np.int32))
    assert verify._cache_size() == size


def test_shape_mismatch_raises():
    keys, drafts, q, p, lengths = _random_block(6, 2, 3, 4)
    with pytest.raises(ValueError):
        verify(keys, drafts, q, p[:, :3], lengths)


# ======================================================================================
# 5. Properties (hypothesis)
# ======================================================================================
SHAPES = [(4, 3, 5), (3, 4, 3)]


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(SHAPES),
    equal_pq=st.booleans(),
    zero_frac=st.sampled_from([0.0, 0.3, 0.6]),
)
def test_verify_properties(seed, shape, equal_pq, zero_frac):
    b, g, v = shape
    keys, drafts, q, p, lengths = _random_block(seed, b, g, v, zero_frac)
    if equal_pq:
        p[:, :g] = q
    out = jax.device_get(verify(keys, drafts, q, p, lengths))

    # shapes / dtypes
    assert out.num_accepted.shape == (b,) and out.num_accepted.dtype == np.int32
    assert out.next_token.shape == (b,) and out.next_token.dtype == np.int32
    assert out.tokens.shape == (b, g + 1) and out.tokens.dtype == np.int32
    assert out.num_emitted.shape == (b,) and out.num_emitted.dtype == np.int32
    assert out.accepted.shape == (b, g) and out.accepted.dtype == np.bool_

    n = out.num_accepted
    assert np.all((n >= 0) & (n <= lengths))
    np.testing.assert_array_equal(out.num_emitted, n + 1)
    pos = np.arange(g)
    np.testing.assert_array_equal(out.accepted, pos[None] < n[:, None])
    assert not np.any(out.accepted & (pos[None] >= lengths[:, None]))
    for i in range(b):
        np.testing.assert_array_equal(out.tokens[i, : n[i]], drafts[i, : n[i]])
        assert out.tokens[i, n[i]] == out.next_token[i]
        assert np.all(out.tokens[i, n[i] + 1 :] == -1)
        nxt = out.next_token[i]
        assert 0 <= nxt < v
        assert p[i, n[i], nxt] > 0  # positive target mass
        if n[i] < lengths[i]:  # rejected: positive residual mass (unless residual is 0)
            resid = np.maximum(p[i, n[i]] - q[i, n[i]], 0)
            assert resid[nxt] > 0 or resid.sum() == 0
    if equal_pq:
        np.testing.assert_array_equal(n, lengths)

    # padding never matters
    d2, q2, p2 = _poison_padding(drafts, q, p, lengths, seed % 1000)
    _assert_same(out, verify(keys, d2, q2, p2, lengths))


# ======================================================================================
# 5. Coupled draws (the serving engine's default mode)
# ======================================================================================
def test_coupled_output_is_plain_sampling_with_the_same_keys():
    """verify_coupled emits, position by position, exactly ``sample(keys[j], p_j)``: the
    plain-decoding token with that key, whatever the drafts (random or drawn with the same
    keys) and the lengths; it accepts a draft iff it equals that sample."""
    b, g, v = 64, 3, 5
    rng = np.random.default_rng(0)
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, g + 1, v)) * 2, jnp.float32), axis=-1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, g, v)) * 2, jnp.float32), axis=-1)
    keys = jax.random.split(jax.random.PRNGKey(3), b * (g + 1)).reshape(b, g + 1, 2)
    plain = np.asarray(jax.vmap(sample)(keys, p))  # [b, g+1]
    lengths = jnp.asarray(rng.integers(0, g + 1, b), jnp.int32)
    for drafts in (jax.vmap(sample)(keys[:, :g], q), jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32)):
        out = jax.device_get(verify_coupled(keys, drafts, p, lengths))
        d = np.asarray(drafts)
        for r in range(b):
            a = int(out.num_accepted[r])
            assert a <= int(lengths[r])
            np.testing.assert_array_equal(out.tokens[r, : a + 1], plain[r, : a + 1])
            assert np.all(out.tokens[r, a + 1 :] == -1) and out.next_token[r] == plain[r, a]
            np.testing.assert_array_equal(d[r, :a], plain[r, :a])
            if a < int(lengths[r]):
                assert d[r, a] != plain[r, a]
    # shared noise makes acceptance high when q is close to p
    near = verify_coupled(keys, jax.vmap(sample)(keys[:, :g], p[:, :g]), p, jnp.full((b,), g, jnp.int32))
    assert int(np.asarray(near.num_accepted).sum()) == b * g


def test_coupled_accept_greedy_and_padding():
    drafts = jnp.asarray([[1, 2, 3], [1, 0, 3], [4, 2, 3], [1, 2, 5]], jnp.int32)
    y = jnp.asarray([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, -7]], jnp.int32)
    out = jax.device_get(coupled_accept(drafts, y, jnp.asarray([3, 3, 3, 2], jnp.int32)))
    np.testing.assert_array_equal(out.num_accepted, [3, 1, 0, 2])
    np.testing.assert_array_equal(out.tokens, [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]])
    np.testing.assert_array_equal(out.next_token, [4, 2, 1, 3])


def _packing(lengths, width):
    """The serving engine's packing of rows with ``lengths[r] + 1`` tokens each, in a buffer
    with two padding slots: ``(rows, cols)`` ``[K]`` (padding: row ``R``, col 0)."""
    r_ = len(lengths)
    rows = [r for r in range(r_) for _ in range(int(lengths[r]) + 1)] + [r_, r_]
    cols = [c for r in range(r_) for c in range(int(lengths[r]) + 1)] + [0, 0]
    assert max(cols) < width
    return np.asarray(rows, np.int32), np.asarray(cols, np.int32)


def test_packed_verification_equals_the_grid_verification():
    """verify_coupled_packed / verify_rejection_packed (the engine's packed rows) give the
    same tokens and acceptance as verify_coupled / verify on the equivalent [R, G+1] grid."""
    b, g, v = 16, 3, 5
    rng = np.random.default_rng(1)
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, g + 1, v)) * 2, jnp.float32), axis=-1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, g, v)) * 2, jnp.float32), axis=-1)
    keys = jax.random.split(jax.random.PRNGKey(5), b * (g + 1)).reshape(b, g + 1, 2)
    drafts = jax.vmap(sample)(keys[:, :g], q)
    lengths = np.asarray(rng.integers(0, g + 1, b), np.int32)
    rows, cols = _packing(lengths, g + 1)
    r_c, c_c = np.minimum(rows, b - 1), cols  # padding slots read any valid entry
    grid = verify_coupled(keys, drafts, p, jnp.asarray(lengths))
    toks, acc = verify_coupled_packed(
        keys[r_c, c_c], p[r_c, c_c], rows, cols, drafts, jnp.asarray(lengths), width=g + 1
    )
    np.testing.assert_array_equal(acc, grid.num_accepted)
    for r in range(b):  # the emitted tokens agree; the packed grid also holds the unread samples
        a = int(acc[r])
        np.testing.assert_array_equal(np.asarray(toks)[r, : a + 1], np.asarray(grid.tokens)[r, : a + 1])
    plain_toks, plain_acc = verify_coupled_packed(keys[r_c, c_c], p[r_c, c_c], rows, cols, drafts, None, width=g + 1)
    assert not np.asarray(plain_acc).any()
    rkeys = jax.random.split(jax.random.PRNGKey(6), b)
    want = verify(rkeys, drafts, q, p, jnp.asarray(lengths))
    got = verify_rejection_packed(rkeys, drafts, q, p[r_c, c_c], rows, cols, jnp.asarray(lengths))
    # p past lengths[r] is zero on the packed grid: padding, never read (verify's contract)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    # keys given as a function (the engine derives them after the scatter): the same result
    lazy = verify_rejection_packed(lambda: rkeys, drafts, q, p[r_c, c_c], rows, cols, jnp.asarray(lengths))
    np.testing.assert_array_equal(lazy.tokens, want.tokens)
