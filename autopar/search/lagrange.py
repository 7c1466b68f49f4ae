"""Min-sum plans and the Lagrange slope: real plans from weight rows ``w_t T + w_m M``, and lam* at the cap.

Plans (:func:`argmin_plans`).  For each row of weights, the min-sum of ``w_t T + w_m M``
over the elimination model (:func:`.elimination.inside`) and its argmin plan, decoded in
reverse order (:func:`.elimination.argmin_at`) and re-evaluated exactly
(:meth:`.SearchProblem.evaluate`): a real plan, a :class:`Point` ``(time, mem, choice)``.

Lagrange (:func:`lagrange_slope`).  For ``lam >= 0``, weak duality bounds the optimum
under the cap from below::

    L(lam) = min_c T(c) + lam (M(c) - cap) <= min { T(c) : M(c) <= cap }

lam* is the slope of the hull of the (T, M) frontier where it crosses the cap
(Eisner-Severance): from ``lo`` (breaks the cap) and ``hi`` (meets it), take
``lam = (T_hi - T_lo) / (M_lo - M_hi)``, the line through them, and solve
``min T + lam M``; a plan below that line replaces ``lo`` or ``hi`` (by whether it fits),
and none below it (within :func:`.pareto.tol`) means lam is the hull's slope there.

Grid.  When the gap ``(target - L) / target`` passes ``GRID_GAP`` the solvers add the rows
``(1, lam* f)`` for ``f`` in ``LAMBDA_GRID`` (2^-4..2^4): a pair's completion trades time
for memory at its own rate, so several slopes prune more than one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .elimination import EliminationModel, decode, inside
from .pareto import tol
from .problem import InfeasibleError

__all__ = ["GRID_GAP", "LAMBDA_GRID", "Point", "argmin_plans", "lagrange_slope"]

LAMBDA_GRID = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2.0, 4.0, 8.0, 16.0)  # extra slopes, times lam*
GRID_GAP = 5e-3  # relative gap (target - L) / target above which the extra slopes pay


class Point(NamedTuple):
    """A real plan: its exact time and memory, and its choice vector."""

    time: int
    mem: int
    choice: tuple[int, ...]


def argmin_plans(model: EliminationModel, w: np.ndarray) -> tuple[list[Point], list]:
    """Per row of weights, the argmin plan of ``w_t T + w_m M`` (re-evaluated exactly),
    and the inside values."""
    vals, _ = inside(model, w, argmins=False)
    if not np.isfinite(vals[model.final]).all():
        raise InfeasibleError(f"{model.problem.summary()}: every plan hits a forbidden (INF) choice or pair")
    red = decode(model, vals, np.zeros((len(w), len(model.k)), np.int64))
    choices = [model.original_choice(r) for r in red]
    return [Point(*model.problem.evaluate(c), c) for c in choices], vals


def lagrange_slope(model: EliminationModel, lo: Point, hi: Point, cap: int, seen: list[Point]) -> tuple[float, list]:
    """Eisner-Severance on the hull (lo breaks the cap, hi meets it): lam* and the
    inside values of ``T + lam* M``.  Every plan met goes to ``seen``."""
    lam, vals = 0.0, []
    for _ in range(64):
        lam = max(0.0, (hi.time - lo.time) / (lo.mem - hi.mem))
        (p,), vals = argmin_plans(model, np.array([[1.0, lam]]))
        seen.append(p)
        line = lo.time + lam * lo.mem
        if p.time + lam * p.mem >= line - tol(line):
            break
        lo, hi = (lo, p) if p.mem <= cap else (p, hi)
    return lam, vals
