"""Cost table of batch-1 decoding on this machine, with plain-decoding references.

In one process (docs/design.md#performance-anchors; the cost table behind
``num_speculative_tokens="auto"``, :mod:`dspark_jax.decoding.decode_profile`), at the attention
span the decode loop's table is measured at by default (``span``; ``--spans`` measures several,
alternated, and adds ``by_span``):

* ``t_step_ms``: a plain decode step (batch 1, no drafter);
* ``t_verify_ms``: verified tokens (1 .. block_size + 1) -> ms, each length its own compiled
  program (target pass + rejection sampling + drafter context write);
* ``t_draft_ms`` / ``t_draft_sampled_ms``: one drafting round (backbone + Markov sampler +
  confidences) at T=0 / T=1, at the drafter's draft vocabulary;
* ``t_context_ms``: writing ``block_size + 1`` tokens' drafter context alone;
* ``ar_tokens_per_s``: plain JAX decoding of real prompts (batch 1, greedy, compilation excluded);
* ``hf_tokens_per_s``: ``transformers`` ``generate`` on the same weights and prompts (fp32,
  2 torch threads, sdpa attention);
* ``bandwidth_bound_tokens_per_s``: measured read bandwidth (a jitted sum over a 1 GiB float32
  array, median of 5) / the target's weight bytes read per step.

All medians of alternated repeats. CLI::

    python -m benchmarks.decode_costs --target smollm2-135m-instruct --random-drafter \\
        --draft-vocab-size 8192 --json decode_costs.json
    python -m benchmarks.decode_costs --target stories260k --drafter runs/stories260k/export
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import write_json
from benchmarks.hf_baseline import hf_generate, hf_llama_from_params


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth [GB/s]: a jitted sum over ``gib`` GiB of float32, median of ``repeats``."""
    n = int(gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    del x
    return n * 4 / statistics.median(ts) / 1e9


def random_drafter(target, preset: str, draft_vocab_size: int, seed: int = 0):
    """The preset's drafter architecture with random weights (costs do not depend on values).
    With a draft vocabulary, its ids are the ``draft_vocab_size`` lowest (any ids cost the same)."""
    from dspark_jax.drafters.build import build_drafter
    from dspark_jax.models.presets import canonical_preset
    from dspark_jax.training.recipes import TRAIN_PRESETS
    from dspark_jax.training.train_config import TrainConfig, drafter_config

    cfg = TRAIN_PRESETS.get(canonical_preset(preset) or "", TrainConfig())
    if draft_vocab_size >= 0:
        cfg = cfg.with_keys(draft_vocab_size=draft_vocab_size)
    d = build_drafter(drafter_config(cfg, target), nnx.Rngs(seed))
    if d.cfg.draft_vocab_size:
        d.set_draft_vocab(range(d.cfg.draft_vocab_size))
    return d


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.api import encode_prompt
    from dspark_jax.data.prompts import load_prompt_texts
    from dspark_jax.decoding.decode_profile import measure_costs
    from dspark_jax.decoding.speculative import generate_autoregressive
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.models.presets import preset_info, resolve_target
    from dspark_jax.models.target import Target
    from dspark_jax.models.weights import params_fingerprint

    args = build_parser().parse_args(argv)

    cfg, params, tok = resolve_target(args.target)
    target = Target(cfg, params, fingerprint=params_fingerprint(params))
    sizes = [int(v) for v in str(args.draft_vocab_size).split(",") if v.strip()]
    if args.drafter:
        drafter, meta = load_drafter(args.drafter)
    else:
        drafter, meta = random_drafter(target, args.target, sizes[0]), {}
    chat = bool(preset_info(args.target).get("chat"))
    texts, _ = load_prompt_texts(args.prompts or ("mt_bench" if chat else "tinystories"), meta)
    prompts = [encode_prompt(tok, t, chat) for t in texts[: args.num_prompts]]
    block_size = drafter.cfg.block_size
    need = max(map(len, prompts)) + args.max_new_tokens + block_size + 2
    cache_len = args.cache_len or min(-(-need // 64) * 64, cfg.max_position)

    spans = [int(v) for v in args.spans.split(",") if v.strip()] if args.spans else None
    table = measure_costs(
        target, drafter, widths=range(block_size + 1), cache_len=cache_len, spans=spans, repeats=args.repeats
    )
    first = table.span_for(("step",), spans[0] if spans else 0) or 0
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=0.0, cache_len=cache_len)
    generate_autoregressive(target, [prompts[0]], **kw)  # compile
    hf = None if args.no_hf else hf_llama_from_params(cfg, params)
    ar_t, ar_s, hf_t, hf_s = plain_timings(target, hf, prompts, kw)
    bw = read_bandwidth_gb_s()
    weight_bytes = sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(nnx.state(target)))
    d_params = sum(int(np.asarray(x).size) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
    res = {
        "target": cfg.name,
        "drafter": args.drafter or "random",
        "block_size": block_size,
        "draft_vocab_size": drafter.cfg.draft_vocab_size or cfg.vocab_size,
        "drafter_params": d_params,
        "cache_len": cache_len,
        **table.decode_ms(first),
        "ar_tokens_per_s": ar_t / max(ar_s, 1e-9),
        "hf_tokens_per_s": (hf_t / max(hf_s, 1e-9)) if hf is not None else None,
        "read_bandwidth_gb_s": bw,
        "target_weight_bytes": weight_bytes,
        "bandwidth_bound_tokens_per_s": bw * 1e9 / weight_bytes,
    }
    add_ratios(res, table)
    print_costs(res, cfg.name, cache_len, first)
    if len(sizes) > 1 and not args.drafter:
        res["draft_vocab_sweep"] = draft_vocab_sweep(target, args, sizes, block_size, cache_len, spans, first)
    if args.json:
        write_json(args.json, res)
    return 0


def draft_vocab_sweep(target, args, sizes: list[int], block_size: int, cache_len: int, spans, first: int) -> dict:
    """Drafting and full-block verification costs (ms, medians over ``--sweep-rounds`` alternated
    rounds) of a random drafter per draft vocabulary size in ``sizes`` (0 = the full vocabulary)."""
    from dspark_jax.decoding.decode_profile import measure_costs

    cfg = target.cfg
    sweep: dict = {}
    tables = {n: [] for n in sizes}
    for _ in range(args.sweep_rounds):  # alternate the sizes: each value is the median of the rounds
        for n in sizes:
            d = random_drafter(target, args.target, n)
            tables[n].append(
                measure_costs(
                    target,
                    d,
                    widths=(0, block_size),
                    cache_len=cache_len,
                    spans=spans,
                    repeats=max(3, args.repeats // 3),
                )
            )
    verify_col = f"t_verify_ms[{block_size + 1}]"
    print(f"\n  {'draft vocab':>12} {'t_draft_ms T=0':>15} {'T=1':>8} {verify_col:>15}")
    for n in sizes:
        med = lambda f, n=n: statistics.median(f(t) for t in tables[n])
        row = {
            "t_draft_ms": 1e3 * med(lambda t: t.draft_seconds(True, first)),
            "t_draft_sampled_ms": 1e3 * med(lambda t: t.draft_seconds(False, first)),
            "t_verify_full_block_ms": 1e3 * med(lambda t: float(t.verify_array([block_size], first)[0])),
        }
        sweep[n or cfg.vocab_size] = row
        print(
            f"  {n or cfg.vocab_size:>12} {row['t_draft_ms']:>15.2f} {row['t_draft_sampled_ms']:>8.2f} "
            f"{row['t_verify_full_block_ms']:>15.2f}"
        )
    return sweep


def plain_timings(target, hf, prompts, kw: dict) -> tuple[float, float, float, float]:
    """Greedy plain decoding of every prompt by the target (compiled already) and by transformers'
    ``hf`` (None: skipped), alternated prompt by prompt: ``(JAX tokens, JAX seconds, transformers
    tokens, transformers seconds)``; ``kw``: generate_autoregressive's settings."""
    from dspark_jax.decoding.speculative import generate_autoregressive

    eos = list(target.cfg.eos_ids)
    if hf is not None:
        import torch

        torch.set_num_threads(2)
        hf.config._attn_implementation = "sdpa"
        hf_generate(hf, prompts[0], 4, 0.0, 0, eos)
    ar_t = ar_s = hf_t = hf_s = 0.0
    for p in prompts:  # alternated prompt by prompt
        a = generate_autoregressive(target, [p], **kw)
        ar_t, ar_s = ar_t + a.num_tokens, ar_s + a.seconds
        if hf is not None:
            ids, secs = hf_generate(hf, p, kw["max_new_tokens"], 0.0, 0, eos)
            hf_t, hf_s = hf_t + len(ids), hf_s + secs
    return ar_t, ar_s, hf_t, hf_s


def add_ratios(res: dict, table) -> None:
    """Keys ``res["t_verify_ms"]`` by verified tokens, adds the costs at every measured span of
    ``table`` (when several) and the ratios draft / step, plain / bandwidth bound, plain / transformers."""
    res["t_verify_ms"] = {w + 1: v for w, v in res["t_verify_ms"].items()}  # keyed by verified tokens
    if len(table.spans()) > 1:
        res["by_span"] = {s: table.decode_ms(s) for s in table.spans()}
    res["draft_over_step"] = res["t_draft_ms"] / res["t_step_ms"]
    res["ar_over_bound"] = res["ar_tokens_per_s"] / res["bandwidth_bound_tokens_per_s"]
    if res["hf_tokens_per_s"]:
        res["ar_over_hf"] = res["ar_tokens_per_s"] / res["hf_tokens_per_s"]


def print_costs(res: dict, target_name: str, cache_len: int, first: int) -> None:
    """Prints the cost table of :func:`main`'s result ``res`` (measured at attention span ``first``)."""
    rows = [
        ("t_step_ms", res["t_step_ms"]),
        ("t_draft_ms (T=0)", res["t_draft_ms"]),
        ("t_draft_ms (T=1)", res["t_draft_sampled_ms"]),
        ("t_context_ms", res["t_context_ms"]),
    ]
    rows += [(f"t_verify_ms[{k} tokens]", v) for k, v in res["t_verify_ms"].items()]
    rows += [
        ("ar_tokens_per_s", res["ar_tokens_per_s"]),
        ("hf_tokens_per_s", res["hf_tokens_per_s"]),
        ("bandwidth_bound_tokens_per_s", res["bandwidth_bound_tokens_per_s"]),
        ("draft / step", res["draft_over_step"]),
        ("ar / bound", res["ar_over_bound"]),
        ("ar / hf", res.get("ar_over_hf")),
    ]
    head = f"{target_name}  drafter={res['drafter']}  draft vocab={res['draft_vocab_size']}  cache={cache_len}"
    print(f"{head}  span={first}")
    for k, v in rows:
        print(f"  {k:<32} {'-' if v is None else f'{v:10.3f}'}")
    for s, row in res.get("by_span", {}).items():
        verify = ", ".join(f"{w + 1}: {v:.3f}" for w, v in row["t_verify_ms"].items())
        print(f"  span {s:>6}: step {row['t_step_ms']:.3f} ms, draft {row['t_draft_ms']:.3f} ms, verify {verify}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.decode_costs",
        description="Batch-1 cost table (plain step, verify per length, draft, context).",
    )
    parser.add_argument("--target", required=True, help="preset name or model path")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--drafter", help="export directory")
    src.add_argument("--random-drafter", action="store_true", help="the preset's drafter shape, random weights")
    parser.add_argument(
        "--draft-vocab-size",
        default="-1",
        help="with --random-drafter: draft vocabulary size (0 = full; default: the preset's); a "
        "comma-separated list measures one cost table per size (drafting and verification "
        "only, in the same process, alternated) and writes them under 'draft_vocab_sweep'",
    )
    parser.add_argument("--prompts", default=None, help="prompt set for the tokens/s references (default: by preset)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cache-len", type=int, default=0, help="KV-cache length (default: as generate uses)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--spans",
        default=None,
        help="comma-separated attention spans [tokens] to measure at (whole KV blocks; default: the "
        "decode loop's one); the first is the headline, all go under 'by_span'",
    )
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument(
        "--sweep-rounds",
        type=int,
        default=3,
        help="draft-vocabulary sweep: cost tables per size, alternated (each compiles anew)",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


if __name__ == "__main__":
    sys.exit(main())
