"""Decode cost against the allocated KV-cache length at a fixed live length (issue 24).

Three sections, each alternated in one process (medians of ``--reps`` repeats), optionally
against another checkout of the package (``--old DIR``, loaded beside this one by
:func:`benchmarks.harness.load_checkout`, each checkout building its own target):

``--window W`` gives the decode, live and engine sections' target a sliding window of ``W`` tokens
on every layer (this checkout only: the cost of windowed cached attention against the cache length).

* ``window`` (not run by default; this checkout only): one jitted batch-1 decode step (cache donated)
  at each of ``--window-positions`` in a cache of ``--live-cache-len`` slots, the target with full
  attention and with a window of ``--window`` (default 64) on every layer: ms per step, so that the
  windowed cost is seen not to grow with the position (the prefill is not timed).

* ``decode``: batch-1 plain decoding (``generate_autoregressive``, greedy, no stop ids) of one
  prompt of ``--prompt-len`` tokens, ``--new-tokens`` new tokens, with the KV cache allocated at
  each of ``--cache-lens`` slots: ms per generated token (compilation excluded) and the ratio to
  the first cache length;
* ``engine``: the serving engine's plain step (every one of ``--rows`` rows verifies its anchor,
  rows at position 40) with the engine's cache at each of ``--engine-cache-lens``;
* ``live`` (not run by default): the same decoding at cache length ``--live-cache-len`` with prompts
  of each of ``--live-lens`` tokens, ms per token against the live length;
* ``default``: batch-1 plain and ``num_speculative_tokens="auto"`` decoding at the default cache
  length (a random drafter, block size 4, one cost table shared by both checkouts so that they
  take the same decisions) on each of ``--default-targets``: ms per token, new / old speed;
* ``profile`` (not run by default): the cost of profiling at start-up, per checkout: seconds of
  the engine's ``profile_sps()`` (``--rows`` rows, dspark policy, random drafter, cache
  ``--profile-cache-len``, default spans) and of the batch-1 ``measure_costs`` (compilation
  included, as at a first start); then this checkout's SPS per span at ``--profile-spans``.

::

    git archive <old-commit> | tar -x -C /tmp/old
    python -m benchmarks.cache_length --old /tmp/old --out runs/cache_length

Prints one table per section and writes ``OUT/cache_length.json``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import alternate, drafter_for, engine_for, load_checkout, markdown_table, write_json

_MODULES = ("api", "config", "drafters.dspark", "decoding.speculative", "serving.engine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_length", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct", help="target of the decode and engine sections")
    p.add_argument("--old", default=None, help="another checkout (its dspark_jax/) to compare with")
    p.add_argument("--sections", default="decode,engine,default", help="comma-separated sections to run")
    p.add_argument("--cache-lens", default="256,1024,4096", help="decode section's cache lengths")
    p.add_argument("--engine-cache-lens", default="256,1024", help="engine section's cache lengths")
    p.add_argument("--live-lens", default="40,200,1000", help="live section's prompt lengths")
    p.add_argument("--live-cache-len", type=int, default=4096, help="live section's cache length")
    p.add_argument("--default-targets", default="stories260k,smollm2-135m-instruct")
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens (default 40)")
    p.add_argument("--new-tokens", type=int, default=32, help="generated tokens (default 32)")
    p.add_argument("--rows", type=int, default=8, help="engine rows (default 8)")
    p.add_argument("--reps", type=int, default=5, help="alternated repeats per case (default 5)")
    p.add_argument("--profile-cache-len", type=int, default=1024, help="profile section's cache length")
    p.add_argument("--profile-spans", default="256,1024", help="profile section's spans of the SPS per span")
    p.add_argument("--window", type=int, default=0, help="sliding window on every target layer (0: none)")
    p.add_argument("--window-positions", default="40,2000,4000", help="window section's decode positions")
    p.add_argument("--out", default="runs/cache_length", help="output directory")
    return p


def _load(mods, a):
    """The sections' target, with ``--window`` applied to every layer when given."""
    target, _ = mods["api"].load_target(a.target)
    if a.window:
        import dataclasses

        n = target.cfg.num_layers
        target.cfg = dataclasses.replace(target.cfg, layer_types=("sliding_attention",) * n, sliding_window=a.window)
    return target


def _packages(old: str | None) -> dict[str, dict[str, Any]]:
    pk = {"new": {m: importlib.import_module(f"dspark_jax.{m}") for m in _MODULES}}
    if old:
        pk["old"] = load_checkout(old, _MODULES)
    return pk


def _prompt(target, n: int) -> list[int]:
    v = target.cfg.vocab_size
    return [(17 + 31 * i) % (v - 3) + 3 for i in range(n)]


def decode_section(pk, a) -> list[dict[str, Any]]:
    """Plain batch-1 decoding at each cache length, ms per token per checkout."""
    lens = [int(c) for c in a.cache_lens.split(",")]
    cases = {}
    for name, mods in pk.items():
        target = _load(mods, a)
        prompt = _prompt(target, a.prompt_len)
        gen = mods["decoding.speculative"].generate_autoregressive
        for c in lens:
            kw = dict(max_new_tokens=a.new_tokens, stop_ids=[], cache_len=c)
            cases[(name, c)] = lambda gen=gen, t=target, p=prompt, kw=kw: gen(t, [p], **kw).seconds / a.new_tokens
    med = alternate({f"{n}:{c}": f for (n, c), f in cases.items()}, a.reps)
    rows = []
    for name in pk:
        base = med[f"{name}:{lens[0]}"]
        for c in lens:
            ms = med[f"{name}:{c}"] * 1e3
            rows.append({"checkout": name, "cache_len": c, "ms_per_token": ms, "ratio": ms / (base * 1e3)})
    return rows


def live_section(pk, a) -> list[dict[str, Any]]:
    """Plain batch-1 decoding at one cache length with prompts of several lengths."""
    lens = [int(n) for n in a.live_lens.split(",")]
    cases = {}
    for name, mods in pk.items():
        target = _load(mods, a)
        gen = mods["decoding.speculative"].generate_autoregressive
        kw = dict(max_new_tokens=a.new_tokens, stop_ids=[], cache_len=a.live_cache_len)
        for n in lens:
            cases[f"{name}:{n}"] = lambda gen=gen, t=target, p=_prompt(target, n), kw=kw: (
                gen(t, [p], **kw).seconds / a.new_tokens
            )
    med = alternate(cases, a.reps)
    return [
        {"checkout": name, "cache_len": a.live_cache_len, "prompt_len": n, "ms_per_token": med[f"{name}:{n}"] * 1e3}
        for name in pk
        for n in lens
    ]


def engine_section(pk, a) -> list[dict[str, Any]]:
    """The engine's plain step (``--rows`` rows, no drafter) at each engine cache length."""
    import jax
    import numpy as np

    lens = [int(c) for c in a.engine_cache_lens.split(",")]
    cases = {}
    for name, mods in pk.items():
        target = _load(mods, a)
        for c in lens:
            eng = engine_for(
                mods["serving.engine"],
                target,
                None,
                num_slots=a.rows,
                cache_len=c,
                policy="plain",
                row_buckets=[a.rows],
                prefill_buckets=[32],
            )
            eng.warmup()
            ell, active = np.zeros(a.rows, np.int32), np.ones(a.rows, bool)

            def step(eng=eng, ell=ell, active=active):
                jax.block_until_ready(eng.device.run_step(a.rows, a.rows, ell, active, False))
                eng.device.state = eng.device.state._replace(pos=eng.device.state.pos * 0 + 40)  # the same live length

            cases[f"{name}:{c}"] = step
    med = alternate(cases, a.reps)
    rows = []
    for name in pk:
        for c in lens:
            ms = med[f"{name}:{c}"] * 1e3
            rows.append(
                {"checkout": name, "cache_len": c, "step_ms": ms, "ratio": ms / (med[f"{name}:{lens[0]}"] * 1e3)}
            )
    return rows


def _checkout_table(speculative, table):
    """The shared cost table in the form a checkout's ``generate_speculative`` reads: as it is,
    or for a checkout from before the tables took attention spans, its own ``CostTable`` of the
    batch-1 fields (the same seconds, at the table's one span)."""
    import dataclasses

    cls = speculative.cached_cost_table.__globals__.get("CostTable")
    if cls is None or "t_verify" not in {f.name for f in dataclasses.fields(cls)}:
        return table
    return cls(
        widths=table.widths,
        t_verify=tuple(float(t) for t in table.verify_array(table.widths)),
        t_draft_greedy=table.draft_seconds(True),
        t_draft_sampled=table.draft_seconds(False),
        t_step=table.step_seconds(),
        t_context=table.context_seconds(),
        cache_len=table.meta["cache_len"],
    )


def default_section(pk, a) -> list[dict[str, Any]]:
    """Plain and ``auto`` batch-1 decoding at the default cache length, per target and checkout."""

    from dspark_jax.decoding.decode_profile import cached_cost_table

    cases, table = {}, {}
    for spec in a.default_targets.split(","):
        for name, mods in pk.items():
            target, _ = mods["api"].load_target(spec)
            drafter = drafter_for(mods, target.cfg, 4, num_layers=1, markov_rank=8)
            sp = mods["decoding.speculative"]
            prompt = _prompt(target, a.prompt_len)
            kw = dict(max_new_tokens=a.new_tokens, stop_ids=[])
            if spec not in table:  # measured once (by the first checkout), shared
                cache_len = sp.default_cache_len(target, [prompt], a.new_tokens, drafter.cfg.block_size)
                table[spec] = cached_cost_table(target, drafter, cache_len)
            plain = dict(kw, cache_len=None)
            auto = dict(kw, num_speculative_tokens="auto", cost_table=_checkout_table(sp, table[spec]))
            cases[f"{spec}:plain:{name}"] = lambda f=sp.generate_autoregressive, t=target, p=prompt, k=plain: (
                f(t, [p], **k).seconds / a.new_tokens
            )
            cases[f"{spec}:auto:{name}"] = lambda f=sp.generate_speculative, t=target, d=drafter, p=prompt, k=auto: (
                f(t, d, [p], **k).seconds / a.new_tokens
            )
    med = alternate(cases, a.reps)
    rows = []
    for spec in a.default_targets.split(","):
        for mode in ("plain", "auto"):
            r = {"target": spec, "mode": mode, **{f"{n}_ms_per_token": med[f"{spec}:{mode}:{n}"] * 1e3 for n in pk}}
            if "old" in pk:
                r["speed_new_over_old"] = med[f"{spec}:{mode}:old"] / med[f"{spec}:{mode}:new"]
            rows.append(r)
    return rows


def profile_section(pk, a) -> list[dict[str, Any]]:
    """Start-up profiling seconds per checkout (engine SPS table, batch-1 cost table), then this
    checkout's engine SPS at each of ``--profile-spans``."""
    c = a.profile_cache_len
    cases, engines = {}, {}
    for name, mods in pk.items():
        target = _load(mods, a)
        drafter = drafter_for(mods, target.cfg, 4, num_layers=1, markov_rank=8)
        eng = engine_for(
            mods["serving.engine"],
            target,
            drafter,
            num_slots=a.rows,
            cache_len=c,
            policy="dspark",
            row_buckets=[a.rows],
            prefill_buckets=[32],
        )
        eng.warmup()
        engines[name] = eng
        measure = mods["decoding.speculative"].cached_cost_table.__globals__["measure_costs"]
        cases[f"engine:{name}"] = lambda eng=eng: eng.profile_sps() and None
        cases[f"batch1:{name}"] = lambda f=measure, t=target, d=drafter: f(t, d, cache_len=c, repeats=5) and None
    med = alternate(cases, a.reps)
    rows: list[dict[str, Any]] = [
        {"what": f"{kind} profiling [s]", **{n: med[f"{kind}:{n}"] for n in pk}} for kind in ("engine", "batch1")
    ]
    spans = [int(s) for s in a.profile_spans.split(",")]
    table = engines["new"].profile_sps(spans=spans)
    for s in table.spans():
        r, k = a.rows, max(table.budgets(a.rows))
        rows.append(
            {
                "what": f"SPS at span {s} (rows {r}: plain / {k} tokens drafting)",
                "new": (f"{table.sps(r, r, False, s):.2f} / {table.sps(r, k, True, s):.2f}"),
            }
        )
    return rows


def window_section(pk, a) -> list[dict[str, Any]]:
    """One decode step at each position, full attention against a window on every layer."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    mods, w = pk["new"], a.window or 64
    positions = [int(p) for p in a.window_positions.split(",")]
    cases = {}
    for kind in ("full", "window"):
        target, _ = mods["api"].load_target(a.target)
        if kind == "window":
            n = target.cfg.num_layers
            target.cfg = dataclasses.replace(target.cfg, layer_types=("sliding_attention",) * n, sliding_window=w)
        graph, state = nnx.split(target)
        cache_cls = type(target.init_cache(1, 1))

        def step(state, tok, pos, k, v, graph=graph, cache_cls=cache_cls):
            out = nnx.merge(graph, state)(tok, pos, cache=cache_cls(k, v))
            return out.logits, out.cache.k, out.cache.v

        fn, cache = jax.jit(step, donate_argnums=(3, 4)), target.init_cache(1, a.live_cache_len)
        kv = [cache.k, cache.v]
        for p in positions:

            def run(fn=fn, state=state, kv=kv, p=p):
                _, kv[0], kv[1] = jax.block_until_ready(
                    fn(state, jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), p, jnp.int32), kv[0], kv[1])
                )

            cases[f"{kind}:{p}"] = run
    med = alternate(cases, a.reps)
    rows = []
    for p in positions:
        ms = {k: med[f"{k}:{p}"] * 1e3 for k in ("full", "window")}
        row = {"position": p, "cache_len": a.live_cache_len, "window": w}
        rows.append(row | {f"{k}_ms": v for k, v in ms.items()})
    return rows


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import jax

    pk = _packages(a.old)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(a), "device": str(jax.devices()[0])}
    sections = {
        "decode": decode_section,
        "live": live_section,
        "engine": engine_section,
        "default": default_section,
        "profile": profile_section,
        "window": window_section,
    }
    for name in a.sections.split(","):
        result[name] = sections[name](pk, a)
        print(f"## {name}\n\n{markdown_table(result[name])}\n", flush=True)
        write_json(out / "cache_length.json", result)
    print(f"wrote {out / 'cache_length.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
