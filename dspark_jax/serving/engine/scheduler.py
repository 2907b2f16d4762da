"""Verification-length policies: how many drafted tokens of each request the target verifies.

docs/design.md#scheduler (paper Sections 7-8). Every function here is a pure
numpy function of *confidences* (and of the SPS table); none of them ever sees a draft token
value, which is what makes them non-anticipating: whether draft position ``k`` is verified
cannot depend on the token drawn there (the engine keeps draft tokens on the device and hands
the host only the confidence logits).

Notation for one engine step with ``n`` active requests (rows), block size ``G``:

* ``surv [n, G]``: cumulative survival ``a_{r,k} = prod_{i<=k} c_{r,i}``, the predicted
  probability that draft ``k`` of row ``r`` is accepted (non-increasing in ``k``).
* ``cap [n]``: the most drafts row ``r`` may verify (0 when it has no draft, else
  ``min(G, room before max_new_tokens / the cache end)``).
* ``l [n]``: chosen verification lengths (drafts verified per row, ``0 <= l_r <= cap_r``).
  The verify pass then holds ``t = n + sum_r l_r`` packed tokens (every row verifies its
  anchor, i.e. always emits at least one token).
* ``sps_of_total [T+1]``: steps per second of the compiled bucket that a pass of ``t``
  tokens runs in (``SPS(bucket(t))``, a jagged step function of ``t``); 0 where no bucket
  fits.
* Throughput objective: ``Theta(l) = E[emitted] * SPS(bucket(t))`` with
  ``E[emitted] = sum_r (1 + sum_{k<=l_r} a_{r,k})``.

Key fact used everywhere: because ``a_{r,k}`` is non-increasing in ``k``, for any number of
admitted drafts ``m`` the set of the ``m`` largest survival probabilities (ties broken by
position ``k`` then row) is a union of per-row prefixes, i.e. an admissible allocation, and it
maximises ``E[emitted]`` among all allocations of ``m`` drafts. Hence the exact optimum over
all admissible allocations is ``max_m (n + S_m) * SPS(n + m)`` with ``S_m`` the sum of the top
``m`` candidates (:func:`optimal_lengths`).

Policies (selected per engine, see :mod:`dspark_jax.serving.engine`):

* :func:`fixed_lengths` -- a fixed number of speculative tokens (1 is the MTP-1 production baseline);
* :func:`threshold_lengths` -- verify draft ``k`` while ``a_{r,k} >= C``;
* :func:`greedy_lengths` -- the clean greedy scheduler: admit candidates in order of
  decreasing survival, stop at the first admission that lowers Theta. Guarantee (tested
  against brute force): it returns the first local maximum of ``m -> Theta_m``; this is the
  global optimum whenever the step time ``1 / SPS(t)`` is convex and non-decreasing in ``t``
  (then ``Theta_m`` = concave / convex-positive is quasi-concave, hence unimodal), e.g. an
  affine cost; on a jagged bucketed SPS curve it can stop early at a bucket edge;
* :func:`deployed_lengths` -- the deployed DSpark variant: the token budget ``K`` is chosen
  by a global search over the jagged SPS table using confidences two steps old, then the
  ``K - n`` draft places are filled with the top *current* candidates.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "best_budget",
    "candidate_order",
    "deployed_lengths",
    "fill_lengths",
    "fixed_lengths",
    "greedy_lengths",
    "optimal_lengths",
    "survival",
    "theta_curve",
    "threshold_lengths",
]


def survival(conf: np.ndarray) -> np.ndarray:
    """Cumulative survival ``a_k = prod_{i<=k} c_i``.

    Args:
      conf: ``[n, G]`` float confidences ``c_{r,k}`` in ``[0, 1]`` (calibrated).
    Returns:
      ``[n, G]`` float64, non-increasing along ``k``.
    """
    c = np.clip(np.asarray(conf, np.float64), 0.0, 1.0)
    return np.cumprod(c, axis=-1)


def _caps(surv: np.ndarray, cap) -> np.ndarray:
    n, g = surv.shape
    return np.clip(np.broadcast_to(np.asarray(cap, np.int64), (n,)), 0, g)


def candidate_order(surv: np.ndarray, cap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Admissible draft candidates sorted by decreasing survival.

    Ties are broken by position ``k`` then row, so every prefix of the order is a union of
    per-row prefixes (``a_{r,k}`` is non-increasing in ``k``).

    Args:
      surv: ``[n, G]`` survival probabilities.
      cap: ``[n]`` (or scalar) int, drafts row ``r`` may verify.
    Returns:
      ``(rows [M], positions [M] (0-based k), probs [M])``, ``M = sum(cap)``.
    """
    surv = np.asarray(surv, np.float64)
    n, g = surv.shape
    caps = _caps(surv, cap)
    kk = np.broadcast_to(np.arange(g), (n, g))
    rr = np.broadcast_to(np.arange(n)[:, None], (n, g))
    ok = kk < caps[:, None]
    r, k, a = rr[ok], kk[ok], surv[ok]
    order = np.lexsort((r, k, -a))
    return r[order], k[order], a[order]


def _lengths_from_prefix(n: int, rows: np.ndarray, m: int) -> np.ndarray:
    return np.bincount(rows[:m], minlength=n).astype(np.int32)


def theta_curve(surv: np.ndarray, cap, sps_of_total: np.ndarray, n_base: int | None = None):
    """Theta after admitting the top ``m`` candidates, for every ``m``.

    Args:
      surv / cap: as in :func:`candidate_order`.
      sps_of_total: ``[T+1]`` SPS of the bucket a pass of ``t`` tokens runs in (0: no bucket).
      n_base: tokens every row contributes without drafts (default ``n``, one anchor each).
    Returns:
      ``(rows, theta)``: the candidate rows in admission order ``[M]`` and
      ``theta [M+1]`` float64 (``theta[m]``: expected emitted tokens per second with ``m``
      drafts admitted; 0 where ``n + m`` tokens fit no bucket).
    """
    surv = np.asarray(surv, np.float64)
    n = surv.shape[0] if n_base is None else n_base
    rows, _, probs = candidate_order(surv, cap)
    sps = np.asarray(sps_of_total, np.float64)
    emitted = n + np.concatenate([[0.0], np.cumsum(probs)])
    t = n + np.arange(len(emitted))
    rate = np.where(t < len(sps), sps[np.minimum(t, len(sps) - 1)], 0.0)
    return rows, emitted * rate


def fixed_lengths(cap, num_speculative_tokens: int) -> np.ndarray:
    """Fixed length: every row verifies ``min(num_speculative_tokens, cap_r)`` drafts. ``[n]`` int32."""
    return np.minimum(np.asarray(cap, np.int64), int(num_speculative_tokens)).clip(0).astype(np.int32)


def threshold_lengths(surv: np.ndarray, cap, threshold: float) -> np.ndarray:
    """Confidence threshold: verify draft ``k`` while ``a_{r,k} >= threshold``. ``[n]`` int32."""
    surv = np.asarray(surv, np.float64)
    n, g = surv.shape
    ok = (surv >= threshold) & (np.arange(g)[None, :] < _caps(surv, cap)[:, None])
    return np.sum(np.cumprod(ok, axis=1), axis=1).astype(np.int32)


def greedy_lengths(surv: np.ndarray, cap, sps_of_total: np.ndarray) -> np.ndarray:
    """The clean greedy scheduler (docs/design.md#scheduler).

    Pools all candidates ``(r, k, a_{r,k})``, sorts them by ``a`` descending and admits
    them in order; stops at the first admission that lowers Theta (so it returns the first
    local maximum of ``m -> Theta_m``; see the module docstring for when that is optimal).

    Returns:
      ``[n]`` int32 verification lengths.
    """
    surv = np.asarray(surv, np.float64)
    rows, theta = theta_curve(surv, cap, sps_of_total)
    drops = np.nonzero(theta[1:] < theta[:-1])[0]
    m = int(drops[0]) if len(drops) else len(rows)
    return _lengths_from_prefix(surv.shape[0], rows, m)


def optimal_lengths(surv: np.ndarray, cap, sps_of_total: np.ndarray) -> np.ndarray:
    """Exact maximiser of Theta over all admissible allocations (global search over ``m``).

    Ties prefer fewer drafts. ``[n]`` int32.
    """
    surv = np.asarray(surv, np.float64)
    rows, theta = theta_curve(surv, cap, sps_of_total)
    return _lengths_from_prefix(surv.shape[0], rows, int(np.argmax(theta)))


def best_budget(surv: np.ndarray, cap, sps_of_total: np.ndarray, budgets) -> int:
    """Token budget ``K`` maximising forecast Theta over the compiled buckets (global search).

    For each budget ``K`` (packed tokens of a compiled bucket, ``K >= n``) the forecast
    fills its ``K - n`` draft places with the best candidates of ``surv`` and scores
    ``(n + S_{K-n}) * SPS(K)``; the jagged SPS table may make a larger bucket win over a
    smaller one (no local stopping). Ties prefer the smaller budget.

    Args:
      surv / cap: forecast survival and caps (e.g. confidences two steps old).
      sps_of_total: as in :func:`theta_curve`.
      budgets: the compiled token budgets available for this row count.
    Returns:
      the chosen ``K`` (int).
    """
    surv = np.asarray(surv, np.float64)
    n = surv.shape[0]
    _, _, probs = candidate_order(surv, cap)
    emitted = n + np.concatenate([[0.0], np.cumsum(probs)])
    sps = np.asarray(sps_of_total, np.float64)
    best_k, best = n, -1.0
    for k in sorted(int(b) for b in budgets if n <= b < len(sps)):
        val = emitted[min(k - n, len(probs))] * sps[k]
        if val > best:
            best_k, best = k, val
    return int(best_k)


def fill_lengths(surv: np.ndarray, cap, num_drafts: int) -> np.ndarray:
    """Admits the ``num_drafts`` best current candidates (fewer if there are fewer). ``[n]``."""
    surv = np.asarray(surv, np.float64)
    rows, _, _ = candidate_order(surv, cap)
    return _lengths_from_prefix(surv.shape[0], rows, max(0, min(int(num_drafts), len(rows))))


def deployed_lengths(
    surv_old: np.ndarray, surv_now: np.ndarray, cap, sps_of_total: np.ndarray, budgets
) -> tuple[np.ndarray, int]:
    """The deployed DSpark scheduler: budget from stale confidences, filled by current ones.

    Args:
      surv_old: ``[n, G]`` survival from confidences two steps old (rows without such a
        history carry a prior, never their current confidences).
      surv_now: ``[n, G]`` current survival (confidences of the drafts being verified).
      cap: ``[n]`` admissible drafts per row (now).
      sps_of_total / budgets: as in :func:`best_budget`.
    Returns:
      ``(lengths [n] int32, budget K)``; ``n + sum(lengths) <= K`` (less only when there are
      fewer candidates than places).
    """
    k = best_budget(surv_old, cap, sps_of_total, budgets)
    n = np.asarray(surv_now).shape[0]
    return fill_lengths(surv_now, cap, k - n), k
