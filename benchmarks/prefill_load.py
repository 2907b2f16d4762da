"""Batched, chunked prefill against one-shot prefill under load (issue 14): the scenario of
``python -m benchmarks.serve_load --long-prompt-scenario``.

    python -m benchmarks.serve_load --long-prompt-scenario --target smollm2-135m-instruct \\
        --no-chat --prompts alpaca --out runs/prefill_load

Two parts, each run with the engine's chunked prefill (``--prefill-chunk-tokens N``) and with
one-shot prefill (one request at a time), on the same warmed-up engine (only its
``prefiller`` is switched, so both modes share every compiled step):

* Long prompt: ``--long-streams`` (8) requests stream (``min_tokens`` keeps them going), then one
  ``--long-prompt-tokens`` (2,000) token prompt arrives. Reported per mode: the streams' largest
  inter-token gap while the long prompt was being prefilled (arrival to its first token), that
  prompt's time to first token, and the engine's measured decode-step and prefill-pass times
  (median and max, timed in the engine thread; a pass is synced before its clock stops). With
  chunked prefill the gap should stay below ``2 x (decode step + chunk pass)``; with one-shot
  prefill it is the whole prefill.
* Load: at each ``--concurrency`` level (default 16 and 64), ``--repeats`` rounds of both modes
  (order rotated each round) of serve_load's closed-loop streaming load; medians of TTFT
  (mean and p90) and output tokens/s per mode.

Writes ``OUT/prefill_load.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import device_description, write_json
from benchmarks.http_load import http_client, load_models, load_prompts, run_level, serve
from dspark_jax.serving.config import EngineConfig


def add_args(p: argparse.ArgumentParser) -> None:
    """The scenario's options (added to serve_load's parser)."""
    g = p.add_argument_group("long-prompt scenario (--long-prompt-scenario)")
    g.add_argument(
        "--long-prompt-scenario",
        action="store_true",
        help="chunked vs one-shot prefill: stream gaps around a long prompt, TTFT and tok/s (see prefill_load.py)",
    )
    g.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=EngineConfig.prefill_chunk_tokens,
        help=f"chunked prefill budget (default {EngineConfig.prefill_chunk_tokens}, the server's)",
    )
    g.add_argument("--long-prompt-tokens", type=int, default=2000, help="the long prompt's tokens (default 2000)")
    g.add_argument("--long-streams", type=int, default=8, help="requests streaming meanwhile (default 8)")
    g.add_argument("--long-cache-len", type=int, default=2048, help="cache length of that engine (default 2048)")
    g.add_argument(
        "--prefill-buckets",
        default="128,512,2048",
        help="prefill buckets (also the chunked pass's attention spans) of both engines, capped to "
        "their cache length (default 128,512,2048)",
    )


# --------------------------------------------------------------------------- instrumentation


class Timings:
    """Wall times of the engine thread's decode steps and prefill passes (instance patches)."""

    def __init__(self, engine, prefiller):
        self.steps: list[float] = []
        self.passes: list[float] = []
        self.one_shot: list[float] = []
        gen, pre_step, one = engine.generate, prefiller.step, engine.prefill

        def generate():
            t0 = time.perf_counter()
            out = gen()  # reads its outputs back: synced
            self.steps.append(time.perf_counter() - t0)
            return out

        def step():
            import jax

            t0 = time.perf_counter()
            out = pre_step()
            jax.block_until_ready(prefiller.stage)
            self.passes.append(time.perf_counter() - t0)
            return out

        def prefill(request):
            t0 = time.perf_counter()
            out = one(request)
            self.one_shot.append(time.perf_counter() - t0)
            return out

        engine.generate, prefiller.step, engine.prefill = generate, step, prefill

    def clear(self) -> None:
        self.steps.clear()
        self.passes.clear()
        self.one_shot.clear()

    def summary(self) -> dict[str, Any]:
        def st(xs):
            return {"n": len(xs), "median_s": statistics.median(xs), "max_s": max(xs)} if xs else None

        return {"decode_step": st(self.steps), "prefill_pass": st(self.passes), "one_shot_prefill": st(self.one_shot)}


# --------------------------------------------------------------------------- long prompt


async def _stream(client, body: dict, times: list[float]) -> None:
    """Streams a completion, appending the arrival time of every chunk with tokens."""
    body = dict(body, stream=True, return_token_ids=True)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line[6:] == "[DONE]":
                continue
            obj = json.loads(line[6:])
            if any(ch.get("token_ids") for ch in obj.get("choices", [])):
                times.append(time.perf_counter())


async def long_prompt_run(url: str, prompts: list[str], long_ids: list[int], args) -> dict[str, Any]:
    """The streams, then the long prompt; the streams are hung up once it has its first token."""
    n = args.long_streams
    times: list[list[float]] = [[] for _ in range(n)]
    long_times: list[float] = []
    async with http_client(url, n + 1) as client:
        body = dict(max_tokens=args.long_cache_len // 2, min_tokens=args.long_cache_len // 2, temperature=0.0)
        tasks = [
            asyncio.ensure_future(_stream(client, dict(body, prompt=prompts[i % len(prompts)], seed=i), times[i]))
            for i in range(n)
        ]
        while not all(len(t) >= 3 for t in times):  # every stream is decoding
            await asyncio.sleep(0.02)
        t_sent = time.perf_counter()
        long_task = asyncio.ensure_future(
            _stream(client, dict(prompt=long_ids, max_tokens=4, temperature=0.0), long_times)
        )
        while not long_times:
            await asyncio.sleep(0.005)
        t_first = long_times[0]
        await asyncio.sleep(max(0.5, 2 * (t_first - t_sent) / max(1, args.long_prompt_tokens // 256)))
        for t in tasks:
            t.cancel()
        await asyncio.gather(long_task, *tasks, return_exceptions=True)
    gaps = []
    for ts in times:
        # gaps between token arrivals that overlap [t_sent, t_first]
        a = np.asarray(ts)
        d = np.diff(a)
        hit = (a[1:] >= t_sent) & (a[:-1] <= t_first)
        gaps.append(float(d[hit].max()) if hit.any() else float("nan"))
    before = [float(np.diff(np.asarray([t for t in ts if t < t_sent])).max()) for ts in times]
    return {
        "long_prompt_ttft_s": t_first - t_sent,
        "max_gap_during_prefill_s": max(gaps),
        "per_stream_max_gap_s": gaps,
        "max_gap_before_s": max(before),
    }


# --------------------------------------------------------------------------- the scenario


def _buckets(spec: str, cache_len: int) -> tuple[int, ...]:
    out = sorted({min(int(x), cache_len) for x in spec.split(",") if x.strip()})
    return tuple(out)


def _engine(args, target, drafter, num_slots: int, cache_len: int):
    from dspark_jax.serving.build import build_engine
    from dspark_jax.serving.engine import EngineConfig
    from dspark_jax.serving.http.preflight import parse_buckets

    policy = "dspark" if drafter is not None else "plain"
    t0 = time.perf_counter()
    config = EngineConfig(
        num_slots=num_slots,
        cache_len=cache_len,
        policy=policy,
        buckets=parse_buckets(args.buckets),
        prefill_buckets=_buckets(args.prefill_buckets, cache_len),
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )
    eng = build_engine(target, drafter, config)
    print(
        f"[prefill_load] {policy} engine, {num_slots} slots x {cache_len}: ready in "
        f"{time.perf_counter() - t0:.0f} s ({eng.metrics()['compiles']} executables)",
        file=sys.stderr,
    )
    return eng, policy


def _long_ids(tok, n: int) -> list[int]:
    from dspark_jax.data.prompts import load_prompt_texts

    texts, _ = load_prompt_texts("alpaca")
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t)
        if len(ids) >= n:
            break
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def long_prompt_part(args, models, prompts) -> dict[str, Any]:
    target, tok, drafter = models
    eng, policy = _engine(args, target, drafter, args.long_streams * 2, args.long_cache_len)
    chunked = eng.prefiller
    timings = Timings(eng, chunked)
    long_ids = _long_ids(tok, args.long_prompt_tokens)
    out = {}
    for mode in ("chunked", "one_shot"):
        eng.prefiller = chunked if mode == "chunked" else None
        timings.clear()
        srv, _ = serve(eng, tok, args, policy, max_queue=64)
        with srv:
            row = asyncio.run(long_prompt_run(srv.url, prompts, long_ids, args))
        row["timings"] = timings.summary()
        ts = row["timings"]
        if ts["decode_step"] and ts["prefill_pass"]:
            row["bound_2x_step_plus_chunk_s"] = 2 * (ts["decode_step"]["median_s"] + ts["prefill_pass"]["max_s"])
        out[mode] = row
        print(f"[prefill_load] long prompt, {mode}: {json.dumps(row)}", file=sys.stderr)
    eng.prefiller = chunked
    return out


def load_part(args, models, prompts) -> dict[str, Any]:
    target, tok, drafter = models
    levels = [int(c) for c in args.concurrency.split(",")]
    eng, policy = _engine(args, target, drafter, args.num_slots or max(levels), args.cache_len)
    chunked = eng.prefiller
    modes = ["chunked", "one_shot"]
    out: dict[str, Any] = {m: [] for m in modes}
    for li, c in enumerate(levels):
        n = args.num_requests or max(8, args.waves * c)
        reps: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            k = (rep + li) % 2
            for mode in modes[k:] + modes[:k]:
                eng.prefiller = chunked if mode == "chunked" else None
                srv, _ = serve(eng, tok, args, policy, max_queue=max(levels) * 4)
                with srv:
                    row = asyncio.run(
                        run_level(srv.url, bool(args.chat), prompts, c, n, args.max_tokens, args.temperature)
                    )
                reps[mode].append(row)
                print(
                    f"[prefill_load] c={c} {mode} #{rep + 1}: {row['output_tok_s']:.1f} tok/s, "
                    f"ttft {row['ttft_s']:.2f} s (p90 {row['ttft_p90_s']:.2f}), ok {row['num_ok']}/{n}",
                    file=sys.stderr,
                )
        for mode in modes:
            rows = reps[mode]
            med = {
                k: statistics.median(r[k] for r in rows)
                for k in ("output_tok_s", "ttft_s", "ttft_p50_s", "ttft_p90_s", "per_user_tok_s")
                if all(r[k] is not None for r in rows)
            }
            ok = sum(r["num_ok"] for r in rows)
            out[mode].append({"concurrency": c, "repeats": len(rows), "num_ok": ok, **med, "runs": rows})
    eng.prefiller = chunked
    return out


def run(args, models=None) -> dict[str, Any]:
    """Both parts; writes ``OUT/prefill_load.json``."""
    models = models or load_models(args)
    tok = models[1]
    if args.chat is None:
        args.chat = False
    prompts = load_prompts(args, tok)
    result: dict[str, Any] = {
        "target": args.target,
        "device": device_description(),
        "prefill_chunk_tokens": args.prefill_chunk_tokens,
        "long_prompt_tokens": args.long_prompt_tokens,
        "long_streams": args.long_streams,
        "prefill_buckets": args.prefill_buckets,
        "argv": sys.argv[1:],
    }
    result["long_prompt"] = long_prompt_part(args, models, prompts)
    result["load"] = load_part(args, models, prompts)
    write_json(Path(args.out) / "prefill_load.json", result)
    print(table(result))
    return result


def table(result: dict) -> str:
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    lines = ["| mode | long-prompt TTFT s | max stream gap s | bound 2x(step+chunk) s | step s | pass s |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for mode, r in result["long_prompt"].items():
        t = r["timings"]
        step = (t["decode_step"] or {}).get("median_s")
        pas = (t["prefill_pass"] or t["one_shot_prefill"] or {}).get("max_s")
        lines.append(
            f"| {mode} | {f(r['long_prompt_ttft_s'])} | {f(r['max_gap_during_prefill_s'])} | "
            f"{f(r.get('bound_2x_step_plus_chunk_s'))} | {f(step)} | {f(pas)} |"
        )
    lines += ["", "| mode | concurrency | TTFT s | TTFT p90 s | output tok/s |", "| --- | --- | --- | --- | --- |"]
    for mode, rows in result["load"].items():
        for r in rows:
            lines.append(
                f"| {mode} | {r['concurrency']} | {f(r.get('ttft_s'))} | {f(r.get('ttft_p90_s'))} | "
                f"{f(r.get('output_tok_s'), '.1f')} |"
            )
    return "\n".join(lines)
