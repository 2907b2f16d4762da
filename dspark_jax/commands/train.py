"""``python -m dspark_jax.train``: train, checkpoint, export and evaluate a drafter.

Usage::

    python -m dspark_jax.train --preset stories260k [key=value ...]
    python -m dspark_jax.train --config smollm2-135m-instruct steps=200     # a built-in recipe
    python -m dspark_jax.train --config my-recipe.yaml steps=200             # or any YAML/JSON file
    python -m dspark_jax.train --preset stories260k --dry-run
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --devices 4   # no weights needed
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --devices 8 --mesh data:2,model:4 \
        --device-memory-gib 16                        # -> per-device total: X GiB (fits 16 GiB)
    python -m dspark_jax.train --config dspark_jax/recipes/qwen3-8b.yaml --dry-run --serve --devices 8 --mesh model:8 \
        --num-slots 64 --cache-len 4096 --device-memory-gib 16    # serving: weights + KV caches
    python -m dspark_jax.train --preset qwen3-8b --dry-run --devices 16 --num-processes 4   # a 4-host layout
    python -m dspark_jax.train --preset qwen3-8b --distributed data_dir=...    # on every worker of a TPU pod slice
    python -m dspark_jax.train --preset qwen3-8b --coordinator-address node0:12345 --num-processes 2 \
        --process-id 0 data_dir=...                                            # one process per GPU node

The stages (data, training, export, calibration, evaluation; each resumable) are in
:mod:`dspark_jax.training.pipeline`, the ``--dry-run`` planner in :mod:`dspark_jax.training.dry_run`,
the recipes (``--preset`` / ``--config NAME``) in :mod:`dspark_jax.training.recipes`, multi-process
runs (TPU pod slices, several GPU nodes) in :mod:`dspark_jax.training.distributed`.
Every field of :class:`~dspark_jax.training.train_config.TrainConfig` is a ``key=value`` override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dspark_jax.decoding import disk_cache
from dspark_jax.errors import DSparkInputError
from dspark_jax.training.distributed import add_distributed_arguments, initialize_distributed, spec_from_args
from dspark_jax.training.dry_run import dry_run, serve_dry_run
from dspark_jax.training.overrides import apply_overrides
from dspark_jax.training.pipeline import run
from dspark_jax.training.recipes import DEFAULT_RECIPE, TRAIN_PRESETS, load_config_file
from dspark_jax.training.train_config import TrainConfig

# One-line notes shown after a key's default in --help (full docs: TrainConfig's docstring).
_FIELD_NOTES = {
    "feature_cache": "folder of the target-feature cache: target forward once per sequence, not per step (empty = off)",
    "feature_cache_dtype": "float32 (same numbers as uncached) or bfloat16 (half the disk)",
    "lr_schedule": "cosine (warmup + cosine) or wsd (warmup, constant, linear decay over the last decay_frac)",
    "mesh": "device mesh over data/fsdp/model, e.g. data:2,model:4 (empty = every device on data)",
}


def _field_help() -> str:
    """One ``key=value`` line per config key (the default preset's values); a nested config's keys with their
    flat alias."""
    lines, default = [], TRAIN_PRESETS[DEFAULT_RECIPE]
    flat = {path: alias for alias, path in TrainConfig.KEY_ALIASES.items()}
    for f in dataclasses.fields(TrainConfig):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            for sub in dataclasses.fields(value):
                key = f"{f.name}.{sub.name}"
                alias = f"  # or {flat[key]}=" if key in flat else ""
                lines.append(f"  {key}={getattr(value, sub.name)!r}{alias}")
            continue
        note = f"  # {_FIELD_NOTES[f.name]}" if f.name in _FIELD_NOTES else ""
        lines.append(f"  {f.name}={value!r}{note}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.train",
        description="Train a DSpark (or DFlash) drafter for a target model by self-distillation, "
        "save Orbax checkpoints, export it, and report tau on held-out prompts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"config keys (override with key=value; defaults shown for the {DEFAULT_RECIPE} preset):\n"
        + _field_help(),
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=sorted(TRAIN_PRESETS),
        help="built-in recipe to start from (default: stories260k)",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="NAME|FILE",
        help="built-in recipe name or YAML/JSON file of config keys, applied after --preset",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="read only the target's config (no weights), build the drafter abstractly, print "
        "parameter counts and a per-device memory estimate as JSON, then exit",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: number of devices to plan the per-device batch and memory for "
        "(default: the visible devices)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        metavar="AXIS:N,...",
        help="device mesh over data/fsdp/model, e.g. data:2,model:4 (same as mesh=...; default: "
        "every device on data, parameters replicated)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="with --dry-run: per-device memory; prints 'per-device total: X GiB (fits|does not fit G GiB)'",
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="with --dry-run: plan serving (engine weights + KV caches of --num-slots x --cache-len, "
        "tensor parallel; default mesh model:N) instead of training",
    )
    p.add_argument("--num-slots", type=int, default=64, help="with --dry-run --serve: decode slots (default 64)")
    p.add_argument(
        "--cache-len", type=int, default=4096, help="with --dry-run --serve: KV-cache positions per slot (default 4096)"
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE.jsonl",
        help="extra training prompts (JSONL with prompt/text/question/turns); same as prompts_file=FILE",
    )
    p.add_argument("--skip-eval", action="store_true", help="do not evaluate tau after training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=500 block_size=8")
    add_distributed_arguments(p)
    return p


def load_config(args: argparse.Namespace) -> TrainConfig:
    """Preset, then config file (or recipe name), then ``key=value`` overrides.

    Raises:
      DSparkInputError: unreadable config file, unknown recipe, or unknown/bad keys.
    """
    if args.config:
        cfg = load_config_file(args.config, args.preset)
    else:
        cfg = TRAIN_PRESETS[args.preset or DEFAULT_RECIPE]
    cfg = _apply(cfg, args.overrides)
    if args.prompts:
        cfg = _apply(cfg, {"prompts_file": args.prompts})
    return cfg


def _apply(cfg, overrides):
    try:
        return apply_overrides(cfg, overrides)
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


def _layout_line(report: dict) -> str:
    """``processes: P x D devices, mesh ..., per-process batch B of G`` of a training plan."""
    lay = report["process_layout"]
    return (
        f"processes: {lay['processes']} x {lay['devices_per_process']} devices, mesh {report['mesh']}, "
        f"per-process batch {lay['per_process_batch']} of {report['global_batch']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args)
        if args.mesh is not None:
            cfg = _apply(cfg, {"mesh": args.mesh})
        if args.serve and not args.dry_run:
            raise DSparkInputError(
                "--serve plans serving memory and needs --dry-run (serve with python -m dspark_jax.serve)"
            )
        if args.dry_run and args.serve:
            report = serve_dry_run(
                cfg,
                num_slots=args.num_slots,
                cache_len=args.cache_len,
                devices=args.devices,
                device_memory_gib=args.device_memory_gib,
            )
            print(json.dumps(report, indent=2))
            print(report["summary"], file=sys.stderr)
            return 0
        spec = spec_from_args(args)
        if args.dry_run:
            report = dry_run(
                cfg,
                devices=args.devices,
                device_memory_gib=args.device_memory_gib,
                num_processes=spec.num_processes or 1,
            )
            print(json.dumps(report, indent=2))
            if report["process_layout"]["processes"] > 1:  # one process: the summary says it all
                print(_layout_line(report), file=sys.stderr)
            print(report["summary"], file=sys.stderr)
            return 0
        initialize_distributed(spec)  # before anything touches a device
        disk_cache.enable_compilation_cache()  # a resumed run skips compiling its step again
        run(cfg, evaluate=not args.skip_eval)
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
