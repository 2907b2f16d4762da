"""Worker for tests/integration/test_mesh.py: every (data, model) mesh check, run with 8 forced CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.mesh_worker

(The pytest process has already initialised JAX with one device, hence the subprocess; one
process runs every check so the programs compile once.) Prints one JSON object; the test
asserts on it. docs/design.md#device-mesh.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.dspark import DSparkDrafter
from dspark_jax.models import sharding as shd
from dspark_jax.models.target import Target, random_params
from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams
from dspark_jax.training.dry_run import estimate_memory
from dspark_jax.training.train_config import TrainConfig, drafter_config
from dspark_jax.training.trainer import Trainer, count_params

N_DEV = 8
# Every sharded dimension divisible by 8: heads, KV heads, MLP, vocabulary.
TCFG = TargetConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    max_position=256,
    name="tiny-mesh",
    eos_ids=(),
)
CFG = TrainConfig.from_keys(
    steps=6,
    batch_size=16,
    anchors_per_seq=8,
    block_size=4,
    num_layers=1,
    markov_rank=16,
    learning_rate=1e-2,
    seq_len=48,
)
# Data-parallel only (data:8) is tests/integration/test_data_parallel.py's (tests/helpers/dp_worker.py).
MESHES = {"1x8": "data:1,model:8", "2x4": "data:2,model:4"}
STEPS = 2


def batch(step, n=16, length=48):
    rng = np.random.default_rng(step)
    toks = rng.integers(3, TCFG.vocab_size, (n, length)).astype(np.int32)
    lens = np.where(np.arange(n) < n // 2, rng.integers(12, 20, n), length).astype(np.int32)
    return {"tokens": toks, "lengths": lens, "prompt_lengths": np.full(n, 4, np.int32)}


def pure(tree):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree))


def max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def per_device_fraction(tree):
    """(bytes on device 0) / (total bytes) over the array leaves of ``tree``."""
    leaves = jax.tree.leaves(tree)
    on0 = sum(next(s.data.nbytes for s in x.addressable_shards if s.device == jax.devices()[0]) for x in leaves)
    return on0 / sum(x.nbytes for x in leaves)


def collectives(hlo: str) -> list[str]:
    return sorted(
        c for c in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute") if c in hlo
    )


def train_checks(out, target):
    def trainer(mesh):
        return Trainer(CFG, target, DSparkDrafter(drafter_config(CFG, target), nnx.Rngs(CFG.seed)), mesh=mesh)

    def run(tr):
        """STEPS steps through the trainer's jitted step, compiled once here (the same program
        Trainer.step runs) so that its HLO and memory analysis need no second compile."""
        toks, lens, plens = tr.shard_batch(batch(0))
        compiled = tr._step.lower(tr.params, tr.opt_state, tr.t_state, toks, lens, plens, np.int32(0)).compile()
        losses = []
        for s in range(STEPS):
            toks, lens, plens = tr.shard_batch(batch(s))
            tr.params, tr.opt_state, terms, _ = compiled(
                tr.params, tr.opt_state, tr.t_state, toks, lens, plens, np.int32(s)
            )
            losses.append(float(terms.loss))
        return losses, compiled

    one = trainer(shd.make_mesh("", jax.devices()[:1]))
    out["train_losses_1dev"], _ = run(one)
    p1 = pure(one.params)
    out["train"] = {}
    for name, spec in MESHES.items():
        tr = trainer(shd.make_mesh(spec))
        t0 = time.perf_counter()
        losses, compiled = run(tr)
        r = {
            "losses": losses,
            "seconds": round(time.perf_counter() - t0, 1),
            "max_abs_param_diff_vs_1dev": max_diff(p1, pure(tr.params)),
            "mesh": shd.describe(tr.mesh),
        }
        try:
            jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5), p1, pure(tr.params))
            r["params_allclose"] = True
        except AssertionError as e:
            r["params_allclose"], r["params_error"] = False, str(e)[:1500]
        r["drafter_param_fraction_dev0"] = per_device_fraction(tr.params)
        r["target_param_fraction_dev0"] = per_device_fraction(tr.t_state)
        r["opt_state_fraction_dev0"] = per_device_fraction(tr.opt_state)
        r["wq_spec"] = str(tr.params["layers"]["wq"].sharding.spec)
        r["opt_mu_wq_spec"] = str(tr.opt_state[1][0].mu["layers"]["wq"].sharding.spec)
        toks, lens, plens = tr.shard_batch(batch(0))
        r["batch_spec"] = str(toks.sharding.spec)
        r["collectives"] = collectives(compiled.as_text())
        ma = compiled.memory_analysis()
        r["memory_analysis_bytes"] = {
            k: int(getattr(ma, k))
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
        }
        out["train"][name] = r
        if name == "2x4":
            checkpoint_checks(out, target, tr, trainer)
            memory_checks(out, target, tr, ma)
    # fsdp: layout only (no step compiled, to keep the suite short): the hidden dimension of the
    # weights and of their optimizer state over `fsdp` as well.
    tr = trainer(shd.make_mesh("fsdp:2,model:4"))
    out["train"]["fsdp2x4_layout"] = {
        "wq_spec": str(tr.params["layers"]["wq"].sharding.spec),
        "opt_mu_wq_spec": str(tr.opt_state[1][0].mu["layers"]["wq"].sharding.spec),
        "opt_state_fraction_dev0": per_device_fraction(tr.opt_state),
        "batch_spec": str(tr.shard_batch(batch(0))[0].sharding.spec),
    }


def checkpoint_checks(out, target, tr, trainer):
    """Saved under the 2x4 mesh; restored on 1 device and on a 4-device model:4 mesh."""
    ref = pure(tr.params)
    ref_opt = jax.tree.map(np.asarray, tr.opt_state)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        tr.save(tr.checkpoint_manager(Path(d)), 2)
        for name, mesh in (
            ("1dev", shd.make_mesh("", jax.devices()[:1])),
            ("model4", shd.make_mesh("model:4", jax.devices()[:4])),
        ):
            t2 = trainer(mesh)
            step = t2.restore_latest(t2.checkpoint_manager(Path(d)))
            leaf = t2.params["layers"]["wq"]
            res[name] = {
                "step": step,
                "max_abs_param_diff": max_diff(ref, pure(t2.params)),
                "max_abs_opt_diff": max_diff(ref_opt, jax.tree.map(np.asarray, t2.opt_state)),
                "wq_spec": str(leaf.sharding.spec),
                "wq_devices": len(leaf.sharding.device_set),
            }
    out["checkpoint"] = res


def memory_checks(out, target, tr, ma):
    """Dry-run estimate (train.estimate_memory) against XLA's memory analysis of the same sharded step."""
    dcfg = tr.drafter().cfg
    n_t = count_params(tr.t_state)
    n_d = count_params(tr.params)
    est = estimate_memory(CFG, TCFG, dcfg, n_t, n_d, N_DEV, mesh={"data": 2, "model": 4})
    actual = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    out["memory"] = {
        "estimate_bytes": est["total_bytes"],
        "memory_analysis_bytes": int(actual),
        "ratio": est["total_bytes"] / actual,
        "breakdown_gib": est,
    }


def engine_checks(out, target, drafter, params):
    prompts = [[5, 17, 33, 2, 9, 41], [7, 7, 100, 3], [11, 250, 4, 4, 4, 4, 60, 1, 2]]
    settings = [
        dict(temperature=0.0, max_new_tokens=20, seed=0),
        dict(temperature=1.0, max_new_tokens=18, seed=3),
        dict(temperature=1.0, top_k=20, max_new_tokens=16, seed=7),
    ]
    reqs = [Request(p, SamplingParams(**s), f"r{i}") for i, (p, s) in enumerate(zip(prompts, settings))]

    def drive(eng):
        pending, toks, acc = list(reqs), {}, 0
        while pending or eng.active_slots():
            free = eng.free_slots()
            if pending and free:
                eng.insert(eng.prefill(pending.pop(0)), free[-1])
            for o in eng.generate():
                toks.setdefault(o.request_id, []).extend(o.token_ids)
                acc += o.num_accepted
        return toks, acc

    cfg = EngineConfig(
        num_slots=2,
        cache_len=48,
        policy="fixed:2",
        buckets=(6,),
        prefill_buckets=(16,),
        suspend_after=None,
        row_buckets=(2,),
        prefill_chunk_tokens=0,
    )
    res = {}
    base = Engine(target, drafter, cfg)
    base.warmup()
    ref, ref_acc = drive(base)
    res["accepted_1dev"] = ref_acc
    res["tokens_1dev"] = ref
    for spec, devs in (("model:8", jax.devices()),):
        mesh = shd.make_mesh(spec, devs)
        # The target's weights go from the host straight to their shards (Target(mesh=...)).
        sharded_target = Target(TCFG, params, fingerprint="tinymeshfp", mesh=mesh)
        res["target_built_sharded_spec"] = str(sharded_target.layers["wq"][...].sharding.spec)
        eng = Engine(sharded_target, drafter, cfg, mesh=mesh)
        t0 = time.perf_counter()
        eng.warmup()
        compiles = eng.metrics()["compiles"]
        toks, acc = drive(eng)
        r = {
            "same_tokens": toks == ref,
            "accepted": acc,
            "warmup_seconds": round(time.perf_counter() - t0, 1),
            "recompiles_after_warmup": eng.metrics()["compiles"] - compiles,
            "cache_spec": str(eng.device.state.tk.sharding.spec),
            "drafter_cache_spec": str(eng.device.state.dk.sharding.spec),
            "target_param_fraction_dev0": per_device_fraction(eng.device.t_state),
            "drafter_param_fraction_dev0": per_device_fraction(eng.device.d_state),
        }
        if not r["same_tokens"]:
            r["tokens"] = toks
        exe = eng.device.step_exe(2, 6)
        r["step_collectives"] = collectives(exe.as_text())
        res[spec] = r
    try:
        Engine(target, drafter, cfg, mesh="data:2,model:4")
        res["data_axis_error"] = None
    except Exception as e:
        res["data_axis_error"] = f"{type(e).__name__}: {e}"
    out["engine"] = res


def main():
    assert jax.device_count() == N_DEV, jax.devices()
    t_start = time.perf_counter()
    out = {"devices": jax.device_count()}
    params = random_params(TCFG, seed=1, scale=0.2)
    target = Target(TCFG, params, fingerprint="tinymeshfp")
    try:
        shd.make_mesh("data:3,model:4")
        out["bad_mesh_error"] = None
    except ValueError as e:
        out["bad_mesh_error"] = str(e)
    t0, c0 = time.perf_counter(), time.process_time()
    train_checks(out, target)
    out["train_seconds"] = round(time.perf_counter() - t0, 1)
    out["train_cpu_seconds"] = round(time.process_time() - c0, 1)

    # Serving: a drafter whose Markov head holds the target's bigram logits, so drafts get accepted;
    # 2 KV heads, fewer than model:8's devices (its context cache: each head on 4 devices).
    v = TCFG.vocab_size
    dcfg = DrafterConfig.for_target(
        TCFG, block_size=2, num_layers=1, markov_rank=v, num_kv_heads=2, target_fingerprint="tinymeshfp"
    )
    d = DSparkDrafter(dcfg, nnx.Rngs(0))
    x = np.stack([np.full(v, 1), np.arange(v)], axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(2, dtype=np.int32), x.shape)
    d.markov_w1[...] = jnp.eye(v, dtype=jnp.float32)
    d.markov_w2[...] = jnp.asarray(np.asarray(target(jnp.asarray(x), jnp.asarray(pos)).logits[:, -1]))
    d.final_norm[...] = d.final_norm[...] * 0.1
    t0, c0 = time.perf_counter(), time.process_time()
    engine_checks(out, target, d, params)
    out["engine_seconds"] = round(time.perf_counter() - t0, 1)
    out["engine_cpu_seconds"] = round(time.process_time() - c0, 1)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
