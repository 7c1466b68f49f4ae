"""A lower bound on a chained problem whose blocks weigh their memory differently (a Lagrange dual, no pass).

Setting (:mod:`.chain`): the nodes split into ``B_0`` with the rest ``R`` and blocks ``B_1 .. B_n`` joined through
``K`` port states.  Here the memory of each part is weighted on its own: block ``b`` takes its terms from the
problems of its key ``order[b - 1]`` and ``B_0`` with the rest from those of the rest's key (one problem per variant,
as :func:`.chain.solve_chain`'s ``variants`` and ``rest_variants``; alike in structure, each a weighting of the same
plans' bytes).  A plan's weighted memory ``M_w`` is the sum of its
parts' memory terms, each from its own key's problem; its time ``T`` is the same in every problem.

The bound.  For every ``lam >= 0`` and every plan with ``M_w <= budget`` (weak duality)::

    T  >=  T + lam (M_w - budget)  >=  min over plans (T + lam M_w) - lam budget  =:  L(lam)

and the minimum is the chain's min-sum with each part's row ``(1, lam)`` on its own key's tables::

    L(lam) = min_(a, z) r_lam(a, z) + (f_lam^(order[0]) (x) f_lam^(order[1]) (x) ... (x) f_lam^(order[n-1]))(a, z)
             - lam budget

(``r`` and ``f^key`` the least over the variants per state pair, :class:`.minsum.MinSumChain`'s tables; ``(x)`` the
min-plus product; runs of equal keys by halving, :func:`_power`).  ``L`` is concave in ``lam``, so unimodal along
``lam = lam_ref 2^(i / 4)``: :func:`lagrange_floor` takes the best of a coarse grid and then of the steps around it,
and stops once an ``L`` passes ``enough``. Every ``L(lam)`` is a lower bound, so whichever it stops at is one. Float
sums: less :func:`.pareto.tol` (the chain's own slack).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .chain_tables import BLOCK_WIDTH_BUDGET
from .elimination import inside
from .minplus import minplus
from .pareto import tol
from .problem import SearchProblem
from .split import split_blocks
from .tables import PortTable

__all__ = ["COARSE_STEPS", "RISE_STEPS", "WeightedChain", "concave_peak_at_most", "lagrange_floor"]

#: The grid's coarse steps (``i`` in steps of 8 around ``lam_ref``: factors of 4 from ``4^-COARSE_STEPS``)
COARSE_STEPS = 6
#: The most further steps (factors of 4) the grid takes up while ``L`` still rises at its top
RISE_STEPS = 10


@dataclass
class WeightedChain:
    """The tables of a chain whose parts weigh memory on their own (module docstring), split at the blocks ``nodes``
    (``nodes[i][j]``: node ``j`` of block ``i``): ``B_0`` with the rest per key (``rests``) and the blocks per key
    (``blocks``), each a list of tables, one per variant; and their min-sum grids per ``lam`` (kept: the bounds a
    caller asks of one chain share their keys and the ``lam`` grid)."""

    nodes: list[list[int]]
    rests: dict[Hashable, list[PortTable]] = field(default_factory=dict)
    blocks: dict[Hashable, list[PortTable]] = field(default_factory=dict)
    k: int = 0
    _grids: dict = field(default_factory=dict, repr=False)  # (part, key, lam) -> (K, K) least over the variants

    def add_rest(self, key: Hashable, problems: Sequence[SearchProblem]) -> None:
        """``B_0`` with the rest of ``problems`` (one per variant) as the rest keyed ``key`` (once per key)."""
        if key not in self.rests:
            self.rests[key] = [PortTable(self._split(p)[1], self.k, BLOCK_WIDTH_BUDGET) for p in problems]

    def add_block(self, key: Hashable, problems: Sequence[SearchProblem]) -> None:
        """The block of ``problems`` (one per variant) as the blocks keyed ``key`` (once per key)."""
        if key not in self.blocks:
            self.blocks[key] = [PortTable(self._split(p)[0], self.k, BLOCK_WIDTH_BUDGET) for p in problems]

    def _split(self, problem: SearchProblem):
        """:func:`.split.split_blocks` of ``problem`` at ``nodes`` (kept with it; :class:`.split.ChainError` where
        they do not chain); the first sets ``k``."""
        key = tuple(map(tuple, self.nodes))
        split = problem.memo(("split", key), lambda: split_blocks(problem, self.nodes))
        self.k = self.k or split[2]
        return split

    def floor(self, rest: Hashable, order: Sequence[Hashable], budget: int, lams: Sequence[float]) -> np.ndarray:
        """``L(lam)`` for each of ``lams`` (module docstring): the rest keyed ``rest``, the blocks ``1 .. n`` keyed
        ``order``."""
        lams = [float(x) for x in lams]
        self._fill(("rest", rest), self.rests[rest], lams)
        for w in set(order):
            self._fill(("block", w), self.blocks[w], lams)
        r = np.stack([self._grids["rest", rest, x] for x in lams])
        chained = None
        for w, run in _runs(order):
            part = _power(np.stack([self._grids["block", w, x] for x in lams]), run)
            chained = part if chained is None else minplus(chained, part)
        whole = r if chained is None else r + chained
        least = whole.reshape(len(lams), -1).min(axis=1)
        values = least - np.asarray(lams) * float(budget)
        return values - tol(values)

    def _fill(self, part: tuple, tables: list[PortTable], lams: list[float]) -> None:
        """The min-sum grid of ``tables`` (least over the variants) at every ``lam`` not kept yet."""
        todo = [x for x in lams if (*part, x) not in self._grids]
        if not todo:
            return
        rows = np.stack([np.ones(len(todo)), np.asarray(todo)], axis=1)
        grids = [t.to_grid(inside(t.model, rows, argmins=False)[0][t.model.final]) for t in tables]
        least = np.minimum.reduce(grids) if len(grids) > 1 else grids[0]
        for x, grid in zip(todo, least):
            self._grids[(*part, x)] = grid


def lagrange_floor(
    chain: WeightedChain,
    rest: Hashable,
    order: Sequence[Hashable],
    budget: int,
    lam_ref: float,
    enough: float | None = None,
) -> float:
    """A lower bound on the least time of the plans whose weighted memory is at most ``budget`` (module docstring):
    the best ``L(lam)`` met on the grid ``lam_ref 2^(i / 4)``: first ``lam = 0`` and the coarse grid's least
    (where ``L`` does not rise between them it rises nowhere further: ``L(0)``, the fastest plan's time, is the
    bound); then the rest of the coarse grid (every 8th ``i`` within ``COARSE_STEPS``; where ``L`` still rises at
    the top, on up by factors of 4, ``RISE_STEPS`` at most: the least weighted memory is then over ``budget`` or
    near it), then the seven steps on each side of the coarse best, unless concavity already bounds ``L`` under
    ``enough`` (:func:`concave_peak_at_most`: no step can give what the caller needs).  ``enough``: stop once ``L``
    passes it (the caller needs no more)."""
    lams = [0.0, lam_ref * 4.0**-COARSE_STEPS]
    values = [float(x) for x in chain.floor(rest, order, budget, lams)]
    if values[1] <= values[0]:  # concave: L falls from here on
        return values[0]

    def passed() -> bool:
        return enough is not None and max(values) > enough

    grid = [lam_ref * 4.0**j for j in range(-COARSE_STEPS + 1, COARSE_STEPS + 1)]
    lams += grid
    values += [float(x) for x in chain.floor(rest, order, budget, grid)]
    for _ in range(RISE_STEPS):
        if passed() or values[-1] <= values[-2]:
            break
        lams.append(lams[-1] * 4.0)
        values.append(float(chain.floor(rest, order, budget, lams[-1:])[0]))
    best = int(np.argmax(values))
    if passed() or best == 0 or enough is not None and concave_peak_at_most(lams, values) <= enough:
        return values[best]
    fine = [lams[best] * 2.0 ** (i / 4) for i in range(-7, 8) if i]
    return max(values[best], float(chain.floor(rest, order, budget, fine).max()))


def concave_peak_at_most(xs: Sequence[float], ys: Sequence[float]) -> float:
    """An upper bound on the maximum over ``x >= xs[0]`` of a concave function that takes the values ``ys`` at the
    increasing points ``xs``: on each gap ``[x_a, x_(a+1)]`` the function is at most the line through the two points
    left of the gap (extended right) and the line through the two right of it (extended left), so at most the
    higher end of the lower of the two, or where they cross; past the last point, at most the line through the last
    two (unbounded where that still rises).  ``inf`` where nothing bounds a gap (fewer than three points)."""

    def line(a: int, b: int) -> tuple[float, float]:
        slope = (ys[b] - ys[a]) / (xs[b] - xs[a])
        return slope, ys[a] - slope * xs[a]

    n, top = len(xs), max(ys)
    if n < 2 or line(n - 2, n - 1)[0] > 0:
        return math.inf
    for a in range(n - 1):
        lines = [line(a - 1, a)] if a >= 1 else []
        lines += [line(a + 1, a + 2)] if a + 2 < n else []
        if not lines:
            return math.inf
        ends = [xs[a], xs[a + 1]]
        if len(lines) == 2 and lines[0][0] != lines[1][0]:
            cross = (lines[1][1] - lines[0][1]) / (lines[0][0] - lines[1][0])
            if xs[a] < cross < xs[a + 1]:
                ends.append(cross)
        top = max(top, max(min(k * x + c for k, c in lines) for x in ends))
    return top


def _runs(order: Sequence[Hashable]) -> list[tuple[Hashable, int]]:
    """``order`` as (key, length) runs of equal keys, in order."""
    out: list[tuple[Hashable, int]] = []
    for w in order:
        if out and out[-1][0] == w:
            out[-1] = (w, out[-1][1] + 1)
        else:
            out.append((w, 1))
    return out


def _power(f: np.ndarray, length: int) -> np.ndarray:
    """``f`` (rows, K, K) min-plus multiplied ``length >= 1`` times, by halving."""
    if length == 1:
        return f
    half = _power(f, length // 2)
    whole = minplus(half, half)
    return minplus(whole, f) if length % 2 else whole
