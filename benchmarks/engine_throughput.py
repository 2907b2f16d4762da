"""Tokens/s of the serving engine with every slot kept busy, per policy and slot count.

Each run calls ``Engine.generate()`` ``--steps`` times; a request that finishes is replaced at once
(prompts cycle through a few fixed openings, greedy, no token limit but the cache), so the engine
always holds ``slots`` rows, as a loaded server does. With ``--ahead`` every speculative policy also
runs with its steps planned before the step in flight is read
(``engine.planner.speculative_ahead``, docs/design.md#serving), alternated with the default.

    python -m benchmarks.engine_throughput --target stories260k --drafter runs/stories260k/export \\
        --policies plain,fixed:2,fixed:8 --slots 1,8 --ahead --out runs/engine_throughput

Prints a table (median tokens/s, the speed-up over plain at the same slot
count, tau) and writes ``OUT/engine_throughput.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import alternate, command_line, device_description, markdown_table, ratio, write_json

OPENINGS = ("Once upon a time", "Lily went to the park", "The little dog", "Tom had a red ball", "One day, a bird")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_throughput", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--target", default="stories260k", help="preset or model path (default stories260k)")
    p.add_argument("--drafter", required=True, help="drafter export directory")
    p.add_argument("--policies", default="plain,fixed:2,fixed:8", help="comma-separated engine policies")
    p.add_argument("--slots", default="1,8", help="slot counts, comma-separated (default 1,8)")
    p.add_argument("--steps", type=int, default=300, help="generate() calls per timed run (default 300)")
    p.add_argument("--reps", type=int, default=3, help="timed repeats per case, alternated (default 3)")
    p.add_argument("--cache-len", type=int, default=512, help="engine cache length (default 512)")
    p.add_argument("--ahead", action="store_true", help="also time speculative steps planned ahead")
    p.add_argument("--out", default="runs/engine_throughput", help="output directory")
    return p


def busy_run(engine, prompts: list[list[int]], steps: int) -> tuple[float, int]:
    """``steps`` calls of ``engine.generate()`` with every slot refilled as it frees; returns
    ``(seconds, emitted tokens)``."""
    from dspark_jax.serving.engine import Request, SamplingParams

    n_req, tokens = 0, 0
    sp = SamplingParams(temperature=0.0, max_tokens=engine.cache_len)
    t0 = time.perf_counter()
    for _ in range(steps):
        for slot in engine.free_slots():
            engine.insert(engine.prefill(Request(prompts[n_req % len(prompts)], sp, f"r{n_req}")), slot)
            n_req += 1
        tokens += sum(len(o.token_ids) for o in engine.generate())
    engine.sync()
    secs = time.perf_counter() - t0
    for slot in engine.active_slots():
        engine.free(slot)
    return secs, tokens


def measure(engine, prompts: list[list[int]], steps: int, reps: int, ahead: bool) -> list[dict[str, Any]]:
    """Median tokens/s and ms/step of ``engine``'s policy, planned after the read and (``ahead``,
    speculative policies only) before it, alternated ``reps`` times."""
    speculative = engine.policy_name != "plain"
    arms = [False, True] if (ahead and speculative) else [False]
    busy_run(engine, prompts, 10)  # compiles what warm-up left
    taus: dict[bool, float] = {}

    def arm(flag: bool):
        def run() -> float:
            engine.planner.speculative_ahead = flag
            engine.reset_metrics()
            secs, tokens = busy_run(engine, prompts, steps)
            taus[flag] = engine.metrics()["mean_accepted_length"]
            return secs / max(tokens, 1)  # seconds per token: its median gives tokens/s

        return run

    try:
        med = alternate({str(a): arm(a) for a in arms}, reps)
    finally:
        engine.planner.speculative_ahead = False
    rows = []
    for a in arms:
        per_token = med[str(a)]
        rows.append({"policy": engine.policy, "slots": engine.num_slots, "ahead": a, "tokens_per_s": 1 / per_token})
        rows[-1]["tau"] = taus[a]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.api import load_target_and_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.engine import Engine
    from dspark_jax.serving.engine.step_programs import ProgramCache

    target, tokenizer, drafter = load_target_and_drafter(args.target, args.drafter)
    if not isinstance(drafter, DSparkDrafter):
        raise DSparkInputError("the engine serves DSpark/DFlash drafters only")
    prompts = [list(tokenizer.encode(t)) for t in OPENINGS]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = []
    for slots in (int(s) for s in args.slots.split(",")):
        programs = ProgramCache()
        for policy in policies:
            engine = Engine(
                target,
                drafter,
                num_slots=slots,
                cache_len=args.cache_len,
                policy=policy,
                row_buckets=[slots],
                prefill_buckets=[32],
                program_cache=programs,
                suspend_after=None,
            )
            engine.warmup()
            results += measure(engine, prompts, args.steps, args.reps, args.ahead)
            print(f"{policy} slots={slots}: {results[-1]}", file=sys.stderr, flush=True)
    plain = {r["slots"]: r["tokens_per_s"] for r in results if r["policy"] == "plain"}
    for r in results:
        r["speedup_vs_plain"] = ratio(r["tokens_per_s"], plain.get(r["slots"]))
    print(
        markdown_table(
            [
                {
                    "policy": r["policy"],
                    "slots": r["slots"],
                    "planned ahead": r["ahead"],
                    "tokens/s": r["tokens_per_s"],
                    "vs plain": r["speedup_vs_plain"],
                    "tau": r["tau"],
                }
                for r in results
            ]
        )
    )
    write_json(
        Path(args.out) / "engine_throughput.json",
        {
            "command": command_line("engine_throughput", argv),
            "device": device_description(),
            "steps": args.steps,
            "reps": args.reps,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
