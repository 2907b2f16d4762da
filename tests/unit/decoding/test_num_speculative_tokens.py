"""``num_speculative_tokens`` has one spelling and one meaning: an int in ``[1, block_size]`` or
``"auto"``, resolved for a drafter by the decoding front door only
(:func:`~dspark_jax.decoding.request.resolve_num_speculative_tokens`), once per call; None is no
value of it (it used to mean ``"auto"`` at the front door and the block size below it)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from dspark_jax.decoding.request import DecodeRequest, decode, resolve_num_speculative_tokens
from dspark_jax.decoding.speculative import generate_speculative
from dspark_jax.decoding.validation import check_num_speculative_tokens
from dspark_jax.errors import DSparkInputError
from dspark_jax.evaluation.acceptance import evaluate_tau
from tests.unit.decoding.helpers import CHEAP, MAX_NEW, PROMPTS, SEEDS


def spy(monkeypatch, fn) -> list:
    """Counts the calls of ``fn`` through every ``dspark_jax`` module that holds it (by any import)."""
    calls: list = []

    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("dspark_jax") and getattr(mod, fn.__name__, None) is fn:
            monkeypatch.setattr(mod, fn.__name__, counted)
    return calls


def test_num_speculative_tokens_has_one_spelling():
    """The verification length is ``num_speculative_tokens`` only (the old ``gamma=`` alias is gone:
    ``gamma`` was also the block size); the CLIs' strings parse to the same values."""
    assert check_num_speculative_tokens(" 3", 4) == 3 and check_num_speculative_tokens("AUTO", 4) == "auto"
    assert DecodeRequest([1], num_speculative_tokens="Auto").num_speculative_tokens == "auto"
    assert DecodeRequest.field_defaults()["num_speculative_tokens"] == "auto"
    with pytest.raises(DSparkInputError, match="must be an integer or 'auto'"):
        check_num_speculative_tokens("three", 4)
    with pytest.raises(DSparkInputError, match="must be an integer or 'auto'"):
        check_num_speculative_tokens(2.5, 4)
    with pytest.raises(TypeError, match="gamma"):
        generate_speculative(None, None, [[1]], gamma=2)  # type: ignore[call-arg]


def test_none_is_refused_everywhere(peaked, drafters):
    """None has no meaning: the request, ``generate_speculative`` and ``evaluate_tau`` refuse it with
    one line (before anything compiles), and ``generate_speculative`` has no default to fall back on."""
    d = drafters["bigram"]
    match = r"num_speculative_tokens must be an integer in \[1, block size\] or 'auto', got None"
    with pytest.raises(DSparkInputError, match=match):
        DecodeRequest([1, 2], num_speculative_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(DSparkInputError, match=match):
        generate_speculative(peaked, d, [[1, 2]], num_speculative_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(DSparkInputError, match=match):
        evaluate_tau(peaked, d, [[1, 2]], num_speculative_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        generate_speculative(peaked, d, [[1, 2]])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="num_speculative_tokens"):
        evaluate_tau(peaked, d, [[1, 2]])  # type: ignore[call-arg]


def test_auto_resolves_by_drafter_kind(drafters):
    """``"auto"`` stays ``"auto"`` for a block drafter and is the block size for any other drafter
    (nothing to choose from); an int is checked against the block."""
    assert resolve_num_speculative_tokens(drafters["bigram"], "auto") == "auto"
    eagle_like = SimpleNamespace(cfg=SimpleNamespace(block_size=5))  # no blocks to read confidences from
    assert resolve_num_speculative_tokens(eagle_like, "auto") == 5
    assert resolve_num_speculative_tokens(eagle_like, 2) == 2
    with pytest.raises(DSparkInputError, match=r"must be in \[1, 5\]"):
        resolve_num_speculative_tokens(eagle_like, 6)


def test_the_front_door_resolves_and_prepares_once(peaked, drafters, monkeypatch):
    """A decode through the front door prepares the drafter once, resolves the verification length
    once (``"auto"`` included) and checks the sampling settings once per request (when the request
    is made), and reports the length it resolved."""
    from dspark_jax import api
    from dspark_jax.decoding import loop, request, speculative, validation
    from dspark_jax.drafters import base

    d = drafters["bigram"]
    prompt, kw = PROMPTS[8], dict(max_new_tokens=MAX_NEW[8], seed=SEEDS[8])
    prepared = spy(monkeypatch, base.prepare_drafter)
    resolved = spy(monkeypatch, request.resolve_num_speculative_tokens)
    sampling = spy(monkeypatch, validation.check_sampling)
    tok = SimpleNamespace(detokenizer=lambda skip_special_tokens=True: SimpleNamespace(extend=lambda ids: ""))
    out = api.generate_text(peaked, tok, prompt, drafter=d, num_speculative_tokens=2, **kw)
    assert (len(prepared), len(resolved), len(sampling)) == (1, 1, 1)
    assert out["num_target_passes"] > 0

    prepared.clear(), resolved.clear(), sampling.clear()
    ev = evaluate_tau(peaked, d, [prompt], num_speculative_tokens=" 2 ", **kw)  # the loop compiled above
    assert (len(prepared), len(resolved), len(sampling)) == (1, 1, 1)  # the one request made
    assert ev["num_speculative_tokens"] == 2 and len(ev["accept_rate_at_k"]) == 2
    assert ev["request_token_ids"] == [out["token_ids"]]

    # "auto": the loop gets the widths and costs once resolved (the compiled auto loop itself:
    # test_speculative_equals_plain.py)
    got = []
    monkeypatch.setattr(speculative, "run_speculative", lambda t, dr, bt, verify, **k: got.append(verify) or "ran")
    prepared.clear(), resolved.clear(), sampling.clear()
    req = DecodeRequest(prompt, num_speculative_tokens="auto", **kw)
    assert decode(peaked, d, [req], cost_table=CHEAP) == "ran"
    assert (len(prepared), len(resolved), len(sampling)) == (1, 1, 1)
    (verify,) = got
    assert isinstance(verify, loop.AutoWidths) and verify.widths == (0, 1, 2, 4)
