"""The law of the first generated tokens at T > 0 from thousands of seeds, against the exact law
enumerated from the target, for both loops (:mod:`tests.unit.decoding.law`); and the request keys
the law's randomness comes from."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.target import Target
from tests.unit.decoding.helpers import TINY, V, tiny_params
from tests.unit.decoding.law import (
    DIST_PROMPT,
    N_LAW,
    SETTINGS,
    _binned,
    _bins,
    chi2_goodness,
    chi2_two_sample,
    counts_of,
    exact_law,
)


def test_request_keys_are_prng_keys_of_the_seeds():
    """The loops' vectorised request keys equal ``jax.random.PRNGKey(seed)`` seed by seed,
    including negative seeds and seeds past 32 bits (whose low 32 bits PRNGKey keeps)."""
    import jax

    from dspark_jax.decoding.loop import _keys

    seeds = [0, 1, -1, -5, 2**31 - 1, 2**31, 2**32, 2**32 + 7, 2**63 - 1, -(2**63), 123456789012345, 7]
    want = np.stack([np.asarray(jax.random.PRNGKey(s)) for s in seeds])
    np.testing.assert_array_equal(np.asarray(_keys(np.asarray(seeds, np.int64), len(seeds))), want)
    np.testing.assert_array_equal(np.asarray(_keys(np.int64(9), 3)), np.stack([np.asarray(jax.random.PRNGKey(9))] * 3))


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
