"""Activation recomputation as a choice of the planner: what recomputing regions does to the tables.

A *region* (``regions.py``: a whole repeated block, or selectively a run of weightless
ops inside one) is recomputed: its forward keeps only the region's inputs, and
backward runs the region's forward again before its own backward
(``lower/recompute.py``).  Recomputing the regions under a choice of strategies ``s``
changes the search's terms as follows (``recomputed_tables``)::

    node i in a region:   time_i(s_i) += forward_i(s_i)      (roofline + forward collectives)
                          mem_i(s_i)   = own_i(s_i)          (its outputs its own op keeps, read outside)
    edge u -> v, v in a   time(s_u, s_v) += move_uv(s_u, s_v) (the move into v runs again;
      region:                                                a gathered parameter v keeps is gathered once)
                          mem(s_u, s_v) = kept_uv(s_u)       (what v's checkpoint keeps of u's output, on
                                                             the first edge of the region reading it; else 0)
    node u outside the    mem_u(s_u)  += its storage          (a value two layers or more read: paid once)
      layers, shared:
    edge u -> v, u shared mem(s_u, s_v) = 0 where unmoved

Who pays for what is ``kept.py``'s rule, *the reader pays*: every term of a layer then
depends on that layer's own choice only, so the chained search may let each layer
choose (``solving.plan_under``'s ``per_layer``), and equal layers still have equal
tables.  The step's peak gains, during each region's backward, the activations it
would have kept (``cost.peak_memory``'s ``reborn_at``), less the region inputs its
recomputation reads as they are; the inputs a checkpoint keeps die when its region's
backward ends.  ``recompute="full"`` recomputes every block, ``"selective"`` the
selective regions of every block, ``"none"`` nothing but the blocks a ``"recompute"``
hint names; ``"auto"`` (the default), under a cap, lets each layer choose among the
three (``driver.plan_from_context``; without a cap it never recomputes: that only
adds time).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.search import INF

from .kept import Keeping, keeping
from .problem_tables import ProblemTables, read_only, seconds_to_ps

__all__ = ["RECOMPUTE_OPTIONS", "recomputed_tables"]

#: What ``recompute=`` accepts.
RECOMPUTE_OPTIONS = ("auto", "none", "selective", "full")


def recomputed_tables(ctx, regions: dict[int, str]) -> ProblemTables:
    """``ctx.tables`` with the nodes of ``regions`` recomputed (the terms in the module docstring), built once.
    No regions is not ``ctx.tables``: a value several layers read is paid once by its node (``kept.py``)."""
    key = tuple(sorted(regions.items()))
    if key not in ctx.tables.recomputed:
        ctx.tables.recomputed[key] = _recomputed(ctx, regions)
    return ctx.tables.recomputed[key]


def _recomputed(ctx, regions: dict[int, str]) -> ProblemTables:
    tables, graph, cand, coster = ctx.tables, ctx.graph, ctx.cand, ctx.coster
    keep = keeping(ctx, regions)
    node_time = list(tables.node_time_ps)
    node_mem = list(tables.node_mem)
    # a node's or an edge's recomputed terms depend on what its key names only, not on the other regions: one
    # memo for every region map over these tables (the per-layer variants share all but their own layers')
    memo = tables.recomputed_terms
    for i in regions:
        node = graph.nodes[i]
        key = ("node", id(cand.strategies[i]), id(tables.node_time_ps[i]), keep.own.get(i, ()))
        if key not in memo:
            forward = seconds_to_ps(np.array([coster.forward_time_s(node, s) for s in cand.strategies[i]]))
            memo[key] = (
                read_only(_add_ps(tables.node_time_ps[i], forward)),
                read_only(_kept_bytes(ctx, node, keep.own.get(i, ()))),
            )
        node_time[i], node_mem[i] = memo[key]
    for u, o in keep.shared - coster.saved_outputs:  # paid once by its node: its readers' unmoved edges pay 0
        node_mem[u] = read_only(node_mem[u] + _kept_bytes(ctx, graph.nodes[u], (o,)))
    edge_time = list(tables.edge_time_ps)
    edge_mem = list(tables.edge_mem)
    for e, (_, v) in enumerate(tables.edge_keys):
        refs = tables.edge_refs[e]
        if v not in regions:
            if v < len(graph.nodes) and all(coster.storage_root((a, o)) in keep.shared for a, o, _, _ in refs):
                key = ("shared", id(tables.edge_mem[e]), _refs_key(ctx, e))
                if key not in memo:
                    memo[key] = read_only(np.where(_same_placement(ctx, e), 0, tables.edge_mem[e]))
                edge_mem[e] = memo[key]
            continue
        pays = tuple((vv, pos) in keep.payers for _, _, vv, pos in refs)
        key = ("edge", id(tables.edge_time_ps[e]), id(tables.edge_mem[e]), _refs_key(ctx, e), pays)
        if key not in memo:
            moves = sum(_move_again_s(ctx, ref) for ref in refs)
            memo[key] = (
                read_only(_add_ps(tables.edge_time_ps[e], seconds_to_ps(moves))),
                read_only(_checkpoint_inputs(ctx, keep, refs, tables.edge_mem[e].shape)),
            )
        edge_time[e], edge_mem[e] = memo[key]
    return replace(
        tables,
        node_time_ps=node_time,
        node_mem=node_mem,
        edge_time_ps=edge_time,
        edge_mem=edge_mem,
        _whole=None,
        recomputed={},
        recomputed_terms={},
        weighted_copies={},
    )


def _checkpoint_inputs(ctx, keep: Keeping, refs, shape: tuple[int, int]) -> np.ndarray:
    """Over (u strategy, v strategy): the bytes a region's checkpoint keeps of the tensors on these edge refs
    (those it pays for: ``Keeping.payers``), under u's placement (what u made, before any move)."""
    out = np.zeros(shape, dtype=np.int64)
    for u, o, v, pos in refs:
        if (v, pos) in keep.payers:
            col = [ctx.coster.storage_bytes((u, o), s.outputs[o]) for s in ctx.cand.strategies[u]]
            out += np.array(col, dtype=np.int64)[:, None]
    return out


def _same_placement(ctx, e: int) -> np.ndarray:
    """Over (u strategy, v strategy) of edge ``e``: whether every tensor on it arrives as u made it (no move)."""
    cand = ctx.cand
    out = None
    for u, o, v, pos in ctx.tables.edge_refs[e]:
        same = np.array([[su.outputs[o] == sv.inputs[pos] for sv in cand.strategies[v]] for su in cand.strategies[u]])
        out = same if out is None else out & same
    return out


def _kept_bytes(ctx, node, outputs: tuple[int, ...]) -> np.ndarray:
    """Per strategy of ``node``: the bytes of ``outputs`` under the strategy's placements."""
    coster = ctx.coster
    return np.array(
        [
            sum(coster.local_bytes(node.outputs[o], s.outputs[o]) for o in outputs)
            for s in ctx.cand.strategies[node.index]
        ],
        dtype=np.int64,
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
