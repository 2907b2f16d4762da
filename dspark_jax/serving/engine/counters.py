"""The serving engine's cumulative counters (docs/design.md#metrics) and their snapshot.

Counted on the host by :meth:`Engine.generate` / :meth:`Engine.insert`; tau (the mean accepted
length) is :class:`dspark_jax.decoding.speculative.Generation`'s: tokens the verification
rounds emitted per round, a stop inside an accepted block cutting it, the prefill token not a
round's. The HTTP server exports them to Prometheus (:mod:`dspark_jax.serving.http.prometheus`).
"""

from __future__ import annotations

import numpy as np

from dspark_jax.decoding.round import RoundStats

__all__ = ["EngineMetrics"]


class EngineMetrics:
    """Cumulative engine counters.

    Args:
      block_size: block size (per-position counters have ``max(block_size, 1)`` entries).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        """Zeroes every counter."""
        g = max(self.block_size, 1)
        self.steps = self.rounds = self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.emitted_tokens = self.round_tokens = self.packed_tokens = self.draft_steps = 0
        self.suspended_steps = self.catchup_passes = self.catchup_tokens = 0
        self.step_seconds = 0.0
        self.pos_reached = np.zeros(g, np.int64)
        self.pos_accepted = np.zeros(g, np.int64)
        self.budget_hist: dict[int, int] = {}
        self.rows_hist: dict[int, int] = {}

    def add_step(self, rows: int, tokens: int, packed: int, drafted: bool, suspended: bool, seconds: float) -> None:
        """One engine step in bucket ``(rows, tokens)`` with ``packed`` real tokens."""
        self.steps += 1
        self.step_seconds += seconds
        self.budget_hist[tokens] = self.budget_hist.get(tokens, 0) + 1
        self.rows_hist[rows] = self.rows_hist.get(rows, 0) + 1
        self.draft_steps += int(drafted)
        self.suspended_steps += int(suspended)
        self.packed_tokens += packed

    def add_rounds(self, verified: np.ndarray, stats: RoundStats, kept: np.ndarray) -> None:
        """One step's verification rounds, one per row: ``verified [n]`` drafts verified,
        their :func:`~dspark_jax.decoding.round.round_statistics` (drafts after a stop or the
        length limit cut the block are not counted) and ``kept [n]`` tokens emitted."""
        self.drafts += int(np.count_nonzero(verified))
        self.pos_reached += np.sum(stats.position_reached, axis=0, dtype=np.int64)
        self.pos_accepted += np.sum(stats.position_accepted, axis=0, dtype=np.int64)
        self.draft_tokens += int(np.sum(stats.num_draft_tokens))
        self.accepted_tokens += int(np.sum(stats.num_accepted))
        self.emitted_tokens += int(np.sum(kept))
        self.round_tokens += int(np.sum(kept))
        self.rounds += len(kept)

    def add_catchup(self, tokens: int) -> None:
        """One catch-up pass over ``tokens`` skipped tokens."""
        self.catchup_passes += 1
        self.catchup_tokens += tokens

    def counters(self) -> dict:
        """The counters and derived rates.

        Keys: ``steps`` (engine steps), ``rounds`` (request-steps: target verification passes
        summed over requests), ``drafts`` (rounds that verified >= 1 draft, vLLM's
        num_drafts), ``draft_tokens`` (verified drafts), ``accepted_tokens``,
        ``emitted_tokens`` (including first tokens from prefill), ``packed_tokens``,
        ``draft_steps``, ``step_seconds``, ``suspended_steps`` (plain steps without drafter
        context upkeep), ``catchup_passes`` / ``catchup_tokens`` (target passes and tokens that
        rebuilt skipped drafter context), ``mean_accepted_length`` (tau: tokens per round),
        ``acceptance_rate``, ``position_reached`` / ``position_accepted`` / ``position_acceptance``
        (per block position), ``budget_hist`` / ``rows_hist`` (chosen buckets).
        """
        reached, acc = self.pos_reached, self.pos_accepted
        return {
            "steps": self.steps,
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "packed_tokens": self.packed_tokens,
            "draft_steps": self.draft_steps,
            "step_seconds": self.step_seconds,
            "suspended_steps": self.suspended_steps,
            "catchup_passes": self.catchup_passes,
            "catchup_tokens": self.catchup_tokens,
            # tau as decode.Generation defines it: tokens the verification rounds emitted (a stop
            # inside an accepted block cuts it) per round; the prefill token is not a round's.
            "mean_accepted_length": self.round_tokens / self.rounds if self.rounds else None,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "position_reached": reached.tolist(),
            "position_accepted": acc.tolist(),
            "position_acceptance": [float(a) / r if r else None for a, r in zip(acc, reached)],
            "budget_hist": dict(sorted(self.budget_hist.items())),
            "rows_hist": dict(sorted(self.rows_hist.items())),
        }
