"""Block hints: which tensor dims pack several equal blocks (a fused qkv projection).

A ``split``/``chunk`` that cuts dim ``d`` into ``b`` equal pieces says its input
packs ``b`` blocks on ``d``.  The hint travels backwards to the op that made the
packed dim, through ops that carry the dim unchanged (view/reshape when the dim
and everything after it map 1:1, elementwise ops with right-aligned
broadcasting).  Rules that can shard that dim then also offer ``Shard(d, b)``,
which keeps whole heads of q, k and v on each rank.
"""

from __future__ import annotations

import math

import torch

from .graph import OpGraph

__all__ = ["block_hints"]

aten = torch.ops.aten

_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unsafe_split.Tensor}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _split_blocks(call) -> tuple[int, int] | None:
    """(dim, blocks) when a split cuts a dim into >= 2 equal pieces."""
    meta = call.inputs[0]
    if call.target is aten.chunk.default:
        dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    else:
        dim = call.args[2] if len(call.args) > 2 else call.kwargs.get("dim", 0)
    dim %= meta.ndim
    sizes = [o.shape[dim] for o in call.outputs]
    if len(sizes) >= 2 and len(set(sizes)) == 1 and sum(sizes) == meta.shape[dim]:
        return dim, len(sizes)
    return None


def _view_source_dim(in_shape: tuple[int, ...], out_shape: tuple[int, ...], d: int) -> int | None:
    """The input dim that output dim ``d`` is, when it and all later dims map 1:1."""
    tail = math.prod(out_shape[d:])
    for i in range(len(in_shape)):
        if in_shape[i] == out_shape[d] and math.prod(in_shape[i:]) == tail:
            return i
    return None


def block_hints(graph: OpGraph) -> dict[int, set[tuple[int, int, int]]]:
    """node index -> {(output index, dim, blocks)} for every node that packs blocks."""
    hints: dict[int, set[tuple[int, int, int]]] = {}
    work: list[tuple[int, int, int, int]] = []
    for node in graph.nodes:
        if node.kind == "op" and node.call.target in _SPLITS:
            found = _split_blocks(node.call)
            if found:
                src, idx = node.inputs[0]
                work.append((src, idx, *found))
    while work:
        n, o, d, b = work.pop()
        node = graph.nodes[n]
        key = (o, d, b)
        if key in hints.setdefault(n, set()):
            continue
        hints[n].add(key)
        if node.kind != "op" or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if node.call.target in _VIEWS:
            src_dim = _view_source_dim(node.call.inputs[0].shape, out.shape, d)
            if src_dim is not None:
                work.append((*node.inputs[0], src_dim, b))
            continue
        if _is_elementwise(node.call):
            for (src, idx), meta in zip(node.inputs, node.call.inputs):
                di = d - (out.ndim - meta.ndim)
                if di >= 0 and meta.shape[di] == out.shape[d]:
                    work.append((src, idx, di, b))
    return hints


def _is_elementwise(call) -> bool:
    """Every tensor input broadcasts to the single output's shape (pointwise-like)."""
    out = call.outputs[0]
    for meta in call.inputs:
        if meta.ndim > out.ndim:
            return False
        for a, o in zip(reversed(meta.shape), reversed(out.shape)):
            if a not in (1, o):
                return False
    return bool(call.inputs) and str(call.target).split(".")[1] in _POINTWISE_NAMES


_POINTWISE_NAMES = {
    "add",
    "sub",
    "mul",
    "div",
    "to",
    "_to_copy",
    "clone",
    "contiguous",
    "alias",
    "dropout",
    "gelu",
    "silu",
    "relu",
    "tanh",
    "sigmoid",
    "neg",
    "pow",
    "exp",
    "where",
}
