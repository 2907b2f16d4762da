"""Batch-1 speed table: prompt sets x decoders x temperatures, with the cost-table bound beside
every measured speedup.

For each temperature and prompt set, :func:`speedup.measure_speed` decodes the set's first
``--num-prompts`` prompts (first turns; the chat template for chat presets) one at a time with
plain JAX decoding, ``transformers`` ``generate`` and the drafter at each
``--num-speculative-tokens`` (fixed lengths and ``auto``), interleaved prompt by prompt,
``--repeats`` times; tokens/s and speedups are medians over the repeats. Every drafter row's
bound ``tau * T_step / (T_draft + T_verify)`` is priced by the cost tables the decode loop itself
uses (:func:`speedup.cost_table_bound`): per pass ``T_draft`` if the round drafted and
``T_verify(w)`` at the compiled width ``w`` it verified with, so ``auto``'s bound uses the mix of
widths it chose (and the rounds where it skipped drafting), printed under each table. The bound
models the decode phase, so it is set beside the decode-phase speedup: tokens after the first
over the seconds minus the prefill's, timed alone per prompt with the loop's own prefill
(:func:`speedup.prefill_seconds`; transformers has none); their ratio is the decode loop's
overhead the bound does not model. The end-to-end speedup (prefill included) is the headline.

Prints one markdown table per temperature (rows: set x decoder, plus a macro-average over the
sets) and the checks of the batch-1 goals (``auto`` >= 1.3x plain macro-averaged and >= 0.95x
on every set; every drafter row within 10% of its bound), and writes everything, with the
command line and the cost tables, to ``--json``::

    python -m benchmarks.speed_table --target smollm2-135m-instruct --drafter EXPORT \\
        --prompts mt_bench,gsm8k,humaneval,alpaca --num-prompts 4 --max-new-tokens 128 \\
        --temperatures 0,1 --num-speculative-tokens 2,4,8,auto --repeats 3 --json speed_table.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import speedup
from benchmarks.harness import cell, command_line, write_json
from benchmarks.hf_baseline import hf_llama_from_params

GOAL_AUTO_MACRO = 1.3  # auto's macro-average speedup over plain at T=0, batch 1
GOAL_AUTO_MIN = 0.95  # auto's speedup on every set
GOAL_BOUND_TOL = 0.10  # measured speedup within 10% of the bound


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speed_table", description="Batch-1 speed table over prompt sets and temperatures."
    )
    ap.add_argument("--target", required=True, help="preset (stories260k, smollm2-135m-instruct) or model path")
    ap.add_argument("--drafter", required=True, help="drafter export directory")
    ap.add_argument(
        "--prompts",
        default="mt_bench,gsm8k,humaneval,alpaca",
        help="comma-separated prompt sets (tinystories, mt_bench, gsm8k, humaneval, alpaca) or JSONL files",
    )
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per set (the first ones that fit)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    ap.add_argument("--num-speculative-tokens", default="2,4,8,auto", help="comma-separated lengths and/or 'auto'")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes over each set (medians)")
    ap.add_argument(
        "--cost-repeats",
        type=int,
        default=15,
        help="repeats of the cost tables measured ahead (auto decides by them and the bounds are priced by them)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--json", default="", help="write the results here")
    return ap


def load_sets(names: list[str], tok, chat: bool, meta: dict, n: int, room: int) -> tuple[dict, dict]:
    """``{set: [token ids]}`` of each set's first ``n`` prompts no longer than ``room`` tokens,
    and ``{set: {"source", "skipped_too_long"}}``."""
    from dspark_jax.api import encode_prompt
    from dspark_jax.data.prompts import load_prompt_texts

    sets, info = {}, {}
    for name in names:
        texts, source = load_prompt_texts(name, meta)
        ids, skipped = [], 0
        for t in texts:
            if len(ids) == n:
                break
            p = encode_prompt(tok, t, chat)
            if len(p) <= room:
                ids.append(p)
            else:
                skipped += 1
        if not ids:
            raise SystemExit(f"error: no prompt of {name!r} fits {room} tokens")
        sets[name], info[name] = ids, {"source": source, "skipped_too_long": skipped}
    return sets, info


def rows_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one :func:`speedup.measure_speed` result: plain, transformers, drafters."""
    ar = run["ar"]
    n = run["num_prompts"]
    rows = [dict(decoder="plain JAX", tau=1.0, tokens_per_s=ar["tokens_per_s"], speedup=1.0, decode_speedup=1.0)]
    hf = run.get("hf_transformers")
    if hf:
        rows.append(
            dict(
                decoder="transformers",
                tau=1.0,
                tokens_per_s=hf["tokens_per_s"],
                speedup=hf["vs_jax_ar"],
                same_as_plain=f"{hf['same_as_ar']}/{n}",
            )
        )
    for name, d in run["drafters"].items():
        rows.append(
            dict(
                decoder=name,
                tau=d["tau"],
                tokens_per_s=d["tokens_per_s"],
                speedup=d["speedup"],
                decode_speedup=d.get("decode_speedup"),
                bound=d["bound"],
                ratio=d["bound_ratio"],
                same_as_plain=f"{d['same_as_ar']}/{n}",
                width_mix=d.get("width_mix"),
                drafting_fraction=d.get("drafting_fraction"),
            )
        )
    return rows


def macro_rows(per_set: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per decoder, the mean over the sets of tau, tokens/s, speedups and bound; the ratio is
    the mean decode-phase speedup over the mean bound."""
    out = []
    for decoder in [r["decoder"] for r in next(iter(per_set.values()))]:
        rs = [r for rows in per_set.values() for r in rows if r["decoder"] == decoder]
        m = {k: statistics.fmean(r[k] for r in rs) for k in ("tau", "tokens_per_s", "speedup")}
        m.update(decoder=decoder, min_speedup=min(r["speedup"] for r in rs))
        if all(r.get("decode_speedup") is not None for r in rs):
            m["decode_speedup"] = statistics.fmean(r["decode_speedup"] for r in rs)
        if all(r.get("bound") for r in rs) and "decode_speedup" in m:
            m["bound"] = statistics.fmean(r["bound"] for r in rs)
            m["ratio"] = m["decode_speedup"] / m["bound"]
        out.append(m)
    return out


def checks(per_set: dict[str, list], macro: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch-1 goals: ``auto``'s macro speedup and worst set, and every bound ratio."""
    ratios = [r["ratio"] for rows in per_set.values() for r in rows if r.get("ratio") is not None]
    out: dict[str, Any] = {
        "bound_ratio_min": min(ratios, default=None),
        "bound_ratio_max": max(ratios, default=None),
        "all_within_bound_tolerance": bool(ratios) and all(abs(x - 1) <= GOAL_BOUND_TOL for x in ratios),
    }
    auto = next((m for m in macro if m["decoder"] == "drafter-auto"), None)
    if auto is not None:
        out.update(
            auto_macro_speedup=auto["speedup"],
            auto_min_speedup=auto["min_speedup"],
            auto_macro_goal_met=auto["speedup"] >= GOAL_AUTO_MACRO,
            auto_min_goal_met=auto["min_speedup"] >= GOAL_AUTO_MIN,
        )
    return out


def markdown(key: str, res: dict[str, Any]) -> str:
    """One temperature's table, auto's width mixes and the goal checks."""
    b = res["budget"]
    lines = [
        f"### {key}: batch 1, {b['num_prompts']} prompts per set, {b['max_new_tokens']} new tokens, "
        f"medians of {b['repeats']} interleaved repeats",
        "",
        "| set | decoder | tau | tokens/s | speedup vs plain | decode-phase speedup "
        "| bound tau*T_step/(T_draft+T_verify) | decode speedup / bound | same tokens as plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table = res["tables"][key]
    for s, rows in [*table["sets"].items(), ("macro", table["macro"])]:
        for r in rows:
            lines.append(
                f"| {s} | {r['decoder']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} | "
                + " | ".join(cell(r.get(k), ".2f") for k in ("decode_speedup", "bound", "ratio"))
                + " | "
                f"{r.get('same_as_plain', '-')} |"
            )
    mixes = [
        f"{s}: "
        + ", ".join(f"{w} drafts {100 * f:.0f}%" for w, f in sorted(r["width_mix"].items()))
        + f"; drafting in {100 * r['drafting_fraction']:.0f}% of passes"
        for s, rows in table["sets"].items()
        for r in rows
        if r["decoder"] == "drafter-auto" and r.get("width_mix")
    ]
    if mixes:
        lines += ["", "auto's bound prices each pass at the width it chose (share of passes):", ""]
        lines += [f"- {m}" for m in mixes]
    c = table["checks"]
    lines += [
        "",
        f"- decode speedup / bound over drafter rows: {cell(c['bound_ratio_min'], '.2f')} .. "
        f"{cell(c['bound_ratio_max'], '.2f')}"
        f" (goal: within {GOAL_BOUND_TOL:.0%})",
    ]
    if "auto_macro_speedup" in c:
        lines.append(
            f"- auto: macro {c['auto_macro_speedup']:.2f}x (goal >= {GOAL_AUTO_MACRO}x at T=0), worst set "
            f"{c['auto_min_speedup']:.2f}x (goal >= {GOAL_AUTO_MIN}x)"
        )
    return "\n".join(lines)


def check_lengths(parser: argparse.ArgumentParser, lengths: str, block_size: int) -> None:
    """Exits with a usage error (status 2) before anything runs when a fixed length of
    ``--num-speculative-tokens`` has no cost in the cost table the bounds are priced by: the table
    measures the widths ``auto`` compiles (:func:`~dspark_jax.decoding.auto_verify.default_widths`)."""
    from dspark_jax.decoding.auto_verify import default_widths

    widths = default_widths(block_size)
    vals = [v.strip() for v in lengths.split(",")]
    bad = [v for v in vals if v not in ("", "auto") and not (v.isdigit() and int(v) in widths[1:])]
    if bad:
        parser.error(
            f"--num-speculative-tokens {','.join(bad)}: the cost-table bound prices only the widths "
            f"{list(widths[1:])} of a block-{block_size} drafter (and 'auto')"
        )


def run_table(args, target, drafter, sets: dict, hf) -> tuple[dict, dict]:
    """``({"T0": {set: measure_speed result}}, {"T0": {"sets", "macro", "checks"}})`` and collects
    the cost tables into each run's ``cost_tables`` (popped from the drafter rows)."""
    runs: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for t in [float(x) for x in args.temperatures.split(",") if x.strip()]:
        key = f"T{t:g}"
        runs[key] = {}
        for name, ids in sets.items():
            runs[key][name] = speedup.measure_speed(
                target,
                speedup.speculative_entries(drafter, args.num_speculative_tokens),
                ids,
                max_new_tokens=args.max_new_tokens,
                temperature=t,
                seed=args.seed,
                hf_model=hf,
                repeats=args.repeats,
                bound_from="cost_table",
                cost_repeats=args.cost_repeats,
            )
        per_set = {name: rows_of(r) for name, r in runs[key].items()}
        macro = macro_rows(per_set)
        tables[key] = {"sets": per_set, "macro": macro, "checks": checks(per_set, macro)}
    return runs, tables


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.models.presets import preset_info, resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    t0, load0 = time.perf_counter(), os.getloadavg()
    cfg, params, tok = resolve_target(args.target)
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    drafter, meta = load_drafter(args.drafter)
    check_lengths(build_parser(), args.num_speculative_tokens, drafter.cfg.block_size)
    chat = bool(preset_info(args.target).get("chat"))
    room = cfg.max_position - args.max_new_tokens - drafter.cfg.block_size - 2
    sets, set_info = load_sets(
        [s.strip() for s in args.prompts.split(",") if s.strip()], tok, chat, meta, args.num_prompts, room
    )
    hf = None if args.no_hf else hf_llama_from_params(cfg, params)
    runs, tables = run_table(args, target, drafter, sets, hf)
    cost_tables: dict[str, Any] = {}
    for by_set in runs.values():
        for r in by_set.values():
            for d in r["drafters"].values():
                cost_tables.update({str(k): v for k, v in d.pop("cost_tables", {}).items()})
    import jax

    res = {
        "command": command_line("speed_table", argv),
        "target": args.target,
        "target_name": cfg.name,
        "drafter": str(Path(args.drafter).resolve()),
        "block_size": drafter.cfg.block_size,
        "chat_template": chat,
        "budget": {
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "seed": args.seed,
            "cost_repeats": args.cost_repeats,
        },
        "prompt_sets": {s: {**set_info[s], "num_prompts": len(ids)} for s, ids in sets.items()},
        "cost_tables": cost_tables,  # by KV-cache length [tokens]; milliseconds
        "tables": tables,
        "runs": runs,
        "machine": {
            "device": str(jax.devices()[0]),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
        },
        "wall_seconds": time.perf_counter() - t0,
    }
    for key in tables:
        print(markdown(key, res) + "\n")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
