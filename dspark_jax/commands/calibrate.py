"""``python -m dspark_jax.calibrate``: fit an export's confidence calibration on a mix of prompt sets.

The training run calibrates on prompts of its own split (``python -m dspark_jax.train``, stage 3b).
This command calibrates an existing export on held-out prompts of your choice, for example the first
turns 20..39 of four chat sets when an evaluation reads turns 0..19 (paper Appendix A5; the fit is
:func:`dspark_jax.training.calibration.calibrate_export`)::

    python -m dspark_jax.calibrate --target smollm2-135m-instruct --drafter runs/smollm2/export \\
        --prompts mt_bench,gsm8k,humaneval,alpaca --skip 20 --num-prompts 20 \\
        --exclude-data ../shared/data/distill/smollm2-135m-instruct

The temperatures and biases are written into the export (``calibration`` / ``calibration_bias``:
sampled rows, ``calibration_greedy`` / ``calibration_greedy_bias``: rows at T = 0); the full report
goes to ``--report`` (default ``<export>/calibration_report.json``); one JSON line (temperatures,
biases, ECE / AUROC / Brier before and after, sizes, seconds) is printed.
Exit status 2 with a one-line ``error:`` message on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["build_parser", "main", "select_prompts"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.calibrate",
        description="Fit a drafter export's confidence temperatures and biases on the target's continuations of "
        "held-out prompts (a mix of prompt sets) and store them in the export.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="preset or model path (as for python -m dspark_jax.eval)")
    p.add_argument("--drafter", required=True, help="drafter export directory (rewritten in place)")
    p.add_argument(
        "--prompts",
        required=True,
        metavar="SETS",
        help="comma-separated prompt sets or JSONL files (as for python -m dspark_jax.eval)",
    )
    p.add_argument("--skip", type=int, default=0, help="prompts skipped at the start of each set (default 0)")
    p.add_argument("--num-prompts", type=int, default=32, help="prompts taken from each set after --skip (default 32)")
    p.add_argument(
        "--exclude-data",
        default=None,
        metavar="DIR",
        help="training shard folder (shard_*.npz): prompts that are a training sequence's prompt are dropped",
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, default=128, help="longer prompts are dropped (tokens, default 128)"
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="continuation length (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="stored sequence length (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts generated together (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampled continuations (default 0)")
    p.add_argument("--report", default=None, help="report path (default <export>/calibration_report.json)")
    return p


def select_prompts(
    sets: dict[str, list[list[int]]], skip: int, num: int, max_tokens: int, trained: set[tuple[int, ...]]
) -> tuple[list[list[int]], dict[str, int]]:
    """Prompts ``[skip, skip + num)`` of every set (token ids), less those longer than
    ``max_tokens`` and those in ``trained``; returns them and how many each set kept."""
    out, kept = [], {}
    for name, ids in sets.items():
        chosen = [p for p in ids[skip : skip + num] if len(p) <= max_tokens and tuple(p) not in trained]
        out += chosen
        kept[name] = len(chosen)
    return out, kept


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.data.prompts import load_prompt_texts
    from dspark_jax.decoding.loading import encode_prompt, load_target_and_drafter
    from dspark_jax.drafters.dspark import DSparkDrafter
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import preset_info
    from dspark_jax.training.calibration import calibrate_export
    from dspark_jax.training.data import load_shards
    from dspark_jax.training.recipes import TRAIN_PRESETS
    from dspark_jax.training.train_config import TrainConfig

    try:
        if args.skip < 0:
            raise DSparkInputError("--skip must be >= 0")
        if args.num_prompts < 1:
            raise DSparkInputError("--num-prompts must be >= 1")
        target, tok, drafter = load_target_and_drafter(args.target, args.drafter)
        if not isinstance(drafter, DSparkDrafter) or not drafter.cfg.has_confidence:
            raise DSparkInputError(f"{args.drafter} is not a DSpark drafter with a confidence head")
        chat = bool(preset_info(args.target).get("chat"))
        names = [s.strip() for s in args.prompts.split(",") if s.strip()]
        window = slice(args.skip, args.skip + args.num_prompts)  # only the window is tokenized
        sets = {s: [encode_prompt(tok, t, chat) for t in load_prompt_texts(s)[0][window]] for s in names}
        trained: set[tuple[int, ...]] = set()
        if args.exclude_data:
            shards = sorted(Path(args.exclude_data).glob("shard_[0-9]*[0-9].npz"))
            if not shards:
                raise DSparkInputError(f"no shard_*.npz in {args.exclude_data}")
            data = load_shards(shards)
            trained = {tuple(int(x) for x in r[:n]) for r, n in zip(data["tokens"], data["prompt_lengths"])}
        ids, kept = select_prompts(sets, 0, args.num_prompts, args.max_prompt_tokens, trained)
        base = TRAIN_PRESETS.get(args.target, TrainConfig())
        summary = calibrate_export(
            target,
            drafter,
            ids,
            args.drafter,
            args.report or Path(args.drafter, "calibration_report.json"),
            max_new_tokens=args.max_new_tokens or base.gen_max_new_tokens,
            seq_len=args.seq_len or base.seq_len,
            seed=args.seed,
            batch_size=args.batch_size or base.gen_batch_size,
            source=f"prompts {args.skip}..{args.skip + args.num_prompts - 1} of {', '.join(names)} (kept {kept})",
        )
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"prompts": kept, **summary}))
    return 0
