"""OpenAI response formatting of the HTTP server: logprobs objects, the non-streamed response
body, and the server-sent-event chunk stream (``stream: true``).

A stream is ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``. Per choice: (chat) a
first chunk with the role, content chunks, one chunk with its ``finish_reason`` (and its
``spec_decode``). With ``stream_options.include_usage`` every chunk has ``usage: null`` and a
last chunk has ``choices: []`` and the usage of the whole request (and its ``spec_decode``),
as OpenAI and vLLM do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from dspark_jax.serving.http.detokenize import OutputState, Update, spec_total, usage
from dspark_jax.serving.http.engine_loop import EngineLoop, RequestEvent

__all__ = ["LogprobFormatter", "StreamContext", "finite_lp", "response_body", "sse_stream", "zip_lps"]


def finite_lp(x: float) -> float:
    """JSON has no -inf: clamp as vLLM does."""
    x = float(x)
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def zip_lps(ids: list[int], lps: list | None) -> list | None:
    """``[(token id, (logprob, top))]`` of a choice's tokens, or None without logprobs."""
    return None if lps is None else list(zip(ids, lps))


class LogprobFormatter:
    """OpenAI logprobs objects; each token's text is decoded once (cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def token_str(self, i: int) -> str:
        """The text of token ``i`` alone (special tokens included)."""
        s = self._pieces.get(i)
        if s is None:
            s = self._pieces[i] = self.tokenizer.decode([int(i)], skip_special_tokens=False)
        return s

    def _chat(self, lps: list) -> dict:
        content = []
        for tid, (lp, top) in lps:
            t = self.token_str(tid)
            alts = [
                {"token": self.token_str(a), "logprob": finite_lp(b), "bytes": list(self.token_str(a).encode("utf-8"))}
                for a, b in top
            ]
            content.append(
                {"token": t, "logprob": finite_lp(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": alts}
            )
        return {"content": content}

    def __call__(self, chat: bool, lps: list | None, offset: int) -> tuple[dict | None, int]:
        """OpenAI's logprobs object for some tokens (``zip_lps``), and the text offset after
        them (completions' ``text_offset``)."""
        if lps is None:
            return None, offset
        if chat:
            return self._chat(lps), offset
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, (lp, top) in lps:
            t = self.token_str(tid)
            tokens.append(t)
            token_lps.append(finite_lp(lp))
            tops.append({self.token_str(a): finite_lp(b) for a, b in top})
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


@dataclasses.dataclass
class StreamContext:
    """What every chunk of one response repeats, and the request's output options."""

    rid: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool
    logprobs: bool
    include_usage: bool

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def response_body(ctx: StreamContext, n_prompt: int, states: list[OutputState], fmt: LogprobFormatter) -> dict:
    """The non-streamed response of finished choices."""
    choices = []
    for st in states:
        choice: dict[str, Any] = {
            "index": st.index,
            "finish_reason": st.finish_reason,
            "logprobs": fmt(ctx.chat, zip_lps(st.token_ids, st.logprobs), 0)[0],
        }
        if ctx.chat:
            choice["message"] = {"role": "assistant", "content": st.text}
        else:
            choice["text"] = st.text
        if ctx.return_token_ids:
            choice["token_ids"] = st.token_ids
        choices.append(choice)
    return {
        "id": ctx.rid,
        "object": "chat.completion" if ctx.chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(n_prompt, states),
        "spec_decode": spec_total(states),
    }


def _chunk(
    ctx: StreamContext,
    index: int,
    text: str | None,
    finish: str | None,
    ids: list[int] | None = None,
    lps=None,
    first: bool = False,
    extra: dict | None = None,
) -> str:
    """One ``data:`` line of choice ``index``."""
    if ctx.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": lps, "finish_reason": finish}
    if ctx.return_token_ids and ids is not None:
        choice["token_ids"] = ids
    body: dict[str, Any] = {"id": ctx.rid, "object": ctx.object, "created": ctx.created, "model": ctx.model}
    body["choices"] = [choice]
    if ctx.include_usage:
        body["usage"] = None
    if extra:
        body.update(extra)
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_chunk(ev: RequestEvent) -> str:
    kind = "server_error" if ev.status >= 500 else "invalid_request_error"
    err = {"error": {"message": ev.message, "type": kind, "param": None, "code": ev.status}}
    return f"data: {json.dumps(err)}\n\n"


def _usage_chunk(ctx: StreamContext, states: list[OutputState]) -> str:
    n_prompt = len(states[0].tracked.request.prompt_ids)
    body = {
        "id": ctx.rid,
        "object": ctx.object,
        "created": ctx.created,
        "model": ctx.model,
        "choices": [],
        "usage": usage(n_prompt, states),
        "spec_decode": spec_total(states),
    }
    return f"data: {json.dumps(body)}\n\n"


def _update_chunks(ctx: StreamContext, st: OutputState, up: Update, offsets: list[int], fmt: LogprobFormatter):
    """The chunks of one applied event: its text / ids / logprobs, then the finish chunk."""
    lps = None
    if ctx.logprobs and up.token_ids:
        lps, offsets[st.index] = fmt(ctx.chat, zip_lps(up.token_ids, up.logprobs), offsets[st.index])
    if up.text or (up.token_ids and (ctx.return_token_ids or ctx.logprobs)):
        yield _chunk(ctx, st.index, up.text, None, up.token_ids, lps)
    if up.finish_reason is not None:
        ids = [] if ctx.return_token_ids else None
        text = None if ctx.chat else ""
        yield _chunk(ctx, st.index, text, up.finish_reason, ids, extra={"spec_decode": st.spec_decode()})


async def sse_stream(
    states: list[OutputState],
    queue: asyncio.Queue,
    watcher: asyncio.Task,
    loop: EngineLoop,
    ctx: StreamContext,
    apply: Callable[[OutputState, RequestEvent], Update],
    fmt: LogprobFormatter,
) -> AsyncIterator[str]:
    """The OpenAI chunk stream of one request's choices (see the module docstring).

    ``apply`` feeds an event to its choice (and records it when it finishes); ``watcher`` is
    the disconnect watcher, cancelled at the end. Choices still running when the stream ends
    (the client went away) are aborted.
    """
    offsets = [0] * len(states)
    try:
        if ctx.chat:
            for st in states:
                yield _chunk(ctx, st.index, "", None, first=True)
        while any(st.finish_reason is None for st in states):
            ev = await queue.get()
            st = states[ev.index]
            if st.finish_reason is not None:
                continue
            if ev.kind == "error":
                yield _error_chunk(ev)
                break
            if ev.finish_reason == "abort":
                return
            for chunk in _update_chunks(ctx, st, apply(st, ev), offsets, fmt):
                yield chunk
        else:
            if ctx.include_usage:
                yield _usage_chunk(ctx, states)
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        for st in states:
            if not st.tracked.done and st.finish_reason is None:
                loop.abort(st.tracked.request_id)
