"""``python -m dspark_jax.eval``: evaluate a drafter on a prompt set, with plots.

Examples::

    python -m dspark_jax.eval --target stories260k --drafter runs/stories260k/export \\
        --prompts tinystories --num-prompts 50 --out runs/stories260k/eval_tinystories
    python -m dspark_jax.eval --target smollm2-135m-instruct --drafter runs/smollm2/export \\
        --prompts mt_bench --num-prompts 20 --max-new-tokens 128 --temperature 1 --out /tmp/ev

Speculative decoding over the prompts; writes ``OUT/eval.json`` with the metrics of
docs/design.md#metrics (tau incl. the bonus/correction token, acceptance rate,
accept rate @k = fraction of rounds with >= k accepted drafts, position-wise
conditional acceptance) and, for a drafter with a confidence head, the reliability of
the cumulative survival observed during decoding against the predicted one (raw head,
and with the export's calibration temperatures when it has them); plus
``OUT/position_acceptance.png`` and ``OUT/reliability.png``.

Prompt sets (from ``$DSPARK_DATA/prompts``): ``mt_bench`` (first turns),
``gsm8k`` (``question``), ``humaneval`` (``prompt``), ``alpaca`` (Eagle's Alpaca
questions, first turns), ``tinystories`` (story openings; the held-out split of the
drafter's training run when the export records a TinyStories run), or a JSONL file
(``prompt`` / ``text`` / ``question`` / ``turns``). Exit status 2 with a one-line
``error:`` message on bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_jax.commands.flags import (
    add_attention_argument,
    add_dtype_argument,
    add_sampling_arguments,
    add_verification_argument,
)
from dspark_jax.data.prompts import PROMPT_SETS, load_prompt_texts
from dspark_jax.decoding import disk_cache
from dspark_jax.decoding.request import DecodeRequest

if TYPE_CHECKING:  # annotations only: the heavy imports stay lazy so that --help is instant
    from dspark_jax.drafters.base import Drafter
    from dspark_jax.models.target import Target
    from dspark_jax.models.tokenizer import Tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.eval",
        description="Evaluate a DSpark/DFlash drafter by speculative decoding over a prompt set: tau, acceptance, "
        "accept rate @k, position-wise acceptance and confidence calibration -> OUT/eval.json and "
        "two PNG plots.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="prompt sets: " + ", ".join(PROMPT_SETS) + " (from $DSPARK_DATA/prompts), or a .jsonl / .jsonl.gz "
        "file with one prompt per line",
    )
    p.add_argument(
        "--target",
        required=True,
        help="preset (stories260k, smollm2-135m-instruct) or path to a .gguf file, a llama2.c .bin "
        "(tok*.bin beside it) or a Hugging Face model directory",
    )
    p.add_argument("--drafter", required=True, help="drafter export directory written by `python -m dspark_jax.train`")
    p.add_argument(
        "--prompts",
        required=True,
        metavar="SET_OR_FILE",
        help="prompt set: " + ", ".join(PROMPT_SETS) + ", or a JSONL file of prompts",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=50,
        help="use the first N prompts of the set (default 50; fewer if the set is smaller)",
    )
    d = DecodeRequest.field_defaults()
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=d["max_new_tokens"],
        help=f"maximum generated tokens per prompt (default {d['max_new_tokens']})",
    )
    add_sampling_arguments(p, d)
    add_verification_argument(p, d)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap prompts in the tokenizer's chat template (default for chat presets)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt texts as they are")
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default 16)")
    p.add_argument(
        "--seed", type=int, default=d["seed"], help=f"PRNG seed; prompt i uses seed + i (default {d['seed']})"
    )
    add_dtype_argument(p)
    add_attention_argument(p)
    p.add_argument("--out", required=True, help="output directory for eval.json and the plots (created)")
    disk_cache.add_cache_arguments(p)
    return p


def _validate(args: argparse.Namespace) -> None:
    from dspark_jax.decoding.validation import check_max_new_tokens, check_sampling, check_seeds
    from dspark_jax.errors import DSparkInputError

    if args.num_prompts < 1:
        raise DSparkInputError("--num-prompts must be >= 1")
    check_max_new_tokens(args.max_new_tokens, 1, "--max-new-tokens")
    try:  # the decode API's checks, before any model is loaded
        check_sampling(args.temperature, args.top_k, args.top_p)
        check_seeds(args.seed, 1)
    except DSparkInputError as e:  # "top_k must ..." -> "--top-k must ..."
        raise DSparkInputError(f"--{str(e).replace('_', '-', 1)}") from None
    if args.batch_size < 1:
        raise DSparkInputError("--batch-size must be >= 1")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DSparkInputError(f"--out {out} exists and is not a directory")


_METRIC_DEFINITIONS = {
    "tau": "tokens emitted per target verification pass (accepted drafts + bonus/correction), "
    "total emitted / total passes",
    "acceptance_rate": "accepted drafts / verified drafts",
    "accept_rate_at_k": "fraction of rounds (target passes, incl. passes that verify nothing at the "
    "max_new_tokens limit) with >= k accepted drafts, k = 1..num_speculative_tokens (the block size "
    "with 'auto'); "
    "tau <= 1 + sum_k accept_rate_at_k (equal without stop tokens)",
    "position_acceptance": "among rounds whose positions 1..k-1 were accepted and k verified, the "
    "fraction where k was accepted",
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the evaluation described by parsed ``args``; returns the eval.json dict.

    Writes ``OUT/eval.json`` and the two plots (:func:`~dspark_jax.evaluation.plots.write_plots`).

    Raises:
      DSparkInputError: bad flags, an unreadable export / prompt set / target, a drafter that
        does not fit the target, ``--num-speculative-tokens`` outside its block, or no prompt that
        fits the target's context.
    """
    from dspark_jax.decoding.loading import load_target
    from dspark_jax.decoding.request import load_drafter_for
    from dspark_jax.drafters.checkpoint import read_export_meta
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.evaluation.acceptance import evaluate_tau
    from dspark_jax.evaluation.plots import write_plots
    from dspark_jax.evaluation.reliability import jsonable

    disk_cache.apply_cache_arguments(args)
    _validate(args)
    meta = read_export_meta(args.drafter)  # fail fast, before loading the target
    texts, source = load_prompt_texts(args.prompts, meta)
    texts = texts[: args.num_prompts]
    if not texts:
        raise DSparkInputError(f"prompt set {args.prompts!r} is empty")
    target, tok = load_target(args.target, dtype=args.dtype, attention_backend=args.attention_backend)
    drafter, meta = load_drafter_for(target, tok, args.drafter, target.dtype)
    kept, num_skipped, chat = _encode(args, target, tok, texts)
    has_conf = drafter.cfg.has_confidence
    ev = evaluate_tau(
        target,
        drafter,
        kept,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_speculative_tokens=args.num_speculative_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        record_rounds=has_conf,
    )
    rounds = ev.pop("rounds", None)
    out: dict[str, Any] = {
        "target": target.cfg.name,
        "drafter": str(Path(args.drafter).resolve()),
        "variant": drafter.cfg.variant,
        "block_size": drafter.cfg.block_size,
        "prompts": {
            "set": args.prompts,
            "source": source,
            "num_prompts": len(kept),
            "num_skipped_too_long": num_skipped,
            "chat": chat,
        },
        "seed": args.seed,
        "batch_size": args.batch_size,
        **ev,
        "metric_definitions": dict(_METRIC_DEFINITIONS),
    }
    out["calibration"] = _decode_calibration(args, drafter, meta, rounds) if has_conf else None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = jsonable(out)
    out["plots"] = write_plots(out, out_dir)
    (out_dir / "eval.json").write_text(json.dumps(out, indent=2))
    return out


def _encode(
    args: argparse.Namespace, target: Target, tok: Tokenizer, texts: list[str]
) -> tuple[list[list[int]], int, bool]:
    """``(token ids of the prompts that fit the target's context, number skipped, chat)``;
    ``chat`` is ``--chat`` / ``--no-chat``, else whether the target preset is a chat model.

    Raises:
      DSparkInputError: every prompt is too long for the target's context.
    """
    from dspark_jax.decoding.loading import encode_prompt
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import preset_info

    chat = args.chat if args.chat is not None else bool(preset_info(args.target).get("chat"))
    ids = [encode_prompt(tok, t, chat) for t in texts]
    room = target.cfg.max_position - 1
    kept = [p for p in ids if len(p) < room]
    if not kept:
        raise DSparkInputError(f"every prompt is longer than the target's context ({target.cfg.max_position} tokens)")
    return kept, len(ids) - len(kept), chat


def _decode_calibration(
    args: argparse.Namespace, drafter: Drafter, meta: dict[str, Any], rounds: list | None
) -> dict[str, Any]:
    """The ``calibration`` entry of eval.json: the temperatures and biases decoding used, the reliability of
    the survival observed in ``rounds`` (:func:`~dspark_jax.evaluation.reliability.decode_reliability`)
    and the held-out fit the export records."""
    from dspark_jax.evaluation.reliability import decode_reliability

    greedy = args.temperature <= 0 and drafter.calibration_greedy
    cal, bias = (
        (drafter.calibration_greedy, drafter.calibration_greedy_bias)
        if greedy
        else (drafter.calibration, drafter.calibration_bias)
    )  # the calibration decoding used for these rows
    temps = list(cal) if cal is not None else None
    biases = list(bias) if bias is not None else None
    rel = decode_reliability(rounds or [], drafter.cfg.block_size, temps, biases=biases)
    return {
        "temperatures": temps,
        "biases": biases,
        "decode": rel,
        "heldout_fit": ((meta.get("extra") or {}).get("calibration")),
    }


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    status, out = run_cli(run, args)
    if status or out is None:
        return status
    summary = {k: out.get(k) for k in ("tau", "acceptance_rate", "accept_rate_at_k", "position_acceptance")}
    dec = (out.get("calibration") or {}).get("decode") or {}
    for name in ("before", "after"):
        if dec.get(name):
            summary[f"decode_calibration_{name}"] = {k: dec[name]["pooled"][k] for k in ("ece", "auroc", "brier")}
    summary["out"] = str(Path(args.out).resolve())
    print(json.dumps(summary))
    return 0
