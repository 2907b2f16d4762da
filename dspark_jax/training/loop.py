"""The training loop of ``python -m dspark_jax.train`` (stage 2): steps, checkpoints, metrics, preemption.

:func:`train_loop` resumes from the newest Orbax checkpoint in ``<workdir>/checkpoints`` (the data
order depends only on ``(seed, step)``, so a resumed run sees the batches an uninterrupted one
would), runs :meth:`Trainer.step <dspark_jax.training.trainer.Trainer.step>` up to ``cfg.steps``
(or ``cfg.time_budget_s``), checkpoints every ``ckpt_every`` steps and at the end, and logs
metrics to ``<workdir>/metrics.jsonl`` (and TensorBoard when installed). A preemption notice
(SIGTERM / SIGINT) finishes the step in flight, checkpoints it and exits with ``128 + signal``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax

from dspark_jax.training import data as data_mod
from dspark_jax.training.losses import LossTerms
from dspark_jax.training.train_config import TrainConfig
from dspark_jax.training.trainer import Trainer


def tensorboard_writer(logdir: Path):
    """A TensorBoard ``SummaryWriter`` on ``logdir`` when TensorBoard is installed, else None.

    Uses ``tensorboardX`` or ``torch.utils.tensorboard`` (both need the ``tensorboard``
    package); training logs JSONL regardless.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            return importlib.import_module(mod).SummaryWriter(str(logdir))
        except Exception:
            continue
    return None


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Appends ``row`` as one JSON line to ``path``."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drops rows with ``step > max_step`` (logged by a killed run after its last checkpoint).

    Rewritten atomically; a torn last line (killed mid-write) is dropped too.
    """
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(row.get("step", 0)) <= max_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


def scalar_terms(terms: LossTerms) -> dict[str, float]:
    """The scalar loss terms of a step as floats (``acc_by_pos`` left out)."""
    return {k: float(v) for k, v in terms._asdict().items() if k != "acc_by_pos"}


class _MetricsLog:
    """Progress bar, ``metrics.jsonl`` rows and TensorBoard scalars of a run resumed at ``start``.

    One process (index 0) writes the logs; rows logged after the checkpoint the run resumes
    from are dropped first (they are about to be redone).
    """

    def __init__(self, cfg: TrainConfig, workdir: Path, start: int):
        from tqdm.auto import tqdm

        self.cfg = cfg
        self.lead = jax.process_index() == 0  # one process writes logs (Orbax coordinates the checkpoints)
        self.path = workdir / "metrics.jsonl"
        if self.lead:
            truncate_jsonl(self.path, start)
        self.tb = tensorboard_writer(workdir / "tensorboard") if self.lead else None
        self.bar = tqdm(
            total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not self.lead
        )
        self.t_train = time.perf_counter()
        self.last_log, self.last_log_step = self.t_train, start

    def after_step(self, step: int, terms: LossTerms, gnorm: jax.Array) -> None:
        """Advances the bar; every ``log_every`` steps (and at the last) writes a metrics row."""
        self.bar.update(1)
        if step % self.cfg.log_every and step != self.cfg.steps:
            return
        now = time.perf_counter()
        tok_per_step = self.cfg.batch_size * self.cfg.seq_len
        row = {
            "step": step,
            **scalar_terms(terms),
            "grad_norm": float(gnorm),
            "tokens_per_s": tok_per_step * (step - self.last_log_step) / max(now - self.last_log, 1e-9),
            "elapsed_s": now - self.t_train,
        }
        self.last_log, self.last_log_step = now, step
        if self.lead:
            append_jsonl(self.path, row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(f"train/{k}", v, step)
            self.tb.flush()
        self.bar.set_postfix(
            loss=f"{row['loss']:.3f}",
            tv=f"{row['tv']:.3f}",
            tau_est=f"{row['tau_est']:.2f}",
            tok_s=f"{row['tokens_per_s']:.0f}",
        )

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()


@contextmanager
def preemption_guard() -> Iterator[list[int]]:
    """Records SIGTERM / SIGINT in the yielded list instead of dying, for the block's duration.

    Preemption notices (TPU VMs, Kubernetes, Slurm send SIGTERM first) then let the loop finish
    the step in flight and checkpoint it, so the restart loses nothing. A second signal kills
    (the default handler is restored on the first).
    """
    received: list[int] = []
    handler = lambda signum, frame: (received.append(signum), signal.signal(signum, signal.SIG_DFL))
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield received
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)


def train_loop(
    cfg: TrainConfig, trainer: Trainer, data: dict[str, Any], workdir: Path
) -> tuple[int, LossTerms | None, float]:
    """Trains from the newest checkpoint in ``<workdir>/checkpoints`` to ``cfg.steps`` (module docstring).

    Args:
      data: the training arrays (``tokens [N, L]``, ``lengths``, ``prompt_lengths``, optional
        feature-cache views), batched by :func:`dspark_jax.training.data.batches`.
    Returns:
      ``(final step, last step's LossTerms or None when no step ran, training seconds)``.
    Raises:
      SystemExit: ``128 + signal`` after a preemption signal (checkpoint saved).
      DSparkInputError: the checkpoints there belong to another run.
    """
    mgr = trainer.checkpoint_manager(workdir / "checkpoints")
    start = trainer.restore_latest(mgr)
    if start:
        print(f"resuming from checkpoint step {start}", file=sys.stderr)
    log = _MetricsLog(cfg, workdir, start)
    it = data_mod.batches(data, cfg.batch_size, cfg.seed, start_step=start)
    step, terms = start, None
    with preemption_guard() as preempted:
        while step < cfg.steps and not preempted:
            terms, gnorm = trainer.step(next(it), step)
            step += 1
            log.after_step(step, terms, gnorm)
            if step % cfg.ckpt_every == 0:
                trainer.save(mgr, step)
            if cfg.time_budget_s and time.perf_counter() - log.t_train > cfg.time_budget_s:
                print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}", file=sys.stderr)
                break
    log.close()
    if mgr.latest_step() != step:
        trainer.save(mgr, step)
    if preempted:
        print(
            f"stopped by signal {preempted[0]} at step {step}; checkpoint saved, rerun the same command to resume",
            file=sys.stderr,
        )
        raise SystemExit(128 + preempted[0])
    return step, terms, time.perf_counter() - log.t_train
