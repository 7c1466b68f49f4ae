"""Activation recomputation as a choice of the planner: which blocks recompute, and what that does to the tables.

A repeated block (``capture.find_blocks``: a model's layers) may be *recomputed*: its
forward keeps only the block's inputs, and backward runs the block's forward again
before its own backward (``lower/recompute.py``).  Recomputing block ``b`` under a
choice of strategies ``s`` changes the search's terms as follows (``recomputed_tables``)::

    node i in b:          time_i(s_i) += forward_i(s_i)      (roofline + forward collectives)
                          mem_i(s_i)   = 0                   (nothing kept for backward)
    edge u -> v, v in b:  time(s_u, s_v) += move_uv(s_u, s_v) (the move into v runs again;
                          a gathered parameter v keeps is gathered once either way)
                          mem(s_u, s_v) = 0 when u is in b   (the block keeps its inputs only)

and the step's peak gains, during the block's backward, the activations the block
would have kept (``cost.peak_memory``, ``regions``).  ``recompute="full"`` recomputes
every block, ``"none"`` none; ``"auto"`` (the default) searches both and keeps the
faster plan that fits the cap: without a cap that is never recomputation, which only
adds time.  Choosing per block (some blocks recomputed, others not) and selective
recomputation (attention scores, softmax, dropout only) are not searched yet.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.capture import find_blocks
from autopar.search import INF

from .problem import ProblemTables, read_only, seconds_to_ps

__all__ = ["RECOMPUTE_OPTIONS", "block_regions", "recomputed_tables"]

#: What ``recompute=`` accepts.
RECOMPUTE_OPTIONS = ("auto", "none", "full")


def block_regions(ctx) -> dict[int, str]:
    """Op node index -> the name of its repeated block (``prefix.index``), for every op of every block."""
    graph = ctx.graph
    blocks = ctx.blocks or find_blocks(graph, min_count=2)  # two layers are enough to recompute one
    if blocks is None:
        return {}
    return {
        i: f"{blocks.prefix}.{blocks.indices[b]}"
        for b, nodes in enumerate(blocks.nodes)
        for i in nodes
        if graph.nodes[i].kind == "op"
    }


def recomputed_tables(ctx, regions: dict[int, str]) -> ProblemTables:
    """``ctx.tables`` with the nodes of ``regions`` recomputed (the terms in the module docstring)."""
    tables, graph, cand, coster = ctx.tables, ctx.graph, ctx.cand, ctx.coster
    node_time = list(tables.node_time_ps)
    node_mem = list(tables.node_mem)
    memo: dict = {}
    for i in regions:
        node = graph.nodes[i]
        key = ("node", id(cand.strategies[i]), id(tables.node_time_ps[i]))
        if key not in memo:
            forward = seconds_to_ps(np.array([coster.forward_time_s(node, s) for s in cand.strategies[i]]))
            memo[key] = (
                read_only(_add_ps(tables.node_time_ps[i], forward)),
                read_only(np.zeros_like(tables.node_mem[i])),
            )
        node_time[i], node_mem[i] = memo[key]
    edge_time = list(tables.edge_time_ps)
    edge_mem = list(tables.edge_mem)
    for e, (u, v) in enumerate(tables.edge_keys):
        if v not in regions:
            continue
        internal = regions.get(u) == regions[v]
        key = ("edge", id(tables.edge_time_ps[e]), id(tables.edge_mem[e]), internal, _refs_key(ctx, e))
        if key not in memo:
            moves = sum(_move_again_s(ctx, ref) for ref in tables.edge_refs[e])
            memo[key] = (
                read_only(_add_ps(tables.edge_time_ps[e], seconds_to_ps(moves))),
                read_only(np.zeros_like(tables.edge_mem[e])) if internal else tables.edge_mem[e],
            )
        edge_time[e], edge_mem[e] = memo[key]
    return replace(
        tables, node_time_ps=node_time, node_mem=node_mem, edge_time_ps=edge_time, edge_mem=edge_mem, _whole=None
    )


def _add_ps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` in picoseconds, where either is ``INF`` (a forbidden choice) the sum is too."""
    return np.where((a >= INF) | (b >= INF), INF, a + np.minimum(b, INF))


def _refs_key(ctx, e: int) -> tuple:
    """What the added move time of edge ``e`` depends on (equal layers share it)."""
    graph, cand = ctx.graph, ctx.cand
    return tuple(
        (id(cand.strategies[u]), id(cand.strategies[v]), o, pos, graph.nodes[u].outputs[o], graph.nodes[u].kind)
        for u, o, v, pos in ctx.tables.edge_refs[e]
    )


def _move_again_s(ctx, ref: tuple[int, int, int, int]) -> np.ndarray:
    """Seconds over (u strategy, v strategy) of the forward move of ``ref`` run again by the recomputation."""
    u, o, v, pos = ref
    graph, cand, coster = ctx.graph, ctx.cand, ctx.coster
    un, vn = graph.nodes[u], graph.nodes[v]
    meta = un.outputs[o]
    out = np.zeros((len(cand.strategies[u]), len(cand.strategies[v])))
    if un.kind == "param" and pos in coster.saved_inputs(vn):
        return out  # a kept gathered parameter is gathered again in backward already (priced on the edge)
    for a, su in enumerate(cand.strategies[u]):
        for b, sv in enumerate(cand.strategies[v]):
            src, dst = su.outputs[o], sv.inputs[pos]
            if src != dst:
                out[a, b] = coster.transition_time_s(meta, src, dst)
    return out
