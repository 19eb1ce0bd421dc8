"""Scaling-law fits: loss = a * N^-b + c over the non-embedding parameter count N, and its inverse.

The math only (no runs, no printing): `fit_power_law` fits one series of (N, loss) points,
`PowerLaw.params_for` answers "how many parameters does this fit need to reach a given loss".

Two methods, and the fit says which one it used (`PowerLaw.method`):

* ``curve_fit``: the three parameters by scipy.optimize.curve_fit (bounded: a > 0, B_MIN <= b <= B_MAX,
  0 <= c <= min loss), from a few starting points of c, keeping the best. It needs MIN_FULL_POINTS
  distinct sizes (one more than its parameters, so the fit is not an exact interpolation);
* ``log-linear``: c held fixed (FIXED_C = 0, a pure power law), log(loss - c) = log a - b log N by least
  squares. Used when there are fewer distinct sizes, or when curve_fit fails or ends on a bound of b or c
  (`PowerLaw.note` says why). Two distinct sizes are the least any fit needs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

MIN_FULL_POINTS = 4  # distinct sizes for the three-parameter fit
MIN_POINTS = 2  # distinct sizes for any fit (the log-linear fallback)
FIXED_C = 0.0  # the fallback's c: a pure power law
B_MIN, B_MAX = 1e-6, 5.0  # bounds of the exponent b in curve_fit; a fit that ends on one is refused
CURVE_FIT = "curve_fit"
LOG_LINEAR = "log-linear"


@dataclass(frozen=True)
class PowerLaw:
    """loss(N) = a * N^-b + c, fitted to `n_points` distinct sizes by `method` (CURVE_FIT or LOG_LINEAR)."""

    a: float
    b: float
    c: float
    method: str
    n_points: int
    note: str | None = None  # why the fallback was used

    def loss(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.a * np.asarray(n, dtype=float) ** -self.b + self.c

    def params_for(self, loss: float) -> float | None:
        """The N at which the fit reaches `loss`: (a / (loss - c))^(1/b). None when it never does (loss at or
        below the asymptote c, or a fit whose loss does not fall with N, b <= 0)."""
        if not (self.b > 0 and loss > self.c and self.a > 0):
            return None
        with np.errstate(over="ignore"):
            value = (self.a / (loss - self.c)) ** (1.0 / self.b)
        return float(value) if math.isfinite(value) else None

    def describe(self) -> str:
        """'curve_fit' or 'log-linear, c fixed at 0 (3 sizes < 4)'."""
        if self.method == CURVE_FIT:
            return CURVE_FIT
        text = f"{LOG_LINEAR}, c fixed at {self.c:g}"
        return f"{text} ({self.note})" if self.note else text


def _log_linear(n: np.ndarray, loss: np.ndarray, c: float, distinct: int, note: str | None) -> PowerLaw | None:
    if np.any(loss <= c):
        return None
    slope, intercept = np.polyfit(np.log(n), np.log(loss - c), 1)
    return PowerLaw(a=float(math.exp(intercept)), b=float(-slope), c=c, method=LOG_LINEAR, n_points=distinct,
                    note=note)


def _curve_fit(n: np.ndarray, loss: np.ndarray) -> tuple[tuple[float, float, float] | None, str | None]:
    """(a, b, c) or (None, why). N is scaled by its geometric mean inside the fit for conditioning."""
    from scipy.optimize import OptimizeWarning, curve_fit

    scale = float(np.exp(np.mean(np.log(n))))
    x = n / scale
    low, high = float(loss.min()), float(loss.max())
    spread = max(high - low, 1e-6)

    def model(x, a, b, c):
        return a * x ** -b + c

    best, best_sse, why = None, math.inf, "curve_fit did not converge"
    for c0 in (0.0, 0.5 * low, low - 2 * spread, low - 0.5 * spread, low - 0.1 * spread):
        c0 = min(max(c0, 0.0), low * (1 - 1e-6))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", OptimizeWarning)
                params, _ = curve_fit(model, x, loss, p0=(max(float(np.mean(loss)) - c0, 1e-6), 0.3, c0),
                                      bounds=([1e-12, B_MIN, 0.0], [np.inf, B_MAX, low]), maxfev=20000)
        except (RuntimeError, ValueError, OptimizeWarning) as exc:
            why = f"curve_fit failed: {' '.join(str(exc).split())[:80]}"
            continue
        if not np.all(np.isfinite(params)):
            continue
        sse = float(np.sum((model(x, *params) - loss) ** 2))
        if sse < best_sse:
            best, best_sse = params, sse
    if best is None:
        return None, why
    a, b, c = (float(v) for v in best)
    if b >= B_MAX * (1 - 1e-3):
        return None, f"curve_fit ended on b's bound {B_MAX:g}"
    if b <= B_MIN * 10:
        return None, "curve_fit ended on b's lower bound: the loss does not fall with N"
    if c >= low - 1e-6 * max(abs(low), 1.0):
        return None, "curve_fit put c at the lowest loss"
    return (a * scale ** b, b, c), None


def fit_power_law(n, loss, fixed_c: float = FIXED_C) -> PowerLaw | None:
    """Fit loss = a N^-b + c to the points (n[i], loss[i]); sizes may repeat (several seeds).

    curve_fit with MIN_FULL_POINTS or more distinct sizes, else (or when it fails) the log-linear fit with
    c = fixed_c. None with fewer than MIN_POINTS distinct sizes or a loss at or below fixed_c.
    """
    n = np.asarray(n, dtype=float)
    loss = np.asarray(loss, dtype=float)
    keep = np.isfinite(n) & np.isfinite(loss) & (n > 0)
    n, loss = n[keep], loss[keep]
    distinct = len(np.unique(n))
    if distinct < MIN_POINTS:
        return None
    if distinct < MIN_FULL_POINTS:
        note = f"{distinct} sizes < {MIN_FULL_POINTS}"
    else:
        params, note = _curve_fit(n, loss)
        if params is not None:
            a, b, c = params
            return PowerLaw(a=a, b=b, c=c, method=CURVE_FIT, n_points=distinct)
    return _log_linear(n, loss, fixed_c, distinct, note)
