"""Trainer: loss sanity, deterministic resume from Orbax checkpoints, export round trip, config overrides."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.checkpoint import export_drafter, load_drafter
from dspark_jax.config import DrafterConfig, TargetConfig, apply_overrides
from dspark_jax.data import batches
from dspark_jax.drafter import Drafter
from dspark_jax.target import Target, random_params
from dspark_jax.trainer import TrainConfig, Trainer, drafter_config, drafter_loss

TCFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position=128, name="tiny")
CFG = TrainConfig(steps=6, batch_size=4, anchors_per_seq=4, gamma=4, num_layers=1, markov_rank=8,
                  learning_rate=1e-2, ckpt_every=3, keep_checkpoints=2)


def _data(n=16, length=40, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, TCFG.vocab_size, (n, length)).astype(np.int32)
    lens = rng.integers(length // 2, length + 1, n).astype(np.int32)
    return {"tokens": toks, "lengths": lens, "prompt_lengths": np.full(n, 4, np.int32)}


def _target():
    return Target(TCFG, random_params(TCFG, seed=1, scale=0.2), fingerprint="tinyfp")


def _params(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.params))


def test_loss_terms_are_sane_and_confidence_label_is_one_minus_tv():
    target = _target()
    d = Drafter(drafter_config(CFG, target), nnx.Rngs(0))
    b = _data()
    terms = drafter_loss(d, target, jnp.asarray(b["tokens"][:4]), jnp.asarray(b["lengths"][:4]),
                         jnp.asarray(b["prompt_lengths"][:4]), jax.random.PRNGKey(0), CFG)
    assert np.isfinite(float(terms.loss))
    assert 0.0 <= float(terms.tv) <= 1.0
    assert 1.0 <= float(terms.tau_est) <= 1 + CFG.gamma
    assert terms.acc_by_pos.shape == (CFG.gamma,)


def test_training_reduces_loss():
    target = _target()
    tr = Trainer(CFG, target, Drafter(drafter_config(CFG, target), nnx.Rngs(0)))
    data = _data()
    it = batches(data, CFG.batch_size, seed=0)
    first = None
    for s in range(30):
        terms, _ = tr.step(next(it), s)
        first = first if first is not None else float(terms.loss)
    assert float(terms.loss) < first


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    """Stop after a checkpoint, restart from it: identical parameters to one uninterrupted run."""
    target = _target()
    data = _data()

    def fresh():
        return Trainer(CFG, target, Drafter(drafter_config(CFG, target), nnx.Rngs(CFG.seed)))

    full = fresh()
    it = batches(data, CFG.batch_size, CFG.seed)
    for s in range(CFG.steps):
        full.step(next(it), s)

    first = fresh()
    mgr = first.checkpoint_manager(tmp_path / "ckpt")
    it = batches(data, CFG.batch_size, CFG.seed)
    for s in range(4):                      # "killed" after step 4; last checkpoint at step 3
        first.step(next(it), s)
        if (s + 1) % CFG.ckpt_every == 0:
            first.save(mgr, s + 1)
    second = fresh()
    mgr2 = second.checkpoint_manager(tmp_path / "ckpt")
    start = second.restore_latest(mgr2)
    assert start == 3
    it = batches(data, CFG.batch_size, CFG.seed, start_step=start)
    for s in range(start, CFG.steps):
        second.step(next(it), s)
    a, b = _params(full), _params(second)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_export_round_trip(tmp_path):
    target = _target()
    cfg = DrafterConfig.for_target(TCFG, gamma=4, num_layers=1, markov_rank=8, target_fingerprint="tinyfp")
    d = Drafter(cfg, nnx.Rngs(3))
    path = export_drafter(d, tmp_path / "export", calibration=[1.0] * 4, extra={"note": "x"})
    d2, meta = load_drafter(path)
    assert d2.cfg == cfg and meta["calibration"] == [1.0] * 4 and meta["extra"]["note"] == "x"
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(d, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(d2, nnx.Param)))


def test_corrupt_export_is_refused(tmp_path):
    from dspark_jax.errors import DSparkInputError

    d = Drafter(DrafterConfig.for_target(TCFG, gamma=4, num_layers=1, markov_rank=8), nnx.Rngs(3))
    path = export_drafter(d, tmp_path / "export")
    other = Drafter(DrafterConfig.for_target(TCFG, gamma=4, num_layers=2, markov_rank=8), nnx.Rngs(3))
    export_drafter(other, tmp_path / "other")
    # config says 1 layer, params hold 2: a mismatched checkpoint
    (tmp_path / "other" / "drafter.json").write_text((path / "drafter.json").read_text())
    with pytest.raises(DSparkInputError):
        load_drafter(tmp_path / "other")
    with pytest.raises(DSparkInputError, match="not a drafter export"):
        load_drafter(tmp_path)


def test_overrides_parse_types_and_reject_unknown_keys():
    cfg = apply_overrides(CFG, ["steps=12", "taps=1,2", "learning_rate=3e-4", "variant=dflash"])
    assert cfg.steps == 12 and cfg.taps == (1, 2) and cfg.learning_rate == 3e-4 and cfg.variant == "dflash"
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(CFG, ["stepz=1"])
    with pytest.raises(ValueError):
        apply_overrides(CFG, ["steps=abc"])
    assert dataclasses.replace(CFG) == CFG
