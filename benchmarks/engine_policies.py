"""Serving policies side by side on one engine: output tokens/s of ``plain``, ``fixed:G`` and
``dspark`` at a given concurrency, alternated in one process.

One engine (one set of compiled programs) is switched between the policies with
``Engine.set_policy``; each round runs the same prompts through every policy in a rotated
order, ``--repeats`` rounds, and the median tokens/s per policy is kept, so the ratios are
measured side by side on a shared machine. Concurrency ``c``: ``c`` requests decode together
(closed loop: a finished request's slot takes the next prompt). Also reports, per policy, the
share of steps that drafted, suspended steps, probes and tau. The ``dspark`` policy's
criterion (issue 26): tokens/s >= 0.95x the better of ``plain`` and ``fixed:G``. With ``--ahead``
every speculative policy also runs as ``POLICY+ahead``: its steps planned before the step in flight
is read (``engine.planner.speculative_ahead``, docs/design.md#serving).

    python -m benchmarks.engine_policies --target stories260k --drafter runs/stories260k/export \\
        --concurrency 1,4 --repeats 3 --out runs/engine_policies

Prints a table and writes ``OUT/engine_policies.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import split_ahead, write_json

STORIES = ["Once upon a time", "The little dog", "One day, a girl named Lily", "Tom and his mom went", "The sun was"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_policies", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--target", default="stories260k", help="preset or model path (default stories260k)")
    p.add_argument("--drafter", required=True, help="drafter export directory")
    p.add_argument("--policies", default="plain,fixed:4,dspark", help="comma-separated (default plain,fixed:4,dspark)")
    p.add_argument("--concurrency", default="1,4", help="concurrency levels (default 1,4)")
    p.add_argument("--num-requests", type=int, default=8, help="requests per policy, level and round (default 8)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--cache-len", type=int, default=512, help="engine cache length (default 512)")
    p.add_argument("--prefill-buckets", default="16,32", help="compiled prompt lengths (default 16,32)")
    p.add_argument("--repeats", type=int, default=3, help="alternated rounds; the median is kept (default 3)")
    p.add_argument("--ahead", action="store_true", help="also run each speculative policy planned ahead")
    p.add_argument("--out", default="runs/engine_policies", help="output directory")
    return p


def run_level(eng, tok, policy: str, prompts: list[str], conc: int, max_tokens: int) -> dict:
    """Decodes every prompt under ``policy`` (``POLICY+ahead``: planned ahead) with ``conc`` in
    flight; tokens/s and counters."""
    from dspark_jax.serving.engine.requests import Request, SamplingParams

    name, ahead = split_ahead(policy)
    eng.set_policy(name)
    eng.planner.speculative_ahead = ahead
    eng.reset_metrics()
    probes0 = eng.planner.probes
    queue = [
        Request(tok.encode(p), SamplingParams(max_new_tokens=max_tokens, temperature=0.0), f"r{i}")
        for i, p in enumerate(prompts)
    ]
    tokens, t0 = 0, time.perf_counter()
    while queue or eng.active_slots():
        for slot in eng.free_slots()[: max(0, conc - len(eng.active_slots()))]:
            if queue:
                eng.insert(eng.prefill(queue.pop(0)), slot)
        tokens += sum(len(o.token_ids) for o in eng.generate())
    secs = time.perf_counter() - t0
    m = eng.metrics()
    return {
        "tokens_per_s": tokens / secs,
        "tokens": tokens,
        "seconds": secs,
        "steps": m["steps"],
        "drafting_share": m["draft_steps"] / max(m["steps"], 1),
        "suspended_steps": m["suspended_steps"],
        "probes": eng.planner.probes - probes0,
        "tau": m["mean_accepted_length"],
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.api import load_target_and_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.engine import Engine, EngineConfig

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    target, tok, drafter = load_target_and_drafter(args.target, args.drafter)
    if not isinstance(drafter, DSparkDrafter):
        raise DSparkInputError("the engine serves DSpark/DFlash drafters only")
    pb = [int(b) for b in args.prefill_buckets.split(",")]
    eng = Engine(
        target,
        drafter,
        EngineConfig(
            num_slots=max(levels),
            cache_len=args.cache_len,
            policy=policies[0],
            prefill_buckets=pb,
            prefill_chunk_tokens=0,
        ),
    )
    t0 = time.perf_counter()
    for p in policies:  # compile (and profile) every policy's programs before timing
        eng.set_policy(p)
        eng.warmup()
    warm_s = time.perf_counter() - t0
    if args.ahead:
        policies += [f"{p}+ahead" for p in policies if p != "plain"]
    prompts = (STORIES * args.num_requests)[: args.num_requests]
    runs: dict = {c: {p: [] for p in policies} for c in levels}
    for r in range(args.repeats):
        for c in levels:
            order = policies[r % len(policies) :] + policies[: r % len(policies)]
            for p in order:
                runs[c][p].append(run_level(eng, tok, p, prompts, c, args.max_tokens))
    table = {}
    print(f"warm-up {warm_s:.1f} s; median of {args.repeats} alternated rounds")
    print(
        f"{'conc':>4} {'policy':>10} {'tok/s':>8} {'vs best':>8} {'drafting':>9} {'suspended':>9} "
        f"{'probes':>6} {'tau':>5}"
    )
    for c in levels:
        med = {p: statistics.median(x["tokens_per_s"] for x in runs[c][p]) for p in policies}
        best_other = max((v for p, v in med.items() if p != "dspark"), default=float("nan"))
        table[c] = {}
        for p in policies:
            x = sorted(runs[c][p], key=lambda e: e["tokens_per_s"])[len(runs[c][p]) // 2]
            table[c][p] = {**x, "median_tokens_per_s": med[p], "ratio_to_best_other": med[p] / best_other}
            print(
                f"{c:>4} {p:>10} {med[p]:8.1f} {med[p] / best_other:8.2f} {x['drafting_share']:9.2f} "
                f"{x['suspended_steps']:9d} {x['probes']:6d} {x['tau'] or 1.0:5.2f}"
            )
    out = Path(args.out)
    write_json(out / "engine_policies.json", {"args": vars(args), "warmup_s": warm_s, "levels": table, "runs": runs})
    print(f"wrote {out / 'engine_policies.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
