"""The min-sum chain behind :mod:`.chain`'s bounds and target: scalar tables, no Pareto sets.

For rows of weights ``w = (w_t, w_m)``, ``f`` and ``r`` are the least ``w_t t + w_m m`` per
state pair of the block table F and the rest table Rest (``dp._inside`` with the ports
kept).  :class:`MinSumChain` computes (min-plus matrix products, :func:`minplus`)::

    L_0(z, a) = r(a, z),    L_{p+1} = L_p (x) f           the rest and p blocks
    total = min_z L_n(z, z)                                 the min-sum of the whole problem
    M_0 = L_0,              M_s = min(L_s, f (x) M_{s-1})  outside bounds (chain.py's docstring)
    f^n                                                     by squaring: the rest's outside bound

and the port states of each row's argmin plan (:meth:`MinSumChain.states`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .dp import _inside

if TYPE_CHECKING:
    from .chain import _Table

__all__ = ["MinSumChain", "minplus"]


def minplus(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, K, K) min-plus product and its argmin over the middle index."""
    z = x[:, :, :, None] + y[:, None, :, :]
    arg = z.argmin(axis=2)
    return np.take_along_axis(z, arg[:, :, None, :], axis=2)[:, :, 0, :], arg


class MinSumChain:
    """Min-sum of the whole chain for rows of weights: tables, argmins, bounds."""

    def __init__(self, ftab: _Table, rtab: _Table, n: int, w: np.ndarray) -> None:
        """``ftab``/``rtab``: the block and rest tables (:class:`.chain._Table`); ``n`` blocks chained."""
        self.w, self.n = w, n
        self.fvals, self.fargs = _inside(ftab.model, w)
        self.rvals, self.rargs = _inside(rtab.model, w)
        self.f = ftab.to_grid(self.fvals[ftab.model.final])
        self.r = rtab.to_grid(self.rvals[rtab.model.final])
        lp = self.r.transpose(0, 2, 1)  # L_0(z, a) = r(a, z)
        self.l_args = []
        self.lp = [lp]
        for _ in range(n):
            lp, arg = minplus(lp, self.f)
            self.lp.append(lp)
            self.l_args.append(arg)
        diag = np.diagonal(lp, axis1=1, axis2=2)
        self.total = diag.min(axis=1)
        self.z = diag.argmin(axis=1)

    def outside(self) -> list[np.ndarray]:
        """``M_s`` for s = 0..n-1, each (rows, K, K) indexed (c, a)."""
        ms = [self.lp[0]]
        for s in range(1, self.n):
            ms.append(np.minimum(self.lp[s], minplus(self.f, ms[-1])[0]))
        return ms

    def power(self) -> np.ndarray:
        """``f^n`` (rows, K, K) by squaring."""
        result, base, e = None, self.f, self.n
        while e:
            if e & 1:
                result = base if result is None else minplus(result, base)[0]
            e >>= 1
            if e:
                base = minplus(base, base)[0]
        return result

    def states(self, row: int) -> list[int]:
        """Port states a_0 (B_0) .. a_n (B_{L-1}) of the row's min-sum plan."""
        z = int(self.z[row])
        states = [z]
        for p in range(self.n - 1, -1, -1):
            states.append(int(self.l_args[p][row, z, states[-1]]))
        return states[::-1]
