"""Repeated blocks of an OpGraph: the layers of a model, found by their structure.

A model's layers live in a module list, so their nodes carry a module path with an
integer component (``model.layers.7.mlp.up_proj``; parameters and buffers by their
FQN).  :func:`find_blocks` groups the nodes by the outermost such index under the most
repeated prefix, canonicalizes each group (:func:`block_signature`) and returns the
longest run of consecutive groups with equal signatures.  Equal signatures mean same
ops with the same arguments and shapes, same parameter shapes, the same internal edges
by relative position, and edges to the outside by kind: from the previous group (by
position there) or from a node outside every group (by its kind and shape).

No model names are involved; a model without a module list (or whose groups differ)
has no blocks and is planned flat.  The search checks the cost tables of the blocks
before it relies on them (``search.chain``), so a signature is a proposal, not a proof.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass

from .graph import OpGraph, OpNode

__all__ = ["Blocks", "block_signature", "find_blocks", "find_layers"]

log = logging.getLogger(__name__)

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True, slots=True)
class Blocks:
    """Repeated blocks in chain order: ``nodes[i][j]`` is node j (graph order) of block i.

    ``prefix``/``indices``: the module list and the list indices the blocks come from."""

    prefix: str
    indices: tuple[int, ...]
    nodes: tuple[tuple[int, ...], ...]

    @property
    def count(self) -> int:
        return len(self.nodes)


def _path(node: OpNode) -> str:
    return (node.fqn or "") if node.kind in ("param", "buffer") else node.module


def _list_index(path: str) -> tuple[str, int] | None:
    """(prefix, index) of the outermost integer component of a dotted path."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part) and i > 0:
            return ".".join(parts[:i]), int(part)
    return None


def _groups(graph: OpGraph) -> tuple[str, dict[int, list[int]]]:
    by_prefix: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for node in graph.nodes:
        found = _list_index(_path(node))
        if found is not None:
            by_prefix[found[0]][found[1]].append(node.index)
    if not by_prefix:
        return "", {}
    prefix = max(by_prefix, key=lambda p: (len(by_prefix[p]), sum(map(len, by_prefix[p].values()))))
    return prefix, dict(by_prefix[prefix])


def block_signature(
    graph: OpGraph, members: list[int], previous: list[int] | None, ops: dict[int, tuple | None] | None = None
) -> tuple:
    """A hashable canonical form of one group (see the module docstring).

    ``ops``, when given, caches each node's op form (node index -> form) across calls.
    """
    ops = {} if ops is None else ops
    rel = {v: r for r, v in enumerate(members)}
    prev = {v: r for r, v in enumerate(previous or [])}
    items = []
    for v in members:
        node = graph.nodes[v]
        ins = []
        for u, o in node.inputs:
            if u in rel:
                ins.append(("in", rel[u], o))
            elif u in prev:
                ins.append(("prev", prev[u], o))
            else:
                src = graph.nodes[u]
                ins.append(("ext", src.kind, src.outputs[o], o))
        if v not in ops:
            call = node.call
            ops[v] = None if call is None else (str(call.target), repr(call.args), repr(sorted(call.kwargs.items())))
        items.append((node.kind, ops[v], node.outputs, node.requires_grad, tuple(ins)))
    return tuple(items)


def find_blocks(graph: OpGraph, *, min_count: int = 3) -> Blocks | None:
    """The longest run of at least ``min_count`` consecutive equal groups, or None."""
    prefix, groups = _groups(graph)
    if len(groups) < min_count:
        return None
    order = sorted(groups)
    ops: dict[int, tuple | None] = {}  # each node's op form, shared by both signatures
    loose = [block_signature(graph, groups[i], None, ops) for i in order]  # outside inputs by kind only
    full = [block_signature(graph, groups[i], groups[order[n - 1]] if n else None, ops) for n, i in enumerate(order)]
    best, start = (0, 0), 0  # (start, length) of the longest run
    for n in range(1, len(order) + 1):
        same = (
            n < len(order)
            and order[n] == order[n - 1] + 1
            and loose[n] == loose[n - 1]
            and (n - start < 2 or full[n] == full[n - 1])
        )
        if not same:
            if n - start > best[1]:
                best = (start, n - start)
            start = n
    first, length = best
    if length < min_count:
        log.info("repeat: %d groups under %s but no %d consecutive equal ones", len(order), prefix, min_count)
        return None
    sizes = {len(groups[order[n]]) for n in range(first, first + length)}
    if len(sizes) != 1:
        return None
    chosen = order[first : first + length]
    log.info("repeat: %d blocks of %d nodes under %s", length, sizes.pop(), prefix)
    return Blocks(prefix, tuple(chosen), tuple(tuple(groups[i]) for i in chosen))


def find_layers(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """The layers of every module list, alike or not: ``prefix.index`` -> the op nodes (graph order) whose module
    path has that entry as its outermost integer component, for each prefix with at least two entries (T5's
    ``encoder.block.0`` carries the relative-attention bias its siblings lack; both stacks are listed).  What a
    user of ``torch.utils.checkpoint`` would wrap: one call per entry.  Whether an entry's ops are convex is the
    caller's to check (``planner.regions``)."""
    by_prefix: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for node in graph.nodes:
        found = _list_index(node.module) if node.kind == "op" else None
        if found is not None:
            by_prefix[found[0]][found[1]].append(node.index)
    return {
        f"{prefix}.{index}": tuple(ops)
        for prefix, entries in by_prefix.items()
        if len(entries) >= 2
        for index, ops in sorted(entries.items())
    }
