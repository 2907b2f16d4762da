"""``python -m dspark_jax.serve``: the OpenAI-compatible HTTP server.

Examples::

    python -m dspark_jax.serve --target smollm2-135m-instruct --drafter runs/smollm2-135m-instruct/export \\
        --policy dspark --num-slots 16 --cache-len 1024 --port 8000
    python -m dspark_jax.serve --target stories260k --policy plain --num-slots 4 --cache-len 256

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 64, "temperature": 0}'

The engine (``dspark_jax.serving.engine.Engine``) is built, profiled (SPS table; ``--sps-table``
loads/saves it) and warmed up (every compiled shape) before the port opens, so the first
request does not pay compilation. Policies: ``plain`` (no drafter), ``fixed:G`` (verify G
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
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_jax.decoding import disk_cache
from dspark_jax.serving.http.preflight import (
    check_engine_shape,
    check_plan,
    check_server_arguments,
    parse_buckets,
    print_plan,
    read_chat_template,
)

__all__ = ["ServerThread", "build_engine", "build_server", "main", "parse_buckets", "warmup_engine"]


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
        default=None,
        help="verification-length policy: plain | fixed:G | threshold:C | greedy | dspark "
        "(default: dspark with --drafter, plain without)",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine shape: slots, cache length, token buckets, SPS table, drafter suspension."""
    p.add_argument("--num-slots", type=int, default=8, help="decode slots = requests decoded together (default 8)")
    p.add_argument(
        "--cache-len",
        type=int,
        default=1024,
        help="KV-cache length per slot = the context length (prompt + generated tokens; default 1024)",
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
        default=16,
        help="consecutive non-drafting steps after which plain steps stop updating the drafter's "
        "context (caught up when drafting resumes; -1: never suspend; default 16)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=256,
        metavar="N",
        help="batched, chunked prefill: each engine iteration runs one compiled prefill pass of at most N "
        "prompt tokens, packing several waiting prompts and splitting a long one into chunks that "
        "interleave with decode steps, so a long prompt delays the streams by one chunk at a time "
        "(0: one-shot prefill, one request at a time; default 256)",
    )
    p.add_argument(
        "--plan-ahead",
        action="store_true",
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
        default="coupled",
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
    from dspark_jax.decoding.cli import add_attention_argument, add_dtype_argument

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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_engine(
    target,
    drafter=None,
    *,
    policy: str | None = None,
    num_slots: int = 8,
    cache_len: int = 1024,
    buckets: Sequence[int] | None = None,
    sps_table: Any = None,
    warmup: bool = True,
    eos_token_ids: Sequence[int] | None = None,
    plan_ahead: bool = False,
    **engine_kwargs,
):
    """Builds (and warms up) a :class:`dspark_jax.serving.engine.Engine`.

    Args:
      policy: ``plain | fixed:G | threshold:C | greedy | dspark``; ``None`` = ``dspark``
        with a drafter, ``plain`` without.
      sps_table: the SPS table (a ``CostTable``), or a JSON path: loaded when it exists (the
        engine reuses it only if it was measured for this device, model and shape), and after
        warm-up the table in use (loaded or freshly profiled) is written there.
      eos_token_ids: default: the target's EOS ids.
      plan_ahead: plan speculative steps before the step in flight is read
        (:attr:`~dspark_jax.serving.engine.planner.Planner.speculative_ahead`; default off).
    Raises:
      DSparkInputError: bad slot count / cache length, or a speculative policy without a drafter.
    """
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.engine import Engine

    check_engine_shape(num_slots, cache_len)
    policy = policy or ("dspark" if drafter is not None else "plain")
    if policy != "plain" and drafter is None:
        raise DSparkInputError(f"policy {policy!r} needs a drafter (--drafter EXPORT_DIR); use --policy plain")
    kw: dict[str, Any] = dict(
        num_slots=num_slots,
        cache_len=cache_len,
        policy=policy,
        eos_token_ids=tuple(eos_token_ids if eos_token_ids is not None else target.cfg.eos_ids),
    )
    if buckets is not None:
        kw["buckets"] = tuple(buckets)
    table_path = Path(sps_table) if isinstance(sps_table, (str, Path)) else None
    if table_path is not None:
        if table_path.exists():
            kw["sps_table"] = table_path
    elif sps_table is not None:
        kw["sps_table"] = sps_table
    kw.update(engine_kwargs)
    engine = Engine(target, drafter if policy != "plain" else None, **kw)
    engine.planner.speculative_ahead = bool(plan_ahead)
    if warmup:
        warmup_engine(engine, sps_table)
    return engine


def warmup_engine(engine, sps_table: Any = None) -> None:
    """Compiles every shape of ``engine`` (and profiles its SPS table); when ``sps_table`` is
    a path, writes the table in use there."""
    engine.warmup()
    if isinstance(sps_table, (str, Path)) and engine.sps_table is not None:
        path = Path(sps_table)
        path.parent.mkdir(parents=True, exist_ok=True)
        engine.sps_table.save(path)


def build_server(
    engine,
    tokenizer,
    *,
    model_name: str,
    max_queue: int = 256,
    default_max_tokens: int | None = None,
    chat_template: str | None = None,
    policy: str = "",
    api_key: str | None = None,
    api_key_health_metrics: bool = False,
    max_request_bytes: int | None = None,
):
    """``(app, engine_loop)``: the FastAPI app around an engine (the loop starts with the app).

    ``default_max_tokens`` None: vLLM's defaults (16 for completions, the rest of the
    context for chat). ``api_key``, ``max_request_bytes`` (None: derived from the context, 0: no
    limit): see :class:`dspark_jax.serving.http.server.ServerConfig`.
    """
    from dspark_jax.serving.http.server import EngineLoop, ServerConfig, create_app

    loop = EngineLoop(engine, tokenizer, max_queue=max_queue, model_name=model_name)
    tcfg = engine.target.cfg
    cfg = ServerConfig(
        model_name=model_name,
        context_len=int(min(engine.cache_len, tcfg.max_position)),
        vocab_size=int(tcfg.vocab_size),
        default_max_tokens=default_max_tokens,
        chat_template=chat_template,
        policy=policy,
        api_key=api_key or None,
        auth_health_metrics=bool(api_key_health_metrics),
        max_logit_bias=int(getattr(engine, "max_logit_bias", 1024)),
        max_request_bytes=max_request_bytes,
    )
    return create_app(loop, tokenizer, cfg), loop


class ServerThread:
    """Runs an app with uvicorn in a background thread (benchmarks, tests).

    ``with ServerThread(app) as s: httpx.get(s.url + "/health")``; leaving the block
    shuts uvicorn down (graceful drain, then the app's lifespan stops the engine loop).
    ``port=0`` picks a free port.
    """

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", graceful_timeout: float = 10.0
    ):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        # log_config=None: uvicorn's own config would bind handlers to the sys.stderr of the
        # moment (a test's capture buffer, closed later); the caller's logging setup applies.
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level=log_level,
                timeout_graceful_shutdown=graceful_timeout,  # pyright: ignore[reportArgumentType]  # seconds, float
                access_log=False,
                lifespan="on",
                log_config=None,
            )
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name="uvicorn"
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(args: argparse.Namespace) -> None:
    import uvicorn

    jax_cache = disk_cache.apply_cache_arguments(args)

    from dspark_jax.api import load_target
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
    engine = build_engine(
        target,
        drafter,
        policy=policy,
        num_slots=args.num_slots,
        cache_len=args.cache_len,
        buckets=parse_buckets(args.buckets),
        sps_table=args.sps_table,
        warmup=False,
        suspend_after=None if args.suspend_after == -1 else args.suspend_after,
        verification=args.verification,
        mesh=mesh,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        profile_spans=parse_buckets(args.profile_spans, "--profile-spans"),
        plan_ahead=args.plan_ahead,
    )
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
