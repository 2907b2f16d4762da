"""The serving engine's settings: one frozen :class:`EngineConfig`, whose defaults are the
server's (``python -m dspark_jax.serve``'s flags read their defaults from it, and
docs/serving.md's defaults table is checked against it).

What is not here is not a setting but a thing the engine is handed: the models, the SPS table
(a :class:`~dspark_jax.decoding.cost_table.CostTable` or its path), the device mesh and a shared
:class:`~dspark_jax.serving.engine.step_programs.ProgramCache`
(:class:`~dspark_jax.serving.engine.Engine`'s keyword arguments).
"""

from __future__ import annotations

import dataclasses

__all__ = ["EngineConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How a :class:`~dspark_jax.serving.engine.Engine` serves (frozen: ``dataclasses.replace``
    makes a changed copy). Checked when an engine is built (``DSparkInputError``).

    Attributes:
      num_slots: decode slots (requests decoded together), >= 1.
      cache_len: KV cache positions per slot (prompt + generated tokens must fit), >= 2.
      policy: ``"plain"``, ``"fixed:G"``, ``"threshold:C"``, ``"greedy"`` or ``"dspark"``
        (:mod:`dspark_jax.serving.engine.scheduler`); None: ``"dspark"`` with a drafter,
        ``"plain"`` without.
      buckets: packed-token budgets of speculative steps (None: 4, 8, 16, 32, 64, 128); for
        ``R`` rows the compiled budgets are ``R`` (plain step) and ``min(k, R * (block_size + 1))``
        for every ``k > R`` here (``fixed:G`` uses exactly ``R * (G + 1)``).
      eos_token_ids: extra ids that end every request (the target's EOS ids always do).
      seed_calibration: start online calibration from the drafter's offline temperatures and
        biases (``DSparkDrafter.calibration``, ``calibration_bias``) instead of ones and zeros.
      profile_iters: timed iterations per bucket when profiling the SPS table.
      profile_spans: attention spans [tokens] the SPS table is profiled at (whole KV blocks;
        None: one block); the planner uses the nearest profiled span at or above the rows'
        live length.
      calibration_window: observations per position kept by online calibration.
      calibration_lr: its learning rate (0 freezes the temperatures).
      row_buckets: compiled row counts (None: powers of two and ``num_slots``; must end at
        ``num_slots``).
      prefill_buckets: compiled prompt lengths (None: powers of two from 16 and ``cache_len``);
        the largest bounds the prompt length.
      suspend_after: consecutive non-drafting steps after which plain steps stop keeping the
        drafter context current (caught up when drafting resumes); None never suspends.
      verification: ``"coupled"`` (every response equals plain decoding with its seed) or
        ``"rejection"`` (the paper's rejection sampling: same output law, higher acceptance at
        T > 0). docs/design.md#verification.
      max_logit_bias: ``logit_bias`` entries per request (a static capacity).
      max_stop_ids: EOS + ``stop_ids`` capacity of a request with ``min_tokens``.
      prefill_chunk_tokens: > 0: batched, chunked prefill of at most this many prompt tokens per
        pass (:class:`~dspark_jax.serving.engine.prefill.ChunkedPrefill`); 0: one-shot prefill,
        one request alone per pass.
      overlap: keep the next step queued on the device while the host works
        (:mod:`~dspark_jax.serving.engine.inflight`).
      plan_ahead: plan and dispatch speculative steps before the step in flight is read
        (:attr:`~dspark_jax.serving.engine.planner.Planner.speculative_ahead`).
    """

    num_slots: int = 8
    cache_len: int = 1024
    policy: str | None = None
    buckets: tuple[int, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    seed_calibration: bool = True
    profile_iters: int = 3
    profile_spans: tuple[int, ...] | None = None
    calibration_window: int = 2048
    calibration_lr: float = 0.05
    row_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    suspend_after: int | None = 16
    verification: str = "coupled"
    max_logit_bias: int = 300
    max_stop_ids: int = 64
    prefill_chunk_tokens: int = 256
    overlap: bool = True
    plan_ahead: bool = False

    def policy_for(self, has_drafter: bool) -> str:
        """:attr:`policy`, or its default: ``"dspark"`` with a drafter, ``"plain"`` without."""
        if self.policy is not None:
            return self.policy
        return "dspark" if has_drafter else "plain"
