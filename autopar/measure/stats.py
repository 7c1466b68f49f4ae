"""Small statistics the measurements report: medians, spread, rank correlation, relative error.

Pure functions over lists of floats; no numpy needed.  ``median_of`` takes the element-wise median of
equally shaped measurements (nested dicts, lists and tuples of numbers and labels): ``autopar calibrate``'s
passes.  ``spearman`` is the
Pearson correlation of the average ranks (ties share their mean rank), as
``scipy.stats.spearmanr`` computes it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["median", "median_of", "spread", "spearman", "ranks", "relative_error"]


def median(values: Sequence[float]) -> float:
    """The median; ``ValueError`` for no values."""
    if not values:
        raise ValueError("median of no values: measure at least once")
    return float(statistics.median(values))


def median_of(samples: Sequence[Any]) -> Any:
    """The element-wise median of equally shaped measurements: numbers the median (kept as they are where all
    are equal: counts stay ints), dicts per key, lists and tuples per position, anything else (a label, a name)
    kept, and a ``ValueError`` where the samples differ in shape or label."""
    if not samples:
        raise ValueError("median_of no samples: measure at least once")
    first = samples[0]
    if isinstance(first, dict):
        if any(not isinstance(s, dict) or s.keys() != first.keys() for s in samples):
            raise ValueError(f"median_of: samples with other keys than {sorted(first, key=str)}")
        return {k: median_of([s[k] for s in samples]) for k in first}
    if isinstance(first, (list, tuple)):
        if any(not isinstance(s, (list, tuple)) or len(s) != len(first) for s in samples):
            raise ValueError(f"median_of: samples of other lengths than {len(first)}")
        return type(first)(median_of(list(column)) for column in zip(*samples))
    if all(s == first for s in samples):
        return first
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return median([float(s) for s in samples])
    raise ValueError(f"median_of: labels differ between samples: {samples!r}")


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far repeats of one measurement lie apart, as a fraction (0.05 = 5%)."""
    mid = median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of paired values: 1 = same order, -1 = reversed, nan below 2 pairs or no spread."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} values against {len(y)}; pass pairs")
    if len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return math.nan
    return cov / math.sqrt(vx * vy)


def relative_error(predicted: float, measured: float) -> float:
    """predicted / measured - 1: +0.2 predicts 20% too much, -0.2 20% too little."""
    if measured <= 0:
        raise ValueError(f"relative_error: measured {measured!r} must be > 0")
    return predicted / measured - 1.0
