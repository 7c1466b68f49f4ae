"""Plan families: data parallel, sharded parameters, tensor parallel, as restrictions of the one search space.

* ``data parallel``: every parameter replicated, its gradient and optimizer state too, and the batch split
  over the whole mesh where it divides (``batch_split_inputs``: a model too small to gain from splitting would
  otherwise come back fully replicated, which no one asking for data parallelism means);
* ``sharded parameters``: every parameter that can be is stored sharded and read
  whole by its consumers, so it is all-gathered before use and its gradient
  reduce-scattered (ZeRO-3/FSDP);
* ``tensor parallel``: every weight matrix that its ops can read sharded stored
  sharded and read in that placement (never all-gathered), state kept with it;
  vectors (biases, norm weights) and matrices only a replicated op reads (a
  convolution) may stay replicated, as in Megatron.

Families are restrictions of the one search space, not rules that build plans:
``family_restriction`` gives the (node, edge) predicates that confine the search to
one, and the planner solves the same problem under each (``plan(family=...)`` forces
one; the report compares them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.placement import Replicate, Shard

from .schema import FAMILIES

if TYPE_CHECKING:  # a type only: the context module the driver uses
    from .context import PlanningContext

__all__ = ["batch_size", "batch_split_inputs", "family_restriction", "is_sharded", "param_nodes"]


def param_nodes(ctx: PlanningContext) -> set[int]:
    return {n.index for n in ctx.graph.nodes if n.kind == "param"}


def is_sharded(placement) -> bool:
    return any(isinstance(p, Shard) for p in placement)


def batch_size(graph) -> int | None:
    """Dim 0 of the graph's tensor inputs (the most common one when they differ); None without inputs."""
    sizes = [n.outputs[0].shape[0] for n in graph.nodes if n.kind == "input" and n.outputs and n.outputs[0].ndim]
    return max(set(sizes), key=sizes.count) if sizes else None


def batch_split_inputs(ctx: PlanningContext) -> dict[int, tuple]:
    """Input node -> its placement split on dim 0 over every mesh axis, for the inputs whose dim 0 is the batch
    (``batch_size``), when the batch divides over the whole mesh and the node has that placement among its
    candidates; empty otherwise (a batch of 1 on 2 devices stays as it is: no data parallelism to force)."""
    batch = batch_size(ctx.graph)
    if batch is None or batch % math.prod(ctx.mesh.shape):
        return {}
    split = tuple(Shard(0) for _ in ctx.mesh.shape)
    return {
        n.index: split
        for n in ctx.graph.nodes
        if n.kind == "input"
        and n.outputs
        and n.outputs[0].ndim
        and n.outputs[0].shape[0] == batch
        and any(st.placement == split for st in ctx.cand.strategies[n.index])
    }


def _read_sharded(ctx: PlanningContext, param: int, consumers: dict[int, list[tuple[int, int, int]]]) -> bool:
    """Whether some sharded placement of ``param`` is one every op using it can read as it is (no move).

    The tensor-parallel family shards exactly those matrices: a weight only a
    replicated op reads (a convolution without a rule, ViT's patch embedding) stays
    whole, as Megatron leaves such layers.
    """
    strategies = ctx.cand.strategies
    uses = [(v, pos) for v, pos, _ in consumers[param]]
    for placement in {st.placement for st in strategies[param] if is_sharded(st.placement)}:
        if uses and all(any(st.inputs[pos] == placement for st in strategies[v]) for v, pos in uses):
            return True
    return False


def family_restriction(ctx: PlanningContext, family: str):
    """(allow_node, allow_edge) that confine the search to one family."""
    params = param_nodes(ctx)
    strategies = ctx.cand.strategies
    full = tuple(Replicate() for _ in ctx.mesh.shape)

    def reads_param_whole(v: int, b: int) -> bool:
        node = ctx.graph.nodes[v]
        return all(strategies[v][b].inputs[pos] == full for pos, (u, _) in enumerate(node.inputs) if u in params)

    if family == "data parallel":
        batch_split = batch_split_inputs(ctx)

        def allow_node(i: int, s: int) -> bool:
            st = strategies[i][s]
            if i in params:
                return st.placement == full and st.state == full
            return i not in batch_split or st.placement == batch_split[i]

        return allow_node, None
    if family == "sharded parameters":
        shardable = {i for i in params if any(is_sharded(st.placement) for st in strategies[i])}

        def allow_node(i: int, s: int) -> bool:
            if i in shardable:
                return is_sharded(strategies[i][s].placement)
            if i in params or ctx.graph.nodes[i].kind != "op":
                return True
            return reads_param_whole(i, s)

        return allow_node, None
    if family == "tensor parallel":
        consumers = ctx.graph.consumers()
        matrices = {i for i in params if ctx.graph.nodes[i].outputs[0].ndim >= 2 and _read_sharded(ctx, i, consumers)}

        def allow_node(i: int, s: int) -> bool:
            if i in params:
                st = strategies[i][s]
                return st.state == st.placement and (i not in matrices or is_sharded(st.placement))
            return True

        def allow_edge(u: int, a: int, v: int, b: int) -> bool:
            if u not in params or v >= len(ctx.graph.nodes):
                return True
            src = strategies[u][a].placement
            node = ctx.graph.nodes[v]
            return all(strategies[v][b].inputs[pos] == src for pos, (w, _) in enumerate(node.inputs) if w == u)

        return allow_node, allow_edge
    raise ValueError(f"family {family!r}: expected one of {FAMILIES}")
