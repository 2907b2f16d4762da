"""Sequential temperature scaling of the confidence head (paper Appendix A5): the fit itself.

One temperature per block position, fit left to right on held-out blocks
(:func:`fit_temperatures`), optionally weighted by how often decoding verifies each block
(:func:`decode_weights`). The data collection, the reports and the training stage that calls
this live in :mod:`dspark_jax.training.calibration`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dspark_jax.evaluation.reliability import sigmoid

__all__ = ["T_BOUNDS", "CalibrationData", "decode_weights", "fit_temperatures"]

T_BOUNDS = (0.05, 20.0)  # search range of each temperature


class CalibrationData(NamedTuple):
    """Teacher-forced blocks of held-out sequences (numpy; one row per anchor block).

    Attributes:
      z: ``[N, block_size]`` float32 raw confidence logits.
      accept: ``[N, block_size]`` float32 exact acceptance probability ``1 - TV_k``.
      valid: ``[N, block_size]`` bool; prefix-closed (position k valid => 1..k-1 valid).
      seq: ``[N]`` int index of the source sequence (for splits by sequence).
      anchor: ``[N]`` int position of the block's anchor in its sequence.
    """

    z: np.ndarray
    accept: np.ndarray
    valid: np.ndarray
    seq: np.ndarray
    anchor: np.ndarray

    def take(self, mask: np.ndarray) -> CalibrationData:
        return CalibrationData(*(x[mask] for x in self))


def _loss_fn(name: str):
    """``f(predicted, observed, weights)``: the weighted mean loss of one position."""
    if name == "brier":
        return lambda a, o, w: float(np.average((a - o) ** 2, weights=w))
    if name == "nll":

        def nll(a, o, w):
            a = np.clip(a, 1e-7, 1 - 1e-7)
            return float(-np.average(o * np.log(a) + (1 - o) * np.log1p(-a), weights=w))

        return nll
    raise ValueError(f"loss must be 'brier' or 'nll', got {name!r}")


def _minimize_1d(f, lo: float, hi: float, grid: int = 49, iters: int = 40) -> float:
    """Grid search then golden-section refinement around the best grid point."""
    xs = np.linspace(lo, hi, grid)
    vals = [f(x) for x in xs]
    i = int(np.argmin(vals))
    a, b = xs[max(i - 1, 0)], xs[min(i + 1, grid - 1)]
    gr = (np.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = f(d)
    best = min([(vals[i], xs[i]), (fc, c), (fd, d)])
    return float(best[1])


def fit_temperatures(
    z: np.ndarray,
    observed: np.ndarray,
    valid: np.ndarray,
    *,
    loss: str = "brier",
    bounds: tuple[float, float] = T_BOUNDS,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Sequential temperature scaling: one ``T_k`` per position, fit left to right.

    For k = 1..block_size, with ``T_1..T_{k-1}`` fixed, ``T_k`` minimises the loss of the
    predicted cumulative survival ``a_k = a_{k-1} * sigmoid(z_k / T_k)`` against the
    observed survival over the blocks where position k exists: a 1-D search on
    ``log T`` in ``bounds`` (grid, then golden section).

    Args:
      z: ``[N, block_size]`` raw confidence logits.
      observed: ``[N, block_size]`` observed survival (expected ``prod (1 - TV)`` or sampled 0/1).
      valid: ``[N, block_size]`` bool.
      loss: ``"brier"`` (squared error) or ``"nll"`` (binary cross-entropy, soft labels allowed).
      weights: optional ``[N]`` non-negative block weights (e.g. :func:`decode_weights`);
        default: every block alike.
    Returns:
      ``[block_size]`` float64 temperatures (positions without data repeat the previous one).
    """
    f = _loss_fn(loss)
    z = np.asarray(z, np.float64)
    n, block_size = z.shape
    w_all = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    temps = np.ones(block_size)
    prev = np.ones(n)
    for k in range(block_size):
        m = np.asarray(valid[:, k], bool) & (w_all > 0)
        if not m.any():
            temps[k] = temps[k - 1] if k else 1.0
        else:
            zk, pk, ok, wk = z[m, k], prev[m], np.asarray(observed, np.float64)[m, k], w_all[m]
            temps[k] = np.exp(
                _minimize_1d(lambda lt, pk=pk, zk=zk, ok=ok, wk=wk: f(pk * sigmoid(zk / np.exp(lt)), ok, wk), lo, hi)
            )
        prev = prev * sigmoid(z[:, k] / temps[k])
    return temps


def decode_weights(data: CalibrationData) -> np.ndarray:
    """How often speculative decoding would verify each teacher-forced block: ``[N]`` float64.

    Teacher-forced data has a block at every anchor, but decoding only drafts from the
    anchors its own rounds reach: after a round that accepted ``n`` drafts the next anchor is
    ``n + 1`` positions later, so blocks right after a rejection (harder ones) are
    over-represented and easy stretches are skipped. Fitting on every anchor alike therefore
    over-predicts decode-time survival. This follows each held-out sequence's rounds
    exactly: the first anchor (the prompt's first generated token) has weight 1 and a block
    at ``a`` with weight ``w`` passes ``w * P(n accepted)`` to the anchor ``a + n + 1``, where
    ``P(n) = s_n - s_{n+1}`` with ``s_k = prod_{i<=k} accept_i`` over its valid positions (at
    greedy acceptance, 0/1, the weights are the 0/1 indicator of the blocks that greedy
    decoding with a full block verifies; at ``1 - TV`` acceptance, the expected number of
    visits along this sequence).

    Args:
      data: :func:`collect` output (every anchor of each sequence, ``anchor_stride`` 1).
    Returns:
      ``[N]`` weights in ``[0, 1]`` (0 for blocks decoding never reaches).
    """
    w = np.zeros(data.z.shape[0])
    for sq in np.unique(data.seq):
        rows = np.flatnonzero(data.seq == sq)
        at = {int(data.anchor[r]): int(r) for r in rows}
        first = min(at)
        start = first + 1 if first + 1 in at else first  # decoding's first anchor: the first generated token
        visit = {start: 1.0}
        for a in sorted(at):
            p = visit.get(a, 0.0)  # 0 before start and for anchors no round reaches
            if p <= 0:
                continue
            r = at[a]
            w[r] = p
            m = int(data.valid[r].sum())
            surv = np.concatenate([[1.0], np.cumprod(np.clip(data.accept[r, :m], 0.0, 1.0))])
            stop = np.append(surv[:-1] - surv[1:], surv[-1])  # P(exactly n accepted), n = 0..m
            for n, pn in enumerate(stop):
                if pn > 0:
                    visit[a + n + 1] = visit.get(a + n + 1, 0.0) + p * pn
    return w
