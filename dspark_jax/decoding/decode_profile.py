"""The batch-1 profiler: measured costs of the decode loop's programs, for ``auto`` verification.

docs/design.md#batch-1-verification-length: ``num_speculative_tokens="auto"``
(:mod:`dspark_jax.decoding.auto_verify`) prices each round with the seconds of a plain step, of
a verification pass per compiled width, of a drafting round and of a context write, measured
on the machine that decodes. :func:`measure_costs` times them into a
:class:`~dspark_jax.decoding.cost_table.CostTable` (the table the serving engine's SPS uses too)
with the shared :func:`~dspark_jax.decoding.cost_table.time_programs`, as the seconds one more
run adds inside a ``lax.fori_loop`` (the decode loop is one ``lax.while_loop``: its programs pay
no dispatch of their own, which a standalone call adds: about 7 ms of a 50 ms SmolLM2 step on a
2-core CPU, docs/journal/2026-12-03-session-19.md), at one attention span by
default (:func:`default_span`) or at a list of spans; :func:`cached_cost_table` measures once per
shapes and reuses the table in memory and from the disk cache.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.auto_verify import default_widths
from dspark_jax.decoding.compile_cache import LRUCache
from dspark_jax.decoding.cost_table import (
    CostTable,
    live_span,
    measured_spans,
    store_table,
    stored_table,
    table_key,
    time_programs,
)
from dspark_jax.decoding.round import RoundInputs, draft_tokens, verify_pass
from dspark_jax.drafters.base import Draft, prepare_drafter
from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

__all__ = ["cached_cost_table", "default_span", "measure_costs"]

_log = logging.getLogger(__name__)


def default_span(cache_len: int, block_size: int) -> int:
    """The span [tokens] batch-1 costs are measured at by default: the KV blocks a full
    verification pass anchored at a quarter of the cache reads."""
    return live_span(cache_len // 4 + block_size, cache_len)


LOOP_CALLS = 4  # program runs per timed call of the looped programs (the other call runs one)


def _programs(target, drafter, widths: Sequence[int]):
    """Jitted batch-1 programs ``(verify per width, draft, step, context)``, each a
    ``lax.fori_loop`` of a traced ``n`` runs of that program that threads its outputs into the
    next run (caches donated and returned; the anchor is the previous run's first token), so XLA
    can neither hoist a run out of the loop nor skip one. The decode loop runs its rounds inside
    one ``lax.while_loop``, where a program does not pay a dispatch of its own: the profiler
    prices a program by what one more run inside a loop adds (:func:`_marginal_seconds`)."""
    t_graph, _ = nnx.split(target)
    d_graph, _ = nnx.split(drafter)
    taps = drafter.cfg.taps
    g = drafter.cfg.block_size
    vocab = target.cfg.vocab_size

    def next_anchor(tokens):  # a valid id that depends on the run's output
        return jnp.clip(tokens[:, 0], 0, vocab - 1).astype(jnp.int32)

    def verify_prog(w):
        def run(t_state, d_state, tcache, dcache, anchor, pos, drafts, dprobs, key, samp, n):
            t = nnx.merge(t_graph, t_state)
            d = nnx.merge(d_graph, d_state)
            running, nv = jnp.ones((1,), bool), jnp.full((1,), w, jnp.int32)
            unread = jnp.zeros(drafts.shape, jnp.float32)  # verify_pass reads no confidence, draft key or room
            draft = Draft(drafts, dprobs, unread, unread)

            def body(_, c):
                tc, dc, a = c
                r = verify_pass(
                    t,
                    d,
                    tc,
                    dc,
                    RoundInputs(running, a, pos, key, key, nv),
                    draft,
                    nv,
                    samp,
                    width=w,
                    block_size=g,
                    taps=taps,
                )
                return r.tcache, r.dcache, next_anchor(r.tokens)

            return jax.lax.fori_loop(0, n, body, (tcache, dcache, anchor))

        return jax.jit(run, donate_argnums=(2, 3))

    @jax.jit
    def draft_prog(t_state, d_state, dcache, anchor, pos, key, samp, n):
        t = nnx.merge(t_graph, t_state)
        d = nnx.merge(d_graph, d_state)

        def body(_, a):
            return next_anchor(draft_tokens(t, d, a, pos, dcache, key, samp).tokens)

        return jax.lax.fori_loop(0, n, body, anchor)

    def step_prog(t_state, tcache, anchor, pos, key, samp, n):
        t = nnx.merge(t_graph, t_state)

        def body(_, c):
            tc, a = c
            out = t(a[:, None], pos[:, None], tc)
            return out.cache, sample(key, process_logits(out.logits[:, 0], samp)).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (tcache, anchor))

    def context_prog(d_state, dcache, feats, pos, n):
        d = nnx.merge(d_graph, d_state)
        vpos = pos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)

        def body(i, dc):  # the features move with i, so no run repeats another's write
            return d.extend_cache(dc, feats + i.astype(feats.dtype), vpos)

        return jax.lax.fori_loop(0, n, body, dcache)

    return (
        {w: verify_prog(w) for w in widths},
        draft_prog,
        jax.jit(step_prog, donate_argnums=(1,)),
        jax.jit(context_prog, donate_argnums=(1,)),
    )


def _decode_calls(target, drafter, widths: Sequence[int], cache_len: int, spans: Sequence[int]) -> dict:
    """``{(program, span, runs): fn}`` of the looped batch-1 programs (:func:`_programs`) over
    caches of ``cache_len`` threaded from call to call, each at 1 and :data:`LOOP_CALLS` runs per
    call; at span ``s`` the anchor sits ``block_size + 1`` positions below ``s``, so every program
    reads the blocks up to ``s`` and a full pass writes only below it."""
    g = drafter.cfg.block_size
    verify_p, draft_p, step_p, context_p = _programs(target, drafter, widths)
    (_, t_state), (_, d_state) = nnx.split(target), nnx.split(drafter)
    st = {"tcache": target.init_cache(1, cache_len), "dcache": drafter.init_cache(1, cache_len)}
    anchor, key = jnp.asarray([1], jnp.int32), jax.random.PRNGKey(0)[None]
    greedy, sampled = sampling_arrays(1, 0.0), sampling_arrays(1, 1.0)
    feats = jnp.zeros((1, g + 1, len(drafter.cfg.taps) * target.cfg.hidden_size), target.dtype)
    pos0 = jnp.asarray([max(0, spans[0] - g - 1)], jnp.int32)
    one = jnp.int32(1)
    d_out = draft_tokens(target, drafter, anchor, pos0, st["dcache"], key, sampled)
    drafts, dprobs = d_out.tokens, d_out.probs

    def step(pos, n):
        st["tcache"], out = step_p(t_state, st["tcache"], anchor, pos, key, greedy, n)
        jax.block_until_ready(out)

    def draft(pos, samp, n):
        jax.block_until_ready(draft_p(t_state, d_state, st["dcache"], anchor, pos, key, samp, n))

    def context(pos, n):
        st["dcache"] = jax.block_until_ready(context_p(d_state, st["dcache"], feats, pos, n))

    def verify(w, pos, n):
        caches = verify_p[w](t_state, d_state, st["tcache"], st["dcache"], anchor, pos, drafts, dprobs, key, greedy, n)
        st["tcache"], st["dcache"], out = caches
        jax.block_until_ready(out)

    calls = {}
    for s in spans:
        pos = jnp.asarray([max(0, s - g - 1)], jnp.int32)
        progs = {
            ("step",): functools.partial(step, pos),
            ("draft", "greedy"): functools.partial(draft, pos, greedy),
            ("draft", "sampled"): functools.partial(draft, pos, sampled),
            ("context",): functools.partial(context, pos),
            **{("verify", w): functools.partial(verify, w, pos) for w in widths},
        }
        for name, fn in progs.items():
            for runs in (1, LOOP_CALLS):
                calls[(name, s, runs)] = functools.partial(fn, one * runs)
    return calls


def _marginal_seconds(seconds: dict) -> dict:
    """``{(program, span): seconds}`` one more run inside a loop adds, from the medians of calls
    running it once and :data:`LOOP_CALLS` times (the call's own dispatch cancels out). Floored at
    a twentieth of the looped call's mean run, so noise cannot make a program free."""
    out = {}
    for (name, s, runs), t_loop in seconds.items():
        if runs == LOOP_CALLS:
            t_one = seconds[(name, s, 1)]
            out[(name, s)] = max((t_loop - t_one) / (LOOP_CALLS - 1), t_loop / LOOP_CALLS / 20, 1e-9)
    return out


def measure_costs(
    target,
    drafter,
    *,
    widths: Sequence[int] | None = None,
    cache_len: int = 512,
    spans: Sequence[int] | None = None,
    repeats: int = 9,
    inner: int | None = None,
) -> CostTable:
    """Measures the batch-1 :class:`CostTable` of ``target`` + ``drafter`` on the current device.

    Each program is compiled once, as a loop of a traced number of runs, over caches of
    ``cache_len`` (donated and threaded from run to run, as in the decode loop), and timed at
    every span by :func:`time_programs` (two warm calls each, then ``repeats`` rotated rounds) at
    1 and :data:`LOOP_CALLS` runs per call; its cost is what one more run adds
    (:func:`_marginal_seconds`), the price inside the decode loop's ``lax.while_loop``.

    Args:
      target / drafter: the models (any drafter kind with ``draft_block``; DSpark / DFlash).
      widths: verification widths to measure (default :func:`~dspark_jax.decoding.auto_verify.default_widths`).
      cache_len: KV-cache length [tokens] the programs are compiled for.
      spans: attention spans [tokens] to measure at (rounded up to whole KV blocks, at most
        ``cache_len``; default one: :func:`default_span`).
      repeats: timed rounds; each value is their median.
      inner: calls per timing (default: enough for ~2 ms per timing, at least 1).
    Returns:
      :class:`CostTable` (``meta``: model, drafter, block size, cache length).
    Raises:
      DSparkInputError: a drafter for another target (prepared first, as decoding does), a span < 1.
      ValueError: widths not starting at 0 or beyond the block size.
    """
    prepare_drafter(target, drafter)
    g = drafter.cfg.block_size
    widths = tuple(default_widths(g) if widths is None else sorted(set(int(w) for w in widths)))
    if widths[0] != 0 or widths[-1] > g:
        raise ValueError(f"widths must start at 0 and stay <= the block size {g}, got {list(widths)}")
    spans = measured_spans(spans, cache_len, default_span(cache_len, g))
    calls = _decode_calls(target, drafter, widths, cache_len, spans)
    seconds = _marginal_seconds(time_programs(calls, repeats=repeats, inner=inner, warm=2))
    dev = jax.devices()[0]
    meta = {
        "device_kind": f"{dev.platform}:{dev.device_kind}",
        "model": target.cfg.name,
        "drafter": f"{drafter.cfg.variant}-g{g}-n{drafter.cfg.num_layers}",
        "block_size": g,
        "cache_len": int(cache_len),
    }
    return CostTable(meta, seconds)


# Measured once per model shapes, cache length and spans (costs do not depend on weight values);
# bounded: a long-lived process sees few distinct shapes.
_COST_TABLES = LRUCache(maxsize=8)


def _stored_or_measured(target, drafter, cache_len: int, spans: tuple[int, ...], repeats: int) -> CostTable:
    """The table stored on disk for these shapes and spans (:func:`stored_table`), else measured
    now and stored for the next process."""
    key = table_key(
        "cost_table",
        target=target.cfg,
        target_dtype=jnp.dtype(target.dtype).name,
        drafter=drafter.cfg,
        drafter_dtype=jnp.dtype(drafter.dtype).name,
        cache_len=int(cache_len),
        spans=list(spans),
        timing="marginal_in_loop",  # tables of standalone calls (before 2026-12-03) are not reused
    )
    stored = stored_table(key)
    if stored is not None and stored.covers([("step",)], spans):
        return stored
    t0 = time.perf_counter()
    table = measure_costs(target, drafter, cache_len=cache_len, spans=spans, repeats=repeats)
    path = store_table(key, table)
    _log.info("measured the cost table in %.1f s%s", time.perf_counter() - t0, f"; stored in {path}" if path else "")
    return table


def cached_cost_table(
    target, drafter, cache_len: int, repeats: int = 5, spans: Sequence[int] | None = None
) -> CostTable:
    """:func:`measure_costs` once per model configs, dtypes, ``cache_len`` and ``spans``, then
    reused: in this process (memory) and by later ones (stored on disk, keyed by the backend,
    device kind, configs, dtypes, ``cache_len``, spans and versions;
    :mod:`~dspark_jax.decoding.disk_cache`), so the same prompt gets the same chosen lengths,
    hence the same tau, in every process.

    ``repeats`` applies to that first measurement only (a benchmark can measure the table the
    decode loop will reuse more precisely ahead of time: ``benchmarks/speedup.py``).
    ``spans``: as in :func:`measure_costs` (default one span: :func:`default_span`).
    ``DSPARK_REFRESH_COSTS=1`` re-measures (and overwrites the stored table)."""
    g = drafter.cfg.block_size
    spans_t = measured_spans(spans, cache_len, default_span(cache_len, g))
    key = (target.cfg, jnp.dtype(target.dtype).name, drafter.cfg, jnp.dtype(drafter.dtype).name, cache_len, spans_t)
    return _COST_TABLES.get_or_build(key, lambda: _stored_or_measured(target, drafter, cache_len, spans_t, repeats))
