"""The HTTP server (``dspark_jax.serving.http.server``) over the real engine, through real HTTP.

One engine for the module (compilation dominates the run time): stories260K target, a
randomly initialised drafter (block of 2), the deployed ``dspark`` scheduler, 2 slots, a
64-token context. :class:`TestHTTP` serves it with uvicorn in a thread (behind an API
key) and drives it with httpx and with the official ``openai`` client: greedy requests
are checked token for token against plain autoregressive decoding, sampled requests sent
concurrently against the same requests sent alone, logprobs and logit_bias through the
engine. The quick load benchmark then reconfigures the same engine for each policy (no
step recompiles: the drafter's block size makes ``fixed:2`` reuse the scheduler's
buckets). HTTP-only behaviour (validation, auth, model names, n, stream options,
defaults, detokenization, tau accounting, queue limits, disconnects) is tested over a fake
engine in ``tests/unit/serving/test_server_http.py``, without compiling anything.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from tests.helpers.env import MODELS_DIR
from tests.helpers.server import metric, stories260k_drafter_meta, wait_idle

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
NUM_SLOTS, CACHE_LEN, GAMMA = 2, 64, 2
API_KEY = "test-key"


@pytest.fixture(scope="module")
def models(stories260k_dir):
    os.environ.setdefault("DSPARK_MODELS", str(MODELS_DIR))
    from flax import nnx

    from dspark_jax.api import load_target
    from dspark_jax.config import DrafterConfig
    from dspark_jax.drafters.dspark import DSparkDrafter

    target, tok = load_target("stories260k")
    drafter = DSparkDrafter(
        DrafterConfig.for_target(target.cfg, block_size=GAMMA, num_layers=1, markov_rank=8), nnx.Rngs(0)
    )
    return target, tok, drafter


@pytest.fixture(scope="module")
def engine(models):
    from dspark_jax.serving.build import build_engine
    from dspark_jax.serving.engine import EngineConfig

    target, _, drafter = models
    # Few compiled shapes (compilation is most of this module's time; each costs ~7 s on 2
    # cores): every step runs both rows, every prompt pads to 64 tokens, the token budgets
    # are the plain step (2) and the full block (2 x 3), which fixed:2 and plain reuse, and
    # prefill is one-shot (chunked prefill through HTTP: tests/unit/test_prefill.py).
    config = EngineConfig(
        num_slots=NUM_SLOTS,
        cache_len=CACHE_LEN,
        policy="dspark",
        row_buckets=(NUM_SLOTS,),
        prefill_buckets=(CACHE_LEN,),
        buckets=(NUM_SLOTS * (GAMMA + 1),),
        prefill_chunk_tokens=0,
    )
    return build_engine(target, drafter, config)


@pytest.fixture(scope="class")
def server(models, engine):
    from dspark_jax.serving.build import build_server
    from dspark_jax.serving.http.thread import ServerThread

    target, tok, _ = models
    app, loop = build_server(
        engine,
        tok,
        model_name="stories260k",
        max_queue=64,
        chat_template=CHAT_TEMPLATE,
        policy="dspark",
        api_key=API_KEY,
    )
    with ServerThread(app) as srv:
        srv.loop, srv.tok, srv.target = loop, tok, target
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def _sse_events(lines) -> list:
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _mixed_requests() -> list[dict]:
    """Six completions: greedy and seeded sampled (top-k, top-p), streamed and not, one with a stop string."""
    prompts = [
        "Once upon a time",
        "The cat sat on the mat",
        "Tom and Lily",
        "One day, a bird",
        "Sam had a red ball",
        "The sun was hot",
    ]
    return [
        {
            "prompt": p,
            "max_tokens": 8 + 6 * i,
            "temperature": [0.0, 0.7, 1.0, 1.3][i % 4],
            "top_k": [0, 20, 0, 5][i % 4],
            "top_p": [1.0, 1.0, 0.9, 0.8][i % 4],
            "seed": 100 + i,
            "return_token_ids": True,
            "stream": i % 2 == 1,
            **({"stop": ["."]} if i == 3 else {}),
        }
        for i, p in enumerate(prompts)
    ]


def _send_together(server, reqs: list[dict]) -> list[tuple]:
    """Sends ``reqs`` concurrently; each one's ``(token_ids, text, finish_reason)``."""

    async def one(c, body):
        if not body["stream"]:
            ch = (await c.post("/v1/completions", json=body)).json()["choices"][0]
            return ch["token_ids"], ch["text"], ch["finish_reason"]
        ids, text, fin = [], "", None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    ids += ch.get("token_ids", [])
                    text += ch["text"]
                    fin = ch["finish_reason"] or fin
        return ids, text, fin

    async def together():
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as c:
            return await asyncio.gather(*(one(c, b) for b in reqs))

    return asyncio.run(together())


class TestHTTP:
    """Everything through HTTP against one running server."""

    # --------------------------------------------------------------------------- completions

    def test_completion_greedy_matches_plain_decoding(self, server, client):
        from dspark_jax.decoding.speculative import generate_autoregressive

        prompt = "Once upon a time"
        r = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "stories260k"
        ch = body["choices"][0]
        ids = server.tok.encode(prompt)
        ref = generate_autoregressive(server.target, [ids], max_new_tokens=24, temperature=0.0).generations[0]
        assert ch["token_ids"] == ref.token_ids and ch["finish_reason"] == "length"
        assert ch["text"] == server.tok.decode(ref.token_ids, skip_special_tokens=True)
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24, "total_tokens": len(ids) + 24}
        sd = body["spec_decode"]
        # tau: tokens per verification pass, the prefill token excluded (decode.Generation.tau)
        assert 1 <= sd["num_steps"] <= 23 and sd["tau"] == pytest.approx(23 / sd["num_steps"])
        assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"] <= GAMMA * sd["num_steps"]
        if sd["num_draft_tokens"]:
            assert sd["acceptance_rate"] == pytest.approx(sd["num_accepted_tokens"] / sd["num_draft_tokens"])
        # vLLM's default max_tokens (16) applies when none is given; token ids work as a prompt too
        r2 = client.post("/v1/completions", json={"prompt": ids, "temperature": 0})
        assert r2.status_code == 200 and r2.json()["usage"]["completion_tokens"] == 16
        assert r2.json()["choices"][0]["text"] == server.tok.decode(ref.token_ids[:16], skip_special_tokens=True)

    def test_concurrent_seeded_requests_equal_alone(self, server, client):
        reqs = _mixed_requests()
        concurrent = _send_together(server, reqs)
        alone = []
        for b in reqs:
            ch = client.post("/v1/completions", json=dict(b, stream=False)).json()["choices"][0]
            alone.append((ch["token_ids"], ch["text"], ch["finish_reason"]))
        assert concurrent == alone
        assert len({tuple(a[0]) for a in alone}) == len(alone)
        assert wait_idle(client)["free_slots"] == NUM_SLOTS

    def test_planned_ahead_requests_equal_alone(self, server, client, engine, monkeypatch):
        """``--plan-ahead`` (``EngineConfig(plan_ahead=True)``): speculative steps dispatched before
        the step in flight is read, through HTTP, give every request the tokens it gets alone."""
        from dspark_jax.serving.engine.inflight import InflightStep

        reqs = _mixed_requests()
        alone = [client.post("/v1/completions", json=dict(b, stream=False)).json()["choices"][0] for b in reqs]
        alone = [(ch["token_ids"], ch["text"], ch["finish_reason"]) for ch in alone]
        wait_idle(client)
        queued = []
        read = InflightStep.read

        def recording_read(step, slots):
            queued.append(engine._inflight is not None and step.bucket[1] > step.bucket[0])
            return read(step, slots)

        monkeypatch.setattr(InflightStep, "read", recording_read)
        monkeypatch.setattr(engine.planner, "speculative_ahead", True)  # engine.plan_ahead, undone after
        engine.set_policy("fixed:2")  # drafting never suspended: every speculative step may go ahead
        try:
            assert _send_together(server, reqs) == alone
        finally:
            engine.set_policy("dspark")
        assert sum(queued) >= 5  # speculative steps found their successor already dispatched
        assert wait_idle(client)["free_slots"] == NUM_SLOTS

    def test_bad_numbers_get_400_and_leave_the_others_alone(self, server, client):
        """Issue 27 through the real engine: numbers it cannot hold get a 400 naming the field,
        sent concurrently with good requests that come back exactly as when sent alone (a top_k
        beyond int32 used to fail the whole prefill pass with 500s); T = 2e-38 decodes as T = 0
        (it used to emit token 0)."""
        good = [
            {"prompt": p, "max_tokens": 8, "temperature": t, "seed": 5, "return_token_ids": True}
            for p, t in (("The cat", 1.0), ("Once upon a time", 0.0), ("Tom and Lily", 0.8))
        ]
        bad = [
            (dict(good[0], top_k=2**31), "top_k"),
            (dict(good[0], prompt=[1, 2**70]), "prompt"),
            (dict(good[0], temperature=1e39), "temperature"),
        ]
        bodies = [good[0], bad[0][0], good[1], bad[1][0], good[2], bad[2][0]]

        async def together():
            async with httpx.AsyncClient(
                base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
            ) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

        rs = asyncio.run(together())
        for r, (_, field) in zip(rs[1::2], bad):
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert all(r.status_code == 200 for r in rs[::2]), [r.text for r in rs]
        alone = [client.post("/v1/completions", json=b).json()["choices"][0]["token_ids"] for b in good]
        assert [r.json()["choices"][0]["token_ids"] for r in rs[::2]] == alone
        for b in good:
            tiny = client.post("/v1/completions", json=dict(b, temperature=2e-38)).json()["choices"][0]
            zero = client.post("/v1/completions", json=dict(b, temperature=0)).json()["choices"][0]
            assert tiny["token_ids"] == zero["token_ids"] and tiny["text"] == zero["text"] != ""
        assert wait_idle(client)["free_slots"] == NUM_SLOTS

    def test_openai_client(self, server, client):
        """The official ``openai`` client: completions and chat, streamed and not, logprobs,
        logit_bias, n, errors; and the engine's counters agree with the responses."""
        import openai

        before = client.get("/metrics").text
        oc = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in oc.models.list()] == ["stories260k"]
        prompt = "Once upon a time"
        server.tok.encode(prompt)
        ref = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        ).json()["choices"][0]
        # completions, greedy, with logprobs: the greedy token is the most likely one (raw logprobs)
        c = oc.completions.create(model="stories260k", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
        ch = c.choices[0]
        assert ch.text == ref["text"] and ch.finish_reason == "length" and c.usage.completion_tokens == 12
        lp = ch.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)
        # logit_bias -100 on the third greedy token changes the third token, and only from there
        third = ref["token_ids"][2]
        b = oc.completions.create(
            model="stories260k",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logit_bias={str(third): -100},
            extra_body={"return_token_ids": True},
        )
        got = b.choices[0].model_extra["token_ids"]
        assert got[:2] == ref["token_ids"][:2] and got[2] != third and third not in got
        # streamed completions add up to the same text
        text = "".join(
            e.choices[0].text
            for e in oc.completions.create(
                model="stories260k", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            if e.choices
        )
        assert text == ref["text"]
        # chat, not streamed and streamed (usage chunk), with logprobs
        msgs = [{"role": "user", "content": "A cat and a dog"}]
        r = oc.chat.completions.create(
            model="stories260k", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 8
        assert all(
            len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
            for t in content
        )
        events = list(
            oc.chat.completions.create(
                model="stories260k",
                messages=msgs,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == r.choices[0].message.content
        assert events[-1].choices == [] and events[-1].usage.completion_tokens == 8
        assert all(e.usage is None for e in events[:-1])
        # n = 2: choice 1 is the request with seed + 1
        two = oc.completions.create(model="stories260k", prompt=prompt, max_tokens=10, temperature=1.0, seed=5, n=2)
        one = oc.completions.create(model="stories260k", prompt=prompt, max_tokens=10, temperature=1.0, seed=6)
        assert two.choices[1].text == one.choices[0].text and two.usage.completion_tokens == 20
        # refusals the client maps to its exceptions
        with pytest.raises(openai.NotFoundError):
            oc.completions.create(model="gpt-4", prompt=prompt, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="response_format"):
            oc.chat.completions.create(
                model="stories260k", messages=msgs, max_tokens=2, response_format={"type": "json_object"}
            )
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            oc.chat.completions.create(model="stories260k", messages=msgs, max_tokens=2, top_logprobs=2)
        # the engine's own counters agree with the per-request counts (no stop strings here)
        assert wait_idle(client)["free_slots"] == NUM_SLOTS
        after = client.get("/metrics").text

        def delta(name):
            return metric(after, name) - metric(before, name)

        assert delta("dspark:spec_decode_num_accepted_tokens_per_pos_total") == delta(
            "dspark:spec_decode_num_accepted_tokens_total"
        )
        assert delta("dspark:spec_decode_num_rounds_total") == delta("dspark:engine_rounds_total")


# --------------------------------------------------------------------------- CLI and benchmark


def test_serve_cli_rejects_speculative_policy_without_drafter(capsys):
    from dspark_jax.commands.serve import main

    assert main(["--target", "stories260k", "--policy", "dspark"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_serve_dry_run_refuses_a_drafter_for_another_target(tmp_path, smollm2_gguf, capsys):
    """The stories260K drafter with the SmolLM2 target: ``serve --dry-run`` exits 2 with the line
    ``serve``, ``generate`` and the API give (reading only the GGUF header and the drafter's
    metadata)."""
    from dspark_jax.commands.serve import main

    export = stories260k_drafter_meta(tmp_path / "export")
    assert main(["--target", "smollm2-135m-instruct", "--drafter", str(export), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "error: drafter was trained for a vocabulary of 512 tokens but the target has 49152"
    assert not out


@pytest.mark.parametrize(
    "config,flags,line",
    [
        ({"vocab_size": 49152}, [], "drafter was trained for a vocabulary of 49152 tokens but the target has 512"),
        ({"hidden_size": 32}, [], "drafter expects target hidden size 32 but the target has 64"),
        ({"taps": [0, 7], "target_num_layers": 8}, [], "drafter taps layers [0, 7] of a 8-layer target but the"),
        ({"taps": [0, 7]}, [], "/drafter.json has an invalid config: tap layer 7 out of range for a 5-layer target"),
        ({}, ["--policy", "fixed:4"], "policy 'fixed:4': G must be in [1, 3] for this drafter"),
        ({"variant": "eagle3"}, [], "the serving engine cannot serve a eagle3 drafter"),
        ({}, ["--max-request-bytes", "-1"], "--max-request-bytes must be >= 0 (0: no limit)"),
    ],
)
def test_serve_dry_run_and_start_refuse_alike(tmp_path, capsys, config, flags, line):
    """``serve --dry-run`` runs the real start's checks: each refusal is the same ``error:`` line,
    exit status 2, from both (the start refuses before it loads the drafter or compiles)."""
    from dspark_jax.commands.serve import main

    export = stories260k_drafter_meta(tmp_path / "export", **config)
    argv = ["--target", "stories260k", "--drafter", str(export), "--num-slots", "1", "--cache-len", "32", *flags]
    errs = []
    for dry in (["--dry-run"], []):
        assert main(argv + dry) == 2
        out, err = capsys.readouterr()
        errs.append(err.strip().splitlines()[-1])
        assert not out
    assert errs[0] == errs[1] and errs[0].startswith("error: ") and line in errs[0], errs


def test_build_engine_plans_ahead_only_when_asked(models):
    from dspark_jax.serving.build import build_engine
    from dspark_jax.serving.engine import EngineConfig

    target, _, drafter = models
    for ahead in (False, True):
        config = EngineConfig(num_slots=1, cache_len=32, policy="fixed:2", plan_ahead=ahead)
        eng = build_engine(target, drafter, config, warmup=False)
        assert eng.planner.speculative_ahead is ahead and eng.plan_ahead is ahead


def _benchmark(name: str):
    """Imports ``benchmarks.<name>``."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.slow
def test_serve_load_quick_writes_table_json_png(models, engine, tmp_path, capsys):
    serve_load = _benchmark("serve_load")
    args = serve_load.build_parser().parse_args(
        [
            "--quick",
            "--policies",
            "plain,fixed:2,fixed:2+ahead,dspark",
            "--concurrency",
            "1,2",
            "--num-requests",
            "2",
            "--max-tokens",
            "6",
            "--num-slots",
            str(NUM_SLOTS),
            "--cache-len",
            str(CACHE_LEN),
            "--out",
            str(tmp_path),
        ]
    )
    serve_load.apply_quick(args)
    compiles = engine.metrics()["compiles"]
    try:
        res = serve_load.sweep(args, models=models, engine=engine, plain_engine=engine)
    finally:
        engine.planner.speculative_ahead = False  # the +ahead arm's setting stays with the shared engine
    assert engine.metrics()["compiles"] == compiles  # reconfigured, not recompiled
    out = capsys.readouterr().out
    assert "| policy | concurrency | output tok/s |" in out and "| dspark | 2 |" in out
    assert json.loads((tmp_path / "serve_load.json").read_text()) == json.loads(json.dumps(res))
    assert res["policies"] == ["plain", "fixed:2", "fixed:2+ahead", "dspark"] and res["concurrency"] == [1, 2]
    for p in res["policies"]:
        for row in res["runs"][p]:
            assert row["num_ok"] == 2 and row["output_tokens"] == 12 and row["output_tok_s"] > 0, (p, row)
            assert row["best_fixed"] in ("fixed:2", "fixed:2+ahead") and row["per_user_tok_s"] > 0
    assert res["runs"]["plain"][0]["output_tok_s_vs_plain"] == pytest.approx(1.0)
    best = res["runs"]["fixed:2"][1]["best_fixed"]
    assert res["runs"][best][1]["output_tok_s_vs_best_fixed"] == pytest.approx(1.0)
    assert res["runs"]["plain"][0]["acceptance_rate"] is None  # plain decoding verifies no drafts
    assert (tmp_path / "serve_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "sps_table.json").exists()


@pytest.mark.slow
def test_serve_load_stress_small(models, engine, tmp_path):
    serve_load = _benchmark("serve_load")
    args = serve_load.build_parser().parse_args(
        [
            "--stress",
            "--target",
            "stories260k",
            "--stress-requests",
            "30",
            "--stress-concurrency",
            "6",
            "--disconnect-frac",
            "0.3",
            "--max-tokens",
            "24",
            "--num-slots",
            str(NUM_SLOTS),
            "--cache-len",
            str(CACHE_LEN),
            "--out",
            str(tmp_path),
        ]
    )
    rep = serve_load.stress(args, models=models, engine=engine)
    assert rep["passed"], rep
    assert rep["completed"] + rep["client_disconnects"] == 30 and rep["client_disconnects"] >= 3
    assert rep["identical_to_alone"] == rep["completed"] and not rep["slot_leak"]
    assert json.loads((tmp_path / "stress.json").read_text())["passed"]


@pytest.mark.slow
def test_engine_overhead_benchmark_writes_ratios(stories260k_dir, tmp_path, capsys):
    engine_overhead = _benchmark("engine_overhead")
    assert (
        engine_overhead.main(
            [
                "--target",
                "stories260k",
                "--random-drafter",
                "2",
                "--rows",
                "1,2",
                "--num-slots",
                "2",
                "--cache-len",
                "64",
                "--prompt-len",
                "20",
                "--reps",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "engine_overhead.json").read_text())["results"]
    assert [r["case"] for r in res] == [
        "step with drafter upkeep, 1 rows",
        "step with drafter upkeep, 2 rows",
        "step, drafter suspended, 1 rows",
        "step, drafter suspended, 2 rows",
        "prefill, 20 tokens",
        "prefill, drafter suspended, 20 tokens",
        "catch-up pass (3 tokens/row), 1 rows",
        "catch-up pass (3 tokens/row), 2 rows",
        "step + drafting a block, 1 rows",
        "step + drafting a block, 2 rows",
    ]
    assert all(r["plain_ms"] > 0 and r["drafter_engine_ms"] > 0 and r["ratio"] > 0 for r in res)
    assert "| step, drafter suspended, 2 rows |" in capsys.readouterr().out
