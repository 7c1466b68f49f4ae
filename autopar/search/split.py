"""Split a problem into its repeated block and the rest, for :mod:`.chain`.

:func:`_split` checks the structure :mod:`.chain`'s docstring requires (edges between
blocks join consecutive ones, one-strategy outside nodes feed the later blocks, equal
tables for blocks 1..) and builds the two sub-problems: F (block 1, with stand-ins for the
previous block's ports) and Rest (the nodes outside the blocks, block 0, and the last
block's ports).  The work is vectorized over the edges and compares arrays by identity
first (:meth:`.problem.SearchProblem.flat` offsets), so it does not grow with the number
of blocks in Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import INF, SearchProblem

_MAX_STATES = 4096  # port states K: the chain's tables are K x K


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
    """(F's part, Rest's part, K, port positions), or :class:`ChainError`.

    Vectorized over the edges: the work in Python is per node of one block and per edge
    of the rest, so it does not grow with the number of blocks (but for the folds, one
    edge per block at most in a model)."""
    n_blocks, size = len(blocks), len(blocks[0]) if blocks else 0
    if n_blocks < 3 or any(len(b) != size for b in blocks):
        raise ChainError(f"need >= 3 blocks of one size, got sizes {[len(b) for b in blocks]}")
    nodes = np.asarray(blocks, np.int64)
    bof = np.full(problem.n_nodes, -1, np.int64)  # node -> its block, -1: R
    pof = np.full(problem.n_nodes, -1, np.int64)  # node -> its position in the block
    bof[nodes], pof[nodes] = np.arange(n_blocks)[:, None], np.arange(size)[None, :]
    if np.count_nonzero(bof >= 0) != n_blocks * size:
        raise ChainError("a node is in two blocks")
    ks = np.asarray(problem.num_choices, np.int64)
    uv = problem.edge_array()
    u, v = uv[:, 0], uv[:, 1]
    bu, bv, pu, pv = bof[u], bof[v], pof[u], pof[v]
    both = (bu >= 0) & (bv >= 0)
    internal, inter = both & (bu == bv), both & (bv == bu + 1)
    into, out_of = (bu < 0) & (bv >= 0), (bu >= 0) & (bv < 0)
    fold = into & (bv > 0)

    def first(mask: np.ndarray) -> tuple[int, int]:
        return problem.edges[int(np.flatnonzero(mask)[0])]

    if (both & ~internal & ~inter).any():
        a, b = first(both & ~internal & ~inter)
        raise ChainError(f"edge {problem.names[a]} -> {problem.names[b]} skips from block {bof[a]} to {bof[b]}")
    if (fold & (ks[u] != 1)).any():
        a, b = first(fold & (ks[u] != 1))
        raise ChainError(f"{problem.names[a]} ({ks[a]} strategies) outside the blocks feeds block {bof[b]}")
    if (out_of & (bu != n_blocks - 1)).any():
        a, b = first(out_of & (bu != n_blocks - 1))
        raise ChainError(f"block {bof[a]} feeds {problem.names[b]} outside the blocks")
    port = tuple(int(j) for j in np.unique(np.concatenate([pu[inter], pu[out_of]])))
    if not port:
        raise ChainError("the blocks are not connected")
    k_port = ks[nodes[:, list(port)]]
    if math.prod(k_port[0].tolist()) > _MAX_STATES or (k_port != k_port[0]).any():
        raise ChainError(f"port states {k_port[0].tolist()}: more than {_MAX_STATES} or unequal across blocks")
    k_port = k_port[0].tolist()
    fold_t = {}  # (block, position) -> folded (t, m), blocks >= 1
    memo: dict = {}
    for e in np.flatnonzero(fold):
        key = (int(bv[e]), int(pv[e]))
        t, m = fold_t.get(key, (problem.node_time[v[e]], problem.node_mem[v[e]]))
        fold_t[key] = _fold_unary(t, m, problem.edge_time[e], problem.edge_mem[e], memo)
    _check_equal(problem, nodes, fold_t, internal & (bu >= 1), inter, (bu, bv, pu, pv))
    # F: the previous block's ports (stand-ins, zero cost), then block 1.
    b1 = blocks[1]
    order = sorted(range(size), key=lambda j: b1[j])
    loc = {j: len(port) + r for r, j in enumerate(order)}
    zeros = [np.zeros(k, np.int64) for k in k_port]
    edges, et, em = [], [], []
    for mask, sub in ((inter & (bv == 1), lambda j: port.index(j)), (internal & (bu == 1), loc.__getitem__)):
        e = np.flatnonzero(mask)
        for x in e[np.lexsort((pv[e], pu[e]))]:
            edges.append((sub(int(pu[x])), loc[int(pv[x])]))
            et.append(problem.edge_time[x])
            em.append(problem.edge_mem[x])

    def own(j: int, which: int) -> np.ndarray:
        folded = fold_t.get((1, j))
        return folded[which] if folded is not None else (problem.node_time, problem.node_mem)[which][b1[j]]

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
    f_part = _Part(
        block, (-1,) * len(port) + tuple(b1[j] for j in order), tuple(range(len(port))), tuple(loc[j] for j in port)
    )
    # Rest: R, block 0, and block L-1's ports (their own costs are in the last F).
    keep_node = bof < 0
    keep_node[nodes[0]] = True
    last_ports = nodes[-1, list(port)]
    keep_node[last_ports] = True
    full = np.flatnonzero(keep_node)
    idx = np.full(problem.n_nodes, -1, np.int64)
    idx[full] = np.arange(full.size)
    is_last = np.zeros(problem.n_nodes, bool)
    is_last[last_ports] = True
    rest_edges = np.flatnonzero(((bu < 0) & (bv < 0)) | (into & (bv == 0)) | out_of | (internal & (bu == 0)))
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
    r_part = _Part(rest, tuple(full.tolist()), left, tuple(int(idx[blocks[-1][j]]) for j in port))
    return f_part, r_part, math.prod(k_port), port


def _check_equal(problem: SearchProblem, nodes: np.ndarray, fold_t: dict, internal, inter, where) -> None:
    """Blocks 1.. have block 1's tables (the ones F is built from): nodes with their folded
    costs, internal edges, and the edges from the previous block's ports.  Arrays are
    compared by :meth:`SearchProblem.flat` offsets (``problem_builder`` gives equal layers
    the same arrays, so equal offsets are the common case), by value where they differ."""
    flat = problem.flat()
    bu, bv, pu, pv = where
    n_blocks = nodes.shape[0]
    folded_id: dict[int, int] = {}  # id of a folded array -> a negative key
    keys = []
    for col, which in ((flat.nt, 0), (flat.nm, 1)):
        key = col[nodes].copy()
        for (i, j), pair in fold_t.items():
            key[i, j] = folded_id.setdefault(id(pair[which]), -1 - len(folded_id))
        keys.append(key)

    def array(kind: int, i: int, j: int) -> np.ndarray:
        pair = fold_t.get((i, j))
        return pair[kind] if pair is not None else (problem.node_time, problem.node_mem)[kind][nodes[i, j]]

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
