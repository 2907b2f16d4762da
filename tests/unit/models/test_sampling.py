"""Exactness tests for dspark_jax.models.sampling (logit processing and sampling)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import sampling
from dspark_jax.models.sampling import (
    SamplingArrays,
    draw_from_logits,
    logits_are_finite,
    process_logits,
    sample,
    sample_or_argmax,
    sampling_arrays,
)

pytestmark = pytest.mark.exactness


# --------------------------------------------------------------------------------------
# Independent numpy reference (float64): temperature -> top-k -> top-p (vLLM / HF order).
# --------------------------------------------------------------------------------------
def ref_process_row(logits, temperature, top_k, top_p):
    logits = np.asarray(logits, np.float64)
    v = logits.shape[-1]
    if temperature <= 0:
        out = np.zeros(v)
        out[int(np.argmax(logits))] = 1.0
        return out
    x = logits / temperature
    order = np.argsort(-x, kind="stable")  # ties: lower token id first
    k_eff = v if (top_k <= 0 or top_k >= v) else top_k
    top = order[:k_eff]
    pk = np.exp(x[top] - x[top].max())
    pk /= pk.sum()
    if top_p >= 1.0:
        n = k_eff
    else:
        cum = np.cumsum(pk)
        n = int(np.searchsorted(cum >= top_p, True)) + 1  # smallest n with cum[n-1] >= p
        n = min(max(n, 1), k_eff)
    kept = order[:n]
    out = np.zeros(v)
    e = np.exp(x[kept] - x[kept].max())
    out[kept] = e / e.sum()
    return out


def ref_process(logits, temperature, top_k, top_p):
    """logits [B, ..., V]; per-row params (lists)."""
    logits = np.asarray(logits)
    out = np.zeros(logits.shape)
    for b in range(logits.shape[0]):
        flat = logits[b].reshape(-1, logits.shape[-1])
        rows = [ref_process_row(r, temperature[b], top_k[b], top_p[b]) for r in flat]
        out[b] = np.stack(rows).reshape(logits.shape[1:])
    return out


def _logits(seed, shape, scale=2.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


# ----------------------------------------------------------------------------- helpers
def test_sampling_arrays_shapes_and_dtypes():
    s = sampling_arrays(3, temperature=0.7, top_k=5, top_p=0.9)
    assert isinstance(s, SamplingArrays)
    assert s.temperature.shape == (3,) and s.temperature.dtype == jnp.float32
    assert s.top_k.shape == (3,) and s.top_k.dtype == jnp.int32
    assert s.top_p.shape == (3,) and s.top_p.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s.temperature), 0.7)
    s = sampling_arrays(2, temperature=[0.0, 1.0], top_k=[0, 3], top_p=[1.0, 0.5])
    np.testing.assert_array_equal(np.asarray(s.top_k), [0, 3])
    with pytest.raises(ValueError):
        sampling_arrays(2, temperature=[1.0, 1.0, 1.0])
    # A NamedTuple is a pytree: it crosses jit boundaries.
    assert len(jax.tree_util.tree_leaves(s)) == 3


# ------------------------------------------------------------------------- temperature
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.3])
def test_temperature_is_softmax_of_scaled_logits(temperature):
    logits = _logits(0, (3, 4, 11))
    probs = process_logits(logits, sampling_arrays(3, temperature=temperature))
    expected = jax.nn.softmax(jnp.asarray(logits) / temperature, axis=-1)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(expected), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-5)


def test_temperature_zero_is_one_hot_at_first_argmax():
    logits = np.array(
        [[0.1, 3.0, 3.0, -1.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, 0.0, 0.0, -9.0]],
        np.float32,
    )
    # top-k / top-p must not change a greedy row.
    params = sampling_arrays(3, temperature=0.0, top_k=[0, 2, 1], top_p=[1.0, 0.1, 0.5])
    probs = np.asarray(process_logits(logits, params))
    expected = np.zeros_like(logits)
    expected[0, 1] = expected[1, 0] = expected[2, 2] = 1.0
    np.testing.assert_array_equal(probs, expected)


def test_temperature_whose_scaled_logits_overflow_is_greedy():
    """Issue 27: ``logits / 2e-38`` overflows float32 (softmax NaN, then the sampler's token 0);
    such a distribution is the greedy one-hot, its exact T -> 0 limit, with top-k / top-p and
    banned (-inf) tokens too, per distribution, and in a batch with ordinary rows left as they
    are. A tiny temperature that does not overflow is still sampled (its softmax is one-hot)."""
    b, g, v = 5, 3, 11
    logits = _logits(9, (b, g, v), scale=8.0)  # |logit| > 6.8 somewhere: 6.8 / 2e-38 overflows
    logits[:, :, 0] = 0.0  # a token whose scaled logit stays finite: the overflow is elsewhere
    logits[1, :, 4] = -np.inf  # banned
    logits[2] = -np.abs(logits[2]) - 20.0  # every logit negative: overflows to -inf, not +inf
    temperature = [2e-38, 2e-38, 1e-37, 0.7, 2e-38]
    params = sampling_arrays(b, temperature=temperature, top_k=[0, 3, 0, 4, 2], top_p=[1.0, 0.9, 0.5, 0.8, 1.0])
    probs = np.asarray(process_logits(logits, params))
    assert np.all(np.isfinite(probs))
    one_hot = np.eye(v, dtype=np.float32)[logits.argmax(-1)]
    np.testing.assert_array_equal(probs[[0, 1, 2, 4]], one_hot[[0, 1, 2, 4]])
    np.testing.assert_allclose(probs[3], ref_process(logits[3:4], [0.7], [4], [0.8])[0], rtol=2e-5, atol=1e-7)
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(3), b))
    np.testing.assert_array_equal(np.asarray(sample(keys, probs))[[0, 1, 2, 4]], logits.argmax(-1)[[0, 1, 2, 4]])
    # small logits: 2e-38 does not overflow them, and the distribution is one-hot all the same
    small = _logits(10, (b, g, v), scale=1e-3)
    probs = np.asarray(process_logits(small, sampling_arrays(b, temperature=2e-38)))
    np.testing.assert_array_equal(probs, np.eye(v, dtype=np.float32)[small.argmax(-1)])


# ------------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("k", [1, 2, 5, 10, 11, 50])
def test_top_k_keeps_exactly_the_k_largest(k):
    v = 11
    logits = _logits(1, (4, v))
    probs = np.asarray(process_logits(logits, sampling_arrays(4, temperature=1.0, top_k=k)))
    for b in range(4):
        kept = set(np.nonzero(probs[b])[0].tolist())
        expect = set(np.argsort(-logits[b])[: min(k, v)].tolist())
        assert kept == expect
        sub = sorted(expect)
        ref = np.exp(logits[b, sub] - logits[b, sub].max())
        np.testing.assert_allclose(probs[b, sub], ref / ref.sum(), rtol=1e-5)


def test_top_k_ties_at_threshold_are_deterministic():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0]], np.float32)
    probs = np.asarray(process_logits(logits, sampling_arrays(1, top_k=2)))
    # exactly k tokens; among equal logits the lower token ids win
    np.testing.assert_allclose(probs[0], [0, 0.5, 0.5, 0, 0, 0], atol=1e-7)
    probs = np.asarray(process_logits(logits, sampling_arrays(1, top_k=5)))
    assert np.count_nonzero(probs[0]) == 5 and probs[0, 4] == 0.0


# ------------------------------------------------------------------------------- top-p
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_top_p_keeps_the_minimal_nucleus(top_p):
    v = 13
    logits = _logits(2, (5, v), scale=1.5)
    probs = np.asarray(process_logits(logits, sampling_arrays(5, temperature=1.0, top_p=top_p)))
    full = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1), np.float64)
    for b in range(5):
        kept = np.nonzero(probs[b])[0]
        order = np.argsort(-full[b])
        n = len(kept)
        assert set(kept.tolist()) == set(order[:n].tolist())  # a top prefix
        assert full[b, order[:n]].sum() >= top_p - 1e-6  # enough mass
        assert full[b, order[: n - 1]].sum() < top_p + 1e-6  # and minimal
        np.testing.assert_allclose(probs[b, kept], full[b, kept] / full[b, kept].sum(), rtol=1e-5)


def test_top_p_edge_values():
    logits = _logits(3, (3, 9))
    probs = np.asarray(process_logits(logits, sampling_arrays(3, top_p=[0.0, 1.0, 1e-9])))
    assert np.count_nonzero(probs[0]) == 1 and probs[0].argmax() == logits[0].argmax()
    assert np.count_nonzero(probs[1]) == 9  # top_p = 1.0 is off
    assert np.count_nonzero(probs[2]) == 1
    # a tie at the nucleus cut: two equal tokens, each half the mass; p=0.5 keeps one
    tie = np.log(np.array([[0.25, 0.25, 0.5]], np.float32))
    probs = np.asarray(process_logits(tie, sampling_arrays(1, top_p=0.6)))
    np.testing.assert_allclose(probs[0], [1 / 3, 0.0, 2 / 3], rtol=1e-6)


# --------------------------------------------------------------------- combined / rows
def test_combined_order_and_per_row_params_match_reference():
    b, g, v = 6, 3, 17
    logits = _logits(4, (b, g, v))
    temperature = [0.5, 1.0, 1.3, 0.0, 0.8, 2.0]
    top_k = [0, 5, 3, 4, 1, 9]
    top_p = [0.9, 1.0, 0.6, 0.3, 0.5, 0.7]
    params = sampling_arrays(b, temperature=temperature, top_k=top_k, top_p=top_p)
    probs = np.asarray(process_logits(logits, params))
    np.testing.assert_allclose(probs, ref_process(logits, temperature, top_k, top_p), rtol=2e-5, atol=1e-7)
    # rows are independent: each row alone gives the same result
    for r in range(b):
        alone = process_logits(
            logits[r : r + 1],
            sampling_arrays(1, temperature=temperature[r], top_k=top_k[r], top_p=top_p[r]),
        )
        np.testing.assert_allclose(np.asarray(alone)[0], probs[r], rtol=1e-6, atol=1e-8)


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # probs 0.4, 0.3, 0.2, 0.1. top_k=2 -> {0.4/0.7, 0.3/0.7} = {0.571, 0.429}.
    # top_p=0.5 on that keeps only token 0; top_p on the *original* would also keep 1
    # (0.4 < 0.5). top_p=0.6 keeps both under the vLLM/HF order.
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 2, np.float32))
    probs = np.asarray(process_logits(logits, sampling_arrays(2, top_k=2, top_p=[0.5, 0.6])))
    np.testing.assert_allclose(probs[0], [1, 0, 0, 0], atol=1e-7)
    np.testing.assert_allclose(probs[1], [4 / 7, 3 / 7, 0, 0], rtol=1e-6)


def test_fast_path_equals_slow_path():
    b, v = 4, 23
    logits = jnp.asarray(_logits(5, (b, 2, v)))
    temperature = jnp.asarray([0.5, 1.0, 1.3, 0.0], jnp.float32)
    off = sampling_arrays(b, temperature=np.asarray(temperature), top_k=0, top_p=1.0)
    fast = process_logits(logits, off)
    # force the slow branch with the same (inactive) filter parameters
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    slow_scaled = jax.jit(sampling.filter_top_k_top_p)(
        scaled,
        jnp.zeros((b, 1, 1), jnp.int32),
        jnp.ones((b, 1, 1), jnp.float32),
    )
    np.testing.assert_array_equal(np.asarray(slow_scaled), np.asarray(scaled))
    # a batch where another row triggers the slow branch gives the same rows
    mixed = SamplingArrays(
        temperature=jnp.concatenate([temperature, jnp.ones((1,))]),
        top_k=jnp.asarray([0, 0, 0, 0, 3], jnp.int32),
        top_p=jnp.ones((5,), jnp.float32),
    )
    extra = jnp.concatenate([logits, logits[:1]], axis=0)
    np.testing.assert_allclose(np.asarray(process_logits(extra, mixed))[:b], np.asarray(fast), rtol=1e-6, atol=1e-8)
    # top_k = V is also "off"
    np.testing.assert_array_equal(
        np.asarray(process_logits(logits, off._replace(top_k=jnp.full((b,), v, jnp.int32)))),
        np.asarray(fast),
    )


def test_large_vocab_fast_and_filtered():
    v = 49152
    logits = jnp.asarray(_logits(6, (2, v)))
    probs = process_logits(logits, sampling_arrays(2, temperature=0.9))
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-4)
    probs = np.asarray(process_logits(logits, sampling_arrays(2, top_k=[50, 0], top_p=[1.0, 0.9])))
    assert np.count_nonzero(probs[0]) == 50
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-4)


# ------------------------------------------------------------------------ non-finite
def test_neg_inf_bans_tokens_and_finiteness_helper():
    logits = np.array(
        [[0.0, -np.inf, 1.0, -np.inf], [np.nan, 0.0, 1.0, 2.0], [np.inf, 0.0, 0.0, 0.0]],
        np.float32,
    )
    probs = np.asarray(process_logits(logits[:1], sampling_arrays(1, top_p=0.99)))
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    np.testing.assert_allclose(probs[0].sum(), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(logits_are_finite(logits)), [True, False, False])
    np.testing.assert_array_equal(np.asarray(logits_are_finite(logits, allow_neg_inf=False)), [False, False, False])
    all_banned = np.full((1, 2, 3), -np.inf, np.float32)
    all_banned[0, 0, 0] = 0.0
    assert not bool(logits_are_finite(all_banned)[0])  # second distribution has no finite logit


# ---------------------------------------------------------------------------- sample
def test_sample_never_draws_zero_probability_tokens_and_matches_law():
    probs = np.array([0.0, 0.5, 0.0, 0.2, 0.3, 0.0, 1e-30], np.float32)
    n = 200_000
    draws = np.asarray(sample(jax.random.PRNGKey(0), jnp.broadcast_to(probs, (n, 7))))
    assert draws.dtype == np.int32 and draws.shape == (n,)
    counts = np.bincount(draws, minlength=7)
    assert counts[0] == counts[2] == counts[5] == 0
    freq = counts / n
    np.testing.assert_allclose(freq[[1, 3, 4]], [0.5, 0.2, 0.3], atol=0.005)


def test_sample_is_jax_random_categorical():
    """The Gumbel-max draw with first_argmax gives jax.random.categorical's ids (zeros and ties included)."""
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.full(50, 0.3), size=(64, 3)).astype(np.float32)
    probs[:, :, ::7] = 0.0
    probs[:8] = np.where(np.arange(50) < 4, 0.25, 0.0)  # exact ties
    keys = jax.random.split(jax.random.PRNGKey(5), 64)
    log_p = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), -np.inf).astype(np.float32)
    ref = jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, jnp.asarray(log_p))
    np.testing.assert_array_equal(np.asarray(sample(keys, jnp.asarray(probs))), np.asarray(ref))


def test_sample_per_row_keys_are_row_local():
    keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), 3))
    probs = np.asarray(process_logits(_logits(7, (3, 5, 9)), sampling_arrays(3)))
    out = np.asarray(sample(keys, probs))
    assert out.shape == (3, 5)
    other, other_keys = probs.copy(), keys.copy()
    other[1:] = other[1:, :, ::-1]
    other_keys[2] = np.asarray(jax.random.PRNGKey(99))
    np.testing.assert_array_equal(np.asarray(sample(other_keys, other))[0], out[0])
    # typed keys work the same way
    typed = jax.random.split(jax.random.key(1), 3)
    assert np.asarray(sample(typed, probs)).shape == (3, 5)


def test_sample_greedy_probs_returns_argmax():
    logits = _logits(8, (4, 3, 10))
    probs = process_logits(logits, sampling_arrays(4, temperature=0.0))
    keys = jax.random.split(jax.random.PRNGKey(2), 4)
    np.testing.assert_array_equal(np.asarray(sample(keys, probs)), logits.argmax(-1))


def test_sample_or_argmax_draws_what_sample_draws():
    # Greedy rows with ties (the first index wins in both) and a sampled batch with the flag off.
    logits = np.asarray(_logits(9, (4, 3, 10))).copy()
    logits[0, 0, [2, 5]] = logits[0, 0].max() + 1.0
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    greedy = process_logits(jnp.asarray(logits), sampling_arrays(4, temperature=0.0))
    got = np.asarray(sample_or_argmax(keys, greedy, jnp.bool_(True)))
    np.testing.assert_array_equal(got, np.asarray(sample(keys, greedy)))
    assert got[0, 0] == 2
    sampled = process_logits(jnp.asarray(logits), sampling_arrays(4, temperature=1.0))
    np.testing.assert_array_equal(
        np.asarray(sample_or_argmax(keys, sampled, jnp.bool_(False))), np.asarray(sample(keys, sampled))
    )


def test_draw_from_logits_is_the_draw_from_process_logits():
    # All greedy (ties and a NaN row included): the argmax of the raw logits is what sampling the
    # one-hot gives. One sampled row: every row goes through process_logits and the draw.
    logits = np.asarray(_logits(10, (4, 10))).copy()
    logits[0, [2, 5]] = logits[0].max() + 1.0
    logits[3, 4] = np.nan
    keys = jax.random.split(jax.random.PRNGKey(4), 4)

    def draw(p):
        return sample(keys, p)

    for temperature in (0.0, [0.0, 0.7, 0.0, 0.0]):
        params = sampling_arrays(4, temperature=temperature, top_k=3)
        got = np.asarray(draw_from_logits(jnp.asarray(logits), params, draw))
        np.testing.assert_array_equal(got, np.asarray(sample(keys, process_logits(jnp.asarray(logits), params))))
    assert got[0] == 2
