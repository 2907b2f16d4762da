"""DSpark vs DFlash vs Eagle3 on identical data and budget: tau, acceptance curves, speedup.

The paper's headline comparison (paper Section 6; docs/design.md#reference-figures): DSpark's macro-average accepted
length is +16-18% over DFlash and +27-31% over Eagle3 when all are trained on the same
data, and a 2-layer DSpark beats the 5-layer DFlash. This script reproduces it on one
target in one process:

1. self-distillation data generated ONCE (the train stage, :func:`dspark_jax.training.pipeline.prepare_data`)
   into ``OUT/data/data``, or an existing shard folder given by ``--data-dir`` (only read);
2. every drafter trained on those same shards with the same budget (steps, batch,
   anchors per sequence, learning-rate schedule, seed), through ``dspark_jax.training.pipeline.run``
   (checkpoints and exports under ``OUT/<drafter>``; rerunning resumes); the frozen
   target runs once per sequence into ONE feature cache ``OUT/feature_cache`` holding
   the union of every drafter's tap layers (:mod:`dspark_jax.training.feature_cache`; float32, so
   training is numerically the uncached one; ``--no-feature-cache`` to recompute per step);
3. evaluation on the same prompts at temperature 0 and 1 (stories260k: the held-out
   TinyStories openings of the data run; chat targets: the first ``--num-prompts`` first
   turns of MT-Bench, GSM8K, HumanEval and Alpaca with the chat template): tau per
   dataset, macro-average, ratios, conditional acceptance per position;
4. batch-1 wall-clock speedup against plain decoding of the same target, prompts and
   sampling, with the bound ``tau * T_target_step / (T_draft + T_verify)`` and
   ``transformers`` ``generate`` on the same weights (see :mod:`benchmarks.speedup`).

Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/conditional_acceptance.png``.

Usage::

    python -m benchmarks.compare_drafters --target stories260k --steps 300 --out runs/compare_stories260k
    python -m benchmarks.compare_drafters --target smollm2-135m-instruct --steps 400 --num-prompts 10 \\
        --data-dir runs/smollm2-135m-instruct/data --out runs/compare_smollm2
    python -m benchmarks.compare_drafters --quick --out /tmp/cmp      # CI-sized smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import speedup
from benchmarks.drafter_study import (
    DRAFTERS,
    data_summary,
    eval_prompts,
    evaluate_drafter,
    floats,
    shared_feature_cache,
    tkey,
    train_drafter,
)
from benchmarks.harness import cell, command_line, ratio, write_json
from benchmarks.hf_baseline import hf_llama_from_params, hf_parity

DEFAULT_DRAFTERS = ["dspark-2L", "dflash-2L", "dflash-5L", "eagle3", "dspark-2L-gated", "dspark-2L-rnn"]
QUICK_DRAFTERS = ["dspark-2L", "dflash-2L", "eagle3"]
# (numerator, denominator, paper figure) of the reported tau ratios
RATIOS = [
    ("dspark-2L", "dflash-2L", "1.16-1.18 (same depth)"),
    ("dspark-2L", "dflash-5L", "> 1 (2L DSpark beats 5L DFlash)"),
    ("dspark-2L", "eagle3", "1.27-1.31"),
]
# A budget that exercises every stage in well under 90 s on 2 cores (CI).
QUICK = dict(
    num_prompts=48,
    num_eval_prompts=8,
    gen_max_new_tokens=40,
    gen_batch_size=48,
    seq_len=56,
    batch_size=8,
    anchors_per_seq=8,
    log_every=10,
    ckpt_every=1000,
    block_size=4,
    drafter_width=0,
)  # a smoke run: the target's width keeps it short


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_drafters",
        description="Train DSpark / DFlash / Eagle3 drafters on identical data and budget, "
        "compare tau, conditional acceptance and batch-1 speedup.",
    )
    p.add_argument("--target", default="stories260k", choices=["stories260k", "smollm2-135m-instruct"])
    p.add_argument("--steps", type=int, default=None, help="training steps per drafter (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--block-size", type=int, default=None, help="block size of every drafter (default: the preset's)")
    p.add_argument(
        "--drafters",
        default=None,
        help="comma-separated subset of: " + ", ".join(DRAFTERS) + f" (default: {','.join(DEFAULT_DRAFTERS)})",
    )
    p.add_argument("--num-prompts", type=int, default=20, help="evaluation prompts per dataset (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="generated tokens per prompt (default 96)")
    p.add_argument("--temperatures", default="0,1", help="evaluation temperatures (default 0,1)")
    p.add_argument("--speed-prompts", type=int, default=8, help="prompts of the batch-1 speed run (default 8)")
    p.add_argument("--speed-temperatures", default="0", help="temperatures of the speed run (default 0)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--data-dir",
        default=None,
        help="existing self-distillation shards (shard_*.npz) to train every drafter on; only read",
    )
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument(
        "--no-feature-cache",
        action="store_true",
        help="run the frozen target inside every train step instead of reading its features from "
        "the shared cache OUT/feature_cache",
    )
    p.add_argument("--out", required=True, help="output folder (data, runs, results)")
    p.add_argument("--quick", action="store_true", help="CI-sized budget (tiny data, ~30 steps, few prompts)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.models.presets import resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint
    from dspark_jax.training.recipes import TRAIN_PRESETS

    t_all = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.drafters.split(",") if args.drafters else (QUICK_DRAFTERS if args.quick else DEFAULT_DRAFTERS)
    if unknown := [n for n in names if n not in DRAFTERS]:
        print(f"error: unknown drafter(s) {unknown}; choose from {list(DRAFTERS)}", file=sys.stderr)
        return 2
    temps, speed_temps = floats(args.temperatures), floats(args.speed_temperatures)
    base = TRAIN_PRESETS[args.target]
    over, (num_prompts, max_new, speed_n) = budget(args, out)
    if args.data_dir:
        over["data_dir"] = str(Path(args.data_dir).resolve())
    base = base.with_keys(**over)

    cfg_t, params, tok = resolve_target(args.target)
    target = Target(cfg_t, params, fingerprint=params_fingerprint(params))

    # -- 1. identical self-distillation data ------------------------------------------------
    data, data_dir, data_info, eval_texts = shared_data(base, target, tok, bool(args.data_dir))

    # -- 2. identical training budget -------------------------------------------------------
    cfgs = {n: base.with_keys(workdir=str(out / n), data_dir=str(data_dir), **DRAFTERS[n]) for n in names}
    cache_info = None
    if args.no_feature_cache:  # the preset's feature_cache=auto would build one per drafter
        cfgs = {n: dataclasses.replace(c, feature_cache="") for n, c in cfgs.items()}
    else:
        cfgs, cache_info = shared_feature_cache(out / "feature_cache", target, data, cfgs)
    drafters, train_info = train_all(cfgs, target, tok)

    # -- 3. tau on the same prompts -----------------------------------------------------------
    prompts = eval_prompts(args.target, tok, eval_texts, num_prompts, cfg_t.max_position - max_new - 20)
    ebs = 1 if args.quick else args.eval_batch_size  # quick: share the batch-1 speed run's compilation
    tau, ratios = tau_and_ratios(target, drafters, prompts, temps, max_new, ebs, args.seed)

    # -- 4. batch-1 speedup ---------------------------------------------------------------------
    speed_prompts = [p for ids in prompts.values() for p in ids[: max(1, speed_n // len(prompts))]][: max(speed_n, 1)]
    parity, speed = batch1_speed(args, target, params, drafters, speed_prompts, speed_temps, max_new)

    result = {
        "target": args.target,
        "target_name": cfg_t.name,
        "command": command_line("compare_drafters", argv),
        "budget": {
            "steps": base.steps,
            "batch_size": base.batch_size,
            "anchors_per_seq": base.anchors_per_seq,
            "learning_rate": base.learning_rate,
            "block_size": base.drafter.block_size,
            "seq_len": base.seq_len,
            "markov_rank": base.drafter.markov_rank,
            "seed": base.seed,
            "quick": args.quick,
        },
        "data": data_info,
        "feature_cache": cache_info,
        "drafters": train_info,
        "eval": {
            "datasets": {k: len(v) for k, v in prompts.items()},
            "max_new_tokens": max_new,
            "temperatures": temps,
            "batch_size": ebs,
        },
        "tau": tau,
        "ratios": ratios,
        "speed": {"batch_size": 1, "prompts": len(speed_prompts), "hf_logit_max_abs_diff": parity, "runs": speed},
        "total_seconds": None,
    }
    write_results(result, out, t_all)
    return 0


def budget(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], tuple[int, int, int]]:
    """The training overrides every drafter shares (``--quick``'s, the steps, batch and block size
    asked for) and the evaluation's sizes ``(prompts per set, new tokens, speed prompts)``."""
    num_prompts, max_new, speed_n = args.num_prompts, args.max_new_tokens, args.speed_prompts
    over: dict[str, Any] = dict(workdir=str(out / "data"), seed=args.seed)
    if args.quick:
        over.update(QUICK, steps=12)
        num_prompts, max_new, speed_n = min(num_prompts, 3), min(max_new, 24), min(speed_n, 2)
    for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("block_size", args.block_size)):
        if v is not None:
            over[k] = v
    return over, (num_prompts, max_new, speed_n)


def shared_data(base, target, tok, given: bool):
    """The self-distillation data every drafter trains on (made once, or read from ``base.data_dir``
    when ``given``): ``(data, its folder, its summary, the held-out texts)``."""
    from dspark_jax.training.pipeline import prepare_data

    t0 = time.perf_counter()
    shards, eval_texts = prepare_data(base, target, tok)
    data_dir = Path(base.data_dir) if base.data_dir else Path(base.workdir) / "data"
    data, data_info = data_summary(shards, data_dir, given, time.perf_counter() - t0)
    print(f"data: {data_info}", file=sys.stderr)
    return data, data_dir, data_info, eval_texts


def train_all(cfgs: dict[str, Any], target, tok) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trains every drafter of ``cfgs`` (name -> TrainConfig): ``(drafters, training summaries)``."""
    drafters, train_info = {}, {}
    for n, cfg in cfgs.items():
        print(f"train {n}: {DRAFTERS[n]} steps={cfg.steps} batch={cfg.batch_size}", file=sys.stderr)
        drafters[n], train_info[n] = train_drafter(cfg, target, tok, DRAFTERS[n])
    return drafters, train_info


def tau_and_ratios(target, drafters, prompts, temps, max_new: int, batch_size: int, seed: int):
    """Held-out tau of every drafter at every temperature (``{name: {T: row}}``) and the ratios of
    :data:`RATIOS` between their macro-averages (``{T: {"a/b": ratio}}``)."""
    tau: dict[str, Any] = {n: {} for n in drafters}
    for t in temps:
        for n, d in drafters.items():
            row = evaluate_drafter(target, d, prompts, t, max_new, batch_size, seed)
            tau[n][tkey(t)] = row
            print(
                f"tau {n} T={t:g}: macro {row['macro_tau']:.3f} "
                + " ".join(f"{k}={v['tau']:.3f}" for k, v in row["datasets"].items()),
                file=sys.stderr,
            )
    ratios = {}
    for t in temps:
        k = tkey(t)
        ratios[k] = {
            f"{a}/{b}": ratio(tau[a][k]["macro_tau"], tau[b][k]["macro_tau"])
            for a, b, _ in RATIOS
            if a in tau and b in tau
        }
    return tau, ratios


def batch1_speed(args, target, params, drafters, speed_prompts, speed_temps, max_new: int):
    """The transformers baseline's logit parity (None with ``--no-hf``) and
    :func:`benchmarks.speedup.measure_speed` at every speed temperature (``{T: result}``)."""
    hf = parity = None
    if not args.no_hf:
        hf = hf_llama_from_params(target.cfg, params)
        parity = hf_parity(hf, target, speed_prompts[0])
    speed = {}
    for t in speed_temps:
        speed[tkey(t)] = speedup.measure_speed(
            target,
            drafters,
            speed_prompts,
            max_new_tokens=max_new,
            temperature=t,
            seed=args.seed,
            hf_model=hf,
            timing_reps=5 if args.quick else 15,
        )
    return parity, speed


def write_results(result: dict[str, Any], out: Path, t_all: float) -> None:
    """Adds the plot and the total seconds; writes ``results.json`` and ``results.md`` and prints the tables."""
    result["plots"] = {"conditional_acceptance": str(plot_acceptance(result, out / "conditional_acceptance.png"))}
    result["total_seconds"] = round(time.perf_counter() - t_all, 1)
    write_json(out / "results.json", result)
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    """The result tables (tau per dataset and drafter, ratios, speed) as markdown."""
    names = list(r["drafters"])
    temps = [tkey(t) for t in r["eval"]["temperatures"]]
    sets = list(r["eval"]["datasets"])
    b = r["budget"]
    lines = [
        f"## Drafter comparison on {r['target']}",
        "",
        f"Identical data ({r['data']['sequences']} self-distilled sequences, {r['data']['generated_tokens']} "
        f"target tokens) and budget for every drafter: {b['steps']} steps x batch {b['batch_size']}, "
        f"{b['anchors_per_seq']} anchor blocks per sequence, lr {b['learning_rate']}, block_size {b['block_size']}. "
        f"Prompts per dataset: {r['eval']['datasets']}, {r['eval']['max_new_tokens']} new tokens.",
        "",
        f"Command: `{r['command']}`",
        "",
    ]
    for tk in temps:
        lines += [
            f"### tau (tokens per target pass), {tk.replace('T', 'temperature ')}",
            "",
            "| drafter | layers | params | " + " | ".join(sets) + " | macro-average |",
            "|---|---|---|" + "---|" * len(sets) + "---|",
        ]
        for n in names:
            d = r["drafters"][n]
            row = r["tau"][n][tk]
            lines.append(
                f"| {n} | {d['num_layers']} | {d['params']:,} | "
                + " | ".join(cell(row["datasets"][s]["tau"], missing="n/a") for s in sets)
                + f" | {cell(row['macro_tau'], missing='n/a')} |"
            )
        lines.append("")
    lines += [
        "### tau ratios (macro-average)",
        "",
        "| ratio | " + " | ".join(temps) + " | paper |",
        "|---|" + "---|" * len(temps) + "---|",
    ]
    for a, bb, paper in RATIOS:
        key = f"{a}/{bb}"
        if all(key in r["ratios"][t] for t in temps):
            lines.append(
                f"| {key} | " + " | ".join(cell(r["ratios"][t][key], missing="n/a") for t in temps) + f" | {paper} |"
            )
    lines.append("")
    sp = r["speed"]
    for tk, run in sp["runs"].items():
        ar = run["ar"]
        lines += [
            f"### Batch-1 wall clock, {tk.replace('T', 'temperature ')} ({sp['prompts']} prompts, "
            f"{run['max_new_tokens']} new tokens, compile excluded)",
            "",
            "| decoder | tokens/s | speedup vs plain | tau | T_draft ms | T_verify ms | bound "
            "tau*T_step/(T_draft+T_verify) |",
            "|---|---|---|---|---|---|---|",
            f"| plain autoregressive (JAX) | {ar['tokens_per_s']:.1f} | 1.00 | 1 | - | "
            f"{ar['t_target_step_ms']:.2f} (T_step) | - |",
        ]
        hf = run.get("hf_transformers")
        if hf:
            lines.append(
                f"| transformers generate (PyTorch fp32) | {hf['tokens_per_s']:.1f} | "
                f"{hf['vs_jax_ar']:.2f} | 1 | - | - | - |"
            )
        for n, d in run["drafters"].items():
            lines.append(
                f"| {n} | {d['tokens_per_s']:.1f} | {d['speedup']:.2f} | {d['tau']:.2f} | "
                f"{d['t_draft_ms']:.2f} | {d['t_verify_ms']:.2f} | {d['bound']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_acceptance(r: dict[str, Any], path: Path) -> Path:
    """Conditional acceptance per block position (pooled over datasets), one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = [tkey(t) for t in r["eval"]["temperatures"]]
    fig, axes = plt.subplots(1, len(temps), figsize=(5.2 * len(temps), 3.8), dpi=110, squeeze=False)
    for ax, tk in zip(axes[0], temps):
        for n in r["drafters"]:
            pa = r["tau"][n][tk]["position_acceptance_pooled"]
            ks = [k + 1 for k, v in enumerate(pa) if v is not None]
            ax.plot(
                ks, [v for v in pa if v is not None], "o-", ms=3, label=f"{n} (tau {r['tau'][n][tk]['macro_tau']:.2f})"
            )
        ax.set_title(f"{r['target']}: {tk.replace('T', 'temperature ')}", fontsize=9)
        ax.set_xlabel("block position k")
        ax.set_ylabel("P(k accepted | 1..k-1 accepted)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
