"""Move prices of one tensor between placements, kept as dense matrices so an edge's table is one gather.

An edge's cost table (``Coster.edge_matrices``) prices every pair of (placement its producer gives, placement its
consumer takes): on a three-axis mesh a hidden state has hundreds of each, and the same tensor shape flows along
every layer's edges.  A ``PairTable`` holds, for one tensor (its ``TensorMeta``) and one kind of move, the seconds
of each move priced so far, in a matrix over the placements met (``NaN``: not priced yet).  ``lookup`` gathers an
edge's rows x columns at once and prices only the pairs never met before, so the work per pair is done once per
tensor, and each later edge with that tensor costs a numpy gather instead of a Python loop over its pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["PairTable"]


class PairTable:
    """Seconds of moving one tensor from placement ``a`` to placement ``b`` (ids: small ints, ``Coster._ids``),
    over the ids met so far; a move between equal ids is free."""

    def __init__(self) -> None:
        self._local: dict[int, int] = {}  # placement id -> row / column of the matrix
        self._ids: list[int] = []
        self._seconds = np.full((0, 0), np.nan)

    def lookup(self, src: Sequence[int], dst: Sequence[int], price: Callable[[int, int], float]) -> np.ndarray:
        """The ``len(src) x len(dst)`` seconds of moving from ``src[i]`` to ``dst[j]``; ``price(i, j)`` prices a
        pair met for the first time (by its positions in ``src`` and ``dst``)."""
        rows, cols = self._indices(src), self._indices(dst)
        out = self._seconds[np.ix_(rows, cols)]
        for i, j in zip(*np.nonzero(np.isnan(out)), strict=True):
            r, c = rows[i], cols[j]
            if np.isnan(self._seconds[r, c]):  # a pair repeated within this edge is priced once
                self._seconds[r, c] = 0.0 if r == c else price(int(i), int(j))
            out[i, j] = self._seconds[r, c]
        return out

    def _indices(self, ids: Sequence[int]) -> np.ndarray:
        local = self._local
        new = [i for i in dict.fromkeys(ids) if i not in local]
        if new:
            for i in new:
                local[i] = len(self._ids)
                self._ids.append(i)
            n, grown = len(self._ids), self._seconds
            self._seconds = np.full((n, n), np.nan)
            self._seconds[: grown.shape[0], : grown.shape[1]] = grown
        return np.fromiter((local[i] for i in ids), dtype=np.intp, count=len(ids))
