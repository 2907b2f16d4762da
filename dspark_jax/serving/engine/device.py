"""The serving engine's device side: the models' states (sharded over a ``model`` mesh), the
decode state, and the compiled programs that advance it.

:class:`EngineDevice` lowers and compiles each program of :mod:`dspark_jax.serving.engine.step_programs`
once per shape, through the engine's :class:`~dspark_jax.serving.engine.step_programs.ProgramCache`:
``("step", R, K)``, ``("bare_step", R)``, ``("catchup", R)``, ``("insert", P)`` and ``("move",)``
(prefill's passes, :class:`~dspark_jax.serving.engine.prefill.PrefillPasses`, compile theirs
through :meth:`EngineDevice._get` too: ``("prefill", P)`` one-shot, ``("prefill_chunk", T, span,
lanes, block)`` and ``("prefill_extract", P, lanes)`` chunked). Cache keys also hold the
engine's signature (model graphs, parameter shapes, slots, cache length, verification mode,
bias-table size, logprob width, mesh), so a cache shared by several engines never hands one
another's program.
docs/design.md#serving and docs/design.md#device-mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterConfig
from dspark_jax.decoding.cost_table import (
    CostTable,
    live_span,
    measured_spans,
    store_table,
    stored_table,
    table_key,
    time_programs,
)
from dspark_jax.drafters.base import BlockDrafter
from dspark_jax.drafters.build import BLOCK_VARIANTS
from dspark_jax.errors import DSparkInputError
from dspark_jax.models import sharding as shd
from dspark_jax.models.gemma4 import refuse
from dspark_jax.models.layers import ATTN_BLOCK
from dspark_jax.serving.engine.requests import SamplingParams, no_bias
from dspark_jax.serving.engine.state import (
    DecodeState,
    PackedTokens,
    PrefixArrays,
    init_state,
    serving_mesh,
    state_shardings,
)
from dspark_jax.serving.engine.step_programs import (
    InsertInputs,
    ProgramCache,
    StepInputs,
    StepSpec,
    catchup_program,
    insert_program,
    move_program,
    step_program,
)

__all__ = ["EngineDevice", "out_shardings_for", "prefill_bucket_list", "row_bucket_list", "token_ladder"]


def token_ladder(buckets) -> list[int]:
    """Packed-token budgets of speculative steps (default 4, 8, ..., 128), ascending.

    Raises:
      DSparkInputError: a budget < 1.
    """
    out = sorted(set(int(b) for b in (buckets if buckets is not None else (4, 8, 16, 32, 64, 128))))
    if any(b < 1 for b in out):
        raise DSparkInputError(f"token buckets must be >= 1, got {out}")
    return out


def _pow2_upto(limit: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v < limit:
        out.append(v)
        v *= 2
    return out + [limit]


def row_bucket_list(row_buckets, num_slots: int) -> list[int]:
    """Compiled row counts (default: powers of two and ``num_slots``).

    Raises:
      DSparkInputError: a count < 1, or the largest is not ``num_slots``.
    """
    out = sorted(set(int(r) for r in row_buckets)) if row_buckets else _pow2_upto(num_slots)
    if out[0] < 1 or out[-1] != num_slots:
        raise DSparkInputError(f"row buckets must be >= 1 and end at num_slots={num_slots}, got {out}")
    return out


def prefill_bucket_list(prefill_buckets, cache_len: int) -> list[int]:
    """Compiled prompt lengths (default: powers of two from 16, and ``cache_len``).

    Raises:
      DSparkInputError: a length outside ``[1, cache_len]``.
    """
    out = (
        sorted(set(int(b) for b in prefill_buckets))
        if prefill_buckets
        else [b for b in _pow2_upto(cache_len, 16) if b <= cache_len]
    )
    if out[0] < 1 or out[-1] > cache_len:
        raise DSparkInputError(f"prefill buckets must be in [1, cache_len={cache_len}], got {out}")
    return out


def out_shardings_for(mesh, target_cfg, drafter_cfg, keep_q: bool) -> Callable[[str], Any]:
    """``kind -> out_shardings`` of the program ``kind`` on ``mesh`` (the state keeps its layout
    between steps, so no program recompiles)."""
    repl = shd.replicated(mesh)

    def of(kind: str):
        if kind in ("step", "bare_step"):
            return state_shardings(DecodeState, mesh, target_cfg, drafter_cfg, keep_q), repl
        if kind == "prefill":  # one-shot prefill: (prefix arrays, finite, logprobs)
            return state_shardings(PrefixArrays, mesh, target_cfg, drafter_cfg, keep_q), repl, repl
        return state_shardings(DecodeState, mesh, target_cfg, drafter_cfg, keep_q)  # catchup, insert, move

    return of


def _flags(n: int) -> tuple:
    return tuple(np.bool_(False) for _ in range(n))


def _insert_inputs(row: int, prompt_len: int, sp: SamplingParams, bias) -> InsertInputs:
    scalars = (np.int32(row), np.int32(prompt_len), np.float32(sp.temperature), np.int32(sp.top_k))
    return InsertInputs(*scalars, np.float32(sp.top_p), tuple(bias))


class EngineDevice:
    """Device state and compiled programs of one engine.

    Args:
      target / drafter: the models (``drafter`` None: plain steps only).
      num_slots / cache_len: decode rows ``B`` and cache positions ``S``.
      mode: ``"coupled"`` or ``"rejection"`` verification.
      nb: bias-table entries per row; n_top: logprob alternatives.
      mesh: None (the default device), a :class:`jax.sharding.Mesh` or a spec such as
        ``"model:8"`` (:func:`serving_mesh`): tensor-parallel serving (docs/design.md#device-mesh).
        The target's and the drafter's weights are sharded over ``model`` by
        :func:`dspark_jax.models.sharding.tree_shardings` (heads, MLP, vocabulary), both KV
        caches over their KV heads (replicated where ``model`` does not divide them), the small
        per-row state replicated; every program is compiled with these output shardings, so
        the state keeps its layout between steps and no step recompiles. Outputs equal the
        one-device engine's (up to float rounding in sharded reductions).
      cache: the :class:`ProgramCache` the programs are compiled into.

    Raises:
      DSparkInputError: a bad mesh (see :func:`serving_mesh`).
    """

    def __init__(
        self,
        target,
        drafter,
        *,
        num_slots: int,
        cache_len: int,
        mode: str,
        nb: int,
        n_top: int,
        mesh,
        cache: ProgramCache,
    ):
        self.target, self.drafter = target, drafter
        self.num_slots, self.cache_len, self.mode, self.nb, self.n_top = num_slots, cache_len, mode, nb, n_top
        self.block_size = drafter.cfg.block_size if drafter is not None else 0
        self.keep_q = mode == "rejection" and self.block_size > 0  # the state keeps each block's q
        self.t_graph, self.t_state = nnx.split(target)
        self.d_graph, self.d_state = nnx.split(drafter) if drafter is not None else (None, None)
        self.mesh = serving_mesh(mesh)
        d_cfg = drafter.cfg if drafter is not None else None
        self.out_shardings = None
        if self.mesh is not None:
            self.t_state = shd.place(self.t_state, shd.tree_shardings(self.t_state, self.mesh, target.cfg))
            if drafter is not None:
                self.d_state = shd.place(self.d_state, shd.tree_shardings(self.d_state, self.mesh, drafter.cfg))
            self.out_shardings = out_shardings_for(self.mesh, target.cfg, d_cfg, self.keep_q)
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), (self.t_state, self.d_state))
        # Without a drafter both modes compile to the same programs (plain steps only).
        signature = (
            self.t_graph,
            self.d_graph,
            str(shapes),
            num_slots,
            cache_len,
            mode if drafter is not None else "",
            nb,
            n_top,
            self.mesh,
        )
        self.cache = cache
        self._token = cache.intern(signature)
        self.compiles = 0  # programs this engine compiled (not found in the cache)
        self.state = init_state(target, drafter, num_slots, cache_len, nb, self.keep_q)
        if self.mesh is not None:
            self.state = shd.place(self.state, state_shardings(DecodeState, self.mesh, target.cfg, d_cfg, self.keep_q))

    @staticmethod
    def check_servable(drafter, target_cfg=None) -> None:
        """Refuses a drafter kind the engine cannot serve: not a block drafter (eagle3: no block pass),
        and a target it cannot serve (``target_cfg``, a :class:`~dspark_jax.config.TargetConfig`: Gemma 4).

        ``drafter``: a drafter, or (no weights: the serving CLI's dry run) its
        :class:`~dspark_jax.config.DrafterConfig`, whose variant decides.

        Raises:
          DSparkInputError: a drafter that is not a :class:`~dspark_jax.drafters.base.BlockDrafter`,
            or a Gemma 4 target (its packed passes are not implemented).
        """
        if target_cfg is not None:
            refuse(target_cfg, "the serving engine")
        if drafter is None:
            return
        if isinstance(drafter, DrafterConfig):
            servable, kind = drafter.variant in BLOCK_VARIANTS, drafter.variant
        else:
            servable = isinstance(drafter, BlockDrafter)
            kind = getattr(drafter.cfg, "variant", type(drafter).__name__)
        if not servable:
            raise DSparkInputError(
                f"the serving engine cannot serve a {kind} "
                "drafter (it drafts autoregressively from its own cache); serve a dspark/dflash drafter, "
                "or evaluate eagle3 with dspark_jax.decoding.speculative / dspark_jax.eval"
            )

    # ------------------------------------------------------------------ executables

    def _get(self, key: tuple, make: Callable[[], tuple], donate=(), out_shardings: Any = None) -> Any:
        """The executable of ``key``, compiled from ``make() -> (fn, example args)`` when not
        cached; on a mesh its outputs get ``out_shardings`` (default: by program kind)."""
        full = (self._token,) + key
        exe = self.cache.get(full)
        if exe is None:
            fn, args = make()
            if out_shardings is None and self.out_shardings is not None:
                out_shardings = self.out_shardings(key[0])
            kw = {} if out_shardings is None else {"out_shardings": out_shardings}
            exe = jax.jit(fn, donate_argnums=donate, **kw).lower(*args).compile()
            self.cache.put(full, exe)
            self.compiles += 1
        return exe

    def _step_fn(self, d_graph, rows: int, tokens: int):
        spec = StepSpec(rows, tokens, self.block_size, self.mode, self.n_top)
        return partial(step_program, t_graph=self.t_graph, d_graph=d_graph, spec=spec)

    def _step_example(self, d_state) -> tuple:
        """Example arguments of a step: every row inactive, flags off."""
        b = self.num_slots
        return (self.t_state, d_state, self.state, StepInputs(np.zeros(b, np.int32), np.zeros(b, bool), *_flags(3)))

    def step_exe(self, rows: int, tokens: int):
        """The step of bucket ``(rows, tokens)`` (state donated)."""

        def make():
            return self._step_fn(self.d_graph, rows, tokens), self._step_example(self.d_state)

        return self._get(("step", rows, tokens), make, donate=(2,))

    def bare_step_exe(self, rows: int):
        """A plain step without drafter context upkeep: the drafter-less engine's program (the
        drafter caches ride along untouched)."""

        def make():
            return self._step_fn(None, rows, rows), self._step_example(None)

        return self._get(("bare_step", rows), make, donate=(2,))

    def catchup_exe(self, rows: int):
        """The drafter catch-up pass over ``rows`` rows, ``block_size + 1`` tokens each."""

        def make():
            w = self.block_size + 1
            fn = partial(catchup_program, t_graph=self.t_graph, d_graph=self.d_graph, rows=rows, width=w)
            z = np.zeros(rows * w, np.int32)
            return fn, (self.t_state, self.d_state, self.state, PackedTokens(z, z, z, z))

        return self._get(("catchup", rows), make, donate=(2,))

    def insert_exe(self, p_len: int, pre: PrefixArrays):
        """Insertion of a prefix of bucket ``p_len`` (state donated)."""

        def make():
            return insert_program, (self.state, pre, _insert_inputs(0, 0, SamplingParams(), no_bias(self.nb)))

        return self._get(("insert", p_len), make, donate=(0,))

    def move_exe(self):
        """The row move (state donated)."""
        return self._get(("move",), lambda: (move_program, (self.state, np.int32(0), np.int32(0))), donate=(0,))

    # ------------------------------------------------------------------ running

    def run_step(self, rows, tokens, ell, active, draft_next, use_bias=False, want_lp=False):
        """Runs the step of bucket ``(rows, tokens)``; returns its outputs (see
        :func:`~dspark_jax.serving.engine.step_programs.step_program`)."""
        inp = StepInputs(ell, active, np.bool_(draft_next), np.bool_(use_bias), np.bool_(want_lp))
        self.state, out = self.step_exe(rows, tokens)(self.t_state, self.d_state, self.state, inp)
        return out

    def run_bare_step(self, rows, ell, active, use_bias: bool, want_lp: bool):
        """Runs the plain step without drafter upkeep; returns its outputs."""
        inp = StepInputs(ell, active, np.bool_(False), np.bool_(use_bias), np.bool_(want_lp))
        self.state, out = self.bare_step_exe(rows)(self.t_state, None, self.state, inp)
        return out

    def run_catchup(self, rows: int, packed: PackedTokens) -> None:
        """Runs one catch-up pass (:class:`PackedTokens` of ``rows * (block_size + 1)`` slots)."""
        self.state = self.catchup_exe(rows)(self.t_state, self.d_state, self.state, packed)

    def run_insert(self, p_len: int, pre: PrefixArrays, row: int, prompt_len: int, sp: SamplingParams, bias) -> None:
        """Writes a prefix of bucket ``p_len`` into ``row``."""
        self.state = self.insert_exe(p_len, pre)(self.state, pre, _insert_inputs(row, prompt_len, sp, bias))

    def run_move(self, src: int, dst: int) -> None:
        """Copies row ``src`` into row ``dst``."""
        self.state = self.move_exe()(self.state, np.int32(src), np.int32(dst))

    def compile_all(self, buckets, bare_rows, examples: dict[int, PrefixArrays]) -> None:
        """Compiles the steps of ``buckets``, the bare steps and catch-up passes of
        ``bare_rows``, the insertion of a prefix of every prefill bucket in ``examples`` (bucket
        -> a prefix of it, the example argument) and the row move."""
        for r, k in buckets:
            self.step_exe(r, k)
        for r in bare_rows:
            self.bare_step_exe(r)
            self.catchup_exe(r)
        for p, pre in examples.items():
            self.insert_exe(p, pre)
        self.move_exe()

    def meta(self) -> dict:
        """What an SPS table must have been measured on: device, models, dtype and shape."""
        dev = jax.devices()[0]
        t, d = self.target, self.drafter
        return {
            "device_kind": f"{dev.platform}:{dev.device_kind}",
            "model": t.cfg.name,
            "fingerprint": getattr(t, "fingerprint", ""),
            "drafter": None if d is None else f"{d.cfg.variant}-g{self.block_size}-n{d.cfg.num_layers}",
            "dtype": str(t.dtype.__name__ if hasattr(t.dtype, "__name__") else t.dtype),
            "num_slots": self.num_slots,
            "block_size": self.block_size,
            "cache_len": self.cache_len,
            **({} if self.mesh is None else {"mesh": shd.describe(self.mesh)}),
        }

    def store_key(self) -> dict:
        """The on-disk key of this engine's SPS table (:func:`~dspark_jax.decoding.cost_table.table_key`):
        :meth:`meta` without the weights' fingerprint (costs do not depend on weight values),
        plus the model configs, verification mode, bias-table size and logprob width."""
        meta = {k: v for k, v in self.meta().items() if k != "fingerprint"}
        d = self.drafter
        return table_key(
            "sps_table",
            **meta,
            target_cfg=self.target.cfg,
            drafter_cfg=None if d is None else d.cfg,
            mode=self.mode,
            bias_entries=self.nb,
            n_top=self.n_top,
        )

    def stored_table(self) -> CostTable | None:
        """The SPS table stored on disk for this engine's shapes (carrying this engine's
        :meth:`meta`), or None (none stored, the cache off, or a refresh requested)."""
        table = stored_table(self.store_key())
        return None if table is None else dataclasses.replace(table, meta=self.meta())

    def store_table(self, table: CostTable) -> None:
        """Stores ``table`` for later processes (a no-op when the cache is off)."""
        store_table(self.store_key(), table)

    def drafts_flags(self) -> list[bool]:
        """Whether steps can draft: ``[False]`` without a drafter, else ``[False, True]``."""
        return [False] if self.block_size == 0 else [False, True]

    @property
    def base_span(self) -> int:
        """The attention span [tokens] of a step whose rows are all inactive: one KV block (every
        packed position is padding, so the pass reads only the first block)."""
        return live_span(0, self.cache_len)

    def _set_pos(self, pos: np.ndarray) -> None:
        """Replaces the rows' anchor positions (same sharding: the compiled steps accept it)."""
        self.state = self.state._replace(pos=jax.device_put(np.asarray(pos, np.int32), self.state.pos.sharding))

    def spans_now(self, spans, busy: int) -> tuple[int, ...]:
        """The spans of ``spans`` that can be profiled with ``busy`` slots in use: all on an idle
        engine, else only :attr:`base_span` (longer spans run row 0 live)."""
        spans = measured_spans(spans, self.cache_len, self.base_span)
        return spans if not busy else (self.base_span,)

    def profile(self, buckets, iters: int, spans=None, busy: int = 0) -> CostTable:
        """Times one step of every bucket with and without drafting at each attention span
        (:func:`~dspark_jax.decoding.cost_table.time_programs`: one warm call each, then ``iters``
        rotated rounds): the SPS table (seconds per step; ``sps()`` its steps per second).

        At :attr:`base_span` (the default) every row is inactive, so no request's state changes.
        A longer span ``s`` [tokens] (whole KV blocks, at most the cache length) runs row 0 live
        with its anchor in the last block below ``s`` (at the base span every row is back at its
        own position), reset before every timing, so that the pass reads the blocks up to ``s``;
        row 0 must then hold no request (the caller profiles such spans on an idle engine only:
        ``busy`` 0), and its position is restored afterwards.

        Raises:
          DSparkInputError: a span beyond :attr:`base_span` while ``busy`` (slots in use) > 0.
        """
        base = self.base_span
        if busy and max(measured_spans(spans, self.cache_len, base)) > base:
            raise DSparkInputError(
                f"profiling at spans beyond {base} tokens needs an idle engine ({busy} slots in use)"
            )
        anchors: dict[int, int | None] = {}  # span -> row 0's anchor position (None: every row inactive)
        for s in measured_spans(spans, self.cache_len, base):
            # the anchor at the start of the block of s - 1, its drafts still inside the cache
            p0 = max(0, min((s - 1) // ATTN_BLOCK * ATTN_BLOCK, self.cache_len - self.block_size - 2))
            span = live_span(p0, self.cache_len) if s > base else base  # the span it really reads
            anchors.setdefault(span, p0 if span > base else None)
        ell, idle = np.zeros(self.num_slots, np.int32), np.zeros(self.num_slots, bool)
        live = idle.copy()
        live[0] = True
        pos = np.asarray(self.state.pos).copy()

        def run(r, k, d, active):
            jax.block_until_ready(self.run_step(r, k, ell, active, d))

        calls = {
            (("engine_step", int(r), int(k), bool(d)), s): partial(run, r, k, d, idle if p0 is None else live)
            for s, p0 in sorted(anchors.items())
            for r, k in buckets
            for d in self.drafts_flags()
        }

        def before(key):  # every row at its own position, row 0 at the span's anchor
            p0 = anchors[key[1]]
            self._set_pos(pos if p0 is None else np.concatenate([[p0], pos[1:]]))

        live_spans = any(p0 is not None for p0 in anchors.values())
        seconds = time_programs(calls, repeats=iters, warm=1, before=before if live_spans else None)
        if live_spans:
            self._set_pos(pos)
        return CostTable(self.meta(), seconds)
