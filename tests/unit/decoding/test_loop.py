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


def _plain_pass(target, drafter, caches, running, anchor, pos, keys, sampling):
    """``round.plain_step`` and the drafter's context write of its running rows."""
    from dspark_jax.decoding.round import RoundCaches, plain_step

    tcache, token, finite, feats = plain_step(target, drafter.cfg.taps, caches.target, anchor, pos, keys, sampling)
    wpos = jnp.where(running, pos, -1)[:, None]
    dcache = drafter.extend_cache(caches.drafter, feats, wpos, target=target, tokens=anchor[:, None])
    return RoundCaches(tcache, dcache), token, finite


def test_plain_step_is_verify_pass_at_width_0(peaked, drafters):
    """``plain_step`` and its context write (the rounds of ``"auto"`` while drafting is suspended)
    are ``verify_pass`` at width 0 without drafts, bit for bit: the caches it writes, the token (greedy rows without the
    random draw, sampled rows with verify's key) and the finite flags; a finished row writes no
    drafter context."""
    import jax

    from dspark_jax.decoding.round import (
        RoundCaches,
        RoundInputs,
        prefill,
        split_round_keys,
        token_keys,
        verify_pass,
    )
    from dspark_jax.drafters.base import Draft
    from dspark_jax.models.sampling import sampling_arrays

    target, drafter = peaked, drafters["bigram"]
    b, tp, v = 4, 8, target.cfg.vocab_size
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, v, (b, tp)), jnp.int32)
    plen = jnp.asarray([8, 5, 3, 6], jnp.int32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(b))
    running = jnp.asarray([True, True, False, True])
    pos = plen - 1
    anchor = jnp.take_along_axis(prompt, pos[:, None], 1)[:, 0]
    draft_keys, verify_keys = split_round_keys(token_keys(keys, pos))
    r = RoundInputs(running, anchor, pos, draft_keys, verify_keys, jnp.full((b,), 9, jnp.int32))
    empty = Draft(jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, v), jnp.float32), *(jnp.zeros((b, 0)),) * 2)
    for temps in ([0.0] * b, [1.0] * b, [0.0, 1.0, 0.7, 1.3]):
        sampling = sampling_arrays(b, temps, 0, 1.0)
        pre = prefill(target, drafter, prompt, plen, keys, sampling, 16, drafter.cfg.taps)
        caches = RoundCaches(pre.tcache, pre.dcache)
        ref = verify_pass(target, drafter, caches, r, empty, jnp.zeros((b,), jnp.int32), sampling, width=0)
        got_caches, token, finite = _plain_pass(target, drafter, caches, running, anchor, pos, keys, sampling)
        np.testing.assert_array_equal(np.asarray(token), np.asarray(ref.tokens[:, 0]), err_msg=str(temps))
        np.testing.assert_array_equal(np.asarray(finite), np.asarray(ref.finite))
        for got, want in zip(jax.tree.leaves(got_caches), jax.tree.leaves(ref.caches)):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), temps
        # the finished row's drafter context is untouched
        for got, old in zip(jax.tree.leaves(got_caches.drafter), jax.tree.leaves(pre.dcache)):
            np.testing.assert_array_equal(np.asarray(got)[:, 2], np.asarray(old)[:, 2])


def test_suspended_stretch_writes_the_drafter_context_in_chunks(peaked, drafters):
    """The suspended rounds of ``"auto"`` write their drafter context a chunk at a time: after a
    stretch of 21 rounds (a full chunk of 16 and part of another; a row finishing inside it) the drafter's
    context cache equals the one written token by token (``plain_step`` and a write), to float32 rounding, and the
    tokens and target caches are the same."""
    import jax

    from dspark_jax.decoding import auto_verify, loop
    from dspark_jax.decoding.round import RoundCaches

    target, drafter = peaked, drafters["bigram"]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9, 3, 2]]
    bt = loop.make_batch(target, prompts, [30, 12, 30], drafter.cfg.block_size, 64, (0.0, 0, 1.0), 0, [])
    x = loop._device_inputs(bt)
    s = loop._start(target, drafter, x, 64, drafter.cfg.taps, drafter.cfg.block_size)
    auto = auto_verify.init_auto_state(3, drafter.cfg.block_size)._replace(
        draft_on=jnp.zeros((), bool), wait=jnp.int32(21)
    )
    s = s._replace(auto=auto)
    got = jax.jit(lambda s: loop._suspended(target, drafter, s, x, 64, 100, 0))(s)
    assert int(got.step) == 21 and bool(got.auto.draft_on)
    # A probe that would leave every row fewer than min_room tokens is not made: plain to the end.
    late = jax.jit(lambda s: loop._suspended(target, drafter, s, x, 64, 100, 10))(s)
    assert not np.any(np.asarray(late.finish) == 0) and int(late.step) > 21
    for row, n in enumerate(np.asarray(got.length)):
        np.testing.assert_array_equal(np.asarray(late.seq)[row, :n], np.asarray(got.seq)[row, :n])
    caches, seq, length, finish = RoundCaches(s.tcache, s.dcache), s.seq, s.length, s.finish
    step = jax.jit(lambda c, a, p, r: _plain_pass(target, drafter, c, r, a, p, x.keys, x.sampling))
    for _ in range(21):  # the reference: one token at a time, as verify_pass at width 0 writes it
        running = (finish == 0) & (length < jnp.asarray(bt.limit))
        p = length - 1
        caches, tok, _ = step(caches, jnp.take_along_axis(seq, p[:, None], 1)[:, 0], p, running)
        seq = seq.at[jnp.arange(3), length].set(jnp.where(running, tok, seq[jnp.arange(3), length]))
        length = length + running
    np.testing.assert_array_equal(np.asarray(got.seq), np.asarray(seq))
    np.testing.assert_array_equal(np.asarray(got.tcache.k), np.asarray(caches.target.k))
    assert int(got.length[1]) < int(got.length[0])  # the short row finished inside the stretch
    for a, b in zip(jax.tree.leaves(got.dcache), jax.tree.leaves(caches.drafter)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
