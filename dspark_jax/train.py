"""``python -m dspark_jax.train``: train, checkpoint, export and evaluate a drafter.

Usage::

    python -m dspark_jax.train --preset stories260k [key=value ...]
    python -m dspark_jax.train --config train/smollm2-135m-instruct.yaml steps=200
    python -m dspark_jax.train --preset stories260k --dry-run

Stages (each resumable; rerunning the same command continues where it stopped):
1. self-distillation data: the target generates continuations of training
   prompts with its own jitted batched decoding -> ``<workdir>/data/shard_*.npz``;
2. training with Orbax checkpoints in ``<workdir>/checkpoints`` (resumes from the
   newest one; the data order depends only on (seed, step));
3. export to ``<export_dir>`` (drafter params + config + target identity);
4. evaluation on held-out prompts: tau, acceptance, per-position acceptance ->
   ``<workdir>/eval.json``.

Every field of :class:`~dspark_jax.trainer.TrainConfig` is a ``key=value`` override.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from .config import apply_overrides
from .errors import DSparkInputError
from .trainer import TRAIN_PRESETS, TrainConfig


def _field_help() -> str:
    lines = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default
        lines.append(f"  {f.name}={default!r}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.train",
        description="Train a DSpark (or DFlash) drafter for a target model by self-distillation, "
                    "save Orbax checkpoints, export it, and report tau on held-out prompts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override with key=value; defaults shown for the stories260k preset):\n"
               + _field_help(),
    )
    p.add_argument("--preset", default=None, choices=sorted(TRAIN_PRESETS),
                   help="built-in recipe to start from (default: stories260k)")
    p.add_argument("--config", default=None, help="YAML or JSON file of config keys, applied after --preset")
    p.add_argument("--dry-run", action="store_true",
                   help="build the drafter abstractly, print parameter counts and memory estimate, then exit")
    p.add_argument("--skip-eval", action="store_true", help="do not evaluate tau after training")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=500 gamma=8")
    return p


def load_config(args: argparse.Namespace) -> TrainConfig:
    """Preset, then config file, then ``key=value`` overrides.

    Raises:
      DSparkInputError: unreadable config file or unknown/bad keys.
    """
    cfg = TRAIN_PRESETS[args.preset or "stories260k"]
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise DSparkInputError(f"config file not found: {path}")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml
                data = yaml.safe_load(text) or {}
            else:
                data = json.loads(text)
        except Exception as e:  # yaml and json raise different types
            raise DSparkInputError(f"cannot parse {path}: {str(e).splitlines()[0]}") from None
        if "preset" in data and not args.preset:
            preset = str(data.pop("preset"))
            if preset not in TRAIN_PRESETS:
                raise DSparkInputError(f"{path}: unknown preset {preset!r}")
            cfg = TRAIN_PRESETS[preset]
        data.pop("preset", None)
        cfg = _apply(cfg, {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in data.items()})
    return _apply(cfg, args.overrides)


def _apply(cfg, overrides):
    try:
        return apply_overrides(cfg, overrides)
    except ValueError as e:
        raise DSparkInputError(str(e)) from None


def dry_run(cfg: TrainConfig) -> dict:
    """Abstract drafter build (``nnx.eval_shape``): parameter counts and a per-device memory estimate.

    The target's files are read for its config; no drafter weights are materialised.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from .drafter import Drafter
    from .presets import resolve_target
    from .trainer import count_params, drafter_config

    tcfg = resolve_target(cfg.target)[0]  # reads the target's files; the drafter stays abstract

    class _T:  # only .cfg and .fingerprint are read by drafter_config
        def __init__(self, c):
            self.cfg, self.fingerprint = c, ""

    dcfg = drafter_config(cfg, _T(tcfg))
    dtype = jnp.dtype(cfg.dtype)
    abstract = nnx.eval_shape(lambda: Drafter(dcfg, nnx.Rngs(0), dtype=dtype))
    n_d = count_params(nnx.state(abstract, nnx.Param))
    t = tcfg
    n_t = (t.vocab_size * t.hidden_size * (1 if t.tie_embeddings else 2) + t.num_layers * (
        t.hidden_size * (t.num_heads + 2 * t.num_kv_heads) * t.head_dim + t.num_heads * t.head_dim * t.hidden_size
        + 3 * t.hidden_size * t.intermediate_size + 2 * t.hidden_size) + t.hidden_size)
    n_dev = jax.device_count()
    per_dev_b = max(1, cfg.batch_size // n_dev)
    bpe = dtype.itemsize
    acts = per_dev_b * cfg.seq_len * t.hidden_size * (t.num_layers + len(dcfg.taps)) * bpe
    logits = per_dev_b * (cfg.seq_len + 4 * cfg.anchors_per_seq * dcfg.gamma) * t.vocab_size * 4
    mem = n_t * bpe + n_d * (4 * 3 + bpe) + acts + logits
    report = {"target": t.name, "target_params": n_t, "drafter_params": n_d, "drafter_config": dcfg.to_dict(),
              "devices": n_dev, "per_device_batch": per_dev_b,
              "per_device_memory_estimate_gib": round(mem / 2**30, 3)}
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args)
        if args.dry_run:
            print(json.dumps(dry_run(cfg), indent=2))
            return 0
        run(cfg, evaluate=not args.skip_eval)
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(cfg: TrainConfig, evaluate: bool = True) -> dict:
    """Runs all stages for ``cfg``; returns the summary written to ``<workdir>/summary.json``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tqdm.auto import tqdm

    from . import data as data_mod
    from .api import load_target
    from .checkpoint import export_drafter
    from .decode import generate_autoregressive
    from .drafter import Drafter
    from .presets import preset_info
    from .trainer import Trainer, append_jsonl, count_params, drafter_config, maybe_initialize_distributed

    maybe_initialize_distributed()
    t_start = time.perf_counter()
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    dtype = jnp.dtype(cfg.dtype)
    target, tok = load_target(cfg.target, dtype=dtype)
    chat = cfg.prompts == "chat"

    # -- prompts ------------------------------------------------------------------------
    if cfg.prompts == "tinystories":
        texts = data_mod.tinystories_openings()
    elif cfg.prompts == "chat":
        texts = list(data_mod.CHAT_PROMPTS)
    else:
        raise DSparkInputError(f"prompts must be 'tinystories' or 'chat', got {cfg.prompts!r}")
    if cfg.prompts_file:
        texts += data_mod.read_prompt_file(cfg.prompts_file)
    train_texts, eval_texts = data_mod.split_prompts(texts, min(cfg.num_eval_prompts, len(texts) // 5), cfg.seed)
    if chat and len(train_texts) < cfg.num_prompts:
        # Few distinct chat prompts: repeat them, the sampled continuations differ.
        train_texts = (train_texts * (cfg.num_prompts // max(1, len(train_texts)) + 1))[: cfg.num_prompts]
    train_texts = train_texts[: cfg.num_prompts]
    (workdir / "eval_prompts.json").write_text(json.dumps(eval_texts, indent=1))
    train_ids = data_mod.encode_prompts(tok, train_texts, chat)

    # -- stage 1: self-distillation data -----------------------------------------------
    t0 = time.perf_counter()
    bar = tqdm(total=len(train_ids), desc="generate data", unit="seq", dynamic_ncols=True)

    def gen(batch, bi):
        res = generate_autoregressive(target, batch, max_new_tokens=cfg.gen_max_new_tokens,
                                      temperature=cfg.gen_temperature, top_p=cfg.gen_top_p,
                                      seed=[cfg.seed * 1_000_003 + bi * 4096 + i for i in range(len(batch))])
        return [g.token_ids for g in res.generations]

    def progress(done, total):
        bar.n = done
        bar.refresh()

    shards = data_mod.generate_shards(workdir / "data", train_ids, gen, seq_len=cfg.seq_len,
                                      batch_size=cfg.gen_batch_size, progress=progress)
    bar.close()
    data = data_mod.load_shards(shards)
    gen_seconds = time.perf_counter() - t0
    n_tokens = int((data["lengths"] - data["prompt_lengths"]).sum())

    # -- stage 2: training ----------------------------------------------------------------
    dcfg = drafter_config(cfg, target)
    drafter = Drafter(dcfg, nnx.Rngs(cfg.seed), dtype=dtype)
    trainer = Trainer(cfg, target, drafter)
    mgr = trainer.checkpoint_manager(workdir / "checkpoints")
    start = trainer.restore_latest(mgr)
    if start:
        print(f"resuming from checkpoint step {start}", file=sys.stderr)
    metrics_path = workdir / "metrics.jsonl"
    it = data_mod.batches(data, cfg.batch_size, cfg.seed, start_step=start)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    t_train = time.perf_counter()
    tok_per_step = cfg.batch_size * cfg.seq_len
    step = start
    last_log = time.perf_counter()
    terms = None
    while step < cfg.steps:
        batch = next(it)
        terms, gnorm = trainer.step(batch, step)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.perf_counter()
            row = {"step": step, **{k: float(v) for k, v in terms._asdict().items() if k != "acc_by_pos"},
                   "grad_norm": float(gnorm),
                   "tokens_per_s": tok_per_step * cfg.log_every / max(now - last_log, 1e-9),
                   "elapsed_s": now - t_train}
            last_log = now
            append_jsonl(metrics_path, row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tv=f"{row['tv']:.3f}", tau_est=f"{row['tau_est']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
        if step % cfg.ckpt_every == 0:
            trainer.save(mgr, step)
        if cfg.time_budget_s and time.perf_counter() - t_train > cfg.time_budget_s:
            print(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step}", file=sys.stderr)
            break
    bar.close()
    if mgr.latest_step() != step:
        trainer.save(mgr, step)
    train_seconds = time.perf_counter() - t_train
    drafter = trainer.drafter()

    summary = {
        "target": target.cfg.name, "target_fingerprint": target.fingerprint, "steps": step,
        "train_sequences": int(data["tokens"].shape[0]), "train_generated_tokens": n_tokens,
        "data_seconds": round(gen_seconds, 1), "train_seconds": round(train_seconds, 1),
        "devices": jax.device_count(), "drafter_params": count_params(nnx.state(drafter, nnx.Param)),
        "final_train_metrics": {k: float(v) for k, v in terms._asdict().items() if k != "acc_by_pos"} if terms else {},
    }
    # -- stage 3: export -------------------------------------------------------------------
    export = export_drafter(drafter, cfg.export_path(), extra={"train": summary, "config": dataclasses.asdict(cfg)})
    summary["export_dir"] = str(export)
    # -- stage 4: held-out evaluation ----------------------------------------------------------
    if evaluate and eval_texts:
        from .evaluate import evaluate_tau

        eval_ids = data_mod.encode_prompts(tok, eval_texts, chat)
        summary["eval"] = evaluate_tau(target, drafter, eval_ids, max_new_tokens=cfg.eval_max_new_tokens,
                                       temperature=cfg.eval_temperature, gamma=dcfg.gamma)
        (workdir / "eval.json").write_text(json.dumps(summary["eval"], indent=2))
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    ev = summary.get("eval", {})
    print(json.dumps({"export_dir": summary["export_dir"], "steps": step, "train_seconds": summary["train_seconds"],
                      "data_seconds": summary["data_seconds"], "tau": ev.get("tau"),
                      "acceptance_rate": ev.get("acceptance_rate")}))
    return summary


if __name__ == "__main__":
    sys.exit(main())
