"""Results of the decode loops: per-row statistics, per-round logs and per-request generations.

docs/design.md#metrics: every count covers emitted tokens only (a stop inside a block discards
the drafts after it). The loops of :mod:`dspark_jax.decoding.speculative` accumulate
:class:`DecodeStats` (and, with ``record_rounds``, a :class:`RoundLog`) on device, one round
(:func:`~dspark_jax.decoding.round.round_statistics`) at a time; :func:`generations` turns
the finished arrays into one :class:`Generation` per request.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.round import FINISH_NAMES, RoundStats

__all__ = ["BatchResult", "DecodeStats", "Generation", "RoundLog", "generations"]


class DecodeStats(NamedTuple):
    """Per-row speculative metrics (docs/design.md#metrics), counting emitted tokens only.

    Attributes:
      num_passes: ``[B]`` target verification passes (prefill excluded).
      num_emitted: ``[B]`` tokens emitted by those passes.
      num_draft_tokens: ``[B]`` draft tokens submitted for verification (none counted after a stop).
      num_accepted: ``[B]`` accepted draft tokens that were emitted.
      position_reached: ``[B, block_size]`` blocks whose positions 1..k-1 were accepted and k verified.
      position_accepted: ``[B, block_size]`` of those, blocks where position k was accepted too.
      num_drafting_rounds: ``[B]`` passes whose round ran the drafter (``"auto"`` skips drafting
        when it does not pay; fixed lengths always draft).
      verify_width_rounds: ``[B, block_size + 1]`` passes by compiled verification width ``w``
        (a pass of ``w + 1`` tokens, what the round's cost depends on; a fixed length ``n`` runs
        passes of width ``n``).
    """

    num_passes: jax.Array
    num_emitted: jax.Array
    num_draft_tokens: jax.Array
    num_accepted: jax.Array
    position_reached: jax.Array
    position_accepted: jax.Array
    num_drafting_rounds: jax.Array
    verify_width_rounds: jax.Array

    @classmethod
    def zeros(cls, b: int, block_size: int) -> DecodeStats:
        z = jnp.zeros((b,), jnp.int32)
        zg = jnp.zeros((b, max(block_size, 1)), jnp.int32)
        return cls(z, z, z, z, zg, zg, z, jnp.zeros((b, block_size + 1), jnp.int32))

    def add(
        self, running: jax.Array, num_kept: jax.Array, rs: RoundStats, width: jax.Array, drafted: jax.Array
    ) -> DecodeStats:
        """Adds one round (:func:`~dspark_jax.decoding.round.round_statistics`) of every row.

        ``width``: ``[]`` int32 compiled verification width of the round; ``drafted``: ``[]`` bool
        whether it ran the drafter (both shared by the batch; only running rows count them).
        """
        run = running.astype(jnp.int32)
        one_hot = jnp.arange(self.verify_width_rounds.shape[1], dtype=jnp.int32)[None, :] == width
        return DecodeStats(
            num_passes=self.num_passes + running,
            num_emitted=self.num_emitted + num_kept,
            num_draft_tokens=self.num_draft_tokens + rs.num_draft_tokens,
            num_accepted=self.num_accepted + rs.num_accepted,
            position_reached=self.position_reached + rs.position_reached,
            position_accepted=self.position_accepted + rs.position_accepted,
            num_drafting_rounds=self.num_drafting_rounds + run * drafted.astype(jnp.int32),
            verify_width_rounds=self.verify_width_rounds + run[:, None] * one_hot.astype(jnp.int32),
        )


class RoundLog(NamedTuple):
    """Optional per-round record of speculative decoding (``record_rounds=True``).

    Round ``r`` of row ``b`` is loop step ``r``; rows run from step 0 until they
    finish, so a row's rounds are ``0 .. num_passes[b] - 1``.

    Attributes:
      conf_logit: ``[B, R, block_size]`` float32 raw confidence logits z_k of the round's
        draft (before calibration), for reliability of the predicted survival.
      num_accepted: ``[B, R]`` int32 accepted drafts that were emitted.
      num_draft_tokens: ``[B, R]`` int32 drafts counted as verified (as in :class:`DecodeStats`);
        position k (1-based) of the round survived iff ``k <= num_accepted``, and it
        counts as an observation iff ``k <= num_draft_tokens``.
    """

    conf_logit: jax.Array
    num_accepted: jax.Array
    num_draft_tokens: jax.Array


@dataclasses.dataclass
class Generation:
    """Result of one request.

    Attributes:
      token_ids: generated token ids (prompt excluded), stop token included.
      finish_reason: ``"stop"`` (stop/EOS token), ``"length"`` (max_new_tokens or
        context end) or ``"error"`` (non-finite logits).
      num_target_passes: target verification passes after prefill.
      tau: mean tokens emitted per target verification pass. THE definition used by
        ``generate --json``, the Python API, the server (``spec_decode.tau``) and its
        ``/metrics`` (``dspark:spec_decode_mean_accepted_length``): ``(len(token_ids) - 1) /
        num_target_passes``. The first generated token comes from prefill; each pass
        emits its accepted drafts plus the correction/bonus token, fewer when a stop (token
        or string) or the length limit ends the request inside the block (nothing after
        the stop is counted, and a pass that adds no token to the output is not a pass).
        NaN here (None in JSON outputs) when no pass ran.
      acceptance_rate: accepted drafts / verified drafts (None when nothing verified).
      position_acceptance: conditional acceptance per block position k (None where
        position k was never reached).
      num_accepted / num_draft_tokens: accepted and verified draft tokens (the server's
        ``num_accepted_tokens`` / ``num_draft_tokens``); ``num_verified`` is the older name
        of ``num_draft_tokens`` (read-only).
      position_reached / position_accepted: per block position k, blocks whose
        positions 1..k-1 were accepted and k verified / of those, blocks where k was
        accepted too (``position_accepted[k-1]`` = rounds with >= k accepted drafts).
      num_drafting_rounds: passes whose round ran the drafter (< ``num_target_passes`` only
        with ``num_speculative_tokens="auto"``).
      verify_width_rounds: passes by compiled verification width ``w`` (index ``w``: a pass of
        ``w + 1`` tokens), the mix a cost-table bound needs (``benchmarks/speedup.py``).
      rounds: with ``record_rounds=True``, per-round numpy arrays of this request
        (see :class:`RoundLog`): ``conf_logit [n, block_size]``, ``accepted [n]``,
        ``verified [n]`` (its ``num_draft_tokens``) for its ``n = num_target_passes``
        rounds; else None.
    """

    token_ids: list[int]
    finish_reason: str
    num_target_passes: int
    tau: float
    acceptance_rate: float | None
    position_acceptance: list[float | None]
    num_accepted: int = 0
    num_draft_tokens: int = 0
    position_reached: list[int] = dataclasses.field(default_factory=list)
    position_accepted: list[int] = dataclasses.field(default_factory=list)
    num_drafting_rounds: int = 0
    verify_width_rounds: list[int] = dataclasses.field(default_factory=list)
    rounds: dict[str, np.ndarray] | None = None

    @property
    def num_verified(self) -> int:
        """Older name of :attr:`num_draft_tokens`."""
        return self.num_draft_tokens


@dataclasses.dataclass
class BatchResult:
    """Generations of a batch plus timing (seconds, tokens/s; compilation excluded), the
    KV-cache length [tokens] the loop ran with (0: not recorded) and the verification length it
    ran with (an int, ``"auto"``, or 0 for plain decoding)."""

    generations: list[Generation]
    seconds: float
    compile_seconds: float
    cache_len: int = 0
    num_speculative_tokens: int | str = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(g.token_ids) for g in self.generations)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def _generation(st, rl, i: int, ids: list[int], finish: int, speculative: bool) -> Generation:
    """Row ``i`` of numpy :class:`DecodeStats` ``st`` (and :class:`RoundLog` ``rl`` or None)."""
    passes = int(st.num_passes[i])
    reached, acc = st.position_reached[i], st.position_accepted[i]
    n_draft = int(st.num_draft_tokens[i])
    return Generation(
        token_ids=ids,
        finish_reason=FINISH_NAMES[finish] or "length",
        num_target_passes=passes,
        tau=int(st.num_emitted[i]) / passes if passes else float("nan"),
        acceptance_rate=(int(st.num_accepted[i]) / n_draft) if speculative and n_draft else None,
        position_acceptance=[(float(a) / float(r)) if r else None for a, r in zip(acc, reached)] if speculative else [],
        num_accepted=int(st.num_accepted[i]),
        num_draft_tokens=n_draft,
        position_reached=reached.tolist() if speculative else [],
        position_accepted=acc.tolist() if speculative else [],
        num_drafting_rounds=int(st.num_drafting_rounds[i]) if speculative else 0,
        verify_width_rounds=st.verify_width_rounds[i].tolist() if speculative else [],
        rounds=None
        if rl is None
        else {
            "conf_logit": rl.conf_logit[i, :passes],
            "accepted": rl.num_accepted[i, :passes],
            "verified": rl.num_draft_tokens[i, :passes],
        },
    )


def generations(seq, length, finish, lens, stats: DecodeStats, rounds: RoundLog | None, speculative: bool):
    """Per-request :class:`Generation` of a finished decode loop.

    Args:
      seq: ``[B, S]`` int32 token buffer; length: ``[B]`` confirmed tokens; finish: ``[B]``
        FINISH_* codes (:mod:`dspark_jax.decoding.round`); lens: ``[B]`` prompt lengths.
      stats / rounds: the loop's :class:`DecodeStats` and optional :class:`RoundLog`.
      speculative: fill the acceptance fields (plain decoding leaves them empty).
    Returns:
      ``list[Generation]``, one per row.
    Raises:
      FloatingPointError: a request's target logits were NaN/inf.
    """
    seq, length, finish = (np.asarray(x) for x in (seq, length, finish))
    st = jax.tree.map(np.asarray, stats)
    rl = None if rounds is None else jax.tree.map(np.asarray, rounds)
    gens = []
    for i in range(seq.shape[0]):
        g = _generation(st, rl, i, seq[i, lens[i] : length[i]].tolist(), int(finish[i]), speculative)
        if g.finish_reason == "error":
            raise FloatingPointError(
                f"request {i}: the target produced NaN/inf logits after {len(g.token_ids)} tokens "
                "(check the weights and dtype)"
            )
        gens.append(g)
    return gens
