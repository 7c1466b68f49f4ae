"""Exact search: bucket elimination over Pareto sets of (time, memory).

Objective and constraints (``c`` picks one strategy per node; see ``problem.py``)
* objective  minimize ``T(c) = sum_i t_i(c_i) + sum_(u,v) t_uv(c_u, c_v)``      -- :func:`solve_dp`
* memory     ``M(c) = base + sum_i m_i(c_i) + sum_(u,v) m_uv(c_u, c_v) <= cap``  -- pruned in
  :func:`_pareto_pass`, enforced by the final pick in :func:`_finish`
* forbidden  no ``INF`` choice or pair: domains cut by arc consistency
  (``SearchProblem.allowed_choices``), forbidden pairs are empty entries in :class:`_Model`

Factors.  Node i gives a unary factor, edge (u, v) a binary one: a table holding, for
each assignment of its scope, a Pareto set of (t, m) pairs.  Nodes left with one
strategy are conditioned away and factors with equal scopes merged (:class:`_Model`).

Elimination (:func:`_pareto_pass`).  Nodes go greedily, smallest new table first,
ties in topological order (:func:`_order`): parameters (leaves) fold into their
consumer, chain ops into an edge, residual blocks reduce series-parallel, and one
front sweeps the stream.  Eliminating x with bucket ``F_1..F_r`` (the factors whose
scope holds x) makes, for every assignment s of the other scope nodes,

    g(s) = Pareto( U_x  F_1(s, x) (+) F_2(s, x) (+) ... (+) F_r(s, x) )

where ``A (+) B = {(t + t', m + m')}`` and ``Pareto`` drops dominated pairs (sort by
(t, m); keep a pair iff its m is below every m before it, :func:`_pareto_keep`).
Pareto(A (+) B) = Pareto(Pareto(A) (+) B), so the bucket is folded one factor at a
time.  Each pair keeps x and the pair indices it came from, for :func:`_backtrack`.

Bounds.  A min-sum pass with weights (w_t, w_m) (:func:`_inside`, then :func:`_outside`
in reverse, same order) gives every table its inside value ``I_g(s) = min over its
pairs of w_t t + w_m m`` and outside value ``O_g(s)``, the same minimum over every
factor not below g::

    I_g(s) = min_x sum_j I_{F_j}(s, x)
    O_{F_j}(s_j) = min over (s, x) \\ s_j of [ O_g(s) + sum_{l != j} I_{F_l}(s, x) ]

A pair (t, m) at cell (s, x) of g's bucket is dropped when ``w_t t + w_m m + rest > B``,
rest = ``O_g(s)`` + inside values of the bucket factors not folded in yet, for rows
  - time      (1, 0):   B = target (a time some plan under the cap reaches)
  - memory    (0, 1):   B = cap
  - Lagrange  (1, lam): B = target + lam cap.  lam* (:func:`_lagrange`) is the slope of
    the convex hull of the (T, M) frontier where it crosses the cap (each step solves
    ``min T + lam M`` by min-sum and moves lam to the line through the two hull plans
    around the cap, Eisner-Severance); ``L = min T + lam*(M - cap)`` is a lower bound.
    When ``target - L`` is large, lam* x 2^-4..2^4 are added: a pair's completion trades
    time for memory at its own rate, and the hull may be far from convex.
Whole entries s and cells (s, x) are tested first (their best pair is their min-sum
value), and the pure rows cut each fold to a contiguous range of the next input's
pairs (:func:`_window`).  Floats prune only with a margin (:func:`_tol`): rounding
keeps extra pairs, never loses one, so the result is exact.

Target.  Thinned passes (one fastest and one smallest pair per entry and memory
bucket; every pair kept is a real plan) find a near-optimal plan cheaply; its time is
the target of the one exact pass.  ``frontier=True`` drops cap and target: a pair goes
when a known hull plan (:func:`_hull`) dominates its ideal completion ``(t + O_t, m + O_m)``.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .problem import INF, InfeasibleError, SearchProblem, Solution

__all__ = ["solve_dp", "min_memory"]

logger = logging.getLogger(__name__)

_THIN_GRIDS = (64, 512, 4096)  # memory buckets across [min-memory plan, min-time plan]
_LAMBDA_GRID = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 2.0, 4.0, 8.0, 16.0)  # extra slopes, times lam*
_GRID_GAP = 5e-3  # relative gap (target - L) / target above which the extra slopes pay
_THIN_GAP = 2e-4  # ... above which thinned passes pay
_HULL_ROWS = 16  # frontier mode: hull plans probed, each gap between two gets its slope row
_FRONTIER_PAIRS = 2_000_000  # frontier mode: pairs in one bucket before falling back to thinned


def _tol(bound: float | np.ndarray) -> float | np.ndarray:
    """Float slack for pruning: far above rounding error, far below one unit of cost."""
    return 1e-9 * np.abs(bound) + 1.0


def _order(scopes: list[tuple[int, ...]], k: list[int]) -> list[int]:
    """Greedy elimination order: smallest new table (product of the neighbours' k)
    first, ties in topological order, so one front sweeps from input to loss."""
    adj: dict[int, set[int]] = {v: set() for v in range(len(k)) if k[v] > 1}
    for s in scopes:
        for v in s:
            adj[v].update(w for w in s if w != v)
    current = {v: math.prod(k[w] for w in adj[v]) for v in adj}
    heap = [(c, v) for v, c in current.items()]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        c, v = heapq.heappop(heap)
        if current.get(v) != c:
            continue
        del current[v]
        order.append(v)
        nbrs = adj.pop(v)
        for w in nbrs:
            adj[w].discard(v)
            adj[w].update(x for x in nbrs if x != w)
            current[w] = math.prod(k[x] for x in adj[w])
            heapq.heappush(heap, (current[w], w))
    return order


@dataclass(slots=True)
class _Step:
    """One bucket: eliminate ``var`` (-1: add up the final scalars) from ``inputs``."""

    var: int
    inputs: tuple[int, ...]
    scope: tuple[int, ...]
    shape: tuple[int, ...]  # joint axes: scope, then var
    bcast: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per input: transpose (rows first), joint shape
    pos: tuple[tuple[int, ...], ...]  # per input: joint axis of each of its scope nodes
    out: int


class _Model:
    """The problem as factors over the allowed strategies, and an elimination plan."""

    def __init__(self, problem: SearchProblem) -> None:
        self.problem = problem
        self.allowed = problem.allowed_choices()
        k = self.k = [len(a) for a in self.allowed]
        acc: dict[tuple[int, ...], list[np.ndarray]] = {
            (): [np.zeros((), np.int64), np.full((), problem.base_mem_bytes, np.int64), np.ones((), bool)]
        }

        def add(nodes: tuple[int, ...], t: np.ndarray, m: np.ndarray) -> None:
            scope = tuple(v for v in nodes if k[v] > 1)
            shape = tuple(k[v] for v in scope)
            ok = (t < INF).reshape(shape)
            t, m = np.where(ok, t.reshape(shape), 0), np.where(ok, m.reshape(shape), 0)
            old = acc.get(scope)
            acc[scope] = [t, m, ok] if old is None else [old[0] + t, old[1] + m, old[2] & ok]

        for i in range(problem.n_nodes):
            add((i,), problem.node_time[i][self.allowed[i]], problem.node_mem[i][self.allowed[i]])
        for e, (u, v) in enumerate(problem.edges):
            ix = np.ix_(self.allowed[u], self.allowed[v])
            em = problem.edge_mem[e]
            add((u, v), problem.edge_time[e][ix], np.zeros((k[u], k[v]), np.int64) if em is None else em[ix])
        scopes = list(acc)
        self.t, self.m, self.ok = ([acc[s][i] for s in scopes] for i in range(3))
        self.n_orig = len(scopes)
        holding: dict[int, set[int]] = {}
        for tid, s in enumerate(scopes):
            for v in s:
                holding.setdefault(v, set()).add(tid)
        self.steps: list[_Step] = []
        self.step_of: dict[int, _Step] = {}
        live = set(range(len(scopes)))
        for v in _order(scopes, k) + [-1]:
            inputs = tuple(sorted(holding.pop(v) if v >= 0 else live))
            live.difference_update(inputs)
            for tid in inputs:
                for w in scopes[tid]:
                    if w != v:
                        holding[w].discard(tid)
            scope = tuple(sorted({w for tid in inputs for w in scopes[tid]} - {v}))
            joint = scope + ((v,) if v >= 0 else ())
            bcast, poss = [], []
            for tid in inputs:
                pos = tuple(joint.index(w) for w in scopes[tid])
                bshape = [k[w] if w in scopes[tid] else 1 for w in joint]
                poss.append(pos)
                bcast.append(((0,) + tuple(int(p) + 1 for p in np.argsort(pos)), tuple(bshape)))
            step = _Step(v, inputs, scope, tuple(k[w] for w in joint), tuple(bcast), tuple(poss), len(scopes))
            scopes.append(scope)
            self.steps.append(step)
            self.step_of[step.out] = step
            live.add(step.out)
            for w in scope:
                holding[w].add(step.out)
        self.scopes = scopes
        self.final = self.steps[-1].out

    def original_choice(self, reduced: np.ndarray) -> tuple[int, ...]:
        return tuple(int(self.allowed[i][reduced[i]]) for i in range(len(self.k)))


def _bc(step: _Step, j: int, arr: np.ndarray) -> np.ndarray:
    """Input j's (rows, *scope) table laid onto the step's joint axes (size 1 where it has none)."""
    perm, bshape = step.bcast[j]
    return arr.transpose(perm).reshape((arr.shape[0],) + bshape)


def _joint(step: _Step, vals: list, skip: int = -1) -> np.ndarray:
    acc: np.ndarray | float = 0.0
    for j, tid in enumerate(step.inputs):
        if j != skip:
            acc = acc + _bc(step, j, vals[tid])
    return acc


def _inside(model: _Model, w: np.ndarray) -> tuple[list, dict[int, np.ndarray]]:
    """Min-sum elimination of ``w[b, 0] T + w[b, 1] M`` for every row b at once:
    inside values (rows, *scope) of every table, and the argmins."""
    vals: list = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        shape = (-1,) + (1,) * t.ndim
        vals.append(np.where(ok, w[:, 0].reshape(shape) * t + w[:, 1].reshape(shape) * m, np.inf))
    vals += [None] * len(model.steps)
    args: dict[int, np.ndarray] = {}
    for st in model.steps:
        joint = _joint(st, vals)
        if st.var < 0:
            vals[st.out] = joint
        else:
            args[st.out] = joint.argmin(axis=-1)
            vals[st.out] = joint.min(axis=-1)
    return vals, args


def _outside(model: _Model, vals: list) -> list:
    """Outside value of every eliminated table (the reverse pass of the docstring)."""
    rows = vals[0].shape[0]
    outs: list = [None] * len(vals)
    outs[model.final] = np.zeros(rows)
    for st in reversed(model.steps):
        oh = outs[st.out] if st.var < 0 else outs[st.out][..., None]
        for j, tid in enumerate(st.inputs):
            if tid >= model.n_orig:
                rest = np.broadcast_to(oh + _joint(st, vals, skip=j), (rows,) + st.shape)
                perm, bshape = st.bcast[j]
                axes = tuple(1 + a for a, size in enumerate(bshape) if size == 1)
                outs[tid] = (rest.min(axis=axes) if axes else rest).transpose(np.argsort(perm))
    return outs


@dataclass(frozen=True, slots=True)
class _Point:
    time: int
    mem: int
    choice: tuple[int, ...]


def _plans(model: _Model, w: np.ndarray) -> tuple[list[_Point], list]:
    """Per row of weights, the argmin plan of ``w_t T + w_m M`` (re-evaluated exactly),
    and the inside values."""
    vals, args = _inside(model, w)
    if not np.isfinite(vals[model.final]).all():
        raise InfeasibleError(f"{model.problem.summary()}: every plan hits a forbidden (INF) choice or pair; fix the strategy lists")
    red = np.zeros((len(w), len(model.k)), np.int64)
    rows = np.arange(len(w))
    for st in reversed(model.steps):
        if st.var >= 0:
            red[:, st.var] = args[st.out][(rows,) + tuple(red[:, v] for v in st.scope)]
    points = []
    for r in red:
        choice = model.original_choice(r)
        points.append(_Point(*model.problem.evaluate(choice), choice))
    return points, vals


@dataclass(slots=True)
class _Bounds:
    """Bound rows stacked: row b is ``wt[b] T + wm[b] M``; per table ``ins`` (rows,
    entries), and for eliminated tables ``outs``."""

    wt: np.ndarray  # (rows, 1)
    wm: np.ndarray
    ins: list
    outs: list


def _bounds(model: _Model, w: np.ndarray, vals: list) -> _Bounds:
    outs = _outside(model, vals)
    ins = [v.reshape(len(w), -1) for v in vals]
    outs = [None if tid < model.n_orig else o.reshape(len(w), -1) for tid, o in enumerate(outs)]
    return _Bounds(w[:, :1].astype(float), w[:, 1:2].astype(float), ins, outs)


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


class _TooBig(RuntimeError):
    """A pass outgrew its pair budget."""


@dataclass(slots=True)
class _Tab:
    off: np.ndarray  # CSR offsets over the table's entries
    t: np.ndarray
    m: np.ndarray
    xs: np.ndarray | None = None  # choice of the eliminated node per pair
    bp: np.ndarray | None = None  # (pairs, inputs): pair index into each input
    keys: tuple | None = None  # search keys of :func:`_window`, built on first use
    wide: bool = False  # some entry holds many pairs: worth :func:`_window`


def _window(tab: _Tab, e: np.ndarray, qp: np.ndarray | None, qs: np.ndarray | None, primary: str) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of entry ``e`` with primary <= qp and secondary <= qs: within an entry pairs
    run by primary ascending (secondary descending), so that is one range.  One
    searchsorted for all entries: a pair's key is ``entry * width + rank of its value``."""
    start, stop = tab.off[e], tab.off[e + 1]
    if qp is None and qs is None:
        return start, stop
    if tab.keys is None:
        ent = np.repeat(np.arange(tab.off.size - 1), np.diff(tab.off))
        pv, sv = (tab.t, tab.m) if primary == "t" else (tab.m, tab.t)
        sp, sn, width = np.sort(pv), np.sort(-sv), pv.size + 1
        tab.keys = (width, sp, ent * width + np.searchsorted(sp, pv, "right"), sn, ent * width + np.searchsorted(sn, -sv, "left"))
    width, sp, kp, sn, ks = tab.keys
    if qp is not None:
        stop = np.minimum(stop, np.searchsorted(kp, e * width + np.searchsorted(sp, qp, "right"), "right"))
    if qs is not None:
        start = np.maximum(start, np.searchsorted(ks, e * width + np.searchsorted(sn, -qs, "left"), "left"))
    return start, np.maximum(stop, start)


def _in_gaps(gaps: tuple[np.ndarray, ...], bnd: _Bounds, t: np.ndarray, m: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Whether a pair (t, m) with these rests may still complete to a plan that no known
    plan dominates.  Such a plan lies below-left of a gap corner (cx, cy) = (time of
    the next known plan, memory of this one), i.e. meets the cap/target test with
    target cx, cap cy on the time row, the memory row and that gap's hull slope row."""
    cx, cy, row = gaps
    ok = (t + rest[0] <= cx[:, None] + _tol(cx[:, None])) & (m + rest[1] <= cy[:, None] + _tol(cy[:, None]))
    lhs = bnd.wt[row] * t + bnd.wm[row] * m + rest[row]
    rhs = bnd.wt[row] * cx[:, None] + bnd.wm[row] * cy[:, None]
    return (ok & (lhs <= rhs + _tol(rhs))).any(axis=0)


def _pareto_pass(
    model: _Model,
    bnd: _Bounds,
    limits: np.ndarray,
    *,
    primary: str = "t",
    gaps: tuple[np.ndarray, ...] | None = None,
    beam: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    values_only: bool = False,
    max_pairs: int | None = None,
) -> tuple[list, dict]:
    """Eliminate every node over Pareto sets (the recurrence of the module docstring).

    ``limits`` holds B per bound row (inf: not used).  ``gaps`` (frontier mode) keeps
    only pairs that may complete below a gap between known plans (:func:`_in_gaps`).  ``beam``
    (heuristic) keeps per entry and memory bucket of that width the fastest and the
    smallest pair.  ``values_only`` frees tables once used and keeps no back-pointers
    (the final pairs' values only); ``max_pairs`` raises :class:`_TooBig` past that.
    """
    tabs = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        flat = ok.reshape(-1)
        tabs.append(_Tab(np.concatenate([[0], np.cumsum(flat)]), t.reshape(-1)[flat], m.reshape(-1)[flat]))
    lim = (limits + _tol(limits))[:, None]
    pure_t = np.flatnonzero((bnd.wm[:, 0] == 0) & np.isfinite(limits))
    pure_m = np.flatnonzero((bnd.wt[:, 0] == 0) & np.isfinite(limits))
    stats = {"steps": len(model.steps), "max_pairs": 0, "max_combined": 0, "pairs": 0}
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
            ents.append(np.ravel_multi_index(tuple(coords[p] for p in st.pos[j]), tshape) if tshape else np.zeros(cells.size, np.int64))
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
            if tab.wide:
                rc = rests[i][:, cell]
                qt = ((lim[pure_t] - rc[pure_t]) / bnd.wt[pure_t]).min(axis=0) - t if pure_t.size else None
                qm = ((lim[pure_m] - rc[pure_m]) / bnd.wm[pure_m]).min(axis=0) - m if pure_m.size else None
                start, stop = _window(tab, e, *((qt, qm) if primary == "t" else (qm, qt)), primary)
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
            if max_pairs is not None and cell.size > max_pairs:
                raise _TooBig(f"{cell.size} pairs eliminating node {st.var}")
            keep = (rc + bnd.wt * t + bnd.wm * m <= lim).all(axis=0)
            if gaps is not None:
                keep[keep] &= _in_gaps(gaps, bnd, t[keep], m[keep], rc[:, keep])
            sel = np.flatnonzero(keep)
            if i + 1 < len(order) and not single:
                sel = sel[_pareto_keep(cell[sel], *((t[sel], m[sel]) if primary == "t" else (m[sel], t[sel])))]
            cell, t, m, ptrs = cell[sel], t[sel], m[sel], [p[sel] for p in ptrs]
        group = cells[cell] // kx
        sel = _pareto_keep(group, *((t, m) if primary == "t" else (m, t)))
        if beam is not None and sel.size > 1:
            g, bucket = group[sel], (m[sel] if primary == "t" else t[sel]) // beam
            edge = np.ones(sel.size + 1, bool)
            edge[1:-1] = (g[1:] != g[:-1]) | (bucket[1:] != bucket[:-1])
            sel = sel[edge[:-1] | edge[1:]]
        bp = None if values_only else np.empty((sel.size, len(order)), np.int64)
        for i, j in enumerate(order):
            if values_only:
                tabs[st.inputs[j]] = None
            else:
                bp[:, j] = ptrs[i][sel]
        off = np.concatenate([[0], np.cumsum(np.bincount(group[sel], minlength=row_ok.size))])
        tabs.append(_Tab(off, t[sel], m[sel], cells[cell[sel]] % kx, bp, wide=bool(np.diff(off).max(initial=0) > 8)))
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


def _min_memory(model: _Model, start: float) -> Solution:
    w = np.array([[0.0, 1.0]])
    (point,), vals = _plans(model, w)
    tabs, stats = _pareto_pass(model, _bounds(model, w, vals), np.array([float(point.mem)]), primary="m")
    if tabs[model.final].t.size == 0:
        raise AssertionError(f"min_memory: the DP lost the min-memory plan ({point.mem} B); internal pruning bug")
    choice = _backtrack(model, tabs, 0)
    t, m = model.problem.evaluate(choice)
    return Solution(choice, t, m, True, "dp", time.perf_counter() - start, stats)


def min_memory(problem: SearchProblem) -> Solution:
    """The plan with the smallest memory ``M`` (ties broken by time), exactly."""
    return _min_memory(_Model(problem), time.perf_counter())


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


def _hull(model: _Model, a: _Point, b: _Point, seen: list[_Point], budget: int = 24) -> None:
    """Supported plans of the frontier between a (fast) and b (small), into ``seen``."""
    segs = [(a, b)]
    while segs and budget > 0:
        p, q = segs.pop()
        if p.time < q.time and p.mem > q.mem:
            lam = (q.time - p.time) / (p.mem - q.mem)
            (r,), _ = _plans(model, np.array([[1.0, lam]]))
            budget -= 1
            line = p.time + lam * p.mem
            if r.time + lam * r.mem < line - _tol(line):
                seen.append(r)
                segs += [(p, r), (r, q)]


def _frontier(model: _Model, seen: list[_Point], w: np.ndarray, vals: list) -> tuple[list[tuple[int, int]], bool]:
    """The (time, memory) Pareto frontier, cap ignored, and whether it is exact: past
    :data:`_FRONTIER_PAIRS` pairs in one bucket the pass is redone thinned (every point
    a real plan, gaps narrower than a 1/4096 of the memory range may be missed)."""
    fast, small = seen[0], seen[1]
    seen = list(seen)
    _hull(model, fast, small, seen, budget=_HULL_ROWS)
    hull = sorted({(p.time, p.mem) for p in seen})
    hull = [q for i, q in enumerate(hull) if all(q[1] < r[1] for r in hull[:i])]
    slopes = np.array([[1.0, (b[0] - a[0]) / (a[1] - b[1])] for a, b in zip(hull, hull[1:])]).reshape(-1, 2)
    if len(slopes):
        pts, vals_h = _plans(model, slopes)
        seen += pts
        w, vals = np.concatenate([w, slopes]), [np.concatenate(x) for x in zip(vals, vals_h)]
    big = 1e300  # an open end: faster than the fastest plan, or smaller than the smallest
    cx = np.array([hull[0][0]] + [b[0] for b in hull[1:]] + [big], float)
    cy = np.array([big] + [a[1] for a in hull[:-1]] + [hull[-1][1]], float)
    gaps = (cx, cy, np.array([0] + list(range(2, 2 + len(slopes))) + [1]))
    bnd = _bounds(model, w, vals)
    limits = np.full(len(w), np.inf)
    try:
        tabs, _ = _pareto_pass(model, bnd, limits, gaps=gaps, values_only=True, max_pairs=_FRONTIER_PAIRS)
        exact = True
    except _TooBig as err:
        logger.info("frontier: %s, thinning to 1/4096 of the memory range", err)
        tabs, _ = _pareto_pass(model, bnd, limits, gaps=gaps, values_only=True, beam=max(1, (fast.mem - small.mem) // 4096))
        exact = False
    fin = tabs[model.final]
    pts = np.concatenate([np.stack([fin.t, fin.m], 1), np.array([(p.time, p.mem) for p in seen], np.int64)])
    return [(int(a), int(b)) for a, b in pts[_pareto_keep(np.zeros(len(pts), np.int64), pts[:, 0], pts[:, 1])]], exact


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
    if not cands:
        exact = _min_memory(model, start)
        if exact.mem_bytes > (cap or 0):
            raise InfeasibleError.over_cap(problem, exact)
        raise AssertionError(f"solve_dp: no plan survived on {problem.summary()}; internal pruning bug")
    best_t, best_m, ref = min(cands, key=lambda c: (c[0], c[1]))
    choice = ref.choice if isinstance(ref, _Point) else _backtrack(model, tabs, ref)
    if problem.evaluate(choice) != (best_t, best_m):
        raise AssertionError(f"solve_dp: plan re-evaluates to {problem.evaluate(choice)}, DP said ({best_t}, {best_m})")
    stats["solve_s"] = time.perf_counter() - start
    logger.info("solve_dp: %s -> %d ps, %d B in %.3fs (max pairs %d)", problem.summary(), best_t, best_m, stats["solve_s"], stats["max_pairs"])
    return Solution(choice, best_t, best_m, True, "dp", stats["solve_s"], stats)


def solve_dp(
    problem: SearchProblem,
    *,
    progress: Callable[[int, int], None] | None = None,
    frontier: bool = False,
) -> Solution:
    """Minimum time under the memory cap, exactly (ties broken by memory).

    ``progress(done, total)`` is called after each node of the exact pass.
    ``frontier=True`` also returns the whole (time, mem) Pareto frontier, cap ignored,
    sorted by time, in ``stats["frontier"]``.  Raises :class:`InfeasibleError` when no
    plan fits the cap (or every plan is forbidden).
    """
    start = time.perf_counter()
    model = _Model(problem)
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
        ub = min(p.time for p in seen if p.mem <= cap)
        if ub - lb > _GRID_GAP * abs(ub):  # extra slopes, solved as one batch
            grid = np.array([[1.0, lam * f] for f in _LAMBDA_GRID])
            pts, vals_g = _plans(model, grid)
            seen += pts
            w, vals_l = np.concatenate([w, [[1.0, lam]], grid]), [np.concatenate(x) for x in zip(vals_l, vals_g)]
        else:
            w = np.concatenate([w, [[1.0, lam]]])
        vals = [np.concatenate(x) for x in zip(vals, vals_l)]
    stats: dict = {"nodes": problem.n_nodes, "steps": len(model.steps), "lambda": lam, "lower_bound": lb, "heuristic_s": 0.0}
    stats.update(width=max((len(st.shape) for st in model.steps), default=0), rows=len(w))
    if frontier:
        stats["frontier"], stats["frontier_exact"] = _frontier(model, seen, w[:2], [v[:2] for v in vals])
    ub = min(p.time for p in seen if cap is None or p.mem <= cap)
    bnd = _bounds(model, w, vals)
    stats.update(bounds_s=time.perf_counter() - start, lagrange_ub=ub)
    for grid in _THIN_GRIDS if ub - lb > _THIN_GAP * abs(ub) else ():
        # Coarse to fine; a band this narrow prunes hard whatever the target, so
        # stop once a fine pass finds nothing better.
        tick = time.perf_counter()
        tabs, _ = _pareto_pass(model, bnd, _limits(bnd, ub, cap), beam=max(1, (fast.mem - small.mem) // grid))
        stats["heuristic_s"] += time.perf_counter() - tick
        fin = tabs[model.final]
        idx = _pick(fin, cap)
        better = idx >= 0 and fin.t[idx] < ub
        if better:
            ub = int(fin.t[idx])
            seen.append(_Point(ub, int(fin.m[idx]), _backtrack(model, tabs, idx)))
        if ub <= lb + _tol(lb) or (grid >= _THIN_GRIDS[1] and not better):
            break
    stats["upper_bound"] = ub
    tabs, pstats = _pareto_pass(model, bnd, _limits(bnd, ub, cap), progress=progress)
    stats.update(pstats)
    return _finish(model, tabs, seen, stats, start)
