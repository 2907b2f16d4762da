"""A/B timing of the engine's hot step programs: this checkout against another checkout of
the package (e.g. the commit before a change), interleaved in one process so that machine
load hits both alike.

    git archive <old-commit> | tar -x -C /tmp/old
    PYTHONPATH=. python benchmarks/hot_step.py --old /tmp/old --target smollm2-135m-instruct --rows 16 --gamma 4

Times, with a random drafter (``--gamma``) and ``fixed:gamma``, the plain step (every row
verifies its anchor only) and the speculative step (every row verifies ``gamma`` drafts),
with no request using logit_bias / logprobs / min_tokens; in this checkout also with both
flags on (``+bias+lp``). Prints one JSON object of median milliseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_package(root: str, name: str):
    """Imports ``root/dspark_jax`` as package ``name``."""
    init = Path(root) / "dspark_jax" / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module(f"{name}.engine")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--old", default=None, help="another checkout (its dspark_jax/) to compare with")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.dspark import Drafter
    from dspark_jax.serving import engine as new_engine

    target, _ = load_target(a.target)
    cfg = DrafterConfig.for_target(target.cfg, gamma=a.gamma, num_layers=1, markov_rank=64)
    drafter = Drafter(cfg, nnx.Rngs(0))
    mods = {"new": new_engine}
    if a.old:
        mods["old"] = load_package(a.old, "dspark_old")
    engines = {}
    for name, mod in mods.items():
        eng = mod.Engine(
            target,
            drafter,
            num_slots=a.rows,
            cache_len=a.cache_len,
            policy=f"fixed:{a.gamma}",
            row_buckets=[a.rows],
            prefill_buckets=[32],
            suspend_after=None,
            profile_iters=1,
        )
        eng.warmup()
        engines[name] = eng
    b = a.rows
    active = np.ones(b, bool)
    cases = []
    for name, eng in engines.items():
        new = "use_bias" in inspect.signature(eng._run_step).parameters
        cases += [(f"{name}:plain", eng, 0, {}), (f"{name}:spec", eng, a.gamma, {})]
        if new:
            on = dict(use_bias=True, want_lp=True)
            cases += [(f"{name}:plain+bias+lp", eng, 0, on), (f"{name}:spec+bias+lp", eng, a.gamma, on)]
    times = {c[0]: [] for c in cases}
    for i in range(a.reps + 2):
        for label, eng, ell, kw in cases if i % 2 == 0 else cases[::-1]:
            tokens = a.rows * (ell + 1)
            t0 = time.perf_counter()
            out = eng._run_step(a.rows, tokens, np.full(b, ell, np.int32), active, False, **kw)
            jax.block_until_ready(out)
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
            eng._state = eng._state._replace(pos=eng._state.pos * 0 + 40)  # stay inside the cache
    print(
        json.dumps(
            {
                "target": a.target,
                "rows": a.rows,
                "gamma": a.gamma,
                "reps": a.reps,
                "median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
