"""The HTTP load client and the in-process server of ``benchmarks.serve_load`` and
``benchmarks.prefill_load``: streamed and plain requests over loopback, their per-level summary
(tokens/s, per-user tokens/s, TTFT, tau), and the models, engines and prompts both benchmarks serve.

Times are :func:`time.perf_counter` seconds taken on the client side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time
from typing import Any

from benchmarks.harness import split_ahead

# --------------------------------------------------------------------------- client side


@dataclasses.dataclass
class Result:
    """One request as the client saw it."""

    ok: bool
    status: int = 0
    start: float = 0.0
    first: float | None = None
    end: float = 0.0
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    spec: dict | None = None
    error: str = ""
    disconnected: bool = False


def endpoint(chat: bool) -> str:
    """The completion endpoint: chat completions or plain completions."""
    return "/v1/chat/completions" if chat else "/v1/completions"


def request_body(prompt: str, chat: bool, **kw) -> dict:
    """A request body for :func:`endpoint` (one user message, or a prompt) with fields ``kw``."""
    b = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    b.update(kw)
    return b


async def stream_request(client, chat: bool, body: dict, hang_up_after: int | None = None) -> Result:
    """Streams one request; ``hang_up_after=k`` closes the connection after k chunks."""
    r = Result(ok=False, start=time.perf_counter())
    body = dict(body, stream=True, return_token_ids=True, stream_options={"include_usage": True})
    n = 0
    try:
        async with client.stream("POST", endpoint(chat), json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:300]
                r.end = time.perf_counter()
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    r.ok = r.finish_reason is not None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    r.error = obj["error"].get("message", "error")
                    break
                n += 1
                for ch in obj.get("choices", []):
                    piece = ch.get("delta", {}).get("content") if chat else ch.get("text")
                    ids = ch.get("token_ids") or []
                    if (piece or ids) and r.first is None:
                        r.first = time.perf_counter()
                    r.text += piece or ""
                    r.token_ids += ids
                    if ch.get("finish_reason"):
                        r.finish_reason = ch["finish_reason"]
                if "usage" in obj:
                    r.usage, r.spec = obj["usage"], obj.get("spec_decode")
                if hang_up_after is not None and n >= hang_up_after:
                    r.disconnected = True
                    break
    except Exception as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    return r


async def plain_request(client, chat: bool, body: dict) -> Result:
    """One request without streaming (its first token time is its end)."""
    r = Result(ok=False, start=time.perf_counter())
    try:
        resp = await client.post(endpoint(chat), json=dict(body, stream=False, return_token_ids=True))
        r.status = resp.status_code
        obj = resp.json()
        if resp.status_code != 200:
            r.error = obj.get("error", {}).get("message", resp.text[:300])
        else:
            ch = obj["choices"][0]
            r.text = ch["message"]["content"] if chat else ch["text"]
            r.token_ids, r.finish_reason = ch.get("token_ids", []), ch["finish_reason"]
            r.usage, r.spec, r.ok = obj["usage"], obj.get("spec_decode"), True
    except Exception as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    r.first = r.first or r.end
    return r


def http_client(url: str, concurrency: int):
    """An ``httpx.AsyncClient`` on ``url`` with room for ``concurrency`` connections (one-hour timeout)."""
    import httpx

    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(3600.0),
        limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4),
    )


async def run_level(
    url: str, chat: bool, prompts: list[str], concurrency: int, num_requests: int, max_tokens: int, temperature: float
) -> dict[str, Any]:
    """One concurrency level: ``num_requests`` streamed requests by ``concurrency`` clients."""
    queue = list(range(num_requests))
    results: list[Result] = []
    async with http_client(url, concurrency) as client:

        async def worker():
            while queue:
                i = queue.pop(0)
                body = request_body(
                    prompts[i % len(prompts)], chat, max_tokens=max_tokens, temperature=temperature, seed=i
                )
                results.append(await stream_request(client, chat, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize(results, wall, concurrency)


def summarize(results: list[Result], wall: float, concurrency: int) -> dict[str, Any]:
    """One level's row: request counts, output and per-user tokens/s, TTFT, latency, pooled tau."""
    ok = [r for r in results if r.ok]
    toks = [(r.usage or {})["completion_tokens"] for r in ok]
    per_user = [(n - 1) / (r.end - r.first) for r, n in zip(ok, toks) if n > 1 and r.first and r.end > r.first]
    ttft = sorted(r.first - r.start for r in ok if r.first)
    steps = sum((r.spec or {}).get("num_steps") or 0 for r in ok)
    emitted = sum(((r.spec or {}).get("tau") or 0) * ((r.spec or {}).get("num_steps") or 0) for r in ok)
    ver = sum((r.spec or {}).get("num_draft_tokens") or 0 for r in ok)
    acc = sum((r.spec or {}).get("num_accepted_tokens") or 0 for r in ok)

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "output_tokens": sum(toks),
        "output_tok_s": sum(toks) / wall if wall > 0 else 0.0,
        "per_user_tok_s": statistics.fmean(per_user) if per_user else None,
        "ttft_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": q(ttft, 0.5),
        "ttft_p90_s": q(ttft, 0.9),
        "e2e_s": statistics.fmean(r.end - r.start for r in ok) if ok else None,
        "tau": emitted / steps if steps else None,
        "acceptance_rate": acc / ver if ver else None,
    }


# --------------------------------------------------------------------------- server side


def load_models(args):
    """``(target, tokenizer, drafter)`` of ``--target`` / ``--drafter`` (or a random drafter of
    block size ``--random-drafter``), in ``--dtype``."""
    import jax.numpy as jnp

    from dspark_jax.api import load_target_and_drafter

    dtype = jnp.dtype(args.dtype)
    target, tok, drafter = load_target_and_drafter(args.target, args.drafter, dtype=dtype)
    if drafter is None and args.random_drafter:
        from flax import nnx

        from dspark_jax.config import DrafterConfig
        from dspark_jax.drafters.dspark import DSparkDrafter

        drafter = DSparkDrafter(
            DrafterConfig.for_target(target.cfg, block_size=args.random_drafter, num_layers=1, markov_rank=8),
            nnx.Rngs(args.seed),
            dtype=dtype,
        )
    return target, tok, drafter


def engine_for(args, target, drafter, policy: str, num_slots: int, engine=None):
    """A warmed-up engine running ``policy`` (``POLICY+ahead``: planned ahead, :func:`split_ahead`):
    built on first use, then reconfigured.

    ``plain`` gets its own engine without a drafter (the baseline is plain decoding, with
    no drafter context to maintain). The speculative policies share one engine:
    reconfiguring it (``Engine.set_policy`` + ``warmup``) compiles only the step buckets a
    policy adds and keeps the SPS table when it covers them, so a sweep pays for compilation
    once. (The online calibration state carries over, as on a long-running server.)
    """
    from dspark_jax.serving.build import build_engine
    from dspark_jax.serving.engine import EngineConfig
    from dspark_jax.serving.http.preflight import parse_buckets

    policy, ahead = split_ahead(policy)
    t0 = time.perf_counter()
    if engine is None:
        config = EngineConfig(
            num_slots=num_slots,
            cache_len=args.cache_len,
            policy=policy,
            buckets=parse_buckets(args.buckets),
            plan_ahead=ahead,
        )
        engine = build_engine(target, drafter, config, sps_table=args.sps_table)
    else:
        engine.set_policy(policy)
        engine.plan_ahead = ahead
        engine.warmup()
        if args.sps_table and engine.sps_table is not None:
            engine.sps_table.save(args.sps_table)
    engine.reset_metrics()
    return engine, time.perf_counter() - t0


def serve(engine, tok, args, policy: str, max_queue: int):
    """``(ServerThread, EngineLoop)``: ``engine`` behind the HTTP server on a free loopback port."""
    from dspark_jax.serving.build import build_server
    from dspark_jax.serving.http.thread import ServerThread

    app, loop = build_server(engine, tok, model_name=args.target, max_queue=max_queue, policy=policy)
    return ServerThread(app), loop


def load_prompts(args, tok) -> list[str]:
    """The prompt texts, shuffled with ``--seed``, keeping those that fit the context with
    ``--max-tokens`` generated tokens (tokenized as the server will: chat template or not).

    Raises:
      DSparkInputError: no prompt fits.
    """
    from dspark_jax.data.prompts import encode_prompts, load_prompt_texts
    from dspark_jax.errors import DSparkInputError

    spec = args.prompts or ("mt_bench" if args.chat else "tinystories")
    texts, _ = load_prompt_texts(spec)
    ids = encode_prompts(tok, texts, bool(args.chat))
    fit = [t for t, i in zip(texts, ids) if len(i) + args.max_tokens <= args.cache_len]
    if not fit:
        raise DSparkInputError(
            f"no prompt of {spec!r} fits --cache-len {args.cache_len} with --max-tokens {args.max_tokens}"
        )
    random.Random(args.seed).shuffle(fit)
    return fit
