"""Bucket elimination over Pareto sets of (time, memory): the exact pass that :mod:`.dp`
and :mod:`.chain` run.

Tables (:class:`ParetoTable`).  The factors and the plan are :mod:`.elimination`'s
(:class:`.elimination.EliminationModel`); here a table holds, per assignment of its scope,
a Pareto set of (t, m) pairs (CSR over the entries, each run by t ascending, m
descending), with the eliminated node's choice and the pairs each came from.

Recurrence (:func:`pareto_pass`).  Along the plan, eliminating x with bucket
``F_1..F_r`` (the factors whose scope holds x) gives

    g(s) = Pareto( U_x  F_1(s, x) (+) ... (+) F_r(s, x) )    for each assignment s

with ``A (+) B = {(t + t', m + m')}``; ``Pareto`` drops dominated pairs (:func:`pareto_keep`).
Pareto(A (+) B) = Pareto(Pareto(A) (+) B), so the bucket is folded one factor at a time;
each pair keeps x and the pairs it came from, for :func:`backtrack` (the folds: :func:`_fold`).

Bounds (:class:`Bounds`, :func:`min_sum_bounds`).  Min-sum with weight rows (w_t, w_m)
(:func:`.elimination.inside` and :func:`.elimination.outside`) gives every table
``I_g(s)``, the least ``w_t t + w_m m`` of its pairs, and ``O_g(s)``, the same least over
all factors not below g.  A pair (t, m) at cell (s, x) goes when
``w_t t + w_m m + rest > B`` (rest = ``O_g(s)`` plus the ``I`` of the bucket factors not
folded yet) on any row (:func:`row_limits`):
  time (1, 0), B = target;  memory (0, 1), B = cap;  Lagrange (1, lam), B = target + lam cap
(lam: :mod:`.lagrange`).  Entries s and cells (s, x) are tested before any pair
(:func:`_live_cells`), and the time/memory rows cut each fold to one range of the next
factor's pairs (:func:`pair_window`).  Floats prune only past a margin (:func:`tol`):
rounding keeps extra pairs, never loses one, so the pass is exact.

Heuristic and frontier modes.  ``beam`` thins each entry to the fastest and the smallest
pair per memory bucket (each a real plan; :func:`_thin`); ``gaps`` drops cap and target
and keeps a pair while it may complete below a gap of the known plans' staircase
(:func:`_in_gaps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .deadline import Deadline
from .elimination import EliminationModel, outside

__all__ = [
    "Bounds",
    "ParetoTable",
    "backtrack",
    "min_sum_bounds",
    "pair_window",
    "pareto_keep",
    "pareto_pass",
    "proven_within",
    "row_limits",
    "tol",
]


def tol(bound: float | np.ndarray) -> float | np.ndarray:
    """Float slack for pruning: well above the rounding of sums of int64 costs, so a float
    test never drops a pair that the exact integer test would keep."""
    return 1e-9 * np.abs(bound) + 1.0


def proven_within(ub: int, lower: float, rel_gap: float) -> int | None:
    """``lower`` (a float lower bound on the optimum) in integers, past its float slack, when it proves the
    plan of time ``ub`` within ``rel_gap`` of the optimum; None when it does not, when ``rel_gap`` is 0, or
    when ``ub`` is within that slack of ``lower`` (the plan is then the optimum's time, and the exact pass
    there, cheap, settles ties by memory)."""
    low = int(lower - tol(lower))
    return low if rel_gap > 0 and tol(ub) < ub - lower and ub - low <= rel_gap * ub else None


@dataclass(slots=True)
class Bounds:
    """Bound rows stacked: row b is ``wt[b] T + wm[b] M``; per table ``ins`` (rows,
    entries), and for eliminated tables ``outs``."""

    wt: np.ndarray  # (rows, 1)
    wm: np.ndarray
    ins: list
    outs: list


def min_sum_bounds(model: EliminationModel, w: np.ndarray, vals: list, final_out: np.ndarray | None = None) -> Bounds:
    """The bound rows ``w``: the inside values ``vals`` (:func:`.elimination.inside`) and the
    outside values from them; ``final_out``: a lower bound on what lies outside the model."""
    outs = [o if o is None else o.reshape(len(w), -1) for o in outside(model, vals, final_out)]
    return Bounds(w[:, :1].astype(float), w[:, 1:2].astype(float), [v.reshape(len(w), -1) for v in vals], outs)


def pareto_keep(g: np.ndarray, p: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Indices of the Pareto pairs of each group g (minimize primary p, then secondary s),
    ordered by (g, p); of equal pairs, the first.  Segmented running minimum of s via a
    per-group offset, over one candidate per (g, p): its least s (:func:`_least_per_key`)."""
    if g.size == 0:
        return g
    o = _least_per_key(g, p, s)
    if o is None:  # (g, p) does not fit one int64 key: every pair a candidate, in (g, p, s, index) order
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


def _least_per_key(g: np.ndarray, p: np.ndarray, s: np.ndarray) -> np.ndarray | None:
    """Per distinct (g, p), ascending, the index of its pair with the least s (the first such): the only pair
    of that key the staircase can keep.  One unstable argsort of the int64 key ``g span + p`` and two
    segmented minima, about half the time of a lexsort of (s, p, g) on the millions of pairs a product forms,
    most of them repeats (equal sums of other halves); None where the key would not fit."""
    lo = int(p.min())
    span = int(p.max()) - lo + 1
    if int(g.min()) < 0 or span * (int(g.max()) + 1) >= 2**62:
        return None
    dense = _least_per_dense_key(g, p - lo, s, span)
    if dense is not None:
        return dense
    key = g * span + (p - lo)
    o = np.argsort(key)
    k = key[o]
    start = np.empty(k.size, bool)
    start[0] = True
    np.not_equal(k[1:], k[:-1], out=start[1:])
    at = np.flatnonzero(start)
    so = s[o]
    least = np.minimum.reduceat(so, at)
    run = np.cumsum(start) - 1
    return np.minimum.reduceat(np.where(so == least[run], o, np.iinfo(np.int64).max), at)


def _least_per_dense_key(g: np.ndarray, p: np.ndarray, s: np.ndarray, span: int) -> np.ndarray | None:
    """:func:`_least_per_key` by two unbuffered minima over a dense array of the (group, p) keys (``p`` from 0
    to ``span - 1``), where that array is small: merged products (:func:`.segments.merge_keep`) put millions
    of pairs into a few thousand time cells per group, and ``np.minimum.at`` over them is some 30 times faster
    than sorting them.  None where the array would be larger than a few times the pairs."""
    seen = np.zeros(int(g.max()) + 1, bool)
    seen[g] = True
    groups = np.flatnonzero(seen)
    if groups.size * span > max(4 * g.size, 1 << 16):
        return None
    rank = np.zeros(seen.size, np.int64)
    rank[groups] = np.arange(groups.size)
    key = rank[g] * span + p
    least = np.full(groups.size * span, np.iinfo(np.int64).max)
    np.minimum.at(least, key, s)
    hit = np.flatnonzero(s == least[key])  # the pairs with their key's least s; of them the first
    first = np.full(least.size, np.iinfo(np.int64).max)
    np.minimum.at(first, key[hit], hit)
    return first[first != np.iinfo(np.int64).max]


@dataclass(slots=True)
class ParetoTable:
    """Pareto pairs per entry of a table's scope (CSR), each entry's run by t ascending."""

    off: np.ndarray  # CSR offsets over the table's entries
    t: np.ndarray
    m: np.ndarray
    xs: np.ndarray | None = None  # choice of the eliminated node per pair
    bp: np.ndarray | None = None  # (pairs, inputs): pair index into each input
    keys: tuple | None = None  # search keys of :func:`pair_window`, built on first use
    wide: bool = False  # some entry holds many pairs: worth :func:`pair_window`


def pair_window(
    tab: ParetoTable, e: np.ndarray, qt: np.ndarray | None, qm: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
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


def _in_gaps(gaps: tuple[np.ndarray, ...], bnd: Bounds, t: np.ndarray, m: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Whether pair (t, m) may complete to a plan no known plan dominates: below-left of
    some gap corner (cx, cy) = (next known plan's time, this one's memory), i.e. passing
    the target cx / cap cy test on the time, memory and that gap's slope rows."""
    cx, cy, row = gaps
    ok = np.zeros(rest.shape[1], bool)
    ti, mi = t + rest[0], m + rest[1]
    for x, y, r in zip(cx, cy, row):
        rhs = bnd.wt[r, 0] * x + bnd.wm[r, 0] * y
        lhs = bnd.wt[r, 0] * t + bnd.wm[r, 0] * m + rest[r]
        ok |= (ti <= x + tol(x)) & (mi <= y + tol(y)) & (lhs <= rhs + tol(rhs))
    return ok


@dataclass(slots=True)
class _Pruning:
    """What a pass prunes by: the bound rows, B per row with its float slack (``lim``, (rows, 1)), the rows
    that weigh only time (``pure_t``) or only memory (``pure_m``) and have a limit, and the gaps."""

    bnd: Bounds
    lim: np.ndarray
    pure_t: np.ndarray
    pure_m: np.ndarray
    gaps: tuple[np.ndarray, ...] | None

    def passes(self, least: np.ndarray) -> np.ndarray:
        """Per column of ``least`` (rows, n), a lower bound per row before any pair is formed: whether it
        passes every limit (and, with gaps, may lie below a gap)."""
        ok = (least <= self.lim).all(axis=0)
        if self.gaps is not None:
            ok &= np.isfinite(least).all(axis=0)
            ok[ok] &= _in_gaps(self.gaps, self.bnd, 0.0, 0.0, least[:, ok])
        return ok


@dataclass(slots=True)
class _Cells:
    """The cells (s, x) of one step that pass every bound row before any pair is formed."""

    entries: int  # entries s of the step's table
    kx: int  # choices x of the eliminated node (1: a final step)
    cells: np.ndarray  # s * kx + x per live cell
    ents: list  # per input table: each live cell's entry in it
    order: list  # the inputs by pair count, fewest first: the fold order
    rests: list  # rests[i]: rest after folding order[:i+1], (rows, live cells)


def pareto_pass(
    model: EliminationModel,
    bnd: Bounds,
    limits: np.ndarray,
    *,
    gaps: tuple[np.ndarray, ...] | None = None,
    beam: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    values_only: bool = False,
    deadline: Deadline | None = None,
) -> tuple[list, dict]:
    """Eliminate every node over Pareto sets (the recurrence of the module docstring).

    ``limits``: B per bound row (inf: unused).  ``gaps``: see :func:`_in_gaps`.  ``beam``
    (heuristic) keeps the fastest and the smallest pair per entry and memory bucket of
    that width, or (``beam < 0``) of ``-beam`` rank buckets (evenly spaced).
    ``values_only`` frees tables once used and keeps no back-pointers.  Past ``deadline`` (checked before
    each step and each fold of a step): :class:`.deadline.OutOfTime`."""
    tabs = []
    for t, m, ok in zip(model.t, model.m, model.ok):
        flat = ok.reshape(-1)
        tabs.append(ParetoTable(np.concatenate([[0], np.cumsum(flat)]), t.reshape(-1)[flat], m.reshape(-1)[flat]))
    pure_t = np.flatnonzero((bnd.wm[:, 0] == 0) & np.isfinite(limits))
    pure_m = np.flatnonzero((bnd.wt[:, 0] == 0) & np.isfinite(limits))
    prune = _Pruning(bnd, (limits + tol(limits))[:, None], pure_t, pure_m, gaps)
    stats = {"steps": len(model.steps), "max_pairs": 0, "max_combined": 0, "pairs": 0, "thinned": False}
    for si, st in enumerate(model.steps):
        live = _live_cells(model, st, tabs, prune)
        cell, t, m, ptrs = _fold(tabs, st, live, prune, stats, deadline)
        group = live.cells[cell] // live.kx
        sel = pareto_keep(group, t, m)
        if beam is not None and sel.size > 1:
            sel = _thin(sel, group[sel], m[sel], beam, stats)
        bp = None if values_only else np.empty((sel.size, len(live.order)), np.int64)
        for i, j in enumerate(live.order):
            if values_only:
                tabs[st.inputs[j]] = None  # consumed
            else:
                bp[:, j] = ptrs[i][sel]
        off = np.concatenate([[0], np.cumsum(np.bincount(group[sel], minlength=live.entries))])
        wide = bool(np.diff(off).max(initial=0) > 8)
        tabs.append(ParetoTable(off, t[sel], m[sel], live.cells[cell[sel]] % live.kx, bp, wide=wide))
        stats["max_pairs"], stats["pairs"] = max(stats["max_pairs"], sel.size), stats["pairs"] + sel.size
        if progress is not None:
            progress(si + 1, len(model.steps))
    return tabs, stats


def _live_cells(model: EliminationModel, st, tabs: list, prune: _Pruning) -> _Cells:
    """The step's entries s, then its cells (s, x), that pass every bound row on their least sums (module
    docstring, Bounds: tested before any pair), and per live cell the rest of the bound after each fold."""
    bnd = prune.bnd
    kx = st.shape[-1] if st.var >= 0 else 1
    row_ok = prune.passes(bnd.ins[st.out] + bnd.outs[st.out])
    rows = np.flatnonzero(row_ok)
    cells = (rows[:, None] * kx + np.arange(kx)).reshape(-1)
    coords = np.unravel_index(cells, st.shape) if st.shape else ()
    ents = []
    for j, tid in enumerate(st.inputs):
        tshape = tuple(model.k[v] for v in model.scopes[tid])
        ents.append(np.ravel_multi_index(tuple(coords[p] for p in st.pos[j]), tshape) if tshape else 0 * cells)
    out = np.repeat(bnd.outs[st.out][:, rows], kx, axis=1)
    ins = [bnd.ins[tid][:, e] for tid, e in zip(st.inputs, ents)]
    alive = np.flatnonzero(prune.passes(out + sum(ins)))
    cells, ents = cells[alive], [e[alive] for e in ents]
    order = sorted(range(len(st.inputs)), key=lambda j: tabs[st.inputs[j]].t.size)
    rests = [out[:, alive]]  # rests[i]: rest after folding order[:i+1]
    for j in reversed(order[1:]):
        rests.append(rests[-1] + ins[j][:, alive])
    rests.reverse()
    return _Cells(row_ok.size, kx, cells, ents, order, rests)


def _fold(tabs: list, st, live: _Cells, prune: _Pruning, stats: dict, deadline: Deadline | None) -> tuple:
    """Fold the step's input tables into the live cells one at a time (fewest pairs first): every pair of each
    with every pair so far, within the windows of the time and memory rows, dropping pairs past a limit (or
    outside the gaps) and, but after the last fold, dominated ones.  Returns (cell, t, m, pointers per fold).

    A fold that would form more than :data:`_FOLD_CHUNK` pairs forms them a run of cells at a time (each cell's
    pairs in one run, so pruning and the Pareto filter per cell are unchanged), each run Pareto-filtered per
    cell, checking ``deadline`` between runs: the memory of a fold is bounded by its runs and what they keep,
    and a budget holds inside one."""
    bnd = prune.bnd
    cell = np.arange(live.cells.size)
    t, m = np.zeros(live.cells.size, np.int64), np.zeros(live.cells.size, np.int64)
    ptrs: list[np.ndarray] = []
    single = True  # at most one pair per cell so far: no Pareto filter needed
    for i, j in enumerate(live.order):
        if deadline is not None:
            deadline.check()
        tab = tabs[st.inputs[j]]
        e = live.ents[j][cell]
        if tab.wide and (prune.pure_t.size or prune.pure_m.size):
            rc, pt, pm = live.rests[i][:, cell], prune.pure_t, prune.pure_m
            qt = ((prune.lim[pt] - rc[pt]) / bnd.wt[pt]).min(axis=0) - t if pt.size else None
            qm = ((prune.lim[pm] - rc[pm]) / bnd.wm[pm]).min(axis=0) - m if pm.size else None
            start, stop = pair_window(tab, e, qt, qm)
        else:
            start, stop = tab.off[e], tab.off[e + 1]
        counts = stop - start
        single = single and counts.max(initial=0) <= 1
        runs = _runs(counts, _FOLD_CHUNK)
        # the last fold's pairs are filtered per entry by the caller; a fold formed in runs filters each run per
        # cell as well (a finer grouping: it keeps all the caller keeps), so what the runs keep stays small
        filtered = not single and (i + 1 < len(live.order) or len(runs) > 1)
        parts = []
        for a, b in runs:
            if deadline is not None and len(parts):
                deadline.check()
            now = (cell[a:b], t[a:b], m[a:b], [p[a:b] for p in ptrs])
            parts.append(_fold_run(tab, live.rests[i], prune, now, (start[a:b], counts[a:b]), filtered))
        stats["max_combined"] = max(stats["max_combined"], int(counts.sum()))
        cell, t, m = (np.concatenate([part[k] for part in parts]) for k in range(3))
        ptrs = [np.concatenate([part[3][k] for part in parts]) for k in range(len(ptrs) + 1)]
    return cell, t, m, ptrs


#: the most pairs one run of a fold forms at once (:func:`_fold`)
_FOLD_CHUNK = 1 << 22


def _runs(counts: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """Consecutive ranges [a, b) of the cells whose pair counts sum to at most ``chunk`` (a cell with more is a
    range of its own); one range when the counts are few."""
    total = int(counts.sum())
    if total <= chunk:
        return [(0, counts.size)]
    ends = np.cumsum(counts)
    out, a = [], 0
    while a < counts.size:
        b = max(int(np.searchsorted(ends, (ends[a - 1] if a else 0) + chunk, "right")), a + 1)
        out.append((a, b))
        a = b
    return out


def _fold_run(tab: ParetoTable, rests: np.ndarray, prune: _Pruning, now: tuple, window: tuple, filtered: bool):
    """One run of cells of a fold: each pair so far (``now``: cell, t, m, pointers) with each pair of its
    ``window`` (start, count) of ``tab``; those within the limits (and gaps), Pareto-filtered per cell when
    ``filtered``.  Returns (cell, t, m, pointers with this fold's)."""
    bnd = prune.bnd
    cell, t, m, ptrs = now
    start, counts = window
    if counts.max(initial=0) <= 1:
        rep = np.flatnonzero(counts)
        q = start[rep]
    else:
        rep = np.repeat(np.arange(counts.size), counts)
        q = start[rep] + np.arange(rep.size) - (np.cumsum(counts) - counts)[rep]
    cell, t, m = cell[rep], t[rep] + tab.t[q], m[rep] + tab.m[q]
    rc = rests[:, cell]
    ptrs = [p[rep] for p in ptrs] + [q]
    keep = (rc + bnd.wt * t + bnd.wm * m <= prune.lim).all(axis=0)
    if prune.gaps is not None:
        keep[keep] &= _in_gaps(prune.gaps, bnd, t[keep], m[keep], rc[:, keep])
    sel = np.flatnonzero(keep)
    if filtered:
        sel = sel[pareto_keep(cell[sel], t[sel], m[sel])]
    return cell[sel], t[sel], m[sel], [p[sel] for p in ptrs]


def _thin(sel: np.ndarray, g: np.ndarray, m: np.ndarray, beam: int, stats: dict) -> np.ndarray:
    """``beam``'s thinning of the Pareto pairs ``sel`` (entries ``g``, memories ``m``, by entry then t): the first
    and last pair of each entry's memory bucket, so each entry's extremes stay."""
    if beam > 0:  # memory buckets of width beam
        bucket = m // beam
    else:  # at most -beam pairs per entry, evenly spaced by rank
        first = np.searchsorted(g, g)
        size = np.searchsorted(g, g, side="right") - first
        bucket = (np.arange(g.size) - first) * -beam // size
        stats["thinned"] |= bool(size.max() > -beam)
    edge = np.ones(sel.size + 1, bool)
    edge[1:-1] = (g[1:] != g[:-1]) | (bucket[1:] != bucket[:-1])
    return sel[edge[:-1] | edge[1:]]  # first and last of each bucket: the entry's extremes stay


def backtrack(model: EliminationModel, tabs: list, p: int) -> tuple[int, ...]:
    """The choice vector of the final table's pair ``p``: each pair's choice of its
    eliminated node, following the back-pointers down to the factors."""
    red = np.zeros(len(model.k), np.int64)
    stack = [(model.final, p)]
    while stack:
        tid, p = stack.pop()
        st, tab = model.step_of[tid], tabs[tid]
        if st.var >= 0:
            red[st.var] = tab.xs[p]
        stack.extend((kid, int(tab.bp[p, j])) for j, kid in enumerate(st.inputs) if kid >= model.n_orig)
    return model.original_choice(red)


def row_limits(bnd: Bounds, target: float, cap: int | None) -> np.ndarray:
    """B per row for plans with time <= target and memory <= cap."""
    wt, wm = bnd.wt[:, 0], bnd.wm[:, 0]
    return np.where(wt == 0, np.inf if cap is None else float(cap), target + wm * (cap or 0))
