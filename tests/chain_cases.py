"""Chain problems whose blocks (and rest) may take other terms, as recomputation per layer gives them: the
variants ``search.chain`` chooses among, and the flat problems brute force solves for each choice."""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar.search.problem import INF

__all__ = ["mixed", "owned", "rest_variant", "variant"]


def variant(problem, blocks: list[list[int]], seed: int):
    """``problem`` with its blocks' terms changed as recomputing a layer changes them (time up, memory down):
    every block node's, and every edge's entering one; shared arrays stay shared (the blocks stay equal)."""
    rng = np.random.default_rng(seed)
    extra, share = int(rng.integers(5, 40)), int(rng.integers(2, 5))  # equal arrays stay equal
    inside = {v for b in blocks for v in b}
    memo: dict = {}

    def moved(arr, kind):
        if arr is None:
            return None
        key = (id(arr), kind)
        if key not in memo:
            memo[key] = np.where(arr >= INF, INF, arr + extra) if kind == "t" else arr // share
        return memo[key]

    def node(arrs, kind):
        return tuple(moved(a, kind) if i in inside else a for i, a in enumerate(arrs))

    def edge(arrs, kind):
        return tuple(moved(a, kind) if v in inside else a for a, (_, v) in zip(arrs, problem.edges))

    return dataclasses.replace(
        problem,
        node_time=node(problem.node_time, "t"),
        node_mem=node(problem.node_mem, "m"),
        edge_time=edge(problem.edge_time, "t"),
        edge_mem=edge(problem.edge_mem, "m"),
    )


def rest_variant(problem, blocks: list[list[int]], seed: int):
    """``problem`` with the terms outside its blocks changed as recomputing the rest of the graph changes them
    (time up, memory down): every node outside the blocks, and every edge entering one."""
    rng = np.random.default_rng(seed + 1000)
    extra, share = int(rng.integers(5, 40)), int(rng.integers(2, 5))
    inside = {v for b in blocks for v in b}

    def moved(arr, kind):
        if arr is None:
            return None
        return np.where(arr >= INF, INF, arr + extra) if kind == "t" else arr // share

    return dataclasses.replace(
        problem,
        node_time=tuple(a if i in inside else moved(a, "t") for i, a in enumerate(problem.node_time)),
        node_mem=tuple(a if i in inside else moved(a, "m") for i, a in enumerate(problem.node_mem)),
        edge_time=tuple(a if v in inside else moved(a, "t") for a, (_, v) in zip(problem.edge_time, problem.edges)),
        edge_mem=tuple(a if v in inside else moved(a, "m") for a, (_, v) in zip(problem.edge_mem, problem.edges)),
    )


def owned(problems, blocks, picks):
    """The problem whose nodes outside the blocks and block 0 take ``problems[picks[0]]``'s terms and block
    i >= 1 ``problems[picks[i]]``'s (an edge: its entered node's)."""
    owner = dict.fromkeys(range(problems[0].n_nodes), picks[0])
    owner.update({v: p for b, p in zip(blocks[1:], picks[1:]) for v in b})
    return dataclasses.replace(
        problems[0],
        node_time=tuple(problems[owner[i]].node_time[i] for i in range(problems[0].n_nodes)),
        node_mem=tuple(problems[owner[i]].node_mem[i] for i in range(problems[0].n_nodes)),
        edge_time=tuple(problems[owner[v]].edge_time[e] for e, (_, v) in enumerate(problems[0].edges)),
        edge_mem=tuple(problems[owner[v]].edge_mem[e] for e, (_, v) in enumerate(problems[0].edges)),
    )


def mixed(problem, other, blocks, picks):
    """The problem whose block i takes ``other``'s terms where ``picks[i]`` is 1 (an edge: its entered node's)."""
    owner = {v: p for b, p in zip(blocks, picks) for v in b}
    ps = (problem, other)
    return dataclasses.replace(
        problem,
        node_time=tuple(ps[owner.get(i, 0)].node_time[i] for i in range(problem.n_nodes)),
        node_mem=tuple(ps[owner.get(i, 0)].node_mem[i] for i in range(problem.n_nodes)),
        edge_time=tuple(ps[owner.get(v, 0)].edge_time[e] for e, (_, v) in enumerate(problem.edges)),
        edge_mem=tuple(ps[owner.get(v, 0)].edge_mem[e] for e, (_, v) in enumerate(problem.edges)),
    )
