"""Runs a worker module on 8 forced CPU devices (XLA must see the flag before JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_worker(name: str, timeout: int) -> dict:
    """Runs ``python -m tests.helpers.<name>`` from the repository root in a fresh interpreter with
    8 CPU devices; returns the JSON object its last stdout line holds (fails the test with its
    stderr otherwise)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run(
        [sys.executable, "-m", f"tests.helpers.{name}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
