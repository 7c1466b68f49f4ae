"""Split a problem into its repeated block and the rest, for :mod:`.chain`.

:func:`split_blocks` checks the structure :mod:`.chain`'s docstring requires (edges between
blocks join consecutive ones, one-strategy outside nodes feed the later blocks, equal
tables for blocks 1..) and builds the two sub-problems: F (block 1, with stand-ins for the
previous block's ports) and Rest (the nodes outside the blocks, block 0, and the last
block's ports).  The work is vectorized over the edges and compares arrays by identity
first (:meth:`.problem.SearchProblem.flat` offsets), so it does not grow with the number
of blocks in Python (the folds too: :func:`_folds` works per distinct strategy count).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import INF, SearchProblem

__all__ = ["ChainError", "Part", "split_blocks"]

_MAX_STATES = 4096  # port states K: the chain's tables are K x K


class ChainError(ValueError):
    """The blocks do not form a chain :func:`solve_chain` can use; the message says why."""


@dataclass(frozen=True, slots=True)
class Part:
    """A sub-problem (a block or the rest) and how its nodes map to the full problem."""

    problem: SearchProblem
    nodes: tuple[int, ...]  # sub node -> full node (-1: an in-port stand-in)
    left: tuple[int, ...]  # sub nodes of the first state (F: in-ports; Rest: B_0's ports)
    right: tuple[int, ...]  # sub nodes of the second state (F: B_i's ports; Rest: B_{L-1}'s ports)


def _folds(
    problem: SearchProblem, edges: np.ndarray, block_pos: tuple[np.ndarray, np.ndarray], shape: tuple[int, int]
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The costs of block nodes fed by one-strategy nodes outside the blocks, the edges folded in.

    An edge ``u -> v`` with ``k_u = 1`` adds its one row to v's unary costs, in edge order::

        t_v <- INF where t_v >= INF or et[0] >= INF, else t_v + et[0];    m_v <- m_v + em[0]

    (``em`` None adds nothing).  ``edges``: those edges (ascending); ``block_pos``: the
    (block, position) of each edge's v; ``shape``: (blocks, block size).  Returns
    ``group`` (blocks, size), the folded table of each block node (-1: none), and the tables
    ``(t, m)`` per group: equal folded costs share a group (one pair of arrays), so
    :func:`_check_equal` sees equal blocks without a look.  Vectorized over the edges, read
    from :meth:`.problem.SearchProblem.flat`: the Python work is per distinct strategy
    count of the nodes fed and per fold of one node (one in a model), not per block."""
    flat, uv, ks = problem.flat(), problem.edge_array(), _ks(problem)
    group = np.full(shape, -1, np.int64)
    tables: list[tuple[np.ndarray, np.ndarray]] = []
    for k in np.unique(ks[uv[edges, 1]]).tolist():
        pick = ks[uv[edges, 1]] == k
        sel = edges[pick]
        cols = np.arange(k)
        add_t = flat.t[flat.et[sel][:, None] + cols]  # (edges, k): the edge's one row
        has_m = flat.has_m[sel].astype(bool)[:, None]
        add_m = np.where(has_m, flat.m.take(flat.em[sel][:, None] + cols, mode="clip"), 0)
        fed, at = np.unique(uv[sel, 1], return_inverse=True)
        at = at.reshape(-1)
        t, m = flat.t[flat.nt[fed][:, None] + cols], flat.m[flat.nm[fed][:, None] + cols]
        # several edges into one node fold one after the other, as listed: the r-th edge of
        # each node in round r (r < the most edges into one node)
        order = np.argsort(at, kind="stable")
        start = np.searchsorted(at[order], at[order])
        rank = np.empty_like(at)
        rank[order] = np.arange(at.size) - start
        for r in range(int(rank.max()) + 1):
            e = np.flatnonzero(rank == r)
            row = at[e]
            t[row] = np.where((t[row] >= INF) | (add_t[e] >= INF), INF, t[row] + add_t[e])
            m[row] = m[row] + add_m[e]
        distinct, which = np.unique(np.concatenate([t, m], axis=1), axis=0, return_inverse=True)
        one = np.flatnonzero(rank == 0)  # an edge per fed node, in the order of ``fed``
        one = one[np.argsort(at[one])]
        group[block_pos[0][pick][one], block_pos[1][pick][one]] = len(tables) + which.reshape(-1)
        tables += [(_frozen(d[:k].copy()), _frozen(d[k:].copy())) for d in distinct]
    return group, tables


def _ks(problem: SearchProblem) -> np.ndarray:
    """``k_i`` per node as an array, kept with the problem (the key its choice check uses)."""
    return problem.memo("ks array", lambda: np.asarray(problem.num_choices, np.int64))


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False  # a read-only array goes into a SearchProblem without a view
    return arr


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where the blocks sit in the problem: per node its block and position, per edge (``u -> v``) the blocks
    and positions of its ends and what kind of edge it is."""

    nodes: np.ndarray  # (blocks, size): node j of block i
    bof: np.ndarray  # node -> its block, -1: R
    bu: np.ndarray  # per edge: u's block (-1: R), v's block, u's position, v's position
    bv: np.ndarray
    pu: np.ndarray
    pv: np.ndarray
    internal: np.ndarray  # both ends in one block
    inter: np.ndarray  # from a block to the next
    into: np.ndarray  # from R into a block
    out_of: np.ndarray  # from a block to R
    fold: np.ndarray  # from R into a block >= 1: folds into the block's unary costs

    @property
    def where(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.bu, self.bv, self.pu, self.pv


def split_blocks(problem: SearchProblem, blocks: list[list[int]]) -> tuple[Part, Part, int, tuple[int, ...]]:
    """(F's part, Rest's part, K, port positions), or :class:`ChainError`.

    Vectorized over the edges: the work in Python is per node of one block and per edge
    of the rest, so it does not grow with the number of blocks (but for the folds, one
    edge per block at most in a model)."""
    lay = _layout(problem, blocks)
    port, k_port = _ports(problem, lay)
    fold_e = np.flatnonzero(lay.fold)
    folded = _folds(problem, fold_e, (lay.bv[fold_e], lay.pv[fold_e]), lay.nodes.shape)  # blocks >= 1
    _check_equal(problem, lay.nodes, folded, lay.internal & (lay.bu >= 1), lay.inter, lay.where)
    f_part = _block_part(problem, blocks, lay, port, k_port, folded)
    return f_part, _rest_part(problem, blocks, lay, port), math.prod(k_port), port


def _layout(problem: SearchProblem, blocks: list[list[int]]) -> _Layout:
    """The blocks' layout (:class:`_Layout`), or :class:`ChainError` for fewer than 3 blocks, blocks of unequal
    sizes, or a node in two blocks."""
    n_blocks, size = len(blocks), len(blocks[0]) if blocks else 0
    if n_blocks < 3 or any(len(b) != size for b in blocks):
        raise ChainError(f"need >= 3 blocks of one size, got sizes {[len(b) for b in blocks]}")
    nodes = np.asarray(blocks, np.int64)
    bof = np.full(problem.n_nodes, -1, np.int64)  # node -> its block, -1: R
    pof = np.full(problem.n_nodes, -1, np.int64)  # node -> its position in the block
    bof[nodes], pof[nodes] = np.arange(n_blocks)[:, None], np.arange(size)[None, :]
    if np.count_nonzero(bof >= 0) != n_blocks * size:
        raise ChainError("a node is in two blocks")
    uv = problem.edge_array()
    u, v = uv[:, 0], uv[:, 1]
    bu, bv, pu, pv = bof[u], bof[v], pof[u], pof[v]
    both = (bu >= 0) & (bv >= 0)
    internal, inter = both & (bu == bv), both & (bv == bu + 1)
    into, out_of = (bu < 0) & (bv >= 0), (bu >= 0) & (bv < 0)
    return _Layout(nodes, bof, bu, bv, pu, pv, internal, inter, into, out_of, into & (bv > 0))


def _ports(problem: SearchProblem, lay: _Layout) -> tuple[tuple[int, ...], list[int]]:
    """The port positions and their strategy counts, or :class:`ChainError` naming the first edge that breaks
    the chain's structure (:mod:`.chain`'s docstring) or the ports that do not fit."""
    ks, uv = _ks(problem), problem.edge_array()
    u, bof, n_blocks = uv[:, 0], lay.bof, lay.nodes.shape[0]

    def first(mask: np.ndarray) -> tuple[int, int]:
        return problem.edges[int(np.flatnonzero(mask)[0])]

    skips = (lay.bu >= 0) & (lay.bv >= 0) & ~lay.internal & ~lay.inter
    if skips.any():
        a, b = first(skips)
        raise ChainError(f"edge {problem.names[a]} -> {problem.names[b]} skips from block {bof[a]} to {bof[b]}")
    if (lay.fold & (ks[u] != 1)).any():
        a, b = first(lay.fold & (ks[u] != 1))
        raise ChainError(f"{problem.names[a]} ({ks[a]} strategies) outside the blocks feeds block {bof[b]}")
    if (lay.out_of & (lay.bu != n_blocks - 1)).any():
        a, b = first(lay.out_of & (lay.bu != n_blocks - 1))
        raise ChainError(f"block {bof[a]} feeds {problem.names[b]} outside the blocks")
    port = tuple(int(j) for j in np.unique(np.concatenate([lay.pu[lay.inter], lay.pu[lay.out_of]])))
    if not port:
        raise ChainError("the blocks are not connected")
    k_port = ks[lay.nodes[:, list(port)]]
    if math.prod(k_port[0].tolist()) > _MAX_STATES or (k_port != k_port[0]).any():
        raise ChainError(f"port states {k_port[0].tolist()}: more than {_MAX_STATES} or unequal across blocks")
    return port, k_port[0].tolist()


def _block_part(
    problem: SearchProblem, blocks: list[list[int]], lay: _Layout, port: tuple, k_port: list, folded: tuple
) -> Part:
    """F: the previous block's ports (stand-ins, zero cost), then block 1 (its nodes by node index), with its
    folded costs (``folded``: :func:`_folds`), its internal edges and the edges from the stand-ins."""
    group, tables = folded
    b1 = blocks[1]
    order = sorted(range(len(b1)), key=lambda j: b1[j])
    loc = {j: len(port) + r for r, j in enumerate(order)}
    zeros = [np.zeros(k, np.int64) for k in k_port]
    edges, et, em = [], [], []
    pu, pv = lay.pu, lay.pv
    for mask, sub in ((lay.inter & (lay.bv == 1), port.index), (lay.internal & (lay.bu == 1), loc.__getitem__)):
        e = np.flatnonzero(mask)
        for x in e[np.lexsort((pv[e], pu[e]))]:
            edges.append((sub(int(pu[x])), loc[int(pv[x])]))
            et.append(problem.edge_time[x])
            em.append(problem.edge_mem[x])

    def own(j: int, which: int) -> np.ndarray:
        g = int(group[1, j])
        return tables[g][which] if g >= 0 else (problem.node_time, problem.node_mem)[which][b1[j]]

    names = tuple(f"<in {problem.names[blocks[0][j]]}>" for j in port) + tuple(problem.names[b1[j]] for j in order)
    block = SearchProblem(
        names,
        tuple(zeros) + tuple(own(j, 0) for j in order),
        tuple(zeros) + tuple(own(j, 1) for j in order),
        tuple(edges),
        tuple(et),
        tuple(em),
        None,
    )
    nodes = (-1,) * len(port) + tuple(b1[j] for j in order)
    return Part(block, nodes, tuple(range(len(port))), tuple(loc[j] for j in port))


def _rest_part(problem: SearchProblem, blocks: list[list[int]], lay: _Layout, port: tuple) -> Part:
    """Rest: R, block 0, and block L-1's ports (their own costs are in the last F, so zero here)."""
    ks, uv = _ks(problem), problem.edge_array()
    keep_node = lay.bof < 0
    keep_node[lay.nodes[0]] = True
    last_ports = lay.nodes[-1, list(port)]
    keep_node[last_ports] = True
    full = np.flatnonzero(keep_node)
    idx = np.full(problem.n_nodes, -1, np.int64)
    idx[full] = np.arange(full.size)
    is_last = np.zeros(problem.n_nodes, bool)
    is_last[last_ports] = True
    bu, bv = lay.bu, lay.bv
    rest_edges = np.flatnonzero(
        ((bu < 0) & (bv < 0)) | (lay.into & (bv == 0)) | lay.out_of | (lay.internal & (bu == 0))
    )
    rest = SearchProblem(
        tuple(problem.names[w] for w in full),
        tuple(np.zeros(ks[w], np.int64) if is_last[w] else problem.node_time[w] for w in full),
        tuple(np.zeros(ks[w], np.int64) if is_last[w] else problem.node_mem[w] for w in full),
        tuple((int(a), int(b)) for a, b in idx[uv[rest_edges]]),
        tuple(problem.edge_time[e] for e in rest_edges),
        tuple(problem.edge_mem[e] for e in rest_edges),
        None,
        problem.base_mem_bytes,
    )
    left = tuple(int(idx[blocks[0][j]]) for j in port)
    return Part(rest, tuple(full.tolist()), left, tuple(int(idx[blocks[-1][j]]) for j in port))


def _check_equal(problem: SearchProblem, nodes: np.ndarray, folded: tuple, internal, inter, where) -> None:
    """Blocks 1.. have block 1's tables (the ones F is built from): nodes with their folded
    costs (``folded``: :func:`_folds`), internal edges, and the edges from the previous
    block's ports.  Arrays are compared by :meth:`SearchProblem.flat` offsets
    (``problem_builder`` gives equal layers the same arrays, so equal offsets are the common
    case) and folded ones by group, by value where they differ."""
    flat = problem.flat()
    bu, bv, pu, pv = where
    n_blocks = nodes.shape[0]
    group, tables = folded
    is_folded = group >= 0
    keys = []
    for col in (flat.nt, flat.nm):
        key = col[nodes].copy()  # offsets >= 0; a folded table's key is -1 - its group
        key[is_folded] = -1 - group[is_folded]
        keys.append(key)

    def array(kind: int, i: int, j: int) -> np.ndarray:
        g = int(group[i, j])
        return tables[g][kind] if g >= 0 else (problem.node_time, problem.node_mem)[kind][nodes[i, j]]

    for kind, key in enumerate(keys):
        for i, j in zip(*np.nonzero(key[1:] != key[1])):
            if not np.array_equal(array(kind, i + 1, j), array(kind, 1, j)):
                raise ChainError(f"the tables of block {i + 1} (its nodes or the edges into it) differ from block 1's")
    # edges: internal ones by their block, the ones from the previous block's ports by the block they enter
    for mask, blk in ((internal, bu), (inter, bv)):
        e = np.flatnonzero(mask)
        e = e[np.lexsort((pv[e], pu[e], blk[e]))]
        counts = np.bincount(blk[e] - 1, minlength=n_blocks - 1)
        if (counts != counts[0]).any():
            i = int(np.flatnonzero(counts != counts[0])[0]) + 1
            raise ChainError(f"the tables of block {i} (its nodes or the edges into it) differ from block 1's")
        e = e.reshape(n_blocks - 1, -1)
        for col in (pu[e], pv[e], flat.et[e], flat.em[e]):
            for i, c in zip(*np.nonzero(col != col[0])):
                a, b = int(e[i, c]), int(e[0, c])
                same = pu[a] == pu[b] and pv[a] == pv[b]
                for x, y in ((problem.edge_time[a], problem.edge_time[b]), (problem.edge_mem[a], problem.edge_mem[b])):
                    x, y = (np.zeros_like(problem.edge_time[a]) if z is None else z for z in (x, y))
                    same = same and np.array_equal(x, y)
                if not same:
                    raise ChainError(
                        f"the tables of block {i + 1} (its nodes or the edges into it) differ from block 1's"
                    )
