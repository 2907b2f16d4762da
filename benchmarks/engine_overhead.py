"""What a drafter costs the serving engine while the scheduler is not drafting.

An engine built with a drafter keeps the drafter's context KV cache current at every step
(the target pass also returns the tapped hidden states; their context keys/values are
written for every verified token), so that drafting can resume at any step. After
``suspend_after`` non-drafting steps it drops that upkeep (drafter suspension, see
:mod:`dspark_jax.serving.engine`) and pays a catch-up pass when drafting resumes. This script
measures, side by side in one process, each case against the same plain step (every row
verifies only its anchor, no drafting) of a drafter-less engine, alternated ``--reps`` times:

* the step with drafter upkeep (what a non-drafting engine pays before suspension);
* the suspended step (should cost what the plain engine's step costs);
* a prefill (prefill drafts nothing while the engine does not draft), with the drafter context
  and with the drafter suspended (no context: it is caught up if drafting resumes);
* one catch-up pass (``block_size + 1`` skipped tokens per row), the price of resuming;
* the step that also drafts the next block (one drafter pass plus ``block_size`` LM-head rows and
  the Markov sampler): what speculation must win back.

    python -m benchmarks.engine_overhead --target smollm2-135m-instruct \\
        --drafter runs/smollm2-135m-instruct/export --rows 1,16,64 --out runs/engine_overhead

Prints a table (median milliseconds and the ratio drafter engine / plain engine) and writes
``OUT/engine_overhead.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import alternate, device_description, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_overhead", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--target", default="smollm2-135m-instruct", help="preset or model path")
    p.add_argument("--drafter", default=None, help="drafter export directory")
    p.add_argument(
        "--random-drafter",
        type=int,
        default=None,
        metavar="BLOCK_SIZE",
        help="a randomly initialised drafter with this block size instead of an export",
    )
    p.add_argument("--rows", default="1,16,64", help="active rows per step, comma-separated (default 1,16,64)")
    p.add_argument("--num-slots", type=int, default=64, help="engine slots (default 64)")
    p.add_argument("--cache-len", type=int, default=384, help="engine cache length (default 384)")
    p.add_argument("--prompt-len", type=int, default=90, help="prompt tokens of the prefill timing (default 90)")
    p.add_argument("--reps", type=int, default=12, help="timed repeats per engine and measurement (default 12)")
    p.add_argument("--out", default="runs/engine_overhead", help="output directory")
    return p


def measure(plain, spec, rows: list[int], prompt_len: int, reps: int) -> list[dict[str, Any]]:
    """Median seconds of ``plain`` and ``spec`` (alternated) for a plain step at each row
    count and for one prefill of ``prompt_len`` tokens."""
    import jax
    import numpy as np

    from dspark_jax.serving.engine import Request, SamplingParams
    from dspark_jax.serving.engine.state import PackedTokens

    b = plain.num_slots

    ell, act_all = np.zeros(b, np.int32), np.zeros(b, bool)

    def step(e, r, draft=False):
        act = act_all.copy()
        act[:r] = True

        def run():  # returns None: timed by the harness as a whole
            jax.block_until_ready(e.device.run_step(r, r, ell, act, draft))

        return run

    def bare_step(e, r):
        act = act_all.copy()
        act[:r] = True
        e.device.bare_step_exe(r)  # compiled outside the timing

        def run():
            jax.block_until_ready(e.device.run_bare_step(r, ell, act, False, False))  # use_bias, want_lp

        return run

    def catch_up(e, r):
        w = e.block_size + 1
        tok = np.full(r * w, 1, np.int32)
        row = np.repeat(np.arange(r, dtype=np.int32), w)
        col = np.tile(np.arange(w, dtype=np.int32), r)
        e.device.catchup_exe(r)

        def run():
            e.device.run_catchup(r, PackedTokens(tok, row, col, col))
            jax.block_until_ready(e.device.state.dk)

        return run

    vocab = plain.target.cfg.vocab_size
    req = Request([int(i) % vocab for i in range(100, 100 + prompt_len)], SamplingParams(temperature=0.0), "p")

    def prefill(e, suspended=False):
        def run():
            e.planner.idle_steps = e.suspend_after if suspended else 0  # what the last steps decided
            jax.block_until_ready(e.prefill(req).arrays)

        return run

    cases = [(f"step with drafter upkeep, {r} rows", step(plain, r), step(spec, r)) for r in rows]
    cases += [(f"step, drafter suspended, {r} rows", step(plain, r), bare_step(spec, r)) for r in rows]
    cases.append((f"prefill, {prompt_len} tokens", prefill(plain), prefill(spec)))
    cases.append((f"prefill, drafter suspended, {prompt_len} tokens", prefill(plain), prefill(spec, True)))
    cases += [
        (f"catch-up pass ({spec.block_size + 1} tokens/row), {r} rows", step(plain, r), catch_up(spec, r)) for r in rows
    ]
    # For scale: the same step when it also drafts the next block (what speculation must win back).
    cases += [(f"step + drafting a block, {r} rows", step(plain, r), step(spec, r, True)) for r in rows]
    out = []
    for name, fp, fs in cases:
        med = alternate({"plain": fp, "spec": fs}, reps)  # a warm-up round first (compiled already)
        mp, ms = med["plain"], med["spec"]
        out.append({"case": name, "plain_ms": mp * 1e3, "drafter_engine_ms": ms * 1e3, "ratio": ms / mp})
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from flax import nnx

    from dspark_jax.api import load_target_and_drafter
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.engine import Engine, EngineConfig

    target, _, drafter = load_target_and_drafter(args.target, args.drafter)
    if drafter is None:
        if not args.random_drafter:
            raise DSparkInputError("give --drafter EXPORT_DIR or --random-drafter BLOCK_SIZE")
        drafter = DSparkDrafter(
            DrafterConfig.for_target(target.cfg, block_size=args.random_drafter, num_layers=1, markov_rank=8),
            nnx.Rngs(0),
        )
    rows = sorted({int(r) for r in args.rows.split(",")})
    if rows[0] < 1 or rows[-1] > args.num_slots:
        raise DSparkInputError(f"--rows must be in [1, --num-slots={args.num_slots}]")
    p_len = max(16, 1 << (args.prompt_len - 1).bit_length())
    cfg = EngineConfig(
        num_slots=args.num_slots,
        cache_len=args.cache_len,
        policy="plain",
        row_buckets=tuple(sorted(set(rows) | {args.num_slots})),
        prefill_buckets=(min(p_len, args.cache_len),),
        prefill_chunk_tokens=0,
    )
    # policy "plain" on both: only the (R, R) buckets compile (plus, for the drafter engine,
    # its suspended steps and catch-up passes).
    plain, spec = Engine(target, None, cfg), Engine(target, drafter, cfg)
    plain.warmup()
    spec.warmup()
    res = measure(plain, spec, rows, args.prompt_len, args.reps)
    lines = ["| case | plain engine ms | engine with drafter ms | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['case']} | {r['plain_ms']:.1f} | {r['drafter_engine_ms']:.1f} | {r['ratio']:.3f} |" for r in res]
    print("\n".join(lines))
    out = Path(args.out)
    record = {
        "target": args.target,
        "drafter": args.drafter or f"random(block_size={args.random_drafter})",
        "num_slots": args.num_slots,
        "cache_len": args.cache_len,
        "reps": args.reps,
        "device": device_description(),
        "results": res,
    }
    write_json(out / "engine_overhead.json", record)
    print(f"wrote {out / 'engine_overhead.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
