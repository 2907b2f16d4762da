"""Worker for tests/integration/test_data_parallel.py: run as a script with 8 forced CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.dp_worker

(The pytest process has already initialised JAX with one device, hence the
subprocess.) Prints one JSON object with the measurements; the test asserts on it.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.training.losses import drafter_loss, finalize_loss, loss_sums, sample_anchors
from dspark_jax.training.train_config import drafter_config
from dspark_jax.training.trainer import Trainer
from tests.helpers.tiny import TINY_TARGET, tiny_target, tiny_train_config

N_DEV = 8
STEPS = 2


def global_batch(n=16, length=40, seed=0):
    """Rows of very different lengths per device: a mean of per-device means would be wrong."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, TINY_TARGET.vocab_size, (n, length)).astype(np.int32)
    lens = np.where(np.arange(n) < n // 2, rng.integers(8, 12, n), length).astype(np.int32)
    return {"tokens": toks, "lengths": lens, "prompt_lengths": np.full(n, 4, np.int32)}


def batches(step):
    return global_batch(seed=step)


def train(cfg, target, mesh, steps=STEPS):
    tr = Trainer(cfg, target, DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(cfg.seed)), mesh=mesh)
    losses = []
    for s in range(steps):
        terms, _ = tr.step(batches(s), s)
        losses.append(float(terms.loss))
    return tr, losses


def params_of(tr):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))


def max_diffs(a, b):
    """max |a - b| over all leaves."""
    absd = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    return max(absd)


def main():
    assert jax.device_count() == N_DEV, jax.devices()
    out = {"devices": jax.device_count()}
    cfg = tiny_train_config(
        steps=6, batch_size=16, anchors_per_seq=4, learning_rate=1e-2, ckpt_every=3, keep_checkpoints=2
    )
    target = tiny_target()
    one = Mesh(np.array(jax.devices()[:1]), ("data",))
    eight = Mesh(np.array(jax.devices()), ("data",))

    t0 = time.perf_counter()
    tr1, loss1 = train(cfg, target, one)
    tr8, loss8 = train(cfg, target, eight)
    p1, p8 = params_of(tr1), params_of(tr8)
    out["max_abs_param_diff_8_vs_1"] = max_diffs(p1, p8)
    out["losses_1"], out["losses_8"] = loss1, loss8
    try:
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), p1, p8)
        out["params_allclose"] = True
    except AssertionError as e:
        out["params_allclose"] = False
        out["params_error"] = str(e)[:2000]

    # The inputs really are split over 8 devices, 2 rows each; parameters replicated.
    b = batches(0)
    toks, lens, plens = tr8.shard_batch(b)
    shards = toks.addressable_shards
    out["input_spec"] = str(toks.sharding.spec)
    out["input_num_devices"] = len(toks.sharding.device_set)
    out["input_shard_shapes"] = sorted({tuple(s.data.shape) for s in shards})
    out["input_shards_match_rows"] = all(np.array_equal(np.asarray(s.data), b["tokens"][s.index]) for s in shards)
    leaf = jax.tree.leaves(tr8.params)[0]
    out["param_fully_replicated"] = bool(leaf.sharding.is_fully_replicated) and len(leaf.sharding.device_set) == N_DEV
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 0)
    hlo = tr8._step.lower(tr8.params, tr8.opt_state, tr8.t_state, toks, lens, plens, np.int32(0)).compile().as_text()
    out["hlo_has_all_reduce"] = "all-reduce" in hlo

    # The multi-process code path (each process feeds its own rows with
    # make_array_from_process_local_data; replicated state via make_array_from_callback),
    # exercised here by pretending there are two processes: same global arrays.
    from dspark_jax.training import trainer as trainer_mod

    real_count = jax.process_count
    jax.process_count = lambda *a, **k: 2
    try:
        out["local_rows"] = [tr8.local_rows(16).start, tr8.local_rows(16).stop]
        mp = tr8.shard_batch(b)
        rep = trainer_mod.replicate(params_of(tr8), jax.tree.leaves(tr8.params)[0].sharding)
    finally:
        jax.process_count = real_count
    out["multiprocess_path_same_arrays"] = all(
        x.sharding == y.sharding and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(mp, (toks, lens, plens))
    )
    out["multiprocess_replicate_ok"] = (
        all(l.sharding.is_fully_replicated and len(l.sharding.device_set) == N_DEV for l in jax.tree.leaves(rep))
        and max_diffs(jax.tree.map(np.asarray, rep), params_of(tr8)) == 0.0
    )

    # Loss normalisation is global: the 8-way step's first loss equals the single-device
    # weighted mean over the whole global batch, not the mean of per-device means.
    d0 = DSparkDrafter(drafter_config(cfg, target), nnx.Rngs(cfg.seed))
    args = [jnp.asarray(b[k]) for k in ("tokens", "lengths", "prompt_lengths")]
    global_loss = float(jax.jit(lambda t, l, pl, k: drafter_loss(d0, target, t, l, pl, k, cfg).loss)(*args, key))
    anchors = sample_anchors(key, args[1], args[2], cfg.anchors_per_seq)
    per = b["tokens"].shape[0] // N_DEV
    shard_loss = jax.jit(lambda t, l, a: finalize_loss(loss_sums(d0, target, t, l, a, cfg)).loss)
    per_device = [
        float(shard_loss(args[0][i : i + per], args[1][i : i + per], anchors[i : i + per]))
        for i in range(0, b["tokens"].shape[0], per)
    ]
    out["loss_global_single_device"] = global_loss
    out["loss_mean_of_device_means"] = float(np.mean(per_device))

    # Gradient accumulation over 8 devices (2 micro-batches of 8 rows, 1 row per device)
    # equals the single-device big-batch step.
    acc = dataclasses.replace(cfg, grad_accum_steps=2)
    tra, loss_a = train(acc, target, eight)
    out["max_abs_param_diff_8dev_accum2_vs_1"] = max_diffs(p1, params_of(tra))
    out["losses_8_accum2"] = loss_a
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
