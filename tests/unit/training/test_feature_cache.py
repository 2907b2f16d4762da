"""Target-feature cache: cached training equals uncached (also from the cached logsumexp on a draft
vocabulary), mismatched caches are refused or extended, old formats rebuilt."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.drafters.build import build_drafter
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.errors import DSparkInputError
from dspark_jax.models.target import Target
from dspark_jax.training.data import batches
from dspark_jax.training.feature_cache import (
    LSE_FILE,
    MANIFEST,
    build_feature_cache,
    ensure_feature_cache,
    open_feature_cache,
)
from dspark_jax.training.losses import loss_sums, sample_anchors, target_draft_probs
from dspark_jax.training.train_config import TrainConfig, drafter_config
from dspark_jax.training.trainer import Trainer
from tests.helpers.tiny import TINY_TARGET, tiny_data, tiny_target, tiny_train_config

TCFG = TINY_TARGET
CFG = tiny_train_config(steps=4, batch_size=4, anchors_per_seq=4, learning_rate=1e-2, ckpt_every=100)


def _data(n=12, length=24, seed=0):
    return tiny_data(n, length, seed, prompt_len=3)


def _cfg(variant):
    return CFG.with_keys(variant=variant)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A float32 cache over the union of the DSpark (default) and Eagle3 taps of the tiny target."""
    target, data = tiny_target(), _data()
    taps = sorted({t for v in ("dspark", "eagle3") for t in drafter_config(_cfg(v), target).taps})
    d = tmp_path_factory.mktemp("fc") / "cache"
    return target, data, build_feature_cache(d, target, data, taps, batch_size=5, progress=False)


def _loss_and_grads(drafter, target, batch, cfg, cached):
    graph, params = nnx.split(drafter, nnx.Param)
    anchors = sample_anchors(
        jax.random.PRNGKey(3), jnp.asarray(batch["lengths"]), jnp.asarray(batch["prompt_lengths"]), cfg.anchors_per_seq
    )

    def f(p):
        s = loss_sums(
            nnx.merge(graph, p),
            target,
            jnp.asarray(batch["tokens"]),
            jnp.asarray(batch["lengths"]),
            anchors,
            cfg,
            cached=cached,
        )
        return s["objective"] / s["w"], s

    (loss, sums), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return loss, sums, grads


@pytest.mark.parametrize("variant", ["dspark", "eagle3"])
def test_cached_loss_and_gradients_equal_uncached(built, variant):
    target, data, fc = built
    cfg = _cfg(variant)
    dcfg = drafter_config(cfg, target)
    drafter = build_drafter(dcfg, nnx.Rngs(0))
    rows = np.array([7, 2, 9, 4])
    batch = {k: v[rows] for k, v in {**data, **fc.batch_arrays(dcfg.taps)}.items()}
    out = target(jnp.asarray(batch["tokens"]), jnp.broadcast_to(jnp.arange(24), (4, 24)), taps=dcfg.taps)
    np.testing.assert_allclose(batch["tap_features"], np.asarray(out.features), rtol=1e-5, atol=1e-5)  # same rows
    l0, s0, g0 = _loss_and_grads(drafter, target, batch, cfg, None)
    l1, s1, g1 = _loss_and_grads(
        drafter, target, batch, cfg, (jnp.asarray(batch["tap_features"]), jnp.asarray(batch["last_hidden"]))
    )
    assert np.isfinite(float(l0)) and float(l0) > 0
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for k in ("tv", "ce", "bce", "tau_num"):
        np.testing.assert_allclose(float(s1[k]), float(s0[k]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        # float32 round-off scales with the leaf's largest entry (the two losses sum in different
        # orders: the cached logsumexp was computed by another program), not with each entry
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g0)) > 1e-4  # gradients are not trivially 0


def test_trainer_steps_with_cache_and_micro_batches_match_uncached(built):
    """Cached rows ride through ``data.batches``, ``shard_batch`` and the micro-batch split like the tokens."""
    target, data, fc = built
    # lr 1e-3: Adam normalises each gradient, so a parameter with a near-zero gradient turns the
    # ~1e-7 relative difference of the two logit matmuls into an update difference of order lr.
    cfg = dataclasses.replace(CFG, grad_accum_steps=2, learning_rate=1e-3)
    dcfg = drafter_config(cfg, target)
    params, losses = [], []
    for d in (data, {**data, **fc.batch_arrays(dcfg.taps)}):
        tr = Trainer(cfg, target, build_drafter(dcfg, nnx.Rngs(0)))
        it = batches(d, cfg.batch_size, cfg.seed, start_step=2)  # an epoch-shuffled batch, not rows 0..3
        losses.append([float(tr.step(next(it), step)[0].loss) for step in range(2)])
        params.append(jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params[1]), jax.tree.leaves(params[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    assert len(tr.shard_batch(next(it))) == 6  # tokens, lengths, prompt lengths, features, hidden, logsumexp


def test_draft_vocab_loss_from_cached_lse_equals_full_vocab(built):
    """With a draft vocabulary the loss reads the target's logits of its ids and the cached logsumexp
    only (never the [.., V] logits) and equals the full-vocabulary loss (the reference: the same cache
    without the logsumexp, which equals no cache at all by the test above), gradients too, labels and
    previous tokens outside the draft vocabulary included."""
    target, data, fc = built
    n, v, h = 16, TCFG.vocab_size, TCFG.hidden_size
    cfg = _cfg("dspark").with_keys(draft_vocab_size=n, drafter_intermediate_size=48)
    dcfg = drafter_config(cfg, target)
    drafter = DSparkDrafter(dcfg, nnx.Rngs(0))
    drafter.set_draft_vocab(range(3, 3 + 4 * n, 4))  # every 4th id: most labels lie outside
    assert drafter.markov_w2 is not None and drafter.conf_w is not None
    rng = np.random.default_rng(1)  # non-trivial Markov and confidence heads
    drafter.markov_w2[...] = jnp.asarray(rng.normal(size=drafter.markov_w2.shape), jnp.float32)
    drafter.conf_w[...] = jnp.asarray(rng.normal(size=drafter.conf_w.shape) * 0.3, jnp.float32)
    rows = np.array([7, 2, 9, 4])
    batch = {k: v_[rows] for k, v_ in {**data, **fc.batch_arrays(dcfg.taps)}.items()}
    out = target(jnp.asarray(batch["tokens"]), jnp.broadcast_to(jnp.arange(24), (4, 24)))
    np.testing.assert_allclose(batch["target_lse"], jax.nn.logsumexp(out.logits, -1), rtol=1e-5, atol=1e-5)
    inside = np.isin(batch["tokens"], np.asarray(drafter.draft_vocab_ids()))
    assert 0 < inside.mean() < 0.5
    full = (jnp.asarray(batch["tap_features"]), jnp.asarray(batch["last_hidden"]))
    new = full + (jnp.asarray(batch["target_lse"]),)
    l0, s0, g0 = _loss_and_grads(drafter, target, batch, cfg, full)
    l1, s1, g1 = _loss_and_grads(drafter, target, batch, cfg, new)
    assert np.isfinite(float(l0)) and float(l0) > 0 and 0 < float(s0["tv"]) < float(s0["w"])
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
    for k in ("tv", "ce", "bce", "conf_err", "tau_num"):
        np.testing.assert_allclose(float(s1[k]), float(s0[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s1["acc_num"]), np.asarray(s0["acc_num"]), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        # float32 round-off scales with the leaf's largest entry (the two losses sum in different
        # orders: the cached logsumexp was computed by another program), not with each entry
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g0)) > 1e-4

    def head_shapes(cached):  # operand shapes of the loss's matrix products
        graph, params = nnx.split(drafter, nnx.Param)
        anchors = jnp.zeros((4, cfg.anchors_per_seq), jnp.int32)
        toks, lens = jnp.asarray(batch["tokens"]), jnp.asarray(batch["lengths"])
        f = lambda p: loss_sums(nnx.merge(graph, p), target, toks, lens, anchors, cfg, cached=cached)["objective"]
        jaxpr = jax.make_jaxpr(jax.grad(f))(params)
        eqns = list(jaxpr.eqns)
        while any(e.params.get("jaxpr") is not None for e in eqns):  # into the bodies of jit and scan
            eqns = [i for e in eqns for i in (e.params["jaxpr"].jaxpr.eqns if "jaxpr" in e.params else [e])]
        return {tuple(x.aval.shape) for e in eqns if e.primitive.name == "dot_general" for x in e.invars}

    head = {(h, v), (v, h)}  # the target's head, [H, V] or (tied) the [V, H] embedding: reference only
    assert head & head_shapes(full) and not head & head_shapes(new)
    # Rounding between the cache's program and the step's never puts the draft vocabulary's mass over 1
    # (a confidence label below 0): with a logsumexp too small it is the softmax over the draft vocabulary.
    mass = np.asarray(jnp.sum(target_draft_probs(drafter, target, None, new[1], new[2] - 20.0), -1))
    assert mass.max() <= 1 + 1e-6 and np.mean(mass > 1 - 1e-6) > 0.5


def test_bfloat16_cache_halves_storage_and_stays_close(built, tmp_path):
    target, data, fc32 = built
    fc = build_feature_cache(
        tmp_path / "bf", target, data, fc32.manifest["layers"], store_dtype="bfloat16", progress=False
    )
    assert fc.layers[3].dtype == np.uint16 and fc.layers[3].nbytes * 2 == fc32.layers[3].nbytes
    f16 = fc.batch_arrays((1, 2))["tap_features"][np.arange(3)]
    f32 = fc32.batch_arrays((1, 2))["tap_features"][np.arange(3)]
    np.testing.assert_allclose(f16.astype(np.float32), f32, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(fc.lse, fc32.lse, rtol=1e-2, atol=1e-2)  # from the rounded last hidden state
    with pytest.raises(DSparkInputError, match="store_dtype"):  # a float32 run does not take a bf16 cache
        ensure_feature_cache(tmp_path / "bf", target, data, (1,), store_dtype="float32")


def test_mismatched_cache_is_refused_or_extended(built, tmp_path):
    target, data, fc = built
    d = tmp_path / "c"
    ensure_feature_cache(d, target, data, (1,), progress=False)
    assert json.loads((d / MANIFEST).read_text())["layers"] == [1, 3]  # + the last layer
    with pytest.raises(DSparkInputError, match="layers"):
        open_feature_cache(d, target, data, (0, 1))
    # Taps not covered: rebuilt with the union of the old and the requested layers.
    fc2 = ensure_feature_cache(d, target, data, (0, 1), progress=False)
    assert sorted(fc2.layers) == [0, 1, 3]
    np.testing.assert_allclose(fc2.layers[1], fc.layers[1], rtol=1e-5, atol=1e-5)  # other batch size
    # A format-1 cache (no logsumexp) of this run: refused by open; ensure adds the logsumexp from the
    # stored last layer in place (the layer files stay).
    manifest = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    (d / LSE_FILE).unlink()
    with pytest.raises(DSparkInputError, match="format: cache has 1, run needs 2"):
        open_feature_cache(d, target, data, (0, 1))
    inode = (d / "layer_003.npy").stat().st_ino
    fc3 = ensure_feature_cache(d, target, data, (0, 1), progress=False, batch_size=5)
    assert sorted(fc3.layers) == [0, 1, 3] and fc3.manifest["format"] == 2
    assert (d / "layer_003.npy").stat().st_ino == inode
    np.testing.assert_allclose(fc3.lse, fc.lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(DSparkInputError, match="tokens_sha256"):
        ensure_feature_cache(d, target, _data(seed=5), (1,), progress=False)
    with pytest.raises(DSparkInputError, match="target_fingerprint"):
        ensure_feature_cache(d, tiny_target(seed=2, fingerprint="other"), data, (1,), progress=False)
    with pytest.raises(DSparkInputError, match="not a feature cache"):
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "x.txt").write_text("x")
        ensure_feature_cache(tmp_path / "junk", target, data, (1,), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_killed_build_leaves_no_cache(built, tmp_path, monkeypatch):
    target, data, _ = built
    calls = []
    real_open = np.lib.format.open_memmap

    def open_then_die(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # second layer file: the build dies half way
            raise KeyboardInterrupt
        return real_open(*a, **k)

    monkeypatch.setattr(np.lib.format, "open_memmap", open_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(tmp_path / "c", target, data, (1, 2), progress=False)
    monkeypatch.setattr(np.lib.format, "open_memmap", real_open)
    assert not (tmp_path / "c").exists()
    with pytest.raises(DSparkInputError, match="no feature cache"):
        open_feature_cache(tmp_path / "c", target, data, (1,))
    fc = ensure_feature_cache(tmp_path / "c", target, data, (1, 2), progress=False)  # the next run builds it
    assert sorted(fc.layers) == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # the killed build's temp folder is gone


@pytest.mark.slow
def test_train_run_with_feature_cache_matches_uncached(stories260k, tmp_path):
    from dspark_jax.models.weights import params_fingerprint
    from dspark_jax.training.pipeline import run

    cfg_t, params, tok = stories260k
    target = Target(cfg_t, params, fingerprint=params_fingerprint(params))
    base = TrainConfig.from_keys(
        workdir=str(tmp_path / "plain"),
        num_prompts=16,
        num_eval_prompts=4,
        gen_max_new_tokens=12,
        gen_batch_size=16,
        seq_len=32,
        steps=3,
        batch_size=4,
        anchors_per_seq=4,
        block_size=4,
        num_layers=1,
        markov_rank=8,
        log_every=100,
        ckpt_every=100,
    )
    s0 = run(base, evaluate=False, calibrate=False, target_and_tokenizer=(target, tok))
    cached = dataclasses.replace(
        base,
        workdir=str(tmp_path / "cached"),
        data_dir=str(tmp_path / "plain/data"),
        feature_cache=str(tmp_path / "fc"),
    )
    s1 = run(cached, evaluate=False, calibrate=False, target_and_tokenizer=(target, tok))
    assert (tmp_path / "fc" / MANIFEST).is_file() and s1["steps"] == s0["steps"] == 3
    from dspark_jax.drafters.checkpoint import load_drafter

    d0, _ = load_drafter(s0["export_dir"])
    d1, _ = load_drafter(s1["export_dir"])
    p0, p1 = nnx.state(d0, nnx.Param), nnx.state(d1, nnx.Param)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(
        float(jnp.max(jnp.abs(a - b))) > 0
        for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(nnx.state(build_drafter(d0.cfg, nnx.Rngs(0)), nnx.Param)))
    )
