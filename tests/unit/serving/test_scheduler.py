"""Unit tests of the verification-length policies, online calibration and the cost (SPS) table.

docs/design.md#scheduler: the clean greedy scheduler against brute force over every admissible
allocation (per-row prefix lengths), the exact global search, the threshold and fixed
policies, the deployed variant's budget depending only on stale confidences, and
non-anticipation (the policies are functions of confidences only). All numpy, no model.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dspark_jax.decoding.cost_table import CostTable, live_span, measured_spans, time_programs
from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import scheduler as sch
from dspark_jax.serving.engine.online_calibration import OnlineCalibrator


def theta_of(lengths, surv, sps_of_total):
    n = surv.shape[0]
    t = n + int(np.sum(lengths))
    if t >= len(sps_of_total):
        return 0.0
    emitted = n + sum(float(np.sum(surv[r, :l])) for r, l in enumerate(lengths))
    return emitted * float(sps_of_total[t])


def brute_force(surv, cap, sps_of_total):
    """Best Theta over every admissible allocation ``0 <= l_r <= cap_r``."""
    best, arg = -1.0, None
    for ls in itertools.product(*[range(int(c) + 1) for c in cap]):
        th = theta_of(ls, surv, sps_of_total)
        if th > best + 1e-12:
            best, arg = th, ls
    return best, arg


def random_case(rng, n_max=4, g_max=4):
    n = int(rng.integers(1, n_max + 1))
    g = int(rng.integers(1, g_max + 1))
    conf = rng.uniform(0.05, 1.0, size=(n, g))
    if rng.random() < 0.3:
        conf[rng.random((n, g)) < 0.3] = 1.0  # ties in the survival
    cap = rng.integers(0, g + 1, size=n)
    return sch.survival(conf), cap, n, g


def test_survival_is_cumulative_product():
    conf = np.array([[0.9, 0.5, 1.0], [0.2, 0.9, 0.9]])
    np.testing.assert_allclose(sch.survival(conf), [[0.9, 0.45, 0.45], [0.2, 0.18, 0.162]])


def test_candidate_order_prefixes_are_admissible():
    rng = np.random.default_rng(0)
    for _ in range(200):
        surv, cap, n, g = random_case(rng)
        rows, ks, probs = sch.candidate_order(surv, cap)
        assert len(rows) == int(np.sum(cap))
        assert np.all(np.diff(probs) <= 1e-15)
        seen = np.zeros(n, int)
        for r, k in zip(rows, ks):
            assert k == seen[r], "every admission extends its row's prefix"
            seen[r] += 1


def test_optimal_lengths_match_brute_force_on_jagged_sps():
    """The global search over m equals the brute-force optimum on any positive SPS curve
    (top-m survivals maximise E[emitted] for every m)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        surv, cap, n, g = random_case(rng)
        t_max = n * (g + 1)
        sps = np.concatenate([[0.0], rng.uniform(0.2, 1.0, size=t_max)])  # jagged, arbitrary
        best, _ = brute_force(surv, cap, sps)
        ell = sch.optimal_lengths(surv, cap, sps)
        assert np.all(ell <= cap) and np.all(ell >= 0)
        assert theta_of(ell, surv, sps) == pytest.approx(best, rel=1e-12)


def test_greedy_is_optimal_when_step_time_is_convex():
    """Guarantee: with 1/SPS(t) convex and non-decreasing, Theta_m is unimodal and the clean
    greedy scheduler (stop at the first admission that lowers Theta) is exactly optimal."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        surv, cap, n, g = random_case(rng)
        t = np.arange(n * (g + 1) + 1, dtype=np.float64)
        a, b, c = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.05)
        sps = 1.0 / (a + b * t + c * t * t)
        best, _ = brute_force(surv, cap, sps)
        ell = sch.greedy_lengths(surv, cap, sps)
        assert np.all(ell <= cap)
        assert theta_of(ell, surv, sps) == pytest.approx(best, rel=1e-12)


def test_greedy_stops_at_first_local_maximum_on_jagged_sps():
    """On a jagged (bucketed) SPS curve greedy returns the first local maximum of m -> Theta_m:
    every admission it made did not lower Theta, the next one would, and it never beats the
    brute-force optimum; at least one case shows the early stop (the reason for the deployed
    variant's global search)."""
    rng = np.random.default_rng(3)
    early = 0
    for _ in range(300):
        surv, cap, n, g = random_case(rng)
        buckets = sorted(set([n] + list(rng.integers(n, n * (g + 1) + 1, size=2)) + [n * (g + 1)]))
        sps_b = {k: 1.0 / (1.0 + 0.1 * k + rng.uniform(0, 0.3)) for k in buckets}
        sps = np.array([0.0] * n + [sps_b[next(k for k in buckets if k >= t)] for t in range(n, n * (g + 1) + 1)])
        ell = sch.greedy_lengths(surv, cap, sps)
        rows, theta = sch.theta_curve(surv, cap, sps)
        m = int(np.sum(ell))
        assert np.all(np.diff(theta[: m + 1]) >= 0)
        assert m == len(rows) or theta[m + 1] < theta[m]
        best, _ = brute_force(surv, cap, sps)
        assert theta[m] <= best + 1e-12
        early += theta[m] < best - 1e-9
    assert early > 0


def test_threshold_and_fixed():
    surv = sch.survival(np.array([[0.9, 0.9, 0.9, 0.9], [0.5, 0.9, 0.9, 0.9], [1.0, 1.0, 0.2, 1.0]]))
    np.testing.assert_array_equal(sch.threshold_lengths(surv, [4, 4, 4], 0.7), [3, 0, 2])
    np.testing.assert_array_equal(sch.threshold_lengths(surv, [1, 4, 0], 0.7), [1, 0, 0])
    np.testing.assert_array_equal(sch.fixed_lengths([4, 2, 0], 3), [3, 2, 0])


def test_deployed_budget_depends_only_on_stale_confidences():
    rng = np.random.default_rng(4)
    n, g = 3, 4
    budgets = [3, 6, 9, 15]
    sps = np.zeros(16)
    for t in range(3, 16):
        sps[t] = {3: 1.0, 6: 0.8, 9: 0.7, 15: 0.5}[next(k for k in budgets if k >= t)]
    cap = np.full(n, g)
    old = sch.survival(rng.uniform(0.3, 1.0, (n, g)))
    ks = set()
    for _ in range(50):
        now = sch.survival(rng.uniform(0.0, 1.0, (n, g)))
        ell, k = sch.deployed_lengths(old, now, cap, sps, budgets)
        ks.add(k)
        assert n + ell.sum() == k  # enough candidates: all K places filled
        # fill = the best current candidates
        np.testing.assert_array_equal(ell, sch.fill_lengths(now, cap, k - n))
    assert len(ks) == 1, "the budget must not depend on current confidences"
    # ... but it does follow the stale ones
    k_hi = sch.deployed_lengths(np.ones((n, g)), old, cap, sps, budgets)[1]
    k_lo = sch.deployed_lengths(np.full((n, g), 1e-3), old, cap, sps, budgets)[1]
    assert k_hi == 15 and k_lo == 3
    # global search over the jagged table: a larger bucket can win over a smaller one that loses
    jag = sps.copy()
    jag[4:7] = 0.3  # bucket 6 is slow, bucket 9 fast again
    assert sch.best_budget(np.full((n, g), 0.9), cap, jag, budgets) in (9, 15)


def test_policies_see_no_draft_tokens():
    """Non-anticipation by construction: every policy's inputs are confidences, caps and
    the SPS curve; none takes draft token values."""
    import inspect

    for fn in (
        sch.fixed_lengths,
        sch.threshold_lengths,
        sch.greedy_lengths,
        sch.optimal_lengths,
        sch.best_budget,
        sch.fill_lengths,
        sch.deployed_lengths,
    ):
        params = set(inspect.signature(fn).parameters)
        assert not params & {"tokens", "draft", "draft_tokens"}, fn.__name__


# ------------------------------------------------------------------------- calibration


def _feed(cal, z, p_accept, rng, rounds=200, rows=8):
    g = cal.block_size
    for _ in range(rounds):
        acc = np.zeros(rows, int)
        for r in range(rows):
            a = 0
            while a < g and rng.random() < p_accept:
                a += 1
            acc[r] = a
        cal.observe(np.full((rows, g), z), np.full(rows, g), acc)
        cal.update()


def test_online_calibration_cools_overconfident_positions():
    rng = np.random.default_rng(5)
    cal = OnlineCalibrator(3, window=512, lr=0.2, max_step=0.05)
    before = cal.confidence(np.full(3, 3.0))  # 0.95 predicted
    _feed(cal, 3.0, 0.6, rng)  # observed 0.6
    after = cal.confidence(np.full(3, 3.0))
    assert np.all(cal.temperatures > 1.0)
    assert np.all(np.abs(after - 0.6) < np.abs(before - 0.6))
    st = cal.stats()
    assert all(o is not None and abs(o - 0.6) < 0.1 for o in st["observed"])


def test_online_calibration_reaches_below_one_half():
    """Temperature scaling cannot bring a positive logit below 1/2; the observed over predicted
    acceptance ratio can: a drafter confident at z = 2 (0.88) that lands 0.3 ends near 0.3."""
    rng = np.random.default_rng(7)
    cal = OnlineCalibrator(2, window=512, lr=0.2, max_step=0.05)
    _feed(cal, 2.0, 0.3, rng)
    after = cal.confidence(np.full(2, 2.0))
    assert np.all(np.abs(after - 0.3) < 0.08), after
    st = cal.stats()
    assert all(abs(p - o) < 0.05 for p, o in zip(st["predicted"], st["observed"]))
    assert all(r < 1.0 for r in st["ratios"])


def test_online_calibration_warms_underconfident_positions():
    rng = np.random.default_rng(6)
    cal = OnlineCalibrator(2, init=[1.0, 1.0], window=512, lr=0.2, max_step=0.05)
    _feed(cal, 1.0, 0.95, rng)  # predicted 0.73, observed 0.95
    assert np.all(cal.temperatures < 1.0)
    assert np.all(cal.confidence(np.ones(2)) > 0.8)


def test_online_calibration_starts_from_the_offline_bias():
    """Seeded with the offline fit's temperatures and biases, the calibrator predicts
    ``sigmoid(z / T + b)`` and nudges only the temperatures (the bias stays)."""
    from types import SimpleNamespace

    drafter = SimpleNamespace(calibration=(2.0, 0.5), calibration_bias=(-1.0, 0.5))
    cal = OnlineCalibrator.seeded(2, drafter, window=512, lr=0.2, max_step=0.05)
    z = np.array([3.0, -1.0])
    np.testing.assert_allclose(cal.confidence(z), 1 / (1 + np.exp(-(z / [2.0, 0.5] + [-1.0, 0.5]))))
    _feed(cal, 3.0, 0.2, np.random.default_rng(8))
    np.testing.assert_array_equal(cal.biases, [-1.0, 0.5])
    assert np.all(np.abs(cal.confidence(np.full(2, 3.0)) - 0.2) < 0.08)
    assert np.all(OnlineCalibrator.seeded(2, None).biases == 0) and np.all(OnlineCalibrator.seeded(2).temperatures == 1)
    with pytest.raises(ValueError, match="biases"):
        OnlineCalibrator(2, bias=[0.0, np.inf])


def test_online_calibration_counts_only_reached_positions():
    cal = OnlineCalibrator(4, window=16, min_obs=1)
    cal.observe(np.zeros((2, 4)), verified=np.array([3, 4]), accepted=np.array([1, 4]))
    st = cal.stats()
    # row 0: positions 1 (accepted), 2 (rejected); 3 not reached. row 1: 1..4 accepted.
    assert st["observations"] == [2, 2, 1, 1]
    assert st["observed"] == [1.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError):
        OnlineCalibrator(2, init=[1.0, -1.0])


# ------------------------------------------------------------------------- the cost (SPS) table


def test_time_programs_rotates_warms_and_repeats():
    calls, befores = [], []
    progs = {n: (lambda n=n: calls.append(n)) for n in "abc"}
    secs = time_programs(progs, repeats=3, inner=2, warm=1, before=befores.append)
    assert list(secs) == ["a", "b", "c"] and all(t >= 0 for t in secs.values())
    # warm a, b, c; then rounds rotated by one: abc, bca, cab, each timing 2 calls
    assert calls == list("abc") + [n for order in ("abc", "bca", "cab") for n in order for _ in range(2)]
    assert befores == list("abc") + list("abcbcacab")


def test_spans_are_whole_kv_blocks_and_lookups_take_the_nearest_at_or_above():
    assert [live_span(p) for p in (-1, 0, 255, 256, 1000)] == [256, 256, 256, 512, 1024]
    assert live_span(1000, cache_len=600) == 600
    assert measured_spans(None, 1024, 256) == (256,)
    assert measured_spans([1, 300, 256, 5000], 1024, 256) == (256, 512, 1024)
    with pytest.raises(DSparkInputError):
        measured_spans([0], 1024, 256)
    t = CostTable({}, {(("engine_step", 1, 4, True), 256): 0.5, (("engine_step", 1, 4, True), 1024): 1.0})
    assert t.spans() == [256, 1024]
    assert [t.span_for(("engine_step", 1, 4, True), s) for s in (0, 300, 5000)] == [256, 1024, 1024]
    assert t.sps(1, 4, True) == 2.0 and t.sps(1, 4, True, span=700) == 1.0 and t.sps(2, 2, False) == 0.0
    assert t.covers_steps([(1, 4)], [True], [256, 1024]) and not t.covers_steps([(1, 4)], [True, False])


def test_sps_table_round_trip_matching_and_the_previous_format(tmp_path):
    meta = {"device_kind": "cpu:cpu", "model": "m", "num_slots": 2, "block_size": 3}
    sps = {(1, 1, False): 100.0, (1, 1, True): 80.0, (1, 4, False): 50.0, (1, 4, True): 40.0}
    table = CostTable.from_steps_per_s(sps, span=256, meta=meta)
    assert table.sps(1, 4, True) == pytest.approx(40.0) and table.budgets(1) == [1, 4]
    path = tmp_path / "sps.json"
    table.save(path)
    back = CostTable.load(path)
    assert back == table and back.meta == meta
    assert back.matches(meta) and not back.matches({**meta, "num_slots": 4})
    assert back.covers_steps([(1, 1), (1, 4)], [False, True], [256]) and not back.covers_steps([(2, 2)], [False])
    path.write_text(json.dumps({"meta": {}}))
    with pytest.raises(DSparkInputError):
        CostTable.load(path)
    with pytest.raises(DSparkInputError):
        CostTable.load(tmp_path / "missing.json")
    old = {"meta": meta, "entries": [{"rows": 1, "tokens": 1, "draft": False, "sps": 100.0}]}
    path.write_text(json.dumps(old))
    with pytest.raises(DSparkInputError, match="previous format.*re-profile") as err:
        CostTable.load(path)
    assert "\n" not in str(err.value)


def test_batch1_accessors_are_functions_of_the_span():
    short = CostTable.from_decode_costs(
        span=256, t_step=1.0, t_verify={0: 1.0, 2: 1.5}, t_draft_greedy=0.2, t_draft_sampled=0.3, t_context=0.1
    )
    long = CostTable.from_decode_costs(
        span=1024, t_step=2.0, t_verify={0: 2.0, 2: 3.0}, t_draft_greedy=0.4, t_draft_sampled=0.6, t_context=0.2
    )
    table = CostTable({"cache_len": 2048}, {**short.seconds, **long.seconds})
    assert table.widths == (0, 2)
    assert list(table.verify_array([0, 2], span=100)) == [1.0, 1.5]
    assert list(table.verify_array([0, 2], span=257)) == [2.0, 3.0]
    assert table.draft_seconds(False, span=2000) == 0.6 and table.step_seconds() == 1.0
    assert table.bound_tokens_per_s(3.0, 2, greedy=True, span=1024) == pytest.approx(3.0 / 3.4)
    assert table.decode_ms(1024)["t_verify_ms"] == {0: 2000.0, 2: 3000.0} and table.decode_ms(1024)["span"] == 1024
    with pytest.raises(ValueError):
        table.verify_array([1])
    assert CostTable.from_json(table.to_json()) == table
