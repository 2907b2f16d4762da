"""``serve/*.sh``: every launch script with ``--dry-run`` prints the server plan or the commands it would run,
touching no device (each runs with ``JAX_PLATFORMS`` naming a backend that does not exist, so any device
use or compilation would fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import MODELS_DIR
from tests.helpers.server import stories260k_drafter_meta

REPO = Path(__file__).resolve().parents[2]


def _dry_run(script: str, *args: str, **env_vars: str) -> str:
    env = {**os.environ, "DSPARK_MODELS": str(MODELS_DIR), "PYTHON": sys.executable, "JAX_PLATFORMS": "none_such"}
    env.update(env_vars)
    p = subprocess.run(
        ["bash", str(REPO / "serve" / script), *args, "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_every_serve_script_is_tested():
    tested = {"plain.sh", "speculative.sh", "mesh.sh", "vllm.sh", "sglang.sh", "llamacpp.sh"}
    assert {p.name for p in (REPO / "serve").glob("*.sh")} == tested


def test_plain_script_plans_the_target_alone():
    plan = json.loads(_dry_run("plain.sh", "--num-slots", "4", "--port", "8123"))
    assert plan["target"]["name"] == "stories260K" and plan["drafter"] is None and plan["policy"] == "plain"
    assert plan["num_slots"] == 4 and plan["mesh_model"] == 1 and plan["url"] == "http://127.0.0.1:8123"
    assert plan["plan_ahead"] is False


def test_speculative_script_plans_the_drafter_and_policy(tmp_path):
    export = stories260k_drafter_meta(tmp_path / "export")
    plan = json.loads(_dry_run("speculative.sh", "--plan-ahead", DRAFTER=str(export), POLICY="threshold:0.5"))
    assert plan["drafter"]["path"] == str(export) and plan["drafter"]["block_size"] == 3
    assert plan["policy"] == "threshold:0.5" and plan["target"]["name"] == "stories260K" and plan["plan_ahead"] is True


def test_mesh_script_plans_tensor_parallel_serving_without_weights():
    plan = json.loads(_dry_run("mesh.sh", "--num-slots", "64", MODEL_PARALLEL="8"))
    assert plan["target"]["name"] == "Qwen3-8B" and plan["target"]["layers"] == 36
    assert plan["mesh_model"] == 8 and plan["dtype"] == "bfloat16" and plan["num_slots"] == 64


@pytest.mark.parametrize(
    "script,fmt,serve",
    [
        ("vllm.sh", "speculators", "serve: vllm serve /m/Qwen3-8B --speculative-config "),
        ("sglang.sh", "deepspec", "serve: python -m sglang.launch_server --model-path /m/Qwen3-8B "),
    ],
)
def test_external_engine_scripts_print_the_export_and_serve_commands(script, fmt, serve):
    out = _dry_run(script, "--export", "--port", "9000", TARGET="/m/Qwen3-8B", EXPORT="runs/x/export", DIR="/o/d")
    export, serve_line = out.splitlines()
    assert export.startswith("export: ") and "-m dspark_jax.export runs/x/export --target /m/Qwen3-8B" in export
    assert f"--format {fmt} --out /o/d" in export
    assert serve_line.startswith(serve) and serve_line.endswith("--port 9000")
    if script == "vllm.sh":
        spec = json.loads(serve_line.split("'")[1])
        assert spec == {"method": "dspark", "model": "/o/d", "num_speculative_tokens": 7}
    else:
        assert "--speculative-algorithm DSPARK --speculative-draft-model-path /o/d" in serve_line


def test_llamacpp_script_prints_export_convert_and_server_commands(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "convert_hf_to_gguf.py").write_text("")
    env = {"LLAMA_CPP": str(tmp_path), "TARGET": "/m/Qwen3-8B", "EXPORT": "runs/x/export", "DIR": "/o/d"}
    out = _dry_run("llamacpp.sh", "--export", "--convert", "--port", "9000", "-t", "2", **env)
    export, target, drafter, serve = out.splitlines()
    assert export.endswith(
        "-m dspark_jax.export runs/x/export --target /m/Qwen3-8B --format speculators --out /o/d --dtype bfloat16"
    )
    convert = f"{tmp_path}/src/convert_hf_to_gguf.py"
    assert target.endswith(f"{convert} /m/Qwen3-8B --outtype bf16 --outfile /o/d.target.gguf")
    assert drafter.endswith(f"{convert} /o/d --target-model-dir /m/Qwen3-8B --outtype bf16 --outfile /o/d.gguf")
    assert serve == (
        f"serve: {tmp_path}/build/bin/llama-server -m /o/d.target.gguf -md /o/d.gguf --spec-type draft-dspark "
        "--spec-draft-n-max 7 --port 9000 -t 2"
    )
    assert _dry_run("llamacpp.sh", **env).splitlines()[0].startswith("serve: ")
