"""The round's pieces (:mod:`dspark_jax.decoding.round`) and the loops' plumbing: host and device
emission agree, the compile cache is bounded and reused across max_new_tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.speculative import generate_autoregressive, generate_speculative


def test_round_emission_and_statistics_agree_on_host_and_device():
    """emit_counts / round_statistics give the same numbers with numpy (the serving engine's
    host read-backs) and jax.numpy (the decode loops), per-row stop ids and min_tokens
    (``stops_from``) included."""
    from dspark_jax.decoding.round import emit_counts, round_statistics

    rng = np.random.default_rng(0)
    b, g = 64, 4
    tokens = rng.integers(0, 6, (b, g + 1)).astype(np.int32)
    num_acc = rng.integers(0, g + 1, b).astype(np.int32)
    num_verify = np.maximum(num_acc, rng.integers(0, g + 1, b)).astype(np.int32)
    num_new = num_acc + 1
    tokens[np.arange(g + 1)[None, :] >= num_new[:, None]] = -1
    running = rng.random(b) < 0.9
    length = rng.integers(3, 10, b).astype(np.int32)
    end = length + rng.integers(1, 8, b).astype(np.int32)
    for stop_ids, stops_from in [
        (np.array([2, 3], np.int32), None),
        (rng.integers(-1, 6, (b, 2)).astype(np.int32), rng.integers(0, 4, b).astype(np.int32)),
    ]:
        args = (tokens, num_new, running, length, end, stop_ids)
        host = emit_counts(*args, stops_from=stops_from, xp=np)
        dev = emit_counts(*map(jnp.asarray, args), stops_from=None if stops_from is None else jnp.asarray(stops_from))
        for h, d in zip(host, dev):
            np.testing.assert_array_equal(h, np.asarray(d))
        kept = host[0]
        assert np.all(kept <= np.minimum(num_new, end - length) * running)
        rs_h = round_statistics(num_verify, num_acc, num_new, kept, g, xp=np)
        rs_d = round_statistics(*map(jnp.asarray, (num_verify, num_acc, num_new, kept)), g)
        for h, d in zip(rs_h, rs_d):
            np.testing.assert_array_equal(h, np.asarray(d))
        assert np.all(rs_h.num_draft_tokens <= num_verify) and np.all(rs_h.num_accepted <= kept)


def test_compile_cache_is_bounded():
    from dspark_jax.decoding.compile_cache import LRUCache
    from dspark_jax.decoding.loop import _COMPILED

    assert isinstance(_COMPILED, LRUCache) and _COMPILED.maxsize <= 64
    cache = LRUCache(maxsize=2)
    built = []
    for k in ("a", "b", "a", "c", "b"):
        cache.get_or_build(k, lambda k=k: built.append(k) or k)
    assert built == ["a", "b", "c", "b"] and len(cache) == 2 and "c" in cache and "a" not in cache


def test_a_new_max_new_tokens_reuses_the_compiled_loops(peaked, drafters, monkeypatch):
    """The loops' static step bound is bucketed (issue 24): another ``max_new_tokens`` at the same
    cache length compiles nothing new, and every request still stops at its own limit."""
    from dspark_jax.decoding import loop
    from dspark_jax.decoding.compile_cache import LRUCache

    monkeypatch.setattr(loop, "_COMPILED", LRUCache(maxsize=8))
    kw = dict(cache_len=64, temperature=0.0, stop_ids=[])
    spec = {
        n: generate_speculative(
            peaked, drafters["bigram"], [[1, 2, 3]], max_new_tokens=n, num_speculative_tokens=4, **kw
        )
        for n in (9, 20)
    }
    ar = {n: generate_autoregressive(peaked, [[1, 2, 3]], max_new_tokens=n, **kw) for n in (9, 20)}
    assert len(loop._COMPILED) == 2  # one speculative loop and one plain loop
    for n in (9, 20):
        ids = ar[n].generations[0].token_ids
        assert len(ids) == n and spec[n].generations[0].token_ids == ids
    assert ar[20].generations[0].token_ids[:9] == ar[9].generations[0].token_ids
