"""A/B timing of the engine's hot step programs: this checkout against another checkout of
the package (e.g. the commit before a change, loaded by :func:`benchmarks.harness.load_checkout`),
interleaved in one process so that machine load hits both alike.

    git archive <old-commit> | tar -x -C /tmp/old
    python -m benchmarks.hot_step --old /tmp/old --target smollm2-135m-instruct --rows 16 --block-size 4

Times, with a random drafter (``--block-size``) and ``fixed:block_size``, the plain step (every row
verifies its anchor only) and the speculative step (every row verifies ``block_size`` drafts),
with no request using logit_bias / logprobs / min_tokens; in this checkout also with both
flags on (``+bias+lp``). Prints one JSON object of median milliseconds.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import time

from benchmarks.harness import drafter_for, engine_for, load_checkout

_SUBMODULES = ("api", "config", "drafters.dspark", "serving.engine")  # what main() builds an engine from


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.hot_step", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--old", default=None, help="another checkout (its dspark_jax/) to compare with")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--cache-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args(argv)

    import jax
    import numpy as np

    packages = {"new": {m: importlib.import_module(f"dspark_jax.{m}") for m in _SUBMODULES}}
    if a.old:
        packages["old"] = load_checkout(a.old, _SUBMODULES)
    engines = {}
    for name, mods in packages.items():
        # Each checkout builds its own target and drafter, so model code is compared too.
        target, _ = mods["api"].load_target(a.target)
        drafter = drafter_for(mods, target.cfg, a.block_size, num_layers=1, markov_rank=64)
        eng = engine_for(
            mods["serving.engine"],
            target,
            drafter,
            num_slots=a.rows,
            cache_len=a.cache_len,
            policy=f"fixed:{a.block_size}",
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
        new = "use_bias" in inspect.signature(eng.device.run_step).parameters
        cases += [(f"{name}:plain", eng, 0, {}), (f"{name}:spec", eng, a.block_size, {})]
        if new:
            on = dict(use_bias=True, want_lp=True)
            cases += [(f"{name}:plain+bias+lp", eng, 0, on), (f"{name}:spec+bias+lp", eng, a.block_size, on)]
    times = {c[0]: [] for c in cases}
    for i in range(a.reps + 2):
        for label, eng, ell, kw in cases if i % 2 == 0 else cases[::-1]:
            tokens = a.rows * (ell + 1)
            t0 = time.perf_counter()
            out = eng.device.run_step(a.rows, tokens, np.full(b, ell, np.int32), active, False, **kw)
            jax.block_until_ready(out)
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
            eng.device.state = eng.device.state._replace(pos=eng.device.state.pos * 0 + 40)  # stay inside the cache
    print(
        json.dumps(
            {
                "target": a.target,
                "rows": a.rows,
                "block_size": a.block_size,
                "reps": a.reps,
                "median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
