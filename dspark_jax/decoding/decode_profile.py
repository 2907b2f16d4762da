"""The batch-1 profiler: measured costs of the decode loop's programs, for ``auto`` verification.

docs/design.md#batch-1-verification-length: ``num_speculative_tokens="auto"``
(:mod:`dspark_jax.decoding.auto_verify`) prices each round with the seconds of a plain step, of
a verification pass per compiled width, of a drafting round and of a context write, measured
on the machine that decodes. :func:`measure_costs` times them into a
:class:`~dspark_jax.decoding.cost_table.CostTable` (the table the serving engine's SPS uses too)
with the shared :func:`~dspark_jax.decoding.cost_table.time_programs`, at one attention span by
default (:func:`default_span`) or at a list of spans, and :func:`measure_round_costs` times the
``auto`` loop's own rounds at each width, the prices it decides by; :func:`cached_cost_table`
measures once per shapes and reuses the table in memory and from the disk cache.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
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
from dspark_jax.decoding.loop import AutoWidths, make_batch, run_speculative
from dspark_jax.decoding.round import RoundCaches, RoundInputs, draft_tokens, verify_pass
from dspark_jax.drafters.base import Draft, prepare_drafter
from dspark_jax.models.sampling import process_logits, sample_or_argmax, sampling_arrays

__all__ = ["cached_cost_table", "default_span", "forcing_costs", "measure_costs", "measure_round_costs"]

_log = logging.getLogger(__name__)


def default_span(cache_len: int, block_size: int) -> int:
    """The span [tokens] batch-1 costs are measured at by default: the KV blocks a full
    verification pass anchored at a quarter of the cache reads."""
    return live_span(cache_len // 4 + block_size, cache_len)


def _programs(target, drafter, widths: Sequence[int]):
    """Jitted batch-1 programs ``(verify per width, draft, step, context)``; caches are donated
    and returned."""
    t_graph, _ = nnx.split(target)
    d_graph, _ = nnx.split(drafter)
    g = drafter.cfg.block_size

    def verify_prog(w):
        def run(t_state, d_state, tcache, dcache, anchor, pos, drafts, dprobs, key, samp):
            t = nnx.merge(t_graph, t_state)
            d = nnx.merge(d_graph, d_state)
            running, n = jnp.ones((1,), bool), jnp.full((1,), w, jnp.int32)
            unread = jnp.zeros(drafts.shape, jnp.float32)  # verify_pass reads no confidence, draft key or room
            r_in, draft = RoundInputs(running, anchor, pos, key, key, n), Draft(drafts, dprobs, unread, unread)
            r = verify_pass(t, d, RoundCaches(tcache, dcache), r_in, draft, n, samp, width=w)
            return r.caches.target, r.caches.drafter, r.tokens

        return jax.jit(run, donate_argnums=(2, 3))

    @jax.jit
    def draft_prog(t_state, d_state, dcache, anchor, pos, key, samp):
        t = nnx.merge(t_graph, t_state)
        d = nnx.merge(d_graph, d_state)
        out = draft_tokens(t, d, anchor, pos, dcache, key, samp)
        return out.tokens, out.probs, out.confidence

    def step_prog(t_state, tcache, anchor, pos, key, samp):
        t = nnx.merge(t_graph, t_state)
        out = t(anchor[:, None], pos[:, None], tcache)
        probs = process_logits(out.logits[:, 0], samp)  # as plain decoding's next_token
        return out.cache, sample_or_argmax(key, probs, jnp.all(samp.temperature <= 0))

    def context_prog(d_state, dcache, feats, pos):
        d = nnx.merge(d_graph, d_state)
        vpos = pos[:, None] + jnp.arange(g + 1, dtype=jnp.int32)
        return d.extend_cache(dcache, feats, vpos)

    return (
        {w: verify_prog(w) for w in widths},
        draft_prog,
        jax.jit(step_prog, donate_argnums=(1,)),
        jax.jit(context_prog, donate_argnums=(1,)),
    )


def _decode_calls(target, drafter, widths: Sequence[int], cache_len: int, spans: Sequence[int]) -> dict:
    """``{(program, span): fn}`` of the batch-1 programs over caches of ``cache_len`` threaded
    from call to call; at span ``s`` the anchor sits ``block_size + 1`` positions below ``s``, so
    every program reads the blocks up to ``s`` and a full pass writes only below it."""
    g = drafter.cfg.block_size
    verify_p, draft_p, step_p, context_p = _programs(target, drafter, widths)
    (_, t_state), (_, d_state) = nnx.split(target), nnx.split(drafter)
    st = {"tcache": target.init_cache(1, cache_len), "dcache": drafter.init_cache(1, cache_len)}
    anchor, key = jnp.asarray([1], jnp.int32), jax.random.PRNGKey(0)[None]
    greedy, sampled = sampling_arrays(1, 0.0), sampling_arrays(1, 1.0)
    feats = jnp.zeros((1, g + 1, len(drafter.cfg.taps) * target.cfg.hidden_size), target.dtype)
    pos0 = jnp.asarray([max(0, spans[0] - g - 1)], jnp.int32)
    drafts, dprobs, _ = draft_p(t_state, d_state, st["dcache"], anchor, pos0, key, sampled)

    def step(pos):
        st["tcache"], out = step_p(t_state, st["tcache"], anchor, pos, key, greedy)
        jax.block_until_ready(out)

    def draft(pos, samp):
        jax.block_until_ready(draft_p(t_state, d_state, st["dcache"], anchor, pos, key, samp))

    def context(pos):
        st["dcache"] = jax.block_until_ready(context_p(d_state, st["dcache"], feats, pos))

    def verify(w, pos):
        caches = verify_p[w](t_state, d_state, st["tcache"], st["dcache"], anchor, pos, drafts, dprobs, key, greedy)
        st["tcache"], st["dcache"], out = caches
        jax.block_until_ready(out)

    calls = {}
    for s in spans:
        pos = jnp.asarray([max(0, s - g - 1)], jnp.int32)
        calls[(("step",), s)] = functools.partial(step, pos)
        calls[(("draft", "greedy"), s)] = functools.partial(draft, pos, greedy)
        calls[(("draft", "sampled"), s)] = functools.partial(draft, pos, sampled)
        calls[(("context",), s)] = functools.partial(context, pos)
        calls.update({(("verify", w), s): functools.partial(verify, w, pos) for w in widths})
    return calls


ROUND_TOKENS = 40  # [tokens] the longer of the two timed decode loops generates
MIN_ROUND_SECONDS = 1e-6  # a loop too fast to time (a toy model) is not priced at zero or below
# Part of a stored table's key: a change to the decode loop's programs changes what its rounds cost,
# so tables timed on an older loop are measured again (2: widths run in place, round.verify_at_width;
# 3: probes back off, so the width-0 loop times fewer drafting rounds; 4: the rounds without drafts
# run in a lean loop of their own, without random bits when greedy, their drafter context written in chunks;
# 5: every round without drafts, a request's first included, runs in that loop).
LOOP_REVISION = 5


def _round_lengths(span: int, cache_len: int, block_size: int) -> tuple[int, int, int]:
    """``(prompt tokens, short, long)`` new-token counts of the timed loops at ``span``: every
    position a round reads or writes stays below ``span`` (and in the cache), as high as it can."""
    top = min(span, cache_len) - block_size - 2
    long_ = max(2, min(ROUND_TOKENS, top - 1))
    return max(1, top - long_), max(1, long_ // 5), long_


def forcing_costs(widths: Sequence[int], i: int) -> np.ndarray:
    """``t_verify [len(widths)]`` under which ``auto`` drafts every round and verifies ``widths[i]``
    drafts (``i == 0``: it never drafts but for its probes), with ``t_draft = 0``: only the ratios
    matter (:func:`~dspark_jax.decoding.auto_verify.choose_width`,
    :func:`~dspark_jax.decoding.auto_verify.should_draft`)."""
    # Up to widths[i] each wider pass is cheaper, so any expected gain (even none) extends.
    t = 0.5 ** np.arange(len(widths), dtype=np.float64)
    if i == 0:
        t[0] = 1e-6
    else:
        t[0], t[i + 1 :] = 1e3, 1e6
    return t.astype(np.float32)


def measure_round_costs(target, drafter, *, cache_len: int, spans: Sequence[int], repeats: int = 5) -> dict:
    """Seconds per round of the batch-1 ``auto`` decode loop itself, at each of its widths.

    Standalone calls price a long verification pass like a short one (on a 2-core CPU verify(8)
    within 10% of verify(2)) while inside the loop, where XLA overlaps and fuses the round's
    programs, it costs more; ``auto`` decides by these prices (:meth:`CostTable.auto_prices`). At
    each span the loop (:func:`~dspark_jax.decoding.loop.run_speculative`, one compiled program)
    is forced to one width by its cost inputs (:func:`forcing_costs`) and run greedily on a fixed
    random prompt (no stop ids) for a short and a long generation (:func:`_round_lengths`); a
    round costs the difference of their seconds over the difference of their passes (prefill
    cancels), median of ``repeats`` rotated repeats.

    Args:
      target / drafter: the models (a block drafter, prepared for ``target``).
      cache_len: KV-cache length [tokens] of the loop. spans: whole-block spans [tokens].
      repeats: timed rounds of all runs (each is a whole generation).
    Returns:
      ``{(("round", w), span): seconds}`` for ``w`` in :func:`default_widths`.
    """
    g = drafter.cfg.block_size
    widths = default_widths(g)
    rng = np.random.default_rng(0)
    out: dict = {}
    for span in spans:
        plen, short, long_ = _round_lengths(span, cache_len, g)
        prompt = rng.integers(0, target.cfg.vocab_size, plen).tolist()
        batches = {n: make_batch(target, [prompt], n, g, cache_len, (0.0, 0, 1.0), 0, []) for n in (short, long_)}
        costs = [(jnp.asarray(forcing_costs(widths, i)), jnp.float32(0.0)) for i in range(len(widths))]

        def run(i, n, batches=batches, costs=costs):
            res = run_speculative(target, drafter, batches[n], AutoWidths(widths, *costs[i]))
            return res.seconds, res.generations[0].num_target_passes

        runs = [(i, n) for i in range(len(widths)) for n in (short, long_)]
        got: dict = {r: [] for r in runs}
        for r in runs:
            run(*r)  # compile (once) and warm
        for k in range(max(1, int(repeats))):
            for r in runs[k % len(runs) :] + runs[: k % len(runs)]:
                got[r].append(run(*r))
        for i, w in enumerate(widths):
            pairs = zip(got[(i, short)], got[(i, long_)])
            per = statistics.median((tl - ts) / max(pl - ps, 1) for (ts, ps), (tl, pl) in pairs)
            out[(("round", w), span)] = max(per, MIN_ROUND_SECONDS)
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
    rounds: bool = True,
) -> CostTable:
    """Measures the batch-1 :class:`CostTable` of ``target`` + ``drafter`` on the current device.

    Each program is compiled once over caches of ``cache_len`` (donated and threaded from call
    to call, as in the decode loop) and timed at every span by :func:`time_programs` (two warm
    calls each, then ``repeats`` rotated rounds).

    Args:
      target / drafter: the models (any drafter kind with ``draft_block``; DSpark / DFlash).
      widths: verification widths to measure (default :func:`~dspark_jax.decoding.auto_verify.default_widths`).
      cache_len: KV-cache length [tokens] the programs are compiled for.
      spans: attention spans [tokens] to measure at (rounded up to whole KV blocks, at most
        ``cache_len``; default one: :func:`default_span`).
      repeats: timed rounds; each value is their median.
      inner: calls per timing (default: enough for ~2 ms per timing, at least 1).
      rounds: also time the ``auto`` loop's rounds (:func:`measure_round_costs`, ``repeats`` of
        them; block drafters), the prices ``auto`` decides by.
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
    seconds = time_programs(calls, repeats=repeats, inner=inner, warm=2)
    if rounds:
        seconds.update(measure_round_costs(target, drafter, cache_len=cache_len, spans=spans, repeats=repeats))
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
        loop=LOOP_REVISION,
    )
    stored = stored_table(key)
    if stored is not None and stored.covers([("step",), ("round", 0)], spans):
        return stored
    _log.info(
        "measuring decode costs (compiling and timing the decode steps: once per machine, shapes and KV-cache "
        "length %d; later runs reuse them)",
        cache_len,
    )
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
