"""Exact search: bucket elimination over Pareto sets of (time, memory).

Objective and constraints (``c`` picks one strategy per node; see ``problem.py``)
* objective  minimize ``T(c) = sum_i t_i(c_i) + sum_(u,v) t_uv(c_u, c_v)``       -- :func:`solve_dp`
* memory     ``M(c) = base + sum_i m_i(c_i) + sum_(u,v) m_uv(c_u, c_v) <= cap``   -- pruned in
             :func:`_pareto_pass`, enforced by the final pick in :func:`_finish`
* forbidden  no ``INF`` choice or pair: arc consistency cuts the domains
             (``SearchProblem.allowed_choices``); forbidden pairs are empty entries
             (:class:`.elimination._Model`)

Domains.  After arc consistency, strategies dominated on their whole neighbourhood go
(:func:`.prune.prune_dominated`: every (T, M) point survives, so the search stays exact).

Width.  Past ``WIDTH_BUDGET`` cells per weight row in the largest joint table (weights
shared across layers put every layer in one bucket) :func:`solve_dp` and :func:`min_memory`
approximate instead (:mod:`.minibucket`: mini-buckets, a lower bound, local search;
``optimal=False``, ``stats["approximate"]``), and a :mod:`.chain` part's model (given the
budget) raises :class:`.ChainError`, so the planner solves flat.

Factors and order are :mod:`.elimination`'s (:class:`.elimination._Model`): the tables,
here holding per assignment of their scope a Pareto set of (t, m) pairs, and the greedy
elimination plan.

Elimination (:func:`_pareto_pass`).  Along the plan, eliminating x with bucket
``F_1..F_r`` (the factors whose scope holds x) gives

    g(s) = Pareto( U_x  F_1(s, x) (+) ... (+) F_r(s, x) )    for each assignment s

with ``A (+) B = {(t + t', m + m')}``; ``Pareto`` drops dominated pairs (:func:`_pareto_keep`).
Pareto(A (+) B) = Pareto(Pareto(A) (+) B), so the bucket is folded one factor at a time;
each pair keeps x and the pairs it came from, for :func:`_backtrack`.

Bounds.  Min-sum with weight rows (w_t, w_m) (:mod:`.elimination`'s inside and outside
passes, :func:`_bounds`) gives every table ``I_g(s)``, the least ``w_t t + w_m m`` of its
pairs, and ``O_g(s)``, the same least over all factors not below g.  A pair (t, m) at cell
(s, x) goes when ``w_t t + w_m m + rest > B`` (rest = ``O_g(s)`` plus the ``I`` of the
bucket factors not folded yet) on any row:
  time (1, 0), B = target;  memory (0, 1), B = cap;  Lagrange (1, lam), B = target + lam cap.
lam* (:func:`_lagrange`) is the slope of the hull of the (T, M) frontier where it crosses
the cap (solve ``min T + lam M``; move lam to the line through the hull plans either side
of the cap: Eisner-Severance); ``L = min T + lam*(M - cap)`` bounds the optimum below.
When ``target - L`` is large lam* x 2^-4..2^4 are added too: a pair's completion trades
time for memory at its own rate.  Entries s and cells (s, x) are tested before any pair,
and the time/memory rows cut each fold to one range of the next factor's pairs
(:func:`_window`).  Floats prune only past a margin (:func:`_tol`): rounding keeps extra
pairs, never loses one, so the optimum is exact.

Target.  The time of the best plan met so far.  Thinned passes (per entry and memory
bucket only the fastest and the smallest pair, each a real plan) improve it cheaply
before the one exact pass.  ``frontier=True`` (:func:`_frontier`) drops cap and target:
a pair stays while it may complete below a gap of the known plans' staircase
(:func:`_in_gaps`); past ``_FRONTIER_POINTS`` pairs an entry is thinned (flagged).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .elimination import _argmin_at, _inside, _Model, _outside
from .problem import InfeasibleError, SearchProblem, Solution

__all__ = ["solve_dp", "min_memory"]

logger = logging.getLogger(__name__)

_THIN_GRIDS = (64, 512, 4096)  # memory buckets across [min-memory plan, min-time plan]
_LAMBDA_GRID = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2.0, 4.0, 8.0, 16.0)  # extra slopes, times lam*
_GRID_GAP = 5e-3  # relative gap (target - L) / target above which the extra slopes pay
_THIN_GAP = 2e-4  # ... above which thinned passes pay
_FRONTIER_POINTS = 32  # frontier mode: at most this many pairs per entry (else not exact)
#: Cells per weight row of the largest joint table the exact search builds; past it the
#: search approximates (:mod:`.minibucket`).  Measured (exact, 2x2 mesh, 70% cap): tiny
#: ALBERT at 4.1e7 cells peaks at 8.7 GiB and 58-170 s, tiny T5 at 2.9e7 cells at 5.8 GiB
#: and 57 s CPU; memory and time scale about linearly with the width, so 2^21 (2.1e6)
#: keeps the peak near 450 MiB and the search to seconds.  Read at each call: tests lower it.
WIDTH_BUDGET = 2**21


def _tol(bound: float | np.ndarray) -> float | np.ndarray:
    """Float slack for pruning: well above the rounding of sums of int64 costs, so a float
    test never drops a pair that the exact integer test would keep."""
    return 1e-9 * np.abs(bound) + 1.0


class _Point(NamedTuple):
    time: int
    mem: int
    choice: tuple[int, ...]


def _plans(model: _Model, w: np.ndarray) -> tuple[list[_Point], list]:
    """Per row of weights, the argmin plan of ``w_t T + w_m M`` (re-evaluated exactly),
    and the inside values."""
    vals, _ = _inside(model, w, argmins=False)
    if not np.isfinite(vals[model.final]).all():
        raise InfeasibleError(f"{model.problem.summary()}: every plan hits a forbidden (INF) choice or pair")
    red = np.zeros((len(w), len(model.k)), np.int64)
    for var in reversed(model.buckets):
        if var >= 0:
            red[:, var] = _argmin_at(model, var, vals, red)
    choices = [model.original_choice(r) for r in red]
    return [_Point(*model.problem.evaluate(c), c) for c in choices], vals


@dataclass(slots=True)
class _Bounds:
    """Bound rows stacked: row b is ``wt[b] T + wm[b] M``; per table ``ins`` (rows,
    entries), and for eliminated tables ``outs``."""

    wt: np.ndarray  # (rows, 1)
    wm: np.ndarray
    ins: list
    outs: list


def _bounds(model: _Model, w: np.ndarray, vals: list, final_out: np.ndarray | None = None) -> _Bounds:
    outs = [o if o is None else o.reshape(len(w), -1) for o in _outside(model, vals, final_out)]
    return _Bounds(w[:, :1].astype(float), w[:, 1:2].astype(float), [v.reshape(len(w), -1) for v in vals], outs)


def _pareto_keep(g: np.ndarray, p: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Indices of the Pareto pairs of each group g (minimize primary p, then secondary s),
    ordered by (g, p).  Segmented running minimum of s via a per-group offset."""
    if g.size == 0:
        return g
    o = np.lexsort((s, p, g))
    g2, s2 = g[o], s[o]
    new = np.empty(g2.size, bool)
    new[0], new[1:] = True, g2[1:] != g2[:-1]
    dr = np.cumsum(new) - 1
    lo = int(s2.min())
    span = int(s2.max()) - lo + 1
    if span * (int(dr[-1]) + 1) < 2**62:
        sv = (s2 - lo) - dr * span  # later groups lie wholly below earlier ones
    else:
        rank = np.unique(s2, return_inverse=True)[1].reshape(-1)
        sv = rank - dr * (int(rank.max()) + 1)
    keep = np.empty(g2.size, bool)
    keep[0], keep[1:] = True, sv[1:] < np.minimum.accumulate(sv)[:-1]
    return o[keep]


@dataclass(slots=True)
class _Tab:
    off: np.ndarray  # CSR offsets over the table's entries
    t: np.ndarray
    m: np.ndarray
    xs: np.ndarray | None = None  # choice of the eliminated node per pair
    bp: np.ndarray | None = None  # (pairs, inputs): pair index into each input
    keys: tuple | None = None  # search keys of :func:`_window`, built on first use
    wide: bool = False  # some entry holds many pairs: worth :func:`_window`


def _window(tab: _Tab, e: np.ndarray, qt: np.ndarray | None, qm: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of entry ``e`` with t <= qt and m <= qm: within an entry pairs run by t
    ascending (m descending), so that is one range.  One searchsorted for all entries:
    a pair's key is ``entry * width + rank of its value among the table's``."""
    start, stop = tab.off[e], tab.off[e + 1]
    if tab.keys is None:
        ent = np.repeat(np.arange(tab.off.size - 1), np.diff(tab.off))
        st, sm, width = np.sort(tab.t), np.sort(-tab.m), tab.t.size + 1
        kt, km = ent * width + np.searchsorted(st, tab.t, "right"), ent * width + np.searchsorted(sm, -tab.m, "left")
        tab.keys = (width, st, kt, sm, km)
    width, st, kt, sm, km = tab.keys
    if qt is not None:
        stop = np.minimum(stop, np.searchsorted(kt, e * width + np.searchsorted(st, qt, "right"), "right"))
    if qm is not None:
        start = np.maximum(start, np.searchsorted(km, e * width + np.searchsorted(sm, -qm, "left"), "left"))
    return start, np.maximum(stop, start)


def _in_gaps(gaps: tuple[np.ndarray, ...], bnd: _Bounds, t: np.ndarray, m: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Whether pair (t, m) may complete to a plan no known plan dominates: below-left of
    some gap corner (cx, cy) = (next known plan's time, this one's memory), i.e. passing
    the target cx / cap cy test on the time, memory and that gap's slope rows."""
    cx, cy, row = gaps
    ok = np.zeros(rest.shape[1], bool)
    ti, mi = t + rest[0], m + rest[1]
    for x, y, r in zip(cx, cy, row):
        rhs = bnd.wt[r, 0] * x + bnd.wm[r, 0] * y
        lhs = bnd.wt[r, 0] * t + bnd.wm[r, 0] * m + rest[r]
        ok |= (ti <= x + _tol(x)) & (mi <= y + _tol(y)) & (lhs <= rhs + _tol(rhs))
    return ok


def _pareto_pass(
    model: _Model,
    bnd: _Bounds,
    limits: np.ndarray,
    *,
    gaps: tuple[np.ndarray, ...] | None = None,
    beam: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    values_only: bool = False,
) -> tuple[list, dict]:
    """Eliminate every node over Pareto sets (the recurrence of the module docstring).

    ``limits``: B per bound row (inf: unused).  ``gaps``: see :func:`_in_gaps`.  ``beam``
    (heuristic) keeps the fastest and the smallest pair per entry and memory bucket of
    that width, or (``beam < 0``) of ``-beam`` rank buckets (evenly spaced).
    ``values_only`` frees tables once used and keeps no back-pointers."""
    tabs = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        flat = ok.reshape(-1)
        tabs.append(_Tab(np.concatenate([[0], np.cumsum(flat)]), t.reshape(-1)[flat], m.reshape(-1)[flat]))
    lim = (limits + _tol(limits))[:, None]
    pure_t = np.flatnonzero((bnd.wm[:, 0] == 0) & np.isfinite(limits))
    pure_m = np.flatnonzero((bnd.wt[:, 0] == 0) & np.isfinite(limits))
    stats = {"steps": len(model.steps), "max_pairs": 0, "max_combined": 0, "pairs": 0, "thinned": False}
    for si, st in enumerate(model.steps):
        kx = st.shape[-1] if st.var >= 0 else 1
        best = bnd.ins[st.out] + bnd.outs[st.out]
        row_ok = (best <= lim).all(axis=0)
        if gaps is not None:
            row_ok &= np.isfinite(best).all(axis=0)
            row_ok[row_ok] &= _in_gaps(gaps, bnd, 0.0, 0.0, best[:, row_ok])
        rows = np.flatnonzero(row_ok)
        cells = (rows[:, None] * kx + np.arange(kx)).reshape(-1)
        coords = np.unravel_index(cells, st.shape) if st.shape else ()
        ents = []
        for j, tid in enumerate(st.inputs):
            tshape = tuple(model.k[v] for v in model.scopes[tid])
            ents.append(np.ravel_multi_index(tuple(coords[p] for p in st.pos[j]), tshape) if tshape else 0 * cells)
        out = np.repeat(bnd.outs[st.out][:, rows], kx, axis=1)
        ins = [bnd.ins[tid][:, e] for tid, e in zip(st.inputs, ents)]
        total = out + sum(ins)
        cell_ok = (total <= lim).all(axis=0)
        if gaps is not None:
            cell_ok &= np.isfinite(total).all(axis=0)
            cell_ok[cell_ok] &= _in_gaps(gaps, bnd, 0.0, 0.0, total[:, cell_ok])
        alive = np.flatnonzero(cell_ok)
        cells, ents = cells[alive], [e[alive] for e in ents]
        order = sorted(range(len(st.inputs)), key=lambda j: tabs[st.inputs[j]].t.size)
        rests = [out[:, alive]]  # rests[i]: rest after folding order[:i+1]
        for j in reversed(order[1:]):
            rests.append(rests[-1] + ins[j][:, alive])
        rests.reverse()
        cell, t, m = np.arange(cells.size), np.zeros(cells.size, np.int64), np.zeros(cells.size, np.int64)
        ptrs: list[np.ndarray] = []
        single = True  # at most one pair per cell so far: no Pareto filter needed
        for i, j in enumerate(order):
            tab = tabs[st.inputs[j]]
            e = ents[j][cell]
            if tab.wide and (pure_t.size or pure_m.size):
                rc = rests[i][:, cell]
                qt = ((lim[pure_t] - rc[pure_t]) / bnd.wt[pure_t]).min(axis=0) - t if pure_t.size else None
                qm = ((lim[pure_m] - rc[pure_m]) / bnd.wm[pure_m]).min(axis=0) - m if pure_m.size else None
                start, stop = _window(tab, e, qt, qm)
            else:
                start, stop = tab.off[e], tab.off[e + 1]
            counts = stop - start
            if single and counts.max(initial=0) <= 1:
                rep = np.flatnonzero(counts)
                q = start[rep]
            else:
                single = False
                rep = np.repeat(np.arange(counts.size), counts)
                q = start[rep] + np.arange(rep.size) - (np.cumsum(counts) - counts)[rep]
            cell, t, m = cell[rep], t[rep] + tab.t[q], m[rep] + tab.m[q]
            rc = rests[i][:, cell]
            ptrs = [p[rep] for p in ptrs] + [q]
            stats["max_combined"] = max(stats["max_combined"], cell.size)
            keep = (rc + bnd.wt * t + bnd.wm * m <= lim).all(axis=0)
            if gaps is not None:
                keep[keep] &= _in_gaps(gaps, bnd, t[keep], m[keep], rc[:, keep])
            sel = np.flatnonzero(keep)
            if i + 1 < len(order) and not single:
                sel = sel[_pareto_keep(cell[sel], t[sel], m[sel])]
            cell, t, m, ptrs = cell[sel], t[sel], m[sel], [p[sel] for p in ptrs]
        group = cells[cell] // kx
        sel = _pareto_keep(group, t, m)
        if beam is not None and sel.size > 1:
            g = group[sel]
            if beam > 0:  # memory buckets of width beam
                bucket = m[sel] // beam
            else:  # at most -beam pairs per entry, evenly spaced by rank
                first = np.searchsorted(g, g)
                size = np.searchsorted(g, g, side="right") - first
                bucket = (np.arange(g.size) - first) * -beam // size
                stats["thinned"] |= bool(size.max() > -beam)
            edge = np.ones(sel.size + 1, bool)
            edge[1:-1] = (g[1:] != g[:-1]) | (bucket[1:] != bucket[:-1])
            sel = sel[edge[:-1] | edge[1:]]  # first and last of each bucket: the entry's extremes stay
        bp = None if values_only else np.empty((sel.size, len(order)), np.int64)
        for i, j in enumerate(order):
            if values_only:
                tabs[st.inputs[j]] = None  # consumed
            else:
                bp[:, j] = ptrs[i][sel]
        off = np.concatenate([[0], np.cumsum(np.bincount(group[sel], minlength=row_ok.size))])
        tabs.append(_Tab(off, t[sel], m[sel], cells[cell[sel]] % kx, bp, wide=bool(np.diff(off).max(initial=0) > 8)))
        stats["max_pairs"], stats["pairs"] = max(stats["max_pairs"], sel.size), stats["pairs"] + sel.size
        if progress is not None:
            progress(si + 1, len(model.steps))
    return tabs, stats


def _backtrack(model: _Model, tabs: list, p: int) -> tuple[int, ...]:
    red = np.zeros(len(model.k), np.int64)
    stack = [(model.final, p)]
    while stack:
        tid, p = stack.pop()
        st, tab = model.step_of[tid], tabs[tid]
        if st.var >= 0:
            red[st.var] = tab.xs[p]
        stack.extend((kid, int(tab.bp[p, j])) for j, kid in enumerate(st.inputs) if kid >= model.n_orig)
    return model.original_choice(red)


def _min_memory(model: _Model, start: float) -> Solution:
    swapped = copy.copy(model)  # memory first, then time: the pass minimizes "t", then "m"
    swapped.t, swapped.m = model.m, model.t
    w = np.array([[1.0, 0.0]])
    (point,), vals = _plans(swapped, w)
    tabs, stats = _pareto_pass(swapped, _bounds(swapped, w, vals), np.array([float(point.mem)]))
    if tabs[model.final].t.size == 0:
        raise AssertionError(f"min_memory: the DP lost the min-memory plan ({point.mem} B); internal pruning bug")
    choice = _backtrack(model, tabs, 0)
    t, m = model.problem.evaluate(choice)
    return Solution(choice, t, m, True, "dp", time.perf_counter() - start, stats)


def min_memory(problem: SearchProblem, *, width_budget: int | None = None) -> Solution:
    """The plan with the smallest memory ``M`` (ties broken by time), exactly; past the
    width budget (``WIDTH_BUDGET`` unless given) the least found, ``optimal=False``
    (:func:`.minibucket.approx_min_memory`)."""
    start = time.perf_counter()
    model = _Model(problem)
    budget = WIDTH_BUDGET if width_budget is None else width_budget
    if model.width > budget:
        from .minibucket import approx_min_memory

        return approx_min_memory(problem, model.width, budget, start)
    return _min_memory(model, start)


def _lagrange(model: _Model, lo: _Point, hi: _Point, cap: int, seen: list[_Point]) -> tuple[float, list]:
    """Eisner-Severance on the hull (lo breaks the cap, hi meets it): lam* and the
    inside values of ``T + lam* M``.  Every plan met goes to ``seen``."""
    lam, vals = 0.0, []
    for _ in range(64):
        lam = max(0.0, (hi.time - lo.time) / (lo.mem - hi.mem))
        (p,), vals = _plans(model, np.array([[1.0, lam]]))
        seen.append(p)
        line = lo.time + lam * lo.mem
        if p.time + lam * p.mem >= line - _tol(line):
            break
        lo, hi = (lo, p) if p.mem <= cap else (p, hi)
    return lam, vals


def _frontier(model: _Model, seen: list[_Point], w: np.ndarray, vals: list) -> tuple[list[tuple[int, int]], bool]:
    """The (time, memory) Pareto frontier, cap ignored, and whether it is exact (an
    entry with more than ``_FRONTIER_POINTS`` pairs keeps that many, evenly spaced)."""
    fast, small = seen[0], seen[1]
    slope = max(small.time - fast.time, 1) / max(fast.mem - small.mem, 1)
    seen = seen + _plans(model, np.array([[1.0, slope * 2.0**e] for e in range(-8, 9)]))[0]
    known = [(p.time, p.mem) for p in seen]
    known = [known[i] for i in _pareto_keep(np.zeros(len(known), np.int64), *np.array(known, np.int64).T)]
    slopes = np.array([[1.0, (b[0] - a[0]) / (a[1] - b[1])] for a, b in zip(known, known[1:])]).reshape(-1, 2)
    if len(slopes):
        pts, vals_h = _plans(model, slopes)
        seen += pts
        w, vals = np.concatenate([w, slopes]), [np.concatenate(x) for x in zip(vals, vals_h)]
    big = 1e300  # open ends: faster than the fastest known plan, smaller than the smallest
    cx = np.array([known[0][0]] + [b[0] for b in known[1:]] + [big], float)
    cy = np.array([big] + [a[1] for a in known[:-1]] + [known[-1][1]], float)
    gaps = (cx, cy, np.array([0] + list(range(2, 2 + len(slopes))) + [1]))
    bnd = _bounds(model, w, vals)
    tabs, pst = _pareto_pass(model, bnd, np.full(len(w), np.inf), gaps=gaps, values_only=True, beam=-_FRONTIER_POINTS)
    fin = tabs[model.final]
    pts = np.concatenate([np.stack([fin.t, fin.m], 1), np.array([(p.time, p.mem) for p in seen], np.int64)])
    front = pts[_pareto_keep(np.zeros(len(pts), np.int64), pts[:, 0], pts[:, 1])]
    return [(int(a), int(b)) for a, b in front], not pst["thinned"]


def _limits(bnd: _Bounds, target: float, cap: int | None) -> np.ndarray:
    """B per row for plans with time <= target and memory <= cap."""
    wt, wm = bnd.wt[:, 0], bnd.wm[:, 0]
    return np.where(wt == 0, np.inf if cap is None else float(cap), target + wm * (cap or 0))


def _pick(fin: _Tab, cap: int | None) -> int:
    """Index of the fastest final pair within the cap (pairs are sorted by time), or -1."""
    fits = np.flatnonzero(fin.m <= cap) if cap is not None else np.arange(min(fin.t.size, 1))
    return int(fits[0]) if fits.size else -1


def _finish(model: _Model, tabs: list, seen: list[_Point], stats: dict, start: float) -> Solution:
    """The best of the DP's final pairs and the plans met on the way, re-evaluated."""
    problem, cap = model.problem, model.problem.mem_cap_bytes
    fin = tabs[model.final]
    idx = _pick(fin, cap)
    cands = [(int(fin.t[idx]), int(fin.m[idx]), idx)] if idx >= 0 else []
    cands += [(p.time, p.mem, p) for p in seen if cap is None or p.mem <= cap]
    best_t, best_m, ref = min(cands, key=lambda c: (c[0], c[1]))  # seen holds a plan that fits
    choice = ref.choice if isinstance(ref, _Point) else _backtrack(model, tabs, ref)
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
) -> Solution:
    """Minimum time under the memory cap, exactly (ties broken by memory).

    Past the width budget (the largest joint table over ``width_budget`` cells per weight
    row, ``WIDTH_BUDGET`` unless given) the search is approximate instead
    (:func:`.minibucket.solve_approx`): a plan, ``optimal=False``, with a lower bound and the
    gap in ``stats``; its :class:`InfeasibleError` is marked ``approximate``.
    ``thinned_only`` (a heuristic, for :mod:`.minibucket`'s windows): skip the exact pass,
    return the best plan the bounds and the coarsest thinned pass met.

    ``progress(done, total)`` is called after each node of the exact pass.
    ``frontier=True`` also returns the (time, mem) Pareto frontier, cap ignored, sorted
    by time, in ``stats["frontier"]``; ``stats["frontier_exact"]`` says whether it is
    complete (see :func:`_frontier`).  Raises :class:`InfeasibleError` when no plan fits
    the cap (or every plan is forbidden).
    """
    start = time.perf_counter()
    model = _Model(problem)
    budget = WIDTH_BUDGET if width_budget is None else width_budget
    if model.width > budget:
        from .minibucket import solve_approx

        return solve_approx(problem, model.width, budget, frontier=frontier, start=start)
    cap = problem.mem_cap_bytes
    w = np.array([[1.0, 0.0], [0.0, 1.0]] if cap is not None or frontier else [[1.0, 0.0]])
    seen, vals = _plans(model, w)
    fast, small = seen[0], seen[-1]
    lb, lam = float(vals[model.final][0]), 0.0
    if cap is not None and fast.mem > cap:
        if small.mem > cap:  # the min-sum argmin is exact up to float ties: settle it
            exact = _min_memory(model, start)
            if exact.mem_bytes > cap:
                raise InfeasibleError.over_cap(problem, exact)
            small = _Point(exact.time, exact.mem_bytes, exact.choice)
            seen.append(small)
        lam, vals_l = _lagrange(model, fast, small, cap, seen)
        lb = max(lb, float(vals_l[model.final][0]) - lam * cap)
        w, vals = np.concatenate([w, [[1.0, lam]]]), [np.concatenate(x) for x in zip(vals, vals_l)]
        ub = min(p.time for p in seen if p.mem <= cap)
        if ub - lb > _GRID_GAP * abs(ub):  # extra slopes, solved as one batch
            grid = np.array([[1.0, lam * f] for f in _LAMBDA_GRID])
            pts, vals_g = _plans(model, grid)
            seen += pts
            w, vals = np.concatenate([w, grid]), [np.concatenate(x) for x in zip(vals, vals_g)]
    stats: dict = {"nodes": problem.n_nodes, "lambda": lam, "lower_bound": lb, "heuristic_s": 0.0, "rows": len(w)}
    if frontier:
        stats["frontier"], stats["frontier_exact"] = _frontier(model, seen, w[:2], [v[:2] for v in vals])
    ub = min(p.time for p in seen if cap is None or p.mem <= cap)
    bnd = _bounds(model, w, vals)
    stats.update(bounds_s=time.perf_counter() - start, lagrange_ub=ub)
    for grid in (_THIN_GRIDS[:1] if thinned_only else _THIN_GRIDS) if ub - lb > _THIN_GAP * abs(ub) else ():
        # Coarse to fine; stop once a fine pass finds nothing better.
        tick = time.perf_counter()
        tabs, _ = _pareto_pass(model, bnd, _limits(bnd, ub, cap), beam=max(1, (fast.mem - small.mem) // grid))
        stats["heuristic_s"] += time.perf_counter() - tick
        fin = tabs[model.final]
        idx = _pick(fin, cap)
        better = idx >= 0 and fin.t[idx] < ub
        if better:
            seen.append(_Point(int(fin.t[idx]), int(fin.m[idx]), _backtrack(model, tabs, idx)))
            ub = seen[-1].time
        if ub <= lb + _tol(lb) or (grid != _THIN_GRIDS[0] and not better):
            break
    if thinned_only:  # the best plan met; optimal only when it meets the bound
        best = min((p for p in seen if cap is None or p.mem <= cap), key=lambda p: (p.time, p.mem))
        optimal = not frontier and (cap is None or fast.mem <= cap)  # the min-sum's plan is then the optimum
        return Solution(best.choice, best.time, best.mem, optimal, "dp", time.perf_counter() - start, stats)
    tabs, pstats = _pareto_pass(model, bnd, _limits(bnd, ub, cap), progress=progress)
    return _finish(model, tabs, seen, {**stats, **pstats, "upper_bound": ub}, start)
