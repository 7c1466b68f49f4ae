"""The min-sum chain behind :mod:`.chain`'s bounds and target: scalar tables, no Pareto sets.

For rows of weights ``w = (w_t, w_m)``, ``f`` and ``r`` are the least ``w_t t + w_m m`` per
state pair of the block table F and the rest table Rest (:func:`.elimination.inside` over
their :class:`.tables.PortTable`, the ports kept).  :class:`MinSumChain` computes (min-plus
matrix products, :func:`minplus`)::

    f^l = f^(l//2) (x) f^(l - l//2)                         memoized halving (:meth:`MinSumChain.fpow`)
    total = min_(a, z) r(a, z) + f^n(a, z)                  the min-sum of the whole problem
    O_n(c, a) = r(a, c);  for l = x + y (x = l//2) of the halving of n, longest first:
        O_x = min(O_x, f^y (x) O_l),  O_y = min(O_y, O_l (x) f^x)   outside bounds (chain.py's docstring)

and the port states of each row's argmin plan (:meth:`MinSumChain.states`).  The lengths
of the halving (:func:`halving`) are at most two per level, so each of these is
O(log n) min-plus products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .elimination import inside
from .minplus import minplus

if TYPE_CHECKING:
    from .tables import PortTable

__all__ = ["MinSumChain", "halving", "minplus"]


def halving(n: int) -> list[tuple[int, int, int]]:
    """``(l, l//2, l - l//2)`` for every length l >= 2 met halving n, shortest first (so a
    segment's halves come before it); at most two lengths per level."""
    seen, todo = set(), [n]
    while todo:
        length = todo.pop()
        if length >= 2 and length not in seen:
            seen.add(length)
            todo += [length // 2, length - length // 2]
    return [(length, length // 2, length - length // 2) for length in sorted(seen)]


def _least(grids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The elementwise least of the variants' grids, which variant gives it (the first on ties), and where more
    than one does."""
    if len(grids) == 1:
        return grids[0], np.zeros(grids[0].shape, np.int64), np.zeros(grids[0].shape, bool)
    stack = np.stack(grids)
    least = stack.min(axis=0)
    return least, stack.argmin(axis=0), (stack == least).sum(axis=0) > 1


def _join(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.concatenate([x, y])


class MinSumChain:
    """Min-sum of the whole chain for rows of weights: tables, argmins, bounds."""

    def __init__(self, ftabs: list[PortTable], rtabs: list[PortTable], n: int, w: np.ndarray) -> None:
        """``ftabs``/``rtabs``: the block's and the rest's tables (:class:`.tables.PortTable`), one per variant
        (a block, and B_0 in the rest, may take any variant: ``f`` is the least over them, ``fsel`` which);
        ``n`` blocks chained.  ``fv[j]``/``rv[j]``: variant j's (values, {}) of :func:`.elimination.inside`
        (no argmins: :meth:`.tables.PortTable.argmin_choice` decodes a plan from the values)."""
        self.w, self.n = w, n
        self.fv = [inside(t.model, w, argmins=False) for t in ftabs]
        self.rv = [inside(t.model, w, argmins=False) for t in rtabs]
        self.f, self.fsel, self.ftied = _least([t.to_grid(v[t.model.final]) for t, (v, _) in zip(ftabs, self.fv)])
        self.r, self.rsel, self.rtied = _least([t.to_grid(v[t.model.final]) for t, (v, _) in zip(rtabs, self.rv)])
        self._pow = {1: self.f}  # l -> f^l, built by halving (:meth:`fpow`)
        self._out: dict[int, np.ndarray] | None = None  # l -> O_l (:meth:`outside`)
        rows, k = len(w), self.f.shape[1]
        whole = (self.r + self.fpow(n)).reshape(rows, -1)  # (a, z): the rest plus n blocks
        self.total = whole.min(axis=1)
        self.ends = np.stack(np.unravel_index(whole.argmin(axis=1), (k, k)), axis=1)  # (a_0, a_n) per row
        self.ends_once = (whole == self.total[:, None]).sum(axis=1) == 1  # per row: no other (a_0, a_n) ties

    def stacked(self, other: MinSumChain) -> MinSumChain:
        """The min-sum of ``self``'s rows then ``other``'s (same tables and chain): every array joined along
        the rows, the powers both have kept, so a row solved once is not solved again."""
        out = object.__new__(MinSumChain)
        out.n, out._out = self.n, None
        for name in ("w", "f", "fsel", "ftied", "r", "rsel", "rtied", "total", "ends", "ends_once"):
            setattr(out, name, _join(getattr(self, name), getattr(other, name)))

        def rows(a: list, b: list) -> list:
            return [(list(map(_join, va, vb)), {}) for (va, _), (vb, _) in zip(a, b)]

        out.fv, out.rv = rows(self.fv, other.fv), rows(self.rv, other.rv)
        out._pow = {n: _join(p, other._pow[n]) for n, p in self._pow.items() if n in other._pow}
        return out

    def fpow(self, length: int) -> np.ndarray:
        """``f^length`` (rows, K, K), memoized: ``f^l = f^(l//2) (x) f^(l - l//2)``, so the
        lengths met while halving n are at most two per level (about 2 log n products)."""
        if length not in self._pow:
            half = length // 2
            self._pow[length] = minplus(self.fpow(half), self.fpow(length - half))
        return self._pow[length]

    def outside(self) -> dict[int, np.ndarray]:
        """``O_l`` (rows, K, K) indexed (c, a) per length l of :func:`halving` (and 1), built once."""
        if self._out is None:
            out = {self.n: self.r.transpose(0, 2, 1)}  # O_n(c, a) = r(a, c)
            rows = len(self.w)
            for length, x, y in reversed(halving(self.n)):
                # both halves' products in one call (rows stacked): half the passes over b
                both = minplus(np.concatenate([self.fpow(y), out[length]]), np.concatenate([out[length], self.fpow(x)]))
                for half, value in ((x, both[:rows]), (y, both[rows:])):
                    out[half] = value if half not in out else np.minimum(out[half], value)
            self._out = out
        return self._out

    def power(self) -> np.ndarray:
        """``f^n`` (rows, K, K)."""
        return self.fpow(self.n)

    def states(self, row: int) -> list[int]:
        """Port states a_0 (B_0) .. a_n (B_{L-1}) of the row's min-sum plan (:meth:`unique_states`)."""
        return self.unique_states(row)[0]

    def unique_states(self, row: int) -> tuple[list[int], bool]:
        """Port states a_0 (B_0) .. a_n (B_{L-1}) of the row's min-sum plan: the ends from
        ``total``'s argmin, then each segment split in the middle as :meth:`fpow` split it,
        at the state b minimizing ``f^h(a, b) + f^(l-h)(b, c)`` (h = l//2, first b on ties);
        and whether every one of these least values was reached once (the ends' and each split's: then,
        where the row's sums are exact, every plan of least value has these states, by induction from the ends
        as in :func:`.elimination.decode_unique`).

        The split depends on (l, a, c) only, so each distinct segment is split once and its
        interior states reused: the Python work is per distinct (l, a, c), at most
        ``K^2`` per length of :func:`halving` and about two per length when the plan repeats
        one state, rather than per block; only the list joins are per block."""
        memo: dict[tuple[int, int, int], list[int]] = {}
        once = [bool(self.ends_once[row])]

        def inner(length: int, a: int, c: int) -> list[int]:  # states strictly between a and c
            if length < 2:
                return []
            if (length, a, c) not in memo:
                h = length // 2
                line = self.fpow(h)[row, a, :] + self.fpow(length - h)[row, :, c]
                mid = int(line.argmin())
                once[0] &= int((line == line[mid]).sum()) == 1
                memo[length, a, c] = inner(h, a, mid) + [mid] + inner(length - h, mid, c)
            return memo[length, a, c]

        first, last = (int(x) for x in self.ends[row])
        return [first, *inner(self.n, first, last), last], once[0]
