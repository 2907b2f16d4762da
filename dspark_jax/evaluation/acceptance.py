"""Drafter evaluation on prompt sets: tau, acceptance, position-wise acceptance.

Metric definitions follow docs/design.md#metrics:
tau = tokens emitted per target verification pass (accepted drafts + the
bonus/correction token), aggregated as total emitted / total passes over all
requests; acceptance rate = accepted drafts / verified drafts; conditional
acceptance at position k = among blocks whose positions 1..k-1 were accepted
(and k verified), the fraction where k was accepted; accept rate @k = the
fraction of rounds (target passes) with at least k accepted drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dspark_jax.decoding.request import DecodeRequest, decode, resolve_num_speculative_tokens
from dspark_jax.decoding.results import BatchResult
from dspark_jax.drafters.base import Drafter
from dspark_jax.models.target import Target


def aggregate(results: Sequence[BatchResult]) -> dict[str, Any]:
    """Pools per-request counters of several batches into corpus-level metrics."""
    gens = [g for r in results for g in r.generations]
    passes = sum(g.num_target_passes for g in gens)
    emitted = sum(g.num_target_passes * g.tau for g in gens if g.num_target_passes)
    acc = sum(g.num_accepted for g in gens)
    ver = sum(g.num_verified for g in gens)
    return {
        "num_requests": len(gens),
        "num_generated_tokens": sum(len(g.token_ids) for g in gens),
        "num_target_passes": passes,
        "tau": emitted / passes if passes else float("nan"),
        "acceptance_rate": acc / ver if ver else float("nan"),
        "tokens_per_s": sum(r.num_tokens for r in results) / max(sum(r.seconds for r in results), 1e-9),
    }


def evaluate_tau(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_speculative_tokens: int | str,
    batch_size: int = 16,
    seed: int = 0,
    record_rounds: bool = False,
) -> dict[str, Any]:
    """Speculative decoding over ``prompts`` through the decoding front door
    (:func:`~dspark_jax.decoding.request.decode`, prompt ``i`` with seed ``seed + i``); returns
    pooled metrics.

    Args:
      num_speculative_tokens: verification length, ``1..block_size`` or ``"auto"`` (resolved by the
        front door, :func:`~dspark_jax.decoding.request.resolve_num_speculative_tokens`); required:
        ``drafter.cfg.block_size`` measures the acceptance of every block position, the eval
        command passes the front door's default, ``"auto"``, unless told otherwise.
      record_rounds: also return the per-round records of every request under
        ``"rounds"`` (a list of :attr:`~dspark_jax.decoding.speculative.Generation.rounds` dicts of
        numpy arrays, not JSON-serialisable: pop it before writing JSON).

    Returns:
      dict with ``tau``, ``acceptance_rate``, ``position_acceptance`` (list over
      k = 1..block_size; ``position_reached`` / ``position_accepted``: its counts),
      ``accept_rate_at_k`` (list over k = 1..the verification length, the block size with
      ``"auto"``: fraction of rounds with >= k accepted drafts), ``num_requests``, ``num_target_passes``,
      ``tokens_per_s`` (compilation excluded), per request in prompt order ``request_tau`` and
      ``request_target_passes`` (so ``tau`` = their passes-weighted mean; for standard errors
      across prompts), ``request_acceptance_rate`` and ``request_token_ids``, and the settings used
      (``num_speculative_tokens``: as the front door resolved it, an int or ``"auto"``).
    Raises:
      DSparkInputError: as :func:`~dspark_jax.decoding.request.decode`, a num_speculative_tokens
        that is None among them.
    """
    settings = (max_new_tokens, temperature, top_k, top_p)
    requests = [DecodeRequest(p, *settings, seed + i, num_speculative_tokens) for i, p in enumerate(prompts)]
    results = []
    reached = np.zeros(drafter.cfg.block_size)
    accepted = np.zeros(drafter.cfg.block_size)
    for s in range(0, len(requests), batch_size):
        res = decode(target, drafter, requests[s : s + batch_size], record_rounds=record_rounds)
        results.append(res)
        for g in res.generations:
            reached += g.position_reached
            accepted += g.position_accepted
    out = aggregate(results)
    gens = [g for r in results for g in r.generations]
    out["request_tau"] = [float(g.tau) for g in gens]
    out["request_target_passes"] = [int(g.num_target_passes) for g in gens]
    out["request_acceptance_rate"] = [g.acceptance_rate for g in gens]
    out["request_token_ids"] = [list(g.token_ids) for g in gens]
    out["position_acceptance"] = [float(a / r) if r else None for a, r in zip(accepted, reached)]
    # Raw counts, so acceptance can be pooled exactly over several prompt sets.
    out["position_reached"] = [int(r) for r in reached]
    out["position_accepted"] = [int(a) for a in accepted]
    n_spec = (
        results[0].num_speculative_tokens
        if results
        else resolve_num_speculative_tokens(drafter, num_speculative_tokens)
    )
    num_verified = drafter.cfg.block_size if n_spec == "auto" else int(n_spec)
    passes = out["num_target_passes"]
    out["accept_rate_at_k"] = [float(a / passes) if passes else None for a in accepted[:num_verified]]
    if record_rounds:
        out["rounds"] = [g.rounds for r in results for g in r.generations]
    out.update(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_speculative_tokens=n_spec,
        block_size=drafter.cfg.block_size,
    )
    return out
