"""``train/*.sh``: every launch script reaches ``python -m dspark_jax.train`` with its recipe (``--dry-run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS_DIR

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
