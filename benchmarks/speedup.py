"""Wall-clock speedup of speculative decoding at batch 1, with its bound and an outside baseline.

docs/design.md#metrics: speedup = tokens per second against plain autoregressive decoding
with the same target, prompts and sampling, measured in one run. For every drafter:

* measured: prompts decoded one at a time (batch 1), plain and speculative interleaved
  prompt by prompt (so load changes on a shared machine hit both alike), compilation
  excluded (:func:`dspark_jax.decoding.speculative.generate_speculative` times execution only) after
  one warm-up call per decoder;
* bound: ``tau * T_target_step / (T_draft + T_verify)`` with the tau measured on the same
  prompts, priced either (``--bound cost_table``, the CLI default, block drafters) by the
  decode loop's own cost tables over the rounds it actually ran (:func:`cost_table_bound`:
  for ``auto`` the mix of widths it chose and the rounds where it skipped drafting), or
  (``micro``, :func:`measure_speed`'s default) by jitted micro-benchmarks of one plain
  decode step, one drafting round and one verification pass (target over block_size + 1 tokens,
  rejection sampling, drafter cache update); the gap to the measured figure is the decode
  loop's overhead. The bound models the decode phase; with ``cost_table`` the decode phase is
  also measured alone (the loop's prefill timed per prompt, :func:`prefill_seconds`, and
  subtracted: ``decode_speedup``), and ``bound_ratio`` compares the bound with that;
* outside baseline: ``transformers`` ``generate`` (PyTorch, fp32) on the same weights
  (:func:`benchmarks.hf_baseline.hf_llama_from_params` converts the project's canonical
  parameters, whatever file they came from: llama2.c, GGUF or safetensors), same prompts and
  sampling.

CLI (one exported drafter, one prompt set; ``benchmarks.speed_table`` runs several sets and
temperatures and prints the table)::

    python -m benchmarks.speedup --target stories260k --drafter runs/stories260k/export --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import median_seconds
from benchmarks.hf_baseline import hf_generate, hf_llama_from_params
from dspark_jax.decoding.decode_profile import cached_cost_table
from dspark_jax.decoding.round import draft_tokens
from dspark_jax.decoding.round import prefill as pre_fill
from dspark_jax.decoding.speculative import (
    auto_cost_span,
    default_cache_len,
    generate_autoregressive,
    generate_speculative,
)
from dspark_jax.decoding.verifier import verify
from dspark_jax.drafters.base import BlockDrafter
from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

# ---------------------------------------------------------------------------------- step timings


def step_timings(
    target,
    drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    reps: int = 15,
    plain_step: bool = True,
) -> dict[str, float]:
    """Seconds of one plain decode step, one drafting round and one verification pass (batch 1).

    Measured at the middle of a generation (``len(prompt) + max_new_tokens // 2``) with the
    cache length the decode loops use; each piece is a separately jitted function, timed
    by its median over ``reps`` runs after a warm-up. ``drafter=None``: only the plain step;
    ``plain_step=False``: without it.

    Returns:
      ``{"t_target_step", "t_draft", "t_verify"}`` [s] (each only when measured).
    """
    g = drafter.cfg.block_size if drafter is not None else 0
    need = len(prompt) + max_new_tokens + g + 2
    cache_len = min(-(-need // 64) * 64, target.cfg.max_position)
    p = min(len(prompt) + max_new_tokens // 2, cache_len - g - 2)
    taps = drafter.cfg.taps if drafter is not None else ()
    t_graph, t_state = nnx.split(target)
    toks = jnp.asarray(np.resize(np.asarray(prompt, np.int32), p + g + 1)[None])  # a plausible context
    pos = jnp.arange(p, dtype=jnp.int32)[None]
    out = target(toks[:, :p], pos, target.init_cache(1, cache_len), taps=taps)
    tcache = out.cache
    samp = sampling_arrays(1, temperature)
    key = jax.random.PRNGKey(0)[None]
    res: dict[str, float] = {}

    @jax.jit
    def plain(ts, cache, tok, pos1):
        t = nnx.merge(t_graph, ts)
        o = t(tok, pos1, cache)
        return sample(key, process_logits(o.logits[:, 0], samp)), o.cache

    if plain_step or drafter is None:
        res["t_target_step"] = median_seconds(
            plain, t_state, tcache, toks[:, p : p + 1], jnp.array([[p]], jnp.int32), reps=reps
        )
    if drafter is None:
        return res
    d_graph, d_state = nnx.split(drafter)
    pos_all = jnp.arange(p, dtype=jnp.int32)[None]
    dcache = drafter.extend_cache(
        drafter.init_cache(1, cache_len), out.features, pos_all, target=target, tokens=toks[:, :p]
    )
    anchor, apos = toks[:, p], jnp.array([p], jnp.int32)

    @jax.jit
    def draft(ts, ds, cache):
        return draft_tokens(nnx.merge(t_graph, ts), nnx.merge(d_graph, ds), anchor, apos, cache, key, samp)

    d_out = draft(t_state, d_state, dcache)
    res["t_draft"] = median_seconds(draft, t_state, d_state, dcache, reps=reps)
    vpos = apos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)

    @jax.jit
    def verify_pass(ts, ds, tc, dc, d_tokens, d_probs):
        t, d = nnx.merge(t_graph, ts), nnx.merge(d_graph, ds)
        vtok = jnp.concatenate([anchor[:, None], d_tokens], axis=1)
        o = t(vtok, vpos, tc, taps=taps)
        r = verify(key, d_tokens, d_probs, process_logits(o.logits, samp), jnp.full((1,), g, jnp.int32))
        return r.tokens, o.cache, d.extend_cache(dc, o.features, vpos, target=t, tokens=vtok)

    res["t_verify"] = median_seconds(
        verify_pass, t_state, d_state, tcache, dcache, d_out.tokens, d_out.probs, reps=reps
    )
    return res


# ---------------------------------------------------------------------------------- measured speedup


def _entries(drafters: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int | str]]:
    """``name -> drafter`` and ``name -> num_speculative_tokens``: a value of ``drafters`` may be a
    drafter (its block size) or ``(drafter, num_speculative_tokens)`` (the same drafter at several
    lengths / ``"auto"``)."""
    n_spec = {n: (d[1] if isinstance(d, tuple) else d.cfg.block_size) for n, d in drafters.items()}
    return {n: (d[0] if isinstance(d, tuple) else d) for n, d in drafters.items()}, n_spec


def _one_run(target, drafters, n_spec, prompts, kw, seed, hf_model) -> dict[str, Any]:
    """One pass over ``prompts``: every decoder on a prompt before the next prompt (interleaved,
    so load changes on a shared machine hit all decoders alike).

    Returns:
      ``{"ar": rec, "hf": rec | None, "sp": {name: rec}}``; each ``rec`` has ``tokens`` and
      ``seconds`` (compilation excluded); a drafter's also ``same_as_ar`` and ``prompts``, one
      record per prompt of what its bound needs (KV-cache length, passes, emitted tokens,
      drafting rounds, passes per compiled verification width).
    """
    eos = list(target.cfg.eos_ids)
    ar = {"tokens": 0, "seconds": 0.0}
    sp = {n: {"tokens": 0, "seconds": 0.0, "same_as_ar": 0, "prompts": []} for n in drafters}
    hf = {"tokens": 0, "seconds": 0.0, "same_as_ar": 0} if hf_model is not None else None
    for i, p in enumerate(prompts):
        a = generate_autoregressive(target, [p], seed=seed + i, **kw)
        ar["tokens"] += a.num_tokens
        ar["seconds"] += a.seconds
        ref = a.generations[0].token_ids
        for n, d in drafters.items():
            s = generate_speculative(target, d, [p], seed=seed + i, num_speculative_tokens=n_spec[n], **kw)
            g = s.generations[0]
            sp[n]["tokens"] += s.num_tokens
            sp[n]["seconds"] += s.seconds
            sp[n]["same_as_ar"] += int(g.token_ids == ref)
            sp[n]["prompts"].append(
                {
                    "cache_len": s.cache_len,
                    "span": auto_cost_span([len(p)], [min(len(p) + kw["max_new_tokens"], s.cache_len)]),
                    "passes": g.num_target_passes,
                    "emitted": max(len(g.token_ids) - 1, 0),  # the prefill token is not a verify pass's
                    "drafted": g.num_drafting_rounds,
                    "widths": list(g.verify_width_rounds),
                }
            )
        if hf is not None:
            ids, secs = hf_generate(hf_model, p, kw["max_new_tokens"], kw["temperature"], seed + i, eos)
            hf["tokens"] += len(ids)
            hf["seconds"] += secs
            hf["same_as_ar"] += int(ids == ref)
    return {"ar": ar, "hf": hf, "sp": sp}


def cost_table_bound(target, drafter, per_prompt: Sequence[dict[str, Any]], greedy: bool) -> dict[str, Any]:
    """The bound ``tau * T_step / (T_draft + T_verify)`` priced by the cost tables the decode loop
    uses, over the rounds it actually ran.

    Every prompt's passes are priced by
    :func:`~dspark_jax.decoding.decode_profile.cached_cost_table` at that prompt's KV-cache
    length, looked up at the span ``auto`` uses
    (:func:`~dspark_jax.decoding.speculative.auto_cost_span`: the very costs
    ``num_speculative_tokens="auto"`` chose its widths with): ``T_draft`` (greedy or sampled)
    for a round that drafted, ``T_verify(w)`` at the compiled width ``w`` the pass verified (a
    fixed length ``n`` runs passes of width ``n``), and ``T_step`` (a plain step) for every
    emitted token's plain alternative. So for ``auto``, ``T_draft`` and ``T_verify`` are means
    per pass over the mix of widths it chose and the rounds where it skipped drafting, and
    ``bound = sum(emitted * T_step) / sum(pass costs) = tau * T_step / (T_draft + T_verify)``.

    Args:
      target / drafter: the models (a block drafter: DSpark / DFlash).
      per_prompt: records of ``_one_run`` (``cache_len``, ``span``, ``passes``, ``emitted``,
        ``drafted``, ``widths``: passes per compiled width 0..block size).
      greedy: T=0 (prices drafting at the greedy drafting round, else the sampled one).
    Returns:
      ``{"bound_from": "cost_table", "bound", "t_target_step_ms", "t_draft_ms", "t_verify_ms"
      (means per pass), "drafting_fraction", "width_mix" {w: fraction of passes},
      "cache_lens" (of the prompts), "cost_tables" {cache_len: CostTable.decode_ms()}}``
      (milliseconds at the table's first span).
    Raises:
      ValueError: a pass at a width the table did not measure.
    """
    tables = {c: cached_cost_table(target, drafter, c) for c in sorted({r["cache_len"] for r in per_prompt})}
    step = draft = verify = 0.0
    hist = np.zeros(drafter.cfg.block_size + 1, np.int64)
    drafted = emitted = 0
    for r in per_prompt:
        t, span = tables[r["cache_len"]], r.get("span", 0)
        h = np.asarray(r["widths"], np.int64)
        used = np.flatnonzero(h).tolist()
        step += r["emitted"] * t.step_seconds(span)
        draft += r["drafted"] * t.draft_seconds(greedy, span)
        verify += float(np.dot(h[used], t.verify_array(used, span))) if used else 0.0
        hist[: len(h)] += h
        drafted += r["drafted"]
        emitted += r["emitted"]
    passes = max(int(hist.sum()), 1)
    return {
        "bound_from": "cost_table",
        "bound": step / max(draft + verify, 1e-12),
        "t_target_step_ms": 1000 * step / max(emitted, 1),
        "t_draft_ms": 1000 * draft / passes,
        "t_verify_ms": 1000 * verify / passes,
        "drafting_fraction": drafted / passes,
        "width_mix": {int(w): float(hist[w]) / passes for w in np.flatnonzero(hist)},
        "cache_lens": sorted(int(c) for c in tables),
        "cost_tables": {int(c): t.decode_ms() for c, t in tables.items()},
    }


def prefill_seconds(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int, reps: int = 5):
    """Seconds of the decode loop's prefill of each prompt at batch 1 (median of ``reps``).

    The loop's own :func:`~dspark_jax.decoding.round.prefill` (target over the prompt padded as
    the loop pads it, the first token, and with a drafter its context cache), jitted alone at
    the KV-cache length the loop uses; the first token greedy (sampling it costs the same up to
    noise). Measured once per (model configs, prompt, cache length) in a process, as the cost
    tables are (costs do not depend on weight values). ``drafter=None``: plain decoding's prefill.

    Returns:
      ``[len(prompts)]`` seconds.
    """
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(drafter) if drafter is not None else (None, None)
    taps = drafter.cfg.taps if drafter is not None else ()
    g = drafter.cfg.block_size if drafter is not None else 0
    dcfg = (drafter.cfg, jnp.dtype(drafter.dtype).name) if drafter is not None else None
    samp, key = sampling_arrays(1, 0.0), jax.random.PRNGKey(0)[None]

    @partial(jax.jit, static_argnames=("cache_len",))
    def run(ts, ds, prompt, plen, cache_len):
        d = None if ds is None or d_graph is None else nnx.merge(d_graph, ds)
        return pre_fill(nnx.merge(t_graph, ts), d, prompt, plen, key, samp, cache_len, taps).token

    out = []
    for p in prompts:
        cl = default_cache_len(target, [p], max_new_tokens, g)
        k = (target.cfg, jnp.dtype(target.dtype).name, dcfg, tuple(p), cl)
        if k not in _PREFILL_S:
            tp = min(-(-len(p) // 32) * 32, cl)  # the loop pads prompts to a multiple of 32 (loop.make_batch)
            arr = np.zeros((1, tp), np.int32)
            arr[0, : len(p)] = p
            plen = jnp.asarray([len(p)], jnp.int32)
            _PREFILL_S[k] = median_seconds(
                partial(run, cache_len=cl), t_state, d_state, jnp.asarray(arr), plen, reps=reps
            )
        out.append(_PREFILL_S[k])
    return out


_PREFILL_S: dict[tuple, float] = {}


def _rates(recs: Sequence[dict[str, Any]], ar: dict[str, Any] | None, prefill_s=None) -> dict[str, Any]:
    """Medians over repeats of one decoder's runs: tokens/s and (given plain's rates ``ar``)
    speedup, the median of the per-run ratios (each run's decoders interleaved).

    ``prefill_s`` (seconds of each prompt's prefill, :func:`prefill_seconds`): also the decode
    phase alone, ``decode_tokens_per_s`` = tokens after the prefill's first one / (seconds -
    prefill seconds), and ``decode_speedup``, what the bound predicts.
    """
    tps = [r["tokens"] / max(r["seconds"], 1e-9) for r in recs]
    out: dict[str, Any] = {
        "tokens": recs[0]["tokens"],
        "seconds": statistics.median(r["seconds"] for r in recs),
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_runs": tps,
    }
    if ar is not None:
        out["speedup_runs"] = [a / b for a, b in zip(tps, ar["tokens_per_s_runs"])]
        out["speedup"] = statistics.median(out["speedup_runs"])
    if prefill_s is not None:
        n, pre = len(prefill_s), sum(prefill_s)
        dtps = [(r["tokens"] - n) / max(r["seconds"] - pre, 1e-9) for r in recs]
        out.update(
            prefill_ms=1000 * pre / n, decode_tokens_per_s=statistics.median(dtps), decode_tokens_per_s_runs=dtps
        )
        if ar is not None:
            out["decode_speedup"] = statistics.median(a / b for a, b in zip(dtps, ar["decode_tokens_per_s_runs"]))
    return out


def _drafter_row(target, d, spec, recs, ar, pre, bound_from, micro_args) -> dict[str, Any]:
    """One drafter entry's result: rates, tau, same_as_ar and the bound (module docstring)."""
    first = recs[0]
    r = _rates(recs, ar, pre)
    r["num_speculative_tokens"] = spec if spec is not None else d.cfg.block_size
    r["same_as_ar"] = first["same_as_ar"]
    r["passes"] = sum(p["passes"] for p in first["prompts"])
    r["emitted"] = sum(p["emitted"] for p in first["prompts"])
    r["tau"] = r["emitted"] / max(r["passes"], 1)
    if _cost_priced(d, spec, bound_from):
        r.update(cost_table_bound(target, d, first["prompts"], greedy=micro_args[2] <= 0))
    else:
        t_step = micro_args[-1]["t_target_step"]
        t = step_timings(target, d, *micro_args[:-1], plain_step=False)
        r.update(
            bound_from="micro",
            t_target_step_ms=1000 * t_step,
            t_draft_ms=1000 * t["t_draft"],
            t_verify_ms=1000 * t["t_verify"],
            bound=r["tau"] * t_step / (t["t_draft"] + t["t_verify"]),
        )
    # the bound models the decode phase: compare it with the decode-phase speedup when measured
    measured = r.get("decode_speedup", r["speedup"])
    r["bound_ratio_of"] = "decode_speedup" if "decode_speedup" in r else "speedup"
    r["bound_ratio"] = measured / r["bound"] if r["bound"] > 0 else None
    return r


def measure_speed(
    target,
    drafters: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    hf_model=None,
    timing_reps: int = 15,
    repeats: int = 1,
    bound_from: str = "micro",
    cost_repeats: int | None = None,
) -> dict[str, Any]:
    """Batch-1 tokens/s of plain decoding, of each drafter and of transformers, in one process.

    Args:
      drafters: ``name -> drafter`` or ``name -> (drafter, num_speculative_tokens)``.
      repeats: passes over the prompts (each interleaved prompt by prompt); tokens/s and
        speedups are medians over them (token counts and tau do not change: same seeds).
      bound_from: ``"micro"``: the bound from :func:`step_timings` (any drafter, fixed lengths);
        ``"cost_table"``: :func:`cost_table_bound` (block drafters; others fall back to micro),
        and the decode phase measured alone too (:func:`prefill_seconds` subtracted), which
        the bound is compared with. An ``"auto"`` entry is always priced by the cost table.
      cost_repeats: measure the cost tables of these prompts' KV-cache lengths first, with this
        many repeats (``auto`` then decides by, and the bound is priced by, these tables;
        default: the decode loop measures them on first use with 5). A table already measured
        in this process is reused as it is.
    Returns:
      ``{"ar": {...}, "hf_transformers": {...} | None, "drafters": {name: {...}}}`` with
      tokens, seconds, tokens_per_s (+ per-run lists), and per drafter speedup (vs plain JAX
      decoding), tau, same_as_ar (prompts whose tokens equal plain decoding's), step timings
      [ms], the bound ``tau * T_target_step / (T_draft + T_verify)`` and ``bound_ratio``
      (measured speedup / bound, of the decode phase when measured: ``bound_ratio_of``; the
      gap is the decode loop's overhead).
    """
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=temperature)
    drafters, n_spec = _entries(drafters)
    priced = {n: _cost_priced(d, n_spec[n], bound_from) for n, d in drafters.items()}
    if cost_repeats:
        for d in {id(d): d for n, d in drafters.items() if priced[n]}.values():
            for c in sorted({default_cache_len(target, [p], max_new_tokens, d.cfg.block_size) for p in prompts}):
                cached_cost_table(target, d, c, repeats=cost_repeats)
    # warm-up (compilation of every prompt shape happens outside the timed runs anyway)
    generate_autoregressive(target, [prompts[0]], seed=seed, **kw)
    for n, d in drafters.items():
        generate_speculative(target, d, [prompts[0]], seed=seed, num_speculative_tokens=n_spec[n], **kw)
    if hf_model is not None:
        hf_generate(hf_model, prompts[0], 4, temperature, seed, list(target.cfg.eos_ids))
    runs = [_one_run(target, drafters, n_spec, prompts, kw, seed, hf_model) for _ in range(max(repeats, 1))]
    pre: dict[Any, Any] = {None: None}
    if bound_from == "cost_table":
        pre = {None: prefill_seconds(target, None, prompts, max_new_tokens)}
        pre.update({id(d): prefill_seconds(target, d, prompts, max_new_tokens) for d in drafters.values()})
    ar = _rates([r["ar"] for r in runs], None, pre[None])
    ar["ms_per_token"] = 1000 / max(ar["tokens_per_s"], 1e-9)
    micro = bound_from == "micro" or not all(priced.values())
    base_t = step_timings(target, None, prompts[0], max_new_tokens, temperature, reps=timing_reps) if micro else {}
    out: dict[str, Any] = {
        "temperature": temperature,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": len(runs),
        "ar": ar,
        "drafters": {},
    }
    hf = None
    if hf_model is not None:
        hf = _rates([r["hf"] for r in runs], ar)
        hf["vs_jax_ar"] = hf.pop("speedup")
        hf["same_as_ar"] = runs[0]["hf"]["same_as_ar"]
    out["hf_transformers"] = hf
    micro_args = (prompts[0], max_new_tokens, temperature, timing_reps, base_t)
    for n, d in drafters.items():
        recs = [run["sp"][n] for run in runs]
        out["drafters"][n] = _drafter_row(target, d, n_spec[n], recs, ar, pre.get(id(d)), bound_from, micro_args)
    # plain decoding's T_step: the micro-benchmark's, else the first cost-table-priced row's
    first_ms = next(iter(out["drafters"].values()), {}).get("t_target_step_ms")
    ar["t_target_step_ms"] = 1000 * base_t["t_target_step"] if base_t else first_ms
    return out


def _cost_priced(drafter, n_spec, bound_from: str) -> bool:
    """Whether an entry's bound comes from the cost table (block drafters only)."""
    return isinstance(drafter, BlockDrafter) and (bound_from == "cost_table" or n_spec == "auto")


def speculative_entries(drafter, lengths: str) -> dict[str, Any]:
    """``--num-speculative-tokens`` (comma-separated lengths and/or ``auto``; empty: the block
    size) -> :func:`measure_speed` entries ``drafter-<n>`` (or ``drafter``)."""
    vals = [v.strip() for v in lengths.split(",") if v.strip()]
    if not vals:
        return {"drafter": drafter}
    return {f"drafter-{v}": (drafter, v if v == "auto" else int(v)) for v in vals}


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.api import encode_prompt
    from dspark_jax.data.prompts import load_prompt_texts
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.models.presets import preset_info, resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speedup",
        description="Batch-1 speedup of one drafter over plain decoding (+ transformers).",
    )
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="export directory")
    ap.add_argument("--prompts", default="tinystories")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument(
        "--num-speculative-tokens",
        default="",
        help="comma-separated lengths and/or 'auto' to compare (default: the block size)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="interleaved passes over the prompts (medians)")
    ap.add_argument(
        "--bound",
        choices=("cost_table", "micro"),
        default="cost_table",
        help="price the bound by the decode loop's cost tables (block drafters) or by micro-benchmarks",
    )
    ap.add_argument(
        "--cost-repeats",
        type=int,
        default=0,
        help="measure the cost tables (auto's and the bound's) ahead with this many repeats (default: 5, on first use)",
    )
    args = ap.parse_args(argv)
    cfg, params, tok = resolve_target(args.target)
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    drafter, meta = load_drafter(args.drafter)
    texts, _ = load_prompt_texts(args.prompts, meta)
    chat = bool(preset_info(args.target).get("chat"))
    ids = [encode_prompt(tok, t, chat) for t in texts[: args.num_prompts]]
    hf = None if args.no_hf else hf_llama_from_params(cfg, params)
    res = measure_speed(
        target,
        speculative_entries(drafter, args.num_speculative_tokens),
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        hf_model=hf,
        repeats=args.repeats,
        bound_from=args.bound,
        cost_repeats=args.cost_repeats,
    )
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
