"""Activation recomputation as a choice of the planner: which blocks recompute, and what that does to the tables.

A repeated block (``capture.find_blocks``: a model's layers) may be *recomputed*: its
forward keeps only the block's inputs, and backward runs the block's forward again
before its own backward (``lower/recompute.py``).  Recomputing block ``b`` under a
choice of strategies ``s`` changes the search's terms as follows (``recomputed_tables``)::

    node i in b:          time_i(s_i) += forward_i(s_i)      (roofline + forward collectives)
                          mem_i(s_i)   = kept_i(s_i)         (what a checkpoint keeps of it, below)
    node u outside:       mem_u(s_u)  += kept_u(s_u)         (its outputs a block's checkpoint keeps)
    edge u -> v, v in b:  time(s_u, s_v) += move_uv(s_u, s_v) (the move into v runs again;
                          a gathered parameter v keeps is gathered once either way)
                          mem(s_u, s_v) = 0                  (v keeps nothing: the checkpoint does)
    edge u -> v, u in b,  mem(s_u, s_v) = 0 where v reads u's output as u made it
      v after the blocks:                                    (kept_u counts it)

A recomputed block's checkpoint keeps the block's inputs, the values other nodes made,
as they are (before any move into the block), one storage however many blocks read
them.  So ``kept_u`` is the bytes, under u's placement, of u's non-parameter outputs
that something outside u's block reads: for u in a block always (the next block's
checkpoint, or the ops after the blocks), for u outside the blocks only when its own
term does not count them already (``Coster.saved_outputs``).  Every block then has the
same tables, so the chained search still solves one block and chains it.

The step's peak gains, during each block's backward, the activations the block would
have kept (``cost.peak_memory``'s ``reborn_at``).  ``recompute="full"`` recomputes every
block, ``"none"`` none but the layers a ``"recompute"`` hint names; ``"auto"`` (the
default) searches both under a cap and keeps the faster plan (without a cap it never
recomputes: that only adds time).  Not searched yet: a choice per block, and selective
recomputation (attention scores, softmax, dropout only).
"""

from __future__ import annotations

import fnmatch
from dataclasses import replace

import numpy as np

from autopar.capture import find_blocks
from autopar.search import INF

from .hints import module_matches
from .problem import ProblemTables, read_only, seconds_to_ps

__all__ = ["RECOMPUTE_OPTIONS", "block_regions", "checkpoint_outputs", "hinted_regions", "recomputed_tables"]

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


def hinted_regions(ctx, regions: dict[int, str], patterns: tuple[str, ...]) -> dict[int, str]:
    """The part of ``regions`` that recompute hints force: each block whose name, or one of whose ops' modules
    (or their ancestors), matches a pattern.  ValueError for a pattern that matches ops of no block."""
    graph = ctx.graph
    chosen: set[str] = set()
    for pattern in patterns:
        hit = {
            r
            for i, r in regions.items()
            if fnmatch.fnmatchcase(r, pattern) or module_matches(graph.nodes[i].module, pattern)
        }
        if not hit:
            names = sorted(set(regions.values()))[:2]
            raise ValueError(
                f"recompute hint {pattern!r} matches no repeated block (layer) of {graph.model_name}: recomputation "
                f"applies to whole layers (here {', '.join(names) or 'none: the model has no repeated layers'}); "
                "fix: a pattern over the layers' module paths, e.g. 'transformer.h.*'"
            )
        chosen |= hit
    return {i: r for i, r in regions.items() if r in chosen}


def recomputed_tables(ctx, regions: dict[int, str]) -> ProblemTables:
    """``ctx.tables`` with the nodes of ``regions`` recomputed (the terms in the module docstring), built once."""
    key = tuple(sorted(regions.items()))
    if key not in ctx.tables.recomputed:
        ctx.tables.recomputed[key] = _recomputed(ctx, regions)
    return ctx.tables.recomputed[key]


def _recomputed(ctx, regions: dict[int, str]) -> ProblemTables:
    tables, graph, cand, coster = ctx.tables, ctx.graph, ctx.cand, ctx.coster
    node_time = list(tables.node_time_ps)
    node_mem = list(tables.node_mem)
    memo: dict = {}
    kept = checkpoint_outputs(ctx, regions)
    for i in regions:
        node = graph.nodes[i]
        key = ("node", id(cand.strategies[i]), id(tables.node_time_ps[i]), kept.get(i, ()))
        if key not in memo:
            forward = seconds_to_ps(np.array([coster.forward_time_s(node, s) for s in cand.strategies[i]]))
            memo[key] = (
                read_only(_add_ps(tables.node_time_ps[i], forward)),
                read_only(_kept_bytes(ctx, node, kept.get(i, ()))),
            )
        node_time[i], node_mem[i] = memo[key]
    for u, outputs in kept.items():
        if u not in regions:
            node_mem[u] = read_only(tables.node_mem[u] + _kept_bytes(ctx, graph.nodes[u], outputs))
    edge_time = list(tables.edge_time_ps)
    edge_mem = list(tables.edge_mem)
    for e, (u, v) in enumerate(tables.edge_keys):
        if u in regions and v < len(graph.nodes) and v not in regions:  # the block's output, kept by its term
            key = ("out", id(tables.edge_mem[e]), _refs_key(ctx, e))
            if key not in memo:
                memo[key] = read_only(np.where(_same_placement(ctx, e), 0, tables.edge_mem[e]))
            edge_mem[e] = memo[key]
        if v not in regions:
            continue
        key = ("edge", id(tables.edge_time_ps[e]), id(tables.edge_mem[e]), _refs_key(ctx, e))
        if key not in memo:
            moves = sum(_move_again_s(ctx, ref) for ref in tables.edge_refs[e])
            memo[key] = (
                read_only(_add_ps(tables.edge_time_ps[e], seconds_to_ps(moves))),
                read_only(np.zeros_like(tables.edge_mem[e])),
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
    )


def checkpoint_outputs(ctx, regions: dict[int, str]) -> dict[int, tuple[int, ...]]:
    """Node -> its outputs a recomputed block's checkpoint keeps that its own term does not count (``kept_u``)."""
    graph, coster = ctx.graph, ctx.coster
    out: dict[int, tuple[int, ...]] = {}
    consumers = graph.consumers()
    for u in graph.nodes:
        if u.kind == "param":
            continue
        home = regions.get(u.index)
        kept = []
        for o in range(len(u.outputs)):
            readers = {v for v, _, idx in consumers[u.index] if idx == o}
            by_block = any(v in regions and regions[v] != home for v in readers)
            counted = (u.index, o) in coster.saved_outputs
            if home is None and by_block and not counted:
                kept.append(o)
            elif home is not None and any(regions.get(v) != home for v in readers):
                kept.append(o)  # read outside its block (the next block's checkpoint, or after the blocks)
        if kept:
            out[u.index] = tuple(kept)
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
