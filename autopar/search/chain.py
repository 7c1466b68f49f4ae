"""Exact search over repeated blocks: one block solved once, chained by min-plus over Pareto sets.

Setting.  The problem's nodes split into blocks ``B_0 .. B_{L-1}`` (``blocks[i][j]`` is
node ``j`` of block ``i``) and the rest ``R``.  The *ports* are the positions ``j`` whose
node has an edge leaving its block; a *state* is the joint choice of a block's port
nodes (original strategy indices, raveled), ``K`` states in all.  Required structure,
checked by :func:`_split` (otherwise ``solve_chain`` solves flat with :func:`.dp.solve_dp`):

* an edge between blocks joins a port of ``B_i`` to ``B_{i+1}``;
* ``R`` nodes that feed ``B_1 .. B_{L-1}`` have one strategy (their edges fold into the
  block's unary costs); only ``B_{L-1}``'s ports feed ``R``;
* ``B_1 .. B_{L-1}``, with their folded costs and the edges from the previous ports, have
  equal tables (position by position), so one block table serves them all.

Factors (Pareto sets of (t, m) pairs per state pair; :func:`.dp._pareto_pass` with the
port nodes kept, ``_Model(keep=...)``)::

    F(a, b)    = Pareto over B_i's choices with ports in state b, of B_i's node and internal
                 edge costs plus the edges from the previous ports in state a       (i >= 1)
    Rest(y, z) = Pareto over R's and B_0's choices, B_0's ports in state y, of their costs,
                 the edges B_{L-1}'s ports (state z) -> R, and the base memory

Recurrence.  With ``n = L - 1`` and ``(A (x) B)(a, c) = Pareto U_b A(a, b) (+) B(b, c)``
(``(+)`` adds pairs: min-plus over Pareto sets, :func:`_product`)::

    G = F^(x)n   by squaring: P_1 = F, P_2k = P_k (x) P_k, G = (x) of P_2^j over the bits of n
    optimum = lexicographic min (t, m) over U_(y, z) Rest(y, z) (+) G(y, z), m <= cap   (:func:`_finish`)

Why it is exact.  T and M are sums over the parts, and once the port states are fixed
the parts share no variable, so every plan is one pair per factor and every choice of
pairs with matching states is a plan.  Replacing a part by one that dominates it at the
same states (t' <= t, m' <= m) gives a plan no worse in T and M, so Pareto filtering
keeps the optimum's (T, M); ``(x)`` is associative, so squaring builds the same G.

Bounds (as in :mod:`.dp`: rows ``(w_t, w_m)``, pairs dropped past ``B`` = target / cap /
``target + lam cap``).  Per row, ``f`` and ``r`` are the min-sum tables of F and Rest::

    L_0(z, a) = r(a, z),     L_{p+1} = L_p (x) f            (R, B_0 and p more blocks)
    M_0 = L_0,               M_s = min(L_s, f (x) M_{s-1})   so
    M_s(c, a) = min over p + q = s of min_z L_p(z, a) + f^q(c, z)

A segment of ``l`` blocks at any position leaves, outside it, R and ``n - l`` blocks split
``p`` before and ``q`` after, so ``M_{n-l}(c, a)`` bounds the outside of every such segment
from below and a pair at ``(a, c)`` goes when ``w (t, m) + M_{n-l}(c, a) > B``.  Rest is
bounded by ``f^n``.  Rows: time, memory, and when the cap binds the Lagrange slope lam*
(Eisner-Severance as :func:`.dp._lagrange`) and lam* x 2^-4..2^4.  The target is the best
plan met: the min-sum plans of the rows, then thinned passes (per entry and memory bucket
only the fastest and the smallest pair: :func:`_thin`, coarse to fine), each a real plan
re-evaluated exactly.  Pruning only drops pairs no plan under target and cap can use, and
the last pass is unthinned: exact.  Windows (:func:`.dp._window`) skip the pairs of the
second factor that the time and memory rows already rule out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dp import (
    _LAMBDA_GRID,
    _THIN_GAP,
    _bounds,
    _limits,
    _Model,
    _pareto_keep,
    _pareto_pass,
    _Tab,
    _tol,
    _window,
    min_memory,
)
from .minsum import MinSumChain
from .problem import INF, InfeasibleError, SearchProblem, Solution

__all__ = ["ChainError", "solve_chain"]

logger = logging.getLogger(__name__)

_MAX_STATES = 4096  # port states K: the chain's tables are K x K
_CHUNK = 1 << 22  # pair combinations formed at once in a product
_THIN_GRIDS = (64, 512)  # thinned passes before the exact one: memory buckets across the plans' spread


class ChainError(ValueError):
    """The blocks do not form a chain :func:`solve_chain` can use; the message says why."""


@dataclass(frozen=True, slots=True)
class _Part:
    """A sub-problem (a block or the rest) and how its nodes map to the full problem."""

    problem: SearchProblem
    nodes: tuple[int, ...]  # sub node -> full node (-1: an in-port stand-in)
    left: tuple[int, ...]  # sub nodes of the first state (F: in-ports; Rest: B_0's ports)
    right: tuple[int, ...]  # sub nodes of the second state (F: B_i's ports; Rest: B_{L-1}'s ports)


def _fold_unary(
    t: np.ndarray, m: np.ndarray, et: np.ndarray, em: np.ndarray | None, memo: dict
) -> tuple[np.ndarray, np.ndarray]:
    """A node's costs with a one-strategy producer's edge added; equal inputs (by identity)
    give the same output arrays, so :func:`_check_equal` sees equal blocks without a look."""
    key = (id(t), id(m), id(et), id(em))
    if key not in memo:
        add_t = et[0]
        memo[key] = (np.where((t >= INF) | (add_t >= INF), INF, t + add_t), m if em is None else m + em[0])
    return memo[key]


def _split(problem: SearchProblem, blocks: list[list[int]]) -> tuple[_Part, _Part, int, tuple[int, ...]]:
    """(F's part, Rest's part, K, port positions), or :class:`ChainError`."""
    n_blocks, size = len(blocks), len(blocks[0]) if blocks else 0
    if n_blocks < 3 or any(len(b) != size for b in blocks):
        raise ChainError(f"need >= 3 blocks of one size, got sizes {[len(b) for b in blocks]}")
    where: dict[int, tuple[int, int]] = {v: (i, j) for i, b in enumerate(blocks) for j, v in enumerate(b)}
    if len(where) != n_blocks * size:
        raise ChainError("a node is in two blocks")
    ks = problem.num_choices
    internal: list[dict] = [{} for _ in blocks]
    inter: list[dict] = [{} for _ in blocks]
    fold_t = [[problem.node_time[v] for v in b] for b in blocks]
    fold_m = [[problem.node_mem[v] for v in b] for b in blocks]
    rest_edges: list[int] = []
    ports: set[int] = set()
    folded: dict = {}
    for e, (u, v) in enumerate(problem.edges):
        bu, bv = where.get(u), where.get(v)
        if bu is None and bv is None:
            rest_edges.append(e)
        elif bu is not None and bv is not None:
            if bu[0] == bv[0]:
                internal[bu[0]][(bu[1], bv[1])] = e
            elif bv[0] == bu[0] + 1:
                inter[bu[0]][(bu[1], bv[1])] = e
                ports.add(bu[1])
            else:
                raise ChainError(f"edge {problem.names[u]} -> {problem.names[v]} skips from block {bu[0]} to {bv[0]}")
        elif bv is not None:  # R -> block
            if bv[0] == 0:
                rest_edges.append(e)
            elif ks[u] == 1:
                i, j = bv
                fold_t[i][j], fold_m[i][j] = _fold_unary(fold_t[i][j], fold_m[i][j], *_edge(problem, e), folded)
            else:
                raise ChainError(f"{problem.names[u]} ({ks[u]} strategies) outside the blocks feeds block {bv[0]}")
        else:  # block -> R
            if bu[0] != n_blocks - 1:
                raise ChainError(f"block {bu[0]} feeds {problem.names[v]} outside the blocks")
            rest_edges.append(e)
            ports.add(bu[1])
    port = tuple(sorted(ports))
    if not port:
        raise ChainError("the blocks are not connected")
    k_port = [ks[blocks[0][j]] for j in port]
    if math.prod(k_port) > _MAX_STATES or any([ks[b[j]] for j in port] != k_port for b in blocks):
        raise ChainError(f"port states {k_port}: more than {_MAX_STATES} or unequal across blocks")
    _check_equal(problem, blocks, internal, inter, fold_t, fold_m)
    # F: the previous block's ports (stand-ins, zero cost), then block 1.
    b1 = blocks[1]
    order = sorted(range(size), key=lambda j: b1[j])
    loc = {j: len(port) + r for r, j in enumerate(order)}
    zeros = [np.zeros(k, np.int64) for k in k_port]
    edges, et, em = [], [], []
    for (j, j2), e in sorted(inter[0].items()):
        edges.append((port.index(j), loc[j2]))
        et.append(problem.edge_time[e])
        em.append(problem.edge_mem[e])
    for (j, j2), e in sorted(internal[1].items()):
        edges.append((loc[j], loc[j2]))
        et.append(problem.edge_time[e])
        em.append(problem.edge_mem[e])
    names = tuple(f"<in {problem.names[blocks[0][j]]}>" for j in port) + tuple(problem.names[b1[j]] for j in order)
    block = SearchProblem(
        names,
        tuple(zeros) + tuple(fold_t[1][j] for j in order),
        tuple(zeros) + tuple(fold_m[1][j] for j in order),
        tuple(edges),
        tuple(et),
        tuple(em),
        None,
    )
    f_part = _Part(
        block, (-1,) * len(port) + tuple(b1[j] for j in order), tuple(range(len(port))), tuple(loc[j] for j in port)
    )
    # Rest: R, block 0, and block L-1's ports (their own costs are in the last F).
    last_ports = {blocks[-1][j] for j in port}
    inside = set(where) - set(blocks[0]) - last_ports
    nodes = tuple(v for v in range(problem.n_nodes) if v not in inside)
    idx = {v: r for r, v in enumerate(nodes)}
    rest_edges += list(internal[0].values())
    rest_edges.sort()
    rest = SearchProblem(
        tuple(problem.names[v] for v in nodes),
        tuple(np.zeros(ks[v], np.int64) if v in last_ports else problem.node_time[v] for v in nodes),
        tuple(np.zeros(ks[v], np.int64) if v in last_ports else problem.node_mem[v] for v in nodes),
        tuple((idx[problem.edges[e][0]], idx[problem.edges[e][1]]) for e in rest_edges),
        tuple(problem.edge_time[e] for e in rest_edges),
        tuple(problem.edge_mem[e] for e in rest_edges),
        None,
        problem.base_mem_bytes,
    )
    r_part = _Part(rest, nodes, tuple(idx[blocks[0][j]] for j in port), tuple(idx[blocks[-1][j]] for j in port))
    return f_part, r_part, math.prod(k_port), port


def _edge(problem: SearchProblem, e: int) -> tuple[np.ndarray, np.ndarray | None]:
    return problem.edge_time[e], problem.edge_mem[e]


def _tables_of(problem: SearchProblem, fold_t, fold_m, internal: dict, inter: dict) -> tuple[tuple, list]:
    """One block's tables as (edge keys, arrays in a fixed order): equal blocks give equal pairs."""
    arrays = list(fold_t) + list(fold_m)
    for edges in (internal, inter):
        for key in sorted(edges):
            et, em = problem.edge_time[edges[key]], problem.edge_mem[edges[key]]
            arrays += [et, np.zeros_like(et) if em is None else em]
    return (tuple(sorted(internal)), tuple(sorted(inter))), arrays


def _check_equal(problem, blocks, internal, inter, fold_t, fold_m) -> None:
    """Blocks 1.. have block 1's tables (the ones F is built from): nodes with their folded
    costs, internal edges, and the edges from the previous block's ports.  Shared arrays
    (``problem_builder`` gives equal layers the same ones) are equal without a look."""
    keys, ref = _tables_of(problem, fold_t[1], fold_m[1], internal[1], inter[0])
    for i in range(2, len(blocks)):
        got_keys, got = _tables_of(problem, fold_t[i], fold_m[i], internal[i], inter[i - 1])
        if got_keys != keys or not all(a is b or np.array_equal(a, b) for a, b in zip(got, ref)):
            raise ChainError(f"the tables of block {i} (its nodes or the edges into it) differ from block 1's")


# ---- a part's table over its two states -----------------------------------------------------
class _Table:
    """A part eliminated down to its port nodes: per (left state, right state) entry."""

    def __init__(self, part: _Part, k_states: int) -> None:
        self.part = part
        self.model = _Model(part.problem, keep=frozenset(part.left + part.right))
        model, k = self.model, self.model.k
        scope = model.steps[-1].scope
        self.shape = tuple(k[v] for v in scope)
        coords = np.unravel_index(np.arange(math.prod(self.shape)), self.shape) if scope else ()
        full = {v: np.full(coords[0].size if scope else 1, model.allowed[v][0]) for v in part.left + part.right}
        for v, c in zip(scope, coords):
            full[v] = model.allowed[v][c]
        ks = part.problem.num_choices
        a = np.ravel_multi_index(tuple(full[v] for v in part.left), tuple(ks[v] for v in part.left))
        b = np.ravel_multi_index(tuple(full[v] for v in part.right), tuple(ks[v] for v in part.right))
        self.grid = np.asarray(a * k_states + b, np.int64).reshape(-1)  # final entry -> state pair
        self.k_states = k_states

    def to_grid(self, vals: np.ndarray) -> np.ndarray:
        """(rows, *final scope) -> (rows, K, K), inf where no entry."""
        rows = vals.shape[0]
        out = np.full((rows, self.k_states * self.k_states), np.inf)
        out[:, self.grid] = vals.reshape(rows, -1)
        return out.reshape(rows, self.k_states, self.k_states)

    def from_grid(self, grid: np.ndarray) -> np.ndarray:
        rows = grid.shape[0]
        return grid.reshape(rows, -1)[:, self.grid].reshape((rows,) + self.shape)

    def reduced(self, state_pair: int) -> np.ndarray:
        """The model's reduced choice vector with the kept nodes set for a state pair."""
        red = np.zeros(len(self.model.k), np.int64)
        e = int(np.flatnonzero(self.grid == state_pair)[0])
        if self.shape:
            for v, c in zip(self.model.steps[-1].scope, np.unravel_index(e, self.shape)):
                red[v] = c
        return red

    def argmin_choice(self, args: dict, row: int, state_pair: int) -> tuple[int, ...]:
        red = self.reduced(state_pair)
        for st in reversed(self.model.steps):
            if st.var >= 0:
                red[st.var] = args[st.out][(row,) + tuple(red[v] for v in st.scope)]
        return self.model.original_choice(red)

    def pareto_choice(self, tabs: list, pair: int, state_pair: int) -> tuple[int, ...]:
        red = self.reduced(state_pair)
        stack = [(self.model.final, pair)]
        while stack:
            tid, p = stack.pop()
            st, tab = self.model.step_of[tid], tabs[tid]
            if st.var >= 0:
                red[st.var] = tab.xs[p]
            stack.extend((kid, int(tab.bp[p, j])) for j, kid in enumerate(st.inputs) if kid >= self.model.n_orig)
        return self.model.original_choice(red)


# ---- Pareto tables over state pairs ----------------------------------------------------------
@dataclass(slots=True)
class _Seg:
    """Pareto pairs per (a, c) entry (CSR over K*K entries, each run by t ascending).

    A leaf (one block) keeps ``leaf``: the block table's final pair index; a product
    keeps its halves and per pair ``(b, ia, ib)``."""

    off: np.ndarray
    t: np.ndarray
    m: np.ndarray
    blocks: int
    leaf: np.ndarray | None = None
    halves: tuple | None = None
    bp: np.ndarray | None = None

    def entry_min(self, w: np.ndarray) -> np.ndarray:
        """(rows, K*K): least ``w_t t + w_m m`` per entry, inf when empty."""
        out = np.full((len(w), self.off.size - 1), np.inf)
        full = np.flatnonzero(np.diff(self.off))
        if full.size:
            vals = w[:, :1] * self.t + w[:, 1:] * self.m
            out[:, full] = np.minimum.reduceat(vals, self.off[full], axis=1)
        return out


def _csr(g: np.ndarray, n_entries: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(g, minlength=n_entries))])


def _leaf(table: _Table, tab) -> _Seg:
    """The block's final Pareto table laid onto the state grid."""
    ent = np.repeat(np.arange(tab.off.size - 1), np.diff(tab.off))
    g = table.grid[ent]
    o = np.lexsort((tab.t, g))
    k2 = table.k_states**2
    return _Seg(_csr(g, k2), tab.t[o], tab.m[o], 1, leaf=o)


def _product(
    a: _Seg, b: _Seg, k: int, w: np.ndarray, out: np.ndarray, lim: np.ndarray, beam: int | None = None
) -> _Seg:
    """``a (x) b`` (see the module docstring), keeping pairs with ``w (t, m) + out <= lim``.

    ``out``: (rows, K*K) lower bound of everything outside the product, per (a, c).
    ``beam``: per entry and memory bucket of that width keep the fastest and the smallest pair."""
    ca, cb = np.diff(a.off).reshape(k, k), np.diff(b.off).reshape(k, k)
    ia_, ib_, ic_ = np.nonzero((ca > 0)[:, :, None] & (cb > 0)[None, :, :])
    ea, eb, ec = ia_ * k + ib_, ib_ * k + ic_, ia_ * k + ic_
    bmin = b.entry_min(w)
    ok = (a.entry_min(w)[:, ea] + bmin[:, eb] + out[:, ec] <= lim).all(axis=0)
    ea, eb, ec, mid = ea[ok], eb[ok], ec[ok], ib_[ok]
    na, nb = ca.reshape(-1)[ea], cb.reshape(-1)[eb]
    n = na * nb
    parts: list[tuple[np.ndarray, ...]] = []
    btab = _Tab(b.off, b.t, b.m)
    pure_t = np.flatnonzero((w[:, 1] == 0) & np.isfinite(lim[:, 0]))
    pure_m = np.flatnonzero((w[:, 0] == 0) & np.isfinite(lim[:, 0]))
    cum = np.concatenate([[0], np.cumsum(n)])
    start = 0
    while start < n.size:  # chunks of about _CHUNK combinations
        stop = max(int(np.searchsorted(cum, cum[start] + _CHUNK, side="right")) - 1, start + 1)
        sl = slice(start, stop)
        start = stop
        tri = np.repeat(np.arange(sl.start, sl.stop), na[sl])  # one row per pair of a
        pa = a.off[ea[tri]] + np.arange(tri.size) - (np.cumsum(na[sl]) - na[sl])[tri - sl.start]
        fit = _fits(w, a.t[pa], a.m[pa], [(bmin, eb[tri]), (out, ec[tri])], lim)  # with b's best pair
        tri, pa = tri[fit], pa[fit]
        g = ec[tri]
        # b's pairs that fit beside this pair of a: one range of the entry (t up, m down), cut by
        # the time and memory rows (as dp._window)
        qt = ((lim[pure_t] - out[pure_t][:, g]) / w[pure_t, :1]).min(axis=0) - a.t[pa] if pure_t.size else None
        qm = ((lim[pure_m] - out[pure_m][:, g]) / w[pure_m, 1:]).min(axis=0) - a.m[pa] if pure_m.size else None
        lo, hi = _window(btab, eb[tri], qt, qm)
        cnt = hi - lo
        rep = np.repeat(np.arange(tri.size), cnt)
        pb = lo[rep] + np.arange(rep.size) - (np.cumsum(cnt) - cnt)[rep]
        pa, tri = pa[rep], tri[rep]
        t, m, g = a.t[pa] + b.t[pb], a.m[pa] + b.m[pb], g[rep]
        keep = np.flatnonzero(_fits(w, t, m, [(out, g)], lim))
        keep = keep[_pareto_keep(g[keep], t[keep], m[keep])]
        parts.append((g[keep], t[keep], m[keep], mid[tri[keep]], pa[keep], pb[keep]))
    if not parts:
        e = np.zeros(0, np.int64)
        return _Seg(
            np.zeros(k * k + 1, np.int64), e, e, a.blocks + b.blocks, halves=(a, b), bp=np.zeros((0, 3), np.int64)
        )
    g, t, m, mid, pa, pb = (np.concatenate(x) for x in zip(*parts))
    sel = _pareto_keep(g, t, m) if len(parts) > 1 else np.arange(g.size)
    if beam is not None and sel.size:
        sel = sel[_thin(g[sel], m[sel] // beam)]
    g, t, m, mid, pa, pb = g[sel], t[sel], m[sel], mid[sel], pa[sel], pb[sel]
    return _Seg(_csr(g, k * k), t, m, a.blocks + b.blocks, halves=(a, b), bp=np.stack([mid, pa, pb], 1))


def _fits(w: np.ndarray, t: np.ndarray, m: np.ndarray, terms: list[tuple], lim: np.ndarray) -> np.ndarray:
    """Mask of pairs with ``w_r (t, m) + rest_r <= lim_r`` on every row, testing the rows one
    by one on the survivors (the Lagrange rows, last, cut the most).  ``rest_r`` is the sum of
    ``table[r, index]`` over ``terms`` (tables (rows, entries), an entry per pair), gathered
    per row for the survivors only: the rows x pairs matrix is never formed."""
    alive = np.arange(t.size)
    for r in range(len(w) - 1, -1, -1):
        rest = sum(tab[r, idx[alive]] for tab, idx in terms)
        v = w[r, 0] * t[alive] + w[r, 1] * m[alive] + rest
        alive = alive[v <= lim[r, 0]]
    mask = np.zeros(t.size, bool)
    mask[alive] = True
    return mask


def _thin(g: np.ndarray, bucket: np.ndarray) -> np.ndarray:
    """Indices of the first and last pair of each (group, bucket) run (groups sorted)."""
    edge = np.ones(g.size + 1, bool)
    edge[1:-1] = (g[1:] != g[:-1]) | (bucket[1:] != bucket[:-1])
    return np.flatnonzero(edge[:-1] | edge[1:])


def _expand(seg: _Seg, a: int, c: int, pair: int, k: int) -> list[tuple[int, int, int]]:
    """(in state, out state, leaf pair) per block of a segment's pair, in chain order."""
    out: list[tuple[int, int, int]] = []
    stack = [(seg, a, c, pair)]
    while stack:
        s, a, c, p = stack.pop()
        if s.halves is None:
            out.append((a, c, int(s.leaf[p])))
            continue
        mid, pa, pb = (int(x) for x in s.bp[p])
        stack.append((s.halves[1], mid, c, pb))
        stack.append((s.halves[0], a, mid, pa))
    return out


# ---- the solver ---------------------------------------------------------------------------
class _Chain:
    def __init__(self, problem: SearchProblem, blocks: list[list[int]]) -> None:
        self.problem, self.blocks = problem, blocks
        f_part, r_part, self.k, self.port = _split(problem, blocks)
        self.n = len(blocks) - 1
        self.ftab, self.rtab = _Table(f_part, self.k), _Table(r_part, self.k)
        self._where: tuple[np.ndarray, np.ndarray] | None = None  # assemble's scatter, built on first use

    def assemble(self, rest_choice: tuple[int, ...], block_choices: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The full choice vector from the rest's choice and each block's (blocks 1..)."""
        if self._where is None:
            pos = {v: j for j, v in enumerate(self.blocks[1])}
            subs = [sub for sub, full in enumerate(self.ftab.part.nodes) if full >= 0]
            at = np.array([pos[self.ftab.part.nodes[sub]] for sub in subs], np.int64)
            self._where = (np.array(subs, np.int64), np.array(self.blocks[1:], np.int64)[:, at])
        subs, targets = self._where
        choice = np.zeros(self.problem.n_nodes, np.int64)
        choice[list(self.rtab.part.nodes)] = rest_choice
        choice[targets] = np.array(block_choices, np.int64)[:, subs]
        return tuple(choice.tolist())

    def scalar_plans(self, sc: MinSumChain) -> list[tuple[int, int, tuple[int, ...]]]:
        out = []
        k = self.k
        for row in range(len(sc.w)):
            if not np.isfinite(sc.total[row]):
                raise InfeasibleError(f"{self.problem.summary()}: every plan hits a forbidden (INF) choice or pair")
            st = sc.states(row)
            rest = self.rtab.argmin_choice(sc.rargs, row, st[0] * k + st[-1])
            per_pair: dict[int, tuple[int, ...]] = {}  # blocks between equal states choose alike
            for pair in (st[i - 1] * k + st[i] for i in range(1, len(st))):
                if pair not in per_pair:
                    per_pair[pair] = self.ftab.argmin_choice(sc.fargs, row, pair)
            blocks = [per_pair[st[i - 1] * k + st[i]] for i in range(1, len(st))]
            choice = self.assemble(rest, blocks)
            out.append((*self.problem.evaluate(choice), choice))
        return out


def _lagrange_rows(chain: _Chain, fast, small, cap: int, seen: list) -> float:
    """Eisner-Severance on the hull (as :func:`.dp._lagrange`), with the chain's min-sum."""
    lam = 0.0
    for _ in range(64):
        lam = max(0.0, (small[0] - fast[0]) / max(fast[1] - small[1], 1))
        p = chain.scalar_plans(MinSumChain(chain.ftab, chain.rtab, chain.n, np.array([[1.0, lam]])))[0]
        seen.append(p)
        line = fast[0] + lam * fast[1]
        if p[0] + lam * p[1] >= line - _tol(line):
            break
        fast, small = (fast, p) if p[1] <= cap else (p, small)
    return lam


def solve_chain(
    problem: SearchProblem,
    blocks: list[list[int]],
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> Solution:
    """Minimum time under the memory cap (ties broken by memory), exactly, solving the
    repeated block once (see the module docstring).

    ``blocks[i][j]``: node of position j in block i, blocks in chain order.  Raises
    :class:`ChainError` when the blocks do not chain (solve flat then), and
    :class:`InfeasibleError` as :func:`.dp.solve_dp` does.  ``progress(stage, done, total)``
    is called as the stages finish.
    """
    start = time.perf_counter()
    tick = progress or (lambda *_: None)
    chain = _Chain(problem, blocks)
    cap = problem.mem_cap_bytes
    tick("block tables", 1, 4)
    w = np.array([[1.0, 0.0], [0.0, 1.0]])
    sc = MinSumChain(chain.ftab, chain.rtab, chain.n, w)
    seen = chain.scalar_plans(sc)
    fast, small = seen
    if cap is not None and int(sc.total[1]) > cap:  # min-sum of memory is the exact least memory
        raise InfeasibleError.over_cap(problem, min_memory(problem))
    if cap is not None and fast[1] > cap:
        if small[1] > cap:  # float ties in the memory row: take a plan that fits
            exact = min_memory(problem)
            small = (exact.time, exact.mem_bytes, exact.choice)
            seen.append(small)
        lam = _lagrange_rows(chain, fast, small, cap, seen)
        # lam* and the slopes around it (as dp's grid): a pair's completion trades at its own rate
        w = np.concatenate([w, [[1.0, lam]], [[1.0, lam * f] for f in _LAMBDA_GRID]])
        sc = MinSumChain(chain.ftab, chain.rtab, chain.n, w)
        seen += chain.scalar_plans(sc)[2:]
    ub = min(p[0] for p in seen if cap is None or p[1] <= cap)
    tick("bounds", 2, 4)
    ms = sc.outside()
    bounds = (  # outside the block: M_{n-1}; outside the rest: the chain's min-sum f^n
        _bounds(chain.ftab.model, w, sc.fvals, chain.ftab.from_grid(ms[chain.n - 1].transpose(0, 2, 1))),
        _bounds(chain.rtab.model, w, sc.rvals, chain.rtab.from_grid(sc.power())),
    )
    stats: dict = {"blocks": len(blocks), "block_nodes": len(blocks[0]), "states": chain.k, "rows": len(w)}
    stats["lagrange_ub"] = ub
    spread = max(p[1] for p in seen) - min(p[1] for p in seen)
    # lower bound: the min-sum of time, or of time + lam (M - cap) on a Lagrange row (weak duality)
    lb = max(float(sc.total[r]) - float(w[r, 1]) * (cap or 0) for r in range(len(w)) if w[r, 0] == 1.0)
    stats["lower_bound"] = lb
    grids = _THIN_GRIDS if ub - lb > _THIN_GAP * abs(ub) else ()  # a target that close needs no thinning
    for grid in grids:  # thinned passes, coarse to fine: real plans that lower the target cheaply
        found = _pass(chain, sc, ms, bounds, ub, max(1, spread // grid))[0]
        better = found is not None and found[0] < ub
        if better:
            seen.append(found)
            ub = found[0]
        elif grid != grids[0]:
            break
    tick("exact pass", 3, 4)
    found, pstats = _pass(chain, sc, ms, bounds, ub, None)
    stats.update(pstats, upper_bound=ub)
    cands = [p for p in seen if cap is None or p[1] <= cap] + ([found] if found is not None else [])
    t, m, choice = min(cands, key=lambda p: (p[0], p[1]))
    tick("done", 4, 4)
    elapsed = time.perf_counter() - start
    stats["solve_s"] = elapsed
    logger.info(
        "solve_chain: %s, %d blocks, %d states -> (%d ps, %d B) in %.3fs",
        problem.summary(),
        len(blocks),
        chain.k,
        t,
        m,
        elapsed,
    )
    return Solution(tuple(choice), t, m, True, "chain", elapsed, stats)


def _pass(chain: _Chain, sc: MinSumChain, ms: list, bounds: tuple, ub: int, beam: int | None):
    """One Pareto pass under target ``ub`` (and the cap): the best plan it finds, re-evaluated,
    or None.  ``beam``: per entry and memory bucket of that width keep the fastest and the
    smallest pair (heuristic, as :func:`.dp._pareto_pass`); None: exact."""
    problem, cap, k, w = chain.problem, chain.problem.mem_cap_bytes, chain.k, sc.w
    fb, rb = bounds
    lim_rows = _limits(fb, float(ub), cap)
    lim = (lim_rows + _tol(lim_rows))[:, None]
    ftabs, fstats = _pareto_pass(chain.ftab.model, fb, lim_rows, beam=beam)
    leaf = _leaf(chain.ftab, ftabs[chain.ftab.model.final])
    g = _power(leaf, chain.n, k, w, ms, lim, beam)
    rtabs, rstats = _pareto_pass(chain.rtab.model, rb, lim_rows, beam=beam)
    rest = _leaf(chain.rtab, rtabs[chain.rtab.model.final])
    stats = {"block_pairs": int(leaf.t.size), "chain_pairs": int(g.t.size), "rest_pairs": int(rest.t.size)}
    best = _finish(rest, g, k, cap)
    if best is None:
        return None, stats
    e, pr, pg = best
    y, z = divmod(e, k)
    rest_choice = chain.rtab.pareto_choice(rtabs, int(rest.leaf[pr]), e)
    per_block = _expand(g, y, z, pg, k)
    memo: dict[tuple[int, int], tuple[int, ...]] = {}  # equal (leaf pair, states): equal block choice
    for a, c, lp in per_block:
        if (lp, a * k + c) not in memo:
            memo[lp, a * k + c] = chain.ftab.pareto_choice(ftabs, lp, a * k + c)
    choice = chain.assemble(rest_choice, [memo[lp, a * k + c] for a, c, lp in per_block])
    t, m = problem.evaluate(choice)
    want = (int(rest.t[pr] + g.t[pg]), int(rest.m[pr] + g.m[pg]))
    if (t, m) != want:
        raise AssertionError(f"solve_chain: plan re-evaluates to {(t, m)}, the chain said {want}")
    return (t, m, choice), stats


def _power(leaf: _Seg, n: int, k: int, w: np.ndarray, ms: list[np.ndarray], lim: np.ndarray, beam: int | None) -> _Seg:
    """``F^(x)n`` by squaring; a segment of l blocks is pruned with ``M_{n-l}``."""

    def out(blocks: int) -> np.ndarray:
        return ms[n - blocks].transpose(0, 2, 1).reshape(len(w), -1)

    result, base, e = None, leaf, n
    while e:
        if e & 1:
            result = (
                base if result is None else _product(result, base, k, w, out(result.blocks + base.blocks), lim, beam)
            )
        e >>= 1
        if e:
            base = _product(base, base, k, w, out(2 * base.blocks), lim, beam)
    return result


def _finish(rest: _Seg, g: _Seg, k: int, cap: int | None) -> tuple[int, int, int] | None:
    """(entry, rest pair, chain pair) of the lexicographically least (t, m) under the cap."""
    best: tuple[int, int, int, int, int] | None = None
    for e in np.flatnonzero((np.diff(rest.off) > 0) & (np.diff(g.off) > 0)):
        rs, re_ = rest.off[e], rest.off[e + 1]
        gs, ge = g.off[e], g.off[e + 1]
        gm = g.m[gs:ge]  # descending along the run
        room = (cap if cap is not None else INF) - rest.m[rs:re_]
        j = np.searchsorted(-gm, -room, side="left")  # first chain pair with m <= room: least t that fits
        ok = np.flatnonzero(j < gm.size)
        if not ok.size:
            continue
        tt = rest.t[rs:re_][ok] + g.t[gs:ge][j[ok]]
        mm = rest.m[rs:re_][ok] + gm[j[ok]]
        i = np.lexsort((mm, tt))[0]
        cand = (int(tt[i]), int(mm[i]), int(e), int(rs + ok[i]), int(gs + j[ok[i]]))
        if best is None or cand[:2] < best[:2]:
            best = cand
    return None if best is None else best[2:]
