"""Build the SearchProblem (pure data) from a CandidateGraph and its Coster.

Node ``i`` of the problem is node ``i`` of the OpGraph; one extra *sink* node per
constrained graph output reads it as Replicate on every axis (the loss must be a
full scalar on every rank; with no loss, every float output must be full).
Outputs other than the loss are left where the plan puts them.

Times are integer picoseconds and memory integer bytes, so the DP and CP-SAT
optimize the same integers and their optima compare exactly.  A *restriction*
(``allow_node``, ``allow_edge``) removes strategies or forbids strategy pairs; it is
how the planner finds the best plan of each family for the comparison table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from autopar.cost import Coster
from autopar.placement import Replicate
from autopar.search import INF, SearchProblem
from autopar.strategies import CandidateGraph

__all__ = [
    "PS_PER_S",
    "ProblemTables",
    "build_tables",
    "read_only",
    "reweighted",
    "seconds_to_ps",
    "to_problem",
    "weighted",
]

PS_PER_S = 10**12


@dataclass
class ProblemTables:
    """Every cost of every candidate, before any restriction (computed once per plan)."""

    names: list[str]
    node_time_ps: list[np.ndarray]
    node_mem: list[np.ndarray]
    edge_keys: list[tuple[int, int]]
    edge_time_ps: list[np.ndarray]
    edge_mem: list[np.ndarray]
    edge_refs: list[list[tuple[int, int, int, int]]]  # per edge: (u, out_idx, v, pos) tensors it carries
    sinks: list[tuple[int, int]]  # (node, output index) read as Replicate by a sink node
    _whole: tuple | None = field(default=None, repr=False)  # (problem, keep): unrestricted, no cap
    # these tables with blocks recomputed, by the recomputed nodes (planner.recompute_tables builds them once)
    recomputed: dict = field(default_factory=dict, repr=False)
    # the recomputed terms of single nodes and edges, shared by every region map over these tables
    recomputed_terms: dict = field(default_factory=dict, repr=False)
    # region maps found over these tables' graph (planner.regions: the selective runs, the rest's parts), by
    # what they were asked for: cap-free, so every plan of a context finds them once
    regions: dict = field(default_factory=dict, repr=False)
    # these tables with activations weighted (``weighted``), by weight
    weighted_copies: dict = field(default_factory=dict, repr=False)

    def problem(self, mem_cap_bytes: int | None) -> tuple[SearchProblem, list[np.ndarray]]:
        """:func:`to_problem` unrestricted.  Built and checked once; each cap is then a
        :meth:`SearchProblem.with_cap` copy sharing the arrays and what the solvers derived
        from them (plan reuse across caps)."""
        if self._whole is None:
            self._whole = _build(self, None, None, None)
            self._whole[0].flat()  # evaluate's index and the edge array: part of the problem, built with it
            self._whole[0].edge_array()
        problem, keep = self._whole
        return problem.with_cap(mem_cap_bytes), list(keep)


def seconds_to_ps(seconds: np.ndarray) -> np.ndarray:
    """Seconds as integer picoseconds; an infinite cost (a forbidden move) becomes ``INF``."""
    s = np.asarray(seconds, dtype=np.float64)
    finite = np.isfinite(s)
    out = np.full(s.shape, INF, dtype=np.int64)
    out[finite] = np.rint(s[finite] * PS_PER_S).astype(np.int64)
    return out


def read_only(arr: np.ndarray) -> np.ndarray:
    """The array made read-only in place: tables are shared by equal nodes and edges, and
    a read-only array goes into a SearchProblem without a view (problem.py)."""
    arr.flags.writeable = False
    return arr


def build_tables(cand: CandidateGraph, coster: Coster) -> ProblemTables:
    graph = cand.graph
    names = [n.name for n in graph.nodes]
    node_time: list[np.ndarray] = []
    node_mem: list[np.ndarray] = []
    cache: dict = {}
    for n in graph.nodes:
        strats = cand.strategies[n.index]
        key = (
            id(strats),
            n.kind,
            n.requires_grad,
            n.outputs,
            tuple(o for o in range(len(n.outputs)) if (n.index, o) in coster.saved_outputs),
            coster.node_mem_key(n),
        )
        if key not in cache:
            cache[key] = (
                seconds_to_ps([coster.node_time_s(n, s) for s in strats]),
                np.array([coster.node_mem_bytes(n, s) for s in strats], dtype=np.int64),
            )
        t, m = cache[key]
        node_time.append(read_only(t))
        node_mem.append(read_only(m))
    edges: dict[tuple[int, int], list] = {}
    ecache: dict = {}
    for v in graph.nodes:
        for pos, (u, o) in enumerate(v.inputs):
            un = graph.nodes[u]
            key = (
                id(cand.strategies[u]),
                id(cand.strategies[v.index]),
                o,
                pos,
                un.kind,
                un.requires_grad,
                v.requires_grad,
                un.outputs[o],
                v.call.target,
                coster.edge_mem_key(v, pos),
            )
            if key not in ecache:
                t, m = coster.edge_matrices(un, o, v, pos)
                ecache[key] = (seconds_to_ps(t), m)
            t, m = ecache[key]
            entry = edges.setdefault((u, v.index), [[], [], []])
            entry[0].append(t)
            entry[1].append(m)
            entry[2].append((u, o, v.index, pos))
    sinks = _constrained_outputs(graph)
    tables = ProblemTables(names, node_time, node_mem, [], [], [], [], sinks)
    for (u, v), (t, m, refs) in sorted(edges.items()):
        tables.edge_keys.append((u, v))
        # one tensor on the edge: the cached matrices themselves, shared by equal edges (the
        # repeated layers), so the search checks and stores each once
        tables.edge_time_ps.append(read_only(t[0] if len(t) == 1 else sum(t[1:], t[0])))
        tables.edge_mem.append(read_only(m[0] if len(m) == 1 else sum(m[1:], m[0])))
        tables.edge_refs.append(refs)
    for k, (u, o) in enumerate(sinks):
        meta = graph.nodes[u].outputs[o]
        full = tuple(Replicate() for _ in cand.mesh_shape)
        t = np.array([[coster.transition_time_s(meta, s.outputs[o], full)] for s in cand.strategies[u]])
        tables.names.append(f"<output {k}>")
        tables.node_time_ps.append(np.zeros(1, dtype=np.int64))
        tables.node_mem.append(np.zeros(1, dtype=np.int64))
        tables.edge_keys.append((u, len(tables.names) - 1))
        tables.edge_time_ps.append(seconds_to_ps(t))
        tables.edge_mem.append(np.zeros(t.shape, dtype=np.int64))
        tables.edge_refs.append([])
    return tables


def _constrained_outputs(graph) -> list[tuple[int, int]]:
    if graph.loss_output is not None:
        return [graph.outputs[graph.loss_output]]
    return [ref for ref in graph.outputs if graph.nodes[ref[0]].outputs[ref[1]].is_float]


def weighted(tables: ProblemTables, weight: int, params: set[int]) -> ProblemTables:
    """``tables`` with every saved activation byte counted ``weight`` times: an op node's memory and every
    edge's (what the edge's reader keeps for backward) times ``weight``, a parameter's (its state) as it is.
    A pipeline's stage plan is searched so (``stage_fitting``): a rank holds its stages' activations once per
    micro-batch in flight and their state once.  Built once per weight; ``weight`` 1 is ``tables`` itself."""
    if weight == 1:
        return tables
    if weight not in tables.weighted_copies:
        node_mem = [m if i in params else read_only(m * weight) for i, m in enumerate(tables.node_mem)]
        shared: dict[int, np.ndarray] = {}  # equal edges share one array: so do their weighted copies
        edge_mem = [shared.setdefault(id(m), read_only(m * weight)) for m in tables.edge_mem]
        tables.weighted_copies[weight] = _with_memory(tables, node_mem, edge_mem)
    return tables.weighted_copies[weight]


def reweighted(tables: ProblemTables, weight: list[int], replaced: dict[int, np.ndarray]) -> ProblemTables:
    """``tables`` with node ``i``'s memory ``weight[i]`` times (and every edge's into it: an edge's bytes are its
    reader's), or ``replaced[i]`` instead where given (its edges still ``weight[i]`` times).  Equal arrays weighted
    alike stay one array (the repeated layers', so the chained search still sees equal blocks).  Every weight is an
    int >= 0: a row of memory a bound sums by where each op runs (``stage_floor``)."""
    memo: dict[tuple[int, int], np.ndarray] = {}

    def times(m: np.ndarray, w: int) -> np.ndarray:
        if w == 1:
            return m
        if (id(m), w) not in memo:
            memo[id(m), w] = read_only(m * w)
        return memo[id(m), w]

    node_mem = [replaced[i] if i in replaced else times(m, weight[i]) for i, m in enumerate(tables.node_mem)]
    edge_mem = [times(m, weight[v]) for m, (_, v) in zip(tables.edge_mem, tables.edge_keys)]
    return _with_memory(tables, node_mem, edge_mem)


def _with_memory(tables: ProblemTables, node_mem: list[np.ndarray], edge_mem: list[np.ndarray]) -> ProblemTables:
    """``tables`` with these memory arrays (the times, edges and sinks its own)."""
    return ProblemTables(
        tables.names,
        tables.node_time_ps,
        node_mem,
        tables.edge_keys,
        tables.edge_time_ps,
        edge_mem,
        tables.edge_refs,
        tables.sinks,
    )


def to_problem(
    tables: ProblemTables,
    mem_cap_bytes: int | None,
    *,
    allow_node: Callable[[int, int], bool] | None = None,
    allow_edge: Callable[[int, int, int, int], bool] | None = None,
) -> tuple[SearchProblem, list[np.ndarray]]:
    """The SearchProblem under a restriction; also each node's kept strategy indices.

    ``allow_node(node, strategy)`` keeps a strategy; ``allow_edge(u, a, v, b)`` may
    forbid a pair (its time becomes INF).  Sink nodes are never restricted.
    """
    if allow_node is None and allow_edge is None:
        return tables.problem(mem_cap_bytes)
    return _build(tables, mem_cap_bytes, allow_node, allow_edge)


def _build(tables: ProblemTables, mem_cap_bytes: int | None, allow_node, allow_edge):
    n = len(tables.names)
    every: dict[int, np.ndarray] = {}  # k -> arange(k), shared (read-only) by the unrestricted nodes
    keep = []
    for i in range(n):
        k = len(tables.node_time_ps[i])
        if allow_node is None or i >= n - len(tables.sinks):
            if k not in every:
                every[k] = read_only(np.arange(k, dtype=np.int64))
            keep.append(every[k])
            continue
        idx = np.array([s for s in range(k) if allow_node(i, s)], dtype=np.int64)
        if len(idx) == 0:
            raise AssertionError(f"restriction leaves node {tables.names[i]} without a strategy")
        keep.append(idx)
    whole = [len(keep[i]) == len(tables.node_time_ps[i]) for i in range(n)]  # unrestricted: share the arrays
    edge_time, edge_mem = [], []
    for (u, v), t, m in zip(tables.edge_keys, tables.edge_time_ps, tables.edge_mem):
        if not (whole[u] and whole[v]):
            t, m = t[np.ix_(keep[u], keep[v])], m[np.ix_(keep[u], keep[v])]
        if allow_edge is not None:
            t = t.copy()
            for a, sa in enumerate(keep[u]):
                for b, sb in enumerate(keep[v]):
                    if not allow_edge(u, int(sa), v, int(sb)):
                        t[a, b] = INF
        edge_time.append(t)
        edge_mem.append(m)
    problem = SearchProblem(
        names=tuple(tables.names),
        node_time=tuple(tables.node_time_ps[i] if whole[i] else tables.node_time_ps[i][keep[i]] for i in range(n)),
        node_mem=tuple(tables.node_mem[i] if whole[i] else tables.node_mem[i][keep[i]] for i in range(n)),
        edges=tuple(tables.edge_keys),
        edge_time=tuple(edge_time),
        edge_mem=tuple(edge_mem),
        mem_cap_bytes=mem_cap_bytes,
    )
    return problem, keep
