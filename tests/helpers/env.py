"""The tests' surroundings: where the model files are (:data:`MODELS_DIR`), whether this is CI
(:data:`IN_CI`: a missing file fails instead of skipping, :func:`require`), the user's own XLA
flags for run-bound subprocesses (:func:`user_xla_env`) and the quick training run's budget
(:data:`QUICK_TRAIN`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def user_xla_env() -> dict[str, str]:
    """This process's environment with the user's own ``XLA_FLAGS`` (the suite's fast compile
    undone), for a run-bound subprocess: it runs faster compiled as users compile."""
    env = dict(os.environ)
    if "DSPARK_TEST_USER_XLA_FLAGS" in env:
        env["XLA_FLAGS"] = env["DSPARK_TEST_USER_XLA_FLAGS"]
    return env


MODELS_DIR = Path(os.environ.get("DSPARK_MODELS") or Path(__file__).resolve().parents[3] / "shared/data/models")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(path: Path | None, what: str, hint: str = "set DSPARK_MODELS=/path/to/shared/data/models") -> Path:
    """Returns ``path`` if it exists; otherwise skips (locally) or fails (CI)."""
    if path is None or not Path(path).exists():
        msg = f"{what} not found at {path} ({hint})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return Path(path)


# A deliberately small budget: enough to exercise every stage of `python -m dspark_jax.train`
# (data generation, training, Orbax checkpoints, export, evaluation) in about a minute on 2 cores.
QUICK_TRAIN = dict(
    num_prompts=96,
    num_eval_prompts=8,
    gen_max_new_tokens=64,
    gen_batch_size=48,
    seq_len=80,
    steps=40,
    batch_size=16,
    anchors_per_seq=8,
    log_every=10,
    ckpt_every=20,
    eval_max_new_tokens=32,
)
