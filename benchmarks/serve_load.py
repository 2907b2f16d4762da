"""Load benchmark of the HTTP server: throughput and per-user speed against concurrency, per policy.

    python -m benchmarks.serve_load --target smollm2-135m-instruct \\
        --drafter runs/smollm2-135m-instruct/export --out runs/serve_load
    python -m benchmarks.serve_load --quick --out /tmp/serve_load          # CI smoke run (stories260K)
    python -m benchmarks.serve_load --stress --target stories260k --random-drafter 4 --out /tmp/stress

Sweep mode (default): every policy (``plain``, ``fixed:N`` for each ``--num-speculative-tokens``,
``greedy``, ``dspark``; ``POLICY+ahead``: that policy planned ahead, the server's ``--plan-ahead``)
gets its own warmed-up engine on the same loaded target/drafter
(``plain`` without a drafter), served with uvicorn in this process; real prompts
(``--prompts``: MT-Bench first turns through the chat template by default, from
``$DSPARK_DATA/prompts``) are sent over loopback HTTP as streaming requests by ``c``
concurrent clients (closed loop: a client sends its next request when the previous one ends).
Policies are interleaved: at each concurrency ``c`` every policy runs back to back,
``--repeats`` times (the order rotates every repeat and level), and the repeat with the
median output tok/s is kept, so that ratios between policies are measured side by side.
Per level:

* ``output_tok_s``: all generated tokens / wall time of the level;
* ``per_user_tok_s``: mean over requests of (tokens - 1) / (last token - first token time),
  the decode speed a user sees once the answer started;
* ``ttft_s`` (mean, p50, p90) and ``e2e_s`` (mean): client-side time to first token and latency;
* ``tau`` / ``acceptance_rate``: the server's per-request speculative metrics, pooled.

Each policy's output and per-user tok/s is also reported as a ratio to ``plain`` and to the
best fixed block_size at the same concurrency. Writes ``OUT/serve_load.json`` and
``OUT/serve_load.png`` (output tok/s and per-user tok/s against concurrency).

Long-prompt scenario (``--long-prompt-scenario``, :mod:`prefill_load`): batched, chunked prefill
against one-shot prefill: the streams' largest inter-token gap while a 2,000-token prompt is
prefilled, and TTFT / output tok/s at concurrency 16 and 64. Writes ``OUT/prefill_load.json``.

Stress mode (``--stress``): ``--stress-requests`` requests (default 500) at concurrency 64
with random seeds, temperatures, top-k/top-p, max_tokens, stop strings, streaming or not, and
``--disconnect-frac`` (default 10%) of clients hanging up early. Then it checks that the
server is still up, no slot leaked (``/health``: all slots free, nothing running or waiting)
and every completed response equals the same request sent again alone with the same seed
(token ids, text and finish reason). Writes ``OUT/stress.json``; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import prefill_load
from benchmarks.harness import device_description, split_ahead, write_json
from benchmarks.http_load import (
    Result,
    engine_for,
    http_client,
    load_models,
    load_prompts,
    plain_request,
    request_body,
    run_level,
    serve,
    stream_request,
)
from dspark_jax.serving.config import EngineConfig

QUICK = dict(
    target="stories260k",
    random_drafter=4,
    policies="plain,fixed:1,fixed:2,greedy,dspark",
    concurrency="1,2,4",
    num_requests=4,
    max_tokens=16,
    num_slots=4,
    cache_len=128,
)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """The prompts' flags: the set and the endpoint (chat or completions)."""
    p.add_argument(
        "--prompts",
        default=None,
        help="prompt set (mt_bench, gsm8k, humaneval, alpaca, tinystories) or JSONL file (default: "
        "mt_bench for chat models, tinystories otherwise)",
    )
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="send prompts to /v1/chat/completions (default when the tokenizer has a chat template)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts to /v1/completions")


def add_stress_args(p: argparse.ArgumentParser) -> None:
    """The stress test's flags."""
    p.add_argument("--stress", action="store_true", help="bounded load test instead of the sweep (see above)")
    p.add_argument("--stress-requests", type=int, default=500, help="requests of the stress test (default 500)")
    p.add_argument("--stress-concurrency", type=int, default=64, help="clients of the stress test (default 64)")
    p.add_argument(
        "--disconnect-frac",
        type=float,
        default=0.1,
        help="fraction of stress requests whose client disconnects early (default 0.1)",
    )
    p.add_argument("--stress-policy", default=None, help="policy of the stress server (default dspark / plain)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_load",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target", default=None, help="preset or model path (default smollm2-135m-instruct; stories260k with --quick)"
    )
    p.add_argument("--drafter", default=None, help="drafter export directory")
    p.add_argument(
        "--random-drafter",
        type=int,
        default=None,
        metavar="BLOCK_SIZE",
        help="use a randomly initialised (untrained) drafter with this block size instead of an export "
        "(smoke tests: exercises every policy, acceptance is near zero)",
    )
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies (default: plain, fixed:N for each --num-speculative-tokens, greedy, dspark); "
        "POLICY+ahead: that policy with its speculative steps planned ahead (the server's --plan-ahead)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        default="1,2,4,8",
        metavar="N[,N...]",
        help="the fixed policies' draft tokens verified per round, in the default policy list (default 1,2,4,8)",
    )
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="concurrency levels (default 1,2,...,64)")
    p.add_argument(
        "--num-requests",
        type=int,
        default=0,
        help="requests per concurrency level (default: max(8, WAVES x concurrency))",
    )
    p.add_argument(
        "--waves",
        type=int,
        default=2,
        help="requests per client at each level when --num-requests is not given (default 2)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every policy at each level, interleaved; the median is reported (default 1)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    add_prompt_args(p)
    p.add_argument("--num-slots", type=int, default=None, help="engine slots (default: the highest concurrency)")
    p.add_argument(
        "--cache-len",
        type=int,
        default=EngineConfig.cache_len,
        help=f"engine cache length (default {EngineConfig.cache_len}, the server's)",
    )
    p.add_argument("--buckets", default=None, help="engine token-budget buckets, comma-separated")
    p.add_argument(
        "--sps-table",
        default=None,
        help="SPS table file shared by all policies (default OUT/sps_table.json: profiled once)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="seed of the request order and random settings (default 0)")
    p.add_argument("--out", default="runs/serve_load", help="output directory (default runs/serve_load)")
    p.add_argument(
        "--quick", action="store_true", help="CI smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items())
    )
    add_stress_args(p)
    prefill_load.add_args(p)
    return p


def apply_quick(args: argparse.Namespace) -> None:
    """``--quick`` fills every option the user left at its default."""
    defaults = vars(build_parser().parse_args([]))
    for k, v in QUICK.items():
        if getattr(args, k) == defaults[k]:
            setattr(args, k, v)
    if args.stress and args.stress_requests == defaults["stress_requests"]:
        args.stress_requests, args.stress_concurrency = 40, 8


def default_policies(args, has_drafter: bool) -> list[str]:
    if args.policies:
        return [p.strip() for p in args.policies.split(",") if p.strip()]
    if not has_drafter:
        return ["plain"]
    fixed = [f"fixed:{n.strip()}" for n in args.num_speculative_tokens.split(",") if n.strip()]
    return ["plain", *fixed, "greedy", "dspark"]


# --------------------------------------------------------------------------- sweep


def _median_run(rows: list[dict]) -> dict:
    """The repeat with the median output tok/s (the lower middle one for an even count), with
    every repeat's output and per-user tok/s attached."""
    order = sorted(rows, key=lambda r: r["output_tok_s"])
    row = dict(order[(len(order) - 1) // 2])
    row["repeats"] = len(rows)
    row["repeat_output_tok_s"] = [r["output_tok_s"] for r in rows]
    row["repeat_per_user_tok_s"] = [r["per_user_tok_s"] for r in rows]
    return row


def build_engines(args, models: tuple, policies: list[str], num_slots: int, engine=None, plain_engine=None):
    """``({policy: engine}, {policy: startup seconds})``: ``plain`` on an engine of its own without a
    drafter, the speculative policies on one shared engine (:func:`engine_for`): one set of compiled
    programs, where one engine per policy would hold several (and can exhaust the process's memory maps).
    ``engine`` / ``plain_engine``: engines to use instead of building them."""
    target, drafter = models
    engines: dict[str, Any] = {}
    startup: dict[str, float] = {}
    for policy in policies:
        shared = next((e for p, e in engines.items() if p != "plain"), None)
        given = plain_engine if policy == "plain" else (engine or shared)
        engines[policy], startup[policy] = engine_for(
            args, target, None if policy == "plain" else drafter, policy, num_slots, given
        )
        print(f"[{policy}] engine ready in {startup[policy]:.1f} s", file=sys.stderr)
    return engines, startup


def sweep(args, models: tuple | None = None, engine=None, plain_engine=None) -> dict[str, Any]:
    """The concurrency sweep over every policy, interleaved.

    Every concurrency level runs each policy back to back (``--repeats`` rounds of all
    policies; the row kept is the repeat with the median output tok/s), so the ratios between
    policies are measured side by side rather than minutes apart on a noisy machine.

    ``models``: ``(target, tokenizer, drafter)`` already loaded (default: from ``args``).
    By default every policy gets its own warmed-up engine (``plain`` one without a drafter;
    compiled executables and the SPS table are shared, each engine keeps its own online
    calibration). ``engine``: an idle warmed-up engine with the drafter to use for every
    speculative policy instead (reconfigured with ``set_policy`` before each run, so its
    calibration carries over); ``plain_engine``: one to use for ``plain``.
    """
    from dspark_jax.errors import DSparkInputError

    if args.repeats < 1 or args.waves < 1:
        raise DSparkInputError("--repeats and --waves must be >= 1")
    target, tok, drafter = models or load_models(args)
    if args.chat is None:
        args.chat = bool(getattr(tok, "has_chat_template", False))
    prompts = load_prompts(args, tok)
    levels = [int(c) for c in args.concurrency.split(",")]
    num_slots = args.num_slots or max(levels)
    policies = default_policies(args, drafter is not None)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.sps_table is None and any(p != "plain" for p in policies):
        args.sps_table = str(out_dir / "sps_table.json")
    engines, startup = build_engines(args, (target, drafter), policies, num_slots, engine, plain_engine)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    engine_stats: dict[str, dict] = {}
    for c in levels:
        n = args.num_requests or max(8, args.waves * c)
        reps: dict[str, list[dict]] = {p: [] for p in policies}
        for rep in range(args.repeats):
            # rotate the order every repeat so that no policy always runs first or after the same one
            k = (rep + levels.index(c)) % len(policies)
            for policy in policies[k:] + policies[:k]:
                eng = engines[policy]
                name, ahead = split_ahead(policy)
                if eng.policy != name:  # a shared engine: switch (compiled buckets are kept)
                    eng.set_policy(name)
                    eng.warmup()
                eng.planner.speculative_ahead = ahead
                eng.reset_metrics()
                row, engine_stats[policy] = measure_level(args, eng, tok, policy, prompts, c, n, max(levels) * 4, rep)
                reps[policy].append(row)
        for policy in policies:
            runs[policy].append(_median_run(reps[policy]))
    add_ratios(runs)
    result = {
        "target": args.target,
        "drafter": args.drafter or (f"random(block_size={drafter.cfg.block_size})" if drafter is not None else None),
        "chat": args.chat,
        "prompts": args.prompts or ("mt_bench" if args.chat else "tinystories"),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "num_slots": num_slots,
        "cache_len": args.cache_len,
        "concurrency": levels,
        "policies": policies,
        "repeats": args.repeats,
        "engine_startup_s": startup,
        "device": device_description(),
        "runs": runs,
        "engine": engine_stats,
    }
    write_json(out_dir / "serve_load.json", result)
    plot(result, out_dir / "serve_load.png")
    print(table(result))
    print(f"wrote {out_dir / 'serve_load.json'} and {out_dir / 'serve_load.png'}", file=sys.stderr)
    return result


def measure_level(args, eng, tok, policy: str, prompts, c: int, n: int, max_queue: int, rep: int) -> tuple[dict, dict]:
    """One run of ``policy`` at concurrency ``c`` (``n`` requests) through a server over ``eng``
    (already set to the policy): the level's row (with the engine's counters) and the engine's
    acceptance, calibration and compile statistics; prints the row (``rep``: the repeat's index)."""
    srv, _ = serve(eng, tok, args, policy, max_queue=max_queue)
    with srv:
        row = asyncio.run(run_level(srv.url, args.chat, prompts, c, n, args.max_tokens, args.temperature))
    m = eng.metrics()  # the server (and its engine thread) has stopped: safe to read
    row["engine"] = {
        k: m.get(k)
        for k in (
            "steps",
            "draft_steps",
            "suspended_steps",
            "catchup_tokens",
            "mean_accepted_length",
            "acceptance_rate",
            "budget_hist",
            "rows_hist",
            "step_seconds",
        )
    }
    stats = {k: m.get(k) for k in ("position_acceptance", "calibration", "compiles")}
    print(
        f"[{policy}] c={c:3d} #{rep + 1}: {row['output_tok_s']:8.1f} tok/s, per user "
        f"{_fmt(row['per_user_tok_s'])} tok/s, ttft {_fmt(row['ttft_s'], '.2f')} s, "
        f"tau {_fmt(row['tau'], '.2f')}, drafting steps {m['draft_steps']}/{m['steps']} "
        f"(suspended {m['suspended_steps']}), "
        f"ok {row['num_ok']}/{row['num_requests']}",
        file=sys.stderr,
    )
    if row["num_ok"] < row["num_requests"]:
        print(f"[{policy}] c={c:3d}: FAILED requests: {row['errors']}", file=sys.stderr)
    return row, stats


def add_ratios(runs: dict[str, list[dict]]) -> None:
    """Adds ``*_vs_plain`` and ``*_vs_best_fixed`` ratios to every row (same concurrency); ``best_fixed``
    names the ``fixed:*`` arm with the most output tok/s (per-user ratios use their own best)."""
    fixed = [p for p in runs if p.startswith("fixed:")]
    for i, _ in enumerate(next(iter(runs.values()), [])):
        for key in ("output_tok_s", "per_user_tok_s"):
            plain = runs["plain"][i][key] if "plain" in runs else None
            best = max((runs[p][i][key] or 0.0 for p in fixed), default=None)
            best_name = max(fixed, key=lambda p: runs[p][i][key] or 0.0) if fixed else None
            for p in runs:
                v = runs[p][i][key]
                runs[p][i][f"{key}_vs_plain"] = v / plain if v and plain else None
                runs[p][i][f"{key}_vs_best_fixed"] = v / best if v and best else None
                if key == "output_tok_s":
                    runs[p][i]["best_fixed"] = best_name


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    head = (
        "| policy | concurrency | output tok/s | per-user tok/s | TTFT s | tau | acc. rate | out vs plain "
        "| out vs best fixed | per-user vs plain | per-user vs best fixed |"
    )
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for p, rows in result["runs"].items():
        for r in rows:
            lines.append(
                f"| {p} | {r['concurrency']} | {_fmt(r['output_tok_s'])} | {_fmt(r['per_user_tok_s'])} | "
                f"{_fmt(r['ttft_s'], '.2f')} | {_fmt(r['tau'], '.2f')} | {_fmt(r['acceptance_rate'], '.2f')} | "
                f"{_fmt(r['output_tok_s_vs_plain'], '.2f')} | {_fmt(r['output_tok_s_vs_best_fixed'], '.2f')} | "
                f"{_fmt(r['per_user_tok_s_vs_plain'], '.2f')} | "
                f"{_fmt(r['per_user_tok_s_vs_best_fixed'], '.2f')} |"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in (
        (axes[0], "output_tok_s", "output tokens/s (all users)"),
        (axes[1], "per_user_tok_s", "per-user tokens/s (decode)"),
    ):
        for p, rows in result["runs"].items():
            xs = [r["concurrency"] for r in rows if r[key]]
            ys = [r[key] for r in rows if r[key]]
            ax.plot(xs, ys, marker="o", label=p, linestyle="--" if p.startswith("fixed:") else "-")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["concurrency"], [str(c) for c in result["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{result['target']}, drafter {result['drafter']}, max_tokens {result['max_tokens']}, "
        f"T={result['temperature']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- stress


def random_settings(rng: random.Random, max_tokens: int) -> dict:
    s = {
        "seed": rng.randrange(2**31),
        "temperature": rng.choice([0.0, 0.0, 0.5, 1.0, 1.3]),
        "top_k": rng.choice([0, 0, 1, 5, 40]),
        "top_p": rng.choice([1.0, 1.0, 0.9, 0.5]),
        "max_tokens": rng.randint(1, max_tokens),
    }
    if rng.random() < 0.2:
        s["stop"] = rng.choice([".", [" the", "!"], "\n", ["and"]])
    return s


async def stress_load(url: str, chat: bool, prompts: list[str], args) -> list[dict]:
    rng = random.Random(args.seed)
    jobs = []
    for i in range(args.stress_requests):
        body = request_body(rng.choice(prompts), chat, **random_settings(rng, args.max_tokens))
        streaming = rng.random() < 0.5
        hang = None
        if rng.random() < args.disconnect_frac:
            hang = rng.randint(1, 3) if streaming else rng.uniform(0.0, 0.3)
        jobs.append({"i": i, "body": body, "stream": streaming, "hang": hang})
    queue = list(jobs)
    async with http_client(url, args.stress_concurrency) as client:

        async def one(job):
            if job["stream"]:
                return await stream_request(client, chat, job["body"], hang_up_after=job["hang"])
            if job["hang"] is None:
                return await plain_request(client, chat, job["body"])
            task = asyncio.ensure_future(plain_request(client, chat, job["body"]))
            done, _ = await asyncio.wait({task}, timeout=job["hang"])
            if task in done:
                return task.result()
            task.cancel()  # closes the connection mid-request
            with __import__("contextlib").suppress(BaseException):
                await task
            return Result(ok=False, disconnected=True)

        async def worker():
            while queue:
                job = queue.pop(0)
                job["result"] = await one(job)

        await asyncio.gather(*(worker() for _ in range(args.stress_concurrency)))
    return jobs


async def rerun_alone(url: str, chat: bool, jobs: list[dict]) -> None:
    async with http_client(url, 1) as client:
        for job in jobs:
            job["alone"] = await plain_request(client, chat, job["body"])


async def wait_idle(url: str, timeout: float = 60.0) -> dict:
    import httpx

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as c:
        while True:
            h = (await c.get("/health")).json()
            if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() - t0 > timeout:
                return h
            await asyncio.sleep(0.1)


def stress(args, models: tuple | None = None, engine=None) -> dict[str, Any]:
    """The bounded load test (``models`` / ``engine``: as in :func:`sweep`)."""
    import httpx

    target, tok, drafter = models or load_models(args)
    if args.chat is None:
        args.chat = bool(getattr(tok, "has_chat_template", False))
    prompts = load_prompts(args, tok)
    policy = args.stress_policy or ("dspark" if drafter is not None else "plain")
    num_slots = args.num_slots or 16
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.sps_table is None and policy != "plain":
        args.sps_table = str(out_dir / "sps_table.json")
    engine, startup_s = engine_for(args, target, drafter, policy, num_slots, engine)
    print(
        f"[stress] {policy}, {num_slots} slots, engine ready in {startup_s:.1f} s; "
        f"{args.stress_requests} requests at concurrency {args.stress_concurrency}",
        file=sys.stderr,
    )
    srv, loop = serve(engine, tok, args, policy, max_queue=args.stress_requests)
    t0 = time.perf_counter()
    with srv:
        jobs = asyncio.run(stress_load(srv.url, args.chat, prompts, args))
        load_s = time.perf_counter() - t0
        health = asyncio.run(wait_idle(srv.url))
        metrics_text = httpx.get(srv.url + "/metrics").text
        completed = [j for j in jobs if j["result"].ok and not j["result"].disconnected]
        asyncio.run(rerun_alone(srv.url, args.chat, completed))
        health_after = asyncio.run(wait_idle(srv.url))
        alive = loop.alive and srv.thread.is_alive()
    mismatches = []
    for j in completed:
        a, b = j["result"], j["alone"]
        if not b.ok or (a.token_ids, a.text, a.finish_reason) != (b.token_ids, b.text, b.finish_reason):
            mismatches.append(
                {
                    "i": j["i"],
                    "body": j["body"],
                    "stream": j["stream"],
                    "concurrent": [a.token_ids, a.text, a.finish_reason],
                    "alone": [b.token_ids, b.text, b.finish_reason, b.error],
                }
            )
    failed = [j for j in jobs if not j["result"].ok and not j["result"].disconnected]
    leak = not (health["running"] == 0 and health["waiting"] == 0 and health["free_slots"] == health["num_slots"])
    leak_after = health_after["free_slots"] != health_after["num_slots"]
    aborted = sum(
        float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith("dspark:request_aborted_total")
    )
    report = {
        "target": args.target,
        "policy": policy,
        "num_slots": num_slots,
        "requests": len(jobs),
        "concurrency": args.stress_concurrency,
        "disconnect_frac": args.disconnect_frac,
        "completed": len(completed),
        "client_disconnects": sum(j["result"].disconnected for j in jobs),
        "server_aborted_requests": aborted,
        "failed": len(failed),
        "failures": [{"i": j["i"], "status": j["result"].status, "error": j["result"].error} for j in failed[:10]],
        "load_seconds": load_s,
        "health_after_load": health,
        "health_at_end": health_after,
        "slot_leak": leak or leak_after,
        "server_alive": alive,
        "identical_to_alone": len(completed) - len(mismatches),
        "mismatches": mismatches[:10],
        "num_mismatches": len(mismatches),
    }
    report["passed"] = bool(alive and not report["slot_leak"] and not mismatches and not failed and completed)
    write_json(out_dir / "stress.json", report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("mismatches", "failures")}, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    args.target = args.target or "smollm2-135m-instruct"
    if args.long_prompt_scenario:  # chunked vs one-shot prefill (benchmarks.prefill_load)
        if args.concurrency == build_parser().get_default("concurrency"):
            args.concurrency = "16,64"
        status, _ = run_cli(prefill_load.run, args)
        return status
    if args.stress:
        status, rep = run_cli(stress, args)
        return status or (0 if rep and rep["passed"] else 1)
    status, res = run_cli(sweep, args)
    failed = [
        (p, r["concurrency"])
        for p, rows in (res or {}).get("runs", {}).items()
        for r in rows
        if r["num_ok"] < r["num_requests"]
    ]
    if failed:
        print(f"requests failed in {failed}; see the errors in serve_load.json", file=sys.stderr)
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
