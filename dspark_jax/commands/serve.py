"""``python -m dspark_jax.serve``: the OpenAI-compatible HTTP server.

Examples::

    python -m dspark_jax.serve --target smollm2-135m-instruct --drafter runs/smollm2-135m-instruct/export \\
        --policy dspark --num-slots 16 --cache-len 1024 --port 8000
    python -m dspark_jax.serve --target stories260k --policy plain --num-slots 4 --cache-len 256

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64, "temperature": 0}'

The engine (``dspark_jax.serving.engine.Engine``; the flags' defaults are those of
:class:`~dspark_jax.serving.config.EngineConfig`) is built (:mod:`dspark_jax.serving.build`),
profiled (SPS table; ``--sps-table`` loads/saves it) and warmed up (every compiled shape) before
the port opens, so the first request does not pay compilation. Policies: ``plain`` (no drafter), ``fixed:G`` (verify G
draft tokens per request), ``threshold:C`` (confidence threshold), ``greedy`` (the clean
greedy Theta scheduler) and ``dspark`` (the deployed scheduler). Ctrl-C drains: requests
in flight finish (up to ``--graceful-timeout`` seconds), then the engine thread stops.
``--prefill-chunk-tokens N`` (default 256) sets the batched, chunked prefill: one compiled pass of
at most N prompt tokens per engine iteration, interleaved with decode steps (0: one-shot prefill
of one request at a time; :mod:`dspark_jax.serving.engine.prefill`).
``--max-request-bytes N`` refuses larger request bodies with 413 (default: 64 bytes per token of the
context + 64 KiB; 0: no limit). ``--dry-run`` runs the start's checks without weights or devices
(:mod:`dspark_jax.serving.http.preflight`) and prints the plan.
``--api-key`` (or ``DSPARK_API_KEY``) requires ``Authorization: Bearer KEY`` on every ``/v1``
route (401 otherwise; ``/health`` and ``/metrics`` stay open unless
``--api-key-health-metrics``). ``--verification`` picks the engine's lossless verification
(``coupled`` or ``rejection``). ``--plan-ahead`` plans and dispatches each speculative step before
the step in flight is read (off by default: it pays where a step is short and the host shares the
device's cores; docs/design.md#serving). Exit status 2 with a one-line ``error:`` message on bad
input, including a drafter the engine cannot serve (e.g. eagle3).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from dspark_jax.decoding import disk_cache
from dspark_jax.serving.config import EngineConfig
from dspark_jax.serving.http.preflight import (
    check_plan,
    check_server_arguments,
    parse_buckets,
    print_plan,
    read_chat_template,
)

__all__ = ["build_parser", "engine_config", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m dspark_jax.serve`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.serve",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming, /health, "
        "/metrics) over the continuous-batching DSpark engine.",
    )
    _add_model_args(p)
    _add_engine_args(p)
    _add_request_args(p)
    _add_runtime_args(p)
    disk_cache.add_cache_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run the start's checks on the target's config and the drafter's metadata (vocabulary, hidden "
        "size, layers, drafter kind, policy, settings; no weights, no devices, nothing compiled: exit status 2 "
        "with the start's error line), print the resolved plan as JSON and exit",
    )
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """--target, --drafter, --policy."""
    p.add_argument(
        "--target",
        required=True,
        help="preset (stories260k, smollm2-135m-instruct) or path to a .gguf file, a llama2.c .bin "
        "(tok*.bin beside it) or a Hugging Face model directory",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter export directory written by `python -m dspark_jax.train` (omit for plain decoding)",
    )
    p.add_argument(
        "--policy",
        default=EngineConfig.policy,
        help="verification-length policy: plain | fixed:G | threshold:C | greedy | dspark "
        "(default: dspark with --drafter, plain without)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine shape: slots, cache length, token buckets, SPS table, drafter suspension."""
    p.add_argument(
        "--num-slots",
        type=int,
        default=EngineConfig.num_slots,
        help=f"decode slots = requests decoded together (default {EngineConfig.num_slots})",
    )
    p.add_argument(
        "--cache-len",
        type=int,
        default=EngineConfig.cache_len,
        help="KV-cache length per slot = the context length (prompt + generated tokens; "
        f"default {EngineConfig.cache_len})",
    )
    p.add_argument(
        "--buckets",
        default=None,
        help="comma-separated token budgets of the compiled verify passes (default: the engine's)",
    )
    p.add_argument(
        "--sps-table",
        default=None,
        help="JSON SPS table (seconds of a step per bucket and attention span): loaded if it exists and "
        "matches the device and model, else profiled at start-up and written there (a file of the "
        "previous format is refused: delete it to re-profile)",
    )
    p.add_argument(
        "--profile-spans",
        default=None,
        help="comma-separated attention spans [tokens] to profile the SPS table at (whole KV blocks; "
        "default one block: the profiling cost of one span per bucket); the scheduler uses the nearest "
        "profiled span at or above the requests' live length",
    )
    p.add_argument(
        "--suspend-after",
        type=int,
        default=-1 if EngineConfig.suspend_after is None else EngineConfig.suspend_after,
        help="consecutive non-drafting steps after which plain steps stop updating the drafter's "
        f"context (caught up when drafting resumes; -1: never suspend; default {EngineConfig.suspend_after})",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=EngineConfig.prefill_chunk_tokens,
        metavar="N",
        help="batched, chunked prefill: each engine iteration runs one compiled prefill pass of at most N "
        "prompt tokens, packing several waiting prompts and splitting a long one into chunks that "
        "interleave with decode steps, so a long prompt delays the streams by one chunk at a time "
        f"(0: one-shot prefill, one request at a time; default {EngineConfig.prefill_chunk_tokens})",
    )
    p.add_argument(
        "--plan-ahead",
        action="store_true",
        default=EngineConfig.plan_ahead,
        help="plan and dispatch each speculative step before the step in flight is read (its rows' room "
        "bounded by what that step can add; output unchanged). Off by default: on a 2-core CPU it made "
        "stories260K 1.5-1.7x faster at one slot but not SmolLM2 (0.97-1.03x), nor anything on an H200 "
        "(0.90-1.06x); measure with python -m benchmarks.engine_policies --ahead",
    )


def _add_request_args(p: argparse.ArgumentParser) -> None:
    """Request handling: queue, default max_tokens, verification, API key, chat template, name."""
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests allowed to wait for a slot when all are busy; more get HTTP 429 "
        "(0: no waiting queue, requests are admitted while slots are free; default 256)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="N",
        help="largest request body taken, in bytes: a larger one gets HTTP 413 before it is parsed or "
        "tokenized (default: 64 per token of the context + 64 KiB; 0: no limit)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of requests that give none, both endpoints (capped to the context room; "
        "default: vLLM's: 16 for /v1/completions, the rest of the context for chat)",
    )
    p.add_argument(
        "--verification",
        default=EngineConfig.verification,
        choices=["coupled", "rejection"],
        help="lossless verification: coupled (Gumbel-coupled, the default) or rejection (standard "
        "speculative rejection sampling: higher acceptance at T > 0, same output law)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise; default: the "
        "DSPARK_API_KEY environment variable, else no key)",
    )
    p.add_argument(
        "--api-key-health-metrics",
        action="store_true",
        help="with --api-key, /health and /metrics need the key too (default: they stay open)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat-template file overriding the tokenizer's (needed for models without one)",
    )
    p.add_argument("--served-model-name", default=None, help="the `model` name in responses (default: --target)")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """dtype, attention backend, device mesh, bind address, shutdown and logging."""
    from dspark_jax.commands.flags import add_attention_argument, add_dtype_argument

    add_dtype_argument(p)
    add_attention_argument(p)
    p.add_argument(
        "--mesh",
        default=None,
        metavar="model:N",
        help="tensor-parallel serving over N devices: weights, KV caches and drafter sharded over "
        "'model' (default: one device); the first N devices of a larger host (CUDA_VISIBLE_DEVICES / "
        "TPU_VISIBLE_CHIPS pick which), model:-1 every device; plan memory first with python -m "
        "dspark_jax.train --config RECIPE --dry-run --serve --mesh model:N",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="seconds to let in-flight requests finish on shutdown (default 30)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's log verbosity (default info)",
    )


def engine_config(args: argparse.Namespace, policy: str | None = None) -> EngineConfig:
    """The :class:`EngineConfig` of the parsed flags (``policy``: the resolved ``--policy``).

    Raises:
      DSparkInputError: bad ``--buckets`` / ``--profile-spans``.
    """
    return EngineConfig(
        num_slots=args.num_slots,
        cache_len=args.cache_len,
        policy=policy if policy is not None else args.policy,
        buckets=parse_buckets(args.buckets),
        profile_spans=parse_buckets(args.profile_spans, "--profile-spans"),
        suspend_after=None if args.suspend_after == -1 else args.suspend_after,
        verification=args.verification,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        plan_ahead=args.plan_ahead,
    )


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from dspark_jax.serving.build import build_engine, build_server, warmup_engine

    jax_cache = disk_cache.apply_cache_arguments(args)

    from dspark_jax.decoding.loading import load_target
    from dspark_jax.decoding.request import load_drafter_for
    from dspark_jax.drafters.checkpoint import export_config, read_export_meta

    api_key = check_server_arguments(args)
    # fail fast, before loading the target
    dcfg = export_config(read_export_meta(args.drafter), args.drafter) if args.drafter else None
    chat_template = read_chat_template(args.chat_template)

    def say(msg: str) -> None:  # before uvicorn's logging is configured
        print(f"[dspark_jax.serve] {msg}", file=sys.stderr, flush=True)

    mesh = None
    if args.mesh:  # weights go straight from the host to their shards (an 8B target never lands on one chip)
        from dspark_jax.serving.engine.state import serving_mesh

        mesh = serving_mesh(args.mesh)
    target, tok = load_target(args.target, dtype=args.dtype, mesh=mesh, attention_backend=args.attention_backend)
    # the dry run's checks (the same lines), with the weights' fingerprint, before the drafter loads
    policy = check_plan(args, target.cfg, dcfg, target.fingerprint)
    drafter = load_drafter_for(target, tok, args.drafter, target.dtype)[0] if args.drafter else None
    t0 = time.monotonic()
    # Built without warm-up first: a drafter or setting the engine refuses (e.g. an eagle3
    # drafter) is one `error:` line before anything is compiled.
    config = engine_config(args, policy)
    engine = build_engine(target, drafter, config, sps_table=args.sps_table, mesh=mesh, warmup=False)
    say(
        f"compiling the engine (policy {policy}, verification {args.verification}, {args.num_slots} slots, "
        f"cache {args.cache_len}, prefill chunk {args.prefill_chunk_tokens}"
        + (", planned ahead" if args.plan_ahead else "")
        + ") for every bucket ..."
    )
    warmup_engine(engine, args.sps_table)
    say(
        f"engine ready in {time.monotonic() - t0:.1f} s: built {engine.metrics()['compiles']} programs"
        + (f" (persistent compilation cache {jax_cache}: the next start reuses them)" if jax_cache else "")
        + (f"; SPS table {engine.table_source}" if engine.table_source else "")
        + f"; serving on http://{args.host}:{args.port}"
    )
    app, _ = build_server(
        engine,
        tok,
        model_name=args.served_model_name or args.target,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        chat_template=chat_template,
        policy=policy,
        api_key=api_key,
        api_key_health_metrics=args.api_key_health_metrics,
        max_request_bytes=args.max_request_bytes,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.graceful_timeout
    )


def main(argv: list[str] | None = None) -> int:
    from dspark_jax.errors import run_cli

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status, _ = run_cli(print_plan if args.dry_run else run, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
