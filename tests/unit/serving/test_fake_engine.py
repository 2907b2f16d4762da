"""The fake engine shipped in the package (:mod:`dspark_jax.serving.engine.fake`) keeps the engine
contract (:class:`~dspark_jax.serving.engine.interface.EngineInterface`) and its output law, so that
server tests over it test the server; and the contract's one-shot prefill queue. No JAX work."""

from __future__ import annotations

import pytest

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.engine import Engine
from dspark_jax.serving.engine.fake import BLOCKS, FakeEngine
from dspark_jax.serving.engine.interface import EngineInterface, OneShotPrefill
from dspark_jax.serving.engine.requests import Request, SamplingParams


def _drain(eng: EngineInterface) -> dict[str, tuple[list[int], str | None, list[int]]]:
    """Runs the engine until idle: ``{request id: (tokens, finish reason, tokens per step)}``."""
    got: dict[str, tuple[list[int], str | None, list[int]]] = {}
    while eng.active_slots():
        for out in eng.generate():
            toks, _, sizes = got.get(out.request_id, ([], None, []))
            got[out.request_id] = (toks + out.token_ids, out.finish_reason, sizes + [len(out.token_ids)])
    return got


def test_both_engines_implement_the_contract():
    assert issubclass(Engine, EngineInterface) and isinstance(FakeEngine(), EngineInterface)
    with pytest.raises(TypeError):  # an engine missing a method of the contract cannot be made
        type("Partial", (EngineInterface,), {"prefill": lambda self, r: r})()


def test_fake_output_law():
    """Tokens are a function of prompt, seed and temperature, never of slot or batch-mates; they
    come in speculative-looking blocks (prefill token with the first); length and stop finish."""
    eng = FakeEngine(vocab_size=64, num_slots=2, cache_len=64)
    a = Request([5, 6, 7], SamplingParams(temperature=0.8, seed=3, max_new_tokens=9), "a")
    b = Request([5, 6, 7], SamplingParams(temperature=0.8, seed=4, max_new_tokens=9), "b")
    for r, slot in ((a, 1), (b, 0)):
        eng.insert(eng.prefill(r), slot)
    got = _drain(eng)
    alone = FakeEngine(vocab_size=64, num_slots=1, cache_len=64)
    alone.insert(alone.prefill(a), 0)
    assert _drain(alone)["a"] == got["a"] and got["a"][0] != got["b"][0]
    toks, reason, sizes = got["a"]
    assert len(toks) == 9 and reason == "length" and sizes[:3] == [1 + BLOCKS[0], BLOCKS[1], BLOCKS[2]]
    assert eng.free_slots() == [0, 1] and eng.metrics()["steps"] > 0
    eng.scripts[(9, 9)] = [4, 2, 8]  # 2 is the EOS id
    eng.insert(eng.prefill(Request([9, 9], SamplingParams(max_new_tokens=9), "s")), 0)
    assert _drain(eng)["s"][:2] == ([4, 2], "stop")
    eng.insert(eng.prefill(Request([9, 9], SamplingParams(max_new_tokens=9, min_tokens=3), "m")), 0)
    toks, reason, _ = _drain(eng)["m"]
    assert toks[:3] != [4, 2, 8] and 2 not in toks[:3]  # min_tokens masks EOS
    eng.insert(eng.prefill(Request([9, 9], SamplingParams(max_new_tokens=4, logit_bias=((11, 100.0),)), "f")), 0)
    assert _drain(eng)["f"][0] == [11] * 4


def test_fake_refuses_as_the_engine_does():
    eng = FakeEngine(num_slots=1, cache_len=8)
    for bad in (Request([], SamplingParams()), Request(list(range(3, 11)), SamplingParams())):
        with pytest.raises(DSparkInputError):
            eng.queue_prefill(bad, tag="x")
    eng.insert(eng.prefill(Request([3], SamplingParams(max_new_tokens=2))), 0)
    with pytest.raises(DSparkInputError, match="busy"):
        eng.insert(eng.prefill(Request([3], SamplingParams(max_new_tokens=2))), 0)


def test_prefill_queue_runs_one_shot_and_fails_one_request_alone():
    eng = FakeEngine(num_slots=4)
    assert not eng.supports_chunked_prefill()
    tags = [object() for _ in range(3)]
    for i, tag in enumerate(tags):
        eng.queue_prefill(Request([3 + i], SamplingParams(max_new_tokens=2), f"q{i}"), tag)
    eng.cancel_prefill(tags[1])
    done = eng.run_prefill()
    assert [t for t, _ in done] == [tags[0], tags[2]] and eng.run_prefill() == []
    assert [p.request.request_id for _, p in done] == ["q0", "q2"]

    def prefill(r):
        if r == "bad":
            raise RuntimeError("device lost")
        return f"prefix of {r}"

    queue = OneShotPrefill(prefill, lambda r: None)
    for r in ("a", "bad", "b"):
        queue.submit(r, tag=r)
    out = queue.step()
    assert [(t, p) for t, p in out if t != "bad"] == [("a", "prefix of a"), ("b", "prefix of b")]
    assert isinstance(dict(out)["bad"], RuntimeError) and len(queue) == 0
