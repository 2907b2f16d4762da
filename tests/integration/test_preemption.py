"""Preemption safety of ``python -m dspark_jax.train`` (docs/design.md#training: Orbax
checkpoints, resume after a kill).

One workdir is SIGKILLed twice -- once during self-distillation data generation, once
at a seeded random moment after a (seeded random) checkpoint exists -- and restarted with the
same command each time; its data shards, logged metrics and exported parameters must
equal those of an uninterrupted run of the same command in another workdir. A fake
half-written Orbax save (what a kill in the middle of ``save`` leaves) is planted
before the next restart: it must be ignored and cleaned up. That restart is then stopped with
SIGTERM (a preemption notice), which must checkpoint the current step and exit 143.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.env import MODELS_DIR

REPO = Path(__file__).resolve().parents[2]
STEPS, CKPT_EVERY, KEEP, N_SHARDS = 40, 5, 2, 8
ARGS = [
    "--preset",
    "stories260k",
    "--skip-eval",
    "num_prompts=64",
    "num_eval_prompts=0",
    "gen_max_new_tokens=32",
    "seq_len=48",
    "gen_batch_size=8",
    "gen_shard_size=8",
    f"steps={STEPS}",
    f"ckpt_every={CKPT_EVERY}",
    f"keep_checkpoints={KEEP}",
    "log_every=5",
    "batch_size=8",
    "anchors_per_seq=4",
    "num_layers=1",
]
KILL_SEED = 20240607


def _cmd(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "dspark_jax.train", *ARGS, f"workdir={workdir}"]


def _env() -> dict:
    e = dict(os.environ)
    e.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    e["JAX_PLATFORMS"] = "cpu"
    return e


def _run(workdir: Path, log: Path) -> str:
    with open(log, "w") as f:
        p = subprocess.run(_cmd(workdir), stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, timeout=900)
    out = log.read_text()
    assert p.returncode == 0, out[-3000:]
    return out


def _run_and_kill(workdir: Path, log: Path, ready, delay: float) -> bool:
    """Starts the command, waits until ``ready()``, sleeps ``delay`` s, SIGKILLs it.

    Returns whether the process was still running when killed.
    """
    with open(log, "w") as f:
        p = subprocess.Popen(_cmd(workdir), stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        try:
            deadline = time.monotonic() + 900
            while not ready():
                assert p.poll() is None, f"exited (rc={p.returncode}) before the kill point:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "kill point never reached"
                time.sleep(0.005)
            time.sleep(delay)
            alive = p.poll() is None
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait()
    return alive


def _shards(workdir: Path) -> list[Path]:
    return sorted((workdir / "data").glob("shard_?????.npz"))


def _steps(workdir: Path) -> list[int]:
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _export_params(workdir: Path) -> dict:
    import jax
    from flax import nnx

    from dspark_jax.drafters.checkpoint import load_drafter

    d, _ = load_drafter(workdir / "export")
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(d, nnx.Param)))


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_killed_and_restarted_training_equals_uninterrupted_run(stories260k_dir, tmp_path):
    t0 = time.perf_counter()
    ref, run = tmp_path / "ref", tmp_path / "run"
    _run(ref, tmp_path / "ref.log")
    assert len(_shards(ref)) == N_SHARDS and _steps(ref)[-1] == STEPS

    # 1) killed during data generation, right after the first shard was committed
    alive = _run_and_kill(run, tmp_path / "kill_gen.log", lambda: len(_shards(run)) >= 1, 0.0)
    n = len(_shards(run))
    assert alive and 1 <= n < N_SHARDS, n
    assert not (run / "checkpoints").exists()

    # 2) restarted (generation resumes at the first missing shard), killed at a seeded random
    #    moment: a random delay after a random checkpoint (at least the first) was committed
    rng = random.Random(KILL_SEED)
    after = rng.choice(range(CKPT_EVERY, STEPS - 2 * CKPT_EVERY + 1, CKPT_EVERY))
    delay = rng.uniform(0.0, 0.05)
    alive = _run_and_kill(run, tmp_path / "kill_train.log", lambda: max(_steps(run), default=0) >= after, delay)
    log = (tmp_path / "kill_train.log").read_text()
    assert alive and not (run / "export").exists(), log[-2000:]
    killed_at = _steps(run)
    assert killed_at and killed_at[-1] < STEPS and len(killed_at) <= KEEP + 1
    tmp_dirs = [p.name for p in (run / "checkpoints").iterdir() if "tmp" in p.name]  # a real mid-save kill

    # 3) what a kill in the middle of Orbax's save leaves: a temporary directory (here with
    #    truncated data files) for the next step
    last = killed_at[-1]
    fake = run / "checkpoints" / f"{last + CKPT_EVERY}.orbax-checkpoint-tmp-1700000000000"
    shutil.copytree(run / "checkpoints" / str(last), fake, dirs_exist_ok=True)
    for f in fake.rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])

    # 4) restarted, then asked to stop with SIGTERM (a preemption notice) once training
    #    resumed: it finishes the step in flight, checkpoints it and exits 128 + 15
    log_path = tmp_path / "sigterm.log"
    with open(log_path, "w") as f:
        p = subprocess.Popen(_cmd(run), stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)
        try:
            deadline = time.monotonic() + 900
            while f"resuming from checkpoint step {last}" not in log_path.read_text():
                assert p.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.01)
            time.sleep(0.3)
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=600)
        finally:
            p.kill()
            p.wait()
    log = log_path.read_text()
    stopped = _steps(run)[-1]
    assert rc == 128 + signal.SIGTERM and f"stopped by signal {int(signal.SIGTERM)} at step {stopped}" in log, log[
        -3000:
    ]
    assert last < stopped < STEPS - CKPT_EVERY and not (run / "export").exists()
    assert not [q for q in (run / "checkpoints").iterdir() if not q.name.isdigit()]  # fake tmp cleaned up

    # 5) restarted again: runs to the end
    out = _run(run, tmp_path / "resume.log")
    assert f"resuming from checkpoint step {stopped}" in out, out[-3000:]

    # same data (generation resumed, not restarted from a corrupt state)
    assert len(_shards(run)) == N_SHARDS
    for a, b in zip(_shards(ref), _shards(run)):
        with np.load(a) as za, np.load(b) as zb:
            for k in ("tokens", "lengths", "prompt_lengths"):
                np.testing.assert_array_equal(za[k], zb[k])
    # periodic checkpoints, only the newest KEEP kept, no temporary directories left
    assert _steps(run) == _steps(ref) == list(range(STEPS - (KEEP - 1) * CKPT_EVERY, STEPS + 1, CKPT_EVERY))
    assert not [p for p in (run / "checkpoints").iterdir() if not p.name.isdigit()]
    # the metrics log holds each step once, with the uninterrupted run's values
    m_ref, m_run = _metrics(ref), _metrics(run)
    assert [r["step"] for r in m_run] == [r["step"] for r in m_ref] == list(range(5, STEPS + 1, 5))
    for a, b in zip(m_ref, m_run):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["tv"] == pytest.approx(a["tv"], rel=1e-6)
    # identical exported parameters
    pa, pb = _export_params(ref), _export_params(run)
    import jax

    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), pa, pb))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=0), pa, pb)
    print(
        f"\npreemption: shards at gen kill {n}/{N_SHARDS}, kill {delay:.3f}s after checkpoint {after}, "
        f"checkpoints at kill "
        f"{killed_at}, real tmp dirs at kill {tmp_dirs}, SIGTERM at step {stopped}, max |param diff| {max(diffs):.3g}, "
        f"{time.perf_counter() - t0:.0f}s"
    )
