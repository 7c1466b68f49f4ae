"""Fitting measurements to the cost model's formulas, with the residuals kept for printing.

A collective of ``x`` bytes through the formula's bandwidth factor (``costmodel.comm``:
``2(n-1)/n * nbytes`` for an all-reduce, ``(n-1)/n * nbytes`` otherwise) takes
``latency_s + x / bandwidth``: ``fit_latency_bandwidth`` finds the two by least
squares on *relative* error (each point weighted by 1/t, so a 20 us message counts
as much as a 20 ms one), constrained to a latency >= 0 and a bandwidth > 0.  A rate
(flop/s, bytes/s) measured on several shapes is summarized by its median
(``fit_rate``), each shape's ratio to it kept as the residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import stats

__all__ = ["LineFit", "RateFit", "fit_latency_bandwidth", "fit_rate"]

_NO_LIMIT_BYTES_PER_S = 1e18  # the bandwidth of a fit that found no size dependence (a finite profile value)


@dataclass(frozen=True, slots=True)
class LineFit:
    """``t = latency_s + x / bandwidth_bytes_per_s`` fitted to ``points`` (x, measured t)."""

    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[float, float], ...]

    def predict(self, x: float) -> float:
        return self.latency_s + x / self.bandwidth_bytes_per_s

    @property
    def residuals(self) -> tuple[float, ...]:
        """measured / fitted - 1 per point."""
        return tuple(t / self.predict(x) - 1 for x, t in self.points)

    @property
    def worst_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


@dataclass(frozen=True, slots=True)
class RateFit:
    """A rate summarized as the median of ``samples`` (label, rate)."""

    rate: float
    samples: tuple[tuple[str, float], ...]

    @property
    def residuals(self) -> tuple[float, ...]:
        """sample / rate - 1 per sample."""
        return tuple(r / self.rate - 1 for _, r in self.samples)


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> LineFit:
    """Least squares on relative error of ``t = a + x / B`` (see the module docstring); ValueError below 2 points."""
    if len(points) < 2:
        raise ValueError(f"fit_latency_bandwidth: {len(points)} points; measure at least 2 sizes")
    x = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    design = np.stack([1.0 / t, x / t], axis=1)  # (a + b x) / t = 1
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if b <= 0:  # no size dependence measurable: all latency, a bandwidth too high to matter
        a, b = float(np.median(t)), 1.0 / _NO_LIMIT_BYTES_PER_S
    elif a < 0:  # refit through the origin
        b = float(np.sum(x / t) / np.sum((x / t) ** 2))
        a = 0.0
    return LineFit(float(a), float(1.0 / b), tuple((float(xi), float(ti)) for xi, ti in zip(x, t)))


def fit_rate(samples: list[tuple[str, float]]) -> RateFit:
    """The median rate of ``samples`` and each sample's residual against it."""
    return RateFit(stats.median([r for _, r in samples]), tuple(samples))
