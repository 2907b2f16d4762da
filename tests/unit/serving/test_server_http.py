"""The HTTP server's own behaviour over a fake engine (:mod:`dspark_jax.serving.engine.fake`): no JAX
compilation, so these run in seconds. Validation (every unhonoured field refused, every wrong
JSON type refused, NaN/inf refused), model names (404), ``n`` > 1, ``stream_options``, ``max_tokens`` defaults, API
keys, logprobs / logit_bias / min_tokens plumbing, UTF-8-safe detokenization at every cut,
stop strings, one tau definition (a stop inside an accepted block), queue limits,
disconnects and metrics. ``tests/integration/test_server.py`` checks the real engine end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_jax.serving.engine.fake import FakeEngine
from tests.helpers.server import CACHE_LEN, CHAT_TEMPLATE, NUM_SLOTS, metric, wait_idle
from tests.helpers.server import serve_fake as _serve

CAT = [234, 143, 174]  # tok512's byte tokens of U+732B (cat), 3 UTF-8 bytes


@pytest.fixture(scope="module")
def tok(stories260k_dir):
    from dspark_jax.models.tokenizer import Llama2cTokenizer

    return Llama2cTokenizer.from_file(stories260k_dir / "tok512.bin")


@pytest.fixture(scope="module")
def server(tok):
    srv = _serve(tok)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _sse(lines) -> list:
    out = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def _stream(client, path, body) -> list:
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        return _sse(r.iter_lines())


# --------------------------------------------------------------------------- validation


def _declared(model) -> set[str]:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.text(min_size=1, max_size=24),
    value=st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3)),
)
def test_property_any_undeclared_field_is_refused(name, value):
    from pydantic import ValidationError

    from dspark_jax.serving.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

    base = {
        CompletionRequest: {"prompt": "hi"},
        ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
        ChatMessage: {"role": "user", "content": "hi"},
        StreamOptions: {},
    }
    for model, body in base.items():
        if name in _declared(model):
            continue
        with pytest.raises(ValidationError) as e:
            model.model_validate({**body, name: value})
        assert any(err["type"] == "extra_forbidden" and err["loc"][-1] == name for err in e.value.errors())


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "hi", "top_logprobs": 3}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "ignore_eos": True}, "ignore_eos"),
        ("/v1/completions", {"prompt": "hi", "user": "me"}, "user"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages.0.name"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
            "presence_penalty",
        ),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"512": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
        # issue 27: numbers the engine's arrays cannot hold (int32 / float32 / int64 token ids)
        ("/v1/completions", {"prompt": "The cat", "max_tokens": 8, "temperature": 1, "top_k": 2**31}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**70}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "top_k": 1e10}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "temperature": 1e39}, "temperature"),
        ("/v1/completions", {"prompt": [1, 2**70]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2**70]]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {str(2**70): 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10**400}}, "logit_bias.5"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 2**70}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**31}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**70}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 2**70}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**70)}, "seed"),
        ("/v1/completions", {"prompt": "hi", "n": 2**70}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2**70}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 1e300}, "presence_penalty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**70},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2**70},
            "top_logprobs",
        ),
    ],
)
def test_unhonoured_fields_get_400_naming_them(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert field.split(".")[-1] in err["message"], err


def _typed_fields(model, prefix: str = "") -> list[tuple[str, type]]:
    """``(JSON path, int | float | bool)`` of every integer, float and boolean field of a request
    model: its scalar fields, the items of its lists, the values of its maps and the fields of
    its nested models (``None`` alternatives ignored)."""
    import types
    import typing

    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        alts = [a for a in typing.get_args(field.annotation) or (field.annotation,) if a is not type(None)]
        if typing.get_origin(field.annotation) not in (typing.Union, types.UnionType):
            alts = [field.annotation]
        for a in alts:
            origin, args = typing.get_origin(a), typing.get_args(a)
            if a in (int, float, bool):
                out.append((prefix + name, a))
            elif origin is list and args[0] in (int, float, bool) and len(alts) == 1:
                out.append((f"{prefix}{name}.0", args[0]))
            elif origin is dict and args[1] in (int, float, bool):
                out.append((f"{prefix}{name}.5", args[1]))
            elif isinstance(a, type) and issubclass(a, BaseModel):
                out += _typed_fields(a, f"{prefix}{name}.")
    return out


def _strict_cases():
    from dspark_jax.serving.http.protocol import ChatCompletionRequest, CompletionRequest

    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        for field, kind in _typed_fields(model):
            yield pytest.param(path, field, kind, id=f"{'chat' if 'chat' in path else 'completions'}-{field}")


# A JSON value of each wrong type per expected type: booleans are not integers, numeric strings
# are not numbers, a fractional or float-spelled number is not an integer.
WRONG = {
    int: [True, False, "12", 1.5, 3.0, None, [1]],
    float: [True, "0.5", "1", None, {"x": 1}],
    bool: [1, 0, "true", "false", None],
}


def _with_value(field: str, value) -> dict:
    """A request body fragment setting the JSON path ``field`` (``a.b``, ``list.0``, ``map.5``)."""
    parts = field.split(".")
    if len(parts) == 1:
        return {field: value}
    head, key = parts
    return {head: [value] if key == "0" else {key: value}}


@pytest.mark.parametrize("path,field,kind", list(_strict_cases()))
def test_wrong_json_type_of_every_typed_field_gets_400_naming_it(server, client, path, field, kind):
    """One rule at the HTTP boundary: every integer, float and boolean field of both endpoints
    refuses a value of the wrong JSON type (``null`` too where the field is not nullable: those
    are skipped) with 400 naming the field, before anything is tokenized or queued."""
    from dspark_jax.serving.http.protocol import ChatCompletionRequest, CompletionRequest

    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    top = model.model_fields[field.split(".")[0]]
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    base.update(max_tokens=2, stream=field.startswith("stream_options"))
    n_before = len(server.engine.requests)
    for value in WRONG[kind]:
        if value is None and "." not in field and top.default is None:
            continue  # a nullable field: null means "not given"
        body = dict(base, **_with_value(field, value))
        r = client.post(path, json=body)
        assert r.status_code == 400, (field, value, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == field, (field, value, err)
        assert field in err["message"] and "JSON" in err["message"], err
    assert len(server.engine.requests) == n_before  # nothing reached the engine


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": 1, "top_p": 1, "presence_penalty": 0}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}, "frequency_penalty": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_p": 1}),
    ],
)
def test_integers_are_numbers(client, path, body):
    """OpenAI's ``number`` fields take integers (JSON has one number type)."""
    r = client.post(path, json=dict(body, max_tokens=2))
    assert r.status_code == 200, r.text


def test_prompt_token_ids_are_integers(client):
    """A prompt's alternatives (text, ids, a batch of either) are one field: 400 naming ``prompt``."""
    for prompt in ([True, 5], [[5, True]], [5, "6"], [5, 6.0], True, 5):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    assert client.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 2}).status_code == 200


def test_typed_fields_cover_both_endpoints():
    """The walk over the request models finds every typed field (a new field is tested without
    being listed here)."""
    from dspark_jax.serving.http.protocol import ChatCompletionRequest, CompletionRequest

    comp, chat = (dict(_typed_fields(m)) for m in (CompletionRequest, ChatCompletionRequest))
    common = {"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "min_tokens", "stream", "return_token_ids"}
    common |= {"presence_penalty", "frequency_penalty", "stop_token_ids.0", "logit_bias.5"}
    common |= {"stream_options.include_usage"}
    assert common | {"logprobs", "echo", "best_of"} <= comp.keys() and comp["logprobs"] is int
    assert common | {"logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt"} <= chat.keys()
    assert chat["logprobs"] is bool and comp["temperature"] is float


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "   "}, "empty"),
        ({"prompt": []}, "empty"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "seed": 2**31}, "seed"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "stop_token_ids": [100000]}, "stop_token_ids"),
        ({"prompt": [5, 100000]}, "vocabulary"),
        ({"prompt": "word " * 200}, "context"),
        ({"prompt": "hi", "max_tokens": CACHE_LEN}, "context"),
        ({"max_tokens": 5}, "prompt"),
    ],
)
def test_invalid_completion_requests_get_400(client, body, needle):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"] + str(err["param"])


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_inf_sampling_values_get_400(client, field, value):
    for path, body in (
        ("/v1/completions", '{"prompt": "hi", "%s": %s}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "%s": %s}'),
    ):
        r = client.post(path, content=(body % (field, value)).encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, field, value, r.text)
        assert r.json()["error"]["param"] == field
    r = client.post(
        "/v1/completions",
        content=b'{"prompt": "hi", "logit_bias": {"5": NaN}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_invalid_bodies_get_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for body in (
        {"messages": []},
        {"messages": [{"role": "user", "content": ""}]},
        {"messages": "hi"},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "hi", "stream": True, "temperature": -1})
    assert r.status_code == 400  # validated before any event is streamed
    assert client.get("/health").json()["status"] == "ok"


def test_model_names(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"] and models["data"][0]["max_model_len"] == CACHE_LEN
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        r = client.post(path, json=dict(body, model="gpt-4"))
        assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "NotFoundError"
        assert client.post(path, json=dict(body, model="fake-model")).status_code == 200
        assert client.post(path, json=body).status_code == 200  # omitted: the served model


def test_chat_completion_uses_template(client, tok):
    msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat and a dog"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    rendered = "system: Tell a story.\nuser: A cat and a dog\nassistant:"
    assert body["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_bos=False))
    # the same rendered prompt through /v1/completions gives the same answer
    r2 = client.post(
        "/v1/completions",
        json={"prompt": tok.encode(rendered, add_bos=False), "max_tokens": 10, "temperature": 0},
    )
    assert r2.json()["choices"][0]["text"] == msg["content"]


def test_streaming_sse_format(client):
    req = {
        "prompt": "Tom and Lily went to the park",
        "max_tokens": 20,
        "temperature": 0.8,
        "seed": 7,
        "stop": ["park."],
        "return_token_ids": True,
    }
    full = client.post("/v1/completions", json=req).json()
    with client.stream(
        "POST", "/v1/completions", json=dict(req, stream=True, stream_options={"include_usage": True})
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert finals[0]["spec_decode"]["num_steps"] >= 1
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [i for c in chunks if c["choices"] for i in c["choices"][0].get("token_ids", [])]
    assert text == full["choices"][0]["text"] and ids == full["choices"][0]["token_ids"]

    events = _stream(
        client,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0},
    )
    assert events[-1] == "[DONE]"
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-2]
    assert sum(len(e["choices"][0]["delta"].get("content") or "") for e in events[:-1]) > 0


def test_stop_token_ids_end_the_request_and_free_the_slot(client):
    base = {"prompt": [31, 32, 33], "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    free = client.post("/v1/completions", json=base).json()["choices"][0]
    sid = free["token_ids"][5]
    r = client.post("/v1/completions", json=dict(base, stop_token_ids=[sid])).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == free["token_ids"][: free["token_ids"].index(sid) + 1]
    assert wait_idle(client)["free_slots"] == NUM_SLOTS


# --------------------------------------------------------------------------- defaults, n, streaming options


def test_max_tokens_defaults_are_vllms(server, client):
    r = client.post("/v1/completions", json={"prompt": "Once upon a time"}).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == CACHE_LEN  # the rest of the context
    ids = list(range(5, 5 + CACHE_LEN - 4))  # room for 4: the completions default is capped to it
    assert client.post("/v1/completions", json={"prompt": ids}).json()["usage"]["completion_tokens"] == 4


def test_n_choices_are_the_same_request_with_seed_plus_i(client):
    for path, base in (
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = dict(base, max_tokens=9, temperature=0.8, seed=2**31 - 2, return_token_ids=True)
        r = client.post(path, json=dict(body, n=3)).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2]
        singles = [client.post(path, json=dict(body, seed=s)).json() for s in (2**31 - 2, 2**31 - 1, -(2**31))]
        for c, one in zip(r["choices"], singles):
            assert c["token_ids"] == one["choices"][0]["token_ids"]
            assert c.get("text", c.get("message")) == one["choices"][0].get("text", one["choices"][0].get("message"))
        assert len({tuple(c["token_ids"]) for c in r["choices"]}) == 3
        assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
        assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
        # streamed: every choice's chunks carry its index and add up to the same text
        events = _stream(client, path, dict(body, n=3))
        assert events[-1] == "[DONE]"
        for c in r["choices"]:
            chunks = [e["choices"][0] for e in events[:-1] if e["choices"] and e["choices"][0]["index"] == c["index"]]
            ids = [i for ch in chunks for i in ch.get("token_ids", [])]
            assert ids == c["token_ids"]
            if path == "/v1/completions":
                assert "".join(ch["text"] for ch in chunks) == c["text"]
            else:
                assert "".join(ch["delta"].get("content") or "" for ch in chunks) == c["message"]["content"]
            assert [ch["finish_reason"] for ch in chunks if ch["finish_reason"]] == [c["finish_reason"]]


def test_stream_options_include_usage(client):
    body = {"prompt": "Once upon a time", "max_tokens": 7, "temperature": 0}
    plain = _stream(client, "/v1/completions", body)
    assert all("usage" not in e for e in plain[:-1])  # no include_usage: no usage anywhere
    events = _stream(client, "/v1/completions", dict(body, stream_options={"include_usage": True}))
    chunks = events[:-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    assert last["usage"] == client.post("/v1/completions", json=body).json()["usage"]
    assert last["spec_decode"]["num_steps"] >= 1
    chat = _stream(
        client,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream_options": {"include_usage": False}},
    )
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and all("usage" not in e for e in chat[:-1])
    assert chat[-2]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- API key


def test_api_key(tok):
    for protect in (False, True):
        srv = _serve(tok, api_key="s3cret", auth_health_metrics=protect)
        try:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                body = {"prompt": "hi", "max_tokens": 2}
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    r = c.post("/v1/completions", json=body, headers=headers)
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
                    assert c.get("/v1/models", headers=headers).status_code == 401
                ok = {"Authorization": "Bearer s3cret"}
                assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
                assert c.get("/v1/models", headers=ok).status_code == 200
                for path in ("/health", "/metrics"):
                    assert c.get(path).status_code == (401 if protect else 200)
                    assert c.get(path, headers=ok).status_code == 200
        finally:
            srv.stop()


# --------------------------------------------------------------------------- sampling parameters reach the engine


def test_logit_bias_logprobs_min_tokens_reach_the_engine(server, client):
    eng = server.engine
    ids = [5, 6, 7, 8]
    free = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    ).json()["choices"][0]["token_ids"]
    third = free[2]
    r = client.post(
        "/v1/completions",
        json={
            "prompt": ids,
            "max_tokens": 6,
            "temperature": 0,
            "return_token_ids": True,
            "logit_bias": {str(third): -100},
        },
    ).json()
    assert r["choices"][0]["token_ids"][:2] == free[:2] and r["choices"][0]["token_ids"][2] != third
    assert eng.requests[-1].params.logit_bias == ((third, -100.0),)
    # completions logprobs: n alternatives per token, aligned with the text
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert eng.requests[-1].params.logprobs == 2
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    # chat: logprobs bool + top_logprobs
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
    ).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert eng.requests[-1].params.logprobs == 3 and len(content) == 4
    assert all(len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode()) for c in content)
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "logprobs": True}).json()
    assert eng.requests[-1].params.logprobs == 0 and all(
        c["top_logprobs"] == [] for c in r["choices"][0]["logprobs"]["content"]
    )
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}).json()
    assert eng.requests[-1].params.logprobs is None and r["choices"][0]["logprobs"] is None
    # streamed logprobs add up to the same
    events = _stream(client, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 2})
    toks = [
        t
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["logprobs"]
        for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert toks == lp["tokens"]
    # min_tokens: EOS cannot end the request before it
    eng.scripts[(9, 9, 9)] = [40, 41, 2, 42, 43, 44, 45]
    r = client.post("/v1/completions", json={"prompt": [9, 9, 9], "max_tokens": 6, "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] == [40, 41, 2] and r["choices"][0]["finish_reason"] == "stop"
    r = client.post(
        "/v1/completions", json={"prompt": [9, 9, 9], "max_tokens": 6, "min_tokens": 4, "return_token_ids": True}
    ).json()
    assert eng.requests[-1].params.min_tokens == 4 and 2 not in r["choices"][0]["token_ids"][:4]


# --------------------------------------------------------------------------- detokenization, stop strings, tau


def test_no_half_character_at_any_cut(server, client, tok):
    from dspark_jax.models.tokenizer import decode_complete

    prompt = [7, 7, 7]
    script = [280, 294, 410] + CAT + [433, 261] + CAT + CAT + [334]
    server.engine.scripts[tuple(prompt)] = script
    chat_prompt = tok.encode(
        CHAT_TEMPLATE.replace(
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
            "user: x\nassistant:",
        ),
        add_bos=False,
    )
    server.engine.scripts[tuple(chat_prompt)] = script
    full = tok.decode(script, skip_special_tokens=True)
    assert "\ufffd" not in full and full.count("\u732b") == 3
    for k in range(1, len(script) + 1):
        want = decode_complete(tok, script[:k])
        assert "\ufffd" not in want and full.startswith(want)
        body = {"prompt": prompt, "max_tokens": k, "return_token_ids": True}
        r = client.post("/v1/completions", json=body).json()["choices"][0]
        assert r["token_ids"] == script[:k] and r["text"] == want, (k, r)
        events = _stream(client, "/v1/completions", body)
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want
        chat = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": k}
        ).json()["choices"][0]["message"]["content"]
        assert chat == want
    # a stop string made of a split character and a cut right after the stop
    r = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stop": ["\u732b"], "return_token_ids": True}
    ).json()["choices"][0]
    assert r["text"] == full[: full.index("\u732b")] and r["token_ids"] == script[:6] and r["finish_reason"] == "stop"


def test_detokenization_is_incremental(server, client, tok, monkeypatch):
    """No re-decoding of the output: the server never decodes more than one id at a time
    (the llama2.c detokenizer works on piece bytes; only logprob token strings decode one id)."""
    sizes = []
    real = type(tok).decode

    def counting(self, ids, skip_special_tokens=False):
        sizes.append(len(ids))
        return real(self, ids, skip_special_tokens)

    monkeypatch.setattr(type(tok), "decode", counting)
    r = client.post(
        "/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 100, "stop": ["zzzz"], "logprobs": 1}
    ).json()
    assert r["usage"]["completion_tokens"] == 100 and sizes and max(sizes) == 1


def test_stop_string_matching(server, client, tok):
    ids = [11, 12, 13]
    free = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 30, "temperature": 0, "return_token_ids": True}
    ).json()["choices"][0]
    text = free["text"]
    needle = text[10:14]
    r = client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 30, "temperature": 0, "stop": [needle, "zzzz"], "return_token_ids": True},
    ).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == text[: text.index(needle)]
    n = len(r["token_ids"])  # the shortest token prefix whose text contains the stop string
    assert r["token_ids"] == free["token_ids"][:n]
    assert needle in tok.decode(free["token_ids"][:n]) and needle not in tok.decode(free["token_ids"][: n - 1])
    events = _stream(
        client,
        "/v1/completions",
        {"prompt": ids, "max_tokens": 30, "temperature": 0, "stop": [needle], "return_token_ids": True},
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == r["text"]
    # min_tokens holds back stop strings too (as vLLM)
    late = client.post(
        "/v1/completions",
        json={
            "prompt": ids,
            "max_tokens": 30,
            "temperature": 0,
            "stop": [needle],
            "min_tokens": n + 1,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert len(late["token_ids"]) > n
    assert wait_idle(client)["free_slots"] == NUM_SLOTS


def test_tau_with_a_stop_inside_an_accepted_block(server, client, tok):
    """Blocks: prefill token, then 3 tokens (2 accepted drafts + bonus), 1, 2. A stop after the
    first accepted draft of the first block: 2 tokens, 1 pass, 1 accepted of 1 verified (the
    draft after the stop is not counted), tau = (2 - 1) / 1 = 1.0, not 1 + accepted/steps = 2."""
    prompt = [21, 22, 23]
    script = [280, 294, 410, 265, 344, 264, 426, 300, 301]
    server.engine.scripts[tuple(prompt)] = script
    before = client.get("/metrics").text
    bodies = []
    stop_text = tok.decode(script[1:2])
    for extra in ({"stop": [stop_text]}, {"stop_token_ids": [script[1]]}):  # a stop string, then a stop token
        r = client.post("/v1/completions", json=dict(extra, prompt=prompt, max_tokens=9, return_token_ids=True)).json()
        assert r["choices"][0]["token_ids"] == script[:2], r
        sd = r["spec_decode"]
        assert (sd["num_steps"], sd["num_draft_tokens"], sd["num_accepted_tokens"]) == (1, 1, 1), sd
        assert sd["tau"] == pytest.approx((r["usage"]["completion_tokens"] - 1) / sd["num_steps"]) == 1.0
        bodies.append(r)
    full = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 9}).json()["spec_decode"]
    # 9 tokens: prefill + 3 + 1 + 2 + 3 -> 4 passes, 8 pass tokens, accepted 2 + 0 + 1 + 2
    assert (full["num_steps"], full["num_accepted_tokens"], full["tau"]) == (4, 5, 2.0)
    bodies.append({"spec_decode": full})
    wait_idle(client)
    after = client.get("/metrics").text

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("dspark:spec_decode_num_rounds_total") == sum(b["spec_decode"]["num_steps"] for b in bodies) == 6
    assert delta("dspark:spec_decode_num_emitted_tokens_total") == 1 + 1 + 8
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == 1 + 1 + 5
    tau_all = metric(after, "dspark:spec_decode_mean_accepted_length")
    assert tau_all == pytest.approx(
        metric(after, "dspark:spec_decode_num_emitted_tokens_total")
        / metric(after, "dspark:spec_decode_num_rounds_total")
    )


# --------------------------------------------------------------------------- load, disconnects, metrics


def test_queue_full_gets_429(tok):
    srv = _serve(
        tok, FakeEngine(vocab_size=tok.vocab_size, num_slots=1, cache_len=CACHE_LEN, step_delay=0.02), max_queue=1
    )
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                return await asyncio.gather(
                    *(
                        c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 20})
                        for _ in range(8)
                    )
                )

        rs = asyncio.run(burst())
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
        err = next(r for r in rs if r.status_code == 429).json()["error"]
        assert err["type"] == "rate_limit_error" and "queue is full" in err["message"]
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert metric(c.get("/metrics").text, "dspark:request_rejected_total", status="429") >= codes.count(429)
            assert wait_idle(c)["free_slots"] == 1
            # idle: the free slot and the queue's place take n=2; n=3 can never fit (400, not 429)
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2}).status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            # n choices are admitted all or none: with the slot busy only the queue's place is left
            with _busy(c, 1):
                r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
                assert r.status_code == 429 and "1 of 1 slots busy" in r.json()["error"]["message"], r.text
            assert wait_idle(c)["free_slots"] == 1
    finally:
        srv.stop()


@contextlib.contextmanager
def _busy(client, n: int):
    """Holds ``n`` long streamed requests, each in a slot (its first chunk arrived; about 60
    engine steps are left, over a second with a 0.02 s fake step); the streams are closed (so
    aborted) on exit."""
    lines = []  # the line iterators: one dropped would close its stream
    with contextlib.ExitStack() as stack:
        for _ in range(n):
            body = {"prompt": "Once upon a time", "max_tokens": CACHE_LEN - 8, "stream": True}
            r = stack.enter_context(client.stream("POST", "/v1/completions", json=body))
            lines.append(r.iter_lines())
            assert r.status_code == 200 and next(lines[-1]).startswith("data: ")
        yield


def test_max_queue_zero_admits_while_slots_are_free(tok):
    """Issue 27: ``max_queue=0`` means no waiting queue, not "refuse everything": requests (and
    the n choices of one) are admitted while slots are free, refused with 429 naming the real
    number of busy slots when none is; more choices than slots + queue is a 400."""
    engine = FakeEngine(vocab_size=tok.vocab_size, num_slots=2, cache_len=CACHE_LEN, step_delay=0.02)
    srv = _serve(tok, engine, max_queue=0)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").json()["free_slots"] == 2
            one = {"prompt": "The cat", "max_tokens": 4}
            assert c.post("/v1/completions", json=one).status_code == 200
            assert c.post("/v1/completions", json=dict(one, n=2)).status_code == 200
            r = c.post("/v1/completions", json=dict(one, n=3))
            assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "3 choices" in r.text, r.text
            with _busy(c, 1):  # one slot left
                assert c.post("/v1/completions", json=one).status_code == 200
                r = c.post("/v1/completions", json=dict(one, n=2))
                assert r.status_code == 429 and "1 of 2 slots busy" in r.json()["error"]["message"], r.text
            with _busy(c, 2):
                r = c.post("/v1/completions", json=one)
                err = r.json()["error"]
                assert r.status_code == 429 and err["type"] == "rate_limit_error", r.text
                assert "0 requests waiting" in err["message"] and "2 of 2 slots busy" in err["message"], err
            assert wait_idle(c)["free_slots"] == 2
            assert c.post("/v1/completions", json=one).status_code == 200
        srv.loop.max_queue = 2  # changed at run time: 2 slots + 2 places
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/completions", json=dict(one, n=3)).status_code == 200  # idle: fits
            assert c.post("/v1/completions", json=dict(one, n=4)).status_code == 200
            assert c.post("/v1/completions", json=dict(one, n=5)).status_code == 400
    finally:
        srv.stop()


def test_client_disconnect_frees_slot(tok):
    srv = _serve(tok, FakeEngine(vocab_size=tok.vocab_size, num_slots=2, cache_len=CACHE_LEN, step_delay=0.01))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            long = {"prompt": "Once upon a time", "max_tokens": CACHE_LEN - 8}
            before = metric(client.get("/metrics").text, "dspark:request_aborted_total")
            with client.stream("POST", "/v1/completions", json=dict(long, stream=True)) as r:  # hang up mid-stream
                got = [line for _, line in zip(range(3), r.iter_lines())]
                assert got[0].startswith("data: ")
            h = wait_idle(client)
            assert h["running"] == 0 and h["free_slots"] == 2
            mid = metric(client.get("/metrics").text, "dspark:request_aborted_total")
            assert mid == before + 1
            with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client times out and closes
                httpx.post(srv.url + "/v1/completions", json=dict(long, n=2), timeout=httpx.Timeout(30, read=0.05))
            h = wait_idle(client)
            assert h["running"] == 0 and h["free_slots"] == 2
            assert metric(client.get("/metrics").text, "dspark:request_aborted_total") == mid + 2
            assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
    finally:
        srv.stop()


def test_metrics_count_requests_and_spec_decode(client):
    before = client.get("/metrics").text
    bodies = [
        client.post("/v1/completions", json={"prompt": p, "max_tokens": 12}).json()
        for p in ("Once upon a time", "The dog ran")
    ]
    wait_idle(client)
    after = client.get("/metrics").text
    for name in (
        "dspark:num_requests_running",
        "dspark:num_requests_waiting",
        "dspark:time_to_first_token_seconds_bucket",
        "dspark:time_per_output_token_seconds_bucket",
        "dspark:e2e_request_latency_seconds_count",
        "dspark:request_success_total",
        "dspark:generation_tokens_total",
        "dspark:prompt_tokens_total",
        "dspark:spec_decode_mean_accepted_length",
        "dspark:spec_decode_acceptance_rate",
    ):
        assert name in after, name

    def delta(name, **kw):
        return metric(after, name, **kw) - metric(before, name, **kw)

    assert delta("dspark:request_success_total", finished_reason="length") == 2
    assert delta("dspark:generation_tokens_total") == 24
    assert delta("dspark:time_to_first_token_seconds_count") == 2
    for key, name in (
        ("num_draft_tokens", "dspark:spec_decode_num_draft_tokens_total"),
        ("num_accepted_tokens", "dspark:spec_decode_num_accepted_tokens_total"),
        ("num_steps", "dspark:spec_decode_num_rounds_total"),
    ):
        assert delta(name) == sum(b["spec_decode"][key] for b in bodies), name
    assert metric(after, "dspark:num_free_slots") == NUM_SLOTS
