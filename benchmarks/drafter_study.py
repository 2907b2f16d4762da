"""Pieces shared by the drafter studies (:mod:`benchmarks.compare_drafters`, :mod:`benchmarks.learning_curve`).

Identical data for every drafter (the shard folder and its summary), ONE target-feature
cache over the union of the drafters' tap layers, training through
``dspark_jax.training.pipeline.run``, and held-out tau at several temperatures on the same
prompts, with the standard error of tau across prompts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# name -> TrainConfig overrides. Everything else (data, steps, batch, anchors, lr, block_size,
# seed) is shared by all drafters of a study.
DRAFTERS: dict[str, dict[str, Any]] = {
    "dspark-2L": dict(variant="dspark", num_layers=2, markov_head="vanilla"),
    "dflash-2L": dict(variant="dflash", num_layers=2),
    "dflash-5L": dict(variant="dflash", num_layers=5),
    "eagle3": dict(variant="eagle3", num_layers=1),
    "dspark-2L-gated": dict(variant="dspark", num_layers=2, markov_head="gated"),
    "dspark-2L-rnn": dict(variant="dspark", num_layers=2, markov_head="rnn"),
    "dspark-5L": dict(variant="dspark", num_layers=5, markov_head="vanilla"),
}
CHAT_SETS = ["mt_bench", "gsm8k", "humaneval", "alpaca"]
# evaluate_tau keys kept per dataset in the result JSONs
TAU_KEYS = (
    "tau",
    "acceptance_rate",
    "position_acceptance",
    "accept_rate_at_k",
    "num_requests",
    "num_target_passes",
    "num_generated_tokens",
)


def floats(s: str) -> list[float]:
    """``"0,1"`` -> ``[0.0, 1.0]``."""
    return [float(x) for x in s.split(",") if x.strip()]


def tkey(t: float) -> str:
    """Result key of temperature ``t``: ``T0``, ``T1``, ``T0.7``."""
    return f"T{t:g}"


def unknown_drafters(names: Sequence[str]) -> list[str]:
    return [n for n in names if n not in DRAFTERS]


def eval_prompts(target_name: str, tok, eval_texts: list[str], n: int, max_len: int) -> dict[str, list[list[int]]]:
    """Token ids of the evaluation prompts per dataset (chat template for chat targets).

    stories260k-like targets: the first ``n`` held-out TinyStories openings of the data run
    (``eval_texts``); chat targets: the first ``n`` first turns of each of :data:`CHAT_SETS`.
    Prompts of ``max_len`` tokens or more are dropped.
    """
    from dspark_jax.api import encode_prompt
    from dspark_jax.data.prompts import load_prompt_texts
    from dspark_jax.models.presets import preset_info

    chat = bool(preset_info(target_name).get("chat"))
    if not chat:
        sets = {"tinystories": eval_texts[:n]}
    else:
        sets = {s: load_prompt_texts(s)[0][:n] for s in CHAT_SETS}
    out = {}
    for name, texts in sets.items():
        ids = [encode_prompt(tok, t, chat) for t in texts]
        out[name] = [p for p in ids if len(p) < max_len]
    return out


def data_summary(shards: Sequence[Path], data_dir: Path, reused: bool, seconds: float) -> tuple[dict, dict[str, Any]]:
    """``(loaded arrays, summary)`` of the shared training shards: sequences, stored length and the
    number of target-generated tokens (prompt tokens excluded)."""
    from dspark_jax.training.data import load_shards

    data = load_shards(list(shards))
    info = {
        "dir": str(data_dir),
        "shards": len(shards),
        "sequences": int(data["tokens"].shape[0]),
        "seq_len": int(data["tokens"].shape[1]),
        "generated_tokens": int((data["lengths"] - data["prompt_lengths"]).sum()),
        "reused": reused,
        "seconds": round(seconds, 1),
    }
    return data, info


def shared_feature_cache(directory: Path, target, data: dict, cfgs: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(cfgs pointing at one cache, cache summary)``: the frozen target's features over ``data``
    for the union of every config's taps (Eagle3's low/mid/high, DSpark/DFlash's defaults), built
    once (or reopened) so each training run reads it instead of building its own."""
    from dspark_jax.training.feature_cache import ensure_feature_cache
    from dspark_jax.training.train_config import drafter_config

    t0 = time.perf_counter()
    union = sorted({t for c in cfgs.values() for t in drafter_config(c, target).taps})
    dtype = next(iter(cfgs.values())).feature_cache_dtype
    fc = ensure_feature_cache(directory, target, data, union, store_dtype=dtype)
    info = {
        "dir": str(fc.directory),
        "layers": fc.manifest["layers"],
        "dtype": fc.store_dtype,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"feature cache: {info}", file=sys.stderr)
    return {n: dataclasses.replace(c, feature_cache=str(fc.directory)) for n, c in cfgs.items()}, info


def train_drafter(cfg, target, tok, overrides: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Trains (or resumes) one drafter with ``dspark_jax.training.pipeline.run`` (no calibration,
    no evaluation); returns ``(exported drafter, training summary)``."""
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.training.pipeline import run as train_run

    summary = train_run(cfg, evaluate=False, calibrate=False, target_and_tokenizer=(target, tok))
    d, _ = load_drafter(summary["export_dir"])
    return d, {
        "overrides": dict(overrides),
        "variant": d.cfg.variant,
        "num_layers": d.cfg.num_layers,
        "markov_head": d.cfg.markov_head if d.cfg.markov else None,
        "block_size": d.cfg.block_size,
        "taps": list(d.cfg.taps),
        "params": summary["drafter_params"],
        "steps": summary["steps"],
        "train_seconds": summary["train_seconds"],
        "export_dir": summary["export_dir"],
        "final_train_metrics": summary["final_train_metrics"],
    }


def tau_stderr(request_tau: Sequence[float], passes: Sequence[int]) -> float | None:
    """Standard error across prompts of the pooled ``tau = sum(emitted) / sum(passes)``.

    The ratio estimator's delta-method error ``sqrt(sum r_i^2 / (n (n - 1))) / mean(passes)``
    with residuals ``r_i = emitted_i - tau * passes_i``; None for fewer than 2 prompts.
    """
    return paired_tau_stderr(request_tau, passes, None, None)


def paired_tau_stderr(
    tau_a: Sequence[float], passes_a: Sequence[int], tau_b: Sequence[float] | None, passes_b: Sequence[int] | None
) -> float | None:
    """Standard error of ``tau_a - tau_b`` measured on the SAME prompts (per-prompt residuals
    differenced, so the prompts' shared difficulty cancels); ``tau_b=None``: of ``tau_a`` alone.
    None for fewer than 2 prompts or no target pass."""

    def residuals(taus, passes):
        p = [int(x) for x in passes]
        e = [t * q if q else 0.0 for t, q in zip(taus, p)]
        if not sum(p):
            return None
        tau = sum(e) / sum(p)
        mean_p = sum(p) / len(p)
        return [(ei - tau * pi) / mean_p for ei, pi in zip(e, p)]

    ra = residuals(tau_a, passes_a)
    if ra is None or len(ra) < 2:
        return None
    if tau_b is not None and passes_b is not None:
        rb = residuals(tau_b, passes_b)
        if rb is None or len(rb) != len(ra):
            return None
        ra = [x - y for x, y in zip(ra, rb)]
    n = len(ra)
    mean = sum(ra) / n
    return math.sqrt(sum((x - mean) ** 2 for x in ra) / (n - 1) / n)


def evaluate_drafter(
    target,
    drafter,
    prompts: Mapping[str, list[list[int]]],
    temperature: float,
    max_new: int,
    batch_size: int,
    seed: int,
) -> dict[str, Any]:
    """Held-out tau of one drafter at one temperature by real speculative decoding.

    Returns:
      ``{"datasets": {name: evaluate_tau's TAU_KEYS + tau_stderr + request_tau /
      request_target_passes}, "macro_tau": mean tau over datasets, "macro_tau_stderr",
      "position_acceptance_pooled": conditional acceptance per block position pooled over
      datasets (None where never reached)}``.
    """
    import numpy as np

    from dspark_jax.evaluation.acceptance import evaluate_tau

    per = {}
    reached = np.zeros(drafter.cfg.block_size)
    accepted = np.zeros(drafter.cfg.block_size)
    for ds, ids in prompts.items():
        ev = evaluate_tau(
            target,
            drafter,
            ids,
            max_new_tokens=max_new,
            temperature=temperature,
            num_speculative_tokens=drafter.cfg.block_size,
            batch_size=batch_size,
            seed=seed,
        )
        per[ds] = {k: ev[k] for k in TAU_KEYS}
        per[ds]["tau_stderr"] = tau_stderr(ev["request_tau"], ev["request_target_passes"])
        per[ds]["request_tau"] = ev["request_tau"]
        per[ds]["request_target_passes"] = ev["request_target_passes"]
        reached += ev["position_reached"]
        accepted += ev["position_accepted"]
    errs = [v["tau_stderr"] for v in per.values()]
    return {
        "datasets": per,
        "macro_tau": float(np.mean([v["tau"] for v in per.values()])),
        # the datasets' prompts are independent: the mean's error adds their variances
        "macro_tau_stderr": None if None in errs else math.sqrt(sum(e * e for e in errs)) / len(errs),
        "position_acceptance_pooled": [float(a / r) if r else None for a, r in zip(accepted, reached)],
    }
