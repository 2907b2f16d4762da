"""Sequential temperature scaling of the confidence head (paper Appendix A5): the fit itself.

One temperature per block position, fit left to right on held-out blocks
(:func:`fit_temperatures`), optionally with a logit bias per position as well
(:func:`fit_calibration`, ``c_k = sigmoid(z_k / T_k + b_k)``: Platt scaling, which can move a
confidence across 1/2 where a temperature alone cannot), optionally weighted by how often
decoding verifies each block (:func:`decode_weights`). The data collection, the reports and the
training stage that calls this live in :mod:`dspark_jax.training.calibration`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from dspark_jax.evaluation.reliability import N_BINS, sigmoid

__all__ = [
    "B_BOUNDS",
    "T_BOUNDS",
    "CalibrationData",
    "CalibrationSettings",
    "decode_weights",
    "fit_calibration",
    "fit_temperatures",
]

T_BOUNDS = (0.05, 20.0)  # search range of each temperature
B_BOUNDS = (-8.0, 8.0)  # search range of each logit bias


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


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    """How :func:`~dspark_jax.training.calibration.fit_and_store_calibration` fits and reports.

    Attributes:
      fit_fraction: share of the held-out sequences the fit uses (split by sequence; the rest
        is the test part the headline metrics come from).
      temperature: acceptance temperature of the labels (1 = training label; 0 = greedy
        acceptance, argmax agreement: the fit is then stored as the drafter's greedy
        calibration, ``calibration_greedy`` in the export, used for rows decoding at T = 0).
      fit_on: ``"expected"`` (``prod (1 - TV)``, default) or ``"sampled"`` (0/1 draws).
      loss: ``"brier"`` (default) or ``"nll"``.
      bias: fit a logit bias per position beside each temperature (``c_k = sigmoid(z_k / T_k + b_k)``,
        :func:`fit_calibration`); False: temperatures only (biases 0); None (default): a bias for
        sampled acceptance (``temperature > 0``), none for greedy acceptance. Measured on held-out
        decoding (stories260K, docs/results.md#calibration): with the bias, sampled decoding's ECE
        fell about tenfold, while at T = 0 it rose (the greedy fit's biases follow its few
        calibration sequences' acceptance level, which other prompts do not share).
      weighting: ``"decode"`` (default): each fit block weighted by how often decoding would
        verify it (:func:`decode_weights`; needs ``anchor_stride`` 1), so the confidences are
        calibrated for the blocks decoding actually drafts; ``"uniform"``: every anchor alike.
      seed: split and sampled-survival seed; n_bins: ECE bins; batch_size / anchor_stride: of
        :func:`~dspark_jax.training.calibration.collect`.
    Raises:
      ValueError: unknown ``fit_on`` / ``loss`` / ``weighting``, decode weighting with
        ``anchor_stride`` > 1, or ``fit_fraction`` outside (0, 1].
    """

    fit_fraction: float = 0.5
    temperature: float = 1.0
    fit_on: str = "expected"
    loss: str = "brier"
    bias: bool | None = None
    weighting: str = "decode"
    seed: int = 0
    n_bins: int = N_BINS
    batch_size: int = 8
    anchor_stride: int = 1

    def __post_init__(self):
        if self.fit_on not in ("expected", "sampled"):
            raise ValueError(f"fit_on must be 'expected' or 'sampled', got {self.fit_on!r}")
        if self.loss not in ("brier", "nll"):
            raise ValueError(f"loss must be 'brier' or 'nll', got {self.loss!r}")
        if self.weighting not in ("decode", "uniform") or (self.weighting == "decode" and self.anchor_stride != 1):
            raise ValueError(f"weighting must be 'decode' (with anchor_stride 1) or 'uniform', got {self.weighting!r}")
        if not 0 < self.fit_fraction <= 1:
            raise ValueError(f"fit_fraction must be in (0, 1], got {self.fit_fraction}")

    @property
    def fits_bias(self) -> bool:
        """Whether the fit has a bias per position (:attr:`bias`, None resolved)."""
        return self.temperature > 0 if self.bias is None else self.bias


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
    return fit_calibration(z, observed, valid, loss=loss, bounds=bounds, weights=weights, bias=False)[0]


def fit_calibration(
    z: np.ndarray,
    observed: np.ndarray,
    valid: np.ndarray,
    *,
    loss: str = "brier",
    bounds: tuple[float, float] = T_BOUNDS,
    bias_bounds: tuple[float, float] = B_BOUNDS,
    weights: np.ndarray | None = None,
    bias: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Sequential Platt scaling: ``c_k = sigmoid(z_k / T_k + b_k)``, ``(T_k, b_k)`` fit left to right.

    As :func:`fit_temperatures` (the same loss of the predicted cumulative survival, earlier
    positions fixed), with a logit bias ``b_k`` beside each temperature: ``b_k`` is searched in
    ``bias_bounds`` (grid, then golden section) for every ``log T`` the outer search of
    :func:`fit_temperatures` tries. ``T_k > 0``, so a position's scores keep their order. A
    temperature alone maps ``z = 0`` to 1/2 whatever ``T_k``: a head whose logits are positive
    on drafts that are mostly rejected stays over-confident; the bias moves that point.

    Args:
      z / observed / valid / loss / bounds / weights: as :func:`fit_temperatures`.
      bias_bounds: search range of each ``b_k``.
      bias: fit the biases (False: all zero, :func:`fit_temperatures`).
    Returns:
      ``(temperatures [block_size], biases [block_size])`` float64 (positions without data
      repeat the previous position's pair).
    """
    f = _loss_fn(loss)
    z = np.asarray(z, np.float64)
    obs = np.asarray(observed, np.float64)
    n, block_size = z.shape
    w_all = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    temps, biases = np.ones(block_size), np.zeros(block_size)
    prev = np.ones(n)
    for k in range(block_size):
        m = np.asarray(valid[:, k], bool) & (w_all > 0)
        if not m.any():
            temps[k], biases[k] = (temps[k - 1], biases[k - 1]) if k else (1.0, 0.0)
        else:
            zk, pk, ok, wk = z[m, k], prev[m], obs[m, k], w_all[m]

            def best_bias(lt: float, zk=zk, pk=pk, ok=ok, wk=wk) -> float:
                if not bias:
                    return 0.0
                u = zk / np.exp(lt)
                return _minimize_1d(lambda b: f(pk * sigmoid(u + b), ok, wk), *bias_bounds, grid=33, iters=30)

            def loss_at(lt: float, zk=zk, pk=pk, ok=ok, wk=wk) -> float:
                return f(pk * sigmoid(zk / np.exp(lt) + best_bias(lt)), ok, wk)

            lt = _minimize_1d(loss_at, lo, hi, grid=33 if bias else 49, iters=30 if bias else 40)
            temps[k], biases[k] = np.exp(lt), best_bias(lt)
        prev = prev * sigmoid(z[:, k] / temps[k] + biases[k])
    return temps, biases


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
