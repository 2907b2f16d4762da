"""Learning curves of DSpark / DFlash / Eagle3 drafters: held-out tau against training budget.

Every drafter trains on IDENTICAL data (one shard folder, one target-feature cache over the
union of their taps; :mod:`drafter_study`) with identical settings apart from its own
architecture (``drafter_study.DRAFTERS``), and is measured at budgets ``B`` that double by real
speculative decoding of held-out prompts at T = 0 and T = 1 (tau macro-average, its standard
error across prompts, conditional acceptance per block position).

**Budgets: one warmup-stable-decay trunk, one decay branch per budget.** The learning rate is
``lr_schedule=wsd`` (:mod:`dspark_jax.training.schedules`): linear warmup over a FIXED
``warmup_steps``, constant, then linear decay to 0 over the last ``decay_frac`` (0.2) of the
steps. Up to its decay start ``s_B = B - round(0.2 B)`` a budget-``B`` run is the constant-rate
trunk, which does not depend on ``B``. So per drafter ONE trunk (``OUT/<drafter>/trunk``,
``decay_frac=0``) trains to ``s_B`` of each budget in turn; its Orbax checkpoint at ``s_B``
(params + AdamW state; the data order depends only on ``(seed, step)``) is copied into
``OUT/<drafter>/b<B>`` and resumed there with ``steps=B, decay_frac=0.2``: bit for bit the
run a fresh ``steps=B`` WSD training would be, with its own full decay, so every point means
its budget. Cost per drafter: ``0.8 B_max + 0.2 sum(B) ~= 1.2 B_max`` steps, against
``sum(B) ~= 2 B_max`` for separate cosine runs per budget (a cosine run's intermediate
checkpoints are not budget points: its rate still depends on the final step count).

**Training seconds** of a point: the trunk's training-stage seconds up to ``s_B`` plus the
branch's (``pipeline.run``'s ``train_seconds``: data generation, feature cache and evaluation
excluded; each trunk segment and branch is one ``pipeline.run`` and compiles its step once,
which is counted). A trunk segment interrupted and resumed counts only its resumed part, the
lost part estimated at the resumed part's step rate.

**Stopping.** A drafter stops doubling (``plateau_at``) once a doubling gains no more than the
eval's noise at EVERY temperature: ``tau(B) - tau(B/2) <= noise_sigmas * SE``, ``SE`` the paired
standard error of that difference across the held-out prompts (same prompts and sampling seeds at
both budgets; per-prompt residuals of the pooled ratio ``sum(emitted) / sum(passes)`` differenced,
:func:`drafter_study.paired_tau_stderr`). ``--no-stop`` trains every budget; a rerun recomputes the
gains with its own ``--noise-sigmas``.

**Data** (stories260k: at least 1M target tokens): every training TinyStories opening (the
3824 minus the ``--num-prompts`` held out, which never enter training) continued by the target
twice, greedily (the preset's ``gen_temperature=0``) and sampled (``gen_sample_temperature`` /
``gen_sample_top_p`` = 0.7 / 0.8, the regime a T = 1 drafter meets), 150 new tokens each (the
preset's 2048 openings x 150 give only ~0.3M): ~1.1M target tokens in ``OUT/data/shards``.
``--data-dir`` reuses an existing shard folder instead (only read); eval prompts found as a
training prompt there are dropped (token-level contamination guard).

**Resumable.** Results go to ``OUT/learning_curve.json`` after every point; a rerun with the
same ``--out`` skips the points already there (and refuses different settings), and resumes
data generation, trunks and branches from their checkpoints. Also written:
``OUT/learning_curve.md``, ``OUT/tau_vs_steps.png``, ``OUT/tau_vs_seconds.png``.

Usage::

    python -m benchmarks.learning_curve --target stories260k --budgets 100,200,400,800,1600,3200,6400 \\
        --out runs/learning_curve_stories260k
    python -m benchmarks.learning_curve --quick --out /tmp/lc      # CI-sized smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.drafter_study import (
    DRAFTERS,
    data_summary,
    eval_prompts,
    evaluate_drafter,
    floats,
    paired_tau_stderr,
    shared_feature_cache,
    tkey,
    train_drafter,
)
from benchmarks.harness import command_line
from benchmarks.learning_curve_report import markdown, plot_curves

DEFAULT_DRAFTERS = ["dspark-2L", "dflash-2L", "dflash-5L", "eagle3"]
QUICK_DRAFTERS = ["dspark-2L", "dflash-2L"]
DEFAULT_BUDGETS = "100,200,400,800,1600,3200,6400"
# A smoke run exercising every stage (2 data passes, trunk + branches, T = 0 and 1) in seconds.
QUICK = dict(
    num_prompts=24,
    num_eval_prompts=4,
    gen_max_new_tokens=24,
    gen_batch_size=24,
    seq_len=40,
    batch_size=4,
    anchors_per_seq=4,
    log_every=10,
    block_size=4,
    drafter_width=0,
)
STATE = "learning_curve.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.learning_curve",
        description="Held-out tau of DSpark / DFlash / Eagle3 drafters against a doubling training budget, "
        "on identical data (warmup-stable-decay trunk + one decay branch per budget; resumable).",
    )
    p.add_argument("--target", default="stories260k", choices=["stories260k", "smollm2-135m-instruct"])
    p.add_argument(
        "--drafters",
        default=None,
        help="comma-separated subset of: " + ", ".join(DRAFTERS) + f" (default: {','.join(DEFAULT_DRAFTERS)})",
    )
    p.add_argument("--budgets", default=None, help=f"training steps, increasing (default {DEFAULT_BUDGETS})")
    p.add_argument("--out", required=True, help="output folder; rerunning with it resumes")
    p.add_argument("--num-prompts", type=int, default=100, help="held-out evaluation prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=128, help="generated tokens per evaluation prompt")
    p.add_argument("--temperatures", default="0,1", help="evaluation temperatures (default 0,1)")
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--block-size", type=int, default=None, help="block size of every drafter (default: the preset's)")
    p.add_argument("--decay-frac", type=float, default=0.2, help="fraction of each budget spent decaying (0.2)")
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="warmup of every run (default: the preset's, <= s_Bmin / 2)"
    )
    p.add_argument("--noise-sigmas", type=float, default=1.0, help="stop rule: gain < this many paired SEs")
    p.add_argument("--no-stop", action="store_true", help="evaluate every budget (no plateau stop)")
    p.add_argument("--data-dir", default=None, help="existing shard folder (shard_*.npz) to train on; only read")
    p.add_argument("--no-sampled-data", action="store_true", help="greedy continuations only (one data pass)")
    p.add_argument("--no-feature-cache", action="store_true", help="run the frozen target in every train step")
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (budgets 4,8; 2 drafters, 2 prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="training-config overrides shared by every run, as for dspark_jax.train "
        "(e.g. draft_vocab_size=8192 init_from_target_layers=-2,-1); part of the study's settings",
    )
    return p


def parse_budgets(spec: str) -> list[int]:
    """``"100,200,400"`` -> ``[100, 200, 400]``; raises ValueError unless strictly increasing and >= 2."""
    b = [int(x) for x in spec.split(",") if x.strip()]
    if not b or b[0] < 2 or any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(f"--budgets must be strictly increasing integers >= 2, got {spec!r}")
    return b


def study_config(args, budgets: list[int]):
    """``(base TrainConfig shared by every run, eval settings)`` from the preset and the flags."""
    from dspark_jax.training.overrides import apply_overrides
    from dspark_jax.training.recipes import TRAIN_PRESETS
    from dspark_jax.training.schedules import wsd_decay_start

    base = TRAIN_PRESETS[args.target]
    over: dict[str, Any] = dict(seed=args.seed, num_prompts=100_000)  # every training prompt
    if args.quick:
        over.update(QUICK)
    for k, v in (("batch_size", args.batch_size), ("block_size", args.block_size)):
        if v is not None:
            over[k] = v
    s_min = wsd_decay_start(budgets[0], args.decay_frac)
    preset_warm = max(1, int(base.warmup_frac * base.steps))
    warm = args.warmup_steps if args.warmup_steps is not None else max(1, min(preset_warm, s_min // 2))
    over.update(lr_schedule="wsd", warmup_steps=warm, decay_frac=args.decay_frac, ckpt_every=250)
    base = apply_overrides(base.with_keys(**over), args.set)
    ev: dict[str, Any] = dict(
        num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, temperatures=floats(args.temperatures)
    )
    if args.quick:
        ev.update(num_prompts=min(args.num_prompts, 2), max_new_tokens=min(args.max_new_tokens, 16))
    ev["batch_size"] = min(args.eval_batch_size, ev["num_prompts"])
    # hold out every evaluation prompt from the data
    base = dataclasses.replace(base, num_eval_prompts=max(base.num_eval_prompts, ev["num_prompts"]))
    return base, ev


def prepare_study_data(base, target, tok, out: Path, args) -> tuple[Path, list[Path], list[str], bool]:
    """``(shard folder, shards, held-out prompt texts, reused)``: ``--data-dir``, or the greedy pass
    plus (unless ``--no-sampled-data``) the sampled pass of every training prompt, merged into
    ``OUT/data/shards`` (each pass resumable in ``OUT/data/<pass>``)."""
    from dspark_jax.training.pipeline import prepare_data

    if args.data_dir:
        cfg = dataclasses.replace(base, workdir=str(out / "data"), data_dir=str(Path(args.data_dir).resolve()))
        shards, eval_texts = prepare_data(cfg, target, tok)
        return Path(cfg.data_dir), shards, eval_texts, True
    passes = {"greedy": dict(gen_sampled_frac=0.0)}
    if not args.no_sampled_data:
        passes["sampled"] = dict(gen_sampled_frac=1.0)
    merged = out / "data" / "shards"
    eval_texts: list[str] = []
    all_shards: list[Path] = []
    for name, kw in passes.items():
        cfg = dataclasses.replace(base, workdir=str(out / "data" / name), **kw)
        print(f"data pass {name}: {kw}", file=sys.stderr)
        shards, eval_texts = prepare_data(cfg, target, tok)  # same split (seed, num_eval_prompts) every pass
        all_shards += shards
    if not merged.is_dir():
        tmp = merged.with_name("shards.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, s in enumerate(all_shards):
            shutil.copyfile(s, tmp / f"shard_{i:05d}.npz")
        os.replace(tmp, merged)
    return merged, sorted(merged.glob("shard_[0-9]*[0-9].npz")), eval_texts, False


def drop_trained_prompts(prompts: dict[str, list[list[int]]], data: dict) -> tuple[dict, int]:
    """``prompts`` without those whose token ids are the prompt of a training sequence, and how many went."""
    seen = {tuple(int(x) for x in row[:n]) for row, n in zip(data["tokens"], data["prompt_lengths"])}
    kept = {k: [p for p in v if tuple(p) not in seen] for k, v in prompts.items()}
    return kept, sum(len(v) for v in prompts.values()) - sum(len(v) for v in kept.values())


# -- resumable state --------------------------------------------------------------------------------


def load_state(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The study so far (``{"settings", "drafters": {name: {"points": [...], ...}}}``), new if absent.

    Raises:
      SystemExit: the stored settings differ (points of another study must not mix).
    """
    if not path.is_file():
        return {"settings": settings, "drafters": {}, "commands": []}
    state = json.loads(path.read_text())
    if state["settings"] != settings:
        diff = {k: (state["settings"].get(k), v) for k, v in settings.items() if state["settings"].get(k) != v}
        raise SystemExit(f"error: {path} holds a study with other settings {diff} (stored, now); use another --out")
    return state


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Writes ``state`` atomically (a kill never leaves a torn JSON)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def checkpoint_steps(workdir: Path) -> list[int]:
    """Steps of the committed Orbax checkpoints under ``<workdir>/checkpoints``."""
    d = workdir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


# -- one drafter's curve ----------------------------------------------------------------------------


def record_segment(known: dict[str, float | None], start: int, end: int, seconds: float) -> None:
    """Records ``known[end]``, the cumulative training seconds of one run (trunk or branch) at step
    ``end``, after a segment ``start -> end`` took ``seconds``. ``known`` maps steps with a record to
    their cumulative seconds (the run's first step included); a ``start`` without one (a segment killed
    after a checkpoint) is costed from the last record before it at this segment's step rate."""
    steps = {int(k): v for k, v in known.items() if v is not None}
    if start in steps:
        base = steps[start]
    else:
        last = max((k for k in steps if k < start), default=min(steps))
        base = steps[last] + (start - last) * seconds / max(end - start, 1)
    known[str(end)] = round(base + seconds, 1)


def train_run_to(cfg, name: str, workdir: Path, steps: int, target, tok, known: dict[str, float | None], save):
    """Trains the run in ``workdir`` from its newest checkpoint to ``steps``, records its seconds in
    ``known`` and saves the study; returns ``(drafter, training summary)``."""
    start = max(checkpoint_steps(workdir), default=0)
    d, info = train_drafter(dataclasses.replace(cfg, workdir=str(workdir), steps=steps), target, tok, DRAFTERS[name])
    if start < steps:
        record_segment(known, start, steps, info["train_seconds"])
        save()
    elif str(steps) not in known:  # trained by a run killed before it saved the study: time unknown
        known[str(steps)] = None
    return d, info


def branch_from_trunk(cfg, name: str, budget: int, target, tok, seconds: dict, out: Path, save) -> Path:
    """The branch workdir of ``budget``, holding the trunk's checkpoint at its decay start ``s_B``;
    trains the trunk (``decay_frac=0``) from its newest checkpoint to ``s_B`` first when needed.

    Raises:
      SystemExit: the trunk is past ``s_B`` and no longer holds its checkpoint (a budget added later).
    """
    from dspark_jax.training.schedules import wsd_decay_start

    s_b = wsd_decay_start(budget, cfg.decay_frac)
    branch = out / name / f"b{budget}"
    seconds.setdefault(branch.name, {str(s_b): 0.0})
    if checkpoint_steps(branch):  # copied before (the branch trains or trained from it)
        return branch
    tdir = out / name / "trunk"
    have = checkpoint_steps(tdir)
    if max(have, default=0) < s_b:
        print(f"trunk {name}: steps {max(have, default=0)} -> {s_b}", file=sys.stderr)
        train_run_to(dataclasses.replace(cfg, decay_frac=0.0), name, tdir, s_b, target, tok, seconds["trunk"], save)
    elif s_b not in have:
        raise SystemExit(f"error: {tdir} is past step {s_b} without its checkpoint; delete {tdir} to rebuild it")
    (branch / "checkpoints").mkdir(parents=True, exist_ok=True)
    tmp = branch / f"ckpt_{s_b}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tdir / "checkpoints" / str(s_b), tmp)
    os.replace(tmp, branch / "checkpoints" / str(s_b))
    return branch


def train_point(cfg, name: str, budget: int, target, tok, prompts, ev: dict, rec: dict, out: Path, save) -> dict:
    """Trains drafter ``name`` to ``budget`` (trunk to s_B, then its own decay) and evaluates it."""
    from dspark_jax.training.schedules import wsd_decay_start

    seconds = rec["seconds_at"]
    branch = branch_from_trunk(cfg, name, budget, target, tok, seconds, out, save)
    print(f"branch {name}: decay to {budget}", file=sys.stderr)
    d, info = train_run_to(cfg, name, branch, budget, target, tok, seconds[branch.name], save)
    s_b = wsd_decay_start(budget, cfg.decay_frac)
    t_trunk, t_branch = seconds["trunk"].get(str(s_b)), seconds[branch.name][str(budget)]
    tau = {}
    for t in ev["temperatures"]:
        tau[tkey(t)] = evaluate_drafter(target, d, prompts, t, ev["max_new_tokens"], ev["batch_size"], cfg.seed)
        print(f"tau {name} B={budget} T={t:g}: {tau[tkey(t)]['macro_tau']:.3f}", file=sys.stderr)
    total = None if t_trunk is None or t_branch is None else round(t_trunk + t_branch, 1)  # None: unknown
    return {
        "budget": budget,
        "steps": info["steps"],
        "decay_start": s_b,
        "train_seconds": total,
        "trunk_seconds": t_trunk,
        "branch_seconds": t_branch,
        "params": info["params"],
        "final_train_metrics": info["final_train_metrics"],
        "export_dir": info["export_dir"],
        "tau": tau,
    }


def doubling_gain(prev: dict[str, Any], point: dict[str, Any], sigmas: float) -> dict[str, Any]:
    """Per temperature: ``{"delta": tau gain over prev, "stderr": paired SE, "significant"}``.

    Multi-dataset targets: the macro gain's SE combines the datasets' paired SEs (independent prompts).
    """
    out = {}
    for tk, row in point["tau"].items():
        old = prev["tau"][tk]
        errs = []
        for ds, cur in row["datasets"].items():
            o = old["datasets"][ds]
            errs.append(
                paired_tau_stderr(
                    cur["request_tau"], cur["request_target_passes"], o["request_tau"], o["request_target_passes"]
                )
            )
        se = None if None in errs else (sum(e * e for e in errs) ** 0.5) / len(errs)
        delta = row["macro_tau"] - old["macro_tau"]
        out[tk] = {"delta": delta, "stderr": se, "significant": se is None or delta > sigmas * se}
    return out


def run_drafter(name: str, cfg, budgets, target, tok, prompts, ev, state, path: Path, args) -> None:
    """All budgets of one drafter in order: points already in ``state`` are kept, missing ones trained and
    evaluated, each doubling's gain (re)computed with the current ``--noise-sigmas``; after the first
    doubling within the noise at every temperature (``plateau_at``) no new budget is trained unless
    ``--no-stop``."""
    rec = state["drafters"].setdefault(
        name, {"overrides": DRAFTERS[name], "points": [], "seconds_at": {"trunk": {"0": 0.0}}}
    )
    done = {p["budget"]: p for p in rec["points"]}
    prev, rec["plateau_at"] = None, None
    for b in budgets:
        point = done.get(b)
        if point is not None:
            print(f"{name}: budget {b} already in {path}, skipped", file=sys.stderr)
        elif rec["plateau_at"] is not None and not args.no_stop:
            print(f"{name}: plateau at {rec['plateau_at']} steps; budgets from {b} on not trained", file=sys.stderr)
            break
        else:
            point = train_point(
                cfg, name, b, target, tok, prompts, ev, rec, Path(args.out), lambda: save_state(path, state)
            )
            rec["points"] = sorted([*rec["points"], point], key=lambda p: p["budget"])
        if prev is not None:
            point["gain"] = doubling_gain(prev, point, args.noise_sigmas)
            if rec["plateau_at"] is None and not any(g["significant"] for g in point["gain"].values()):
                rec["plateau_at"] = b
        save_state(path, state)
        prev = point


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dspark_jax.models.presets import resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.drafters.split(",") if args.drafters else (QUICK_DRAFTERS if args.quick else DEFAULT_DRAFTERS)
    if [n for n in names if n not in DRAFTERS]:
        print(f"error: unknown drafter(s) in {names}; choose from {list(DRAFTERS)}", file=sys.stderr)
        return 2
    try:
        budgets = parse_budgets(args.budgets or ("4,8" if args.quick else DEFAULT_BUDGETS))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        base, ev = study_config(args, budgets)
    except ValueError as e:  # a bad --set
        print(f"error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache(out)
    cfg_t, params, tok = resolve_target(args.target)
    target = Target(cfg_t, params, fingerprint=params_fingerprint(params))

    t0 = time.perf_counter()
    data_dir, shards, eval_texts, reused = prepare_study_data(base, target, tok, out, args)
    data, data_info = data_summary(shards, data_dir, reused, time.perf_counter() - t0)
    print(f"data: {data_info}", file=sys.stderr)
    if args.target == "stories260k" and not args.quick and data_info["generated_tokens"] < 1_000_000:
        print(f"warning: {data_info['generated_tokens']:,} target tokens, under the study's 1M", file=sys.stderr)
    cfgs = {n: base.with_keys(data_dir=str(data_dir), **DRAFTERS[n]) for n in names}
    cache_info = None
    if args.no_feature_cache:
        cfgs = {n: dataclasses.replace(c, feature_cache="") for n, c in cfgs.items()}
    else:
        cfgs, cache_info = shared_feature_cache(out / "feature_cache", target, data, cfgs)
    prompts = eval_prompts(
        args.target, tok, eval_texts, ev["num_prompts"], cfg_t.max_position - ev["max_new_tokens"] - 20
    )
    prompts, dropped = drop_trained_prompts(prompts, data)
    if not all(prompts.values()):
        print(f"error: no evaluation prompt left in {[k for k, v in prompts.items() if not v]}", file=sys.stderr)
        return 2

    settings = study_settings(base, ev, data_info, prompts, args)
    path = out / STATE
    state = load_state(path, settings)
    state.update(
        target=args.target,
        data=data_info,
        feature_cache=cache_info,
        eval_prompts_dropped=dropped,
        noise_sigmas=args.noise_sigmas,
    )
    state["commands"].append(command_line("learning_curve", argv))
    save_state(path, state)
    for n in names:
        run_drafter(n, cfgs[n], budgets, target, tok, prompts, ev, state, path, args)
    state["plots"] = plot_curves(state, out)
    save_state(path, state)
    (out / "learning_curve.md").write_text(markdown(state))
    print(markdown(state))
    return 0


def enable_compilation_cache(out: Path) -> None:
    """JAX's persistent compilation cache in ``OUT/jax_cache`` (unless one is configured already): the trunk
    segments of a drafter compile the same step (their rate does not depend on ``steps``), and a rerun
    recompiles nothing, so only the first of them pays the compile."""
    import jax

    if not getattr(jax.config, "jax_compilation_cache_dir", None):
        jax.config.update("jax_compilation_cache_dir", str(out / "jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def study_settings(base, ev: dict, data_info: dict, prompts: dict, args) -> dict[str, Any]:
    """What makes two points comparable; a rerun on the same ``--out`` must match it."""
    keys = ("batch_size", "anchors_per_seq", "learning_rate", "warmup_steps", "decay_frac", "lr_schedule")
    return {
        **{k: getattr(base, k) for k in keys},
        "block_size": base.drafter.block_size,
        "seq_len": base.seq_len,
        "markov_rank": base.drafter.markov_rank,
        "drafter_width": base.drafter.width,  # the key older studies recorded
        "seed": base.seed,
        "data_sequences": data_info["sequences"],
        "data_generated_tokens": data_info["generated_tokens"],
        "eval_prompts": {k: len(v) for k, v in prompts.items()},
        "eval_max_new_tokens": ev["max_new_tokens"],
        "eval_temperatures": ev["temperatures"],
        "feature_cache": not args.no_feature_cache,
        "quick": args.quick,
        **({"overrides": sorted(args.set)} if args.set else {}),  # absent when none: older studies still resume
    }


if __name__ == "__main__":
    sys.exit(main())
