"""Confidence calibration (:mod:`dspark_jax.training.calibration`, metrics in
:mod:`dspark_jax.evaluation.reliability`): metrics, sequential temperature
scaling, consistency with the training loss, storage in the export, decode-time use.

docs/design.md#calibration and docs/design.md#metrics; paper Appendix A5.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.drafters.checkpoint import FORMAT, export_drafter, load_drafter
from dspark_jax.drafters.markov import sample_block
from dspark_jax.errors import DSparkInputError
from dspark_jax.evaluation import reliability as R
from dspark_jax.models.sampling import sampling_arrays
from dspark_jax.training import calibration as C
from dspark_jax.training.losses import drafter_loss, sample_anchors
from tests.helpers.tiny import tiny_data, tiny_drafter, tiny_target, tiny_train_config

CFG = tiny_train_config(anchors_per_seq=6)


@functools.cache
def _tiny_drafter(variant):
    d = tiny_drafter(_target(), variant, train=CFG)
    if d.cfg.has_confidence:  # a confidence head that actually varies
        rng = np.random.default_rng(0)
        d.conf_w[...] = jnp.asarray(rng.standard_normal(d.conf_w[...].shape).astype(np.float32) * 0.5)
    return d


@functools.cache
def _target():
    """The tiny target (built once: eager initialisation is slow on CPU); read-only."""
    return tiny_target()


def _drafter(target, variant="dspark"):
    """A fresh copy of the tiny drafter (tests may set its calibration)."""
    return nnx.clone(_tiny_drafter(variant))


def _data(n=6, length=40, seed=0):
    return tiny_data(n, length, seed)


# ======================================================================================
# Metrics against hand-computed cases
# ======================================================================================
def test_ece_hand_computed():
    # one point per bin: ECE = mean |p - o|
    assert R.ece([0.1, 0.2, 0.8, 0.9], [0, 1, 1, 1]) == pytest.approx((0.1 + 0.8 + 0.2 + 0.1) / 4)
    # two points in bin [0.10, 0.15): |mean p - mean o| = |0.13 - 0.5|; one in the last bin
    assert R.ece([0.12, 0.14, 1.0], [0, 1, 1]) == pytest.approx(2 / 3 * 0.37)
    # soft observations, perfectly calibrated bins
    assert R.ece([0.3, 0.3, 0.7], [0.1, 0.5, 0.7]) == pytest.approx(0.0, abs=1e-12)
    # 20 equal-width bins: 0.52 and 0.54 share a bin, 0.56 is in the next one
    assert R.ece([0.52, 0.54], [0.5, 0.56]) == pytest.approx(0.0, abs=1e-12)
    assert R.ece([0.52, 0.56], [0.53, 0.53]) == pytest.approx(0.02)


def test_brier_hand_computed():
    assert R.brier([0.1, 0.9, 0.5], [0, 1, 1]) == pytest.approx((0.01 + 0.01 + 0.25) / 3)


def test_auroc_hand_computed_and_against_pairs():
    assert R.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert R.auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)  # a tie counts one half
    assert R.auroc([0.9, 0.1], [0, 1]) == pytest.approx(0.0)
    assert np.isnan(R.auroc([0.2, 0.3], [1, 1]))  # one class only
    rng = np.random.default_rng(0)
    s = rng.integers(0, 6, 300) / 5.0  # many ties
    y = rng.random(300) < 0.4
    pos, neg = s[y], s[~y]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert R.auroc(s, y) == pytest.approx(brute)


def test_reliability_table_and_metrics_rows():
    rel = R.reliability([0.12, 0.14, 0.97], [0, 1, 1])
    assert len(rel["count"]) == 20 and sum(rel["count"]) == 3
    assert rel["mean_predicted"][2] == pytest.approx(0.13) and rel["mean_observed"][2] == pytest.approx(0.5)
    assert rel["mean_observed"][0] is None
    pred = np.array([[0.9, 0.5], [0.8, 0.2]])
    valid = np.array([[True, True], [True, False]])
    m = R.metrics(pred, valid, np.array([[1.0, 0.0], [1.0, 0.0]]))
    assert m["pooled"]["n"] == 3 and m["per_position"][1]["n"] == 1
    assert m["per_position"][0]["brier"] == pytest.approx((0.01 + 0.04) / 2)


# ======================================================================================
# Sequential temperature scaling
# ======================================================================================
def _synthetic(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    g = 5
    z = rng.normal(1.5, 1.5, (n, g)) + np.linspace(1.0, -1.0, g)
    t_true = np.array([2.0, 0.5, 3.0, 1.0, 1.5])
    c = 1 / (1 + np.exp(-z / t_true))
    y = np.cumprod(rng.random((n, g)) < c, axis=1).astype(float)
    valid = np.ones((n, g), bool)
    valid[: n // 10, 3:] = False  # some blocks end early (prefix-closed)
    return z, t_true, np.cumprod(c, axis=1), y, valid


def test_temperature_scaling_recovers_known_temperatures():
    z, t_true, surv, y, valid = _synthetic()
    # exact survival probabilities: the true temperatures are the exact minimiser
    np.testing.assert_allclose(C.fit_temperatures(z, surv, valid), t_true, rtol=1e-3)
    # sampled Bernoulli survival: recovered up to sampling noise, with Brier and with NLL
    np.testing.assert_allclose(C.fit_temperatures(z, y, valid), t_true, rtol=0.15)
    np.testing.assert_allclose(C.fit_temperatures(z, y, valid, loss="nll"), t_true, rtol=0.15)


def test_weighted_fit_equals_fit_on_the_weighted_blocks():
    z, t_true, surv, y, valid = _synthetic(n=4000, seed=2)
    w = (np.arange(len(z)) % 3 == 0).astype(float)
    keep = w > 0
    np.testing.assert_allclose(
        C.fit_temperatures(z, y, valid, weights=w), C.fit_temperatures(z[keep], y[keep], valid[keep]), rtol=1e-9
    )


def _chain_data(accept, valid=None):
    """One sequence with a block at every anchor 0..len-1 (block_size = accept.shape[1])."""
    accept = np.asarray(accept, float)
    n = accept.shape[0]
    valid = np.ones(accept.shape, bool) if valid is None else np.asarray(valid, bool)
    return C.CalibrationData(np.zeros(accept.shape), accept, valid, np.zeros(n, int), np.arange(n) + 4)


def test_decode_weights_follow_greedy_rounds():
    """Greedy (0/1) acceptance: weight 1 exactly on the anchors decoding's rounds reach."""
    acc = np.zeros((12, 3))
    acc[1] = [1, 1, 0]  # from anchor 5 (row 1, the first generated token): 2 accepted -> anchor 8
    acc[4] = [1, 1, 1]  # anchor 8: all 3 accepted (+ bonus) -> anchor 12
    acc[8] = [0, 1, 1]  # anchor 12: none accepted -> anchor 13, then one anchor per round
    w = C.decode_weights(_chain_data(acc))
    np.testing.assert_array_equal(np.flatnonzero(w), [1, 4, 8, 9, 10, 11])  # anchors 5, 8, 12, 13, 14, 15
    assert set(w[w > 0]) == {1.0}


def test_decode_weights_spread_expected_visits():
    """Fractional acceptance: each block passes its weight to the anchors after it by
    P(n accepted); the first round's mass is conserved."""
    acc = np.full((8, 2), 0.5)
    w = C.decode_weights(_chain_data(acc))
    # from anchor row 1: P(n=0) = .5 -> row 2, P(n=1) = .25 -> row 3, P(n=2) = .25 -> row 4
    assert w[0] == 0 and w[1] == 1.0
    np.testing.assert_allclose(w[2], 0.5)
    np.testing.assert_allclose(w[3], 0.25 + 0.5 * 0.5)
    short = np.ones((8, 2), bool)
    short[-1, 1] = False  # the last block has one valid position: its mass stops there
    assert C.decode_weights(_chain_data(acc, short))[-1] > 0


def test_temperature_scaling_reduces_ece():
    z, t_true, surv, y, valid = _synthetic(seed=1)
    temps = C.fit_temperatures(z, y, valid)
    raw, cal = R.predicted_survival(z), R.predicted_survival(z, temps)
    assert R.ece(raw[valid], y[valid]) > 0.05
    assert R.ece(cal[valid], y[valid]) < 0.015
    assert R.brier(cal[valid], y[valid]) < R.brier(raw[valid], y[valid])


def test_scaling_never_reorders_scores():
    rng = np.random.default_rng(2)
    z = rng.normal(0, 3, (500, 4))
    temps = np.array([0.3, 4.0, 1.7, 0.06])
    c_raw, c_cal = 1 / (1 + np.exp(-z)), 1 / (1 + np.exp(-z / temps))
    for k in range(4):  # sorted by raw score, calibrated scores never decrease (ties only by saturation)
        order = np.argsort(z[:, k])
        assert np.all(np.diff(c_cal[order, k]) >= 0) and np.all(np.diff(c_raw[order, k]) >= 0)
    a = R.predicted_survival(z, temps)
    assert np.all(np.diff(a[np.argsort(z[:, 0]), 0]) >= 0)
    assert np.all(np.diff(a, axis=1) <= 0)  # survival never increases with k
    # the per-position AUROC of c_k is therefore invariant under calibration (away from saturation)
    y = rng.random((500, 4)) < 0.5
    c_mild = 1 / (1 + np.exp(-z / np.array([0.3, 4.0, 1.7, 0.5])))
    for k in range(4):
        assert R.auroc(c_raw[:, k], y[:, k]) == pytest.approx(R.auroc(c_mild[:, k], y[:, k]))


def test_survival_helpers():
    acc = np.array([[0.5, 0.5, 1.0], [1.0, 0.0, 1.0]])
    valid = np.array([[True, True, False], [True, True, True]])
    np.testing.assert_allclose(R.expected_survival(acc, valid), [[0.5, 0.25, 0.0], [1.0, 0.0, 0.0]])
    s = R.sampled_survival(acc, valid, seed=0)
    assert set(np.unique(s)) <= {0.0, 1.0} and np.all(np.diff(s, axis=1) <= 0)
    assert s[1, 0] == 1.0 and s[1, 1] == 0.0 and s[0, 2] == 0.0


# ======================================================================================
# Teacher-forced data: the same math as training
# ======================================================================================
def test_block_terms_match_drafter_loss():
    target = _target()
    d = _drafter(target)
    b = _data(n=4)
    toks, lens, pl = (jnp.asarray(b[k]) for k in ("tokens", "lengths", "prompt_lengths"))
    key = jax.random.PRNGKey(3)
    anchors = sample_anchors(key, lens, pl, CFG.anchors_per_seq)
    # one jitted closure (eager op-by-op execution is much slower than compiling)
    terms, bt, greedy = jax.jit(
        lambda: (
            drafter_loss(d, target, toks, lens, pl, key, CFG),
            C.block_terms(d, target, toks, lens, anchors),
            C.block_terms(d, target, toks, lens, anchors, temperature=0.0),
        )
    )()
    v = np.asarray(bt.valid, np.float64)
    acc = (np.asarray(bt.accept) * v).sum((0, 1)) / v.sum((0, 1))
    np.testing.assert_allclose(acc, np.asarray(terms.acc_by_pos), rtol=1e-5, atol=1e-6)
    w = np.exp(-np.arange(CFG.drafter.block_size) / CFG.pos_decay) * v
    conf_err = (w * np.abs(1 / (1 + np.exp(-np.asarray(bt.z, np.float64))) - np.asarray(bt.accept))).sum() / w.sum()
    assert conf_err == pytest.approx(float(terms.conf_err), rel=1e-4)
    # greedy acceptance is an indicator
    assert set(np.unique(np.asarray(greedy.accept))) <= {0.0, 1.0}


def test_collect_covers_every_anchor_block():
    target = _target()
    d = _drafter(target)
    b = _data(n=5)
    data = C.collect(target, d, b, batch_size=2, memory_budget_mb=0.05)  # several anchor chunks
    n_blocks = int(np.sum(np.maximum(b["lengths"] - 2 - (b["prompt_lengths"] - 1) + 1, 0)))
    assert data.z.shape == (n_blocks, CFG.drafter.block_size)
    assert data.valid[:, 0].all() and np.all(np.diff(data.valid.astype(int), axis=1) <= 0)
    assert np.all((data.accept >= 0) & (data.accept <= 1))
    assert sorted(np.unique(data.seq)) == list(range(5))


def test_dflash_is_refused():
    target = _target()
    with pytest.raises(DSparkInputError, match="no confidence head"):
        C.collect(target, _drafter(target, "dflash"), _data(n=2))


# ======================================================================================
# Storage in the export and use at decode time
# ======================================================================================
def test_fit_and_store_calibration_round_trip(tmp_path):
    target = _target()
    d = _drafter(target)
    export_drafter(d, tmp_path / "export")
    rep = C.fit_and_store_calibration(target, d, _data(n=6), tmp_path / "export")
    temps = rep["temperatures"]
    assert len(temps) == CFG.drafter.block_size and all(C.T_BOUNDS[0] <= t <= C.T_BOUNDS[1] for t in temps)
    for part in ("before", "after"):
        pooled = rep[part]["pooled"]
        assert {"ece", "auroc", "brier", "ece_sampled", "brier_sampled"} <= set(pooled)
        assert len(rep[part]["per_position"]) == CFG.drafter.block_size
    assert rep["num_sequences"] == {"fit": 3, "test": 3}
    meta = json.loads((tmp_path / "export/drafter.json").read_text())
    biases = rep["biases"]
    assert len(biases) == CFG.drafter.block_size and all(C.B_BOUNDS[0] <= b <= C.B_BOUNDS[1] for b in biases)
    assert meta["calibration"] == pytest.approx(temps) and meta["calibration_bias"] == pytest.approx(biases)
    assert meta["format"] == FORMAT
    assert meta["extra"]["calibration"]["after"]["ece"] == pytest.approx(rep["after"]["pooled"]["ece"])
    assert d.calibration == pytest.approx(tuple(temps)) and d.calibration_bias == pytest.approx(tuple(biases))
    loaded, _ = load_drafter(tmp_path / "export")
    assert loaded.calibration == pytest.approx(tuple(temps))
    assert loaded.calibration_bias == pytest.approx(tuple(biases))
    # re-exporting a calibrated drafter keeps its calibration
    export_drafter(loaded, tmp_path / "again")
    again = json.loads((tmp_path / "again/drafter.json").read_text())
    assert again["calibration"] == pytest.approx(temps) and again["calibration_bias"] == pytest.approx(biases)
    # a greedy fit (argmax-agreement labels) is stored beside it and used for rows at T = 0 only
    rep0 = C.fit_and_store_calibration(
        target, loaded, _data(n=6), tmp_path / "again", C.CalibrationSettings(temperature=0.0)
    )
    loaded2, _ = load_drafter(tmp_path / "again")
    assert loaded2.calibration == pytest.approx(tuple(temps))
    assert loaded2.calibration_greedy == pytest.approx(tuple(rep0["temperatures"]))
    assert rep0["biases"] is None  # the greedy fit: temperatures only (CalibrationSettings.bias)
    for greedy, want, want_b in ((True, rep0["temperatures"], [0.0] * CFG.drafter.block_size), (False, temps, biases)):
        np.testing.assert_allclose(loaded2.confidence_temperatures(greedy=greedy), want, rtol=1e-6)
        np.testing.assert_allclose(loaded2.confidence_biases(greedy=greedy), want_b, rtol=1e-6)


def test_temperature_only_exports_still_load(tmp_path):
    """An export of format 3 (temperatures, no biases) loads with zero biases: the confidences
    and the decode program are those of temperature scaling."""
    target = _target()
    d = _drafter(target)
    d.set_calibration([0.8, 1.25, 1.6, 2.0])
    export_drafter(d, tmp_path / "e")
    meta = json.loads((tmp_path / "e/drafter.json").read_text())
    for k in ("calibration_bias", "calibration_greedy_bias"):
        assert meta.pop(k) is None
    meta["format"] = "dspark_jax.drafter/3"
    (tmp_path / "e/drafter.json").write_text(json.dumps(meta))
    loaded, _ = load_drafter(tmp_path / "e")
    assert loaded.calibration == (0.8, 1.25, 1.6, 2.0) and loaded.calibration_bias is None
    assert loaded.confidence_biases() is None and loaded.confidence_biases(greedy=True) is None
    z = np.array([[1.0, -0.5, 2.0, 0.3]])
    np.testing.assert_allclose(
        R.predicted_survival(z, loaded.calibration, loaded.calibration_bias),
        R.predicted_survival(z, loaded.calibration),
    )


def test_invalid_calibration_is_refused(tmp_path):
    target = _target()
    d = _drafter(target)
    with pytest.raises(ValueError, match="temperatures"):
        d.set_calibration([1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        d.set_calibration([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="biases"):
        d.set_calibration([1.0] * 4, bias=[0.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        d.set_calibration([1.0] * 4, bias=[0.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ValueError, match="need temperatures"):
        d.set_calibration(None, bias=[0.0] * 4)
    with pytest.raises(ValueError, match="no confidence head"):
        _drafter(target, "dflash").set_calibration([1.0] * CFG.drafter.block_size)
    export_drafter(d, tmp_path / "e")
    meta = json.loads((tmp_path / "e/drafter.json").read_text())
    meta["calibration"] = [1.0, -1.0, 1.0, 1.0]
    (tmp_path / "e/drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DSparkInputError, match="invalid calibration"):
        load_drafter(tmp_path / "e")


def test_sample_block_applies_temperatures_to_confidences_only():
    target = _target()
    d = _drafter(target)
    b = 3
    ctx = jnp.asarray(np.random.default_rng(0).integers(3, 64, (b, 12)).astype(np.int32))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b))
    samp = sampling_arrays(b, 1.0)
    temps = jnp.asarray([0.5, 2.0, 1.0, 3.0])

    def draft(conf_temperature):  # traced under jit: eager op-by-op execution is much slower
        pos = jnp.broadcast_to(jnp.arange(12), (b, 12))
        out = target(ctx, pos, taps=d.cfg.taps)
        cache = d.extend_cache(d.init_cache(b, 32), out.features, pos)
        block = d.draft_block(target, ctx[:, -1], jnp.full((b,), 11, jnp.int32), cache)
        return sample_block(d, block, ctx[:, -1], keys, samp, conf_temperature=conf_temperature)

    raw, cal = jax.jit(lambda t: (draft(None), draft(t)))(temps)
    np.testing.assert_array_equal(raw.tokens, cal.tokens)
    np.testing.assert_array_equal(raw.probs, cal.probs)
    np.testing.assert_allclose(raw.confidence, jax.nn.sigmoid(raw.confidence_logit), rtol=1e-6)
    np.testing.assert_allclose(cal.confidence, jax.nn.sigmoid(raw.confidence_logit / temps), rtol=1e-6)
    d.set_calibration([0.5, 2.0, 1.0, 3.0])  # the drafter's own calibration is the default
    np.testing.assert_allclose(jax.jit(lambda: draft(None))().confidence, cal.confidence, rtol=1e-6)
    bias = jnp.asarray([-1.0, 0.5, 0.0, 2.0])
    d.set_calibration([0.5, 2.0, 1.0, 3.0], bias=bias)  # with a bias per position
    biased = jax.jit(lambda: draft(None))()
    np.testing.assert_array_equal(biased.tokens, raw.tokens)
    np.testing.assert_allclose(biased.confidence, jax.nn.sigmoid(raw.confidence_logit / temps + bias), rtol=1e-6)


def test_decode_round_records_match_counters():
    """``record_rounds``: per-round logs agree with DecodeStats and give accept_rate@k."""
    from dspark_jax.decoding.speculative import generate_speculative
    from dspark_jax.evaluation.acceptance import evaluate_tau

    target = _target()
    d = _drafter(target)
    d.set_calibration([1.5, 1.0, 0.7, 2.0])
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3, 4]]
    # (same shapes as evaluate_tau's call below: one compilation)
    kw = dict(max_new_tokens=20, record_rounds=True, num_speculative_tokens=d.cfg.block_size)
    res = generate_speculative(target, d, prompts, seed=[0, 1, 2], **kw)
    for g in res.generations:
        r = g.rounds
        assert r["conf_logit"].shape == (g.num_target_passes, CFG.drafter.block_size)
        assert int(r["accepted"].sum()) == g.num_accepted and int(r["verified"].sum()) == g.num_verified
        for k in range(1, CFG.drafter.block_size + 1):
            assert int((r["accepted"] >= k).sum()) == g.position_accepted[k - 1]
    ev = evaluate_tau(target, d, prompts, **kw)
    rounds = ev.pop("rounds")
    n_rounds = sum(len(r["accepted"]) for r in rounds)
    assert n_rounds == ev["num_target_passes"]
    acc = np.concatenate([r["accepted"] for r in rounds])
    assert ev["accept_rate_at_k"] == pytest.approx(
        [float((acc >= k).mean()) for k in range(1, CFG.drafter.block_size + 1)]
    )
    rel = R.decode_reliability(rounds, CFG.drafter.block_size, list(d.calibration))
    assert rel["num_rounds"] == n_rounds
    assert rel["before"]["pooled"]["n"] == int(sum(r["verified"].sum() for r in rounds))
    assert "after" in rel


def test_greedy_fit_calibrates_held_out_decode_rounds():
    """The greedy fit, on teacher-forced blocks of some prompts' greedy continuations, calibrates
    the rounds greedy decoding verifies on other prompts: decode-time ECE at least 0.05 below the
    raw head's (here 0.170 -> 0.055), the raw head made over-confident on purpose."""
    from dspark_jax.decoding.speculative import generate_speculative

    target = _target()
    d = _drafter(target)
    d.conf_b[...] = d.conf_b[...] + 2.0  # an over-confident raw head: the fit must correct it at decode time
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, d.cfg.vocab_size, 4)] for _ in range(32)]
    n_spec = d.cfg.block_size
    res = generate_speculative(target, d, prompts, max_new_tokens=32, record_rounds=True, num_speculative_tokens=n_spec)
    seqs = [p + g.token_ids for p, g in zip(prompts[:16], res.generations[:16])]  # = the target's greedy
    length = max(map(len, seqs))
    fit_data = {
        "tokens": np.array([s + [0] * (length - len(s)) for s in seqs], np.int32),
        "lengths": np.array([len(s) for s in seqs], np.int32),
        "prompt_lengths": np.full(len(seqs), 4, np.int32),
    }
    rep = C.fit_and_store_calibration(target, d, fit_data, None, C.CalibrationSettings(temperature=0.0))
    rel = R.decode_reliability([g.rounds for g in res.generations[16:]], CFG.drafter.block_size, rep["temperatures"])
    raw, fitted = rel["before"]["pooled"]["ece"], rel["after"]["pooled"]["ece"]
    assert fitted < raw - 0.05, (raw, fitted)


def test_bias_calibrates_sampled_decode_rounds_a_temperature_cannot():
    """Sampled decoding (T = 1) with a raw head that is positive where most drafts are rejected: a
    temperature alone cannot bring a positive logit below 1/2, so the temperature-only fit stays
    over-confident at decode time; the fit with a bias per position (the default) calibrates the
    held-out rounds: decode-time ECE at least 0.05 below the temperature-only fit's (here 0.235 ->
    0.001, raw 0.53; the old code had the temperature-only fit alone)."""
    from dspark_jax.decoding.speculative import generate_speculative
    from dspark_jax.training.data import heldout_sequences

    target = _target()
    d = _drafter(target)
    d.conf_b[...] = d.conf_b[...] + 4.0
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(3, d.cfg.vocab_size, 4)] for _ in range(16)]
    fit_data = heldout_sequences(target, prompts[:8], max_new_tokens=20, seq_len=24, temperature=1.0, seed=1)
    res = generate_speculative(
        target,
        d,
        prompts[8:],
        max_new_tokens=20,
        temperature=1.0,
        seed=list(range(8)),
        record_rounds=True,
        num_speculative_tokens=d.cfg.block_size,
    )
    rounds = [g.rounds for g in res.generations]
    ece = {}
    for bias in (False, True):
        rep = C.fit_and_store_calibration(target, d, fit_data, None, C.CalibrationSettings(bias=bias))
        assert (rep["biases"] is not None) == bias
        rel = R.decode_reliability(rounds, CFG.drafter.block_size, rep["temperatures"], biases=rep["biases"])
        ece[bias] = rel["after"]["pooled"]["ece"]
    raw = rel["before"]["pooled"]["ece"]
    assert ece[True] < ece[False] - 0.05, (raw, ece)
