"""Activation recomputation as a choice of the planner: what recomputing regions does to the tables.

A *region* (``regions.py``: a whole repeated block, or selectively a run of weightless
ops inside one) is recomputed: its forward keeps only the region's inputs, and
backward runs the region's forward again before its own backward
(``lower/recompute.py``).  Recomputing the regions under a choice of strategies ``s``
changes the search's terms as follows (``recomputed_tables``)::

    node i in a region:   time_i(s_i) += forward_i(s_i)      (roofline + forward collectives)
                          mem_i(s_i)   = kept_i(s_i)         (what it still pays for, below)
    node u outside:       mem_u(s_u)  += kept_u(s_u)         (storages it owns that a checkpoint keeps)
    edge u -> v, v in a   time(s_u, s_v) += move_uv(s_u, s_v) (the move into v runs again;
      region:                                                a gathered parameter v keeps is gathered once)
                          mem(s_u, s_v) = 0                  (v keeps nothing: the checkpoint does)
    edge u -> v, v in     mem(s_u, s_v) = 0 where v reads u's output unmoved and a node pays
      no region:                                             its storage (``paid``: one storage, paid once)

``kept_u`` (``checkpoint_outputs``) counts storages, not tensors: a checkpoint keeping
a view keeps its base.  An op of a region pays its outputs another region reads (that
region's checkpoint keeps them) or ops past its layer read, and those its own op kept
anyway (their readers' edges price no share for them); what the other ops of its layer
keep, their edges pay, moved (a copy) or not (their share).  A value a region reads
from outside is paid by the op that owns its storage, unless that op keeps it itself
anyway.  Every block then has the same tables, so the chained search still solves one
block and chains it.

The step's peak gains, during each region's backward, the activations it would have
kept (``cost.peak_memory``'s ``reborn_at``), less the region inputs its recomputation
reads as they are (the checkpoint's own storage); the outputs a checkpoint keeps die
with that checkpoint's backward (``checkpoint_release``).  ``recompute="full"``
recomputes every block, ``"selective"`` the selective regions of every block, ``"none"``
nothing but the blocks a ``"recompute"`` hint names; ``"auto"`` (the default) searches
the three under a cap and keeps the fastest plan (without a cap it never recomputes:
that only adds time).  Not searched yet: a choice per block.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from autopar.search import INF

from .problem import ProblemTables, read_only, seconds_to_ps
from .regions import block_regions

__all__ = ["RECOMPUTE_OPTIONS", "checkpoint_outputs", "checkpoint_release", "paid", "recomputed_tables"]

#: What ``recompute=`` accepts.
RECOMPUTE_OPTIONS = ("auto", "none", "selective", "full")


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
    for e, (_, v) in enumerate(tables.edge_keys):
        refs = tables.edge_refs[e]
        if v < len(graph.nodes) and v not in regions and all(paid(ctx, kept, (a, o)) for a, o, _, _ in refs):
            # a value a checkpoint keeps, read as it is by an op that would keep it too: one storage, paid on a node
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
    """Node -> its outputs whose storage its own term pays under ``regions`` (``kept_u``, module docstring).

    An op of a region pays its outputs another region or an op past its layer reads (the
    next layer's checkpoint or first ops keep them: every layer's terms alike, as the
    chained search needs), and those its own op kept without recomputation (their
    readers' edges price a share of 0 for them); what the other ops of its layer keep of
    them, their edges pay, moved (a copy) or not.
    A value a region reads from outside is paid on the op that owns its storage (a
    view's base: a checkpoint keeping a view keeps the base), unless that op keeps it
    itself anyway; the unmoved edges of the other readers then pay nothing for it
    (``paid``)."""
    graph, coster = ctx.graph, ctx.coster
    layer = block_regions(ctx)
    out: dict[int, set[int]] = {}
    consumers = graph.consumers()
    for u in graph.nodes:
        if u.kind == "param":
            continue
        home = regions.get(u.index)
        for o in range(len(u.outputs)):
            readers = {v for v, _, idx in consumers[u.index] if idx == o}
            if home is not None:
                others = {regions.get(v) for v in readers} - {home}
                beyond = any(layer.get(v) != layer.get(u.index) for v in readers)  # read past its layer
                if others - {None} or beyond or None in others and (u.index, o) in coster.saved_outputs:
                    out.setdefault(u.index, set()).add(o)
                continue  # else its layer's readers' edges pay what they keep (moved or not)
            if not any(v in regions for v in readers):
                continue
            root = coster.storage_root((u.index, o))
            if graph.nodes[root[0]].kind == "param" or root[0] in regions or root in coster.saved_outputs:
                continue  # a weight's view (model state), or paid by its own region or its own op already
            out.setdefault(root[0], set()).add(root[1])
    return {u: tuple(sorted(os)) for u, os in out.items()}


def paid(ctx, kept: dict[int, tuple[int, ...]], ref: tuple[int, int]) -> bool:
    """Whether the storage of ``ref`` (node, output) is paid by a node term of ``kept`` (``checkpoint_outputs``)."""
    for u, o in (ref, ctx.coster.storage_root(ref)):
        if o in kept.get(u, ()):
            return True
    return False


def checkpoint_release(ctx, regions: dict[int, str]) -> dict[int, int]:
    """Op of a recomputed block -> the op whose backward frees its outputs a checkpoint keeps: its first reader
    outside its block (backward reaches it last; the checkpoint holding them is released with it)."""
    out: dict[int, int] = {}
    for v in ctx.graph.nodes:
        for u, _ in v.inputs:
            home = regions.get(u)
            if home is not None and regions.get(v.index) != home and v.index < out.get(u, len(ctx.graph.nodes)):
                out[u] = v.index
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
