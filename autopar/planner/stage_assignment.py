"""Which pipeline stage runs what: the chain of layers a pipeline splits, and the stage of every op.

``chain_layers`` lists the layers (every module-list entry whose ops are convex, alike or not, in graph order);
``stage_of_nodes`` places every op of the captured graph on a stage of a ``PipelinePlan`` (the rule in its
docstring), the same map the planner prices (``stage_prices``) and the runtime cuts the program by
(``lower.split_program``, through ``compiled``).
"""

from __future__ import annotations

from autopar.capture import OpGraph, find_layers

from .plan_parts import PipelinePlan, StagePart
from .regions import convex_layers

__all__ = ["chain_layers", "chain_slots", "even_stages", "layer_span", "stage_of_nodes"]


def chain_layers(graph: OpGraph) -> list[tuple[str, tuple[int, ...]]]:
    """The layers a pipeline splits, in graph order: every module-list entry whose ops are convex
    (``capture.find_layers``), alike or not, as (name, op node indices), ordered by their first op."""
    layers = find_layers(graph)
    convex = convex_layers(graph, layers)
    return sorted(((name, ops) for name, ops in layers.items() if name in convex), key=lambda item: min(item[1]))


def even_stages(layer_count: int, stages: int) -> tuple[tuple[int, int], ...]:
    """``[first, stop)`` layer ranges of ``stages`` runs as equal as they go, the longer ones first."""
    base, extra = divmod(layer_count, stages)
    out, first = [], 0
    for j in range(stages):
        stop = first + base + (1 if j < extra else 0)
        out.append((first, stop))
        first = stop
    return tuple(out)


def stage_of_nodes(graph: OpGraph, pipeline: PipelinePlan) -> dict[str, int]:
    """Op node name -> the stage (position in ``pipeline.stages``) that runs it.

    A layer's ops run on the stage holding the layer.  Any other op runs on the latest stage among the ops it
    reads (the head after the last layer: the last stage); an op that reads no op of a stage (masks, positions,
    rotary tables made from the inputs alone) runs on the earliest stage among its readers, so it is made once
    and sent on, and an op read by none on the last stage.  Raises AssertionError when an op would read a value
    of a later stage (layers that are not a chain)."""
    layers = chain_layers(graph)
    stage_of_layer = {k: j for j, part in enumerate(pipeline.stages) for k in range(part.first_layer, part.stop_layer)}
    pinned = {i: stage_of_layer[k] for k, (_, ops) in enumerate(layers) for i in ops}
    stage: dict[int, int] = {}
    for node in graph.nodes:  # forward: the latest stage read
        if node.kind != "op":
            continue
        read = [stage[u] for u, _ in node.inputs if u in stage]
        if node.index in pinned:
            stage[node.index] = pinned[node.index]
        elif read:
            stage[node.index] = max(read)
    users: dict[int, list[int]] = {}
    for node in graph.nodes:
        for u, _ in node.inputs:
            users.setdefault(u, []).append(node.index)
    last = len(pipeline.stages) - 1
    for node in reversed(graph.nodes):  # backward: what reads no stage runs on its earliest reader's
        if node.kind == "op" and node.index not in stage:
            read_by = [stage[v] for v in users.get(node.index, ()) if v in stage]
            stage[node.index] = min(read_by) if read_by else last
    for node in graph.nodes:
        for u, _ in node.inputs:
            if u in stage and node.index in stage and stage[u] > stage[node.index]:
                raise AssertionError(
                    f"pipeline stages: op {node.name} (stage {stage[node.index]}) reads {graph.nodes[u].name} of a "
                    f"later stage {stage[u]}: the layers do not form a chain"
                )
    return {graph.nodes[i].name: j for i, j in stage.items()}


def chain_slots(graph: OpGraph, layers: list) -> tuple[dict[int, int], dict[int, int]]:
    """``(position, slot)`` of every op node (by index) in the chain of ``layers`` (``chain_layers(graph)``, ``n`` of
    them): ``position`` the stage ``stage_of_nodes`` runs it on where each layer is a stage of its own, ``slot`` where
    a split's stages count it (``stage_prices``): a layer's op, or one placed strictly inside the chain, at its
    position; any other at ``n`` (the prelude, on the first stage) or ``n + 1`` (the postlude, on the last)."""
    n = len(layers)
    one_each = PipelinePlan("", "gpipe", tuple(StagePart(k, k + 1) for k in range(n)))
    index = {node.name: node.index for node in graph.nodes}
    position = {index[name]: k for name, k in stage_of_nodes(graph, one_each).items()}
    in_layer = {i for _, ops in layers for i in ops}
    slot = {i: k if i in in_layer or 0 < k < n - 1 else (n if k == 0 else n + 1) for i, k in position.items()}
    return position, slot


def layer_span(names: list[str]) -> str:
    """``transformer.h.0-3`` for a run of one module list's entries, else the first and last name."""
    if not names:
        return ""
    prefix, _, first = names[0].rpartition(".")
    last_prefix, _, last = names[-1].rpartition(".")
    if len(names) == 1:
        return names[0]
    if prefix == last_prefix and first.isdigit() and last.isdigit():
        return f"{prefix}.{first}-{last}"
    return f"{names[0]} .. {names[-1]}"
