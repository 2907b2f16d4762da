"""Learning-rate schedules of the drafter optimizer (``TrainConfig.lr_schedule``).

``cosine`` (default): linear warmup from 0, then cosine decay to 5% of the peak at ``steps``;
the schedule of every run before ``lr_schedule`` existed. Every point of it depends on
``steps``, so the model at step ``s < steps`` is not the model a ``steps = s`` run would give.

``wsd`` (warmup-stable-decay): linear warmup from 0 over ``warmup_steps``, constant at the
peak, then linear decay to 0 over the last ``decay_steps = round(decay_frac * steps)`` steps.
Up to :func:`wsd_decay_start` it does not depend on ``steps``: a ``wsd`` run with
``decay_frac = 0`` (the "trunk", warmup then constant) checkpointed at ``wsd_decay_start(B)``
and resumed with ``steps = B, decay_frac = f`` trains exactly the model a single ``steps = B``
run would, so every budget of a learning curve shares the trunk and pays only its own decay
(``benchmarks/learning_curve.py``; the schedule of MiniCPM, Hu et al. 2024).

Step indices are the optimizer's update count ``s = 0, 1, ...``: update ``s`` uses ``lr(s)``. The
``wsd`` rate reaches the compiled step as an input (:func:`host_lr_factor`, applied by
:class:`~dspark_jax.training.trainer.Trainer`): AdamW runs at the peak rate and its update is scaled
by ``lr(s) / peak``, the same update; the trunk and every branch then share one compilation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import optax

from dspark_jax.errors import DSparkInputError

LR_SCHEDULES = ("cosine", "wsd")


class ScheduleConfig(Protocol):
    """The fields of :class:`~dspark_jax.training.train_config.TrainConfig` a schedule reads."""

    @property
    def lr_schedule(self) -> str: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def steps(self) -> int: ...
    @property
    def warmup_frac(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def decay_frac(self) -> float: ...


def warmup_steps(cfg: ScheduleConfig) -> int:
    """Warmup length [steps]: ``cfg.warmup_steps`` when set, else ``warmup_frac * steps`` (at least 1)."""
    return cfg.warmup_steps if cfg.warmup_steps > 0 else max(1, int(cfg.warmup_frac * cfg.steps))


def wsd_decay_start(steps: int, decay_frac: float) -> int:
    """First update [step index] of a ``steps``-step ``wsd`` run's decay: ``steps - round(decay_frac * steps)``.

    Raises:
      DSparkInputError: ``decay_frac`` outside [0, 1].
    """
    if not 0.0 <= decay_frac <= 1.0:
        raise DSparkInputError(f"decay_frac must be in [0, 1], got {decay_frac}")
    return steps - int(round(decay_frac * steps))


def wsd_factor(step: int, warmup: int, steps: int, decay_frac: float) -> float:
    """``lr(step) / peak`` of warmup-stable-decay: ``clip(min(step / warmup, (steps - step) / decay_steps), 0, 1)``.

    ``decay_steps = steps - wsd_decay_start(steps, decay_frac)``; with ``decay_steps = 0`` (e.g.
    ``decay_frac = 0``) only the warmup term applies and the factor does not depend on ``steps``.
    Host arithmetic (Python floats): the train step takes it as an input.

    Raises:
      DSparkInputError: bad ``decay_frac``, or the warmup does not end before the decay starts.
    """
    start = wsd_decay_start(steps, decay_frac)
    decay = steps - start
    warmup = max(1, warmup)
    if decay and warmup > start:
        raise DSparkInputError(f"wsd: warmup ({warmup} steps) must end before the decay starts (step {start})")
    frac = step / warmup
    if decay:
        frac = min(frac, (steps - step) / decay)
    return min(max(frac, 0.0), 1.0)


def host_lr_factor(cfg: ScheduleConfig) -> Callable[[int], np.float32] | None:
    """``step -> lr(step) / peak`` for a ``wsd`` run (float32, fed to the jitted train step each step,
    so the compiled step does not depend on ``steps`` or ``decay_frac`` and every budget of a learning
    curve reuses one compilation); None for ``cosine`` (its schedule lives inside the optimizer).

    Raises:
      DSparkInputError: unknown ``lr_schedule``, or a bad ``wsd`` setting.
    """
    learning_rate_schedule(cfg)  # validates
    if cfg.lr_schedule != "wsd":
        return None
    warm, steps, frac = warmup_steps(cfg), cfg.steps, cfg.decay_frac
    return lambda step: np.float32(wsd_factor(int(step), warm, steps, frac))


def learning_rate_schedule(cfg: ScheduleConfig) -> optax.Schedule:
    """The learning rate per update of ``cfg`` (module docstring); ``wsd``'s takes host integers only
    (the trainer applies it through :func:`host_lr_factor`).

    Raises:
      DSparkInputError: unknown ``lr_schedule``, or a bad ``wsd`` setting.
    """
    warm = warmup_steps(cfg)
    if cfg.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.learning_rate, warm, max(cfg.steps, warm + 1), end_value=cfg.learning_rate * 0.05
        )
    if cfg.lr_schedule == "wsd":
        wsd_factor(0, warm, cfg.steps, cfg.decay_frac)  # validates
        peak, steps, frac = cfg.learning_rate, cfg.steps, cfg.decay_frac

        def wsd(count: Any) -> float:
            return peak * wsd_factor(int(count), warm, steps, frac)

        return wsd
    raise DSparkInputError(f"lr_schedule must be one of {LR_SCHEDULES}, got {cfg.lr_schedule!r}")
