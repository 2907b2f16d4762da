"""The HTTP server stays responsive and drops nothing, over a fake engine (:mod:`dspark_jax.serving.engine.fake`)
and the real stories260K tokenizer (a llama2.c BPE in pure Python: seconds for a 1,000,000-character
prompt): a body over ``max_request_bytes`` gets 413 before it is parsed or tokenized; a long prompt
is tokenized in a worker thread while ``/health`` and other requests' streams go on; chat roles
the template does not render are mapped (``developer`` -> ``system``) or refused, never dropped.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.helpers.server import CACHE_LEN, metric, serve_fake

BIG = 1_000_000  # characters
# Renders system / user / assistant only: any other role would vanish from the prompt.
SUA_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}[USER] {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}[BOT] {{ m['content'] }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[BOT]{% endif %}"
)


@pytest.fixture(scope="module")
def tok(stories260k_dir):
    from dspark_jax.models.tokenizer import Llama2cTokenizer

    return Llama2cTokenizer.from_file(stories260k_dir / "tok512.bin")


def _big_prompt() -> str:
    return ("Once upon a time there was a little cat. " * (BIG // 41 + 1))[:BIG]


class _Watched:
    """The real tokenizer, with the start and end of each long ``encode`` recorded (the work is
    the real tokenizer's, in whatever thread the server calls it)."""

    def __init__(self, tok):
        self.tok, self.started, self.finished = tok, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, add_bos=None):
        long = len(text) > 100_000
        if long:
            self.started.set()
        try:
            return self.tok.encode(text, add_bos)
        finally:
            if long:
                self.finished.set()


def _first_chunk_seconds(client, body) -> float:
    t0 = time.monotonic()
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        dt = next(time.monotonic() - t0 for line in lines if line.startswith("data: {"))
        for _ in lines:  # the rest of the stream
            pass
    return dt


def test_a_long_prompt_is_tokenized_off_the_event_loop(tok):
    """No body limit: a 1,000,000-character prompt is tokenized (seconds, by the real tokenizer)
    while ``/health`` answers in under 1 s and a small streamed request gets its first chunk before
    that tokenization ends; then it is refused for the context (400).

    The first chunk's seconds are printed, not bounded: this tokenizer is pure Python, so its worker
    thread shares the GIL with the engine's and the loop's, and with the suite's other workers on two
    cores the chunk took 2.3 s once (0.014 s on a quiet machine). With the default body limit the same
    prompt never reaches the tokenizer (413 in under 1 s, below)."""
    watched = _Watched(tok)
    srv = serve_fake(watched, max_request_bytes=0)
    try:
        big: dict = {}

        def send_big():
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                big["r"] = c.post("/v1/completions", json={"prompt": _big_prompt(), "max_tokens": 4})

        sender = threading.Thread(target=send_big)
        sender.start()
        assert watched.started.wait(30), "the long prompt never reached the tokenizer"
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            t0 = time.monotonic()
            assert c.get("/health").json()["status"] == "ok"
            health_s = time.monotonic() - t0
            first_s = _first_chunk_seconds(c, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            overlapped = not watched.finished.is_set()
        sender.join(120)
        print(f"while tokenizing {BIG:,} characters: /health {health_s:.3f} s, first chunk {first_s:.3f} s")
        assert health_s < 1.0, health_s
        assert overlapped, (
            f"the small request's first chunk ({first_s:.3f} s) came after the long prompt's tokenization"
        )
        r = big["r"]
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def limited(tok):
    srv = serve_fake(tok)  # the default limit: 64 bytes per token of the context + 64 KiB
    yield srv
    srv.stop()


def test_a_body_over_the_limit_gets_413_before_tokenizing(limited, tok):
    from dspark_jax.serving.http.protocol import default_max_request_bytes

    limit = default_max_request_bytes(CACHE_LEN)
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        before = metric(c.get("/metrics").text, "dspark:request_rejected_total", status="413")
        for path, body in (
            ("/v1/completions", {"prompt": _big_prompt(), "max_tokens": 4}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": _big_prompt()}], "max_tokens": 4}),
        ):
            t0 = time.monotonic()
            r = c.post(path, json=body)
            assert time.monotonic() - t0 < 1.0
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert f"at most {limit}" in err["message"] and "--max-request-bytes" in err["message"], err
            got = re.search(r"has (\d+) bytes", err["message"])  # the Content-Length it came with
            assert got and int(got.group(1)) > BIG, err

        # without Content-Length (chunked), counted as it arrives
        def chunks():
            data = json.dumps({"prompt": _big_prompt()}).encode()
            for i in range(0, len(data), 65536):
                yield data[i : i + 65536]

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and f"more than {limit} bytes" in r.json()["error"]["message"], r.text
        assert metric(c.get("/metrics").text, "dspark:request_rejected_total", status="413") == before + 3
        # a body just within the limit is parsed (and then refused for the context, 400)
        prompt = "a " * ((limit - 100) // 2)
        r = c.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
        # chunked and small: handed on whole
        small = json.dumps({"prompt": "Once upon a time", "max_tokens": 3}).encode()
        json_type = {"content-type": "application/json"}
        r = c.post("/v1/completions", content=iter([small[:10], small[10:]]), headers=json_type)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert c.get("/health").json()["status"] == "ok"


# --------------------------------------------------------------------------- chat roles


@pytest.fixture(scope="module")
def sua(tok):
    srv = serve_fake(tok, chat_template=SUA_TEMPLATE)
    yield srv
    srv.stop()


def _chat(client, msgs, **kw):
    return client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0, **kw})


def test_developer_reaches_a_system_user_assistant_template_as_system(sua, tok):
    with httpx.Client(base_url=sua.url, timeout=30) as c:
        dev = [{"role": "developer", "content": "Tell a sad story."}, {"role": "user", "content": "A cat"}]
        sys = [dict(dev[0], role="system"), dev[1]]
        r_dev, r_sys, r_user = _chat(c, dev), _chat(c, sys), _chat(c, dev[1:])
        assert r_dev.status_code == 200, r_dev.text
        rendered = "[SYS] Tell a sad story.\n[USER] A cat\n[BOT]"
        assert sua.engine.requests[-3].prompt_ids == tok.encode(rendered, add_bos=False)
        assert r_dev.json()["usage"] == r_sys.json()["usage"] != r_user.json()["usage"]
        assert r_dev.json()["choices"][0]["message"] == r_sys.json()["choices"][0]["message"]


def test_a_role_the_template_does_not_render_is_refused(tok):
    """Nothing is dropped silently: a role or position the template does not render is a 400
    naming the message (``developer`` first mapped to ``system``)."""
    from dspark_jax.serving.http.chat import ChatRenderer
    from dspark_jax.serving.http.protocol import APIError

    ua = SUA_TEMPLATE.replace("{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n{% elif", "{% if")
    first_system = (  # a system message only as the first message (as Llama 3's template reads it)
        "{% if messages[0]['role'] == 'system' %}[SYS] {{ messages[0]['content'] }}\n"
        "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
        "{% for m in rest %}{% if m['role'] in ['user', 'assistant'] %}[{{ m['role'] }}] {{ m['content'] }}\n"
        "{% endif %}{% endfor %}"
    )
    user = {"role": "user", "content": "A cat"}
    cases = [
        (ua, [{"role": "developer", "content": "Be brief."}, user], 0, "developer (given to the template as system)"),
        (ua, [{"role": "system", "content": "Be brief."}, user], 0, "system"),
        (SUA_TEMPLATE, [user, {"role": "assistant", "content": "Hi"}, user], None, None),
        (first_system, [{"role": "system", "content": "Be brief."}, user], None, None),
        (first_system, [user, {"role": "system", "content": "Be brief."}], 1, "system"),
        (first_system, [user, {"role": "developer", "content": "Be brief."}], 1, "developer (given"),
    ]
    for template, msgs, bad, needle in cases:
        renderer = ChatRenderer(tok, template)
        if bad is None:
            text = renderer.prompt_text(msgs, True)
            assert all(m["content"] in text for m in msgs), text
            continue
        with pytest.raises(APIError) as e:
            renderer.prompt_text(msgs, True)
        assert e.value.status == 400 and e.value.param == f"messages.{bad}.role", e.value.message
        assert f"messages[{bad}]" in e.value.message and needle in e.value.message, e.value.message
    # a template that knows developer keeps it; one that raises on it gets the fallback
    assert ChatRenderer(tok, "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% endfor %}").role_map() == {}
    raising = "{% for m in messages %}{% if m['role'] not in ['system', 'user'] %}{{ raise_exception('no') }}" + (
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert ChatRenderer(tok, raising).role_map() == {"developer": "system"}


def test_no_chat_template_names_the_flag(tok):
    """A chat request to a server whose tokenizer has no template (stories260K) is told how to give one."""
    from dspark_jax.errors import DSparkInputError
    from dspark_jax.serving.http.chat import ChatRenderer

    with pytest.raises(DSparkInputError, match=r"has no chat template: .*/v1/completions.*--chat-template FILE"):
        ChatRenderer(tok).render([{"role": "user", "content": "A cat"}], True)


def test_unknown_roles_get_400_over_http(sua):
    with httpx.Client(base_url=sua.url, timeout=30) as c:
        for role in ("wizard", "tool", "function"):
            r = _chat(c, [{"role": role, "content": "hi"}, {"role": "user", "content": "A cat"}])
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role", r.text
