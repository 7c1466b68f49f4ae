"""Exact search for the fastest plan under the memory cap: bounds, targets, then Pareto passes.

Objective and constraints (``c`` picks one strategy per node; see ``problem.py``)
* objective  minimize ``T(c) = sum_i t_i(c_i) + sum_(u,v) t_uv(c_u, c_v)``       -- :func:`solve_dp`
* memory     ``M(c) = base + sum_i m_i(c_i) + sum_(u,v) m_uv(c_u, c_v) <= cap``   -- pruned in
             :func:`.pareto.pareto_pass`, enforced by the final pick in :func:`_finish`
* forbidden  no ``INF`` choice or pair: arc consistency cuts the domains
             (``SearchProblem.allowed_choices``); forbidden pairs are empty entries
             (:class:`.elimination.EliminationModel`)

Domains.  After arc consistency, strategies dominated on their whole neighbourhood go
(:func:`.prune.prune_dominated`: every (T, M) point survives, so the search stays exact).

Width.  Past ``WIDTH_BUDGET`` cells per weight row in the largest joint table (weights
shared across layers put every layer in one bucket) :func:`solve_dp` and :func:`min_memory`
approximate instead (:mod:`.minibucket`: mini-buckets, a lower bound, local search;
``optimal=False``, ``stats["approximate"]``), and a :mod:`.chain` part's model (given the
budget) raises :class:`.ChainError`, so the planner solves flat.

Recurrence.  Factors and order are :mod:`.elimination`'s; :func:`.pareto.pareto_pass`
eliminates along the plan over Pareto sets of (t, m) pairs: eliminating x with bucket
``F_1..F_r`` gives, for each assignment s,

    g(s) = Pareto( U_x  F_1(s, x) (+) ... (+) F_r(s, x) ),    A (+) B = {(t + t', m + m')}

and a pair (t, m) goes when ``w_t t + w_m m + rest > B`` on a bound row (rest: the min-sum
of everything outside it): time (1, 0), B = target;  memory (0, 1), B = cap;
Lagrange (1, lam), B = target + lam cap (:mod:`.pareto`'s docstring).

Bounds.  The min-sum rows' argmin plans (:func:`.lagrange.argmin_plans`) give the first
target; when the fastest breaks the cap, lam* (:func:`.lagrange.lagrange_slope`) and
``L = min T + lam* (M - cap)`` bound the optimum below, and when ``target - L`` is large
lam* x 2^-4..2^4 are added as rows too (:mod:`.lagrange`).

Target.  The time of the best plan met so far.  Thinned passes (per entry and memory
bucket only the fastest and the smallest pair, each a real plan) improve it cheaply
before the one exact pass.  ``frontier=True`` (:func:`_frontier`) drops cap and target:
a pair stays while it may complete below a gap of the known plans' staircase
(:mod:`.pareto`'s gaps); past ``_FRONTIER_POINTS`` pairs an entry is thinned (flagged).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import numpy as np

from .deadline import Deadline, OutOfTime
from .elimination import EliminationModel
from .lagrange import GRID_GAP, LAMBDA_GRID, Point, argmin_plans, lagrange_slope
from .minibucket import approx_min_memory, solve_approx
from .pareto import ParetoTable, backtrack, min_sum_bounds, pareto_keep, pareto_pass, proven_within, row_limits, tol
from .problem import InfeasibleError, SearchProblem, Solution

__all__ = ["WIDTH_BUDGET", "solve_dp", "min_memory"]

logger = logging.getLogger(__name__)

_THIN_GRIDS = (64, 512, 4096)  # memory buckets across [min-memory plan, min-time plan]
_THIN_GAP = 2e-4  # relative gap (target - L) / target above which thinned passes pay
_FRONTIER_POINTS = 32  # frontier mode: at most this many pairs per entry (else not exact)
#: Cells per weight row of the largest joint table the exact search builds; past it the
#: search approximates (:mod:`.minibucket`).  Measured (exact, 2x2 mesh, 70% cap): tiny
#: ALBERT at 4.1e7 cells peaks at 8.7 GiB and 58-170 s, tiny T5 at 2.9e7 cells at 5.8 GiB
#: and 57 s CPU; memory and time scale about linearly with the width, so 2^21 (2.1e6)
#: keeps the peak near 450 MiB and the search to seconds.  Read at each call: tests lower it.
WIDTH_BUDGET = 2**21


def _min_memory(model: EliminationModel, start: float) -> Solution:
    swapped = copy.copy(model)  # memory first, then time: the pass minimizes "t", then "m"
    swapped.t, swapped.m = model.m, model.t
    w = np.array([[1.0, 0.0]])
    (point,), vals = argmin_plans(swapped, w)
    tabs, stats = pareto_pass(swapped, min_sum_bounds(swapped, w, vals), np.array([float(point.mem)]))
    if tabs[model.final].t.size == 0:
        raise AssertionError(f"min_memory: the DP lost the min-memory plan ({point.mem} B); internal pruning bug")
    choice = backtrack(model, tabs, 0)
    t, m = model.problem.evaluate(choice)
    return Solution(choice, t, m, True, "dp", time.perf_counter() - start, stats)


def min_memory(problem: SearchProblem, *, width_budget: int | None = None) -> Solution:
    """The plan with the smallest memory ``M`` (ties broken by time), exactly; past the
    width budget (``WIDTH_BUDGET`` unless given) the least found, ``optimal=False``
    (:func:`.minibucket.approx_min_memory`)."""
    start = time.perf_counter()
    model = EliminationModel(problem)
    budget = WIDTH_BUDGET if width_budget is None else width_budget
    if model.width > budget:
        return approx_min_memory(problem, model.width, budget, start)
    return _min_memory(model, start)


def _frontier(
    model: EliminationModel, seen: list[Point], w: np.ndarray, vals: list
) -> tuple[list[tuple[int, int]], bool]:
    """The (time, memory) Pareto frontier, cap ignored, and whether it is exact (an
    entry with more than ``_FRONTIER_POINTS`` pairs keeps that many, evenly spaced)."""
    fast, small = seen[0], seen[1]
    slope = max(small.time - fast.time, 1) / max(fast.mem - small.mem, 1)
    seen = seen + argmin_plans(model, np.array([[1.0, slope * 2.0**e] for e in range(-8, 9)]))[0]
    known = [(p.time, p.mem) for p in seen]
    known = [known[i] for i in pareto_keep(np.zeros(len(known), np.int64), *np.array(known, np.int64).T)]
    slopes = np.array([[1.0, (b[0] - a[0]) / (a[1] - b[1])] for a, b in zip(known, known[1:])]).reshape(-1, 2)
    if len(slopes):
        pts, vals_h = argmin_plans(model, slopes)
        seen += pts
        w, vals = np.concatenate([w, slopes]), [np.concatenate(x) for x in zip(vals, vals_h)]
    big = 1e300  # open ends: faster than the fastest known plan, smaller than the smallest
    cx = np.array([known[0][0]] + [b[0] for b in known[1:]] + [big], float)
    cy = np.array([big] + [a[1] for a in known[:-1]] + [known[-1][1]], float)
    gaps = (cx, cy, np.array([0] + list(range(2, 2 + len(slopes))) + [1]))
    bnd = min_sum_bounds(model, w, vals)
    tabs, pst = pareto_pass(model, bnd, np.full(len(w), np.inf), gaps=gaps, values_only=True, beam=-_FRONTIER_POINTS)
    fin = tabs[model.final]
    pts = np.concatenate([np.stack([fin.t, fin.m], 1), np.array([(p.time, p.mem) for p in seen], np.int64)])
    front = pts[pareto_keep(np.zeros(len(pts), np.int64), pts[:, 0], pts[:, 1])]
    return [(int(a), int(b)) for a, b in front], not pst["thinned"]


def _pick(fin: ParetoTable, cap: int | None) -> int:
    """Index of the fastest final pair within the cap (pairs are sorted by time), or -1."""
    fits = np.flatnonzero(fin.m <= cap) if cap is not None else np.arange(min(fin.t.size, 1))
    return int(fits[0]) if fits.size else -1


def _finish(model: EliminationModel, tabs: list, seen: list[Point], stats: dict, start: float) -> Solution:
    """The best of the DP's final pairs and the plans met on the way, re-evaluated."""
    problem, cap = model.problem, model.problem.mem_cap_bytes
    fin = tabs[model.final]
    idx = _pick(fin, cap)
    cands = [(int(fin.t[idx]), int(fin.m[idx]), idx)] if idx >= 0 else []
    cands += [(p.time, p.mem, p) for p in seen if cap is None or p.mem <= cap]
    best_t, best_m, ref = min(cands, key=lambda c: (c[0], c[1]))  # seen holds a plan that fits
    choice = ref.choice if isinstance(ref, Point) else backtrack(model, tabs, ref)
    if problem.evaluate(choice) != (best_t, best_m):
        raise AssertionError(f"solve_dp: plan re-evaluates to {problem.evaluate(choice)}, DP said ({best_t}, {best_m})")
    stats["solve_s"] = time.perf_counter() - start
    logger.info("solve_dp: %s -> (%d ps, %d B) in %.3fs", problem.summary(), best_t, best_m, stats["solve_s"])
    return Solution(choice, best_t, best_m, True, "dp", stats["solve_s"], stats)


def solve_dp(
    problem: SearchProblem,
    *,
    progress: Callable[[int, int], None] | None = None,
    frontier: bool = False,
    width_budget: int | None = None,
    thinned_only: bool = False,
    rel_gap: float = 0.0,
    deadline: Deadline | None = None,
) -> Solution:
    """Minimum time under the memory cap, exactly (ties broken by memory).

    ``rel_gap`` > 0: when the best plan the bounds and thinned passes met is proven within
    ``rel_gap`` of the optimum by the Lagrange bound, it is returned without the exact pass
    (``optimal=False``, ``stats["lower_bound"]`` and ``stats["gap"]`` as :mod:`.minibucket`'s).
    Past ``deadline`` before the exact pass, likewise with the Lagrange bound (``stats["budget_hit"]``).

    Past the width budget (the largest joint table over ``width_budget`` cells per weight
    row, ``WIDTH_BUDGET`` unless given) the search is approximate instead
    (:func:`.minibucket.solve_approx`, its windows stopped at ``deadline``): a plan, ``optimal=False``, with a
    lower bound and the gap in ``stats``; its :class:`InfeasibleError` is marked ``approximate``.  The
    dominance pruning stops at ``deadline`` too (:func:`.prune.prune_dominated`).
    ``thinned_only`` (a heuristic, for :mod:`.minibucket`'s windows): skip the exact pass,
    return the best plan the bounds and the coarsest thinned pass met.

    ``progress(done, total)`` is called after each node of the exact pass.
    ``frontier=True`` also returns the (time, mem) Pareto frontier, cap ignored, sorted
    by time, in ``stats["frontier"]``; ``stats["frontier_exact"]`` says whether it is
    complete (see :func:`_frontier`).  Raises :class:`InfeasibleError` when no plan fits
    the cap (or every plan is forbidden).
    """
    start = time.perf_counter()
    model = EliminationModel(problem, deadline=deadline)
    budget = WIDTH_BUDGET if width_budget is None else width_budget
    if model.width > budget:
        approx = {"frontier": frontier, "start": start, "solve_window": solve_dp, "deadline": deadline}
        return solve_approx(problem, model.width, budget, **approx)
    cap = problem.mem_cap_bytes
    w = np.array([[1.0, 0.0], [0.0, 1.0]] if cap is not None or frontier else [[1.0, 0.0]])
    seen, vals = argmin_plans(model, w)
    fast, small = seen[0], seen[-1]
    lb, lam = float(vals[model.final][0]), 0.0
    if cap is not None and fast.mem > cap:
        if small.mem > cap:  # the min-sum argmin is exact up to float ties: settle it
            exact = _min_memory(model, start)
            if exact.mem_bytes > cap:
                raise InfeasibleError.over_cap(problem, exact)
            small = Point(exact.time, exact.mem_bytes, exact.choice)
            seen.append(small)
        lam, vals_l = lagrange_slope(model, fast, small, cap, seen)
        lb = max(lb, float(vals_l[model.final][0]) - lam * cap)
        w, vals = np.concatenate([w, [[1.0, lam]]]), [np.concatenate(x) for x in zip(vals, vals_l)]
        ub = min(p.time for p in seen if p.mem <= cap)
        if ub - lb > GRID_GAP * abs(ub):  # extra slopes, solved as one batch
            grid = np.array([[1.0, lam * f] for f in LAMBDA_GRID])
            pts, vals_g = argmin_plans(model, grid)
            seen += pts
            w, vals = np.concatenate([w, grid]), [np.concatenate(x) for x in zip(vals, vals_g)]
    stats: dict = {"nodes": problem.n_nodes, "lambda": lam, "lower_bound": lb, "heuristic_s": 0.0, "rows": len(w)}
    if frontier:
        stats["frontier"], stats["frontier_exact"] = _frontier(model, seen, w[:2], [v[:2] for v in vals])
    ub = min(p.time for p in seen if cap is None or p.mem <= cap)
    bnd = min_sum_bounds(model, w, vals)
    stats.update(bounds_s=time.perf_counter() - start, lagrange_ub=ub)
    for grid in (_THIN_GRIDS[:1] if thinned_only else _THIN_GRIDS) if ub - lb > _THIN_GAP * abs(ub) else ():
        # Coarse to fine; stop once a fine pass finds nothing better.
        tick = time.perf_counter()
        tabs, _ = pareto_pass(model, bnd, row_limits(bnd, ub, cap), beam=max(1, (fast.mem - small.mem) // grid))
        stats["heuristic_s"] += time.perf_counter() - tick
        fin = tabs[model.final]
        idx = _pick(fin, cap)
        better = idx >= 0 and fin.t[idx] < ub
        if better:
            seen.append(Point(int(fin.t[idx]), int(fin.m[idx]), backtrack(model, tabs, idx)))
            ub = seen[-1].time
        if ub <= lb + tol(lb) or (grid != _THIN_GRIDS[0] and not better):
            break
    low = None if frontier else proven_within(ub, lb, rel_gap)
    if low is None and not frontier and deadline is not None and deadline.passed() and ub - lb > tol(ub):
        low = _out_of_time(lb, stats)
    if thinned_only or low is not None:  # the best plan met; optimal only when it meets the bound
        return _best_met(seen, cap, not frontier and (cap is None or fast.mem <= cap), low, stats, start)
    try:
        tabs, pstats = pareto_pass(model, bnd, row_limits(bnd, ub, cap), progress=progress, deadline=deadline)
    except OutOfTime:  # the exact pass ran past the budget: the best plan met, with the bound proven so far
        return _best_met(seen, cap, False, _out_of_time(lb, stats), stats, start)
    return _finish(model, tabs, seen, {**stats, **pstats, "upper_bound": ub}, start)


def _out_of_time(lb: float, stats: dict) -> int:
    """A search stopped by its deadline: marks ``stats`` and returns the proven lower bound in integers."""
    stats["budget_hit"] = True
    return int(lb - tol(lb))


def _best_met(seen: list, cap: int | None, optimal: bool, low: int | None, stats: dict, start: float) -> Solution:
    """The fastest plan of ``seen`` under ``cap`` (optimal when the caller proved it so), with its gap to ``low``."""
    best = min((p for p in seen if cap is None or p.mem <= cap), key=lambda p: (p.time, p.mem))
    if low is not None:
        stats.update(lower_bound=low, gap=(best.time - low) / best.time)
    return Solution(best.choice, best.time, best.mem, optimal, "dp", time.perf_counter() - start, stats)
