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
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_jax.decoding import disk_cache
from dspark_jax.decoding.cli import (
    add_attention_argument,
    add_dtype_argument,
    add_sampling_arguments,
    add_verification_argument,
)
from dspark_jax.decoding.request import DecodeRequest

if TYPE_CHECKING:  # annotations only: the heavy imports stay lazy so that --help is instant
    from dspark_jax.drafters.base import Drafter
    from dspark_jax.models.target import Target
    from dspark_jax.models.tokenizer import Tokenizer

PROMPT_SETS = {
    "tinystories": None,
    "mt_bench": "mt_bench_question.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "alpaca": "eagle_alpaca_question.jsonl",
}


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


def load_prompt_texts(spec: str, export_meta: dict | None = None) -> tuple[list[str], str]:
    """Prompt texts of a named set or a JSONL file, and a description of their source.

    ``tinystories``: when ``export_meta`` records a TinyStories training run, the
    held-out split of that run (the prompts its training never saw), else all openings.

    Raises:
      DSparkInputError: unknown set / missing file / unreadable rows.
    """
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.evaluation import prompts as prompts_mod

    if spec == "tinystories":
        texts = prompts_mod.tinystories_openings()
        cfg = ((export_meta or {}).get("extra") or {}).get("config") or {}
        if cfg.get("prompts") == "tinystories" and not cfg.get("prompts_file"):
            n_eval = min(int(cfg.get("num_eval_prompts", 0)), len(texts) // 5)
            if n_eval > 0:
                _, held = prompts_mod.split_prompts(texts, n_eval, int(cfg.get("seed", 0)))
                return held, f"tinystories openings: the {n_eval} held-out prompts of the drafter's training run"
        return texts, "tinystories openings (the export records no TinyStories training split: may overlap training)"
    if spec in PROMPT_SETS:
        path = prompts_mod.shared_data_dir() / "prompts" / PROMPT_SETS[spec]
        if not path.exists():
            raise DSparkInputError(f"prompt set {spec!r} not found at {path} (set DSPARK_DATA)")
        return prompts_mod.read_prompt_file(path), str(path)
    path = Path(spec)
    if not path.is_file():
        raise DSparkInputError(f"--prompts {spec!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a file")
    return prompts_mod.read_prompt_file(path), str(path.resolve())


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

    Writes ``OUT/eval.json`` and the two plots (:func:`write_plots`).

    Raises:
      DSparkInputError: bad flags, an unreadable export / prompt set / target, a drafter that
        does not fit the target, ``--num-speculative-tokens`` outside its block, or no prompt that
        fits the target's context.
    """
    from dspark_jax.api import load_target
    from dspark_jax.decoding.request import load_drafter_for, resolve_num_speculative_tokens
    from dspark_jax.drafters.checkpoint import read_export_meta
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.evaluation.acceptance import evaluate_tau
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
    n_spec = resolve_num_speculative_tokens(drafter, args.num_speculative_tokens)
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
        num_speculative_tokens=n_spec,
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
    from dspark_jax.api import encode_prompt
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


def _f(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x * scale, spec)


def write_plots(ev: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """Writes ``position_acceptance.png`` and ``reliability.png``; returns their paths.

    Args:
      ev: the eval.json dict of :func:`run` (after :func:`~dspark_jax.evaluation.reliability.jsonable`).
      out_dir: an existing folder.
    Raises:
      ImportError: matplotlib is not installed (the ``plots`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {
        "position_acceptance": str(out_dir / "position_acceptance.png"),
        "reliability": str(out_dir / "reliability.png"),
    }
    for name, plot in (("position_acceptance", _plot_position_acceptance), ("reliability", _plot_reliability)):
        fig = plot(plt, ev)
        fig.tight_layout()
        fig.savefig(paths[name])
        plt.close(fig)
    return paths


def _plot_position_acceptance(plt: Any, ev: dict[str, Any]) -> Any:
    """Figure: conditional acceptance c_k (bars) and accept rate @k (line) per block position."""
    pa = ev.get("position_acceptance") or []
    n_spec = ev.get("num_speculative_tokens")
    g_used = n_spec if isinstance(n_spec, int) else len(pa)
    pa = pa[:g_used]
    ks = list(range(1, len(pa) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    ax.bar(
        ks, [v if v is not None else 0.0 for v in pa], color="#4C72B0", alpha=0.85, label="conditional acceptance c_k"
    )
    ar = ev.get("accept_rate_at_k") or []
    if ar:
        ax.plot(
            range(1, len(ar) + 1),
            [v if v is not None else float("nan") for v in ar],
            "o-",
            color="#DD8452",
            label="accept rate @k (rounds with >= k accepted)",
        )
    ax.set_xlabel("block position k")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(ks)
    ax.set_title(
        f"{ev.get('target')} / {ev.get('variant')}: tau {_f(ev.get('tau'))}, "
        f"acceptance {_f(ev.get('acceptance_rate'))} ({ev['prompts']['set']})",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return fig


def _plot_reliability(plt: Any, ev: dict[str, Any]) -> Any:
    """Figure: reliability diagram of the predicted cumulative survival during decoding (raw head
    and calibrated), with the per-bin counts below."""
    cal = ev.get("calibration") or {}
    dec = cal.get("decode") or {}
    fig, (ax, axh) = plt.subplots(2, 1, figsize=(5.6, 6.4), dpi=110, gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], "--", color="gray", lw=1, label="perfect calibration")
    styles = {
        "before": ("#C44E52", "raw confidence head"),
        "after": ("#55A868", "calibrated (export temperatures and biases)"),
    }
    for name, (color, label) in styles.items():
        rep = dec.get(name)
        if not rep:
            continue
        rel = rep["reliability"]
        edges = rel["bin_edges"]
        width = edges[1] - edges[0]
        xs = [m for m, c in zip(rel["mean_predicted"], rel["count"]) if c]
        ys = [m for m, c in zip(rel["mean_observed"], rel["count"]) if c]
        pooled = rep["pooled"]
        ax.plot(
            xs,
            ys,
            "o-",
            color=color,
            ms=4,
            label=f"{label}: ECE {_f(pooled.get('ece'), '.1f', 100)}%, AUROC {_f(pooled.get('auroc'), '.3f')}, "
            f"Brier {_f(pooled.get('brier'), '.3f')}",
        )
        off = -width / 4 if name == "before" else width / 4
        axh.bar([e + width / 2 + off for e in edges[:-1]], rel["count"], width=width / 2, color=color, alpha=0.7)
    if not (dec.get("before") or dec.get("after")):
        ax.text(0.5, 0.5, "no confidence head / no verified rounds", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("observed survival (positions 1..k accepted)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title(
        f"reliability of predicted cumulative survival during decoding\n"
        f"({dec.get('num_rounds', 0)} rounds, T={ev.get('temperature')}, {ev['prompts']['set']})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    axh.set_xlabel("predicted survival a_k = prod c_i")
    axh.set_ylabel("count")
    axh.set_yscale("log")
    return fig


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


if __name__ == "__main__":
    sys.exit(main())
