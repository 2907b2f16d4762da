"""``python -m benchmarks.device_check``: its ``--tiny`` run end to end in a subprocess (as on the command
line, where it turns XLA's backend optimisation down before JAX loads: compiling is most of the
run), every section present with finite numbers (None only where a peak is unknown on this
device); and, in process, the peak tables and the analytic FLOPs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _numbers(x, path="$"):
    """``(path, value)`` of every number in a JSON value."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


@pytest.mark.slow
def test_tiny_run_writes_every_section(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "device_check.json").read_text())
    s = r["sections"]
    assert list(s) == ["step", "roofline", "exactness", "engine", "train", "moe", "compile"]
    for name, sec in s.items():
        assert not {"error", "skipped", "partial"} & set(sec), (name, sec)
        assert f"== {name if name != 'compile' else 'compile seconds'}" in p.stdout
    bad = [(k, v) for k, v in _numbers(r) if not math.isfinite(v)]
    assert not bad, bad
    assert r["meta"]["tiny"] and r["meta"]["dtype"] == "float32"
    # the step at every (cache, live) point; the cost table follows the same points
    assert {(x["cache_len"], x["live_len"]) for x in s["step"]["rows"]} == {
        (128, 16),
        (128, 64),
        (128, 96),
        (256, 16),
        (256, 64),
        (256, 192),
    }
    assert all(x["ms_per_token"] > 0 and x["bytes_dense"] >= x["bytes_live"] for x in s["roofline"]["rows"])
    assert s["roofline"]["rows"][-1]["program"] == "generate_autoregressive"
    (case,) = s["exactness"]["cases"]
    assert case["dtype"] == "bfloat16" and case["tokens"] == 2 * 24
    # bfloat16: the one-pass recomputation has other shapes than the verifying passes, so a near
    # tie may flip; on this tiny model none does
    assert case["argmax_agreement"] >= 0.9
    assert [x["tokens"] for x in s["moe"]["timing"]] == [1, 4] and s["moe"]["bytes"][0]["read_over_active"] <= 1.5
    engine = {(x["policy"], x["rows"]) for x in s["engine"]["rows"]}
    assert engine == {("fixed:4", 1), ("fixed:4", 4), ("plain", 1), ("plain", 4)}
    assert all(x["steps_per_s"] > 0 and x["tokens_per_s"] > 0 for x in s["engine"]["rows"])
    t = s["train"]
    assert t["flops"]["total"] == pytest.approx(sum(v for k, v in t["flops"].items() if k != "total"))
    assert t["step_s"] > 0 and t["peak_tflops"] is None and t["mfu"] is None  # CPU: no peak in the table
    assert set(s["compile"]["seconds"]) >= {"step[cache=128]", "engine.warmup[fixed:4]"}


def _script(monkeypatch):
    from benchmarks import device_check

    return device_check


def test_peak_tables_and_the_full_size_config():
    from benchmarks import device_setup as dc

    assert dc.peak(dc.PEAK_BW_GB_S, "NVIDIA H200") == 4800.0
    assert dc.peak(dc.PEAK_BW_GB_S, "NVIDIA H100 80GB HBM3") == 3350.0
    assert dc.peak(dc.PEAK_BW_GB_S, "TPU v5 lite") == 819.0
    assert dc.peak(dc.PEAK_BW_GB_S, "TPU v5p") == 2765.0
    assert dc.peak(dc.PEAK_BW_GB_S, "TPU v6e") == 1640.0
    assert dc.peak(dc.PEAK_TFLOPS, "NVIDIA H200") == 989.0
    assert dc.peak(dc.PEAK_BW_GB_S, "cpu") is None and dc.peak(dc.PEAK_TFLOPS, "cpu") is None
    from dspark_jax.models.weights import count_target_params

    cfg = dc.qwen3_8b_config()
    assert 8.1e9 < count_target_params(cfg) < 8.3e9  # Qwen3-8B: 8.19B parameters
    assert cfg.qk_norm and not cfg.tie_embeddings


def test_train_flops_counts_the_target_forward_like_two_flops_per_parameter_per_token(monkeypatch):
    """The frozen target's part: 2 FLOPs per matmul weight per token plus the dense attention."""
    from dspark_jax.config import DrafterConfig

    dc = _script(monkeypatch)
    t = dc.qwen3_8b_config()
    d = DrafterConfig.for_target(t, block_size=8, num_layers=2)
    b, seq, a = 4, 1024, 16
    f = dc.train_flops(t, d, b, seq, a)
    from dspark_jax.models.weights import count_target_params

    matmul_params = count_target_params(t) - t.vocab_size * t.hidden_size - (2 * t.num_layers + 1) * t.hidden_size
    matmul_params -= 2 * t.num_layers * t.head_dim  # q/k-norm weights
    attn = 4 * t.num_heads * t.head_dim * seq * t.num_layers
    assert f["target_forward"] == pytest.approx(b * seq * (2 * matmul_params + attn))
    assert f["drafter_backward"] > f["drafter_forward"] > 0
