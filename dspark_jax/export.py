"""``python -m dspark_jax.export``: writes a drafter in DeepSpec's or speculators' checkpoint format.

::

    python -m dspark_jax.export runs/smollm2-135m-instruct/export --target smollm2-135m-instruct \\
        --format speculators --out runs/smollm2-speculators --dtype bfloat16

``DRAFTER`` is anything :func:`~dspark_jax.drafters.checkpoint.load_drafter` takes (an export of this
project, a DeepSpec / speculators / z-lab directory, a Hub id); ``--target`` anything
:func:`~dspark_jax.api.load_target` takes. The writing is :mod:`dspark_jax.drafters.format_export`.
Exit status 0, or 2 with one ``error:`` line (a drafter the format cannot express, another target's
drafter, missing files).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.export",
        description="Write a drafter as DeepSpec's Qwen3DSparkModel or speculators' dspark checkpoint "
        "(config.json + model.safetensors), for vLLM, SGLang, sglang-jax and llama.cpp.",
    )
    p.add_argument("drafter", help="drafter: an export directory, a DeepSpec/speculators directory or a Hub id")
    p.add_argument("--target", required=True, help="the drafter's target (a preset or a model path)")
    p.add_argument("--format", required=True, choices=["deepspec", "speculators"], help="checkpoint format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="tensor dtype (default: the drafter's)"
    )
    p.add_argument("--verifier", default=None, help="speculators' verifier name_or_path (default: --target as given)")
    return p


def run(args: argparse.Namespace) -> str:
    """Loads, checks and writes; returns the output directory."""
    import jax.numpy as jnp

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.checkpoint import load_drafter, read_export_meta
    from dspark_jax.drafters.format_export import export_blockers, export_to_format
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import target_config

    meta = read_export_meta(args.drafter)  # fail fast, before loading the target's weights
    blockers = export_blockers(
        DrafterConfig.from_dict(meta["config"]), args.format, target_config(args.target).num_layers
    )
    if blockers:
        raise DSparkInputError(f"this drafter cannot be written in {args.format}'s format: {'; '.join(blockers)}")
    target, _ = load_target(args.target)
    drafter, _ = load_drafter(args.drafter, target=target)
    dtype = jnp.dtype(args.dtype) if args.dtype else None
    verifier = args.verifier or args.target  # what vLLM / speculators load as the verifier
    out, notes = export_to_format(drafter, target, args.format, args.out, dtype=dtype, verifier=verifier)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"wrote {args.format} checkpoint to {out}")
    return str(out)


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    code, _ = run_cli(run, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
