"""Which ops a recomputation covers: whole repeated blocks, or selectively the cheap, memory-heavy runs in them.

A *region* is a set of op nodes recomputed together (one checkpoint in the lowered
program, ``lower/recompute.py``); the planner maps each op node to its region's name.

* ``block_regions``: every op of a repeated block (``capture.find_blocks``: a model's
  layers), one region per block, named after the block (``model.layers.3``).  A model
  whose layers are not alike (T5's first block carries the relative-attention bias; two
  layers per stack leave no run of alike ones) has its module lists' entries instead
  (``capture.find_layers``), each a region where its ops are convex: what a user of
  ``torch.utils.checkpoint`` wraps.  The search then prices them flat (no chain).
* ``layer_regions``: every layer, alike or not (the repeated blocks and the module list entries
  beside them): what one recompute mode for every layer covers; each layer choosing its own
  (the chained search) covers the repeated blocks.
* ``selective_regions``: inside each block, the maximal runs of consecutive ops (in
  graph order, so each run is convex) that read no weight, directly or through a view
  of one.  Weight-reading ops (projections, the weight multiply of a norm) are where a
  block's FLOPs are, so what remains is what Megatron's selective recomputation
  (Korthikanti et al., 2022) redoes: the attention core (scores, softmax, dropout and
  the score-weighted sum, or one fused attention op), the pointwise activations, the
  residual adds and dropouts.  A run becomes a region only when it pays at the
  captured shapes: the bytes its ops keep that die with the checkpoint (their own
  tensors, and the storages made inside the run that no op outside it keeps) exceed
  the bytes the checkpoint newly keeps (its inputs' storages that no op kept already).
  A run of views, a lone GELU that keeps only its input, or a dropout whose mask is
  smaller than the input the checkpoint would keep stays saved.  Regions are named
  after the modules their ops share (``model.layers.3.mlp.act``; ``#2`` ... when a
  name repeats).
* ``rest_regions``: the rest of the graph at block granularity: the ops before the
  first op of the repeated blocks (embeddings, masks, rotary tables) and the ops after
  the last (final norm, head, loss), each part one region where it pays as a selective
  run must (``_pays``), named ``before <blocks>`` / ``after <blocks>`` (``after
  transformer.h``).  Both are convex: nothing before the blocks reads what the blocks
  make, and nothing after them feeds the head.  Ops between the blocks that belong to
  none stay saved.  The planner's ``"auto"`` offers only the part before the blocks:
  backward starts with the part after them, so what it saves is made again at once,
  as the step's peak comes (``cost.peak``: at the start of backward everything saved is
  alive), and recomputing it never lowers the peak, only adds the forward again (and
  the parameters its recomputation gathers).  The part before stays recomputed
  through all of backward until its own, at the end.
* ``hinted_regions``: the blocks a ``"recompute"`` hint names.
"""

from __future__ import annotations

import fnmatch
import os

from autopar.capture import find_blocks, find_layers

from .hints import module_matches

__all__ = ["block_regions", "convex_layers", "hinted_regions", "layer_regions", "rest_regions", "selective_regions"]


def block_regions(ctx) -> dict[int, str]:
    """Op node index -> the name of its repeated block (``prefix.index``), for every op of every block; with no
    repeated blocks, ``layer_regions``."""
    graph = ctx.graph
    blocks = ctx.blocks or find_blocks(graph, min_count=2)  # two layers are enough to recompute one
    if blocks is None:  # layers that are not alike
        return layer_regions(ctx)
    return {
        i: f"{blocks.prefix}.{blocks.indices[b]}"
        for b, nodes in enumerate(blocks.nodes)
        for i in nodes
        if graph.nodes[i].kind == "op"
    }


def layer_regions(ctx) -> dict[int, str]:
    """Op node index -> its layer (``prefix.index``), for every entry of every module list whose ops are convex
    (``capture.find_layers``), alike or not: the repeated blocks' ops (named as ``block_regions`` names them), and
    the layers beside them (T5's first block, the other stack).  What one mode for every layer recomputes."""
    layers = find_layers(ctx.graph)
    convex = convex_layers(ctx.graph, layers)
    return {i: name for name, ops in layers.items() if name in convex for i in ops}


def convex_layers(graph, layers: dict[str, tuple[int, ...]]) -> set[str]:
    """The layers through which no path leaves and comes back (``lower.recompute`` checkpoints a region as one
    call, so nothing outside it may both read a value it makes and feed a later op of it).  One sweep in graph
    order (topological): ``after[v]``, the layers some path into v (or v itself) comes from, as a bitset; a layer
    is not convex when one of its ops reads a node outside it that comes after it."""
    bit = {name: k for k, name in enumerate(layers)}
    home = {i: bit[name] for name, ops in layers.items() for i in ops}
    after: dict[int, int] = {}
    broken = 0
    for node in graph.nodes:
        mine, acc = home.get(node.index), 0
        for u, _ in node.inputs:
            from_u = after.get(u, 0)
            if mine is not None and home.get(u) != mine and from_u >> mine & 1:
                broken |= 1 << mine
            acc |= from_u
        after[node.index] = acc | (1 << mine if mine is not None else 0)
    return {name for name, k in bit.items() if not broken >> k & 1}


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


def selective_regions(ctx, blocks: dict[int, str]) -> dict[int, str]:
    """Op node -> selective region, over the blocks of ``blocks`` (``block_regions``' map; see the module docstring)."""
    graph, coster = ctx.graph, ctx.coster
    weights = _weight_values(graph)
    by_block: dict[str, list[int]] = {}
    for i in sorted(blocks):
        by_block.setdefault(blocks[i], []).append(i)
    keepers = _keepers(ctx)
    out: dict[int, str] = {}
    for block, ops in by_block.items():
        names: dict[str, int] = {}
        for run in _weightless_runs(graph, ops, weights):
            if _pays(graph, coster, run, keepers):
                name = _region_name(graph, block, run)
                names[name] = names.get(name, 0) + 1
                out.update((i, name if names[name] == 1 else f"{name}#{names[name]}") for i in run)
    return out


def rest_regions(ctx, blocks: dict[int, str], parts: tuple[str, ...] = ("before", "after")) -> list[dict[int, str]]:
    """The parts of the graph outside ``blocks`` (``block_regions``' map) recomputing which pays: the ops before
    the first op of the blocks, and those after the last, each an op node -> region map (module docstring);
    ``parts``: which of the two to consider."""
    if not blocks:
        return []
    graph = ctx.graph
    first, last = min(blocks), max(blocks)
    prefix = blocks[first].rsplit(".", 1)[0]
    ops = [n.index for n in graph.nodes if n.kind == "op" and n.index not in blocks]
    keepers = _keepers(ctx)
    sides = (([i for i in ops if i < first], "before"), ([i for i in ops if i > last], "after"))
    return [
        dict.fromkeys(part, f"{where} {prefix}")
        for part, where in sides
        if where in parts and part and _pays(graph, ctx.coster, part, keepers)
    ]


def _weight_values(graph) -> set[int]:
    """Nodes whose values are weights: parameters, and ops all of whose inputs are weights (their views, casts)."""
    out = {n.index for n in graph.nodes if n.kind == "param"}
    for n in graph.nodes:
        if n.kind == "op" and n.inputs and all(u in out for u, _ in n.inputs):
            out.add(n.index)
    return out


def _weightless_runs(graph, ops: list[int], weights: set[int]) -> list[list[int]]:
    """Maximal runs of consecutive ``ops`` (graph order) that read no weight."""
    runs: list[list[int]] = [[]]
    for i in ops:
        if i in weights or any(u in weights for u, _ in graph.nodes[i].inputs):
            runs.append([])
        else:
            runs[-1].append(i)
    return [r for r in runs if r]


def _keepers(ctx) -> dict[tuple[int, int], set[int]]:
    """Storage root -> the ops that keep it (or a view of it) for backward."""
    graph, coster = ctx.graph, ctx.coster
    out: dict[tuple[int, int], set[int]] = {}
    for v in graph.nodes:
        kept = coster.kept_by(v)
        refs = [v.inputs[pos] for pos in kept.inputs] + [(v.index, o) for o in kept.outputs]
        for ref in refs:
            out.setdefault(coster.storage_root(ref), set()).add(v.index)
    return out


def _pays(graph, coster, run: list[int], keepers: dict) -> bool:
    """Whether recomputing ``run`` frees more bytes (at the captured shapes) than its checkpoint newly keeps."""
    inside = set(run)

    def nbytes(ref) -> int:
        meta = graph.nodes[ref[0]].outputs[ref[1]]
        return meta.numel * meta.dtype.itemsize

    freed = sum(coster.kept_by(graph.nodes[i]).internal_bytes for i in run)
    freed += sum(  # the roots the run makes whose every keeper is in it
        nbytes(root)
        for i in inside
        if graph.nodes[i].kind != "param"
        for root in ((i, o) for o in range(len(graph.nodes[i].outputs)))
        if (ops := keepers.get(root)) and not ops - inside
    )
    roots_in = {
        coster.storage_root(ref)
        for i in run
        for ref in graph.nodes[i].inputs
        if ref[0] not in inside and graph.nodes[ref[0]].kind != "param"
    }
    newly_kept = sum(nbytes(r) for r in roots_in if r[0] not in inside and not keepers.get(r))
    return freed > newly_kept


def _region_name(graph, block: str, run: list[int]) -> str:
    """The deepest module path the run's ops share (at least the block's own)."""
    modules = [graph.nodes[i].module or "" for i in run]
    common = os.path.commonprefix([m + "." for m in modules])
    path = common[: common.rfind(".")] if "." in common else ""
    return path if len(path) > len(block) and path.startswith(block) else block
