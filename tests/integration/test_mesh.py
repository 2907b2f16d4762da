"""Training and serving on a (data, model) device mesh (docs/design.md#device-mesh).

With 8 forced CPU devices (subprocess ``tests/helpers/mesh_worker.py``, one process for every check
so programs compile once), on a tiny target whose heads, KV heads, MLP and vocabulary the
mesh divides:

* a training step on meshes 1x8 and 2x4 (data x model) equals the one-device step (parameters allclose;
  data:8 alone is test_data_parallel.py's);
* the compiled programs really are sharded: per-device parameter/optimizer bytes about
  1/model of the total, collectives in the HLO;
* a checkpoint saved under the 2x4 mesh restores on 1 device and on a model:4 mesh with
  identical parameters and optimizer state;
* the dry run's memory estimate is within 20% of XLA's memory analysis of the sharded step;
* the tensor-parallel engine (model:8) emits the one-device engine's tokens exactly (greedy
  and T=1 with seeds, coupled verification, fixed policy) and never recompiles after warm-up.

Mesh parsing, the replication fallback and the dry-run CLI run in-process (one device).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_jax.models import sharding as shd
from tests.helpers.forced_devices import run_worker

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


@pytest.fixture(scope="module")
def report() -> dict:
    return run_worker("mesh_worker", timeout=1200)


def test_sharded_training_step_equals_one_device_step(report):
    assert report["devices"] == 8
    for name in ("1x8", "2x4"):
        r = report["train"][name]
        assert r["params_allclose"], (name, r.get("params_error"))
        assert r["max_abs_param_diff_vs_1dev"] < 1e-5, name
        for a, b in zip(report["train_losses_1dev"], r["losses"]):
            assert a == pytest.approx(b, rel=1e-5), name


def test_training_programs_are_really_sharded(report):
    t = report["train"]
    for name, model in (("1x8", 8), ("2x4", 4)):
        r = t[name]
        # weights of heads/MLP/vocab dims split over `model`; small norms/biases replicated
        for k in ("drafter_param_fraction_dev0", "target_param_fraction_dev0", "opt_state_fraction_dev0"):
            assert 1 / model <= r[k] < 1.15 / model, (name, k, r[k])
        assert r["wq_spec"] == r["opt_mu_wq_spec"] == "P(None, None, 'model')"
        assert "all-reduce" in r["collectives"], name
    # fsdp: the hidden (embed) dimension over `fsdp` too, optimizer state alike: ~1/8 per device
    f = t["fsdp2x4_layout"]
    assert f["wq_spec"] == f["opt_mu_wq_spec"] == "P(None, 'fsdp', 'model')"
    assert f["opt_state_fraction_dev0"] < 1.3 / 8
    assert all(r["batch_spec"] == "P(('data', 'fsdp'),)" for r in t.values())
    # per-device argument bytes shrink with `model`
    arg = {k: t[k]["memory_analysis_bytes"]["argument_size_in_bytes"] for k in ("1x8", "2x4")}
    assert arg["1x8"] < arg["2x4"]


def test_checkpoint_restores_under_another_mesh(report):
    c = report["checkpoint"]
    for name, devices in (("1dev", 1), ("model4", 4)):
        assert c[name]["step"] == 2
        assert c[name]["max_abs_param_diff"] == 0.0 and c[name]["max_abs_opt_diff"] == 0.0
        assert c[name]["wq_devices"] == devices
    assert c["model4"]["wq_spec"] == "P(None, None, 'model')"


def test_dry_run_estimate_matches_memory_analysis(report):
    m = report["memory"]
    assert 0.8 <= m["ratio"] <= 1.2, m


def test_tensor_parallel_engine_matches_one_device_engine(report):
    e = report["engine"]
    assert e["accepted_1dev"] > 0  # drafts really get accepted (coupled verification)
    r = e["model:8"]
    assert r["same_tokens"], r.get("tokens")
    assert r["accepted"] == e["accepted_1dev"]
    assert r["recompiles_after_warmup"] == 0
    assert r["cache_spec"] == "P(None, None, None, 'model')"
    # the drafter's 2 KV heads on model:8: each on 4 devices (a split of model), same tokens
    assert r["drafter_cache_spec"] == "P(None, None, None, 'model_kv')"
    assert e["target_built_sharded_spec"] == "P(None, None, 'model')"
    assert 1 / 8 <= r["target_param_fraction_dev0"] < 1.15 / 8
    assert 1 / 8 <= r["drafter_param_fraction_dev0"] < 1.15 / 8
    assert "all-reduce" in r["step_collectives"]
    assert "shards over 'model' only" in e["data_axis_error"]


def test_bad_mesh_is_one_line_error(report):
    assert report["bad_mesh_error"] == "mesh data:3,model:4 needs 12 devices (3 x 4), but 8 are available"


# --------------------------------------------------------------------- in-process, one device


def test_mesh_parsing_and_defaults():
    assert shd.parse_mesh("data:2,model:4") == {"data": 2, "model": 4}
    assert shd.mesh_shape("", 8) == {"data": 8, "fsdp": 1, "model": 1}
    assert shd.mesh_shape("model:4", 8) == {"data": 2, "fsdp": 1, "model": 4}
    assert shd.mesh_shape("data:-1,model:2", 8) == {"data": 4, "fsdp": 1, "model": 2}
    for bad, msg in (
        ("data:2,cores:4", "unknown axis 'cores'"),
        ("data:2,data:4", "given twice"),
        ("data:x", "must be an integer"),
        ("model:0", ">= 1"),
        ("data", "axis:size"),
    ):
        with pytest.raises(ValueError, match=msg):
            shd.mesh_shape(bad, 8)
    with pytest.raises(ValueError, match="does not divide 8 devices"):
        shd.mesh_shape("model:3", 8)
    m = shd.make_mesh()  # default: every device on `data`
    assert m.axis_names == shd.MESH_AXES and dict(m.shape)["data"] == len(m.devices.flat)


def test_replication_fallback_for_dimensions_the_mesh_does_not_divide():
    mesh = shd.AbstractMesh({"model": 4})
    # 9 heads (SmolLM2-135M): the fused [H, 9 * 64] projection stays whole even though 576 % 4 == 0
    assert shd.logical_spec(("embed", "heads"), (576, 576), mesh, units={"heads": 9}) == shd.P()
    assert shd.logical_spec(("embed", "heads"), (576, 512), mesh, units={"heads": 8}) == shd.P(None, "model")
    assert shd.logical_spec(("vocab", "embed"), (49152, 576), mesh) == shd.P("model")
    assert shd.logical_spec(("vocab", "embed"), (513, 576), mesh) == shd.P()
    # one mesh axis is used at most once per array, by the dimension whose rule comes first
    assert shd.logical_spec(("mlp", "vocab"), (8, 8), mesh) == shd.P(None, "model")
    assert shd.logical_spec(("vocab", "mlp"), (8, 8), mesh) == shd.P("model")


def test_dry_run_cli_mesh_fit_line_and_bad_mesh(tmp_path, monkeypatch, capsys):
    """The train CLI's dry run (in process: the built-in Qwen3-8B config, no files)."""
    from dspark_jax.commands.train import main

    for k, v in dict(DSPARK_MODELS=str(tmp_path), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1").items():
        monkeypatch.setenv(k, v)
    base = [
        "--config",
        str(REPO / "dspark_jax/recipes/qwen3-8b.yaml"),
        "--dry-run",
        "--devices",
        "8",
        "--device-memory-gib",
        "16",
    ]
    assert main(base + ["--mesh", "data:2,model:4"]) == 0
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert r["mesh"] == "data:2,fsdp:1,model:4" and r["fits"] and r["per_device_micro_batch"] == 4
    assert r["summary"].startswith("per-device total: ") and r["summary"].endswith("(fits 16 GiB)")
    assert out.err.strip() == r["summary"]
    mem = r["memory_breakdown_gib"]
    assert mem["target_weights"] == pytest.approx(8_190_735_360 * 2 / 4 / 2**30, rel=0.01)  # bf16 / model
    assert main(base + ["--mesh", "data:8"]) == 0  # pure data parallel: does not fit a v5e chip
    assert json.loads(capsys.readouterr().out)["summary"].endswith("(does not fit 16 GiB)")
    assert main(base + ["--serve", "--mesh", "model:8", "--num-slots", "64", "--cache-len", "4096"]) == 0
    r = json.loads(capsys.readouterr().out)
    kv = 2 * 36 * 64 * 4096 * 8 * 128 * 2 / 8 / 2**30  # K and V, bf16, 8 KV heads over model:8
    assert r["memory_breakdown_gib"]["target_kv_cache"] == pytest.approx(kv, rel=1e-3) and r["fits"]
    assert r["summary"].endswith("(fits 16 GiB)")
    assert main(base + ["--mesh", "data:3,model:4"]) == 2
    assert capsys.readouterr().err.strip() == "error: mesh data:3,model:4 needs 12 devices (3 x 4), but 8 are available"
