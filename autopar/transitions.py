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

Partial gradients: an op that an axis does not split may run its backward on
``P(sum)`` gradients (its strategy's ``partial_grad``; exact because a
vector-Jacobian product is linear in the incoming gradient), so it asks for
``P(sum)`` and hands ``P(sum)`` back (``input_grad_placements`` /
``output_grad_placements``).  A consumer's ``R`` gradient becomes ``P(sum)`` by the
free mask step, and the partial gradients of several consumers are summed locally:
the reduction happens once, where a whole gradient is needed (a parameter's, whose
reduction overlaps with backward, or a split producer's).  A parameter read by
several ops may likewise sum its uses' partial gradients before one reduction to
its state placement (``candidates.SourceStrategy.accumulated_grad``).

Bytes follow ``costmodel.comm``: the full buffer of an all-reduce, the gathered
size of an all-gather or reduce-scatter, each rank's buffer for all-to-all; all
measured on the tensor's local size when the step runs (see ``transitions``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .placement import Partial, Placement, Replicate, Shard
from .spec import TensorMeta, local_shape

__all__ = [
    "AxisTransition",
    "transitions",
    "consumer_grad_placement",
    "producer_grad_placement",
    "input_grad_placements",
    "output_grad_placements",
    "partial_on",
]


@dataclass(frozen=True, slots=True)
class AxisTransition:
    """One collective on one axis. ``kind`` is None for free local conversions.  ``axis`` is a tuple for one
    all-reduce over several axes' groups flattened into one (the cost model's choice for a gradient bucket partial
    on them, ``cost.Coster.flattens``); ``transitions`` itself lists one step per axis."""

    axis: int | tuple[int, ...]
    kind: str | None
    bytes: int
    reduce_op: str = "sum"
    src: Placement = Replicate()
    dst: Placement = Replicate()


def _local_bytes(meta: TensorMeta, current: list[Placement], mesh_shape: tuple[int, ...]) -> int:
    shape = local_shape(meta.shape, tuple(current), mesh_shape)
    n = 1
    for s in shape:
        n *= s
    return n * meta.itemsize


def transitions(
    meta: TensorMeta,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    *,
    include_local: bool = False,
) -> list[AxisTransition]:
    """The steps that take a tensor from placements ``src`` to ``dst``, in execution order.

    1. un-shard, innermost axis first (a dim sharded by several axes is nested, so
       the last axis's pieces must be joined first): ``S -> R/P`` all-gather,
       ``S(i) -> S(j)`` all-to-all;
    2. reduce Partials, innermost axis first: ``P -> R`` all-reduce,
       ``P(sum) -> S`` reduce-scatter;
    3. free local steps, outermost axis first: ``R -> S`` slice, ``R -> P`` mask
       (listed with ``kind=None`` only when ``include_local``).

    Before any step on axis ``a`` that moves dim ``d``, an inner axis ``b > a`` that
    still shards ``d`` is all-gathered (and re-sliced in step 3): on the nested
    layout axis ``b`` splits axis ``a``'s piece, so it must be joined first.

    Each step's bytes are measured on the placements the tensor has when the step
    runs, so the list is exactly what the runtime issues.
    """
    current = list(src)
    steps: list[AxisTransition] = []

    def step(axis: int, kind: str | None, new: Placement, op: str = "sum") -> None:
        nbytes = 0
        if kind is not None:
            full = list(current)
            full[axis] = Replicate() if isinstance(current[axis], Shard) else current[axis]
            nbytes = _local_bytes(meta, full, mesh_shape)
            if kind == "all_to_all":
                nbytes = _local_bytes(meta, current, mesh_shape)
        if kind is not None or include_local:
            steps.append(AxisTransition(axis, kind, nbytes, op, current[axis], new))
        current[axis] = new

    sizes = mesh_shape

    def free_inner(axis: int, dims: set[int]) -> None:
        # nested layout: an inner axis sharding a dim this step moves must be joined first
        for b in reversed(range(axis + 1, len(src))):
            q = current[b]
            if sizes[b] > 1 and isinstance(q, Shard) and q.dim in dims:
                step(b, "all_gather", Replicate())

    def dims_of(*ps: Placement) -> set[int]:
        return {p.dim for p in ps if isinstance(p, Shard)}

    for axis in reversed(range(len(src))):
        s, d = current[axis], dst[axis]
        if sizes[axis] == 1 or s == d or not isinstance(s, Shard):
            continue
        free_inner(axis, dims_of(s, d))
        if isinstance(d, Shard):
            step(axis, "all_to_all", d)
        else:
            step(axis, "all_gather", Replicate())
    for axis in reversed(range(len(src))):  # inner partials first: full = reduce_0(reduce_1(...))
        s, d = current[axis], dst[axis]
        if sizes[axis] == 1 or s == d or not isinstance(s, Partial):
            continue
        free_inner(axis, dims_of(d))
        if isinstance(d, Shard) and s.op == "sum":
            step(axis, "reduce_scatter", d)
        else:
            step(axis, "all_reduce", Replicate(), s.op)
    for axis in range(len(src)):
        s, d = current[axis], dst[axis]
        if sizes[axis] == 1 or s == d:
            continue
        free_inner(axis, dims_of(d))
        step(axis, None, d)  # R -> S slice or R -> P mask
    return steps


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


def partial_on(placements: tuple[Placement, ...], flags: tuple[bool, ...] = ()) -> tuple[Placement, ...]:
    """``placements`` with ``P(sum)`` on the axes ``flags`` marks (no flags: unchanged)."""
    if not any(flags):
        return tuple(placements)
    return tuple(Partial("sum") if f else p for p, f in zip(placements, flags))


def input_grad_placements(
    read: tuple[Placement, ...], split: tuple[bool, ...], partial_grad: tuple[bool, ...] = ()
) -> tuple[Placement, ...]:
    """The gradient an op hands back for an input it read as ``read``, per axis.

    ``consumer_grad_placement`` on each axis, except on the ``partial_grad`` axes
    (which the op does not split), where its backward ran on ``P(sum)`` gradients
    and so returns ``P(sum)`` (see ``strategies.base.OpStrategy``).
    """
    return partial_on(tuple(consumer_grad_placement(p, sp) for p, sp in zip(read, split)), partial_grad)


def output_grad_placements(out: tuple[Placement, ...], partial_grad: tuple[bool, ...] = ()) -> tuple[Placement, ...]:
    """The placement an op needs the gradient of an output placed ``out`` in (``P(sum)`` on ``partial_grad`` axes)."""
    return partial_on(tuple(producer_grad_placement(p) for p in out), partial_grad)
