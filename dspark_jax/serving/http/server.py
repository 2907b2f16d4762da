"""OpenAI-compatible HTTP server over the continuous-batching speculative engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and Prometheus ``GET /metrics``.

Architecture (docs/design.md#serving): one background thread, :class:`EngineLoop`
(:mod:`dspark_jax.serving.http.engine_loop`), owns the :class:`~dspark_jax.serving.engine.Engine` and is the
only thread that touches JAX. The asyncio side (this module) refuses a body over
``ServerConfig.max_request_bytes`` (413, before parsing), validates requests
(:mod:`dspark_jax.serving.http.protocol`), tokenizes them in a worker thread (a long prompt
takes seconds, and the event loop keeps serving ``/health`` and the other streams meanwhile;
chat: :mod:`dspark_jax.serving.http.chat`), enqueues them, and per choice detokenizes incrementally
and matches stop strings (:mod:`dspark_jax.serving.http.detokenize`), then formats responses and
streams (:mod:`dspark_jax.serving.http.streaming`). Metrics: :mod:`dspark_jax.serving.http.prometheus`.
Shutdown (uvicorn's graceful drain, then the app's lifespan end) stops the thread after failing
whatever is still queued with 503.

Requests: unhonoured fields get 400 naming them; a ``model`` other than the served name gets
404 (as vLLM); a request that does not fit in the free slots plus the free places of the
waiting queue 429 (``n`` choices are admitted all or none; more than the server can ever hold,
400). ``n`` > 1 runs ``n`` requests: choice ``i`` is exactly
what the same request with ``seed + i`` (wrapped into int32) returns as its only choice.
``logit_bias``, ``logprobs`` / ``top_logprobs`` and ``min_tokens`` are passed to the engine
(:class:`~dspark_jax.serving.engine.SamplingParams`); logprobs are the target's raw log-softmax
(vLLM's default). ``min_tokens`` also holds back stop strings until that many tokens were
generated (as vLLM).

Exactness: the engine's output for a request depends only on its prompt, sampling parameters
and seed, never on its batch-mates (batching never changes a response). A stop string ends the request at the
first token whose text completes an occurrence (the text is cut before it; the token is kept in
``token_ids``), so the response is the same whether the engine emitted those tokens in one step
or several.

Per-request speculative metrics are returned in a ``spec_decode`` object beside ``usage``:
``num_steps`` (target verification passes that gave the response at least one token),
``num_draft_tokens`` (draft tokens verified, none counted after a stop),
``num_accepted_tokens`` (accepted drafts in the response), ``acceptance_rate`` = accepted /
verified and ``tau`` = ``(completion_tokens - 1) / num_steps``: returned tokens per
verification pass, the first token (sampled at prefill) excluded. This is
:class:`dspark_jax.decoding.speculative.Generation`'s tau, the one definition (``generate
--json``, the Python API and ``/metrics``' ``dspark:spec_decode_mean_accepted_length`` use it
too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dspark_jax import __version__
from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine.requests import Request
from dspark_jax.serving.http.chat import ChatRenderer, chat_prompt
from dspark_jax.serving.http.detokenize import OutputState, Update
from dspark_jax.serving.http.engine_loop import (
    EngineLoop,
    QueueFullError,
    RequestEvent,
    ServerClosedError,
    TrackedRequest,
)
from dspark_jax.serving.http.prometheus import ServerMetrics
from dspark_jax.serving.http.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    ServerConfig,
    completion_prompt,
    sampling_params,
)
from dspark_jax.serving.http.streaming import LogprobFormatter, StreamContext, response_body, sse_stream

__all__ = ["EngineLoop", "ServerConfig", "create_app"]


def _error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}


def _json_kind(value) -> str:
    """The JSON type of a parsed JSON value, with the value (shortened) for the error message."""
    kind = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"JSON {kind.get(type(value), 'null')} {shown}"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of a request-body validation error (at most 4 problems named; a
    value of the wrong JSON type says which type was expected and which came). ``param``: the
    path the first problem's field shares with the others of that field (a union's
    alternatives are one field)."""
    parts, locs = [], []
    for e in exc.errors()[:4]:
        if e.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({e.get('ctx', {}).get('error', 'parse error')})")
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        if loc:
            locs.append(loc)
        if e.get("type") == "extra_forbidden":
            parts.append(f"{name}: unsupported parameter (this server does not honour it)")
        elif e.get("type") in _EXPECTED:
            parts.append(f"{name}: expected {_EXPECTED[e['type']]}, got {_json_kind(e.get('input'))}")
        else:
            parts.append(f"{name}: {e.get('msg', 'invalid')}")
    param = None
    if locs:
        same = [loc for loc in locs if loc[0] == locs[0][0]]
        common = same[0]
        for loc in same[1:]:
            n = next((i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))
            common = common[:n]
        param = ".".join(common)
    return "; ".join(parts) or "invalid request", param


def _install_auth(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
    """Every ``/v1`` route (and ``/health`` / ``/metrics`` with ``auth_health_metrics``) needs
    ``Authorization: Bearer <api_key>``; 401 otherwise."""
    expected = f"Bearer {config.api_key}".encode()
    protected_extra = ("/health", "/metrics") if config.auth_health_metrics else ()

    @app.middleware("http")
    async def _auth(request: HTTPRequest, call_next):
        path = request.url.path
        if request.method != "OPTIONS" and (path.startswith("/v1") or path in protected_extra):
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):
                metrics.request_rejected.labels(**metrics.labels(status="401")).inc()
                resp = _error_response(
                    401,
                    "Unauthorized: send the server's API key as 'Authorization: Bearer <key>'",
                    None,
                    "authentication_error",
                )
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        return await call_next(request)


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Validation errors and :class:`APIError` become OpenAI error bodies (counted by status)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: HTTPRequest, exc: RequestValidationError):
        message, param = _validation_message(exc)
        metrics.request_rejected.labels(**metrics.labels(status="400")).inc()
        return _error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(_req: HTTPRequest, exc: APIError):
        metrics.request_rejected.labels(**metrics.labels(status=str(exc.status))).inc()
        return _error_response(exc.status, exc.message, exc.param, exc.kind)


class _BodyLimit:
    """ASGI middleware: a ``POST`` body over ``limit`` bytes gets 413 before anything parses or
    tokenizes it (``Content-Length`` says so up front; a chunked body is counted as it comes).
    The body is read to its end either way, discarding what is over the limit, so the client
    gets the 413 rather than a reset connection; a body within the limit is handed on whole."""

    def __init__(self, app, limit: int, metrics: ServerMetrics):
        self.app, self.limit, self.metrics = app, int(limit), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        size, chunks, more = 0, [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away mid-body
                return
            body, more = msg.get("body", b""), msg.get("more_body", False)
            size += len(body)
            if size <= self.limit:
                chunks.append(body)
        if size > self.limit:
            self.metrics.request_rejected.labels(**self.metrics.labels(status="413")).inc()
            got = f"{int(declared)} bytes" if declared.isdigit() else f"more than {self.limit} bytes"
            resp = _error_response(
                413,
                f"the request body has {got}; this server takes at most {self.limit} (--max-request-bytes)",
                None,
            )
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the disconnect, when it comes

        return await self.app(scope, replay, send)


async def _watch_disconnect(http: HTTPRequest, tracked: list[TrackedRequest], loop: EngineLoop) -> None:
    """Waits for the client to go away, then aborts the request's choices (frees their slots)."""
    try:
        while True:
            msg = await http.receive()
            if msg["type"] == "http.disconnect":
                break
    except asyncio.CancelledError:
        return
    except Exception:
        pass
    for t in tracked:
        if not t.done:
            loop.abort(t.request_id)


class _Routes:
    """The route handlers of one app (see :func:`create_app`)."""

    def __init__(self, loop: EngineLoop, tokenizer, config: ServerConfig):
        self.loop, self.tokenizer, self.config = loop, tokenizer, config
        self.metrics = loop.metrics
        self.fmt = LogprobFormatter(tokenizer)
        self.chat = ChatRenderer(tokenizer, config.chat_template)

    async def health(self):
        snap = self.loop.snapshot()
        body = {k: snap[k] for k in ("num_slots", "running", "free_slots", "waiting", "steps")}
        body["status"] = "ok" if snap["alive"] else "stopped"
        body["policy"] = self.config.policy
        return JSONResponse(body, status_code=200 if snap["alive"] else 503)

    async def prometheus_metrics(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        name = self.config.model_name
        card = {"id": name, "object": "model", "created": 0, "owned_by": "dspark_jax", "root": name}
        return {"object": "list", "data": [dict(card, parent=None, max_model_len=self.config.context_len)]}

    async def completions(self, req: CompletionRequest, http: HTTPRequest):
        self._check_model(req)
        # tokenizing is CPU-bound (seconds for a long prompt): a worker thread, so /health and the
        # other requests' streams keep going meanwhile
        ids = await asyncio.to_thread(completion_prompt, req, self.tokenizer, self.config)
        return await self._run(http, ids, req, req.max_tokens, chat=False)

    async def chat_completions(self, req: ChatCompletionRequest, http: HTTPRequest):
        self._check_model(req)
        ids = await asyncio.to_thread(chat_prompt, req, self.chat, self.config)
        return await self._run(http, ids, req, req.max_completion_tokens or req.max_tokens, chat=True)

    def _check_model(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.config.model_name:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist (this server serves `{self.config.model_name}`).",
                "model",
                "NotFoundError",
            )

    def _finish_metrics(self, st: OutputState) -> None:
        m = self.metrics
        m.request_success.labels(**m.labels(finished_reason=st.finish_reason)).inc()
        m.generation_tokens.labels(**m.labels()).inc(len(st.token_ids))
        arrival = st.tracked.arrival
        now = st.finished_at or time.monotonic()
        m.e2e.labels(**m.labels()).observe(now - arrival)
        if st.first_token_at is not None:
            m.ttft.labels(**m.labels()).observe(st.first_token_at - arrival)
            if len(st.token_ids) > 1:
                m.tpot.labels(**m.labels()).observe((now - st.first_token_at) / (len(st.token_ids) - 1))
        m.add_spec(st.num_steps, st.num_emitted, st.num_verified, st.num_accepted)

    def _apply(self, st: OutputState, ev: RequestEvent) -> Update:
        """Feeds ``ev`` to its choice; a finished choice is counted (and, ended by a stop string
        while the engine still generates for it, aborted)."""
        up = st.feed(ev)
        if up.finish_reason is not None:
            if not st.tracked.done:  # a stop string: the engine is still generating for it
                self.loop.abort(st.tracked.request_id, count=False)
            self._finish_metrics(st)
        return up

    def _submit(self, ids: list[int], req: SamplingRequest, params: list, stop: tuple[str, ...], chat: bool):
        """Queues one engine request per choice: ``(request id, tracked, states, queue)``."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        tracked = [
            TrackedRequest(
                request=Request(prompt_ids=ids, params=p, request_id=rid if len(params) == 1 else f"{rid}-{i}"),
                loop=aloop,
                queue=queue,
                index=i,
            )
            for i, p in enumerate(params)
        ]
        states = [OutputState(t, self.tokenizer, stop, req.min_tokens) for t in tracked]
        try:
            self.loop.submit(*tracked)
        except DSparkInputError as e:  # more choices than the server can ever hold at once
            raise APIError(400, str(e), "n") from None
        except QueueFullError as e:
            raise APIError(429, str(e), None, "rate_limit_error") from None
        except ServerClosedError as e:
            raise APIError(503, str(e), None, "server_error") from None
        return rid, tracked, states, queue

    async def _collect(self, tracked, states: list[OutputState], queue: asyncio.Queue, watcher) -> bool:
        """Feeds events until every choice finished; False when the client went away."""
        try:
            while any(st.finish_reason is None for st in states):
                ev = await queue.get()
                st = states[ev.index]
                if st.finish_reason is not None:
                    continue  # the engine's answer to our stop-string abort
                if ev.kind == "error":
                    kind = "invalid_request_error" if ev.status == 400 else "server_error"
                    raise APIError(ev.status, ev.message, None, kind)
                if ev.finish_reason == "abort":  # the client is gone; nobody reads this
                    return False
                self._apply(st, ev)
        finally:
            watcher.cancel()
            for t, st in zip(tracked, states):
                if not t.done and st.finish_reason is None:
                    self.loop.abort(t.request_id, count=False)
        return True

    async def _run(self, http: HTTPRequest, ids: list[int], req: SamplingRequest, max_tokens: int | None, chat: bool):
        params, stop, n_lp = sampling_params(req, len(ids), max_tokens, chat, self.config)
        rid, tracked, states, queue = self._submit(ids, req, params, stop, chat)
        watcher = asyncio.create_task(_watch_disconnect(http, tracked, self.loop))
        ctx = StreamContext(
            rid,
            int(time.time()),
            self.config.model_name,
            chat,
            req.return_token_ids,
            n_lp is not None,
            bool(req.stream_options and req.stream_options.include_usage),
        )
        if req.stream:
            return StreamingResponse(
                sse_stream(states, queue, watcher, self.loop, ctx, self._apply, self.fmt),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )
        if not await self._collect(tracked, states, queue, watcher):
            return _error_response(499, "client disconnected")
        return response_body(ctx, len(ids), states, self.fmt)


def create_app(loop: EngineLoop, tokenizer, config: ServerConfig) -> FastAPI:
    """Builds the FastAPI app around a started-or-not :class:`EngineLoop`.

    The app's lifespan starts the loop (if needed) and stops it at shutdown. The loop's engine
    is any :class:`~dspark_jax.serving.engine.interface.EngineInterface` (the engine, or
    :class:`~dspark_jax.serving.engine.fake.FakeEngine`); requests reach it as
    :class:`~dspark_jax.serving.engine.requests.Request` s.
    """
    routes = _Routes(loop, tokenizer, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="dspark_jax", version=__version__, lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.config = config
    if config.request_byte_limit is not None:  # inside the API-key check (added later: outer)
        app.add_middleware(_BodyLimit, limit=config.request_byte_limit, metrics=loop.metrics)
    if config.api_key:
        _install_auth(app, config, loop.metrics)
    _install_error_handlers(app, loop.metrics)
    app.get("/health")(routes.health)
    app.get("/metrics")(routes.prometheus_metrics)
    app.get("/v1/models")(routes.models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    return app
