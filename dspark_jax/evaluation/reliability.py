"""Reliability of the confidence head's survival predictions: ECE, Brier, AUROC, tables.

docs/design.md#metrics (paper Appendix A5). The scheduler multiplies per-position
confidences into cumulative survival probabilities ``a_k = c_1 ... c_k``; these functions
measure how well they match the observed survival, both for the held-out fit of
:mod:`dspark_jax.training.calibration` and for the rounds of a decoding run
(:func:`decode_reliability`, used by ``python -m dspark_jax.eval``). Pure numpy.

Survival, ``[N, block_size]`` arrays over blocks (or decoding rounds) and positions:

* predicted: ``prod_{i<=k} sigmoid(z_i / T_i + b_i)`` (:func:`predicted_survival`);
* expected: ``prod_{i<=k} (1 - TV_i)``, the exact probability that the prefix 1..k is
  accepted (:func:`expected_survival`);
* sampled: ``prod_{i<=k} 1[u_i < 1 - TV_i]``, ``u_i ~ U(0, 1)`` (:func:`sampled_survival`).

Metrics (:func:`metrics`): ECE with :data:`N_BINS` equal-width bins
(``sum_b n_b / N * |mean predicted_b - mean observed_b|``), AUROC (Mann-Whitney rank
statistic, ties get average ranks), Brier score; per position and pooled over all
(block, position) pairs where the position exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "N_BINS",
    "auroc",
    "brier",
    "decode_reliability",
    "ece",
    "expected_survival",
    "jsonable",
    "metrics",
    "predicted_survival",
    "reliability",
    "rounds_survival",
    "sampled_survival",
    "sigmoid",
]

N_BINS = 20  # ECE / reliability bins (equal width on [0, 1])


# ======================================================================================
# Survival
# ======================================================================================
def sigmoid(x: np.ndarray | float) -> np.ndarray:
    """Logistic function in float64, ``1 / (1 + exp(-x))`` computed as ``(1 + tanh(x / 2)) / 2``
    (no overflow for large ``|x|``)."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))


def expected_survival(accept: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """``[N, block_size]`` ``prod_{i<=k} (1 - TV_i)`` (0 where invalid)."""
    return np.where(valid, np.cumprod(np.where(valid, accept, 1.0), axis=1), 0.0)


def sampled_survival(accept: np.ndarray, valid: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[N, block_size]`` binary survival ``prod_{i<=k} 1[u_i < 1 - TV_i]``, ``u ~ U(0, 1)``, as float."""
    u = np.random.default_rng(seed).random(accept.shape)
    return (np.cumprod(u < accept, axis=1) & valid).astype(np.float64)


def predicted_survival(
    z: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    biases: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """``[N, block_size]`` predicted cumulative survival ``prod_{i<=k} sigmoid(z_i / T_i + b_i)``
    (temperatures 1 and biases 0 where None)."""
    z = np.asarray(z, np.float64)
    t = np.ones(z.shape[-1]) if temperatures is None else np.asarray(temperatures, np.float64)
    b = np.zeros(z.shape[-1]) if biases is None else np.asarray(biases, np.float64)
    return np.cumprod(sigmoid(z / t + b), axis=-1)


# ======================================================================================
# Metrics
# ======================================================================================
def _bins(pred: np.ndarray, n_bins: int) -> np.ndarray:
    return np.clip((np.asarray(pred, np.float64) * n_bins).astype(np.int64), 0, n_bins - 1)


def ece(pred: np.ndarray, obs: np.ndarray, n_bins: int = N_BINS) -> float:
    """Expected calibration error: ``sum_b n_b / N * |mean pred_b - mean obs_b|``, equal-width bins."""
    pred, obs = np.asarray(pred, np.float64).ravel(), np.asarray(obs, np.float64).ravel()
    if pred.size == 0:
        return float("nan")
    b = _bins(pred, n_bins)
    cnt = np.bincount(b, minlength=n_bins)
    gap = np.abs(np.bincount(b, pred, n_bins) - np.bincount(b, obs, n_bins))  # n_b * |mean gap|
    return float(gap.sum() / cnt.sum())


def brier(pred: np.ndarray, obs: np.ndarray) -> float:
    """Mean squared error of the predicted probabilities against the observations."""
    pred, obs = np.asarray(pred, np.float64).ravel(), np.asarray(obs, np.float64).ravel()
    return float(np.mean((pred - obs) ** 2)) if pred.size else float("nan")


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by the Mann-Whitney U statistic (ties: average ranks).

    Returns NaN when only one class is present.
    """
    s = np.asarray(scores, np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(s.size, np.float64)
    # average rank of each run of ties (1-based ranks)
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_s)) + 1]
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def reliability(pred: np.ndarray, obs: np.ndarray, n_bins: int = N_BINS) -> dict[str, list]:
    """Reliability-diagram table: per equal-width bin, count, mean predicted, mean observed."""
    pred, obs = np.asarray(pred, np.float64).ravel(), np.asarray(obs, np.float64).ravel()
    b = _bins(pred, n_bins)
    cnt = np.bincount(b, minlength=n_bins)
    sp, so = np.bincount(b, pred, n_bins), np.bincount(b, obs, n_bins)
    mean = lambda x: [float(v / c) if c else None for v, c in zip(x, cnt)]
    return {
        "bin_edges": np.linspace(0, 1, n_bins + 1).tolist(),
        "count": cnt.tolist(),
        "mean_predicted": mean(sp),
        "mean_observed": mean(so),
    }


def _row(p: np.ndarray, o: np.ndarray, y: np.ndarray | None, n_bins: int) -> dict[str, Any]:
    """One metrics row; ``y`` (binary labels, when they differ from ``o``) adds AUROC and ``*_sampled``."""
    if p.size == 0:
        return {"n": 0}
    row = {
        "n": int(p.size),
        "mean_predicted": float(p.mean()),
        "mean_observed": float(o.mean()),
        "ece": ece(p, o, n_bins),
        "brier": brier(p, o),
    }
    if y is None:
        row["auroc"] = auroc(p, o)
    else:
        row.update(
            mean_observed_sampled=float(y.mean()),
            ece_sampled=ece(p, y, n_bins),
            brier_sampled=brier(p, y),
            auroc=auroc(p, y),
        )
    return row


def metrics(
    pred: np.ndarray, valid: np.ndarray, obs: np.ndarray, labels: np.ndarray | None = None, n_bins: int = N_BINS
) -> dict[str, Any]:
    """Calibration metrics of cumulative survival predictions, pooled and per position.

    Args:
      pred: ``[N, block_size]`` predicted survival; valid: ``[N, block_size]`` bool.
      obs: ``[N, block_size]`` observed survival for ECE / Brier (soft or 0/1).
      labels: ``[N, block_size]`` 0/1 outcomes for AUROC (and ``*_sampled`` ECE/Brier);
        ``None``: AUROC against ``obs`` (which should then be binary).
    Returns:
      ``{"pooled": row, "per_position": [row] * block_size}``, each row with ``n``,
      ``mean_predicted``, ``mean_observed``, ``ece``, ``brier``, ``auroc`` (plus
      ``ece_sampled``, ``brier_sampled``, ``mean_observed_sampled`` with ``labels``).
    """
    valid = np.asarray(valid, bool)
    pred, obs = np.asarray(pred, np.float64), np.asarray(obs, np.float64)
    lab = None if labels is None else np.asarray(labels, np.float64)

    def row(m):
        return _row(pred[m], obs[m], None if lab is None else lab[m], n_bins)

    per = []
    for k in range(valid.shape[1]):
        m = np.zeros_like(valid)
        m[:, k] = valid[:, k]
        per.append(row(m))
    return {"pooled": row(valid), "per_position": per}


def jsonable(obj: Any) -> Any:
    """``obj`` with NaN / inf floats replaced by None and numpy scalars by Python ones (strict JSON)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


# ======================================================================================
# Decode-time reliability
# ======================================================================================
def rounds_survival(rounds: Sequence[dict[str, np.ndarray]], block_size: int) -> tuple[np.ndarray, ...]:
    """Per-round records of decoding -> ``(z [R, block_size], outcomes [R, block_size], valid [R, block_size])``.

    ``outcomes[r, k-1] = 1[k <= accepted_r]`` (the prefix 1..k survived verification),
    ``valid[r, k-1] = k <= verified_r`` (position k was verified or lies after an
    earlier rejection within the verified length).
    """
    rs = [r for r in rounds if r is not None and len(r["accepted"])]
    if not rs:
        e = np.zeros((0, block_size))
        return e, e, e.astype(bool)
    z = np.concatenate([r["conf_logit"] for r in rs]).astype(np.float64)
    acc = np.concatenate([r["accepted"] for r in rs])
    ver = np.concatenate([r["verified"] for r in rs])
    k = np.arange(1, block_size + 1)
    return z, (k[None, :] <= acc[:, None]).astype(np.float64), k[None, :] <= ver[:, None]


def decode_reliability(
    rounds: Sequence[dict[str, np.ndarray]],
    block_size: int,
    temperatures: Sequence[float] | None,
    n_bins: int = N_BINS,
    biases: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Calibration of the cumulative survival observed during decoding.

    Predicted ``a_k = prod_{i<=k} sigmoid(z_i / T_i + b_i)`` of each round's draft against
    the binary outcome "positions 1..k all accepted", over the verified positions.

    Returns:
      ``{"num_rounds", "before": metrics+reliability (raw head), "after": ... (with
      ``temperatures`` and ``biases`` (None: 0); absent when ``temperatures`` is None)}``.
    """
    z, y, valid = rounds_survival(rounds, block_size)
    out: dict[str, Any] = {
        "num_rounds": int(z.shape[0]),
        "observed": "binary survival of verification (positions 1..k accepted), "
        "over verified positions of every decoding round",
    }
    if not valid.any():
        return out
    for name, t in (("before", None), ("after", temperatures)):
        if name == "after" and t is None:
            continue
        pred = predicted_survival(z, t, biases if name == "after" else None)
        rep = metrics(pred, valid, y, None, n_bins)
        rep["reliability"] = reliability(pred[valid], y[valid], n_bins)
        out[name] = rep
    return out
