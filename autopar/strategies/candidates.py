"""Candidates: every node's strategies on the mesh (the CandidateGraph).

* op nodes: the op-family rule expanded to the n-D mesh (``strategies.expand_to_mesh``),
  with block hints (``blocks.block_hints``) so fused tensors can be split block-wise;
  an op without a rule gets the replicate fallback and is listed as such;
* parameters: every placement a consumer asks for, plus Replicate and a plain
  shard per axis (ZeRO/FSDP-style storage), each paired with a *state* placement
  (where gradients and optimizer state live): the parameter's own placement, or,
  on axes where the parameter is replicated, a shard (ZeRO-1/2).  Data
  parallelism, sharded parameters and tensor parallelism are all just these
  placements: nothing picks a family by name;
* user inputs and buffers: Replicate or a shard of any dim on each axis (a local
  slice of the global batch costs nothing).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from autopar.capture import OpCall, OpGraph, OpNode, block_hints
from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.spec import TensorMeta
from autopar.transitions import partial_on

from .base import (
    OpStrategy,
    every_rank_gets_an_element,
    expand_to_mesh,
    partial_grad_flags,
    partial_grad_suffix,
    rule_for,
    with_partial_grads,
)

__all__ = ["SourceStrategy", "CandidateGraph", "build_candidates"]


@dataclass(frozen=True, slots=True)
class SourceStrategy:
    """A parameter's, buffer's or input's placement, and where its grad + optimizer state live."""

    placement: tuple[Placement, ...]
    state: tuple[Placement, ...]
    partial_grad: tuple[bool, ...] = ()  # accumulate the uses' gradients as P(sum) on these axes, reduce once

    @property
    def outputs(self) -> tuple[tuple[Placement, ...], ...]:
        return (self.placement,)

    def output_grad(self, index: int = 0) -> tuple[Placement, ...]:
        """Where the uses' gradients are summed: the state placement, or ``P(sum)`` on the
        ``partial_grad`` axes (a parameter read by several ops: each use's partial gradient
        is added locally and the sum is reduced once, ``accumulated_grad``)."""
        return partial_on(self.state, self.partial_grad)

    @property
    def accumulated_grad(self) -> tuple[tuple[Placement, ...], tuple[Placement, ...]] | None:
        """(from, to) of the one gradient move after all uses are summed; None when none is needed."""
        acc = self.output_grad()
        return (acc, self.state) if acc != self.state else None

    def label(self) -> str:
        p = "(" + ",".join(map(str, self.placement)) + ")"
        p = p if self.state == self.placement else f"{p} state=(" + ",".join(map(str, self.state)) + ")"
        return p + partial_grad_suffix(self.partial_grad)


@dataclass(frozen=True)
class CandidateGraph:
    """The OpGraph with a list of strategies per node (``strategies[i]``)."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    strategies: list[list]  # OpStrategy for ops, SourceStrategy for sources


def build_candidates(graph: OpGraph, mesh_shape: tuple[int, ...]) -> CandidateGraph:
    """Enumerate strategies for every node (ops first, then sources, which read their consumers)."""
    constant, op_keys = graph.derived("candidate keys", lambda: _op_keys(graph))
    strategies: list[list] = [[] for _ in graph.nodes]
    cache: dict[str, list[OpStrategy]] = {}
    for index, call, key in op_keys:
        if key not in cache:
            options = expand_to_mesh(call, mesh_shape, rule_for(call.target))
            if index in constant:
                options = [s for s in options if _all_replicated(s)] or options[-1:]
            elif graph.nodes[index].requires_grad:
                options = with_partial_grads(options, mesh_shape)
            cache[key] = options
        strategies[index] = cache[key]
    consumers = graph.derived("consumers", graph.consumers)
    sources: dict[tuple, list[SourceStrategy]] = {}  # equal sources share one list (a layer's weights)
    for node in graph.nodes:
        if node.kind == "op":
            continue
        if node.index in constant:
            full = tuple(Replicate() for _ in mesh_shape)
            strategies[node.index] = [SourceStrategy(full, full)]
            continue
        # sources are never stored Partial: a consumer reading P gets it from R for free
        wanted = {s.inputs[pos] for c, pos, _ in consumers[node.index] for s in strategies[c]}
        wanted = frozenset(w for w in wanted if not any(isinstance(p, Partial) for p in w))
        uses = len(consumers[node.index]) if node.kind == "param" else 0
        key = (node.kind, node.outputs, wanted, uses > 1)
        if key not in sources:
            sources[key] = _source_strategies(node, set(wanted), mesh_shape)
            if uses > 1:  # several uses: their gradients may be summed as partials and reduced once
                sources[key] = _with_accumulation(sources[key], mesh_shape)
        strategies[node.index] = sources[key]
    return CandidateGraph(graph, mesh_shape, strategies)


def _op_keys(graph: OpGraph) -> tuple[set[int], list[tuple[int, OpCall, str]]]:
    """The graph's constant nodes, and per op ``(index, call with its block hints, key)``: ops with equal keys
    (a layer's ops in every layer) take one strategy list.  The graph's alone, so made once per graph
    (``OpGraph.derived``) for every mesh it is planned on."""
    hints = block_hints(graph)
    constant = constant_nodes(graph)
    keys = []
    for node in graph.nodes:
        if node.kind != "op":
            continue
        call = replace(node.call, block_hints=frozenset(hints.get(node.index, ())))
        key = repr(
            (
                call.target,
                call.args,
                call.kwargs,
                call.inputs,
                call.outputs,
                sorted(call.block_hints),
                node.index in constant,
                node.requires_grad,
            )
        )
        keys.append((node.index, call, key))
    return constant, keys


def constant_nodes(graph: OpGraph) -> set[int]:
    """Nodes that depend on no user input and no parameter (buffers, arange, masks built from them).

    They are the same every step (a compiler would fold them), so they are kept
    replicated: their consumers take any piece of a replicated value for free, so
    nothing is lost in communication, and the search does not carry them, which
    matters because they are read by every layer (rotary tables, causal masks).
    """
    out: set[int] = set()
    for node in graph.nodes:
        if node.kind == "buffer" or (node.kind == "op" and all(src in out for src, _ in node.inputs)):
            out.add(node.index)
    return out


def _all_replicated(s: OpStrategy) -> bool:
    return all(isinstance(p, Replicate) for pl in s.inputs + s.outputs for p in pl)


def _plain_shard_options(meta: TensorMeta, axis_size: int) -> list[Placement]:
    return [Shard(d) for d, size in enumerate(meta.shape) if size >= axis_size]


def _zero_dim(meta: TensorMeta, axis_size: int, placement: tuple[Placement, ...], axis: int) -> int | None:
    """The dim a ZeRO-style state shard uses on replicated mesh ``axis``: the largest dim not sharded yet.

    Failing that, a dim the placement already shards plainly, but only on axes before
    ``axis``: the state shard then splits each piece further, so this rank's state is a
    range of its piece (what the runtime's ZeRO needs to alias the optimizer's shard into
    the parameter); split on an earlier axis it would not be.
    """
    used = {p.dim for p in placement if isinstance(p, Shard)}
    dims = sorted(
        (d for d, s in enumerate(meta.shape) if s >= axis_size and d not in used), key=lambda d: -meta.shape[d]
    )
    if not dims:
        dims = [
            d
            for d, s in enumerate(meta.shape)
            if s >= axis_size
            and all(
                not (isinstance(p, Shard) and p.dim == d and (p.blocks > 1 or a > axis))
                for a, p in enumerate(placement)
            )
        ]
    return dims[0] if dims else None


def _source_strategies(node: OpNode, wanted: set, mesh_shape: tuple[int, ...]) -> list[SourceStrategy]:
    meta = node.outputs[0]
    per_axis = []
    for axis, size in enumerate(mesh_shape):
        opts: list[Placement] = [Replicate()]
        if size > 1:
            opts += _plain_shard_options(meta, size)
            opts += [w[axis] for w in wanted if isinstance(w[axis], Shard) and w[axis] not in opts]
        per_axis.append(opts)
    placements = set(itertools.product(*per_axis)) if node.kind != "param" else None
    if node.kind == "param":
        # the placements consumers read, R everywhere, and each wanted placement with
        # one more axis sharded for storage (FSDP on top of TP) or fewer (gathered use)
        placements = {tuple(Replicate() for _ in mesh_shape)} | {w for w in wanted if _fits(meta, w, mesh_shape)}
        for base in list(placements):
            for axis, size in enumerate(mesh_shape):
                if size > 1 and isinstance(base[axis], Replicate):
                    # storage: a gather from any nesting the runtime can run (unrunnable moves price as inf)
                    d = _zero_dim(meta, size, base, len(mesh_shape))
                    if d is not None:
                        cand = base[:axis] + (Shard(d),) + base[axis + 1 :]
                        if _fits(meta, cand, mesh_shape):
                            placements.add(cand)
    out = []
    for pl in sorted(placements, key=_order_key):
        if not _fits(meta, pl, mesh_shape):
            continue
        out.append(SourceStrategy(pl, pl))
        if node.kind == "param":
            out.extend(SourceStrategy(pl, st) for st in _state_options(meta, pl, mesh_shape) if st != pl)
    return out


def _with_accumulation(options: list[SourceStrategy], mesh_shape: tuple[int, ...]) -> list[SourceStrategy]:
    """``options`` and, for each, the variants summing the uses' gradients as ``P(sum)`` on a
    non-empty subset of the axes (of more than one rank) before one reduction to the state.

    The summed gradient is the gradient of the stored piece, so it must have its
    shape: only axes where the parameter is stored replicated qualify (a parameter
    stored sharded on an axis, FSDP, is gathered per use, and each use's gradient is
    reduced back to the stored piece on that edge), and every axis where the state
    is sharded beyond the parameter (ZeRO) must be among them (the sum is ``P(sum)``
    there; on an axis left out it would take the state's shard, smaller than the
    piece it is the gradient of).
    """
    out = list(options)
    for s in options:
        axes = [a for a, size in enumerate(mesh_shape) if size > 1 and isinstance(s.placement[a], Replicate)]
        zero = {a for a, (p, st) in enumerate(zip(s.placement, s.state)) if p != st}
        for flags in partial_grad_flags(axes, len(mesh_shape)):
            if all(flags[a] for a in zero):
                out.append(replace(s, partial_grad=flags))
    return out


def _state_options(meta: TensorMeta, pl: tuple[Placement, ...], mesh_shape: tuple[int, ...]):
    """State placements: the parameter's own, or additionally sharded on replicated axes."""
    per_axis = []
    for axis, (p, size) in enumerate(zip(pl, mesh_shape)):
        opts = [p]
        if isinstance(p, Replicate) and size > 1:
            d = _zero_dim(meta, size, pl, axis)
            if d is not None:
                opts.append(Shard(d))
        per_axis.append(opts)
    for st in itertools.product(*per_axis):
        if _fits(meta, st, mesh_shape):
            yield st


def _fits(meta: TensorMeta, pl: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Every sharded dim still gives each rank at least one element per block."""
    shape = list(meta.shape)
    for p, size in zip(pl, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(shape) or shape[p.dim] % p.blocks or shape[p.dim] // p.blocks < size:
                return False
            shape[p.dim] = -(-(shape[p.dim] // p.blocks) // size) * p.blocks
    return every_rank_gets_an_element(meta.shape, pl, mesh_shape)  # the smaller pieces of nested uneven splits


def _order_key(pl: tuple[Placement, ...]) -> tuple:
    return tuple(
        (0, 0, 0) if isinstance(p, Replicate) else (1, p.dim, p.blocks) if isinstance(p, Shard) else (2, 0, 0)
        for p in pl
    )
