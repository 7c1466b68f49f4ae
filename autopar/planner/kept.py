"""Who pays for the storages a recomputation keeps: the accounting the recomputed tables and the plan's peak share.

Recomputing a region (``regions.py``) drops what its ops keep for backward and keeps,
in its checkpoint, the region's inputs instead.  Each storage must be paid once, and
the terms of one repeated layer must depend on that layer's own choice only, so that
the search may choose per layer (the chained search joins layers whose tables do not
look at their neighbours').  The rule is *the reader pays*:

* a storage its own op keeps (``Coster.saved_outputs``: softmax's output, say) is paid
  by that op, recomputed or not (``own``: a recomputed op still pays its outputs read
  outside its region);
* a storage a region's checkpoint keeps is paid by that region, on the first of its
  input edges that reads it (or a view of it: ``payers``);
* a storage a non-recomputed op keeps is paid on that op's input edge, as without
  recomputation (a share, or the copy when the edge moves);
* a value made outside the repeated layers and read by two or more of them (rotary
  tables, masks: ``shared``) is paid once by its own node, whoever keeps it, and
  unmoved edges reading it pay nothing.

Two regions keeping one storage, or a region and an op of another layer, both pay: an
over-count by one tensor where a value feeds two regions, which the layers' structure
makes rare (a layer's input feeds the next layer's checkpoint and its first norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from .regions import layer_regions

__all__ = ["Keeping", "keeping"]


@dataclass(frozen=True)
class Keeping:
    """The accounting of one region assignment (the module docstring).

    ``own``: region op -> its outputs it still pays (kept by its own op, read outside its
    region); ``payers``: (op, input position) -> the storage root that input edge pays
    for its region's checkpoint; ``shared``: the roots paid by their own node;
    ``first``: region -> its first op (backward ends the region there: the checkpoint's
    inputs are freed); ``release``: region op -> the op whose backward frees its ``own``
    outputs (their first reader outside the region).
    """

    own: dict[int, tuple[int, ...]]
    payers: dict[tuple[int, int], tuple[int, int]]
    shared: frozenset
    first: dict[str, int]
    release: dict[int, int]


def keeping(ctx, regions: dict[int, str]) -> Keeping:
    """The ``Keeping`` of ``regions`` (op node -> region name)."""
    graph, coster = ctx.graph, ctx.coster
    layer = layer_regions(ctx)
    consumers = graph.consumers()
    own: dict[int, tuple[int, ...]] = {}
    release: dict[int, int] = {}
    for i, home in regions.items():
        outs = []
        for o in range(len(graph.nodes[i].outputs)):
            outside = [v for v, _, idx in consumers[i] if idx == o and regions.get(v) != home]
            if outside and (i, o) in coster.saved_outputs:
                outs.append(o)
                release[i] = min(outside + [release.get(i, len(graph.nodes))])
        if outs:
            own[i] = tuple(outs)
    shared = _shared_roots(ctx, layer)
    payers: dict[tuple[int, int], tuple[int, int]] = {}
    taken: set[tuple[str, tuple[int, int]]] = set()
    first: dict[str, int] = {}
    for v in sorted(regions):
        region = regions[v]
        first.setdefault(region, v)
        for pos, (u, o) in enumerate(graph.nodes[v].inputs):
            root = coster.storage_root((u, o))
            if regions.get(u) == region or graph.nodes[root[0]].kind == "param" or root in shared:
                continue
            if root in coster.saved_outputs or (region, root) in taken:
                continue  # its own op pays it; or this region pays it on an earlier edge
            taken.add((region, root))
            payers[(v, pos)] = root
    return Keeping(own, payers, frozenset(shared), first, release)


def _shared_roots(ctx, layer: dict[int, str]) -> set[tuple[int, int]]:
    """Roots made outside the layers that ops of two or more layers read (through views)."""
    graph, coster = ctx.graph, ctx.coster
    readers: dict[tuple[int, int], set[str]] = {}
    for v in graph.nodes:
        if v.index not in layer:
            continue
        for u, o in v.inputs:
            root = coster.storage_root((u, o))
            if root[0] not in layer and graph.nodes[root[0]].kind != "param":
                readers.setdefault(root, set()).add(layer[v.index])
    return {r for r, layers in readers.items() if len(layers) >= 2}
