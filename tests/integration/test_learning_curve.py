"""The learning-curve study (``python -m benchmarks.learning_curve``): its helpers, and a CI-sized run end to end.

``--quick`` on stories260K: tiny data generated once (a greedy and a sampled pass), two drafters, a
warmup-stable-decay trunk per drafter with one decay branch per budget (4 and 8 steps), tau at T = 0
and 1 on two held-out prompts, then a rerun on the same folder that only skips. Only the run and the
shape of its outputs are checked (numbers of so small a budget mean nothing).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ds = importlib.import_module("benchmarks.drafter_study")
lc = importlib.import_module("benchmarks.learning_curve")


def test_budgets_must_increase():
    assert lc.parse_budgets("100,200,400") == [100, 200, 400]
    for bad in ("", "4,4", "8,4", "1,2"):
        with pytest.raises(ValueError):
            lc.parse_budgets(bad)


def test_set_overrides_every_run_and_enters_the_settings(tmp_path):
    args = lc.build_parser().parse_args(
        [
            "--out",
            "x",
            "--target",
            "smollm2-135m-instruct",
            "--set",
            "draft_vocab_size=8192",
            "init_from_target_layers=-2,-1",
        ]
    )
    base, ev = lc.study_config(args, [400, 800])
    assert base.drafter.draft_vocab_size == 8192 and base.init_from_target_layers == (-2, -1)
    assert base.lr_schedule == "wsd"  # the study's own settings still apply
    data = {"sequences": 1, "generated_tokens": 1}
    settings = lc.study_settings(base, ev, data, {"gsm8k": [[1]]}, args)
    assert settings["overrides"] == ["draft_vocab_size=8192", "init_from_target_layers=-2,-1"]
    plain = lc.build_parser().parse_args(["--out", "x"])
    assert "overrides" not in lc.study_settings(*lc.study_config(plain, [400]), data, {"t": [[1]]}, plain)
    assert lc.main(["--out", str(tmp_path), "--set", "no_such_key=1"]) == 2


def test_tau_standard_errors():
    taus, passes = [2.0, 3.0, 1.5, 2.5], [10, 5, 8, 6]
    emitted = np.array(taus) * passes
    tau = emitted.sum() / sum(passes)
    r = (emitted - tau * np.array(passes)) / np.mean(passes)
    assert ds.tau_stderr(taus, passes) == pytest.approx(np.std(r, ddof=1) / 2)
    assert ds.tau_stderr([2.0], [4]) is None
    # paired: the same prompts measured twice have no noise in their difference, whatever their spread
    assert ds.paired_tau_stderr(taus, passes, taus, passes) == 0.0
    shifted = [t + 0.5 for t in taus]
    assert ds.paired_tau_stderr(shifted, passes, taus, passes) < ds.tau_stderr(taus, passes)


def test_doubling_gain_stops_only_below_the_noise_at_every_temperature():
    def point(t0, t1):
        def row(ts):
            return {
                "macro_tau": float(np.average(ts, weights=[4, 4, 4])),
                "datasets": {"tinystories": {"request_tau": ts, "request_target_passes": [4, 4, 4]}},
            }

        return {"tau": {"T0": row(t0), "T1": row(t1)}}

    prev = point([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    g = lc.doubling_gain(prev, point([1.5, 2.5, 3.5], [1.0, 2.2, 2.9]), sigmas=1.0)
    assert g["T0"]["delta"] == pytest.approx(0.5) and g["T0"]["stderr"] == pytest.approx(0.0)
    assert g["T0"]["significant"] and not g["T1"]["significant"]  # T1: +0.033 +- 0.067
    g = lc.doubling_gain(prev, point([1.0, 2.1, 2.9], [1.0, 2.0, 3.0]), sigmas=1.0)
    assert not any(v["significant"] for v in g.values())


def test_segment_seconds_accumulate_and_cost_a_killed_segment_at_the_step_rate():
    known = {"0": 0.0}
    lc.record_segment(known, 0, 80, 40.0)
    lc.record_segment(known, 80, 160, 30.0)
    assert known == {"0": 0.0, "80": 40.0, "160": 70.0}
    lc.record_segment(known, 200, 320, 60.0)  # killed after a checkpoint at 200: 40 steps at 0.5 s/step
    assert known["320"] == pytest.approx(70.0 + 20.0 + 60.0)


def test_drop_trained_prompts():
    data = {"tokens": np.array([[1, 5, 6, 9, 9], [1, 7, 8, 0, 0]]), "prompt_lengths": np.array([3, 2])}
    kept, n = lc.drop_trained_prompts({"s": [[1, 5, 6], [1, 5], [1, 7, 8]]}, data)
    assert kept == {"s": [[1, 5], [1, 7, 8]]} and n == 1


def any_significant(point) -> bool:
    return any(g["significant"] for g in point["gain"].values())


@pytest.mark.slow
def test_quick_learning_curve_writes_outputs_and_resumes(stories260k_dir, tmp_path):
    out = tmp_path / "lc"
    env = dict(os.environ, DSPARK_MODELS=str(stories260k_dir.parent))
    cmd = [sys.executable, "-m", "benchmarks.learning_curve", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "learning_curve.json").read_text())
    st = r["settings"]
    assert st["lr_schedule"] == "wsd" and st["decay_frac"] == 0.2 and st["eval_prompts"] == {"tinystories": 2}
    assert r["data"]["sequences"] > 0 and r["data"]["shards"] == 2  # greedy + sampled pass
    assert list(r["drafters"]) == ["dspark-2L", "dflash-2L"]
    for name, rec in r["drafters"].items():
        pts = rec["points"]
        assert [p["budget"] for p in pts] == [4, 8] and [p["steps"] for p in pts] == [4, 8]
        assert [p["decay_start"] for p in pts] == [3, 6]
        assert pts[0]["params"] == pts[1]["params"] > 0
        assert 0 < pts[0]["trunk_seconds"] < pts[1]["trunk_seconds"]  # one trunk, cumulative
        assert all(p["train_seconds"] == pytest.approx(p["trunk_seconds"] + p["branch_seconds"], abs=0.11) for p in pts)
        for p in pts:
            for t in ("T0", "T1"):
                row = p["tau"][t]
                assert 1.0 <= row["macro_tau"] <= st["block_size"] + 1
                assert len(row["position_acceptance_pooled"]) == st["block_size"]
                d = row["datasets"]["tinystories"]
                assert len(d["request_tau"]) == 2
                assert d["tau"] == pytest.approx(np.average(d["request_tau"], weights=d["request_target_passes"]))
        assert "gain" not in pts[0] and rec["plateau_at"] == (None if any_significant(pts[1]) else 8)
        for t in ("T0", "T1"):
            g = pts[1]["gain"][t]
            assert g["delta"] == pytest.approx(pts[1]["tau"][t]["macro_tau"] - pts[0]["tau"][t]["macro_tau"])
        # every run of the drafter on the shared shards and feature cache; trunk constant, branches decay
        trunk = json.loads((out / name / "trunk" / "config.json").read_text())
        branch = json.loads((out / name / "b8" / "config.json").read_text())
        assert (trunk["decay_frac"], branch["decay_frac"], trunk["steps"], branch["steps"]) == (0.0, 0.2, 6, 8)
        assert trunk["lr_schedule"] == branch["lr_schedule"] == "wsd"
        assert trunk["data_dir"] == branch["data_dir"] == r["data"]["dir"]
        assert trunk["feature_cache"] == branch["feature_cache"] == r["feature_cache"]["dir"]
    assert r["drafters"]["dspark-2L"]["points"][0]["params"] != r["drafters"]["dflash-2L"]["points"][0]["params"]
    for png in r["plots"].values():
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(r["plots"]) == {"tau_vs_steps", "tau_vs_seconds"}
    assert "| dspark-2L | " in (out / "learning_curve.md").read_text()

    # a rerun on the same folder skips every point and changes none
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("already in") == 4 and "trunk " not in proc.stderr
    r2 = json.loads((out / "learning_curve.json").read_text())
    assert r2["drafters"] == r["drafters"] and len(r2["commands"]) == 2
