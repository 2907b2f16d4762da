"""The drafter comparison benchmark runs end to end and writes its outputs (CI-sized budget).

``python -m benchmarks.compare_drafters --quick`` on stories260K: data generated once, three
drafters (DSpark, DFlash, Eagle3) trained on it for a few dozen steps, tau at T = 0 and 1,
batch-1 speed against plain decoding and transformers. Only the run and the shape of its
outputs are checked (the numbers of so small a budget mean nothing; docs/results.md has
the full run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_comparison_writes_outputs(stories260k_dir, tmp_path):
    out = tmp_path / "cmp"
    env = dict(os.environ, DSPARK_MODELS=str(stories260k_dir.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare_drafters", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    names = ["dspark-2L", "dflash-2L", "eagle3"]
    assert list(r["drafters"]) == names
    assert r["data"]["sequences"] > 0 and not r["data"]["reused"]
    # every drafter trained on the same shard folder with the same budget
    cfgs = [json.loads((out / n / "config.json").read_text()) for n in names]
    budget = {
        (c["data_dir"], c["steps"], c["batch_size"], c["anchors_per_seq"], c["drafter"]["block_size"]) for c in cfgs
    }
    assert len(budget) == 1
    assert [r["drafters"][n]["variant"] for n in names] == ["dspark", "dflash", "eagle3"]
    # one shared feature cache holding every drafter's taps (Eagle3's low/mid/high included) + the last layer
    fc = r["feature_cache"]
    assert {c["feature_cache"] for c in cfgs} == {fc["dir"]}
    assert set().union(*(r["drafters"][n]["taps"] for n in names)) <= set(fc["layers"])
    for n in names:
        for t in ("T0", "T1"):
            row = r["tau"][n][t]
            assert set(row["datasets"]) == {"tinystories"}
            assert 1.0 <= row["macro_tau"] <= r["budget"]["block_size"] + 1
            assert len(row["position_acceptance_pooled"]) == r["budget"]["block_size"]
    for t in ("T0", "T1"):
        assert set(r["ratios"][t]) == {"dspark-2L/dflash-2L", "dspark-2L/eagle3"}
        assert r["ratios"][t]["dspark-2L/eagle3"] == pytest.approx(
            r["tau"]["dspark-2L"][t]["macro_tau"] / r["tau"]["eagle3"][t]["macro_tau"]
        )
    run = r["speed"]["runs"]["T0"]
    assert run["ar"]["tokens_per_s"] > 0 and run["hf_transformers"]["tokens_per_s"] > 0
    assert run["hf_transformers"]["same_as_ar"] == r["speed"]["prompts"]  # same weights, greedy: same tokens
    assert r["speed"]["hf_logit_max_abs_diff"] < 1e-3
    for n in names:
        d = run["drafters"][n]
        assert d["same_as_ar"] == r["speed"]["prompts"]  # lossless at T = 0
        assert d["speedup"] > 0 and d["bound"] > 0 and d["t_draft_ms"] > 0 and d["t_verify_ms"] > 0
    md = (out / "results.md").read_text()
    assert "| dspark-2L/eagle3 |" in md and "bound" in md and "transformers generate" in md
    png = Path(r["plots"]["conditional_acceptance"])
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
