"""Median time of the engine's hot step programs (plain step, speculative step) with no request
using logit_bias / logprobs / min_tokens, and with them: run it on two checkouts to compare.

    PYTHONPATH=. python benchmarks/hot_step.py --target smollm2-135m-instruct --rows 16 --gamma 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--features", action="store_true", help="also time with bias and logprobs on")
    a = p.parse_args(argv)
    import inspect

    import jax
    import numpy as np
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafter import Drafter
    from dspark_jax.engine import Engine

    target, _ = load_target(a.target)
    cfg = DrafterConfig.for_target(target.cfg, gamma=a.gamma, num_layers=1, markov_rank=64)
    drafter = Drafter(cfg, nnx.Rngs(0))
    eng = Engine(target, drafter, num_slots=a.rows, cache_len=a.cache_len, policy=f"fixed:{a.gamma}",
                 row_buckets=[a.rows], prefill_buckets=[32], suspend_after=None, profile_iters=1)
    eng.warmup()
    b = eng.num_slots
    active = np.ones(b, bool)
    new = "use_bias" in inspect.signature(eng._run_step).parameters
    res = {}
    cases = [("plain", 0, {}), ("spec", a.gamma, {})]
    if a.features and new:
        cases += [("plain+bias+lp", 0, dict(use_bias=True, want_lp=True)),
                  ("spec+bias+lp", a.gamma, dict(use_bias=True, want_lp=True))]
    for name, ell, kw in cases:
        tokens = a.rows * (ell + 1)
        ts = []
        for i in range(a.reps + 3):
            t0 = time.perf_counter()
            out = eng._run_step(a.rows, tokens, np.full(b, ell, np.int32), active, False, **kw)
            jax.block_until_ready(out)
            if i >= 3:
                ts.append(time.perf_counter() - t0)
            eng._state = eng._state._replace(pos=eng._state.pos * 0 + 40)   # stay inside the cache
        res[name] = round(statistics.median(ts) * 1e3, 3)
    print(json.dumps({"new_engine": new, "rows": a.rows, "gamma": a.gamma, "median_ms": res}))


if __name__ == "__main__":
    main()
