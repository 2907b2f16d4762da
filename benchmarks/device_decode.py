"""The decode sections of :mod:`benchmarks.device_check`: ``step`` (a batch-1 plain decode step at
several cache and live lengths), ``roofline`` (those steps and ``generate_autoregressive`` against
the memory-bandwidth roofline) and ``exactness`` (bfloat16 greedy speculative decoding against a
one-pass recomputation)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.device_setup import PEAK_BW_GB_S, Context, peak, random_drafter, table
from benchmarks.harness import ratio
from dspark_jax.config import DrafterConfig
from dspark_jax.models.target import Target


def _step_exe(target: Target, cache_len: int):
    """A compiled batch-1 plain decode step ``(state, cache, token [1, 1], pos [1, 1]) -> (next
    token [1, 1], cache)`` with the cache donated, and its compile seconds."""
    graph, state = nnx.split(target)

    def step(state, cache, tok, pos):
        out = nnx.merge(graph, state)(tok, pos, cache=cache)
        return jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)[:, None], out.cache

    cache = target.init_cache(1, cache_len)
    one = jnp.zeros((1, 1), jnp.int32)
    t0 = time.perf_counter()
    exe = jax.jit(step, donate_argnums=(1,)).lower(state, cache, one, one).compile()
    return exe, state, cache, time.perf_counter() - t0


def measure_steps(ctx: Context, caches: tuple[int, ...]) -> list[dict[str, Any]]:
    """Median ms of the plain step per (cache length, live length); live lengths alternate."""
    p, rows = ctx.plan, []
    for c in caches:
        exe, state, cache, csec = _step_exe(ctx.target, c)
        ctx.compile_s[f"step[cache={c}]"] = csec
        lives = sorted({n for n in p.lives if n < c} | {c * 3 // 4})
        times: dict[int, list[float]] = {n: [] for n in lives}
        tok = jnp.zeros((1, 1), jnp.int32)
        for rep in range(p.reps + 1):
            for n in lives if rep % 2 else lives[::-1]:
                pos = jnp.full((1, 1), n, jnp.int32)
                t0 = time.perf_counter()
                tok, cache = exe(state, cache, tok, pos)
                jax.block_until_ready(tok)
                if rep:
                    times[n].append(time.perf_counter() - t0)
        rows += [{"cache_len": c, "live_len": n, "step_ms": 1e3 * statistics.median(times[n])} for n in lives]
        del cache
        ctx.partial({"rows": rows})
    base = {r["live_len"]: r["step_ms"] for r in rows if r["cache_len"] == caches[0]}
    for r in rows:
        r["over_smallest_cache"] = ratio(r["step_ms"], base.get(r["live_len"]))
    return rows


def section_step(ctx: Context) -> dict[str, Any]:
    ctx.step_rows = measure_steps(ctx, ctx.plan.caches)
    rows = [[r["cache_len"], r["live_len"], r["step_ms"], r["over_smallest_cache"]] for r in ctx.step_rows]
    table("step: batch-1 plain decode step", ["cache", "live", "ms", f"x cache {ctx.plan.caches[0]}"], rows)
    return {"rows": ctx.step_rows}


def weight_bytes_per_token(target: Target) -> int:
    """Bytes of weights a decode step reads: every layer, the final norm, the LM head (the
    embedding when tied) and one embedding row."""
    itemsize = jnp.dtype(target.dtype).itemsize
    layers = sum(int(v.size) for v in jax.eval_shape(target.layer_weights).values())
    cfg = target.cfg
    return itemsize * (layers + cfg.hidden_size * (cfg.vocab_size + 2))


def kv_bytes(target: Target, n: int) -> int:
    """Bytes of keys and values of ``n`` positions (all layers)."""
    c = target.cfg
    return 2 * c.num_layers * n * c.num_kv_heads * c.head_dim * jnp.dtype(target.dtype).itemsize


def _gbs(r: dict[str, Any]) -> list[Any]:
    return [r["fraction_of_roofline"], r["gb_s_live"], r["gb_s_dense"]]


def section_roofline(ctx: Context) -> dict[str, Any]:
    from dspark_jax.decoding.speculative import generate_autoregressive

    p, target = ctx.plan, ctx.target
    steps = ctx.step_rows or measure_steps(ctx, p.caches[:1])
    prompt = list(np.random.default_rng(1).integers(3, ctx.cfg.vocab_size, p.lives[0]))
    run = lambda: generate_autoregressive(
        target, [prompt], max_new_tokens=p.ar_new, temperature=0.0, cache_len=p.caches[0]
    )
    first = run()  # compiles
    ctx.compile_s[f"generate_autoregressive[cache={p.caches[0]}]"] = first.compile_seconds
    res = sorted((run() for _ in range(3)), key=lambda r: r.seconds)[1]
    ar = {"cache_len": p.caches[0], "live_len": len(prompt) + p.ar_new // 2, "step_ms": 1e3 * res.seconds / p.ar_new}
    bw = peak(PEAK_BW_GB_S, ctx.report["meta"]["device_kind"])
    w = weight_bytes_per_token(target)
    rows = []
    for kind, r in [("step", r) for r in steps] + [("generate_autoregressive", ar)]:
        live_b, dense_b, s = w + kv_bytes(target, r["live_len"]), w + kv_bytes(target, r["cache_len"]), r["step_ms"]
        roof = None if bw is None else 1e3 * live_b / (bw * 1e9)
        rows.append(
            {
                "program": kind,
                "cache_len": r["cache_len"],
                "live_len": r["live_len"],
                "ms_per_token": s,
                "bytes_live": live_b,
                "bytes_dense": dense_b,
                "roofline_ms": roof,
                "fraction_of_roofline": ratio(roof, s),
                "gb_s_live": live_b / s / 1e6,
                "gb_s_dense": dense_b / s / 1e6,
            }
        )
    table(
        f"roofline: peak {bw} GB/s, weights {w / 1e9:.3g} GB per token",
        ["program", "cache", "live", "ms/token", "roofline ms", "fraction", "GB/s live", "GB/s dense"],
        [[r[k] for k in ("program", "cache_len", "live_len", "ms_per_token", "roofline_ms")] + _gbs(r) for r in rows],
    )
    return {"peak_bandwidth_gb_s": bw, "weight_bytes_per_token": w, "rows": rows}


# ----------------------------------------------------------------------------- exactness


def _full_pass_argmax(target: Target, seqs: np.ndarray) -> tuple[np.ndarray, float]:
    """Argmax ``[B, T]`` of one cache-less target pass over ``seqs [B, T]``, and its compile seconds."""
    graph, state = nnx.split(target)

    def f(state, toks):
        pos = jnp.broadcast_to(jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
        return jnp.argmax(nnx.merge(graph, state)(toks, pos).logits, axis=-1)

    toks = jnp.asarray(seqs, jnp.int32)
    t0 = time.perf_counter()
    exe = jax.jit(f).lower(state, toks).compile()
    csec = time.perf_counter() - t0
    return np.asarray(exe(state, toks)), csec


def exactness_case(
    name: str, target: Target, drafter: Any, shape: tuple[int, int, int], block_size: int, compile_s
) -> dict:
    """Greedy speculative and plain decoding of random prompts; the committed tokens against the
    argmax of a one-pass recomputation of the final sequences."""
    from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative

    b, plen, new = shape
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, target.cfg.vocab_size, plen)] for _ in range(b)]
    spec = generate_speculative(
        target, drafter, prompts, max_new_tokens=new, temperature=0.0, num_speculative_tokens=block_size
    )
    plain = generate_autoregressive(target, prompts, max_new_tokens=new, temperature=0.0)
    gens = [g.token_ids for g in spec.generations]
    seqs = np.zeros((b, plen + max(map(len, gens))), np.int32)
    for i, g in enumerate(gens):
        seqs[i, : plen + len(g)] = prompts[i] + g
    am, csec = _full_pass_argmax(target, seqs)
    compile_s[f"exactness[{name}].generate_speculative"] = spec.compile_seconds
    compile_s[f"exactness[{name}].generate_autoregressive"] = plain.compile_seconds
    compile_s[f"exactness[{name}].full_pass"] = csec
    agree = [am[i, plen - 1 : plen - 1 + len(g)] == np.asarray(g) for i, g in enumerate(gens)]
    plain_ids = [q.token_ids for q in plain.generations]
    same = [np.asarray(g[: len(q)]) == np.asarray(q[: len(g)]) for g, q in zip(gens, plain_ids)]
    firsts = [int(np.argmin(s)) if not s.all() else len(s) for s in same]
    acc = [g.acceptance_rate for g in spec.generations if g.acceptance_rate is not None]
    return {
        "model": name,
        "dtype": str(jnp.dtype(target.dtype)),
        "tokens": int(sum(map(len, gens))),
        "argmax_agreement": float(np.concatenate(agree).mean()),
        "plain_vs_speculative_agreement": float(np.concatenate(same).mean()),
        "first_divergence_min": min(firsts),
        "acceptance_rate": float(np.mean(acc)) if acc else None,
        "tau": float(np.nanmean([g.tau for g in spec.generations])),
    }


def _stories260k(dtype: Any, block_size: int):
    """stories260K (``$DSPARK_MODELS``) in ``dtype`` with a random drafter, or None when absent."""
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.models.presets import resolve_target

    try:
        cfg, params, _ = resolve_target("stories260k")
    except (DSparkInputError, OSError):
        return None
    target = Target(cfg, params, dtype=dtype)
    return target, random_drafter(DrafterConfig.for_target(cfg, block_size=block_size, num_layers=1), dtype)


def section_exactness(ctx: Context) -> dict[str, Any]:
    bf16, p = jnp.bfloat16, ctx.plan
    if jnp.dtype(ctx.dtype) == jnp.dtype(bf16):
        target, drafter = ctx.target, ctx.drafter
    else:  # bfloat16 copies of the same weights
        target = Target(ctx.cfg, ctx.params, dtype=bf16)
        drafter = random_drafter(ctx.drafter.cfg, bf16)
    cases = [exactness_case(ctx.cfg.name, target, drafter, p.exact_shape, p.block_size, ctx.compile_s)]
    ctx.partial({"cases": cases})
    stories, note = None, "not with --tiny"
    if p.stories and time.perf_counter() - ctx.started > ctx.args.budget_s:
        note = "skipped: the budget was spent"
    elif p.stories:
        stories = _stories260k(bf16, p.block_size)
        note = "run" if stories is not None else "absent from $DSPARK_MODELS"
    if stories is not None:
        cases.append(exactness_case("stories260k", *stories, (p.exact_shape[0], 16, 64), p.block_size, ctx.compile_s))
    keys = ["model", "tokens", "argmax_agreement", "plain_vs_speculative_agreement", "first_divergence_min"]
    table(
        "exactness: bfloat16 greedy speculative decoding",
        keys + ["acceptance"],
        [[c[k] for k in keys] + [c["acceptance_rate"]] for c in cases],
    )
    return {"stories260k": note, "cases": cases}
