"""Exact search: bucket elimination over Pareto sets of (time, memory).

Objective and constraints (``c`` picks one strategy per node; see ``problem.py``)
--------------------------------------------------------------------------------
* objective   minimize ``T(c) = sum_i t_i(c_i) + sum_(u,v) t_uv(c_u, c_v)``      -- :func:`solve_dp`
* memory      ``M(c) = base + sum_i m_i(c_i) + sum_(u,v) m_uv(c_u, c_v) <= cap``  -- :func:`_pareto_pass`
  (pruning) and the final pick in :func:`_pick`
* forbidden   no ``INF`` choice or pair; removed up front by arc consistency    -- :func:`_reduce_domains`

Every term is a *factor*: a table over a scope of nodes holding, per assignment of
the scope, a Pareto set of (t, m) pairs.  Node i gives a unary factor, edge (u, v) a
binary one; nodes left with one strategy are conditioned away (their factors lose
that axis) and factors with equal scopes are merged (:class:`_Model`).

Elimination (:func:`_pareto_pass`).  Nodes are eliminated greedily, smallest new
table first (:func:`_order`), so leaves (parameters) fold into their consumer and
chain nodes into an edge first, and residual blocks reduce series-parallel.
Eliminating x with bucket ``F_1..F_r`` (the factors whose scope holds x) makes

    g(s) = Pareto( U_x  F_1(s, x) (+) F_2(s, x) (+) ... (+) F_r(s, x) ),   s in scope(g)

where ``A (+) B = {(t+t', m+m')}`` is the Minkowski sum and ``Pareto`` drops
dominated pairs (sort by (t, m); keep a pair iff its m is below every m before it).
Pareto(A (+) B) = Pareto(Pareto(A) (+) B), so the bucket is folded one factor at a
time.  Each kept pair stores x and the pair indices it came from (back-pointers).

Bounds.  A scalar pass with weights (w_t, w_m) gives, for each factor, the inside
value ``I_g(s) = min over its pairs of w_t t + w_m m`` and the outside value
``O_g(s)`` = the same minimum over every factor *not* below g (:func:`_inside`,
:func:`_outside`; min-sum elimination with the same order, then its reverse)::

    I_g(s) = min_x sum_j I_{F_j}(s, x)
    O_{F_j}(s_j) = min_{(s, x) \\ s_j} [ O_g(s) + sum_{l != j} I_{F_l}(s, x) ]

A pair (t, m) in a cell of g's bucket is dropped when ``w_t t + w_m m + rest > B``
(rest = O_g + inside values of the bucket factors not folded yet) for:
  - time:      (1, 0),   B = UB (a feasible plan's time)
  - memory:    (0, 1),   B = cap
  - Lagrange:  (1, lam), B = UB + lam * cap,  lam from :func:`_lagrange`: the slope
    of the convex hull of the (T, M) frontier where it crosses the cap (each step
    solves ``min T + lam M`` by min-sum and moves lam to the crossing of the two
    hull points around the cap, Eisner-Severance).  Only pairs whose Lagrangian
    reduced cost lies within the duality gap ``UB - LB`` survive.
Floats only ever prune with a margin (``_tol``), so rounding keeps extra pairs, never
loses one: the result is exact.  With ``frontier=True`` the cap and UB are not used;
a pair is dropped when its ideal completion ``(t + O_t, m + O_m)`` is dominated by a
known plan on the hull (``_hull``), and the final Pareto set is the full frontier.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from .problem import INF, InfeasibleError, SearchProblem, Solution

__all__ = ["solve_dp", "min_memory"]

logger = logging.getLogger(__name__)


def _tol(bound: float) -> float:
    """Float slack for pruning: far above rounding error, far below one unit of cost."""
    return 1e-9 * abs(bound) + 1.0


def _reduce_domains(problem: SearchProblem) -> list[np.ndarray]:
    """Allowed strategies per node: drop INF choices, then arc consistency on INF pairs."""
    alive = [np.asarray(t < INF) for t in problem.node_time]
    incident: list[list[int]] = [[] for _ in range(problem.n_nodes)]
    ok = [np.asarray(t < INF) for t in problem.edge_time]
    for e, (u, v) in enumerate(problem.edges):
        incident[u].append(e)
        incident[v].append(e)
    queue, queued = list(range(len(problem.edges))), set(range(len(problem.edges)))
    while queue:
        e = queue.pop()
        queued.discard(e)
        u, v = problem.edges[e]
        allowed = ok[e] & alive[u][:, None] & alive[v][None, :]
        for node, support in ((u, allowed.any(axis=1)), (v, allowed.any(axis=0))):
            if (alive[node] & ~support).any():
                alive[node] = alive[node] & support
                for f in incident[node]:
                    if f not in queued:
                        queued.add(f)
                        queue.append(f)
    for i, a in enumerate(alive):
        if not a.any():
            raise InfeasibleError(
                f"node {problem.names[i]}: every strategy is forbidden (INF time) or has only forbidden pairs "
                f"with a neighbour, so every assignment is forbidden; fix: allow a strategy (e.g. replicate) for it"
            )
    return [np.flatnonzero(a) for a in alive]


def _order(scopes: list[tuple[int, ...]], k: list[int]) -> list[int]:
    """Greedy elimination order: smallest new table (product of the neighbours' k)
    first, ties in topological order, so after the leaves and chains fold away one
    front sweeps the residual stream from input to loss (one big message absorbing
    small ones, never two big ones meeting)."""
    adj: dict[int, set[int]] = {v: set() for v in range(len(k)) if k[v] > 1}
    for s in scopes:
        for v in s:
            adj[v].update(w for w in s if w != v)

    def cost(v: int) -> tuple[int, int]:
        return math.prod(k[w] for w in adj[v]), v

    current = {v: cost(v) for v in adj}
    heap = [(c, v) for v, c in current.items()]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        c, v = heapq.heappop(heap)
        if v not in current or current[v] != c:
            continue
        del current[v]
        order.append(v)
        nbrs = adj.pop(v)
        for w in nbrs:
            adj[w].discard(v)
            adj[w].update(x for x in nbrs if x != w)
        for w in nbrs:
            current[w] = cost(w)
            heapq.heappush(heap, (current[w], w))
    return order


@dataclass(slots=True)
class _Step:
    """One bucket: eliminate ``var`` (-1: sum the final scalars) from ``inputs``."""

    var: int
    inputs: tuple[int, ...]
    scope: tuple[int, ...]
    shape: tuple[int, ...]  # joint axes: scope, then var
    bcast: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per input: transpose, broadcast shape
    pos: tuple[tuple[int, ...], ...]  # per input: joint axis of each scope variable
    out: int


class _Model:
    """The problem as factors over reduced domains plus an elimination plan."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.allowed = _reduce_domains(problem)
        k = self.k = [len(a) for a in self.allowed]
        acc: dict[tuple[int, ...], list[np.ndarray]] = {(): [np.zeros((), np.int64), np.full((), problem.base_mem_bytes, np.int64), np.ones((), bool)]}

        def add(nodes: tuple[int, ...], t: np.ndarray, m: np.ndarray) -> None:
            scope = tuple(v for v in nodes if k[v] > 1)
            shape = tuple(k[v] for v in scope)
            ok = (t < INF).reshape(shape)
            t, m = np.where(ok, t.reshape(shape), 0), np.where(ok, m.reshape(shape), 0)
            if scope in acc:
                acc[scope] = [acc[scope][0] + t, acc[scope][1] + m, acc[scope][2] & ok]
            else:
                acc[scope] = [t, m, ok]

        for i in range(problem.n_nodes):
            al = self.allowed[i]
            add((i,), problem.node_time[i][al], problem.node_mem[i][al])
        for e, (u, v) in enumerate(problem.edges):
            ix = np.ix_(self.allowed[u], self.allowed[v])
            em = problem.edge_mem[e]
            add((u, v), problem.edge_time[e][ix], np.zeros((k[u], k[v]), np.int64) if em is None else em[ix])
        self.scopes = list(acc)
        self.t = [acc[s][0] for s in self.scopes]
        self.m = [acc[s][1] for s in self.scopes]
        self.ok = [acc[s][2] for s in self.scopes]
        self.n_orig = len(self.scopes)
        self._plan()

    def _plan(self) -> None:
        k, scopes = self.k, list(self.scopes)
        holding: dict[int, set[int]] = {}
        for tid, s in enumerate(scopes):
            for v in s:
                holding.setdefault(v, set()).add(tid)
        self.steps: list[_Step] = []
        self.step_of: dict[int, _Step] = {}
        live = set(range(len(scopes)))
        for v in _order(scopes, k) + [-1]:
            inputs = tuple(sorted(holding.pop(v))) if v >= 0 else tuple(sorted(live))
            live.difference_update(inputs)
            for tid in inputs:
                for w in scopes[tid]:
                    if w != v:
                        holding[w].discard(tid)
            scope = tuple(sorted({w for tid in inputs for w in scopes[tid]} - {v}))
            joint = scope + ((v,) if v >= 0 else ())
            bcast, poss = [], []
            for tid in inputs:
                pos = [joint.index(w) for w in scopes[tid]]
                poss.append(tuple(pos))
                bshape = [1] * len(joint)
                for p in pos:
                    bshape[p] = k[joint[p]]
                bcast.append((tuple(int(p) for p in np.argsort(pos)), tuple(bshape)))
            out = len(scopes)
            scopes.append(scope)
            step = _Step(v, inputs, scope, tuple(k[w] for w in joint), tuple(bcast), tuple(poss), out)
            self.steps.append(step)
            self.step_of[out] = step
            live.add(out)
            for w in scope:
                holding[w].add(out)
        self.all_scopes = scopes
        self.final = self.steps[-1].out

    def weights(self, wt: float, wm: float) -> list[np.ndarray]:
        return [np.where(ok, wt * t.astype(float) + wm * m.astype(float), np.inf) for t, m, ok in zip(self.t, self.m, self.ok)]

    def original_choice(self, reduced: np.ndarray) -> tuple[int, ...]:
        return tuple(int(self.allowed[i][reduced[i]]) for i in range(len(self.k)))


def _bc(step: _Step, j: int, arr: np.ndarray) -> np.ndarray:
    """Input j's table broadcast onto the step's joint axes."""
    perm, bshape = step.bcast[j]
    return arr.transpose(perm).reshape(bshape)


def _joint(step: _Step, vals: list, skip: int = -1) -> np.ndarray:
    acc: np.ndarray | float = 0.0
    for j, tid in enumerate(step.inputs):
        if j != skip:
            acc = acc + _bc(step, j, vals[tid])
    return np.broadcast_to(acc, step.shape)


def _inside(model: _Model, wt: float, wm: float) -> tuple[list, dict[int, np.ndarray]]:
    """Min-sum elimination of ``wt T + wm M``: inside value of every table, argmins."""
    vals: list = model.weights(wt, wm) + [None] * len(model.steps)
    args: dict[int, np.ndarray] = {}
    for st in model.steps:
        joint = _joint(st, vals)
        if st.var < 0:
            vals[st.out] = np.asarray(joint, float)
        else:
            arg = args[st.out] = joint.argmin(axis=-1)
            vals[st.out] = np.take_along_axis(joint, arg[..., None], axis=-1)[..., 0]
    return vals, args


def _outside(model: _Model, vals: list) -> list:
    """Outside value of every eliminated table (the reverse pass of the docstring)."""
    outs: list = [None] * len(vals)
    outs[model.final] = np.zeros(())
    for st in reversed(model.steps):
        oh = outs[st.out] if st.var < 0 else outs[st.out][..., None]
        for j, tid in enumerate(st.inputs):
            if tid < model.n_orig:
                continue
            rest = np.broadcast_to(oh + _joint(st, vals, skip=j), st.shape)
            perm, bshape = st.bcast[j]
            axes = tuple(a for a, s in enumerate(bshape) if s == 1)
            r = rest.min(axis=axes) if axes else rest
            outs[tid] = np.asarray(r).transpose(np.argsort(perm))
    return outs


@dataclass(frozen=True, slots=True)
class _Point:
    time: int
    mem: int
    choice: tuple[int, ...]


def _scalar_plan(model: _Model, wt: float, wm: float) -> tuple[_Point, list]:
    """The argmin plan of ``wt T + wm M`` (exactly re-evaluated) and the inside values."""
    vals, args = _inside(model, wt, wm)
    if not np.isfinite(vals[model.final]):
        raise InfeasibleError(f"{model.problem.summary()}: every assignment hits a forbidden (INF) choice or pair; fix the strategy lists")
    red = np.zeros(len(model.k), np.int64)
    for st in reversed(model.steps):
        if st.var >= 0:
            red[st.var] = args[st.out][tuple(red[w] for w in st.scope)]
    choice = model.original_choice(red)
    t, m = model.problem.evaluate(choice)
    return _Point(t, m, choice), vals


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
        sv = (s2 - lo) - dr * span
    else:
        rank = np.unique(s2, return_inverse=True)[1].reshape(-1)
        sv = rank - dr * (int(rank.max()) + 1)
    cm = np.minimum.accumulate(sv)
    keep = np.empty(g2.size, bool)
    keep[0], keep[1:] = True, sv[1:] < cm[:-1]
    return o[keep]


@dataclass(slots=True)
class _Tab:
    off: np.ndarray  # CSR offsets over the table's entries
    t: np.ndarray
    m: np.ndarray
    xs: np.ndarray | None = None  # choice of the eliminated node per pair
    bp: np.ndarray | None = None  # (pairs, inputs): pair index into each input
    keys: tuple | None = None  # search keys of :func:`_window`, built on first use


def _window(tab: _Tab, e: np.ndarray, qp: np.ndarray | None, qs: np.ndarray | None, primary: str) -> tuple[np.ndarray, np.ndarray]:
    """For each query, the pairs of entry ``e`` with primary <= qp and secondary <= qs.

    Within an entry pairs are sorted by primary ascending (secondary descending), so
    that is a contiguous range.  One searchsorted over all entries at once: a pair's
    key is ``entry * width + rank of its value among the table's values``.
    """
    start, stop = tab.off[e], tab.off[e + 1]
    if qp is None and qs is None:
        return start, stop
    if tab.keys is None:
        ent = np.repeat(np.arange(tab.off.size - 1), np.diff(tab.off))
        pv, sv = (tab.t, tab.m) if primary == "t" else (tab.m, tab.t)
        sp, sn = np.sort(pv), np.sort(-sv)
        width = pv.size + 1
        tab.keys = (width, sp, ent * width + np.searchsorted(sp, pv, "right"), sn, ent * width + np.searchsorted(sn, -sv, "left"))
    width, sp, kp, sn, ks = tab.keys
    base = e * width
    if qp is not None:
        stop = np.minimum(stop, np.searchsorted(kp, base + np.searchsorted(sp, qp, "right"), "right"))
    if qs is not None:
        start = np.maximum(start, np.searchsorted(ks, base + np.searchsorted(sn, -qs, "left"), "left"))
    return start, np.maximum(stop, start)


@dataclass(frozen=True, slots=True)
class _Bound:
    """Drop a pair when ``wt t + wm m + rest > limit`` (rest from ``ins``/``outs``)."""

    wt: float
    wm: float
    limit: float
    ins: list
    outs: list


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rep = np.repeat(np.arange(counts.size), counts)
    within = np.arange(rep.size) - (np.cumsum(counts) - counts)[rep]
    return rep, within


def _dominated(stair: tuple[np.ndarray, np.ndarray], it: np.ndarray, im: np.ndarray) -> np.ndarray:
    """Whether a known plan (stair: times ascending, running-min memories) is clearly
    at least as good as the ideal completion (it, im) in both time and memory."""
    at = np.searchsorted(stair[0], it - (1e-9 * np.abs(it) + 1.0), side="right") - 1
    return (at >= 0) & (stair[1][np.maximum(at, 0)] <= im - (1e-9 * np.abs(im) + 1.0))


def _pareto_pass(
    model: _Model,
    bounds: list[_Bound],
    *,
    primary: str = "t",
    stair: tuple[np.ndarray, np.ndarray] | None = None,
    progress: Callable[[int, int], None] | None = None,
    beam: int | None = None,
) -> tuple[list, dict]:
    """Eliminate every node over Pareto sets (the recurrence of the module docstring).

    Work is done only where it can matter: first the output entries s whose best
    completion ``I_g(s) + O_g(s)`` passes every bound, then the cells (s, x) whose
    ``O_g(s) + sum_j I_{F_j}(s, x)`` does, then pair by pair as the bucket is folded.
    ``stair`` = (times ascending, running-min memories) of known plans: drop pairs whose
    ideal completion they dominate (``bounds[0]``/``bounds[1]`` must be time/memory).
    ``beam`` (heuristic, for an upper bound only) keeps one pair per entry and memory
    bucket of that width; the pairs kept are exact plans.
    """
    tabs: list = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        flat = ok.reshape(-1)
        tabs.append(_Tab(np.concatenate([[0], np.cumsum(flat)]), t.reshape(-1)[flat], m.reshape(-1)[flat]))
    # Stack the bounds: row b of every array below belongs to bound b; the last two
    # rows are time/memory for the staircase test when ``stair`` is given.
    live = [bd for bd in bounds if np.isfinite(bd.limit)]
    used = live + (bounds[:2] if stair is not None else [])
    nl = len(live)
    wt = np.array([bd.wt for bd in live])[:, None]
    wm = np.array([bd.wm for bd in live])[:, None]
    lim = np.array([bd.limit + _tol(bd.limit) for bd in live])[:, None]
    pure_t = [b for b, bd in enumerate(live) if bd.wt and not bd.wm]
    pure_m = [b for b, bd in enumerate(live) if bd.wm and not bd.wt]
    stats = {"steps": len(model.steps), "max_pairs": 0, "max_combined": 0, "pairs": 0}
    for si, st in enumerate(model.steps):
        kx = st.shape[-1] if st.var >= 0 else 1
        best = np.stack([(bd.outs[st.out] + bd.ins[st.out]).reshape(-1) for bd in used]) if used else np.zeros((0, 1))
        row_ok = (best[:nl] <= lim).all(axis=0) if nl else np.ones(math.prod(st.shape) // kx, bool)
        if stair is not None:
            row_ok &= np.isfinite(best[-2:]).all(axis=0)
            row_ok[row_ok] &= ~_dominated(stair, best[-2, row_ok], best[-1, row_ok])
        rows = np.flatnonzero(row_ok)
        cells = (rows[:, None] * kx + np.arange(kx)).reshape(-1)
        coords = np.unravel_index(cells, st.shape) if st.shape else ()
        ents = []
        for j, tid in enumerate(st.inputs):
            tshape = tuple(model.k[v] for v in model.all_scopes[tid])
            ents.append(np.ravel_multi_index(tuple(coords[p] for p in st.pos[j]), tshape) if tshape else np.zeros(cells.size, np.int64))
        out = np.stack([np.repeat(bd.outs[st.out].reshape(-1)[rows], kx) for bd in used]) if used else np.zeros((0, cells.size))
        ins = [np.stack([bd.ins[tid].reshape(-1)[e] for bd in used]) if used else out for tid, e in zip(st.inputs, ents)]
        total = out + sum(ins)
        cell_ok = (total[:nl] <= lim).all(axis=0)
        if stair is not None:
            cell_ok &= np.isfinite(total[-2:]).all(axis=0)
            cell_ok[cell_ok] &= ~_dominated(stair, total[-2, cell_ok], total[-1, cell_ok])
        alive = np.flatnonzero(cell_ok)
        cells, ents = cells[alive], [e[alive] for e in ents]
        order = sorted(range(len(st.inputs)), key=lambda j: tabs[st.inputs[j]].t.size)
        rest = out[:, alive]
        rests = [rest]  # rests[i]: (bounds, cells) rest after folding order[:i+1]
        for j in reversed(order[1:]):
            rest = rest + ins[j][:, alive]
            rests.append(rest)
        rests.reverse()
        cell, t, m = np.arange(cells.size), np.zeros(cells.size, np.int64), np.zeros(cells.size, np.int64)
        ptrs: list[np.ndarray] = []
        for i, j in enumerate(order):
            tab = tabs[st.inputs[j]]
            rc = rests[i][:, cell]
            # the input's time / memory still allowed by the pure time / memory bounds
            qt = ((lim[pure_t] - rc[pure_t]) / wt[pure_t]).min(axis=0) - t if pure_t else None
            qm = ((lim[pure_m] - rc[pure_m]) / wm[pure_m]).min(axis=0) - m if pure_m else None
            start, stop = _window(tab, ents[j][cell], *((qt, qm) if primary == "t" else (qm, qt)), primary)
            rep, within = _expand(stop - start)
            q = start[rep] + within
            cell, t, m = cell[rep], t[rep] + tab.t[q], m[rep] + tab.m[q]
            ptrs = [p[rep] for p in ptrs] + [q]
            stats["max_combined"] = max(stats["max_combined"], cell.size)
            rc = rests[i][:, cell]
            keep = (rc[:nl] + wt * t + wm * m <= lim).all(axis=0)
            if stair is not None:
                it, im = t + rc[-2], m + rc[-1]
                keep[keep] &= ~_dominated(stair, it[keep], im[keep])
            sel = np.flatnonzero(keep)
            if i + 1 < len(order):
                sel = sel[_pareto_keep(cell[sel], *((t[sel], m[sel]) if primary == "t" else (m[sel], t[sel])))]
            cell, t, m, ptrs = cell[sel], t[sel], m[sel], [p[sel] for p in ptrs]
        group = cells[cell] // kx
        sel = _pareto_keep(group, *((t, m) if primary == "t" else (m, t)))
        if beam is not None and sel.size > 1:
            g, bucket = group[sel], (m[sel] if primary == "t" else t[sel]) // beam
            edge = np.ones(sel.size + 1, bool)
            edge[1:-1] = (g[1:] != g[:-1]) | (bucket[1:] != bucket[:-1])
            sel = sel[edge[:-1] | edge[1:]]  # the fastest and the smallest pair of each bucket
        bp = np.empty((sel.size, len(order)), np.int64)
        for i, j in enumerate(order):
            bp[:, j] = ptrs[i][sel]
        off = np.concatenate([[0], np.cumsum(np.bincount(group[sel], minlength=row_ok.size))])
        tabs.append(_Tab(off, t[sel], m[sel], cells[cell[sel]] % kx, bp))
        stats["max_pairs"] = max(stats["max_pairs"], int(sel.size))
        stats["pairs"] += int(sel.size)
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


def _bound(model: _Model, wt: float, wm: float, limit: float, vals: list) -> _Bound:
    return _Bound(wt, wm, limit, vals, _outside(model, vals))


def _min_memory(model: _Model, start: float) -> Solution:
    point, vals = _scalar_plan(model, 0.0, 1.0)
    tabs, stats = _pareto_pass(model, [_bound(model, 0.0, 1.0, point.mem, vals)], primary="m")
    fin = tabs[model.final]
    if fin.t.size == 0:
        raise AssertionError(f"min_memory: the DP lost the min-memory plan ({point.mem} B); internal pruning bug")
    choice = _backtrack(model, tabs, 0)
    t, m = model.problem.evaluate(choice)
    return Solution(choice, t, m, True, "dp", time.perf_counter() - start, stats)


def min_memory(problem: SearchProblem) -> Solution:
    """The assignment with the smallest memory ``M`` (ties broken by time), exactly."""
    return _min_memory(_Model(problem), time.perf_counter())


def _lagrange(model: _Model, lo: _Point, hi: _Point, cap: int, seen: list[_Point]) -> tuple[float, list]:
    """Eisner-Severance on the hull: lo breaks the cap, hi meets it; returns lam* and
    the inside values of ``T + lam* M``.  Every plan met is appended to ``seen``."""
    vals: list = []
    lam = 0.0
    for _ in range(64):
        lam = max(0.0, (hi.time - lo.time) / (lo.mem - hi.mem))
        p, vals = _scalar_plan(model, 1.0, lam)
        seen.append(p)
        line = lo.time + lam * lo.mem
        if p.time + lam * p.mem >= line - _tol(line):
            break
        if p.mem <= cap:
            hi = p
        else:
            lo = p
    return lam, vals


def _hull(model: _Model, a: _Point, b: _Point, seen: list[_Point], budget: int = 24) -> None:
    """Supported points of the frontier between a (fast) and b (small), into ``seen``."""
    segs = [(a, b)]
    while segs and budget > 0:
        p, q = segs.pop()
        if p.time >= q.time or p.mem <= q.mem:
            continue
        lam = (q.time - p.time) / (p.mem - q.mem)
        r, _ = _scalar_plan(model, 1.0, lam)
        budget -= 1
        line = p.time + lam * p.mem
        if r.time + lam * r.mem < line - _tol(line):
            seen.append(r)
            segs += [(p, r), (r, q)]


_THIN_GRIDS = (64, 512, 4096)  # memory buckets across [min-mem plan, min-time plan]
_LAMBDA_GRID = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2.0, 4.0, 8.0, 16.0)  # extra slopes, times lam*


def _with_target(bounds: list[_Bound], target: int, cap: int | None) -> list[_Bound]:
    """The bounds for plans with time <= target and memory <= cap."""
    return [replace(b, limit=cap if not b.wt else target + b.wm * (cap or 0)) for b in bounds]


def _pick(fin: _Tab, cap: int | None) -> int:
    """Index of the fastest final pair within the cap (pairs are sorted by time), or -1."""
    fits = np.flatnonzero(fin.m <= cap) if cap is not None else np.arange(min(fin.t.size, 1))
    return int(fits[0]) if fits.size else -1


def solve_dp(
    problem: SearchProblem,
    *,
    progress: Callable[[int, int], None] | None = None,
    frontier: bool = False,
) -> Solution:
    """Minimum time under the memory cap, exactly (ties broken by memory).

    ``progress(done, total)`` is called after each eliminated node.  ``frontier=True``
    also returns the whole (time, mem) Pareto frontier, cap ignored, sorted by time,
    in ``stats["frontier"]``.  Raises :class:`InfeasibleError` when nothing fits.
    """
    start = time.perf_counter()
    model = _Model(problem)
    cap = problem.mem_cap_bytes
    fast, vals_t = _scalar_plan(model, 1.0, 0.0)
    seen = [fast]
    small, vals_m = None, None
    lam, vals_l = 0.0, None
    if cap is not None or frontier:
        small, vals_m = _scalar_plan(model, 0.0, 1.0)
        seen.append(small)
    if cap is not None and fast.mem > cap:
        if small.mem > cap:
            exact = _min_memory(model, start)
            if exact.mem_bytes > cap:
                raise InfeasibleError.over_cap(problem, exact)
            small = _Point(exact.time, exact.mem_bytes, exact.choice)
            seen.append(small)
        lam, vals_l = _lagrange(model, fast, small, cap, seen)
    stats: dict = {"nodes": problem.n_nodes, "eliminated": len(model.steps) - 1, "lambda": lam}
    stats["width"] = max((len(st.shape) for st in model.steps), default=0)
    stats["bounds_s"] = time.perf_counter() - start
    if frontier:
        _hull(model, fast, small, seen)
        known = sorted((p.time, p.mem) for p in seen)
        ks_t = np.array([x[0] for x in known], float)
        ks_m = np.minimum.accumulate(np.array([x[1] for x in known], float))
        bounds = [_bound(model, 1.0, 0.0, np.inf, vals_t), _bound(model, 0.0, 1.0, np.inf, vals_m)]
        tabs, pstats = _pareto_pass(model, bounds, stair=(ks_t, ks_m), progress=progress)
    else:
        ub = min(p.time for p in seen if cap is None or p.mem <= cap)
        lb = float(vals_t[model.final])
        bounds = [_bound(model, 1.0, 0.0, ub, vals_t)]
        if cap is not None:
            bounds.append(_bound(model, 0.0, 1.0, cap, vals_m))
        if vals_l is not None:
            bounds.append(_bound(model, 1.0, lam, ub + lam * cap, vals_l))
            lb = max(lb, float(vals_l[model.final]) - lam * cap)
        gap = (ub - lb) / max(abs(ub), 1)
        for f in _LAMBDA_GRID if vals_l is not None and gap > 1e-3 else ():
            # More slopes: a pair's best completion trades time for memory at its own rate.
            p, vals = _scalar_plan(model, 1.0, lam * f)
            seen.append(p)
            bounds.append(_bound(model, 1.0, lam * f, 0.0, vals))
        ub = min(p.time for p in seen if p.mem <= (cap if cap is not None else p.mem))
        stats.update(lower_bound=lb, lagrange_ub=ub, heuristic_s=0.0, bounds=len(bounds))
        for grid in _THIN_GRIDS if cap is not None and ub > lb + _tol(lb) else ():
            # Thinned passes keep one pair per (entry, memory bucket): exact plans, fast,
            # and a UB near the optimum makes the exact pass below prune hard.
            tick = time.perf_counter()
            tabs, _ = _pareto_pass(model, _with_target(bounds, ub, cap), beam=max(1, (fast.mem - small.mem) // grid))
            stats["heuristic_s"] += time.perf_counter() - tick
            fin = tabs[model.final]
            idx = _pick(fin, cap)
            if idx >= 0 and fin.t[idx] < ub:
                ub = int(fin.t[idx])
                seen.append(_Point(ub, int(fin.m[idx]), _backtrack(model, tabs, idx)))
            if ub <= lb + _tol(lb):
                break
        stats["upper_bound"] = ub
        tabs, pstats = _pareto_pass(model, _with_target(bounds, ub, cap), progress=progress)
    stats.update(pstats)
    fin = tabs[model.final]
    idx = _pick(fin, cap)
    candidates = [(int(fin.t[idx]), int(fin.m[idx]), idx)] if idx >= 0 else []
    candidates += [(p.time, p.mem, p) for p in seen if cap is None or p.mem <= cap]
    if frontier:
        pts = np.array([(int(a), int(b)) for a, b in zip(fin.t, fin.m)] + [(p.time, p.mem) for p in seen], np.int64).reshape(-1, 2)
        keep = _pareto_keep(np.zeros(len(pts), np.int64), pts[:, 0], pts[:, 1])
        stats["frontier"] = [(int(a), int(b)) for a, b in pts[keep]]
    if not candidates:
        if cap is not None and frontier:
            exact = _min_memory(model, start)
            if exact.mem_bytes > cap:
                raise InfeasibleError.over_cap(problem, exact)
        raise AssertionError(f"solve_dp: no plan survived on {problem.summary()}; internal pruning bug")
    best_t, best_m, ref = min(candidates, key=lambda c: (c[0], c[1]))
    choice = ref.choice if isinstance(ref, _Point) else _backtrack(model, tabs, ref)
    t, m = problem.evaluate(choice)
    if (t, m) != (best_t, best_m):
        raise AssertionError(f"solve_dp: plan re-evaluates to ({t}, {m}), DP said ({best_t}, {best_m}); internal bug")
    stats["solve_s"] = time.perf_counter() - start
    logger.info("solve_dp: %s -> time %d ps, mem %d B in %.3fs (max pairs %d)", problem.summary(), t, m, stats["solve_s"], stats["max_pairs"])
    return Solution(choice, t, m, True, "dp", stats["solve_s"], stats)
