"""The host's share of an engine step, with and without the next step queued on the device.

The engine keeps the next step in flight while the host closes the previous one and the caller does
its own work (``EngineConfig(overlap=True)``, :mod:`dspark_jax.serving.engine.inflight`). This script
measures what that buys, side by side in one process: for each policy and row count it runs
``--steps`` calls of ``Engine.generate()`` over rows that never finish, with ``--caller-ms`` of
Python work between calls (the server's routing and detokenizing holds the interpreter the same
way), once with ``overlap=False`` and once with ``overlap=True``, alternated ``--reps`` times. It
also replays the same sequence of step programs back to back with no host work at all: the
device's own time. The host share of a step is ``1 - device / wall``, the time the device waits.

    python -m benchmarks.engine_host --target stories260k --random-drafter 4 \\
        --policies plain,fixed:2,dspark --rows 1,8 --out runs/engine_host

Prints a table (median milliseconds per step, host shares, the speed-up of overlap) and writes
``OUT/engine_host.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import alternate, command_line, device_description, markdown_table, write_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_host", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--target", default="stories260k", help="preset or model path (default stories260k)")
    p.add_argument("--drafter", default=None, help="drafter export directory")
    p.add_argument(
        "--random-drafter",
        type=int,
        default=4,
        metavar="BLOCK_SIZE",
        help="a random drafter of this block size (default 4)",
    )
    p.add_argument("--policies", default="plain,fixed:2,dspark", help="comma-separated engine policies")
    p.add_argument("--rows", default="1,8", help="active rows, comma-separated (default 1,8)")
    p.add_argument("--steps", type=int, default=24, help="generate() calls per timed run (default 24)")
    p.add_argument("--caller-ms", type=float, default=1.0, help="caller's Python work between calls [ms] (default 1)")
    p.add_argument("--cache-len", type=int, default=512, help="engine cache length (default 512)")
    p.add_argument("--reps", type=int, default=5, help="timed repeats per case (default 5)")
    p.add_argument("--out", default="runs/engine_host", help="output directory")
    return p


class _Recorder:
    """Records every step program an engine dispatches while installed (a context manager), to
    replay them later with no host work in between."""

    NAMES = ("run_step", "run_bare_step", "run_catchup")

    def __init__(self, device):
        self.device, self.calls = device, []
        self._orig = {n: getattr(device, n) for n in self.NAMES}

    def __enter__(self) -> _Recorder:
        for name, fn in self._orig.items():
            setattr(self.device, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._orig.items():
            setattr(self.device, name, fn)

    def _wrap(self, name, fn):
        def run(*args, **kw):
            self.calls.append((name, args, kw))
            return fn(*args, **kw)

        return run

    def replay(self) -> None:
        for name, args, kw in self.calls:
            self._orig[name](*args, **kw)


def _busy(ms: float) -> None:
    """Holds the interpreter for ``ms`` milliseconds (what a caller's Python work does)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def measure(engine, policy: str, rows: int, steps: int, caller_ms: float, reps: int) -> dict[str, Any]:
    """Median milliseconds per step of ``engine`` under ``policy`` with ``rows`` rows: overlap
    off, on, and the device-only replay of the off run's programs."""
    import jax

    from dspark_jax.serving.engine import Request, SamplingParams

    engine.set_policy(policy)
    engine.warmup()  # compiles and profiles (or adopts) the SPS table outside the recording
    vocab = engine.target.cfg.vocab_size
    n_new = steps * (engine.block_size + 1) + 8
    sp = SamplingParams(temperature=0.0, max_new_tokens=n_new, min_tokens=n_new)  # never stops within the run
    reqs = [Request([(101 + 7 * i + j) % vocab for j in range(24)], sp, f"r{i}") for i in range(rows)]

    def fresh():
        engine.sync()
        for slot in engine.active_slots():
            engine.free(slot)
        engine.planner.idle_steps = 0
        for i, r in enumerate(reqs):
            engine.insert(engine.prefill(r), i)
        jax.block_until_ready(engine.device.state.tk)

    def run(overlap: bool):
        def timed() -> float:
            fresh()
            engine.overlap = overlap
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.generate()
                _busy(caller_ms)
            # until the last outputs were delivered: a step still in flight is the next one's
            secs = (time.perf_counter() - t0) / steps
            engine.sync()
            jax.block_until_ready(engine.device.state.tk)
            return secs

        return timed

    with _Recorder(engine.device) as recorder:
        run(False)()  # compiles what is left; records the off run's programs

    def device_only() -> float:
        fresh()
        t0 = time.perf_counter()
        recorder.replay()
        jax.block_until_ready(engine.device.state.tk)
        return (time.perf_counter() - t0) / steps

    try:
        med = alternate({"off": run(False), "on": run(True), "device": device_only}, reps)
    finally:
        engine.overlap = True
    off, on, dev = med["off"], med["on"], med["device"]
    return {
        "policy": policy,
        "rows": rows,
        "off_ms": off * 1e3,
        "on_ms": on * 1e3,
        "device_ms": dev * 1e3,
        "host_share_off": max(0.0, 1 - dev / off),
        "host_share_on": max(0.0, 1 - dev / on),
        "speedup": off / on,
        "programs_per_step": len(recorder.calls) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.api import load_target_and_drafter
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.engine import Engine, EngineConfig

    target, _, drafter = load_target_and_drafter(args.target, args.drafter)
    if drafter is None and args.random_drafter:
        from flax import nnx

        cfg = DrafterConfig.for_target(target.cfg, block_size=args.random_drafter, num_layers=1, markov_rank=32)
        drafter = DSparkDrafter(cfg, nnx.Rngs(0))
    if drafter is not None and not isinstance(drafter, DSparkDrafter):
        raise DSparkInputError("the engine serves DSpark/DFlash drafters only")
    rows = [int(r) for r in args.rows.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = []
    for r in rows:
        engine = Engine(
            target,
            drafter,
            EngineConfig(
                num_slots=r,
                cache_len=args.cache_len,
                row_buckets=[r],
                policy=policies[0],
                profile_iters=2,
                prefill_chunk_tokens=0,
            ),
        )
        for policy in policies:
            results.append(measure(engine, policy, r, args.steps, args.caller_ms, args.reps))
            print(f"{policy} rows={r}: {results[-1]}", file=sys.stderr, flush=True)
    table = markdown_table(
        [
            {
                "policy": x["policy"],
                "rows": x["rows"],
                "overlap off [ms/step]": x["off_ms"],
                "overlap on [ms/step]": x["on_ms"],
                "device only [ms/step]": x["device_ms"],
                "host share off": x["host_share_off"],
                "host share on": x["host_share_on"],
                "off / on": x["speedup"],
            }
            for x in results
        ]
    )
    print(table)
    out = Path(args.out)
    write_json(
        out / "engine_host.json",
        {
            "command": command_line("benchmarks.engine_host", argv),
            "device": device_description(),
            "steps": args.steps,
            "caller_ms": args.caller_ms,
            "reps": args.reps,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
