"""The training step from a feature cache: the loss on the draft vocabulary (the cached logsumexp)
against the loss over the full vocabulary, at equal batch: FLOP split and step time.

Arms, all on the same target, the same cached batches and the same initial drafter:

* ``full-vocab``: this checkout on a cache without the target's logsumexp (the loss unembeds the
  cached last hidden state over all V ids and takes a softmax: the computation before the cached
  logsumexp);
* ``draft-vocab``: this checkout on the cache with it (the target's logits of the draft vocabulary's
  ids only, exact ``p = exp(logit - logsumexp)``);
* ``old`` (``--old CHECKOUT``): another checkout's trainer (e.g. the commit before the change, from
  ``git archive <commit> | tar -x -C /tmp/old``) on the cache's features and last hidden states.

FLOP split (``--flops``): XLA's cost analysis of each arm's compiled step, lowered with
``lax.scan`` unrolled (XLA counts a loop body once, so a scanned drafter would count one layer),
split into the target's side of the loss (:func:`~dspark_jax.training.losses.target_draft_probs`
at the gathered positions, compiled alone), the optimizer update (compiled alone) and the rest,
the drafter's own forward and backward; beside it the matrix products of the drafter counted
analytically from its shapes. Step time: steps of the arms alternated in one process (every
arm the same batch sequence; the order reversed every round), median of ``--steps`` after two
warm-up rounds, and the speedup over the first arm; the losses of the arms step by step must
agree. ``--profile`` times, in the same rounds, the parts compiled alone (the target's side with
and without the logsumexp, the optimizer update), to show what else the step spends its time on.

CLI::

    git archive HEAD~1 | tar -x -C /tmp/old   # the commit before the change
    python -m benchmarks.train_step --target smollm2-135m-instruct \\
        --data-dir ../shared/data/distill/smollm2-135m-instruct --num-sequences 64 \\
        --set draft_vocab_size=8192 --steps 7 --flops --profile --old /tmp/old --json train_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import alternate, command_line, device_description, load_checkout, markdown_table, write_json

# What an arm builds its drafter and trainer from, in each checkout.
_MODULES = ("api", "config", "drafters.build", "training.data", "training.recipes", "training.trainer")


@contextlib.contextmanager
def _unrolled_scans():
    """``jax.lax.scan`` with ``unroll=True`` while lowering for the FLOP count (every layer counted)."""
    import jax

    scan = jax.lax.scan
    jax.lax.scan = functools.partial(scan, unroll=True)
    try:
        yield
    finally:
        jax.lax.scan = scan


def _flops(compiled: Any) -> float:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return float(ca.get("flops", 0.0))


def analytic_drafter_flops(dcfg: Any, batch: int, anchors: int, seq_len: int) -> dict[str, float]:
    """Matrix-product FLOPs (2 per multiply-add) of one drafter forward + backward, by part.

    Forward ``F``; backward ``2F`` where both the weights and the input take gradients, ``F`` where
    only one does (the context projection: frozen features; the base logits: the target's frozen LM
    head rows).
    """
    d, h, g = dcfg.model_width, dcfg.hidden_size, dcfg.block_size
    s, c, p = dcfg.num_block_positions, batch * seq_len, batch * anchors * dcfg.num_block_positions
    q, kv, n = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim, dcfg.draft_size
    pos = batch * anchors * g
    proj = 2 * p * d * (2 * q + 2 * kv) + 6 * p * d * dcfg.intermediate_size  # q, k, v, o and the MLP
    attn = 2 * 2 * p * q * (seq_len + s)  # scores and values over the context and the block's own slots
    out = {
        "backbone layers": 3 * dcfg.num_layers * (proj + attn),
        "context projection + K/V": 2 * (2 * c * len(dcfg.taps) * h * d) + 3 * dcfg.num_layers * 2 * c * d * 2 * kv,
        "base logits": 2 * (2 * pos * d * n) + (2 * 2 * pos * d * h if d != h else 0),
        "Markov head": 3 * 2 * pos * dcfg.markov_rank * n if dcfg.markov_rank else 0,
    }
    return {k: v / 1e9 for k, v in out.items()}


def _parts(arm: dict[str, Any]) -> dict[str, Any]:
    """Jitted parts of an arm's step compiled alone: the target's side of the loss with and without
    the logsumexp (``(target state, hidden [B, A, g, H], lse [B, A, g] or None) -> p [B, A, g, N]``,
    :func:`~dspark_jax.training.losses.target_draft_probs`) and the optimizer update
    (``(params, opt state) -> params``, the parameters standing in for their gradients)."""
    import jax
    import optax
    from flax import nnx

    from dspark_jax.training.losses import target_draft_probs

    tr, drafter = arm["trainer"], arm["drafter"]
    graph = nnx.graphdef(arm["target"])
    side = jax.jit(lambda st, hs, ls: target_draft_probs(drafter, nnx.merge(graph, st), None, hs, ls))
    return {"side": side, "opt": jax.jit(lambda p, o: optax.apply_updates(p, tr.tx.update(p, o, p)[0]))}


def _gathered(arm: dict[str, Any], batch: dict[str, np.ndarray]) -> tuple[Any, Any]:
    """``(last hidden [B, A, g, H], lse [B, A, g])`` of the first ``A * g`` positions of ``batch``'s rows
    (stand-ins for the gathered positions: the parts' cost does not depend on which)."""
    import jax.numpy as jnp

    cfg, dcfg = arm["trainer"].cfg, arm["dcfg"]
    shape = (cfg.batch_size, cfg.anchors_per_seq, dcfg.block_size)
    k = shape[1] * shape[2]
    hidden = np.asarray(batch["last_hidden"], np.float32)[:, :k].reshape(*shape, -1)
    return jnp.asarray(hidden), jnp.asarray(np.asarray(batch["target_lse"])[:, :k].reshape(shape))


def _flop_split(arm: dict[str, Any], batch: dict[str, np.ndarray], lse: bool) -> dict[str, float]:
    """GFLOP of an arm's step: total, the target's side, the optimizer, the rest (module doc)."""
    from flax import nnx

    tr, parts = arm["flop_trainer"], _parts(arm)
    with _unrolled_scans():
        total = _flops(tr.lower_step(batch if lse else _without_lse(batch)).compile())
    opt_f = _flops(parts["opt"].lower(tr.params, tr.opt_state).compile())
    hidden, lse_arr = _gathered(arm, batch)
    t_f = _flops(parts["side"].lower(nnx.state(arm["target"]), hidden, lse_arr if lse else None).compile())
    return {
        "total": total / 1e9,
        "target side": t_f / 1e9,
        "optimizer": opt_f / 1e9,
        "drafter": (total - t_f - opt_f) / 1e9,
    }


def _part_cases(arm: dict[str, Any], batch: dict[str, np.ndarray], data: dict[str, Any]) -> dict[str, Any]:
    """Timed cases (``--profile``) of the parts of :func:`_parts` (run and compiled once here) and of
    reading one batch of ``data`` (the memory-mapped cache) on the host."""
    import jax
    from flax import nnx

    from dspark_jax.training.data import batches

    parts, tr, state = _parts(arm), arm["trainer"], nnx.state(arm["target"])
    hidden, lse = _gathered(arm, batch)
    calls = {
        "part: target side, all V ids": lambda: parts["side"](state, hidden, None),
        "part: target side, draft vocabulary + logsumexp": lambda: parts["side"](state, hidden, lse),
        "part: optimizer update": lambda: parts["opt"](tr.params, tr.opt_state),
    }

    def ready(f) -> None:  # None: alternate() times the whole call
        jax.block_until_ready(f())

    cases: dict[str, Any] = {k: functools.partial(ready, f) for k, f in calls.items()}
    rows = batches(data, tr.cfg.batch_size, seed=2)

    def read() -> None:
        next(rows)

    cases["part: a batch read from the cache (host)"] = read
    for fn in cases.values():
        fn()
    return cases


def _without_lse(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "target_lse"}


def _arm(
    name: str, mods: dict[str, Any], args: argparse.Namespace, data: dict, lse: bool, target: Any
) -> dict[str, Any]:
    """One arm: its checkout's drafter and trainer (with ``--flops`` a second trainer, lowered with
    unrolled scans from a fresh trace) on ``target`` (None: that checkout loads its own)."""
    from flax import nnx

    if target is None:
        target, _ = mods["api"].load_target(args.target)
    trainer_mod = mods["training.trainer"]
    base = mods["training.recipes"].TRAIN_PRESETS.get(args.preset)
    cfg = mods["config"].apply_overrides(base or trainer_mod.TrainConfig(target=args.target), list(args.set))
    dcfg = trainer_mod.drafter_config(cfg, target)
    drafter = mods["drafters.build"].build_drafter(dcfg, nnx.Rngs(0))
    if dcfg.draft_vocab_size:
        drafter.set_draft_vocab(mods["training.data"].draft_vocabulary(data, dcfg.draft_vocab_size, dcfg.vocab_size))
    flop_trainer = (
        trainer_mod.Trainer(cfg, target, drafter) if args.flops and hasattr(trainer_mod.Trainer, "lower_step") else None
    )
    return {
        "name": name,
        "lse": lse,
        "target": target,
        "drafter": drafter,
        "dcfg": dcfg,
        "trainer": trainer_mod.Trainer(cfg, target, drafter),
        "flop_trainer": flop_trainer,
        "step": 0,
        "losses": [],
        "times": [],
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.train_step",
        description="FLOP split and step time of the training step, draft-vocabulary loss vs full-vocabulary loss.",
    )
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--preset", default=None, help="training preset (default: the target's)")
    ap.add_argument("--set", action="append", default=[], help="key=value override of the preset (repeat)")
    ap.add_argument("--data-dir", required=True, help="folder of self-distillation shards (shard_*.npz)")
    ap.add_argument("--num-sequences", type=int, default=64, help="first rows of the shards used (and cached)")
    ap.add_argument("--cache-dir", default=None, help="feature cache folder (default: under --out-dir)")
    ap.add_argument("--out-dir", default="runs/train_step")
    ap.add_argument("--old", default=None, help="another checkout (its dspark_jax/) as the first arm")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per arm (after 2 warm-up rounds)")
    ap.add_argument("--flops", action="store_true", help="also the FLOP split (compiles each step once more)")
    ap.add_argument("--profile", action="store_true", help="also time the target's side and the optimizer alone")
    ap.add_argument("--json", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    import importlib

    from dspark_jax.api import load_target
    from dspark_jax.models.presets import canonical_preset
    from dspark_jax.training.data import batches, load_shards
    from dspark_jax.training.feature_cache import ensure_feature_cache

    args = _parser().parse_args(argv)
    args.preset = args.preset or canonical_preset(args.target) or args.target
    t0 = time.perf_counter()
    shards = sorted(Path(args.data_dir).glob("shard_[0-9]*[0-9].npz"))
    data = {k: v[: args.num_sequences] for k, v in load_shards(shards).items()}
    target, _ = load_target(args.target)
    here = {m: importlib.import_module(f"dspark_jax.{m}") for m in _MODULES}
    arms = [_arm("full-vocab", here, args, data, False, target), _arm("draft-vocab", here, args, data, True, target)]
    taps = arms[1]["dcfg"].taps
    cache_dir = args.cache_dir or str(Path(args.out_dir) / f"fcache-{args.target}-{args.num_sequences}")
    data = {**data, **ensure_feature_cache(cache_dir, target, data, taps, batch_size=8).batch_arrays(taps)}
    if args.old:
        arms.insert(0, _arm("old", load_checkout(args.old, _MODULES), args, data, False, None))
    print(f"models, data and feature cache: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for arm in arms:
        arm["batches"] = batches(data if arm["lse"] else _without_lse(data), arm["trainer"].cfg.batch_size, seed=0)

    def run(arm: dict[str, Any]) -> float:
        batch = next(arm["batches"])
        t = time.perf_counter()
        terms, _ = arm["trainer"].step(batch, arm["step"])
        arm["losses"].append(float(terms.loss))
        arm["step"] += 1
        arm["times"].append(time.perf_counter() - t)
        return arm["times"][-1]

    sample = next(batches(data, arms[0]["trainer"].cfg.batch_size, seed=1))
    # Counted before any step: a step donates its parameters, which the FLOP trainer shares.
    flops = {a["name"]: _flop_split(a, sample, a["lse"]) for a in arms if a["flop_trainer"] is not None}
    cases: dict[str, Any] = {a["name"]: functools.partial(run, a) for a in arms}
    parts = _part_cases(arms[-1], sample, data) if args.profile else {}
    med = alternate({**cases, **parts}, reps=args.steps, warmup=2)
    rows = [_row(arm, arms, med, flops.get(arm["name"], {})) for arm in arms]
    keys = dict.fromkeys(k for r in rows for k in r)  # every column, the old checkout's without a FLOP split
    rows = [{k: r.get(k) for k in keys} for r in rows]
    print(markdown_table(rows + [{"arm": k, "s/step": med[k]} for k in parts]))
    tc = arms[-1]["trainer"].cfg
    analytic = analytic_drafter_flops(arms[-1]["dcfg"], tc.batch_size, tc.anchors_per_seq, tc.seq_len)
    print(markdown_table([{"drafter's own (analytic)": k, "GFLOP": v} for k, v in analytic.items()], ".2f"))
    if args.json:
        out = [{**r, "losses": a["losses"], "seconds": a["times"]} for r, a in zip(rows, arms)]
        write_json(
            args.json,
            {
                "command": command_line("train_step", argv),
                "device": device_description(),
                "steps": args.steps,
                "warmup_rounds": 2,
                "arms": out,
                "parts_seconds": {k: med[k] for k in parts},
                "analytic_drafter_gflop": analytic,
            },
        )
    return 0


def _row(arm: dict[str, Any], arms: list[dict[str, Any]], med: dict[str, float], flops: dict[str, float]) -> dict:
    """An arm's table row: median s/step, speedup over the first arm and over ``full-vocab``, the FLOP
    split, the largest difference of its losses from the first arm's (the same steps)."""
    ref, full = arms[0], next(a for a in arms if a["name"] == "full-vocab")
    r: dict[str, Any] = {"arm": arm["name"], "s/step": med[arm["name"]]}
    r[f"speedup over {ref['name']}"] = med[ref["name"]] / med[arm["name"]]
    if ref is not full:
        r["speedup over full-vocab"] = med["full-vocab"] / med[arm["name"]]
    r.update({f"GFLOP {k}": v for k, v in flops.items()})
    r["max |loss - first arm's|"] = max(abs(x - y) for x, y in zip(arm["losses"], ref["losses"]))
    return r


if __name__ == "__main__":
    sys.exit(main())
