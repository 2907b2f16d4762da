"""Training-step cost of drafter configurations, side by side in one process.

Each configuration (``key=value`` overrides of the target's training preset, e.g.
``drafter_width=128`` or ``draft_vocab_size=8192``) gets its own :class:`~dspark_jax.training.trainer.Trainer`
on the same target and the same batches; steps alternate between the configurations (so a
busy shared machine slows all of them alike) and each reports the median seconds per step
and its ratio to the first configuration. ``feature_cache=DIR`` in a configuration trains
from a target-feature cache (built on first use). Data: the preset run's shards
(``--data-dir``), or random token sequences of the preset's shape when none is given
(step costs depend on shapes, not on values).

CLI::

    python -m benchmarks.train_step_cost --target stories260k --steps 12 \\
        --config "" --config "drafter_width=128" --json train_step_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx

from benchmarks.harness import write_json


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.api import load_target
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.presets import canonical_preset
    from dspark_jax.training.data import batches, draft_vocabulary, load_shards
    from dspark_jax.training.overrides import apply_overrides
    from dspark_jax.training.recipes import TRAIN_PRESETS
    from dspark_jax.training.train_config import TrainConfig, drafter_config
    from dspark_jax.training.trainer import Trainer, count_params

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step_cost",
        description="Median seconds per training step of drafter configurations.",
    )
    ap.add_argument("--target", required=True)
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        help="space-separated key=value overrides of the preset (repeat; '' = the preset)",
    )
    ap.add_argument("--data-dir", default=None, help="folder of shard_*.npz (default: random sequences)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per configuration (after 2 warm-up)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    base = TRAIN_PRESETS.get(canonical_preset(args.target) or "", TrainConfig(target=args.target))
    target, _ = load_target(args.target)
    if args.data_dir:
        data = load_shards(sorted(Path(args.data_dir).glob("shard_[0-9]*[0-9].npz")))
    else:
        rng = np.random.default_rng(0)
        n, L = max(4 * base.batch_size, 64), base.seq_len
        data = {
            "tokens": rng.integers(3, target.cfg.vocab_size, (n, L)).astype(np.int32),
            "lengths": np.full(n, L, np.int32),
            "prompt_lengths": np.full(n, L // 8, np.int32),
        }
    runs = []
    for spec in args.config or [""]:
        cfg = apply_overrides(base, [s for s in spec.split() if s])
        d = build_drafter(drafter_config(cfg, target), nnx.Rngs(0))
        if d.cfg.draft_vocab_size:
            d.set_draft_vocab(draft_vocabulary(data, d.cfg.draft_vocab_size, target.cfg.vocab_size))
        cdata = data
        if cfg.feature_cache:
            from dspark_jax.training.feature_cache import ensure_feature_cache

            fc = ensure_feature_cache(cfg.feature_cache, target, data, d.cfg.taps, store_dtype=cfg.feature_cache_dtype)
            cdata = {**data, **fc.batch_arrays(d.cfg.taps)}
        runs.append(
            {
                "config": spec or "(preset)",
                "trainer": Trainer(cfg, target, d),
                "batches": batches(cdata, cfg.batch_size, seed=0),
                "times": [],
                "drafter_params": count_params(nnx.state(d, nnx.Param)),
            }
        )
    for i in range(args.steps + 2):
        for r in runs[i % len(runs) :] + runs[: i % len(runs)]:  # rotate the order every step
            batch = next(r["batches"])
            t0 = time.perf_counter()
            terms, _ = r["trainer"].step(batch, i)
            float(terms.loss)
            if i >= 2:
                r["times"].append(time.perf_counter() - t0)
    ref = statistics.median(runs[0]["times"])
    out = []
    print(f"{'configuration':<48} {'params':>10} {'s/step':>8} {'ratio':>6}")
    for r in runs:
        med = statistics.median(r["times"])
        out.append(
            {"config": r["config"], "drafter_params": r["drafter_params"], "seconds_per_step": med, "ratio": med / ref}
        )
        print(f"{r['config']:<48} {r['drafter_params']:>10,} {med:>8.3f} {med / ref:>6.2f}")
    if args.json:
        write_json(args.json, {"target": args.target, "steps": args.steps, "runs": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
