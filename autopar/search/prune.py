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

from .problem import INF, SearchProblem

__all__ = ["prune_dominated"]

_BIG = np.iinfo(np.int64).max  # memory where the dominated side's pair is forbidden: anything fits below
_CHUNK = 1 << 22  # elements of one (a, b, column) comparison block in :func:`_dominated`


def _dominated(dom: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Mask of rows b of ``sub`` with some row a != b of ``dom`` with ``dom[a] <= sub[b]``
    everywhere and (not ``dom[b] <= sub[a]`` or a < b); ``dom[i] <= sub[i]`` holds for all i.

    All pairs at once: ``ge[a, b]`` is ``a >= b``, and b goes when some a has ``a > b``
    (``ge[a, b]`` and not ``ge[b, a]``, or equal and a < b), in row chunks that keep the
    (a, b, column) comparison within ``_CHUNK`` elements."""
    k, cols = dom.shape
    if k <= 1:
        return np.zeros(k, bool)
    ge = np.empty((k, k), bool)
    step = max(1, _CHUNK // max(k * cols, 1))
    for lo in range(0, k, step):
        ge[lo : lo + step] = (dom[lo : lo + step, None, :] <= sub[None, :, :]).all(axis=2)
    np.fill_diagonal(ge, False)
    strict = ge & (~ge.T | np.tri(k, k, -1, dtype=bool).T)  # a > b: not b >= a, or equal with a < b
    return strict.any(axis=0)


def _rows_cols(a: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``a[np.ix_(rows, cols)]``, without the index grids where a side keeps every index (sorted, unique)."""
    if rows.size < a.shape[0]:
        a = a[rows]
    return a if cols.size == a.shape[1] else a[:, cols]


def prune_dominated(
    problem: SearchProblem, allowed: list[np.ndarray], keep: frozenset[int] = frozenset()
) -> list[np.ndarray]:
    """``allowed`` (per node, sorted strategy indices) without the dominated strategies
    (module docstring), to a fixpoint; nodes in ``keep`` keep all of theirs."""
    alive = [np.asarray(a, np.int64) for a in allowed]
    incident: list[list[tuple[int, int, bool]]] = [[] for _ in range(problem.n_nodes)]
    for e, (u, v) in enumerate(problem.edges):
        incident[u].append((e, v, False))
        incident[v].append((e, u, True))
    todo = [v for v in range(problem.n_nodes) if v not in keep and alive[v].size > 1]
    queued = set(todo)
    while todo:
        v = todo.pop()
        queued.discard(v)
        al = alive[v]
        dom = [problem.node_time[v][al, None], problem.node_mem[v][al, None]]
        sub = list(dom)
        for e, w, flip in incident[v]:
            t, m = problem.edge_time[e], problem.edge_mem[e]
            t = _rows_cols(t.T if flip else t, al, alive[w])
            dom.append(t)
            sub.append(t)
            if m is not None:  # None: zeros, never decides
                m = _rows_cols(m.T if flip else m, al, alive[w])
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
