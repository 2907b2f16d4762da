"""``python -m dspark_jax.export``: writes a drafter in DeepSpec's or speculators' checkpoint format.

::

    python -m dspark_jax.export runs/smollm2-135m-instruct/export --target smollm2-135m-instruct \\
        --format speculators --out runs/smollm2-speculators --dtype bfloat16

``DRAFTER`` is anything :func:`~dspark_jax.drafters.checkpoint.load_drafter` takes (an export of this
project, a DeepSpec / speculators / z-lab directory, a Hub id); ``--target`` anything
:func:`~dspark_jax.decoding.loading.load_target` takes, needed unless the drafter carries its own embedding and
LM head (DeepSeek's Gemma 4 drafters; a DeepSpec source directory's other config keys are kept).
The writing is :mod:`dspark_jax.drafters.format_export`.
Exit status 0, or 2 with one ``error:`` line (a drafter the format cannot express, another target's
drafter, missing files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.export",
        description="Write a drafter as DeepSpec's Qwen3DSparkModel or speculators' dspark checkpoint "
        "(config.json + model.safetensors), for vLLM, SGLang, sglang-jax and llama.cpp.",
    )
    p.add_argument("drafter", help="drafter: an export directory, a DeepSpec/speculators directory or a Hub id")
    p.add_argument(
        "--target",
        default=None,
        help="the drafter's target (a preset or a model path); needed unless the drafter has its own embedding "
        "and LM head (e.g. a Gemma 4 one)",
    )
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

    from dspark_jax.config import DrafterConfig
    from dspark_jax.decoding.loading import load_target
    from dspark_jax.drafters.checkpoint import load_drafter, read_export_meta
    from dspark_jax.drafters.format_export import export_blockers, export_to_format
    from dspark_jax.drafters.formats import read_json_object
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import target_config

    meta = read_export_meta(args.drafter)  # fail fast, before loading the target's weights
    cfg = DrafterConfig.from_dict(meta["config"])
    if args.target is None and not cfg.own_embeddings:
        raise DSparkInputError("--target is needed: the drafter reads the target's embedding and LM head")
    depth = target_config(args.target).num_layers if args.target else cfg.target_num_layers or max(cfg.taps) + 1
    blockers = export_blockers(cfg, args.format, depth)
    if blockers:
        raise DSparkInputError(f"this drafter cannot be written in the {args.format} format: {'; '.join(blockers)}")
    target = load_target(args.target)[0] if args.target else None
    drafter, meta = load_drafter(args.drafter, target=target)
    extra = meta.get("extra") or {}
    base = None  # a DeepSpec Gemma 4 source: the config keys its layers do not read are written back
    if cfg.own_embeddings and extra.get("source_format") == "deepspec":
        base = read_json_object(Path(extra["source"]) / "config.json")
    dtype = jnp.dtype(args.dtype) if args.dtype else None
    verifier = args.verifier or args.target or ""  # what vLLM / speculators load as the verifier
    out, notes = export_to_format(
        drafter, target, args.format, args.out, dtype=dtype, verifier=verifier, base_config=base
    )
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"wrote {args.format} checkpoint to {out}")
    return str(out)


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    code, _ = run_cli(run, args)
    return code
