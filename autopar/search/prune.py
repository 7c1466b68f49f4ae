"""Exact domain pruning by dominance (neighbourhood substitutability).

For node v with strategies a, b (alive after INF / arc-consistency pruning,
``SearchProblem.allowed_choices``), write ``a >= b`` ("a dominates b") when

    t_v(a) <= t_v(b),   m_v(a) <= m_v(b),   and on every edge (v, w), for every strategy y
    of w still alive:   t_vw(a, y) <= t_vw(b, y)   and   (t_vw(b, y) = INF  or  m_vw(a, y) <= m_vw(b, y))

(edges into v read their matrices transposed).  Then for any allowed plan ``c`` with
``c_v = b``, the plan ``c'`` equal to ``c`` but ``c'_v = a`` is allowed (its edge times are
<= ``c``'s, all below INF) and has ``T(c') <= T(c)`` and ``M(c') <= M(c)``: ``v`` appears
only in its own and its incident edges' terms.  So dropping b keeps the minimum time under
every cap (ties broken by memory), the least memory, and every point of the (T, M) Pareto
frontier.

``>=`` is a preorder (reflexive; transitive: where ``t(c) < INF``, ``t(b) <= t(c) < INF``
so the memory test of ``a >= b`` applies).  Strategies equal under it (``a >= b >= a``)
are ordered by index, so ``a > b  iff  a >= b and (not b >= a or a < b)`` is a strict
partial order and every strategy with some ``a > b`` can go at once: each has a maximal
dominator, which stays (:func:`_dominated`).  Removing strategies of v only shrinks the
rows its neighbours are compared on, so the test is repeated on them to a fixpoint
(:func:`prune_dominated`), each removal justified on the domains left at its time (the
optimum over the smaller domains equals the one over the larger, by induction).  Arc
consistency survives: a strategy whose only finite partner was b has a finite partner a.

Nodes in ``keep`` are never pruned: their edges continue outside the sub-problem (a
block's ports, :mod:`.chain`), so their costs here are incomplete.
"""

from __future__ import annotations

import numpy as np

from .deadline import Deadline
from .problem import INF, SearchProblem

__all__ = ["prune_dominated", "rows_cols"]

_BIG = np.iinfo(np.int64).max  # memory where the dominated side's pair is forbidden: anything fits below
_CHUNK = 1 << 22  # elements of one (pair, column) comparison chunk in :func:`_dominated`
_BLOCK = 32  # columns compared at a time on the pairs left, before those that failed are dropped (:func:`_dominated`)
_DENSE = 8  # :func:`_dominated` compares the whole (a, b) square while more than 1/_DENSE of it is left


def _dominated(dom: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Mask of rows b of ``sub`` with some row a != b of ``dom`` with ``dom[a] <= sub[b]``
    everywhere and (not ``dom[b] <= sub[a]`` or a < b); ``dom[i] <= sub[i]`` holds for all i.

    ``ge[a, b]`` is ``a >= b``, and b goes when some a has ``a > b`` (``ge[a, b]`` and not
    ``ge[b, a]``, or equal and a < b).  A pair is out once one column says ``dom[a] > sub[b]``,
    and most pairs are out after a few columns (the node's own time and memory first): so the
    pairs are filtered column by column over the whole (a, b) square while more than
    ``1 / _DENSE`` of it is left, then ``_BLOCK`` columns at a time on the pairs left.  The work is
    about k^2 times the columns it takes most pairs to fail, not k^2 times every column (a node of
    512 strategies beside neighbours of as many has 2,000)."""
    k, cols = dom.shape
    if k <= 1:
        return np.zeros(k, bool)
    left = ~np.eye(k, dtype=bool)
    col = 0
    while col < cols:
        left &= dom[:, None, col] <= sub[None, :, col]
        col += 1
        if col % 4 == 0 and np.count_nonzero(left) * _DENSE < k * k:
            break
    a_idx, b_idx = np.nonzero(left)
    for lo in range(col, cols, _BLOCK):
        if a_idx.size == 0:
            break
        keep = np.empty(a_idx.size, bool)
        step = max(1, _CHUNK // _BLOCK)
        for p in range(0, a_idx.size, step):
            a, b = a_idx[p : p + step], b_idx[p : p + step]
            keep[p : p + step] = (dom[a, lo : lo + _BLOCK] <= sub[b, lo : lo + _BLOCK]).all(axis=1)
        a_idx, b_idx = a_idx[keep], b_idx[keep]
    ge = np.zeros((k, k), bool)
    ge[a_idx, b_idx] = True
    strict = ge & (~ge.T | np.tri(k, k, -1, dtype=bool).T)  # a > b: not b >= a, or equal with a < b
    return strict.any(axis=0)


def rows_cols(a: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``a[np.ix_(rows, cols)]``, without the index grids where a side keeps every index (sorted, unique): ``a``
    itself (no copy) where both do."""
    if rows.size < a.shape[0]:
        a = a[rows]
    return a if cols.size == a.shape[1] else a[:, cols]


def prune_dominated(
    problem: SearchProblem,
    allowed: list[np.ndarray],
    keep: frozenset[int] = frozenset(),
    deadline: Deadline | None = None,
) -> list[np.ndarray]:
    """``allowed`` (per node, sorted strategy indices) without the dominated strategies
    (module docstring), to a fixpoint; nodes in ``keep`` keep all of theirs.  Past ``deadline``
    the pruning stops where it is: what it removed so far was dominated, so the domains left
    still hold every optimum (a wider search, not a wrong one)."""
    alive = [np.asarray(a, np.int64) for a in allowed]
    incident: list[list[tuple[int, int, bool]]] = [[] for _ in range(problem.n_nodes)]
    for e, (u, v) in enumerate(problem.edges):
        incident[u].append((e, v, False))
        incident[v].append((e, u, True))
    todo = [v for v in range(problem.n_nodes) if v not in keep and alive[v].size > 1]
    queued = set(todo)
    while todo:
        if deadline is not None and deadline.passed():
            break
        v = todo.pop()
        queued.discard(v)
        al = alive[v]
        dom = [problem.node_time[v][al, None], problem.node_mem[v][al, None]]
        sub = list(dom)
        for e, w, flip in incident[v]:
            t, m = problem.edge_time[e], problem.edge_mem[e]
            t = rows_cols(t.T if flip else t, al, alive[w])
            dom.append(t)
            sub.append(t)
            if m is not None:  # None: zeros, never decides
                m = rows_cols(m.T if flip else m, al, alive[w])
                dom.append(m)
                sub.append(np.where(t >= INF, _BIG, m))
        gone = _dominated(np.concatenate(dom, axis=1), np.concatenate(sub, axis=1))
        if not gone.any():
            continue
        alive[v] = al[~gone]
        for _, w, _ in incident[v]:
            if w not in keep and w not in queued and alive[w].size > 1:
                queued.add(w)
                todo.append(w)
    return alive
