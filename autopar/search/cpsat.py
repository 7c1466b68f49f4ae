"""The referee: the same search problem as a CP-SAT (OR-Tools) model.

Objective and constraints (all exact integers, so the optimum equals the DP's)
-----------------------------------------------------------------------------
* choice       ``x[i, s]`` Boolean, ``sum_s x[i, s] == 1`` per node           -- :func:`_build`
* pair         ``y[e, s, t]`` Boolean per edge and allowed pair, tied to its ends by
               ``sum_t y[e, s, t] == x[u, s]`` and ``sum_s y[e, s, t] == x[v, t]``
               (so ``y[e, s, t] == x[u, s] AND x[v, t]``)                       -- :func:`_build`
* forbidden    an ``INF`` choice gets no ``x`` (fixed 0), an ``INF`` pair no ``y``,
               which the two marginal equalities turn into ``NOT(x[u,s] AND x[v,t])``
* memory       ``base + sum m_i(s) x[i, s] + sum m_e(s, t) y[e, s, t] <= cap``   -- :func:`_build`
* objective    minimize ``sum t_i(s) x[i, s] + sum t_e(s, t) y[e, s, t]``      -- :func:`solve_cpsat`

An edge with a one-strategy end is folded into the other end's ``x`` (same value,
fewer variables).  ``optimal=True`` only when CP-SAT proves OPTIMAL.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from ortools.sat.python import cp_model

from .problem import INF, InfeasibleError, SearchProblem, Solution

__all__ = ["solve_cpsat"]

logger = logging.getLogger(__name__)


def _build(
    problem: SearchProblem,
) -> tuple[cp_model.CpModel, list[dict[int, cp_model.IntVar]], cp_model.LinearExpr, cp_model.LinearExpr, int]:
    """The model, ``x`` per node (choice -> Boolean), the time and memory expressions,
    and the number of Booleans."""
    model = cp_model.CpModel()
    ks = problem.num_choices
    unary_t = [problem.node_time[i].astype(object).copy() for i in range(problem.n_nodes)]
    unary_m = [problem.node_mem[i].astype(object).copy() for i in range(problem.n_nodes)]
    time_terms: list = []
    mem_terms: list = []
    pairs: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    for e, (u, v) in enumerate(problem.edges):
        et, em = problem.edge_time[e], problem.edge_mem[e]
        if ks[u] == 1 or ks[v] == 1:
            node, row = (v, (0, slice(None))) if ks[u] == 1 else (u, (slice(None), 0))
            add_t = et[row]
            unary_t[node] = np.where((add_t >= INF) | (unary_t[node] >= INF), INF, unary_t[node] + add_t)
            if em is not None:
                unary_m[node] = unary_m[node] + em[row]
        else:
            pairs.append((e, et, em))
    x: list[dict[int, cp_model.IntVar]] = []
    for i in range(problem.n_nodes):
        xi = {s: model.new_bool_var(f"x[{i},{s}]") for s in range(ks[i]) if unary_t[i][s] < INF}
        model.add_exactly_one(list(xi.values()))
        x.append(xi)
        time_terms += [int(unary_t[i][s]) * b for s, b in xi.items() if unary_t[i][s]]
        mem_terms += [int(unary_m[i][s]) * b for s, b in xi.items() if unary_m[i][s]]
    n_bools = sum(len(xi) for xi in x)
    for e, et, em in pairs:
        u, v = problem.edges[e]
        rows: dict[int, list] = {s: [] for s in x[u]}
        cols: dict[int, list] = {t: [] for t in x[v]}
        for s in x[u]:
            for t in x[v]:
                if et[s, t] >= INF:
                    continue
                y = model.new_bool_var(f"y[{e},{s},{t}]")
                rows[s].append(y)
                cols[t].append(y)
                n_bools += 1
                if et[s, t]:
                    time_terms.append(int(et[s, t]) * y)
                if em is not None and em[s, t]:
                    mem_terms.append(int(em[s, t]) * y)
        for s, ys in rows.items():
            model.add(sum(ys) == x[u][s])
        for t, ys in cols.items():
            model.add(sum(ys) == x[v][t])
    return (
        model,
        x,
        cp_model.LinearExpr.sum(time_terms),
        cp_model.LinearExpr.sum(mem_terms) + problem.base_mem_bytes,
        n_bools,
    )


def _solve(model: cp_model.CpModel, time_limit_s: float | None, workers: int) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    return solver, solver.solve(model)


def _choice(solver: cp_model.CpSolver, x: list[dict[int, cp_model.IntVar]]) -> tuple[int, ...]:
    return tuple(next(s for s, b in xi.items() if solver.boolean_value(b)) for xi in x)


def _min_memory(problem: SearchProblem, time_limit_s: float | None, workers: int) -> Solution:
    """Lexicographic (memory, then time) minimum, in two CP-SAT solves."""
    start = time.perf_counter()
    model, x, t_expr, m_expr, _ = _build(problem)
    model.minimize(m_expr)
    solver, status = _solve(model, time_limit_s, workers)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleError(
            f"{problem.summary()}: every assignment hits a forbidden (INF) choice or pair; fix the strategy lists"
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(
            f"CP-SAT min-memory on {problem.summary()}: no plan within time_limit_s={time_limit_s}; "
            "fix: raise the limit"
        )
    proven = status == cp_model.OPTIMAL
    model.add(m_expr == int(round(solver.objective_value)))
    model.minimize(t_expr)
    solver, status = _solve(model, time_limit_s, workers)
    choice = _choice(solver, x)
    t, m = problem.evaluate(choice)
    return Solution(choice, t, m, proven and status == cp_model.OPTIMAL, "cpsat", time.perf_counter() - start)


def solve_cpsat(problem: SearchProblem, *, time_limit_s: float | None = None, workers: int = 2) -> Solution:
    """Minimum time under the memory cap by CP-SAT (the referee for :func:`~.dp.solve_dp`).

    Raises :class:`InfeasibleError` (with the smallest reachable memory) when CP-SAT
    proves nothing fits, ``TimeoutError`` when it finds no plan within ``time_limit_s``.
    """
    start = time.perf_counter()
    model, x, t_expr, m_expr, n_bools = _build(problem)
    if problem.mem_cap_bytes is not None:
        model.add(m_expr <= problem.mem_cap_bytes)
    model.minimize(t_expr)
    solver, status = _solve(model, time_limit_s, workers)
    if status == cp_model.INFEASIBLE:
        least = _min_memory(problem, time_limit_s, workers)
        raise InfeasibleError.over_cap(problem, least)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(
            f"CP-SAT on {problem.summary()}: status {solver.status_name(status)} after {solver.wall_time:.1f}s "
            f"(time_limit_s={time_limit_s}); fix: raise time_limit_s or use solve_dp"
        )
    choice = _choice(solver, x)
    t, m = problem.evaluate(choice)
    if t != int(round(solver.objective_value)):
        raise AssertionError(f"solve_cpsat: plan re-evaluates to time {t}, CP-SAT reported {solver.objective_value}")
    elapsed = time.perf_counter() - start
    stats = {
        "status": solver.status_name(status),
        "best_bound": solver.best_objective_bound,
        "booleans": n_bools,
        "wall_s": solver.wall_time,
    }
    logger.info(
        "solve_cpsat: %s -> %s time %d ps, mem %d B in %.3fs", problem.summary(), stats["status"], t, m, elapsed
    )
    return Solution(choice, t, m, status == cp_model.OPTIMAL, "cpsat", elapsed, stats)
