"""``train/*.sh``: every launch script reaches ``python -m dspark_jax.train`` with its recipe (``--dry-run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "train").glob("*.sh")))
def test_train_script_dry_run_prints_its_plan(script):
    env = {**os.environ, "DSPARK_MODELS": str(MODELS_DIR), "PYTHON": sys.executable}
    p = subprocess.run(
        ["bash", str(REPO / "train" / script), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    plan = json.loads(p.stdout)
    assert "per-device total" in plan["summary"] and "per-device total" in p.stderr


def _dry_run(script: str, *args: str, **env_vars: str) -> tuple[dict, str]:
    env = {**os.environ, "DSPARK_MODELS": str(MODELS_DIR), "PYTHON": sys.executable, **env_vars}
    p = subprocess.run(
        ["bash", str(REPO / "train" / script), *args, "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), p.stderr


def test_tpu_pod_script_prints_the_gcloud_command_and_the_pod_plan():
    plan, err = _dry_run("qwen3-8b-tpu-pod.sh", "--tpu-name", "pod-a", "--workers", "4", "steps=7", ZONE="zone-b")
    line = next(x for x in err.splitlines() if x.startswith("would run: "))
    assert line.startswith("would run: gcloud compute tpus tpu-vm ssh pod-a --zone zone-b --worker=all --command=")
    assert "-m dspark_jax.train --preset qwen3-8b" in line and "steps=7" in line and "--distributed" in line
    assert plan["target"] == "Qwen3-8B" and plan["devices"] == 16 and plan["mesh"] == "data:16,fsdp:1,model:1"
    assert plan["process_layout"]["processes"] == 4 and plan["process_layout"]["devices_per_process"] == 4
    assert plan["process_layout"]["per_process_batch"] == 16 and plan["warnings"] == []
    assert "processes: 4 x 4 devices" in err and "per-device total" in err


def test_gpu_multinode_script_prints_each_nodes_command_and_the_plan():
    plan, err = _dry_run(
        "qwen3-8b-gpu-multinode.sh", "--num-nodes", "2", "--mesh", "data:4,model:4", COORDINATOR="n0:1234"
    )
    line = next(x for x in err.splitlines() if x.startswith("would run on each node: "))
    assert "--preset qwen3-8b" in line and "--coordinator-address n0:1234 --num-processes 2" in line
    assert plan["devices"] == 16 and plan["mesh"] == "data:4,fsdp:1,model:4"
    lay = plan["process_layout"]
    assert (lay["processes"], lay["devices_per_process"], lay["per_process_batch"]) == (2, 8, 32)
