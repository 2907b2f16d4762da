"""``--dry-run`` plans a run from the target's *config* alone: no weights are read or needed.

Covers the Qwen3 recipes (built-in configs, nothing on disk), stories260k (llama2.c header
only) and a Hugging Face directory holding just ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.models import hf_io, model_io

REPO = Path(__file__).resolve().parents[2]

# Published sizes: Qwen3-4B 4.0B parameters (tied), Qwen3-8B 8.2B (untied).
QWEN3 = {
    "qwen3-4b": dict(params=4_022_468_096, hidden=2560, tie=True),
    "qwen3-8b": dict(params=8_190_735_360, hidden=4096, tie=False),
}


@pytest.fixture
def no_weight_loading(monkeypatch):
    """Any attempt to load weights fails the test."""

    def boom(*a, **k):
        raise AssertionError("--dry-run tried to load weights")

    for name in ("load_target_files", "load_llama2c", "load_gguf", "load_hf_dir"):
        monkeypatch.setattr(model_io, name, boom)
    monkeypatch.setattr(hf_io, "_read_st", boom)


@pytest.mark.parametrize("recipe", sorted(QWEN3))
def test_qwen3_recipe_dry_run_needs_no_files(recipe, tmp_path):
    """The CLI on dspark_jax/recipes/<recipe>.yaml with an empty model folder and no hub cache: counts,
    drafter shape and a per-device memory estimate, in seconds."""
    env = dict(
        os.environ, DSPARK_MODELS=str(tmp_path), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu"
    )
    t0 = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark_jax.train",
            "--config",
            str(REPO / f"dspark_jax/recipes/{recipe}.yaml"),
            "--dry-run",
            "--devices",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    want = QWEN3[recipe]
    assert r["target_params"] == want["params"]
    t, d = r["target_config"], r["drafter_config"]
    assert (t["hidden_size"], t["num_layers"], t["num_heads"], t["num_kv_heads"], t["head_dim"], t["vocab_size"]) == (
        want["hidden"],
        36,
        32,
        8,
        128,
        151936,
    )
    assert t["tie_embeddings"] is want["tie"] and t["qk_norm"] and t["rope_theta"] == 1e6 and t["rms_eps"] == 1e-6
    assert d["taps"] == [1, 9, 17, 25, 33] and d["block_size"] == 7 and d["num_layers"] == 5 and d["markov_rank"] == 256
    assert d["variant"] == "dspark" and d["hidden_size"] == want["hidden"]
    assert 0.5e9 < r["drafter_params"] < 1.5e9
    assert r["dtype"] == "bfloat16" and r["remat"] and r["devices"] == 4 and not r["warnings"]
    mem = r["memory_breakdown_gib"]
    assert mem["target_weights"] == pytest.approx(want["params"] * 2 / 2**30, rel=1e-3)  # bf16 target
    assert mem["drafter_weights_grads_adam"] > 16 * r["drafter_params"] / 2**30  # fp32 master + AdamW
    assert 10 < r["per_device_memory_estimate_gib"] < 95
    assert wall < 60, f"dry run took {wall:.1f}s"
    assert not (tmp_path / "runs").exists()


def test_stories260k_dry_run_reads_only_the_header(stories260k_dir, monkeypatch, no_weight_loading):
    from dspark_jax.training.dry_run import dry_run
    from dspark_jax.training.recipes import TRAIN_PRESETS

    monkeypatch.setenv("DSPARK_MODELS", str(stories260k_dir.parent))
    r = dry_run(TRAIN_PRESETS["stories260k"], devices=1)
    assert r["target_params"] == 260_032 and r["target"] == "stories260K"
    assert r["drafter_config"]["vocab_size"] == 512 and r["per_device_memory_estimate_gib"] > 0
    r8 = dry_run(TRAIN_PRESETS["stories260k"], devices=8)
    assert (
        r8["per_device_micro_batch"] == 4 and r8["per_device_memory_estimate_gib"] < r["per_device_memory_estimate_gib"]
    )
    bad = TRAIN_PRESETS["stories260k"].with_keys(taps=(1, 9))
    with pytest.raises(DSparkInputError, match="tap layer 9"):
        dry_run(bad, devices=1)


def test_builtin_qwen3_config_parses_like_a_downloaded_config_json(tmp_path, no_weight_loading):
    """The built-in configs go through the same parser as a Hugging Face directory: writing the
    same config.json (no weights) into a folder gives the same TargetConfig."""
    from dspark_jax.models.presets import BUILTIN_HF_CONFIGS, builtin_target_config, target_config
    from dspark_jax.training.dry_run import dry_run
    from dspark_jax.training.recipes import TRAIN_PRESETS

    for name in QWEN3:
        d = tmp_path / ("Qwen3-4B" if name == "qwen3-4b" else "Qwen3-8B")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(BUILTIN_HF_CONFIGS[name], model_type="qwen3")))
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
        assert model_io.read_target_config(d) == builtin_target_config(name) == target_config(name)
        assert target_config(str(d)) == target_config(name)
        r = dry_run(dataclasses.replace(TRAIN_PRESETS[name], target=str(d)), devices=4)
        assert r["target_params"] == QWEN3[name]["params"]


def test_qwen3_weights_need_a_path(monkeypatch, tmp_path):
    from dspark_jax.models.presets import resolve_target

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DSparkInputError, match="target=/path/to/Qwen3-8B") as e:
        resolve_target("qwen3-8b")
    assert "\n" not in str(e.value)
