"""Approximate search past the width budget: mini-bucket elimination, then local search.

When the exact elimination (:mod:`.dp`) would build a joint table of more than
``dp.WIDTH_BUDGET`` cells per weight row (weights shared across layers tie the layers'
ops into one bucket), :func:`solve_approx` replaces it.  Same objective and constraints
as :func:`.dp.solve_dp` (min ``T`` subject to ``M <= cap``); a bound, rarely a proof.

Mini-buckets (Dechter and Rish 2003).  Eliminating x with bucket ``F_1..F_r`` is split:
the bucket's tables are partitioned (:func:`.elimination.mini_buckets`, greedy
first-fit, largest scope first) into parts ``Q_1..Q_p`` whose joint tables fit the
budget, and each part is eliminated on its own, ``g_q(s_q) = min_x sum_(F in Q_q) F(s_q, x)``.  Since
``min_x (f + h) >= min_x f + min_x h``, every table's min-sum is a lower bound of the
exact one, for every weight row ``w``: the final value ``L_w`` bounds
``min_c w_t T(c) + w_m M(c)`` from below.  So

* ``L_(1, 0)`` bounds the optimum's time, ``L_(0, 1)`` the least memory (above the cap:
  infeasibility is proven), and ``L_(1, lam) - lam cap`` the optimum under the cap
  (weak duality, as :func:`.lagrange.lagrange_slope`);
* decoding in reverse order, each node's argmin of the sum of *all* its bucket's tables
  (every part's) at the choices already made (:func:`.elimination.argmin_at`), gives real
  plans, re-evaluated exactly (:meth:`.SearchProblem.evaluate`).

Plans (:func:`solve_approx`): the time and memory rows, then Eisner-Severance for lam*
(:func:`.lagrange.lagrange_slope`) and the slopes lam* x 2^-4..2^4 as in
:func:`.dp.solve_dp`.  Then two local searches, each keeping only moves that leave a plan free of forbidden pairs,
under the cap, and faster (or as fast and smaller):

* iterated conditional modes (:class:`_Local`), from every plan met (one over the cap may
  be repaired): per node, the best strategy given its neighbours' choices, to a fixpoint;
* windows (:func:`_windows`, large-neighbourhood search) from the best: with the nodes
  outside a window fixed, the window is a smaller problem (edges to fixed nodes fold into
  unary costs, the cap drops by the fixed nodes' memory) solved by :func:`.dp.solve_dp`
  (which passes itself in: ``solve_window``).
  The windows (:func:`_window_sets`): the complement of a cutset (cutset conditioning: the
  most connected nodes, shared weights first, fixed until the rest's elimination fits
  ``_CUTSET_WIDTH`` cells, :func:`_cutset`), solved once with the coarsest thinned pass
  only (``thinned_only``: Pareto sets bounded, a heuristic), and around each cutset node
  the ``_WINDOW`` nodes nearest it, solved exactly.  Measured on tiny ALBERT (2x2 mesh,
  70% cap) this finds the exact optimum where conditional modes alone stop 0.8% above it.
  ``_CUTSET_WIDTH``: 2^15 cells keeps the windows' peak under the inside passes' (12-layer
  ALBERT, 70% cap: 14 s and 0.74 GiB in all; 2^16 finds a plan 2.3% faster in 35 s, 1.4 GiB).

The answer is the fastest plan met; ``stats`` holds the lower bound, the relative gap
``(T - L) / T``, and the table size against the budget.  ``optimal`` is True only when the
plan's time equals ``L_(1, 0)``, computed exactly (integer sums below 2^53): then no plan
is faster (the memory tie-break is not proven).

Past the search's deadline (``search_budget_s``) no window starts and the cutset stops growing: the plan is the
best the decoded rows and the local search met (``stats["budget_hit"]``).  Building the tables, the bound rows
and the local search do not look at the clock (a 12-layer GPT-shaped model on a 4 x 8 x 8 mesh: 11.6 s of search
under a budget of 10 s).

When no plan met fits the cap, :class:`.InfeasibleError` says so, marked
``approximate=True``: the least-memory plan found (``min_mem_bytes``) need not be the
least there is, and the message says whether the memory row's bound proves that no plan
fits (``L_(0, 1) > cap``) or not.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from .deadline import Deadline
from .elimination import EliminationModel, elimination_order, mini_buckets
from .lagrange import GRID_GAP, LAMBDA_GRID, Point, argmin_plans, lagrange_slope
from .pareto import pareto_keep, tol
from .problem import INF, InfeasibleError, SearchProblem, Solution
from .prune import rows_cols

__all__ = ["mini_buckets", "solve_approx", "approx_min_memory"]

#: The search that re-solves a window: ``solve_window(problem, thinned_only=...)``.
WindowSolver = Callable[..., Solution]

logger = logging.getLogger(__name__)

_ROWS_AT_ONCE = 4  # weight rows per inside pass: its joint holds rows x budget floats
_SWEEPS = 50  # local search: at most this many sweeps over the nodes
_WINDOW = 24  # windows: nodes around a cutset node re-solved exactly at once
_WINDOW_SWEEPS = 3  # windows: at most this many sweeps over them
_CUTSET_WIDTH = 2**15  # the cutset's complement: width (cells) of its elimination, at most (measured below)


class _Local:
    """Iterated conditional modes over the model's allowed strategies (exact int64 deltas)."""

    def __init__(self, model: EliminationModel) -> None:
        problem = self.problem = model.problem
        self.allowed = model.allowed
        self.incident: list[list[tuple[np.ndarray, np.ndarray | None, int]]] = [[] for _ in range(problem.n_nodes)]
        for (u, v), et, em in zip(problem.edges, problem.edge_time, problem.edge_mem):
            au, av = model.allowed[u], model.allowed[v]
            t = rows_cols(et, au, av)  # a view where neither side was pruned
            m = None if em is None else rows_cols(em, au, av)
            self.incident[u].append((t, m, v))  # rows: u's allowed, columns: v's
            self.incident[v].append((t.T, None if m is None else m.T, u))
        self.movable = [v for v in range(problem.n_nodes) if len(model.allowed[v]) > 1]

    def reduced(self, choice: tuple[int, ...]) -> np.ndarray | None:
        """Positions of ``choice`` in the allowed lists (None: a choice not allowed)."""
        red = np.empty(len(choice), np.int64)
        for i, (c, al) in enumerate(zip(choice, self.allowed)):
            j = int(np.searchsorted(al, c))
            if j >= al.size or al[j] != c:
                return None
            red[i] = j
        return red

    def _key(self, bad: np.ndarray, t: np.ndarray, m: np.ndarray, cap: int | None, by_memory: bool) -> tuple:
        """Lexicographic keys, least first: forbidden pairs, then (memory, time) or (memory
        over the cap, time, memory)."""
        if by_memory:
            return (t, m, bad)
        over = np.zeros_like(m) if cap is None else np.maximum(m - cap, 0)
        return (m, t, over, bad)  # np.lexsort: the last key is the primary one

    def improve(self, choice: tuple[int, ...], cap: int | None, by_memory: bool = False) -> Point:
        """Node by node, the strategy with the least key given the neighbours' choices
        (:meth:`_key`: first fewer forbidden pairs, then under the cap, then the least (T, M),
        or with ``by_memory`` the least (M, T)), to a fixpoint or ``_SWEEPS`` sweeps.  Forbidden
        entries count in ``bad``, not in the time, so the sums stay exact in int64."""
        red = self.reduced(choice)
        if red is None:
            return Point(*self.problem.evaluate(choice), choice)
        problem = self.problem
        nodes = [(problem.node_time[v][al], problem.node_mem[v][al]) for v, al in enumerate(self.allowed)]
        terms = [(t[red[v]], m[red[v]]) for v, (t, m) in enumerate(nodes)]
        terms += [
            (t[red[v], red[w]], 0 if m is None else m[red[v], red[w]])
            for v in range(len(nodes))
            for t, m, w in self.incident[v]
            if w > v
        ]
        bad = sum(int(t >= INF) for t, _ in terms)
        tt = sum(int(t) for t, _ in terms if t < INF)
        mm = problem.base_mem_bytes + sum(int(m) for _, m in terms)
        for _ in range(_SWEEPS):
            moved = False
            for v in self.movable:
                t0, m0 = nodes[v]
                db, dt, dm = (t0 >= INF).astype(np.int64), np.where(t0 >= INF, 0, t0), m0.copy()
                for t, m, w in self.incident[v]:
                    col = t[:, red[w]]
                    db += col >= INF
                    dt += np.where(col >= INF, 0, col)
                    if m is not None:
                        dm += m[:, red[w]]
                c = red[v]
                nb, nt, nm = bad - int(db[c]) + db, tt - int(dt[c]) + dt, mm - int(dm[c]) + dm
                keys = self._key(nb, nt, nm, cap, by_memory)
                x = int(np.lexsort(keys)[0])
                if [int(k[x]) for k in reversed(keys)] < [int(k[c]) for k in reversed(keys)]:
                    red[v], bad, tt, mm, moved = x, int(nb[x]), int(nt[x]), int(nm[x]), True
            if not moved:
                break
        out = tuple(int(self.allowed[i][r]) for i, r in enumerate(red))
        got = problem.evaluate(out)
        if bad == 0 and got != (tt, mm):
            raise AssertionError(f"local search: plan re-evaluates to {got}, the deltas said {(tt, mm)}")
        return Point(*got, out)


def _window_problem(problem: SearchProblem, nodes: list[int], choice: tuple[int, ...]) -> SearchProblem:
    """The problem over ``nodes`` (sorted) with every other node fixed at ``choice``: the
    edges to fixed nodes fold into the nodes' own costs (INF stays INF); no base, no cap."""
    pos = {v: i for i, v in enumerate(nodes)}
    nt = [problem.node_time[v].copy() for v in nodes]
    nm = [problem.node_mem[v].copy() for v in nodes]
    edges, et, em = [], [], []
    for (u, v), t, m in zip(problem.edges, problem.edge_time, problem.edge_mem):
        if u in pos and v in pos:
            edges.append((pos[u], pos[v]))
            et.append(t)
            em.append(m)
        elif u in pos or v in pos:
            i, t, m = (pos[u], t[:, choice[v]], None if m is None else m[:, choice[v]]) if u in pos else (
                pos[v], t[choice[u]], None if m is None else m[choice[u]])  # fmt: skip
            nt[i] = np.minimum(nt[i] + np.minimum(t, INF), INF)
            if m is not None:
                nm[i] = nm[i] + m
    names = tuple(problem.names[v] for v in nodes)
    return SearchProblem(names, tuple(nt), tuple(nm), tuple(edges), tuple(et), tuple(em), None)


def _width(problem: SearchProblem, k: list[int], gone: set[int]) -> int:
    """Largest joint table (cells) of the greedy elimination
    (:func:`.elimination.elimination_order`) of the problem without the nodes ``gone``
    (fixed: their edges fold into unary costs)."""
    scopes = [(u, v) for u, v in problem.edges if u not in gone and v not in gone and k[u] > 1 and k[v] > 1]
    kk = [1 if v in gone else k[v] for v in range(len(k))]
    adj: dict[int, set[int]] = {v: set() for v in range(len(k)) if kk[v] > 1}
    for u, v in scopes:
        adj[u].add(v)
        adj[v].add(u)
    width = 1
    for v in elimination_order(scopes, kk):
        nbrs = adj.pop(v)
        width = max(width, kk[v] * math.prod(kk[w] for w in nbrs))
        for w in nbrs:
            adj[w].discard(v)
            adj[w].update(x for x in nbrs if x != w)
    return width


def _cutset(problem: SearchProblem, k: list[int], budget: int, deadline: Deadline | None = None) -> set[int]:
    """Nodes whose fixing brings the elimination's width to ``budget``: the most connected
    first (shared weights, outputs read by many layers), greedily (cutset conditioning).  Past
    ``deadline``, the nodes taken so far (the rest may then be too wide for a window)."""
    degree = [0] * len(k)
    for u, v in problem.edges:
        degree[u], degree[v] = degree[u] + 1, degree[v] + 1
    gone: set[int] = set()
    for v in sorted(range(len(k)), key=lambda v: (-degree[v], v)):
        if _width(problem, k, gone) <= budget or (deadline is not None and deadline.passed()):
            break
        gone.add(v)
    return gone


def _window_sets(
    problem: SearchProblem, k: list[int], budget: int, deadline: Deadline | None = None
) -> list[list[int]]:
    """Every node but a cutset (:func:`_cutset`: with the cutset fixed the rest is narrow),
    then around each cutset node the ``_WINDOW`` nodes nearest it (breadth first), so it
    moves with its readers."""
    n = problem.n_nodes
    adj: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.edges:
        adj[u].append(v)
        adj[v].append(u)
    gone = _cutset(problem, k, budget, deadline)
    sets = [[v for v in range(n) if v not in gone]]
    for hub in sorted(gone):
        ball, frontier = {hub}, [hub]
        while frontier and len(ball) < _WINDOW:
            frontier = list(dict.fromkeys(w for v in frontier for w in adj[v] if w not in ball))
            ball.update(frontier[: _WINDOW - len(ball)])
        sets.append(sorted(ball))
    return [[v for v in nodes if k[v] > 1] for nodes in sets]


def _windows(
    problem: SearchProblem,
    k: list[int],
    point: Point,
    budget: int,
    solve_window: WindowSolver,
    deadline: Deadline | None = None,
) -> tuple[Point, int, bool]:
    """Large-neighbourhood search: re-solve windows (:func:`_window_sets`) with the rest
    fixed (``solve_window``, i.e. :func:`.dp.solve_dp`, on :func:`_window_problem`, under the
    cap less the fixed nodes' memory; the first, wide, window once and thinned), keeping
    each better plan, to a fixpoint or ``_WINDOW_SWEEPS`` sweeps.  A window too wide for ``budget`` is skipped.
    Past ``deadline`` no further window starts.  Returns the plan, the number of windows that improved it, and
    whether the deadline stopped the windows."""
    if deadline is not None and deadline.passed():
        return point, 0, True
    cap, wins, sets = problem.mem_cap_bytes, 0, [w for w in _window_sets(problem, k, budget, deadline) if w]
    for sweep in range(_WINDOW_SWEEPS):
        better = False
        for nodes in sets[1:] if sweep else sets:  # the wide first window (cutset's complement) once
            if deadline is not None and deadline.passed():
                return point, wins, True
            sub = _window_problem(problem, nodes, point.choice)
            t_in, m_in = sub.evaluate([point.choice[v] for v in nodes])
            fixed_t, fixed_m = point.time - t_in, point.mem - m_in
            if EliminationModel(sub, deadline=deadline).width > budget:
                continue
            sub = sub.with_cap(None if cap is None else cap - fixed_m)
            got = solve_window(sub, thinned_only=nodes is sets[0])  # the wide one: bounded Pareto sets
            sol = Point(got.time, got.mem_bytes, got.choice)
            if (fixed_t + sol.time, fixed_m + sol.mem) < (point.time, point.mem):
                choice = list(point.choice)
                for v, c in zip(nodes, sol.choice):
                    choice[v] = c
                point, better, wins = Point(*problem.evaluate(choice), tuple(choice)), True, wins + 1
                if (point.time, point.mem) != (fixed_t + sol.time, fixed_m + sol.mem):
                    raise AssertionError(f"window search: plan re-evaluates to {point[:2]}, the window said otherwise")
        if not better:
            break
    return point, wins, False


def _batched_plans(model: EliminationModel, w: np.ndarray) -> tuple[list[Point], np.ndarray]:
    """:func:`.lagrange.argmin_plans` in batches of ``_ROWS_AT_ONCE`` rows: the plans, and the final
    lower bound of each row."""
    pts, finals = [], []
    for i in range(0, len(w), _ROWS_AT_ONCE):
        p, vals = argmin_plans(model, w[i : i + _ROWS_AT_ONCE])
        pts += p
        finals.append(np.asarray(vals[model.final], float).reshape(-1))
    return pts, np.concatenate(finals)


def _approx_stats(model: EliminationModel, exact_width: int, budget: int) -> dict:
    why = f"the exact elimination's largest joint table has {exact_width} cells per weight row > budget {budget}"
    return {"nodes": model.problem.n_nodes, "approximate": True, "why": why, "exact_width": exact_width,
            "budget": budget, "width": model.width, "steps": len(model.steps)}  # fmt: skip


def _least_memory(model: EliminationModel, local: _Local, exact_width: int, budget: int) -> tuple[Point, float]:
    """The least-memory plan found (memory row, then local search) and the memory row's bound."""
    (small,), finals = _batched_plans(model, np.array([[0.0, 1.0]]))
    small = local.improve(small.choice, None, by_memory=True)
    if small.time >= INF:
        raise InfeasibleError(_no_allowed(model.problem, exact_width, budget), approximate=True)
    return small, float(finals[0])


def _no_allowed(problem: SearchProblem, exact_width: int, budget: int) -> str:
    return (
        f"{problem.summary()}: the approximate search (joint table {exact_width} cells > budget {budget}) met no "
        "plan free of forbidden (INF) choices or pairs; not proven that none exists; fix: raise "
        "autopar.search.dp.WIDTH_BUDGET to search exactly, or allow more reshardings"
    )


def approx_min_memory(problem: SearchProblem, exact_width: int, budget: int, start: float) -> Solution:
    """The least-memory plan found (not proven least): :func:`.dp.min_memory` past the budget."""
    model = EliminationModel(problem, budget=budget)
    small, lb = _least_memory(model, _Local(model), exact_width, budget)
    stats = _approx_stats(model, exact_width, budget)
    stats.update(lower_bound=lb, gap=(small.mem - lb) / max(abs(small.mem), 1), solve_s=time.perf_counter() - start)
    return Solution(small.choice, small.time, small.mem, False, "dp", stats["solve_s"], stats)


def _over_cap(small: Point, lb_m: float, cap: int, exact_width: int, budget: int) -> InfeasibleError:
    """The error for a search whose least-memory plan found (``small``) is over the cap; ``lb_m``: the memory
    row's bound, which proves no plan fits when it is over the cap too."""
    proven = lb_m > cap + tol(cap)
    how = f"the memory bound {lb_m:.0f} B > cap proves it" if proven else "not proven: approximate search"
    return InfeasibleError(
        f"the approximate search (joint table {exact_width} cells > budget {budget}) found no plan under the "
        f"memory cap {cap} B ({how}); the least-memory plan it found uses {small.mem} B (time {small.time} "
        "ps); fix: raise mem_cap_bytes, use more devices, or raise autopar.search.dp.WIDTH_BUDGET",
        cap_bytes=cap,
        min_mem_bytes=small.mem,
        min_mem_solution=Solution(small.choice, small.time, small.mem, False, "dp", 0.0),
        approximate=True,
    )


def _lagrange_plans(model: EliminationModel, fast: Point, seen: list[Point], cap: int, lb: float) -> tuple:
    """(lam*, the lower bound raised by it): Eisner-Severance from the fast plan (over the cap) and the fastest
    plan met under it (:func:`.lagrange.lagrange_slope`), then, while the gap to the best plan under the cap
    is wider than ``GRID_GAP``, the slopes lam* x ``LAMBDA_GRID``.  Every plan met is appended to ``seen``."""
    hi = min((p for p in seen if p.mem <= cap), key=lambda p: (p.time, p.mem))
    lam, vals_l = lagrange_slope(model, fast, hi, cap, seen)
    lb = max(lb, float(vals_l[model.final][0]) - lam * cap)
    ub = min(p.time for p in seen if p.mem <= cap and p.time < INF)
    if ub - lb > GRID_GAP * abs(ub):
        grid = np.array([[1.0, lam * f] for f in LAMBDA_GRID])
        pts, finals = _batched_plans(model, grid)
        seen += pts
        lb = max([lb] + [float(v) - float(r[1]) * cap for v, r in zip(finals, grid)])
    return lam, lb


def solve_approx(
    problem: SearchProblem,
    exact_width: int,
    budget: int,
    *,
    frontier: bool,
    start: float,
    solve_window: WindowSolver,
    deadline: Deadline | None = None,
) -> Solution:
    """:func:`.dp.solve_dp` past the width budget (module docstring): the fastest plan found
    under the cap (``optimal`` only when the time bound proves it), with the lower bound and
    the gap in ``stats``.  ``solve_window(problem, thinned_only=...)`` re-solves a window
    (:func:`_windows`): :func:`.dp.solve_dp` passes itself, so a window is searched as any
    problem is, and this module need not import the search that calls it."""
    model = EliminationModel(problem, budget=budget, deadline=deadline)
    local = _Local(model)
    cap = problem.mem_cap_bytes
    stats = _approx_stats(model, exact_width, budget)
    (fast,), finals = _batched_plans(model, np.array([[1.0, 0.0]]))
    finals_t = finals[0]
    lb, lam = float(finals_t), 0.0
    if fast.time >= INF:  # a forbidden pair: repair it first
        fast = local.improve(fast.choice, None)
    seen = [fast] if fast.time < INF else []
    if cap is not None or frontier:
        small, lb_m = _least_memory(model, local, exact_width, budget)
        seen.append(small)
        if cap is not None and small.mem > cap:
            raise _over_cap(small, lb_m, cap, exact_width, budget)
    if cap is not None and fast.mem > cap and fast.time < INF:  # (a forbidden fast plan: no hull to walk)
        lam, lb = _lagrange_plans(model, fast, seen, cap, lb)
    fits = [p for p in seen if p.time < INF and (cap is None or p.mem <= cap)]
    tick = time.perf_counter()
    improved = [local.improve(c, cap) for c in dict.fromkeys(p.choice for p in seen)]  # over the cap too: repaired
    stats["local_s"] = time.perf_counter() - tick
    good = [p for p in improved if p.time < INF and (cap is None or p.mem <= cap)]
    if not good:
        raise InfeasibleError(_no_allowed(problem, exact_width, budget), approximate=True)
    best = min(good, key=lambda p: (p.time, p.mem))
    tick = time.perf_counter()
    # uncapped, a window's search is one min-sum pass (no Pareto sets): as wide as the budget
    window_budget = budget if cap is None else min(budget, _CUTSET_WIDTH)
    best, stats["windows"], late = _windows(problem, model.k, best, window_budget, solve_window, deadline)
    if late:
        stats["budget_hit"] = True
    stats["windows_s"] = time.perf_counter() - tick
    if fits:  # ps the local search took off the best decoded plan
        stats["local_gain"] = min(p.time for p in fits) - best.time
    if frontier:
        pts = np.array([(p.time, p.mem) for p in seen + improved + [best] if p.time < INF], np.int64)
        front = pts[pareto_keep(np.zeros(len(pts), np.int64), pts[:, 0], pts[:, 1])]
        stats["frontier"], stats["frontier_exact"] = [(int(a), int(b)) for a, b in front], False
    stats.update({"lambda": lam}, lower_bound=lb, upper_bound=best.time, gap=(best.time - lb) / max(abs(best.time), 1))
    # The time row's bound is a sum of int64 costs, exact in float64 below 2^53: a plan
    # meeting it is optimal, to the picosecond (the memory tie-break is not proven).
    exact = sum(float(np.abs(t).max(initial=0)) for t in model.t) < 2**53  # every partial sum too
    optimal = exact and best.time <= float(finals_t)
    stats["optimal_time_proven"] = optimal
    stats["solve_s"] = time.perf_counter() - start
    logger.warning(
        "solve_dp: %s: %s; approximate search (mini-buckets) -> (%d ps, %d B), within %.2f%% of the lower bound, "
        "in %.2fs",
        problem.summary(),
        stats["why"],
        best.time,
        best.mem,
        100 * stats["gap"],
        stats["solve_s"],
    )
    return Solution(best.choice, best.time, best.mem, optimal, "dp", stats["solve_s"], stats)
