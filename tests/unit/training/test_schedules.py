"""Learning-rate schedules (dspark_jax.training.schedules): cosine unchanged, warmup-stable-decay, branching."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.training.schedules import host_lr_factor, learning_rate_schedule, wsd_decay_start
from dspark_jax.training.train_config import TrainConfig
from dspark_jax.training.trainer import make_optimizer


def _trajectory(tx: optax.GradientTransformation, n: int, scale=None) -> list[np.ndarray]:
    """Parameters after each of ``n`` updates of ``tx`` on a toy tree with fixed pseudo-gradients;
    ``scale(i)`` multiplies update ``i`` (the Trainer's wsd factor)."""
    p: Any = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    state = tx.init(p)
    out = []
    for i in range(n):
        g = {"w": jnp.cos(jnp.linspace(-1.0, 1.0, 6).reshape(2, 3) * (i + 2))}
        u: Any
        u, state = tx.update(g, state, p)
        if scale is not None:
            u = {"w": u["w"] * scale(i)}
        p = optax.apply_updates(p, u)
        out.append(np.asarray(p["w"]))
    return out


def _lrs(cfg: TrainConfig, steps) -> np.ndarray:
    sched = learning_rate_schedule(cfg)
    return np.array([float(np.asarray(sched(s))) for s in steps])


@pytest.mark.parametrize("steps", [1, 7, 100, 1100])
def test_cosine_is_the_schedule_before_lr_schedule_existed(steps):
    cfg = TrainConfig(steps=steps, learning_rate=3e-3, warmup_frac=0.04)
    assert cfg.lr_schedule == "cosine"
    warm = max(1, int(0.04 * steps))
    old = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warm, max(steps, warm + 1), end_value=3e-3 * 0.05)
    s = list(range(0, steps + 2))
    np.testing.assert_array_equal(_lrs(cfg, s), [float(np.asarray(old(i))) for i in s])


def test_cosine_optimizer_updates_unchanged():
    cfg = TrainConfig(steps=20, learning_rate=1e-2, warmup_frac=0.1, weight_decay=0.01, grad_clip=1.0)
    warm = max(1, int(cfg.warmup_frac * cfg.steps))
    old_tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 1e-2, warm, 20, end_value=1e-2 * 0.05),
            b1=0.9,
            b2=0.95,
            weight_decay=0.01,
        ),
    )
    np.testing.assert_array_equal(_trajectory(old_tx, 8), _trajectory(make_optimizer(cfg), 8))


def test_wsd_warmup_stable_decay_to_zero():
    cfg = TrainConfig(steps=100, learning_rate=2e-3, lr_schedule="wsd", decay_frac=0.2, warmup_steps=10)
    assert wsd_decay_start(100, 0.2) == 80
    lr = _lrs(cfg, range(101))
    assert lr[0] == 0.0
    np.testing.assert_allclose(lr[5], 1e-3, rtol=1e-6)  # linear warmup
    np.testing.assert_allclose(lr[10:81], 2e-3, rtol=1e-6)  # warmup end .. decay start: the peak
    np.testing.assert_allclose(lr[90], 1e-3, rtol=1e-6)  # linear decay
    assert lr[100] == 0.0 and np.all(np.diff(lr[80:]) < 0)
    # warmup_steps = 0: warmup_frac * steps, as for cosine
    lr2 = _lrs(dataclasses.replace(cfg, warmup_steps=0, warmup_frac=0.05), [0, 5])
    np.testing.assert_allclose(lr2, [0.0, 2e-3], rtol=1e-6)


def test_wsd_trunk_equals_every_budget_before_its_decay():
    """A decay_frac=0 trunk (warmup, then constant, whatever its steps) matches each budget's own
    schedule up to that budget's decay start: branching from the trunk is a full run."""

    def wsd(steps: int, decay_frac: float) -> TrainConfig:
        return TrainConfig(steps=steps, decay_frac=decay_frac, learning_rate=3e-3, lr_schedule="wsd", warmup_steps=4)

    trunk = _lrs(wsd(7, 0.0), range(400))
    np.testing.assert_array_equal(trunk, _lrs(wsd(350, 0.0), range(400)))
    for budget in (8, 16, 100, 400):
        start = wsd_decay_start(budget, 0.2)
        own = _lrs(wsd(budget, 0.2), range(budget + 1))
        np.testing.assert_array_equal(own[:start], trunk[:start])
        assert own[start - 1] == pytest.approx(3e-3) and own[budget] == 0.0


def test_wsd_optimizer_at_peak_scaled_by_host_factor_is_adamw_with_the_schedule():
    """make_optimizer's wsd AdamW runs at the peak rate and the Trainer scales each update by
    host_lr_factor(step): the same updates as AdamW with the schedule inside."""
    cfg = TrainConfig(steps=10, learning_rate=1e-2, lr_schedule="wsd", warmup_steps=3, decay_frac=0.4)
    assert host_lr_factor(dataclasses.replace(cfg, lr_schedule="cosine")) is None
    factor = host_lr_factor(cfg)
    assert factor is not None
    sched = learning_rate_schedule(cfg)
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    got, want = _trajectory(make_optimizer(cfg), cfg.steps, factor), _trajectory(ref_tx, cfg.steps)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert float(factor(0)) == 0.0 and float(factor(5)) == 1.0 and float(factor(9)) == pytest.approx(0.25)


def test_bad_schedule_settings_raise():
    with pytest.raises(DSparkInputError, match="lr_schedule"):
        learning_rate_schedule(TrainConfig(lr_schedule="linear"))
    with pytest.raises(DSparkInputError, match="decay_frac"):
        learning_rate_schedule(TrainConfig(lr_schedule="wsd", decay_frac=1.5))
    with pytest.raises(DSparkInputError, match="warmup"):
        learning_rate_schedule(TrainConfig(lr_schedule="wsd", steps=10, warmup_steps=9))
