"""The decode loops update their KV caches in place, and attention's cost follows the live length.

Issue 24: the compiled single-request loops (:func:`~dspark_jax.decoding.loop._ar_decode`,
``_spec_decode`` at a fixed width and with ``num_speculative_tokens="auto"``) must not rebuild a cache-shaped array in
their loop bodies (a layer ``scan`` that maps the cache as xs/ys copies it every step): inside every
``while`` body of the optimized HLO, the only instructions whose result has a cache's shape are
parameters, tuple reads, bitcasts and in-place updates (``dynamic-update-slice`` / ``scatter``, or a
fusion whose root is one). The compiled programs' temporaries (``memory_analysis()``) stay below one
cache array (two with per-layer weights: the zero array the unrolled prefill's first writes copy from).
Tiny random models at a long cache, so that a cache copy would dominate the temporaries.
(``auto`` runs each compiled width in a ``lax.while_loop`` of zero or one trip: a ``lax.switch`` with
the writes inside its branches copied both caches into every branch, 10 copies a round here.)

:func:`~dspark_jax.models.layers.cached_attention` equals the dense masked attention, does not
depend on the allocated cache length or the batch-mates' lengths (bit for bit), and gives queries
that see nothing a zero output.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding import auto_verify
from dspark_jax.decoding import loop as sp
from dspark_jax.drafters.base import prepare_drafter
from dspark_jax.models import layers
from dspark_jax.models.layers import attention, cached_attention
from dspark_jax.models.sampling import sampling_arrays
from dspark_jax.models.target import Target, random_params
from tests.helpers.tiny import TINY_TARGET, tiny_drafter

CACHE = 4096
PROMPT = 32
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$")
_OP = re.compile(r"([\w-]+)\(")
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\{$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _instruction(ln: str) -> tuple[str, str] | None:
    """An HLO instruction line -> ``(result shape, opcode)`` (a tuple shape kept whole), else None."""
    m = _INSTR.match(ln)
    if m is None:
        return None
    rest = m.group(2)
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        end, depth = 0, 1
        while depth:
            end += 1
            depth += {"(": 1, ")": -1}.get(rest[end], 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = _OP.match(rest)
    return (shape, op.group(1)) if op else None


def _computations(text: str) -> dict[str, list[str]]:
    """Optimized HLO text -> ``{computation name: instruction lines}``."""
    comps, name = {}, None
    for ln in text.splitlines():
        m = _HEADER.match(ln)
        if m:
            name = m.group(1)
            comps[name] = []
        elif ln.startswith("}"):
            name = None
        elif name is not None and ln.strip():
            comps[name].append(ln)
    return comps


def _callees(ln: str) -> list[str]:
    out = _CALLED.findall(ln)
    for group in _BRANCHES.findall(ln):
        out += [c.strip().lstrip("%") for c in group.split(",")]
    return out


def _root_op(lines: list[str]) -> str:
    for ln in lines:
        if ln.strip().startswith("ROOT"):
            ins = _instruction(ln)
            return ins[1] if ins else ""
    return ""


def cache_producers_in_loops(text: str, cache_dims: str) -> tuple[list[str], int]:
    """Instructions inside any ``while`` body (transitively: nested loops, conditionals' branches,
    calls) whose result is an array of shape ``cache_dims`` (e.g. ``"4,1,4096,2,8"``), split into
    ``(offenders, in-place updates)``: offenders are anything but reads, bitcasts and in-place updates
    (``dynamic-update-slice`` / ``scatter``, or a fusion whose root is one); the count of in-place
    updates shows that the check saw the caches."""
    comps = _computations(text)
    bodies = set()
    for lines in comps.values():
        for ln in lines:
            ins = _instruction(ln)
            if ins and ins[1] == "while":
                bodies.update(_callees(ln))
    seen, todo, bad, updates = set(), list(bodies), [], 0
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for ln in comps[name]:
            ins = _instruction(ln)
            if ins is None:
                continue
            shape, op = ins
            if op != "fusion":  # a fusion is judged by its root, not by the parameters inside it
                todo.extend(_callees(ln))
            if not re.fullmatch(r"[a-z0-9]+\[" + cache_dims + r"\](\{[^}]*\})?", shape):
                continue
            if op in ("parameter", "get-tuple-element", "bitcast"):
                continue
            roots = [_root_op(comps.get(c, [])) for c in _callees(ln)] if op == "fusion" else [op]
            if roots and all(r in ("dynamic-update-slice", "scatter") for r in roots):
                updates += 1
            else:
                bad.append(ln.strip()[:200])
    return bad, updates


@pytest.fixture(scope="module")
def models():
    cfg = dataclasses.replace(TINY_TARGET, max_position=CACHE)
    target = Target(cfg, random_params(cfg, seed=1, scale=0.2))
    drafter = tiny_drafter(target)
    prepare_drafter(target, drafter)
    return target, drafter


def _arrays(b: int = 1):
    prompt = jnp.zeros((b, PROMPT), jnp.int32)
    lens = jnp.full((b,), 10, jnp.int32)
    return sp._Inputs(
        prompt,
        lens,
        lens + 20,
        sampling_arrays(b, 0.0, 0, 1.0),
        jnp.zeros((b, 2), jnp.uint32),
        jnp.ones(1, jnp.int32),
    )


def _compiled(models, kind: str):
    target, drafter = models
    (tg, ts), (dg, ds) = nnx.split(target), nnx.split(drafter)
    if kind == "plain":
        return sp._ar_decode.lower(ts, _arrays(), t_graph=tg, cache_len=CACHE, max_steps=20).compile()
    statics = dict(t_graph=tg, d_graph=dg, cache_len=CACHE, max_steps=20, record_rounds=False, width=4)
    auto = None
    if kind == "auto":
        widths = auto_verify.default_widths(drafter.cfg.block_size)
        auto = sp.AutoWidths(widths, jnp.linspace(1.0, 2.0, len(widths), dtype=jnp.float32), jnp.float32(0.3))
    return sp._spec_decode.lower(ts, ds, _arrays(), auto, **statics).compile()


@pytest.mark.parametrize("kind", ["plain", "fixed", "auto"])
def test_loop_bodies_update_caches_in_place(models, kind):
    target, drafter = models
    compiled = _compiled(models, kind)
    text = str(compiled.as_text())
    c = target.cfg
    dims = [f"{c.num_layers},1,{CACHE},{c.num_kv_heads},{c.head_dim}"]
    if kind != "plain":
        d = drafter.cfg
        dims.append(f"{d.num_layers},1,{CACHE},{d.num_kv_heads},{d.head_dim}")
    for dim in dims:
        bad, updates = cache_producers_in_loops(text, dim)
        assert bad == []
        assert updates >= 2  # k and v, written in place inside the loop
    one_cache_array = c.num_layers * CACHE * c.num_kv_heads * c.head_dim * 4
    stats = compiled.memory_analysis()
    # With the layers unrolled (per-layer weights on the CPU) the empty cache is one zero array before
    # the loop, which the prefill's first writes copy from: one cache array of temporaries, no more.
    bound = one_cache_array * (2 if target.per_layer else 1)
    assert stats is not None and stats.temp_size_in_bytes < bound


def test_cached_attention_equals_dense_and_ignores_cache_length():
    rng = np.random.default_rng(0)
    layers, b, s, kvh, hd, nh = 2, 3, 100, 2, 8, 4
    k, v = (jnp.asarray(rng.standard_normal((layers, b, s, kvh, hd)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, 5, nh, hd)), jnp.float32)
    pos = jnp.asarray([[3, 4, 5, 6, 7], [40, 41, 42, 43, 44], [95, 96, 97, 98, 99]], jnp.int32)
    dense = attention(q, k[1], v[1], jnp.arange(s)[None, None, :] <= pos[:, :, None])
    for block in (16, 64, 256):  # 100 is no multiple of 16 or 64: the last block overlaps
        got = cached_attention(q, k, v, 1, pos, block=block)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=1e-6, rtol=0)
    got = cached_attention(q, k, v, 1, pos, block=16)
    alone = cached_attention(q[:1], k, v, 1, pos[:1], block=16)
    assert np.array_equal(np.asarray(alone), np.asarray(got[:1]))  # batch-mates' lengths add exact zeros
    longer = cached_attention(q[:2], jnp.concatenate([k, k], 2), jnp.concatenate([v, v], 2), 1, pos[:2], block=16)
    assert np.array_equal(np.asarray(longer), np.asarray(got[:2]))  # the allocated length is not read
    blind = cached_attention(q, k, v, 0, jnp.full_like(pos, -1))
    assert not np.any(np.asarray(blind))


def test_cached_attention_reads_only_live_blocks():
    """Slots past the longest query's position are never read: NaN there changes nothing."""
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, 128, 1, 8)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((2, 1, 2, 8)), jnp.float32)
    pos = jnp.asarray([[10], [40]], jnp.int32)
    want = cached_attention(q, k, v, 0, pos, block=32)
    k_nan, v_nan = k.at[:, :, 64:].set(jnp.nan), v.at[:, :, 64:].set(jnp.nan)
    got = jax.jit(lambda *a: cached_attention(*a, block=32))(q, k_nan, v_nan, 0, pos)
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_the_tpu_flat_kv_write_equals_the_plain_scatter():
    """kv_scatter's TPU form (rows of a flat [rows, heads * hd] view) writes what the plain scatter
    writes and drops out-of-range indices (negative ones too); checked on CPU by calling both forms."""
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((3, 2, 16, 2, 4)), jnp.float32)
    upd = jnp.asarray(rng.standard_normal((2, 5, 2, 4)), jnp.float32)
    pos = jnp.asarray([[0, 3, 15, 16, 40], [7, 8, 9, 2, 16]], jnp.int32)  # 16, 40: past the end
    index = (jnp.int32(1), jnp.arange(2)[:, None], pos)
    flat = layers._kv_scatter_flat(cache, index, upd)
    assert np.array_equal(np.asarray(flat), np.asarray(layers._kv_scatter_plain(cache, index, upd)))
    assert np.array_equal(np.asarray(flat), np.asarray(layers.kv_scatter(cache, index, upd)))  # CPU: plain
    packed = (jnp.asarray([0, 2, 2]), jnp.asarray([1, 0, 5]), jnp.asarray([4, -1, 3]))  # row 5, slot -1: dropped
    got = layers._kv_scatter_flat(cache, packed, upd[0, :3])
    assert np.array_equal(np.asarray(got), np.asarray(cache.at[0, 1, 4].set(upd[0, 0])))
