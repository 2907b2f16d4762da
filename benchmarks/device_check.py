"""A prepared accelerator check (issue 24): random-weight Qwen3-8B-shaped models, at most ~5 minutes
on one chip (an H200 GPU or a TPU chip), no downloads, nothing from outside the repository's tree.

With an accelerator, from the repository root::

    python -m benchmarks.device_check --out /tmp/dc

prints one table per section and writes ``/tmp/dc/device_check.json`` after every section (a run
cut short still leaves the sections done). Paste the JSON (and the printed tables) into the issue's
thread, or under "Accelerator check" in ``docs/results.md``. ``--tiny`` is the CPU-sized run the
test suite makes (``tests/integration/test_device_check.py``); ``--sections step,train`` picks
sections; ``--budget-s`` skips the sections that would start after that many seconds.

The models: a Qwen3-8B-shaped :class:`~dspark_jax.models.target.Target` (36 layers, hidden 4096,
32/8 heads of 128, FFN 12288, vocabulary 151936, q/k-norm, untied head) with random weights drawn
on the device (the layout of :func:`~dspark_jax.models.target.random_params`; drawing 8B normals on
the host would take minutes), and a drafter of :meth:`~dspark_jax.config.DrafterConfig.for_target`
built by :func:`~dspark_jax.drafters.build.build_drafter`. stories260K (``$DSPARK_MODELS``) joins
the bfloat16 exactness section when present (not with ``--tiny``). Costs depend on shapes, not on weight values; the
random drafter's acceptance is ~0, so the speculative rows measure step costs, not speed-ups.

Sections (run in this order; the JSON keys; ``step``, ``roofline`` and ``exactness`` live in
:mod:`benchmarks.device_decode`, what the sections share in :mod:`benchmarks.device_setup`):

* ``step``: a batch-1 plain decode step (:meth:`Target.__call__` on a donated
  :class:`~dspark_jax.models.layers.KVCache`, argmax) at cache lengths 1k / 4k / 16k and live
  lengths well below them (the cost should follow the live length, not the cache);
* ``roofline``: those steps and :func:`~dspark_jax.decoding.speculative.generate_autoregressive`
  against the memory-bandwidth roofline: bytes of the weights read per token plus the live KV,
  over the device's peak bandwidth (:data:`benchmarks.device_setup.PEAK_BW_GB_S`, null when the
  device is not listed);
* ``exactness``: bfloat16 greedy :func:`~dspark_jax.decoding.speculative.generate_speculative`:
  the fraction of committed tokens that are the argmax of a one-pass recomputation by the target
  of the final sequence (the contract: argmax of the verifying pass; bfloat16 plain and
  speculative decoding may differ token for token where their shapes differ, reported too);
* ``engine``: :class:`~dspark_jax.serving.engine.Engine` steps at 1..64 rows, plain and
  speculative (``fixed:block_size``): steps/s and tokens/s;
* ``train``: the training step (:class:`~dspark_jax.training.trainer.Trainer`): seconds and MFU
  from analytic FLOPs (:func:`train_flops`; XLA's cost analysis counts a scan body once) against
  :data:`benchmarks.device_setup.PEAK_TFLOPS` (bfloat16 dense);
* ``moe``: a mixture-of-experts target (Qwen3-30B-A3B's layer shape: 128 experts, top 8, expert
  width 768, hidden 2048, 4 layers) against a dense one of the same active size, batch-1 step
  and a ``block_size``-token verification (:func:`benchmarks.moe_cost.time_steps`), and the weight
  bytes one compiled sparse layer reads against its chosen experts' (:func:`benchmarks.moe_cost.layer_bytes`);
* ``compile``: compile seconds of every program above.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# --tiny: CPU-sized timings mean nothing and compiling is most of the run, so XLA compiles fast
# (when JAX is not loaded yet, i.e. from the command line; flags already set, as by the test
# suite, are kept).
if "--tiny" in sys.argv[1:] and "jax" not in sys.modules:
    from benchmarks.engine_hlo import with_fast_compile

    os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.device_decode import section_exactness, section_roofline, section_step
from benchmarks.device_setup import (
    PEAK_TFLOPS,
    Context,
    Plan,
    device_params,
    peak,
    plan,
    qwen3_8b_config,
    random_drafter,
    table,
    tiny_config,
)
from benchmarks.harness import command_line
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.models.target import Target

SECTIONS = ("step", "roofline", "exactness", "engine", "train", "moe", "compile")
# ----------------------------------------------------------------------------- engine


def _engine_point(eng: Any, rows: int, p: Plan, vocab: int) -> dict[str, Any]:
    """``rows`` greedy requests in the engine, 2 warm steps, then ``p.engine_steps`` timed ones with
    the next step queued on the device (``overlap``, the default), then as many without."""
    from dspark_jax.serving.engine import Request, SamplingParams

    rng = np.random.default_rng(rows)
    for i in range(rows):
        ids = [int(t) for t in rng.integers(3, vocab, p.engine_prompt)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=p.engine_cache - p.engine_prompt - 1, seed=i)
        eng.insert(eng.prefill(Request(ids, sp, f"r{i}")), eng.free_slots()[0])
    for _ in range(2):
        eng.generate()
    res: dict[str, Any] = {"policy": eng.policy, "rows": rows}
    for overlap in (True, False):
        eng.overlap = overlap
        times, toks = [], 0
        for _ in range(p.engine_steps):
            t0 = time.perf_counter()
            outs = eng.generate()
            times.append(time.perf_counter() - t0)
            toks += sum(len(o.token_ids) for o in outs)
        total = sum(times)
        if overlap:
            res |= {
                "ms_per_step": 1e3 * statistics.median(times),
                "steps_per_s": len(times) / total,
                "tokens_per_s": toks / total,
                "tokens_per_row_step": toks / len(times) / rows,
            }
        else:
            res["ms_per_step_no_overlap"] = 1e3 * statistics.median(times)
            res["overlap_speedup"] = res["ms_per_step_no_overlap"] / res["ms_per_step"]
    eng.overlap = True
    for s in eng.active_slots():
        eng.free(s)
    eng.sync()
    return res


def section_engine(ctx: Context) -> dict[str, Any]:
    from dspark_jax.serving.engine import Engine, EngineConfig

    p, g = ctx.plan, ctx.plan.block_size
    eng = Engine(
        ctx.target,
        ctx.drafter,
        EngineConfig(
            num_slots=max(p.rows),
            cache_len=p.engine_cache,
            policy=f"fixed:{g}",
            row_buckets=list(p.row_buckets),
            prefill_buckets=[p.engine_prompt],
            suspend_after=None,
            profile_iters=1,
            prefill_chunk_tokens=0,
        ),
    )
    out = []
    for policy in (f"fixed:{g}", "plain"):
        if policy != eng.policy:
            eng.set_policy(policy)
        t0 = time.perf_counter()
        eng.warmup()
        ctx.compile_s[f"engine.warmup[{policy}]"] = time.perf_counter() - t0
        for r in p.rows:
            out.append(_engine_point(eng, r, p, ctx.cfg.vocab_size))
            ctx.partial({"rows": out})
    keys = ["policy", "rows", "ms_per_step", "ms_per_step_no_overlap", "overlap_speedup", "steps_per_s", "tokens_per_s"]
    table(f"engine: cache {p.engine_cache}, prompt {p.engine_prompt}", keys, [[r[k] for k in keys] for r in out])
    return {
        "cache_len": p.engine_cache,
        "block_size": g,
        "row_buckets": list(p.row_buckets),
        "programs_compiled": eng.metrics()["compiles"],
        "rows": out,
    }


# ----------------------------------------------------------------------------- training step


def train_flops(t: TargetConfig, d: DrafterConfig, batch: int, seq: int, anchors: int) -> dict[str, float]:
    """FLOPs of one training step (multiply-adds x 2; matmuls and attention, elementwise work not
    counted). Attention is counted over every key the implementation reads: the target's causal
    pass at full ``[L, L]``, each drafter slot over the whole context plus its block.

    * frozen target forward over ``batch x seq`` tokens (taps and logits at every position);
    * drafter forward: context projection and per-layer context keys/values over every position,
      the backbone over ``batch x anchors x num_slots`` slots, the frozen LM head and the Markov
      head's ``W2`` over the ``block_size`` predicted slots;
    * drafter backward: 2x the forward of its trained matmuls (input and weight gradients), 1x for
      the context projection (its input, the target's features, needs no gradient) and for the
      frozen LM head (input gradient only).
    """
    n_tok = batch * seq
    qd, kd = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    t_layer = 2 * (t.hidden_size * (2 * qd + 2 * kd) + 3 * t.hidden_size * t.intermediate_size) + 4 * qd * seq
    target = n_tok * (t.num_layers * t_layer + 2 * t.hidden_size * t.vocab_size)
    w, slots, pred = d.model_width, batch * anchors * d.num_block_positions, batch * anchors * d.block_size
    dq, dk = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    ctx_fc = n_tok * 2 * len(d.taps) * d.hidden_size * w
    ctx_kv = n_tok * d.num_layers * 2 * w * 2 * dk
    d_layer = 2 * (w * (2 * dq + 2 * dk) + 3 * w * d.intermediate_size) + 4 * dq * (seq + d.num_block_positions)
    adapters = 2 * d.hidden_size * w * (slots + pred) if w != d.hidden_size else 0
    backbone = slots * d.num_layers * d_layer + adapters
    head = pred * 2 * d.hidden_size * d.draft_size
    markov = pred * 2 * d.markov_rank * d.draft_size if d.markov else 0
    fwd = ctx_fc + ctx_kv + backbone + head + markov
    bwd = ctx_fc + 2 * (ctx_kv + backbone + markov) + head
    return {
        "target_forward": float(target),
        "drafter_forward": float(fwd),
        "drafter_backward": float(bwd),
        "total": float(target + fwd + bwd),
    }


def section_train(ctx: Context) -> dict[str, Any]:
    from dspark_jax.training.train_config import TrainConfig
    from dspark_jax.training.trainer import Trainer

    p = ctx.plan
    b, seq, anchors = p.train_shape
    dcfg = ctx.drafter.cfg
    cfg = TrainConfig.from_keys(
        batch_size=b,
        seq_len=seq,
        anchors_per_seq=anchors,
        block_size=dcfg.block_size,
        num_layers=dcfg.num_layers,
        dtype=str(jnp.dtype(ctx.dtype)),
    )
    trainer = Trainer(cfg, ctx.target, ctx.drafter)
    rng = np.random.default_rng(3)
    batch = {
        "tokens": rng.integers(3, ctx.cfg.vocab_size, (b, seq)).astype(np.int32),
        "lengths": np.full(b, seq, np.int32),
        "prompt_lengths": np.full(b, seq // 8, np.int32),
    }
    times = []
    for i in range(p.train_steps + 1):
        t0 = time.perf_counter()
        terms, _ = trainer.step(batch, i)
        loss = float(terms.loss)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    ctx.compile_s["train_step (first step - median)"] = max(times[0] - med, 0.0)
    flops = train_flops(ctx.cfg, dcfg, b, seq, anchors)
    tf = peak(PEAK_TFLOPS, ctx.report["meta"]["device_kind"])
    mfu = None if tf is None else flops["total"] / med / (tf * 1e12)
    res = {
        "batch": b,
        "seq_len": seq,
        "anchors_per_seq": anchors,
        "block_size": dcfg.block_size,
        "dtype": cfg.dtype,
        "step_s": med,
        "loss": loss,
        "flops": flops,
        "tflops_per_s": flops["total"] / med / 1e12,
        "peak_tflops": tf,
        "mfu": mfu,
    }
    table(
        "train: one optimisation step",
        ["batch", "seq", "anchors", "s/step", "TFLOP/step", "TFLOP/s", "MFU"],
        [[b, seq, anchors, med, flops["total"] / 1e12, res["tflops_per_s"], mfu]],
    )
    return res


def section_moe(ctx: Context) -> dict[str, Any]:
    from benchmarks.moe_cost import layer_bytes, time_steps

    base = tiny_config() if ctx.args.tiny else qwen3_8b_config()
    hidden, experts, k, width = (64, 8, 2, 32) if ctx.args.tiny else (2048, 128, 8, 768)
    moe = dataclasses.replace(base, name="moe", hidden_size=hidden, num_layers=4, num_heads=4 if ctx.args.tiny else 32,
                              num_kv_heads=4 if not ctx.args.tiny else 2, head_dim=128 if not ctx.args.tiny else 16,
                              intermediate_size=k * width, num_experts=experts, num_experts_per_tok=k,
                              moe_intermediate_size=width, norm_topk_prob=True)  # fmt: skip
    dense = dataclasses.replace(moe, name="dense", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    targets = {c.name: Target(c, device_params(c, ctx.dtype), dtype=ctx.dtype) for c in (moe, dense)}
    timing = time_steps(targets, ctx.plan.block_size, ctx.plan.caches[0], ctx.plan.reps)
    rows = layer_bytes(targets["moe"], ctx.plan.block_size)
    table("moe: MoE vs dense of the same active size", list(timing[0]), [list(r.values()) for r in timing])
    table("moe: weight bytes one sparse layer reads", list(rows[0]), [list(r.values()) for r in rows])
    return {"moe_config": moe.to_dict(), "timing": timing, "bytes": rows}


# ----------------------------------------------------------------------------- main

RUNNERS = {
    "step": section_step,
    "roofline": section_roofline,
    "exactness": section_exactness,
    "engine": section_engine,
    "train": section_train,
    "moe": section_moe,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.device_check",
        description="Accelerator check: decode, engine, training and exactness on random models.",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (the test suite's run)")
    ap.add_argument("--out", default=None, help="folder for device_check.json (written after every section)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--dtype", default=None, help="default: float32 with --tiny or on CPU, else bfloat16")
    ap.add_argument("--budget-s", type=float, default=280.0, help="no section starts after this many seconds")
    ap.add_argument("--rows", default=None, help="engine row counts, comma-separated (default by size)")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; choose from {', '.join(SECTIONS)}")
    if args.dtype is None:
        args.dtype = "float32" if args.tiny or jax.default_backend() == "cpu" else "bfloat16"
    return args


def build(args: argparse.Namespace, started: float) -> Context:
    """Models, sizes and the report's header (``started``: the run's ``time.perf_counter()``)."""
    p = plan(args.tiny)
    if args.rows:
        rows = tuple(sorted({int(r) for r in args.rows.split(",")}))
        p = dataclasses.replace(p, rows=rows, row_buckets=rows)
    dtype = jnp.dtype(args.dtype)
    cfg = tiny_config() if args.tiny else qwen3_8b_config()
    t0 = time.perf_counter()
    params = device_params(cfg, dtype)
    target = Target(cfg, params, dtype=dtype)
    dcfg = DrafterConfig.for_target(cfg, block_size=p.block_size, num_layers=p.drafter_layers)
    drafter = random_drafter(dcfg, dtype)
    jax.block_until_ready(nnx.state(drafter))
    n_params = lambda m: int(sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))))
    dev = jax.devices()[0]
    meta = {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "dtype": str(dtype),
        "tiny": bool(args.tiny),
        "budget_s": args.budget_s,
        "target": cfg.to_dict(),
        "target_params": n_params(target),
        "drafter": dcfg.to_dict(),
        "drafter_params": n_params(drafter),
        "plan": dataclasses.asdict(p),
        "build_s": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else None
    return Context(args, p, dtype, cfg, params, target, drafter, out, {"meta": meta, "sections": {}}, {}, started)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    ctx = build(args, started)
    ctx.report["meta"]["command"] = command_line("device_check", argv)
    print(
        f"device_check: {ctx.report['meta']['device_kind']} ({ctx.report['meta']['platform']}), {ctx.cfg.name}, "
        f"{ctx.report['meta']['target_params'] / 1e9:.3g}B params, dtype {ctx.dtype}"
    )
    ctx.write()
    failed = []
    for name, run in RUNNERS.items():
        if name not in args.sections:
            continue
        if time.perf_counter() - started > args.budget_s:
            ctx.report["sections"][name] = {"skipped": f"the budget of {args.budget_s:g} s was spent"}
            print(f"\n== {name}: skipped (budget spent)")
        else:
            t0, ctx.current = time.perf_counter(), name
            try:
                ctx.report["sections"][name] = {**run(ctx), "section_s": time.perf_counter() - t0}
            except Exception as e:  # one section's failure (say out of memory) leaves the others' results
                failed.append(name)
                ctx.report["sections"][name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
                print(f"\n== {name}: FAILED {type(e).__name__}: {e}")
        gc.collect()  # the section's models and caches leave the device before the next one
        ctx.write()
    if "compile" in args.sections:
        table("compile seconds", ["program", "s"], [[k, v] for k, v in ctx.compile_s.items()])
    ctx.write()
    print(
        f"\ntotal {time.perf_counter() - started:.1f} s"
        + (f"; written to {ctx.out / 'device_check.json'}" if ctx.out else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
