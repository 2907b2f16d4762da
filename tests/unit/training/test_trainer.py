"""Trainer: loss sanity, deterministic resume from Orbax checkpoints, export round trip, config overrides."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.checkpoint import export_drafter, load_drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.models.target import Target, random_params
from dspark_jax.training.data import batches
from dspark_jax.training.losses import drafter_loss
from dspark_jax.training.overrides import apply_overrides
from dspark_jax.training.train_config import TrainConfig, drafter_config
from dspark_jax.training.trainer import Trainer

TCFG = TargetConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position=128,
    name="tiny",
)
CFG = TrainConfig.from_keys(
    steps=6,
    batch_size=4,
    anchors_per_seq=4,
    block_size=4,
    num_layers=1,
    markov_rank=8,
    learning_rate=1e-2,
    ckpt_every=3,
    keep_checkpoints=2,
)


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
    d = DSparkDrafter(drafter_config(CFG, target), nnx.Rngs(0))
    b = _data()
    terms = drafter_loss(
        d,
        target,
        jnp.asarray(b["tokens"][:4]),
        jnp.asarray(b["lengths"][:4]),
        jnp.asarray(b["prompt_lengths"][:4]),
        jax.random.PRNGKey(0),
        CFG,
    )
    assert np.isfinite(float(terms.loss))
    assert 0.0 <= float(terms.tv) <= 1.0
    assert 1.0 <= float(terms.tau_est) <= 1 + CFG.drafter.block_size
    assert terms.acc_by_pos.shape == (CFG.drafter.block_size,)


def test_training_reduces_loss():
    target = _target()
    tr = Trainer(CFG, target, DSparkDrafter(drafter_config(CFG, target), nnx.Rngs(0)))
    data = _data()
    it = batches(data, CFG.batch_size, seed=0)
    first = None
    for s in range(30):
        terms, _ = tr.step(next(it), s)
        first = first if first is not None else float(terms.loss)
    assert first is not None and float(terms.loss) < first


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    """Stop after a checkpoint, restart from it: identical parameters to one uninterrupted run."""
    target = _target()
    data = _data()

    def fresh():
        return Trainer(CFG, target, DSparkDrafter(drafter_config(CFG, target), nnx.Rngs(CFG.seed)))

    full = fresh()
    it = batches(data, CFG.batch_size, CFG.seed)
    for s in range(CFG.steps):
        full.step(next(it), s)

    first = fresh()
    mgr = first.checkpoint_manager(tmp_path / "ckpt")
    it = batches(data, CFG.batch_size, CFG.seed)
    for s in range(4):  # "killed" after step 4; last checkpoint at step 3
        first.step(next(it), s)
        if (s + 1) % CFG.ckpt_every == 0:
            first.save(mgr, s + 1)
    second = fresh()
    mgr2 = second.checkpoint_manager(tmp_path / "ckpt")
    start = second.restore_latest(mgr2)
    assert start == 3
    assert "params" in mgr2.item_metadata(3)  # the shape check before a restore reads it (not None)
    it = batches(data, CFG.batch_size, CFG.seed, start_step=start)
    for s in range(start, CFG.steps):
        second.step(next(it), s)
    a, b = _params(full), _params(second)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_wsd_branch_from_the_constant_trunk_equals_one_wsd_run(tmp_path):
    """The learning-curve study's premise (benchmarks/learning_curve.py): a decay_frac=0 trunk checkpointed
    at a budget's decay start and resumed with that budget's decay trains the parameters of one run."""
    target = _target()
    data = _data()
    full_cfg = dataclasses.replace(CFG, lr_schedule="wsd", warmup_steps=2, decay_frac=0.5)  # decay from step 3

    def run(cfg, start, stop, mgr=None):
        tr = Trainer(cfg, target, DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(cfg.seed)))
        if mgr is not None:
            assert tr.restore_latest(mgr) == start
        it = batches(data, cfg.batch_size, cfg.seed, start_step=start)
        for s in range(start, stop):
            before = _params(tr) if s == 0 else None
            tr.step(next(it), s)
            if before is not None:  # lr(0) = 0: the Trainer applies the wsd factor (AdamW itself is at the peak)
                jax.tree.map(np.testing.assert_array_equal, before, _params(tr))
        return tr

    full = run(full_cfg, 0, 6)
    trunk = run(dataclasses.replace(full_cfg, steps=3, decay_frac=0.0), 0, 3)
    mgr = trunk.checkpoint_manager(tmp_path / "ckpt")
    trunk.save(mgr, 3)
    branch = run(full_cfg, 3, 6, mgr)
    jax.tree.map(np.testing.assert_array_equal, _params(full), _params(branch))


def test_export_round_trip(tmp_path):
    _target()
    cfg = DrafterConfig.for_target(TCFG, block_size=4, num_layers=1, markov_rank=8, target_fingerprint="tinyfp")
    d = DSparkDrafter(cfg, nnx.Rngs(3))
    path = export_drafter(d, tmp_path / "export", calibration=[1.0] * 4, extra={"note": "x"})
    d2, meta = load_drafter(path)
    assert d2.cfg == cfg and meta["calibration"] == [1.0] * 4 and meta["extra"]["note"] == "x"
    jax.tree.map(
        np.testing.assert_array_equal,
        nnx.to_pure_dict(nnx.state(d, nnx.Param)),
        nnx.to_pure_dict(nnx.state(d2, nnx.Param)),
    )


def test_draft_vocabulary_tv_and_export(tmp_path):
    """The trainer's draft-space TV (target mass off the draft vocabulary counted in full) equals
    1 - acceptance computed in target space with q exactly 0 off it; the ids and the width
    survive the export; a drafter without its ids is refused."""
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.training.calibration import block_terms
    from dspark_jax.training.data import draft_vocabulary
    from dspark_jax.training.losses import loss_sums

    target = _target()
    cfg = CFG.with_keys(draft_vocab_size=16, drafter_width=48)
    dcfg = drafter_config(cfg, target)
    assert dcfg.draft_vocab_size == 16 and dcfg.model_width == 48 and dcfg.head_dim == 12
    d = DSparkDrafter(dcfg, nnx.Rngs(0))
    data = _data()
    ids = draft_vocabulary(data, 16, TCFG.vocab_size)
    d.set_draft_vocab(ids)
    rng = np.random.default_rng(0)
    assert d.markov_w2 is not None
    d.markov_w2[...] = jnp.asarray(rng.normal(size=d.markov_w2.shape), jnp.float32)
    toks, lens = jnp.asarray(data["tokens"][:4]), jnp.asarray(data["lengths"][:4])
    anchors = jnp.asarray(rng.integers(3, 15, (4, 3)), jnp.int32)
    sums = jax.jit(lambda a: loss_sums(d, target, toks, lens, a, cfg))(anchors)
    bt = jax.jit(lambda a: block_terms(d, target, toks, lens, a, temperature=1.0))(anchors)
    np.testing.assert_allclose(
        np.asarray(sums["acc_num"]),
        np.sum(np.asarray(bt.accept) * np.asarray(bt.valid), axis=(0, 1)),
        rtol=1e-5,
        atol=1e-6,
    )
    path = export_drafter(d, tmp_path / "export")
    d2, _ = load_drafter(path)
    assert d2.draft_vocab == tuple(int(i) for i in ids) and d2.cfg == dcfg
    meta = (path / "drafter.json").read_text().replace('"draft_vocab": [', '"draft_vocab": [99999, ')
    (path / "drafter.json").write_text(meta)
    with pytest.raises(DSparkInputError, match="draft vocabulary"):
        load_drafter(path)
    with pytest.raises(ValueError, match="no draft vocabulary installed"):
        DSparkDrafter(dcfg, nnx.Rngs(0)).draft_vocab_ids()


def test_corrupt_export_is_refused(tmp_path):
    from dspark_jax.errors import DSparkInputError

    d = DSparkDrafter(DrafterConfig.for_target(TCFG, block_size=4, num_layers=1, markov_rank=8), nnx.Rngs(3))
    path = export_drafter(d, tmp_path / "export")
    other = DSparkDrafter(DrafterConfig.for_target(TCFG, block_size=4, num_layers=2, markov_rank=8), nnx.Rngs(3))
    export_drafter(other, tmp_path / "other")
    # config says 1 layer, params hold 2: a mismatched checkpoint
    (tmp_path / "other" / "drafter.json").write_text((path / "drafter.json").read_text())
    with pytest.raises(DSparkInputError):
        load_drafter(tmp_path / "other")
    with pytest.raises(DSparkInputError, match="not a drafter export"):
        load_drafter(tmp_path)


def test_overrides_parse_types_and_reject_unknown_keys():
    cfg = apply_overrides(CFG, ["steps=12", "taps=1,2", "learning_rate=3e-4", "variant=dflash"])
    assert (
        cfg.steps == 12 and cfg.drafter.taps == (1, 2) and cfg.learning_rate == 3e-4 and cfg.drafter.variant == "dflash"
    )
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(CFG, ["stepz=1"])
    with pytest.raises(ValueError):
        apply_overrides(CFG, ["steps=abc"])
    assert dataclasses.replace(CFG) == CFG


# ----------------------------------------------------------------------------- accumulation, precision, remat

STEP_CFG = dataclasses.replace(CFG, batch_size=8)


def _two_steps(cfg, target=None):
    """(trainer, losses) after two steps on fixed batches of 8 sequences."""
    target = target or _target()
    tr = Trainer(cfg, target, DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(cfg.seed)))
    it = batches(_data(), cfg.batch_size, cfg.seed)
    losses = [float(tr.step(next(it), s)[0].loss) for s in range(2)]
    return tr, losses


def _step_jaxpr(tr) -> str:
    args = (tr.params, tr.opt_state, tr.t_state, *tr.shard_batch(_data(n=8)), np.int32(0))
    return str(jax.make_jaxpr(tr._step)(*args))


def _assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), _params(a), _params(b))


@pytest.fixture(scope="module")
def big_batch_run():
    return _two_steps(STEP_CFG)


def test_gradient_accumulation_equals_the_big_batch_step(big_batch_run):
    """4 micro-batches of 2 (numerators and denominators summed) == one batch of 8."""
    base, base_losses = big_batch_run
    acc, acc_losses = _two_steps(dataclasses.replace(STEP_CFG, grad_accum_steps=4))
    _assert_params_close(base, acc)
    assert acc_losses == pytest.approx(base_losses, rel=1e-5)
    assert "scan" in _step_jaxpr(acc)
    with pytest.raises(ValueError, match="not divisible"):
        acc.step(_data(n=6), 0)


def test_remat_gives_the_same_step(big_batch_run):
    base, base_losses = big_batch_run
    rem, rem_losses = _two_steps(dataclasses.replace(STEP_CFG, remat=True))
    assert "remat" in _step_jaxpr(rem) and "remat" not in _step_jaxpr(base)
    _assert_params_close(base, rem)
    assert rem_losses == pytest.approx(base_losses, rel=1e-6)


def test_bfloat16_compute_keeps_float32_master_weights(big_batch_run):
    """dtype=bfloat16: bf16 target weights and forward pass, float32 params and optimizer state."""
    base, base_losses = big_batch_run
    cfg = dataclasses.replace(STEP_CFG, dtype="bfloat16")
    target = Target(TCFG, random_params(TCFG, seed=1, scale=0.2), dtype=jnp.bfloat16, fingerprint="tinyfp")
    tr, losses = _two_steps(cfg, target)
    assert {x.dtype for x in jax.tree.leaves(tr.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(tr.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.float32)
    }
    assert jnp.dtype(tr.drafter().dtype) == jnp.float32
    jaxpr = _step_jaxpr(tr)
    assert "bf16" in jaxpr and "dot_general" in jaxpr
    assert np.all(np.isfinite(losses)) and losses == pytest.approx(base_losses, rel=2e-2)
    _assert_params_close(base, tr, rtol=0, atol=5e-2)  # same trajectory up to bf16 rounding (lr 1e-2)


def test_damaged_or_partial_latest_checkpoint_does_not_break_restart(tmp_path):
    """A save interrupted by a kill leaves only an Orbax temporary directory (ignored, cleaned);
    a damaged newest step is reported and skipped; a checkpoint of another config is refused."""
    import shutil

    from dspark_jax.errors import DSparkInputError

    target = _target()
    data = _data()

    def fresh(cfg=CFG):
        return Trainer(cfg, target, DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(cfg.seed)))

    tr = fresh()
    mgr = tr.checkpoint_manager(tmp_path / "ckpt")
    it = batches(data, CFG.batch_size, CFG.seed)
    for s in range(2):
        tr.step(next(it), s)
        tr.save(mgr, s + 1)
        if s == 0:
            after_one = _params(tr)
    ck = tmp_path / "ckpt"
    # a kill in the middle of saving step 3: only the temporary directory exists
    shutil.copytree(ck / "2", ck / "3.orbax-checkpoint-tmp-1700000000000")
    for f in (ck / "3.orbax-checkpoint-tmp-1700000000000" / "default").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")
    # step 2 damaged on disk (its array data truncated)
    for f in (ck / "2" / "default").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:5])
    tr2 = fresh()
    mgr2 = tr2.checkpoint_manager(ck)
    assert tr2.restore_latest(mgr2) == 1
    jax.tree.map(np.testing.assert_array_equal, after_one, _params(tr2))
    assert mgr2.all_steps() == [1]
    tr2.step(next(batches(data, CFG.batch_size, CFG.seed, start_step=1)), 1)
    tr2.save(mgr2, 2)  # the damaged step's number is free again
    mgr2.wait_until_finished()
    assert sorted(p.name for p in ck.iterdir()) == ["1", "2"]  # the temporary directory was cleaned up
    other = fresh(CFG.with_keys(num_layers=2))
    with pytest.raises(DSparkInputError, match="no checkpoint"):
        other.restore_latest(other.checkpoint_manager(ck))
    assert mgr2.all_steps() == [1, 2]  # nothing deleted for a mismatched config
