"""tau of the engine's two verification modes (coupled draws vs rejection sampling).

    python -m benchmarks.verification_modes --target stories260k \\
        --drafter ~/dspark-runs/s260k-i14/export --prompts ~/dspark-runs/s260k-i14/eval_prompts.json

docs/design.md#verification / docs/design.md#metrics: for each temperature and mode, one warmed-up
:class:`~dspark_jax.serving.engine.Engine` (policy ``fixed:block_size`` by default, so that both modes
verify the same number of drafts) decodes every prompt (seeds 0..n-1, ``--max-tokens``) in
``--slots`` concurrent slots; reported: tau (tokens per request-round, the engine's
``mean_accepted_length``), acceptance rate and per-position conditional acceptance. Greedy
(T=0) is the same in both modes and is reported as a check. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def run(eng, reqs):
    from dspark_jax.serving.engine import Request  # noqa: F401

    pending = list(reqs)
    eng.reset_metrics()
    t0 = time.perf_counter()
    while pending or eng.active_slots():
        while pending and eng.free_slots():
            eng.insert(eng.prefill(pending.pop(0)), eng.free_slots()[0])
        eng.generate()
    m = eng.metrics()
    return {
        "tau": m["mean_accepted_length"],
        "acceptance_rate": m["acceptance_rate"],
        "position_acceptance": [None if a is None else round(a, 3) for a in m["position_acceptance"]],
        "emitted_tokens": m["emitted_tokens"],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.verification_modes", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument("--target", default="stories260k")
    p.add_argument("--drafter", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--policy", default=None, help="default fixed:block_size")
    p.add_argument("--temperatures", default="0,0.7,1.0")
    a = p.parse_args(argv)

    from dspark_jax.api import encode_prompt, load_target_and_drafter
    from dspark_jax.serving.engine import Engine, EngineConfig, Request, SamplingParams

    target, tok, drafter = load_target_and_drafter(a.target, os.path.expanduser(a.drafter))
    prompts = json.loads(Path(os.path.expanduser(a.prompts)).read_text())[: a.num_prompts]
    ids = [encode_prompt(tok, t, spec=a.target) for t in prompts]  # chat presets get their chat template
    policy = a.policy or f"fixed:{drafter.cfg.block_size}"
    res = {
        "target": a.target,
        "drafter": a.drafter,
        "block_size": drafter.cfg.block_size,
        "policy": policy,
        "num_prompts": len(ids),
        "max_tokens": a.max_tokens,
        "slots": a.slots,
        "results": {},
    }
    for mode in ("coupled", "rejection"):
        eng = Engine(
            target,
            drafter,
            EngineConfig(
                num_slots=a.slots,
                cache_len=a.cache_len,
                policy=policy,
                verification=mode,
                profile_iters=1,
                prefill_chunk_tokens=0,
            ),
        )
        eng.warmup()
        for temp in (float(t) for t in a.temperatures.split(",")):
            reqs = [
                Request(x, SamplingParams(temperature=temp, seed=i, max_new_tokens=a.max_tokens), f"r{i}")
                for i, x in enumerate(ids)
            ]
            r = run(eng, reqs)
            res["results"][f"{mode}@T={temp}"] = r
            print(mode, temp, r, file=sys.stderr, flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
