"""Transitions: the collective that turns one placement into another on one mesh axis.

Forward, on one axis (``src -> dst``):

=================  ==============================  ===========================
src -> dst         collective                      backward (the conjugate)
=================  ==============================  ===========================
same               none                            none
R -> S(d)          local slice (free)              all_gather
R -> P             local (rank 0 keeps, free)      none
S(d) -> R          all_gather                      reduce_scatter / slice
S(d) -> S(d')      all_to_all                      all_to_all
S -> P             all_gather, then as R -> P      as S -> R
P -> R             all_reduce (sum or max)         none (Megatron's g)
P -> S(d)          reduce_scatter                  all_gather
=================  ==============================  ===========================

Gradients are derived, not tabulated: on each edge the consumer hands back a
gradient whose placement follows from how it used its input
(``consumer_grad_placement``: a replicated input to a computation the axis splits
gets a ``P(sum)`` gradient — Megatron's f, and the data-parallel weight-gradient
all-reduce), and the producer needs its gradient in the placement of its output
(``producer_grad_placement``; for a parameter: where its gradient lives).  The
backward collective is the transition between the two.  So a forward all-gather
costs a reduce-scatter in backward, and data parallelism's all-reduce of weight
gradients falls out of the same table.

Bytes follow ``costmodel.comm``: the full buffer of an all-reduce, the gathered
size of an all-gather or reduce-scatter, each rank's buffer for all-to-all; all
computed on the tensor's local size under its placements on the *other* axes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .placement import Partial, Placement, Replicate, Shard
from .spec import TensorMeta, local_shape

__all__ = [
    "AxisTransition",
    "axis_transition",
    "transitions",
    "consumer_grad_placement",
    "producer_grad_placement",
]


@dataclass(frozen=True, slots=True)
class AxisTransition:
    """One collective on one axis. ``kind`` is None for free local conversions."""

    axis: int
    kind: str | None
    bytes: int
    reduce_op: str = "sum"
    src: Placement = Replicate()
    dst: Placement = Replicate()


def axis_transition(src: Placement, dst: Placement) -> tuple[str | None, str]:
    """The collective (or None) for ``src -> dst`` on one axis, and its reduce op."""
    if src == dst:
        return None, "sum"
    if isinstance(src, Replicate):
        return None, "sum"  # R -> S slice, R -> P local
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return "all_to_all", "sum"
        return "all_gather", "sum"  # S -> R, S -> P
    # src is Partial
    if isinstance(dst, Shard) and src.op == "sum":
        return "reduce_scatter", "sum"
    if isinstance(dst, Partial):  # P(max) <-> P(sum): materialize first
        return "all_reduce", src.op
    return "all_reduce", src.op


def _bytes_on_axis(meta: TensorMeta, src: tuple[Placement, ...], axis: int, mesh_shape: tuple[int, ...]) -> int:
    """Bytes of the tensor with every axis but ``axis`` applied (``axis`` as Replicate)."""
    others = tuple(Replicate() if a == axis else p for a, p in enumerate(src))
    shape = local_shape(meta.shape, others, mesh_shape)
    n = 1
    for s in shape:
        n *= s
    return n * meta.itemsize


def transitions(meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                mesh_shape: tuple[int, ...]) -> list[AxisTransition]:
    """The collectives that take a tensor from placements ``src`` to ``dst`` (one per axis)."""
    out = []
    for axis, (s, d) in enumerate(zip(src, dst)):
        if mesh_shape[axis] == 1:
            continue
        kind, op = axis_transition(s, d)
        if kind is None:
            continue
        nbytes = _bytes_on_axis(meta, src, axis, mesh_shape)
        if kind == "all_to_all":
            nbytes = nbytes // mesh_shape[axis]
        out.append(AxisTransition(axis, kind, nbytes, op, s, d))
    return out


def consumer_grad_placement(p: Placement, axis_split: bool) -> Placement:
    """Placement of the gradient a consumer returns for an input it read as ``p``."""
    if isinstance(p, Shard):
        return p
    if isinstance(p, Partial):
        return Replicate()
    return Partial("sum") if axis_split else Replicate()


def producer_grad_placement(p: Placement) -> Placement:
    """Placement a producer needs its output gradient in, for an output placed ``p``."""
    return p if isinstance(p, Shard) else Replicate()
