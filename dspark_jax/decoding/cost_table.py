"""Measured per-round costs of single-request decoding: the cost table.

docs/design.md#scheduler profiles SPS(B) of the verify pass; at batch 1 the same idea needs the
seconds of each piece of a speculative round, measured on the machine that decodes:

* ``t_step``: a plain autoregressive step (one token, no drafter);
* ``t_verify[w]``: a verification pass of ``w + 1`` tokens (anchor + ``w`` drafts) with the
  tapped features written into the drafter's context cache and the rejection sampling, for
  each compiled width ``w`` (``w = 0`` is the plain step of a speculative loop that keeps the
  drafter's context current);
* ``t_draft``: one drafting round (backbone pass + Markov sampler + confidences), greedy and
  sampled;
* ``t_context``: writing ``block_size + 1`` tokens' context features alone.

Each is its own compiled program over caches of the real length (donated and threaded from
call to call, as in the decode loop), timed as the median of repeats that alternate between
the programs so that drift on a shared machine hits all of them alike.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import disk_cache
from dspark_jax.decoding.auto_verify import default_widths
from dspark_jax.decoding.compile_cache import LRUCache
from dspark_jax.decoding.round import RoundInputs, draft_tokens, verify_pass
from dspark_jax.drafters.base import Draft, prepare_drafter
from dspark_jax.models.sampling import process_logits, sample, sampling_arrays

__all__ = ["CostTable", "cached_cost_table", "measure_costs"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per piece of a decoding round at batch 1 (all values in seconds).

    Attributes:
      widths: verification widths (drafts per pass) that ``t_verify`` covers, ascending from 0.
      t_verify: seconds of a verification pass per width (same order as ``widths``).
      t_draft_greedy / t_draft_sampled: seconds of one drafting round at T=0 / T>0.
      t_step: seconds of a plain autoregressive step (no drafter).
      t_context: seconds of writing ``block_size + 1`` tokens' drafter context.
      cache_len: KV-cache length the programs were measured at [tokens].
    """

    widths: tuple[int, ...]
    t_verify: tuple[float, ...]
    t_draft_greedy: float
    t_draft_sampled: float
    t_step: float
    t_context: float
    cache_len: int

    def verify_array(self, widths: Sequence[int]) -> np.ndarray:
        """``[len(widths)]`` float32 ``t_verify`` at ``widths``.

        Raises:
          ValueError: a width the table did not measure.
        """
        table = dict(zip(self.widths, self.t_verify))
        missing = [w for w in widths if w not in table]
        if missing:
            raise ValueError(f"cost table has no verification cost for widths {missing} (it has {list(self.widths)})")
        return np.asarray([table[w] for w in widths], np.float32)

    def bound_tokens_per_s(self, tau: float, width: int, greedy: bool = True) -> float:
        """Expected tokens/s of speculative decoding at acceptance length ``tau`` [tokens/pass]
        verifying ``width`` drafts per round: ``tau / (T_draft + T_verify(width))``."""
        t_draft = self.t_draft_greedy if greedy else self.t_draft_sampled
        return tau / (t_draft + float(self.verify_array([width])[0]))

    def to_record(self) -> dict[str, Any]:
        """Every field in seconds, exactly (the stored form; :meth:`from_record` inverts it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, obj: dict[str, Any]) -> CostTable:
        """Inverse of :meth:`to_record`.

        Raises:
          KeyError / TypeError / ValueError: a malformed record.
        """
        widths = tuple(int(w) for w in obj["widths"])
        t_verify = tuple(float(t) for t in obj["t_verify"])
        if len(widths) != len(t_verify) or not widths:
            raise ValueError("widths and t_verify differ in length")
        scalars = ("t_draft_greedy", "t_draft_sampled", "t_step", "t_context")
        return cls(widths, t_verify, *(float(obj[k]) for k in scalars), cache_len=int(obj["cache_len"]))

    def to_json(self) -> dict[str, Any]:
        """Milliseconds, the layout of ``benchmarks/decode_costs.py``'s JSON."""
        ms = lambda s: round(1e3 * s, 4)
        return {
            "t_step_ms": ms(self.t_step),
            "t_verify_ms": {w: ms(t) for w, t in zip(self.widths, self.t_verify)},
            "t_draft_ms": ms(self.t_draft_greedy),
            "t_draft_sampled_ms": ms(self.t_draft_sampled),
            "t_context_ms": ms(self.t_context),
            "cache_len": self.cache_len,
        }


def _programs(target, drafter, widths: Sequence[int], cache_len: int):
    """Jitted batch-1 programs ``name -> (fn, args_builder)``; caches are donated and returned."""
    t_graph, _ = nnx.split(target)
    d_graph, _ = nnx.split(drafter)
    taps = drafter.cfg.taps
    g = drafter.cfg.block_size

    def verify_prog(w):
        def run(t_state, d_state, tcache, dcache, anchor, pos, drafts, dprobs, key, samp):
            t = nnx.merge(t_graph, t_state)
            d = nnx.merge(d_graph, d_state)
            running, n = jnp.ones((1,), bool), jnp.full((1,), w, jnp.int32)
            unread = jnp.zeros(drafts.shape, jnp.float32)  # verify_pass reads no confidence, draft key or room
            r_in, draft = RoundInputs(running, anchor, pos, key, key, n), Draft(drafts, dprobs, unread, unread)
            r = verify_pass(t, d, tcache, dcache, r_in, draft, n, samp, width=w, block_size=g, taps=taps)
            return r.tcache, r.dcache, r.tokens

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
        return out.cache, sample(key, process_logits(out.logits[:, 0], samp))

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


def measure_costs(
    target,
    drafter,
    *,
    widths: Sequence[int] | None = None,
    cache_len: int = 512,
    position: int | None = None,
    repeats: int = 9,
    inner: int | None = None,
) -> CostTable:
    """Measures a :class:`CostTable` for ``target`` + ``drafter`` on the current device.

    Args:
      target / drafter: the models (any drafter kind with ``draft_block``; DSpark / DFlash).
      widths: verification widths to measure (default :func:`~dspark_jax.decoding.auto_verify.default_widths`).
      cache_len: KV-cache length [tokens] (attention reads the whole static cache).
      position: the anchor position [tokens] (default: a quarter of ``cache_len``).
      repeats: alternated timing rounds; each value is their median.
      inner: calls per timing (default: enough for ~2 ms per timing, at least 1).
    Returns:
      :class:`CostTable`.
    Raises:
      DSparkInputError: a drafter for another target (prepared first, as decoding does).
    """
    prepare_drafter(target, drafter)
    g = drafter.cfg.block_size
    widths = tuple(default_widths(g) if widths is None else sorted(set(int(w) for w in widths)))
    if widths[0] != 0 or widths[-1] > g:
        raise ValueError(f"widths must start at 0 and stay <= the block size {g}, got {list(widths)}")
    pos0 = cache_len // 4 if position is None else int(position)
    verify_p, draft_p, step_p, context_p = _programs(target, drafter, widths, cache_len)
    (_, t_state), (_, d_state) = nnx.split(target), nnx.split(drafter)
    state = {"tcache": target.init_cache(1, cache_len), "dcache": drafter.init_cache(1, cache_len)}
    anchor, pos = jnp.asarray([1], jnp.int32), jnp.asarray([pos0], jnp.int32)
    key = jax.random.PRNGKey(0)[None]
    greedy, sampled = sampling_arrays(1, 0.0), sampling_arrays(1, 1.0)
    drafts, dprobs, _ = draft_p(t_state, d_state, state["dcache"], anchor, pos, key, sampled)
    feats = jnp.zeros((1, g + 1, len(drafter.cfg.taps) * target.cfg.hidden_size), target.dtype)

    def call(name):
        if name == "step":
            state["tcache"], out = step_p(t_state, state["tcache"], anchor, pos, key, greedy)
        elif name == "draft_greedy":
            out = draft_p(t_state, d_state, state["dcache"], anchor, pos, key, greedy)
        elif name == "draft_sampled":
            out = draft_p(t_state, d_state, state["dcache"], anchor, pos, key, sampled)
        elif name == "context":
            state["dcache"] = out = context_p(d_state, state["dcache"], feats, pos)
        else:
            state["tcache"], state["dcache"], out = verify_p[name](
                t_state, d_state, state["tcache"], state["dcache"], anchor, pos, drafts, dprobs, key, greedy
            )
        jax.block_until_ready(out)

    names = ["step", "draft_greedy", "draft_sampled", "context", *widths]
    for n in names:  # compile + warm
        call(n)
        call(n)
    if inner is None:
        t0 = time.perf_counter()
        call(widths[-1])
        inner = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-6)))
    times: dict[Any, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no program always first
        for n in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                call(n)
            times[n].append((time.perf_counter() - t0) / inner)
    med = {n: statistics.median(v) for n, v in times.items()}
    return CostTable(
        widths=widths,
        t_verify=tuple(med[w] for w in widths),
        t_draft_greedy=med["draft_greedy"],
        t_draft_sampled=med["draft_sampled"],
        t_step=med["step"],
        t_context=med["context"],
        cache_len=cache_len,
    )


# Measured once per model shapes and cache length (costs do not depend on weight values);
# bounded: a long-lived process sees few distinct shapes.
_COST_TABLES = LRUCache(maxsize=8)


def _stored_or_measured(target, drafter, cache_len: int, repeats: int) -> CostTable:
    """The table stored on disk for these shapes (:mod:`~dspark_jax.decoding.disk_cache`), else
    measured now and stored for the next process."""
    key = disk_cache.cost_key(
        "cost_table",
        target=target.cfg,
        target_dtype=jnp.dtype(target.dtype).name,
        drafter=drafter.cfg,
        drafter_dtype=jnp.dtype(drafter.dtype).name,
        cache_len=int(cache_len),
    )
    stored = disk_cache.load_costs(key)
    if stored is not None:
        try:
            return CostTable.from_record(stored)
        except (KeyError, TypeError, ValueError) as e:
            _log.warning("ignoring a malformed stored cost table (%s); measuring again", e)
    t0 = time.perf_counter()
    table = measure_costs(target, drafter, cache_len=cache_len, repeats=repeats)
    path = disk_cache.save_costs(key, table.to_record())
    _log.info("measured the cost table in %.1f s%s", time.perf_counter() - t0, f"; stored in {path}" if path else "")
    return table


def cached_cost_table(target, drafter, cache_len: int, repeats: int = 5) -> CostTable:
    """:func:`measure_costs` once per model configs, dtypes and ``cache_len``, then reused: in
    this process (memory) and by later ones (stored on disk, keyed by the backend, device kind,
    configs, dtypes, ``cache_len`` and versions; :mod:`~dspark_jax.decoding.disk_cache`), so the
    same prompt gets the same chosen lengths, hence the same tau, in every process.

    ``repeats`` applies to that first measurement only (a benchmark can measure the table the
    decode loop will reuse more precisely ahead of time: ``benchmarks/speedup.py``).
    ``DSPARK_REFRESH_COSTS=1`` re-measures (and overwrites the stored table)."""
    key = (target.cfg, jnp.dtype(target.dtype).name, drafter.cfg, jnp.dtype(drafter.dtype).name, cache_len)
    return _COST_TABLES.get_or_build(key, lambda: _stored_or_measured(target, drafter, cache_len, repeats))
