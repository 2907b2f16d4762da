"""A prepared accelerator check (issue 24): random-weight Qwen3-8B-shaped models, at most ~5 minutes
on one chip (an H200 GPU or a TPU chip), no downloads, nothing from outside the repository's tree.

With an accelerator, from the repository root::

    python -m benchmarks.device_check --out /tmp/dc

prints one table per section and writes ``/tmp/dc/device_check.json`` after every section (a run
cut short still leaves the sections done). Paste the JSON (and the printed tables) into the issue's
thread, or under "Accelerator check" in ``docs/results.md``. ``--tiny`` is the CPU-sized run the
test suite makes (``tests/integration/test_device_check.py``); ``--sections step,train`` picks
sections; ``--budget-s`` skips the sections that would start after that many seconds.

The models: a Qwen3-8B-shaped :class:`~dspark_jax.models.target.Target` (36 layers, hidden 4096,
32/8 heads of 128, FFN 12288, vocabulary 151936, q/k-norm, untied head) with random weights drawn
on the device (the layout of :func:`~dspark_jax.models.target.random_params`; drawing 8B normals on
the host would take minutes), and a drafter of :meth:`~dspark_jax.config.DrafterConfig.for_target`
built by :func:`~dspark_jax.drafters.build.build_drafter`. stories260K (``$DSPARK_MODELS``) joins
the bfloat16 exactness section when present (not with ``--tiny``). Costs depend on shapes, not on weight values; the
random drafter's acceptance is ~0, so the speculative rows measure step costs, not speed-ups.

Sections (run in this order; the JSON keys):

* ``step``: a batch-1 plain decode step (:meth:`Target.__call__` on a donated
  :class:`~dspark_jax.models.layers.KVCache`, argmax) at cache lengths 1k / 4k / 16k and live
  lengths well below them (the cost should follow the live length, not the cache);
* ``roofline``: those steps and :func:`~dspark_jax.decoding.speculative.generate_autoregressive`
  against the memory-bandwidth roofline: bytes of the weights read per token plus the live KV,
  over the device's peak bandwidth (:data:`PEAK_BW_GB_S`, null when the device is not listed);
* ``exactness``: bfloat16 greedy :func:`~dspark_jax.decoding.speculative.generate_speculative`:
  the fraction of committed tokens that are the argmax of a one-pass recomputation by the target
  of the final sequence (the contract: argmax of the verifying pass; bfloat16 plain and
  speculative decoding may differ token for token where their shapes differ, reported too);
* ``engine``: :class:`~dspark_jax.serving.engine.Engine` steps at 1..64 rows, plain and
  speculative (``fixed:block_size``): steps/s and tokens/s;
* ``train``: the training step (:class:`~dspark_jax.training.trainer.Trainer`): seconds and MFU
  from analytic FLOPs (:func:`train_flops`; XLA's cost analysis counts a scan body once) against
  :data:`PEAK_TFLOPS` (bfloat16 dense);
* ``moe``: a mixture-of-experts target (Qwen3-30B-A3B's layer shape: 128 experts, top 8, expert
  width 768, hidden 2048, 4 layers) against a dense one of the same active size, batch-1 step
  and a ``block_size``-token verification (:func:`benchmarks.moe_cost.time_steps`), and the weight
  bytes one compiled sparse layer reads against its chosen experts' (:func:`benchmarks.moe_cost.layer_bytes`);
* ``compile``: compile seconds of every program above.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# --tiny: CPU-sized timings mean nothing and compiling is most of the run, so XLA compiles fast
# (when JAX is not loaded yet, i.e. from the command line; flags already set, as by the test
# suite, are kept).
if "--tiny" in sys.argv[1:] and "jax" not in sys.modules:
    from benchmarks.engine_hlo import with_fast_compile

    os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.harness import command_line, json_default, ratio
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.drafters.build import build_drafter
from dspark_jax.models.target import Target

SECTIONS = ("step", "roofline", "exactness", "engine", "train", "moe", "compile")
# Peak HBM bandwidth [GB/s] and dense bfloat16 [TFLOP/s] by a substring of the lower-cased
# jax device_kind, first match wins (vendors' data sheets; SXM parts unless named).
PEAK_BW_GB_S = (
    ("h200", 4800.0),
    ("h100 pcie", 2000.0),
    ("h100", 3350.0),
    ("a100", 2039.0),
    ("v5 lite", 819.0),
    ("v5e", 819.0),
    ("v5p", 2765.0),
    ("tpu v5", 2765.0),
    ("v6 lite", 1640.0),
    ("v6e", 1640.0),
    ("tpu v4", 1200.0),
)
PEAK_TFLOPS = (
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100", 989.0),
    ("a100", 312.0),
    ("v5 lite", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),
    ("v6 lite", 918.0),
    ("v6e", 918.0),
    ("tpu v4", 275.0),
)


def peak(table: tuple[tuple[str, float], ...], device_kind: str) -> float | None:
    """The first entry of ``table`` whose key is in ``device_kind`` (case-insensitive), else None."""
    kind = device_kind.lower()
    return next((v for k, v in table if k in kind), None)


def qwen3_8b_config() -> TargetConfig:
    """Qwen3-8B's shape (its config.json); no EOS, so random models run every step asked for."""
    return TargetConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=40960,
        rope_theta=1e6,
        rms_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        bos_id=None,
        eos_ids=(),
        name="qwen3-8b-random",
    )


def tiny_config() -> TargetConfig:
    """A CPU-sized target of the same kind (q/k-norm, untied head)."""
    return dataclasses.replace(
        qwen3_8b_config(),
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position=1024,
        name="tiny-random",
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one run (:func:`plan`)."""

    caches: tuple[int, ...]  # step: KV-cache lengths
    lives: tuple[int, ...]  # step: live lengths shared by every cache (plus 3/4 of each cache)
    reps: int  # step: timed steps per point
    block_size: int  # the drafter's block size (engine fixed:block_size, speculative decoding)
    drafter_layers: int
    ar_new: int  # roofline: generate_autoregressive's new tokens
    rows: tuple[int, ...]  # engine: active rows measured
    row_buckets: tuple[int, ...]  # engine: compiled row counts (the last one holds max(rows))
    engine_cache: int
    engine_prompt: int
    engine_steps: int
    train_shape: tuple[int, int, int]  # (batch, seq_len, anchors per sequence)
    train_steps: int
    exact_shape: tuple[int, int, int]  # (prompts, prompt length, new tokens)
    stories: bool  # exactness on stories260K too, when $DSPARK_MODELS has it


def plan(tiny: bool) -> Plan:
    if tiny:
        return Plan(
            caches=(128, 256),
            lives=(16, 64),
            reps=3,
            block_size=4,
            drafter_layers=1,
            ar_new=16,
            rows=(1, 4),
            row_buckets=(4,),
            engine_cache=256,
            engine_prompt=16,
            engine_steps=3,
            train_shape=(2, 32, 4),
            train_steps=2,
            exact_shape=(2, 12, 24),
            stories=False,
        )
    return Plan(
        caches=(1024, 4096, 16384),
        lives=(128, 512),
        reps=10,
        block_size=8,
        drafter_layers=2,
        ar_new=64,
        rows=(1, 8, 64),
        row_buckets=(1, 8, 64),
        engine_cache=2048,
        engine_prompt=64,
        engine_steps=8,
        train_shape=(4, 1024, 16),
        train_steps=5,
        exact_shape=(4, 64, 64),
        stories=True,
    )


def device_params(cfg: TargetConfig, dtype: Any, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Random parameters drawn on the default device in ``dtype`` by one compiled program: the
    layout and scales of :func:`~dspark_jax.models.target.random_params` (norm weights ``1 + n``,
    the embedding ``10 n``)."""
    from dspark_jax.models.weights import target_param_shapes

    shapes = target_param_shapes(cfg)
    flat = [(k, s) for k, s in shapes.items() if k != "layers"] + list(shapes["layers"].items())

    def draw(key: jax.Array) -> list[jax.Array]:
        out = []
        for (name, shape), k in zip(flat, jax.random.split(key, len(flat))):
            x = jax.random.normal(k, shape, dtype) * jnp.asarray(scale, dtype)
            out.append(
                x + jnp.asarray(1, dtype) if "norm" in name else x * jnp.asarray(10 if name == "embed" else 1, dtype)
            )
        return out

    arrays = dict(zip([k for k, _ in flat], jax.jit(draw)(jax.random.PRNGKey(seed))))
    params: dict[str, Any] = {k: arrays[k] for k in shapes if k != "layers"}
    params["layers"] = {k: arrays[k] for k in shapes["layers"]}
    return params


def random_drafter(cfg: DrafterConfig, dtype: Any, seed: int = 0) -> Any:
    """:func:`~dspark_jax.drafters.build.build_drafter` initialised by one compiled program."""
    return nnx.jit(lambda: build_drafter(cfg, nnx.Rngs(seed), dtype=dtype))()


@dataclasses.dataclass
class Context:
    """What the sections share: arguments, models, sizes and the report."""

    args: argparse.Namespace
    plan: Plan
    dtype: Any
    cfg: TargetConfig
    params: dict[str, Any]
    target: Target
    drafter: Any
    out: Path | None
    report: dict[str, Any]
    compile_s: dict[str, float]
    step_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    current: str = ""  # the section running

    def partial(self, data: dict[str, Any]) -> None:
        """Records and writes the running section's results so far (a run cut short keeps them)."""
        self.report["sections"][self.current] = {"partial": True, **data}
        self.write()

    def write(self) -> None:
        if self.compile_s and "compile" in self.args.sections:
            self.report["sections"].pop("compile", None)  # kept last
            self.report["sections"]["compile"] = {
                "seconds": dict(self.compile_s),
                "total_s": sum(self.compile_s.values()),
            }
        self.report["meta"]["elapsed_s"] = time.perf_counter() - T0
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / "device_check.json.tmp"
            tmp.write_text(json.dumps(self.report, indent=2, default=json_default))
            tmp.replace(self.out / "device_check.json")


T0 = time.perf_counter()


def table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """Prints a plain table: numbers with 4 significant digits, None as '-'."""
    fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
    cells = [headers] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n== {title}")
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


# ----------------------------------------------------------------------------- step and roofline


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
    layers = sum(int(v[...].size) for v in target.layers.values())
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
    if p.stories and time.perf_counter() - T0 > ctx.args.budget_s:
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


# ----------------------------------------------------------------------------- engine


def _engine_point(eng: Any, rows: int, p: Plan, vocab: int) -> dict[str, Any]:
    """``rows`` greedy requests in the engine, 2 warm steps, then ``p.engine_steps`` timed ones with
    the next step queued on the device (``overlap``, the default), then as many without."""
    from dspark_jax.serving.engine import Request, SamplingParams

    rng = np.random.default_rng(rows)
    for i in range(rows):
        ids = [int(t) for t in rng.integers(3, vocab, p.engine_prompt)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=p.engine_cache - p.engine_prompt - 1, seed=i)
        eng.insert(eng.prefill(Request(ids, sp, f"r{i}")), eng.free_slots()[0])
    for _ in range(2):
        eng.generate()
    res: dict[str, Any] = {"policy": eng.policy, "rows": rows}
    for overlap in (True, False):
        eng.overlap = overlap
        times, toks = [], 0
        for _ in range(p.engine_steps):
            t0 = time.perf_counter()
            outs = eng.generate()
            times.append(time.perf_counter() - t0)
            toks += sum(len(o.token_ids) for o in outs)
        total = sum(times)
        if overlap:
            res |= {
                "ms_per_step": 1e3 * statistics.median(times),
                "steps_per_s": len(times) / total,
                "tokens_per_s": toks / total,
                "tokens_per_row_step": toks / len(times) / rows,
            }
        else:
            res["ms_per_step_no_overlap"] = 1e3 * statistics.median(times)
            res["overlap_speedup"] = res["ms_per_step_no_overlap"] / res["ms_per_step"]
    eng.overlap = True
    for s in eng.active_slots():
        eng.free(s)
    eng.sync()
    return res


def section_engine(ctx: Context) -> dict[str, Any]:
    from dspark_jax.serving.engine import Engine, EngineConfig

    p, g = ctx.plan, ctx.plan.block_size
    eng = Engine(
        ctx.target,
        ctx.drafter,
        EngineConfig(
            num_slots=max(p.rows),
            cache_len=p.engine_cache,
            policy=f"fixed:{g}",
            row_buckets=list(p.row_buckets),
            prefill_buckets=[p.engine_prompt],
            suspend_after=None,
            profile_iters=1,
            prefill_chunk_tokens=0,
        ),
    )
    out = []
    for policy in (f"fixed:{g}", "plain"):
        if policy != eng.policy:
            eng.set_policy(policy)
        t0 = time.perf_counter()
        eng.warmup()
        ctx.compile_s[f"engine.warmup[{policy}]"] = time.perf_counter() - t0
        for r in p.rows:
            out.append(_engine_point(eng, r, p, ctx.cfg.vocab_size))
            ctx.partial({"rows": out})
    keys = ["policy", "rows", "ms_per_step", "ms_per_step_no_overlap", "overlap_speedup", "steps_per_s", "tokens_per_s"]
    table(f"engine: cache {p.engine_cache}, prompt {p.engine_prompt}", keys, [[r[k] for k in keys] for r in out])
    return {
        "cache_len": p.engine_cache,
        "block_size": g,
        "row_buckets": list(p.row_buckets),
        "programs_compiled": eng.metrics()["compiles"],
        "rows": out,
    }


# ----------------------------------------------------------------------------- training step


def train_flops(t: TargetConfig, d: DrafterConfig, batch: int, seq: int, anchors: int) -> dict[str, float]:
    """FLOPs of one training step (multiply-adds x 2; matmuls and attention, elementwise work not
    counted). Attention is counted over every key the implementation reads: the target's causal
    pass at full ``[L, L]``, each drafter slot over the whole context plus its block.

    * frozen target forward over ``batch x seq`` tokens (taps and logits at every position);
    * drafter forward: context projection and per-layer context keys/values over every position,
      the backbone over ``batch x anchors x num_slots`` slots, the frozen LM head and the Markov
      head's ``W2`` over the ``block_size`` predicted slots;
    * drafter backward: 2x the forward of its trained matmuls (input and weight gradients), 1x for
      the context projection (its input, the target's features, needs no gradient) and for the
      frozen LM head (input gradient only).
    """
    n_tok = batch * seq
    qd, kd = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    t_layer = 2 * (t.hidden_size * (2 * qd + 2 * kd) + 3 * t.hidden_size * t.intermediate_size) + 4 * qd * seq
    target = n_tok * (t.num_layers * t_layer + 2 * t.hidden_size * t.vocab_size)
    w, slots, pred = d.model_width, batch * anchors * d.num_block_positions, batch * anchors * d.block_size
    dq, dk = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    ctx_fc = n_tok * 2 * len(d.taps) * d.hidden_size * w
    ctx_kv = n_tok * d.num_layers * 2 * w * 2 * dk
    d_layer = 2 * (w * (2 * dq + 2 * dk) + 3 * w * d.intermediate_size) + 4 * dq * (seq + d.num_block_positions)
    adapters = 2 * d.hidden_size * w * (slots + pred) if w != d.hidden_size else 0
    backbone = slots * d.num_layers * d_layer + adapters
    head = pred * 2 * d.hidden_size * d.draft_size
    markov = pred * 2 * d.markov_rank * d.draft_size if d.markov else 0
    fwd = ctx_fc + ctx_kv + backbone + head + markov
    bwd = ctx_fc + 2 * (ctx_kv + backbone + markov) + head
    return {
        "target_forward": float(target),
        "drafter_forward": float(fwd),
        "drafter_backward": float(bwd),
        "total": float(target + fwd + bwd),
    }


def section_train(ctx: Context) -> dict[str, Any]:
    from dspark_jax.training.train_config import TrainConfig
    from dspark_jax.training.trainer import Trainer

    p = ctx.plan
    b, seq, anchors = p.train_shape
    dcfg = ctx.drafter.cfg
    cfg = TrainConfig(
        batch_size=b,
        seq_len=seq,
        anchors_per_seq=anchors,
        block_size=dcfg.block_size,
        num_layers=dcfg.num_layers,
        dtype=str(jnp.dtype(ctx.dtype)),
    )
    trainer = Trainer(cfg, ctx.target, ctx.drafter)
    rng = np.random.default_rng(3)
    batch = {
        "tokens": rng.integers(3, ctx.cfg.vocab_size, (b, seq)).astype(np.int32),
        "lengths": np.full(b, seq, np.int32),
        "prompt_lengths": np.full(b, seq // 8, np.int32),
    }
    times = []
    for i in range(p.train_steps + 1):
        t0 = time.perf_counter()
        terms, _ = trainer.step(batch, i)
        loss = float(terms.loss)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    ctx.compile_s["train_step (first step - median)"] = max(times[0] - med, 0.0)
    flops = train_flops(ctx.cfg, dcfg, b, seq, anchors)
    tf = peak(PEAK_TFLOPS, ctx.report["meta"]["device_kind"])
    mfu = None if tf is None else flops["total"] / med / (tf * 1e12)
    res = {
        "batch": b,
        "seq_len": seq,
        "anchors_per_seq": anchors,
        "block_size": dcfg.block_size,
        "dtype": cfg.dtype,
        "step_s": med,
        "loss": loss,
        "flops": flops,
        "tflops_per_s": flops["total"] / med / 1e12,
        "peak_tflops": tf,
        "mfu": mfu,
    }
    table(
        "train: one optimisation step",
        ["batch", "seq", "anchors", "s/step", "TFLOP/step", "TFLOP/s", "MFU"],
        [[b, seq, anchors, med, flops["total"] / 1e12, res["tflops_per_s"], mfu]],
    )
    return res


def section_moe(ctx: Context) -> dict[str, Any]:
    from benchmarks.moe_cost import layer_bytes, time_steps

    base = tiny_config() if ctx.args.tiny else qwen3_8b_config()
    hidden, experts, k, width = (64, 8, 2, 32) if ctx.args.tiny else (2048, 128, 8, 768)
    moe = dataclasses.replace(base, name="moe", hidden_size=hidden, num_layers=4, num_heads=4 if ctx.args.tiny else 32,
                              num_kv_heads=4 if not ctx.args.tiny else 2, head_dim=128 if not ctx.args.tiny else 16,
                              intermediate_size=k * width, num_experts=experts, num_experts_per_tok=k,
                              moe_intermediate_size=width, norm_topk_prob=True)  # fmt: skip
    dense = dataclasses.replace(moe, name="dense", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    targets = {c.name: Target(c, device_params(c, ctx.dtype), dtype=ctx.dtype) for c in (moe, dense)}
    timing = time_steps(targets, ctx.plan.block_size, ctx.plan.caches[0], ctx.plan.reps)
    rows = layer_bytes(targets["moe"], ctx.plan.block_size)
    table("moe: MoE vs dense of the same active size", list(timing[0]), [list(r.values()) for r in timing])
    table("moe: weight bytes one sparse layer reads", list(rows[0]), [list(r.values()) for r in rows])
    return {"moe_config": moe.to_dict(), "timing": timing, "bytes": rows}


# ----------------------------------------------------------------------------- main

RUNNERS = {
    "step": section_step,
    "roofline": section_roofline,
    "exactness": section_exactness,
    "engine": section_engine,
    "train": section_train,
    "moe": section_moe,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.device_check",
        description="Accelerator check: decode, engine, training and exactness on random models.",
    )
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (the test suite's run)")
    ap.add_argument("--out", default=None, help="folder for device_check.json (written after every section)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--dtype", default=None, help="default: float32 with --tiny or on CPU, else bfloat16")
    ap.add_argument("--budget-s", type=float, default=280.0, help="no section starts after this many seconds")
    ap.add_argument("--rows", default=None, help="engine row counts, comma-separated (default by size)")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(args.sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; choose from {', '.join(SECTIONS)}")
    if args.dtype is None:
        args.dtype = "float32" if args.tiny or jax.default_backend() == "cpu" else "bfloat16"
    return args


def build(args: argparse.Namespace) -> Context:
    """Models, sizes and the report's header."""
    p = plan(args.tiny)
    if args.rows:
        rows = tuple(sorted({int(r) for r in args.rows.split(",")}))
        p = dataclasses.replace(p, rows=rows, row_buckets=rows)
    dtype = jnp.dtype(args.dtype)
    cfg = tiny_config() if args.tiny else qwen3_8b_config()
    t0 = time.perf_counter()
    params = device_params(cfg, dtype)
    target = Target(cfg, params, dtype=dtype)
    dcfg = DrafterConfig.for_target(cfg, block_size=p.block_size, num_layers=p.drafter_layers)
    drafter = random_drafter(dcfg, dtype)
    jax.block_until_ready(nnx.state(drafter))
    n_params = lambda m: int(sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))))
    dev = jax.devices()[0]
    meta = {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "dtype": str(dtype),
        "tiny": bool(args.tiny),
        "budget_s": args.budget_s,
        "target": cfg.to_dict(),
        "target_params": n_params(target),
        "drafter": dcfg.to_dict(),
        "drafter_params": n_params(drafter),
        "plan": dataclasses.asdict(p),
        "build_s": time.perf_counter() - t0,
    }
    out = Path(args.out) if args.out else None
    return Context(args, p, dtype, cfg, params, target, drafter, out, {"meta": meta, "sections": {}}, {})


def main(argv: list[str] | None = None) -> int:
    global T0
    T0 = time.perf_counter()
    args = parse_args(argv)
    ctx = build(args)
    ctx.report["meta"]["command"] = command_line("device_check", argv)
    print(
        f"device_check: {ctx.report['meta']['device_kind']} ({ctx.report['meta']['platform']}), {ctx.cfg.name}, "
        f"{ctx.report['meta']['target_params'] / 1e9:.3g}B params, dtype {ctx.dtype}"
    )
    ctx.write()
    failed = []
    for name, run in RUNNERS.items():
        if name not in args.sections:
            continue
        if time.perf_counter() - T0 > args.budget_s:
            ctx.report["sections"][name] = {"skipped": f"the budget of {args.budget_s:g} s was spent"}
            print(f"\n== {name}: skipped (budget spent)")
        else:
            t0, ctx.current = time.perf_counter(), name
            try:
                ctx.report["sections"][name] = {**run(ctx), "section_s": time.perf_counter() - t0}
            except Exception as e:  # one section's failure (say out of memory) leaves the others' results
                failed.append(name)
                ctx.report["sections"][name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                }
                print(f"\n== {name}: FAILED {type(e).__name__}: {e}")
        gc.collect()  # the section's models and caches leave the device before the next one
        ctx.write()
    if "compile" in args.sections:
        table("compile seconds", ["program", "s"], [[k, v] for k, v in ctx.compile_s.items()])
    ctx.write()
    print(
        f"\ntotal {time.perf_counter() - T0:.1f} s"
        + (f"; written to {ctx.out / 'device_check.json'}" if ctx.out else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
