"""Online calibration of the drafter's confidences while serving.

docs/design.md#online-calibration: the scheduler trusts the predicted
acceptance ``c_k = sigmoid(z_k / T_k + b_k)`` of every block position ``k`` (``b_k`` the offline
calibration's logit bias, held fixed here). Traffic drifts away
from the held-out data the offline calibration was fit on, so the engine keeps, per
position, the last ``window`` verification outcomes (raw confidence logit ``z``, and whether
position ``k`` was accepted given that verification reached it) and after every step nudges
``T_k`` by a small multiplicative step against the gradient of the window's binary
cross-entropy:

    dBCE/dlog T_k = mean_window( -(c - y) * z / T_k ),   T_k <- T_k * exp(-lr * grad)

with the step clipped to ``+-max_step`` (relative) and ``T_k`` to ``[t_min, t_max]``.
Overconfident predictions (``c > y`` on average with ``z > 0``) raise ``T_k``, which pulls
``c_k`` towards ``sigmoid(b_k)``; underconfident ones lower it.

A temperature cannot move ``z / T_k + b_k`` across 0 where it has the sign of ``b_k``: a drafter
whose confidence head is positive on traffic it mostly gets wrong stays overconfident at any ``T_k`` (SmolLM2-135M,
MT-Bench: predicted 0.52 against 0.30 observed at position 1 after 2,048 observations). So the
confidence the scheduler reads is also scaled by the window's observed over predicted acceptance
per position, ``c_k * rho_k`` (:func:`~dspark_jax.decoding.auto_verify.acceptance_ratio`, the
ratio batch-1 ``auto`` applies per request), recomputed at every :meth:`OnlineCalibrator.update`.
Temperatures and ratios only feed the scheduler: draft tokens, their distributions and the
emitted tokens never depend on them.
"""

from __future__ import annotations

import numpy as np

from dspark_jax.decoding.auto_verify import acceptance_ratio, reached_and_accepted

__all__ = ["OnlineCalibrator"]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


class OnlineCalibrator:
    """Per-position sliding-window temperature tracker.

    Args:
      block_size: block positions ``G`` (the drafter's block size).
      init: initial temperatures ``[G]`` (e.g. the drafter's offline calibration), default 1.
      bias: the logit biases ``[G]`` of that calibration (fixed), default 0.
      window: observations kept per position (a ring buffer).
      lr: learning rate of the log-temperature update.
      max_step: largest relative change of ``T_k`` per update.
      min_obs: observations a position needs before it is updated.
      t_min / t_max: clip range of the temperatures.

    Raises:
      ValueError: bad sizes, non-positive temperatures or non-finite biases.
    """

    def __init__(
        self,
        block_size: int,
        init=None,
        *,
        bias=None,
        window: int = 2048,
        lr: float = 0.05,
        max_step: float = 0.02,
        min_obs: int = 32,
        t_min: float = 0.05,
        t_max: float = 20.0,
    ):
        if block_size < 1 or window < 1:
            raise ValueError("block_size and window must be >= 1")
        t = np.ones(block_size) if init is None else np.asarray(init, np.float64).reshape(-1)
        if t.shape != (block_size,) or not np.all((t > 0) & np.isfinite(t)):
            raise ValueError(f"need {block_size} positive finite initial temperatures, got {t}")
        b = np.zeros(block_size) if bias is None else np.asarray(bias, np.float64).reshape(-1)
        if b.shape != (block_size,) or not np.all(np.isfinite(b)):
            raise ValueError(f"need {block_size} finite calibration biases, got {b}")
        self.biases = b
        self.block_size, self.window, self.lr, self.max_step = block_size, window, lr, max_step
        self.min_obs, self.t_min, self.t_max = min_obs, t_min, t_max
        self.temperatures = t.copy()
        self.ratios = np.ones(block_size)  # observed / predicted acceptance per position (update())
        self._z = np.zeros((block_size, window))
        self._y = np.zeros((block_size, window))
        self._count = np.zeros(block_size, np.int64)  # total observations ever, per position

    @classmethod
    def seeded(cls, block_size: int, drafter=None, **kw) -> OnlineCalibrator:
        """Starts from ``drafter``'s offline calibration of sampled rows (its ``calibration``
        temperatures and ``calibration_bias``), or from ones and zeros when it has none or
        ``drafter`` is None; ``kw``: the other arguments of the constructor."""
        temps = getattr(drafter, "calibration", None)
        return cls(block_size, temps, bias=getattr(drafter, "calibration_bias", None) if temps else None, **kw)

    def confidence(self, z: np.ndarray) -> np.ndarray:
        """Calibrated confidences ``min(1, sigmoid(z_k / T_k + b_k) * rho_k)``; ``z [..., G]`` raw logits."""
        return np.minimum(self.ratios * self._c(np.asarray(z, np.float64), slice(None)), 1.0)

    def _c(self, z: np.ndarray, pos, t=None) -> np.ndarray:
        """``sigmoid(z / T + b)`` of position(s) ``pos`` (temperature ``t`` when given)."""
        return _sigmoid(z / (self.temperatures[pos] if t is None else t) + self.biases[pos])

    def observe(self, z: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Records one verification round per row.

        Args:
          z: ``[n, G]`` raw confidence logits of the verified drafts.
          verified: ``[n]`` int drafts verified (``l_r``).
          accepted: ``[n]`` int leading drafts accepted (``<= l_r``).
        Position ``k`` (1-based) of row ``r`` is an observation iff ``k <= l_r`` and
        ``k <= accepted_r + 1`` (verification reached it); its label is ``k <= accepted_r``.
        """
        z = np.asarray(z, np.float64)
        if z.size == 0:
            return
        k = np.arange(1, self.block_size + 1)[None, :]
        ver = np.asarray(verified)[:, None]
        acc = np.asarray(accepted)[:, None]
        reached, accepted = reached_and_accepted(k, ver, acc)
        reached &= np.isfinite(z)
        label = accepted.astype(np.float64)
        for pos in range(self.block_size):
            sel = reached[:, pos]
            m = int(sel.sum())
            if not m:
                continue
            zs, ys = z[sel, pos][-self.window :], label[sel, pos][-self.window :]
            m = len(zs)
            idx = (self._count[pos] + np.arange(m)) % self.window
            self._z[pos, idx] = zs
            self._y[pos, idx] = ys
            self._count[pos] += m

    def update(self) -> None:
        """One multiplicative step of every position with at least ``min_obs`` observations,
        then the acceptance ratios of the window at the new temperatures."""
        hits, predicted = np.zeros(self.block_size), np.zeros(self.block_size)
        for pos in range(self.block_size):
            m = int(min(self._count[pos], self.window))
            if not m:
                continue
            z, y = self._z[pos, :m], self._y[pos, :m]
            t = self.temperatures[pos]
            if m >= self.min_obs:
                c = self._c(z, pos, t)
                grad = float(np.mean(-(c - y) * z / t))
                step = float(np.clip(-self.lr * grad, -self.max_step, self.max_step))
                t = self.temperatures[pos] = float(np.clip(t * np.exp(step), self.t_min, self.t_max))
            hits[pos], predicted[pos] = y.sum(), float(np.sum(self._c(z, pos, t)))
        self.ratios = acceptance_ratio(hits, predicted)

    def stats(self) -> dict:
        """Per-position window statistics: ``temperatures``, ``ratios`` (observed over predicted
        acceptance, :meth:`update`), ``predicted`` (mean confidence the scheduler reads,
        :meth:`confidence`), ``observed`` (conditional acceptance), ``observations`` (window size)."""
        pred, obs, num = [], [], []
        for pos in range(self.block_size):
            m = int(min(self._count[pos], self.window))
            num.append(m)
            if m:
                z, y = self._z[pos, :m], self._y[pos, :m]
                c = np.minimum(self._c(z, pos) * self.ratios[pos], 1.0)
                pred.append(float(np.mean(c)))
                obs.append(float(np.mean(y)))
            else:
                pred.append(None)
                obs.append(None)
        return {
            "temperatures": [float(t) for t in self.temperatures],
            "ratios": [float(r) for r in self.ratios],
            "predicted": pred,
            "observed": obs,
            "observations": num,
        }

    def prior_acceptance(self, default: float = 0.5, strength: float = 16.0) -> np.ndarray:
        """``[G]`` conditional acceptance forecast from the window's observations per position,
        shrunk towards ``default`` by ``strength`` pseudo-observations (a Beta prior:
        ``(accepted + strength * default) / (observations + strength)``), so that a handful of
        unlucky rounds cannot pin the forecast at 0."""
        m = np.minimum(self._count, self.window).astype(np.float64)
        acc = np.array([self._y[pos, : int(m[pos])].sum() for pos in range(self.block_size)])
        return (acc + strength * default) / (m + strength)

    def prior_survival(self, default: float = 0.5, strength: float = 16.0) -> np.ndarray:
        """``[G]`` survival forecast, the cumulative product of :meth:`prior_acceptance`; used for
        requests whose own confidences are not available (e.g. the deployed scheduler's stale
        budget)."""
        return np.cumprod(self.prior_acceptance(default, strength))
