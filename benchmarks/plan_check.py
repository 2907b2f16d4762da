"""The memory planners checked against the TPU compiler, for a topology that is not here.

    JAX_PLATFORMS=cpu python -m benchmarks.plan_check --topology v5e:2x4 \\
        --config dspark_jax/recipes/qwen3-8b.yaml --json /tmp/plan.json

For a training recipe, the serving plan (:func:`~dspark_jax.training.dry_run.estimate_serving_memory`:
the engine's largest step, ``--num-slots`` rows and the packed-token budget, at ``--cache-len`` on
``model:<chips>``) and the training plan (:func:`~dspark_jax.training.dry_run.estimate_memory`: the
trainer's optimisation step on each ``--train-meshes`` mesh) are set beside the per-device device
memory the TPU compiler assigns the same program (``hbm_gib``: its buffer assignment, see
:func:`compile_with_hbm`; ``ratio`` = planner / that), with ``memory_analysis()``'s arguments +
temporaries + outputs - aliased (``analysis_gib``, which also counts scoped VMEM). Every program is
lowered from abstract values (``nnx.eval_shape`` / ``jax.ShapeDtypeStruct`` with the project's
shardings on the topology's mesh, :mod:`benchmarks.tpu_compile`): no weights are read or allocated. The engine step is
:func:`~dspark_jax.serving.engine.step_programs.step_program` with its state donated, as
:class:`~dspark_jax.serving.engine.device.EngineDevice` compiles it; the training step is the
trainer's own (:func:`~dspark_jax.training.trainer.make_train_step`, parameters and optimizer state
donated). A training step of a 36-layer target takes minutes (about 7 on two busy cores) and ~2.5 GB
of host memory to compile.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.tpu_compile import Builder, sds, topology_devices  # sets JAX_PLATFORMS=cpu
from dspark_jax.models import sharding as shd
from dspark_jax.training.dry_run import estimate_memory, estimate_serving_memory, recipe_configs

GIB = 2.0**30


def peak_bytes(exe) -> int:
    """Per-device ``memory_analysis()`` peak: arguments + temporaries + outputs - aliased (donated).
    On TPU its temporaries include the program's scoped VMEM scratch, which is not HBM."""
    m = exe.memory_analysis()
    assert m is not None, "the compiler gave no memory analysis"
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def compile_with_hbm(lowered) -> tuple[Any, int]:
    """``(executable, per-device HBM bytes)`` of ``lowered``: the HBM total is the sum of the buffer
    assignment's allocations in device memory (parameters, outputs, the temporaries' heap; color 0
    of XLA's memory-usage report), which leaves out the scoped VMEM that ``memory_analysis()``
    counts among the temporaries."""
    with tempfile.TemporaryDirectory() as d:
        exe = lowered.compile(compiler_options={"xla_dump_to": d})
        reports = sorted(Path(d).glob("*memory-usage-report.txt"), key=lambda f: f.stat().st_mtime)
        text = reports[-1].read_text() if reports else ""
    m = re.search(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", text)
    if m is None:
        raise RuntimeError("the compiler wrote no memory-usage report for device memory")
    return exe, int(m.group(1))


def _abstract(module_fn, mesh, cfg):
    """``(graph, state of ShapeDtypeStructs with the project's shardings)`` of ``module_fn()``, abstractly."""
    graph, state = nnx.split(nnx.eval_shape(module_fn))
    shard = shd.tree_shardings(state, mesh, cfg)
    return graph, jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), state, shard)


def engine_step(tcfg, dcfg, mesh, *, num_slots: int, cache_len: int, tokens: int, dtype=jnp.bfloat16):
    """The engine's step of bucket ``(num_slots, tokens)`` compiled for ``mesh`` (coupled verification,
    the engine's default bias-table and logprob sizes)."""
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.serving.engine.device import out_shardings_for
    from dspark_jax.serving.engine.state import DecodeState, init_state, state_shardings
    from dspark_jax.serving.engine.step_programs import StepInputs, StepSpec, step_program

    b = Builder(tcfg, mesh, dtype=dtype)
    d_graph, d_state = _abstract(lambda: build_drafter(dcfg, nnx.Rngs(0), dtype=dtype), mesh, dcfg)
    nb, n_top = 300 + 64, min(20, tcfg.vocab_size)  # Engine's max_logit_bias + max_stop_ids; its n_top

    def init():
        return init_state(nnx.merge(b.graph, b.state), nnx.merge(d_graph, d_state), num_slots, cache_len, nb, False)

    st_shard = state_shardings(DecodeState, mesh, tcfg, dcfg, False)
    st = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), jax.eval_shape(init), st_shard)
    rep = NamedSharding(mesh, P())
    flag = sds((), jnp.bool_, rep)
    inp = StepInputs(sds((num_slots,), jnp.int32, rep), sds((num_slots,), jnp.bool_, rep), flag, flag, flag)
    spec = StepSpec(num_slots, tokens, dcfg.block_size, "coupled", n_top)
    fn = partial(step_program, t_graph=b.graph, d_graph=d_graph, spec=spec)
    out = out_shardings_for(mesh, tcfg, dcfg, False)("step")
    return jax.jit(fn, donate_argnums=(2,), out_shardings=out).lower(b.state, d_state, st, inp)


def train_step(cfg, tcfg, dcfg, mesh):
    """The trainer's optimisation step (:class:`~dspark_jax.training.trainer.Trainer`'s ``_step``) of
    recipe ``cfg`` compiled for ``mesh``, from abstract target, float32 drafter and AdamW state."""
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import target_param_shapes
    from dspark_jax.training.trainer import make_optimizer, make_train_step

    compute = jnp.dtype(cfg.dtype)
    shapes = target_param_shapes(tcfg)

    def target():
        zeros = jax.tree.map(lambda s: jnp.zeros(s, compute), shapes, is_leaf=lambda x: isinstance(x, tuple))
        return Target(tcfg, zeros, dtype=compute, layer_layout="stacked")  # the accelerator's, on any host

    t_graph, t_state = _abstract(target, mesh, tcfg)
    drafter = nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(cfg.seed)))  # float32 master weights
    graph, params = nnx.split(drafter, nnx.Param)
    compute_model = nnx.merge(graph, params)
    compute_model.dtype = compute  # the trainer's compute graph: the static dtype replaced
    c_graph = nnx.split(compute_model, nnx.Param)[0]
    p_shard = shd.tree_shardings(params, mesh, dcfg)
    params = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), params, p_shard)
    tx = make_optimizer(cfg, frozen=dcfg.own_embeddings)  # as the Trainer builds it
    opt = jax.eval_shape(tx.init, params)
    o_shard = shd.tree_shardings(opt, mesh, dcfg)
    opt = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), opt, o_shard)
    batch = shd.batch_sharding(mesh)
    toks = sds((cfg.batch_size, cfg.seq_len), jnp.int32, batch)
    lens = sds((cfg.batch_size,), jnp.int32, batch)
    step = make_train_step(cfg, c_graph, t_graph, tx, mesh, dcfg.block_size)
    repl = NamedSharding(mesh, P())
    jit = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_shard, o_shard, repl, repl))
    return jit.lower(params, opt, t_state, toks, lens, lens, np.int32(0))


def check(args) -> list[dict[str, Any]]:
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.weights import count_target_params
    from dspark_jax.training.recipes import load_config_file
    from dspark_jax.training.trainer import count_params

    cfg = load_config_file(args.config)
    tcfg, dcfg = recipe_configs(cfg)
    devices = topology_devices(args.topology)
    n = len(devices)
    rows: list[dict[str, Any]] = []

    def row(kind, mesh_spec, est, lowered, t0):
        exe, hbm = compile_with_hbm(lowered)
        peak, m = peak_bytes(exe), exe.memory_analysis()
        r = {"topology": args.topology, "plan": kind, "mesh": mesh_spec, "planner_gib": est["total_bytes"] / GIB}
        r.update(hbm_gib=hbm / GIB, ratio=est["total_bytes"] / hbm, analysis_gib=peak / GIB)
        r.update(compile_s=time.perf_counter() - t0)
        r.update(args_gib=m.argument_size_in_bytes / GIB, temp_gib=m.temp_size_in_bytes / GIB)
        r.update(out_gib=m.output_size_in_bytes / GIB, alias_gib=m.alias_size_in_bytes / GIB, planner_parts=est)
        rows.append(r)
        print(
            f"# {kind} {mesh_spec}: planner {r['planner_gib']:.2f} GiB, compiler {hbm / GIB:.2f} GiB", file=sys.stderr
        )

    if "serve" in args.plans:
        spec = f"model:{n}"
        mesh = shd.make_mesh(spec, devices=devices)
        est = estimate_serving_memory(
            tcfg, dcfg, num_slots=args.num_slots, max_len=args.cache_len, dtype=cfg.dtype, devices=n, mesh=spec
        )
        tokens = min(args.max_tokens, args.num_slots * (dcfg.block_size + 1))
        t0 = time.perf_counter()
        lowered = engine_step(tcfg, dcfg, mesh, num_slots=args.num_slots, cache_len=args.cache_len, tokens=tokens)
        row(f"serve {args.num_slots}x{args.cache_len} step({args.num_slots},{tokens})", spec, est, lowered, t0)
    if "train" in args.plans:
        n_t = count_target_params(tcfg)
        n_d = count_params(nnx.state(nnx.eval_shape(lambda: build_drafter(dcfg, nnx.Rngs(0))), nnx.Param))
        for spec in args.train_meshes.split(";"):
            mesh = shd.make_mesh(spec, devices=devices)
            est = estimate_memory(cfg, tcfg, dcfg, n_t, n_d, n, mesh=spec)
            t0 = time.perf_counter()
            lowered = train_step(cfg, tcfg, dcfg, mesh)
            row(f"train b{cfg.batch_size}x{cfg.seq_len}/{cfg.grad_accum_steps}", spec, est, lowered, t0)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--topology", default="v5e:2x4")
    ap.add_argument("--config", default="dspark_jax/recipes/qwen3-8b.yaml", help="training recipe (a YAML or preset)")
    ap.add_argument("--plans", default="serve,train", help="comma list of serve, train")
    ap.add_argument("--num-slots", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=128, help="the engine's largest packed-token budget")
    ap.add_argument("--train-meshes", default="data:2,model:4;model:8", help="';'-separated mesh specs")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = check(a)
    cols = ["plan", "mesh", "planner_gib", "hbm_gib", "ratio", "analysis_gib", "args_gib", "temp_gib", "out_gib"]
    cols += ["alias_gib"]
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
    if a.json:
        cmd = " ".join(["python -m benchmarks.plan_check", *(argv if argv is not None else sys.argv[1:])])
        a.json.write_text(json.dumps({"command": cmd, "jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
