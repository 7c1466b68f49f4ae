"""Data-parallel gradient buckets: many per-parameter all-reduces become a few, overlapped with backward.

A parameter that is replicated on a mesh axis and read there by computation the
axis splits gets a ``P(sum)`` gradient from each consumer, which the plan reduces
with one all-reduce per consumer edge (``P(sum) -> R``).  ``GradBuckets`` does that
work the way DDP does:

- the consumer edges hand their gradient back unreduced (``note``: when the
  executor lowers the graph it sets each such edge's gradient target to its
  partial placement);
- the parameter's source value is an identity autograd function (``wrap``) whose
  backward receives the sum of its consumers' partial gradients; it drops them
  into the parameter's *bucket* (parameters grouped, in reverse order of first
  use, up to ``bucket_bytes``; the first bucket only up to
  ``first_bucket_bytes``, 1 MiB, as DDP's, so the first all-reduce starts as soon
  as the last-used parameters' gradients exist instead of after most of backward)
  and returns no gradient;
- when every parameter of a bucket has arrived, one ``all_reduce`` of the
  bucket's flat buffer is started asynchronously (``async_op=True``) on the
  axis's group, so it runs while backward goes on;
- at the end of backward (an autograd engine callback) every bucket is waited
  for (one whose parameters did not all arrive is reduced then), and each
  parameter's reduced gradient is added to ``.grad`` (``None`` -> set to its
  range of the bucket's flat buffer, a fresh buffer every round, so no copy), so
  gradient accumulation over several backwards stays exact.

A step of several micro-batches (``ShardedModule.train_step`` of a pipelined or
accumulating plan) reduces once: ``hold`` takes the gradients so far out of
``.grad``, the micro-batches run unwrapped (their partial gradients accumulate in
``.grad``), and ``reduce_held`` all-reduces each bucket's sum after the last backward
and adds what ``hold`` took (the cost model prices it so: ``Coster.grad_move_steps``).

Bucketed: parameters whose every consumer edge returns the same gradient
placement (or whose plan sums its uses' gradients first, ``partial_grad_axes``: then
that sum's placement), which differs from the parameter's own gradient placement only
on axes where it is ``P(sum)`` and the placement ``R``; others keep the plan's
per-edge collectives.  ZeRO parameters are never bucketed.  A bucket partial on several
axes (data parallelism over two axes of the mesh) is reduced as the plan chose
(``Plan.flat_grad_axes``, priced by ``cost.Coster.flattens``): by one all-reduce over
those axes' groups flattened into one (``MeshGroups.flat_group``; torchtitan flattens
mesh dims so), or once per axis, one after the other (the first overlapped with
backward, the others as backward ends).

Limits: gradients reach ``.grad`` only, as with DDP (``torch.autograd.grad``
with respect to a bucketed parameter sees none: compile with
``grad_bucket_bytes=None`` for that); a bucket's flat copy is transient memory
the plan does not count (at most ``bucket_bytes`` per bucket in flight).

Counting: the counter keeps the plan's *logical* list: when a bucket is
reduced it records, for every edge noted for its parameters, the edge's
planned ``all_reduce`` (kind, axis, ``"backward"``, bytes).  A bucket is thus one
physical collective standing for those entries; counted == planned still holds
entry by entry.  Summing a parameter's partial gradients before the reduction
instead of after changes only the float summation order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from autopar.placement import Partial, Placement, Replicate
from autopar.spec import TensorMeta
from autopar.transitions import transitions

from .counter import CollectiveCounter
from .groups import MeshGroups

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "GradBuckets", "bucket_layout", "bucketable"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
DEFAULT_FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def bucketable(xplan, exclude: set[str]) -> dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]]:
    """Param node name -> (axes, partial gradient placement) for parameters whose gradient can be bucketed: partial
    on ``axes`` where the parameter's gradient is replicated, alike elsewhere.

    Parameters in ``exclude`` (ZeRO) and those whose edges disagree are left out.
    Ordered by first use in forward.
    """
    graph = xplan.graph
    found: dict[str, set] = {}
    for n in graph.nodes:
        if n.kind != "op" or not n.requires_grad:
            continue
        ex = xplan.nodes[n.name]
        for pos, (u, _) in enumerate(n.inputs):
            producer = graph.nodes[u]
            if producer.kind != "param" or producer.name in exclude or not producer.outputs[0].is_float:
                continue
            # a parameter whose uses' gradients are summed first hands the bucket the sum
            g = xplan.accumulate.get(producer.name) or ex.input_grad(pos)
            found.setdefault(producer.name, set()).add(g)
    out = {}
    for name, grads in found.items():
        if len(grads) != 1:
            continue
        (g,) = grads
        target = xplan.sources[name][1]  # where the parameter's gradient lives
        axes = [a for a, (p, q) in enumerate(zip(g, target)) if p != q]
        if axes and all(isinstance(g[a], Partial) and isinstance(target[a], Replicate) for a in axes):
            out[name] = (tuple(axes), g)
    return out


def bucket_layout(
    order: list, axes_of: dict, sizes: dict, bucket_bytes: int, first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES
) -> list[tuple[tuple, list]]:
    """The gradient buckets of the parameters ``order`` (by first use in forward), as ``(axes, names)`` in the
    order backward fills them: parameters in reverse order of first use (the last used are ready first), each
    into the open bucket of its partial ``axes_of[name]`` while it stays within the cap (``bucket_bytes``; the
    first bucket of each axis set ``first_bucket_bytes``, as DDP's); ``sizes``: each gradient's bytes in the
    bucket.  A gradient larger than the cap has a bucket of its own.  The last bucket of an axis set holds the
    parameters used first; it is ready only when backward ends."""
    layout: list[tuple[tuple, list]] = []
    filled: dict[int, int] = {}
    for name in reversed(order):  # backward readiness order: last used first
        axes = axes_of[name]
        current = next((b for b in reversed(layout) if b[0] == axes), None)
        first = current is not None and not any(b[0] == axes for b in layout if b is not current)
        cap = min(first_bucket_bytes, bucket_bytes) if first else bucket_bytes
        if current is None or filled[id(current)] + sizes[name] > cap and current[1]:
            current = (axes, [])
            layout.append(current)
            filled[id(current)] = 0
        current[1].append(name)
        filled[id(current)] += sizes[name]
    return layout


@dataclass
class _Bucket:
    axes: tuple[int, ...]
    names: list[str]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    work: object = None
    flat: torch.Tensor | None = None
    packed: list[tuple[str, torch.Size]] = field(default_factory=list)  # (name, shape) in the flat, in order


class _Round:
    """One forward's worth of bucketed gradients (its backward fills and reduces the buckets)."""

    def __init__(self, owner: GradBuckets, params: dict[str, torch.Tensor], counter: CollectiveCounter | None) -> None:
        self.owner, self.params, self.counter = owner, params, counter
        self.buckets = [_Bucket(axes, list(names)) for axes, names in owner.layout]
        self.of = {name: b for b in self.buckets for name in b.names}
        self.queued = False

    def arrive(self, name: str, grad: torch.Tensor) -> None:
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.queued = True
        b = self.of[name]
        b.grads[name] = grad
        if len(b.grads) == len(b.names):
            self.launch(b)

    def launch(self, b: _Bucket) -> None:
        if b.work is not None or not b.grads:
            return
        names = [n for n in b.names if n in b.grads]
        b.flat = torch.cat([b.grads[n].reshape(-1) for n in names])
        b.packed = [(n, b.grads[n].shape) for n in names]
        b.grads.clear()  # the flat copy is the only one kept: the gradients are held once, as the plan counts
        b.work = dist.all_reduce(b.flat, group=self.owner.first_group(b.axes), async_op=True)
        if self.counter is not None:
            for n in names:
                for entries in self.owner.logical.get(n, {}).values():
                    for kind, axis, nbytes, op in entries:
                        self.counter.record(kind, axis, "backward", nbytes, op)

    def finish(self) -> None:
        with self.owner.groups.collectives("the gradient all-reduce"):
            self._finish()

    def _finish(self) -> None:
        for b in self.buckets:
            self.launch(b)
        for b in self.buckets:
            if b.work is None:
                continue
            b.work.wait()
            for group in self.owner.later_groups(b.axes):  # reduced once per axis: the others, in turn
                dist.all_reduce(b.flat, group=group)
            offset = 0
            for n, shape in b.packed:
                numel = shape.numel()
                reduced = b.flat[offset : offset + numel].view(shape)
                offset += numel
                p = self.params[n]
                p.grad = reduced if p.grad is None else p.grad.add_(reduced)  # a view of this round's flat
            b.packed = []
            b.flat = b.work = None


class _BucketedSource(torch.autograd.Function):
    """Identity in forward; backward hands the parameter's partial gradient to its bucket and returns none."""

    @staticmethod
    def forward(ctx, param, rnd, name):  # noqa: D102
        ctx.rnd, ctx.name = rnd, name
        return param.view_as(param)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        ctx.rnd.arrive(ctx.name, grad.contiguous())
        return None, None, None


class GradBuckets:
    """The bucketed parameters of one compiled module (see the module docstring)."""

    def __init__(
        self,
        groups: MeshGroups,
        bucketed: dict[str, tuple[tuple[int, ...], tuple[Placement, ...]]],
        sizes: dict[str, int],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        flat: frozenset[tuple[int, ...]] = frozenset(),
    ) -> None:
        self.groups = groups
        self.bucketed = bucketed
        self.flat = flat  # axis sets reduced by one all-reduce over their flattened group (groups.flat_group)
        axes_of = {name: axes for name, (axes, _) in bucketed.items()}
        self.layout = bucket_layout(list(bucketed), axes_of, sizes, bucket_bytes, first_bucket_bytes)
        # param -> {edge: its planned gradient collectives (kind, axis or flattened axes, bytes, reduce op)}
        self.logical: dict[str, dict[object, list[tuple]]] = {}
        self.round: _Round | None = None
        log.debug("gradient buckets: %s", [(a, len(n)) for a, n in self.layout])

    def first_group(self, axes: tuple[int, ...]) -> dist.ProcessGroup:
        """The group a bucket partial on ``axes`` starts its reduction on: the flattened group of the axes where
        the plan chose it (``flat``), else its first axis's."""
        if len(axes) > 1 and axes in self.flat:
            return self.groups.flat_group(axes)
        return self.groups.axis_group(axes[0])

    def later_groups(self, axes: tuple[int, ...]) -> list[dist.ProcessGroup]:
        """The groups its reduction goes on over, one after the other: its other axes' (none when flattened)."""
        if len(axes) == 1 or axes in self.flat:
            return []
        return [self.groups.axis_group(a) for a in axes[1:]]

    def __contains__(self, name: str) -> bool:
        return name in self.bucketed

    def begin(self, params: dict[str, torch.Tensor], counter: CollectiveCounter | None) -> None:
        """Start a forward: its bucketed parameters' gradients go to a new round (None under no_grad)."""
        self.round = _Round(self, params, counter) if torch.is_grad_enabled() else None

    def defers(self, name: str) -> bool:
        """Whether this forward reduces ``name``'s gradient in a bucket."""
        return self.round is not None and name in self.bucketed and self.round.params[name].requires_grad

    def note(self, name: str, edge, meta: TensorMeta, grad_src, grad_dst) -> None:
        """At compile time: ``edge`` (any key; noting it again replaces it) of ``name`` defers its reduction.

        The edge's gradient then stays at ``grad_src`` (its move does not reduce it),
        and every reduction of ``name``'s bucket records the edge's planned
        ``grad_src -> grad_dst`` collectives.
        """
        steps = [t for t in transitions(meta, grad_src, grad_dst, self.groups.mesh.shape) if t.kind]
        entries = [(t.kind, t.axis, t.bytes, t.reduce_op) for t in steps]
        axes = tuple(sorted(t.axis for t in steps))
        if len(axes) > 1 and axes in self.flat:  # one all-reduce over the axes flattened, as the plan lists it
            entries = [(entries[0][0], axes, entries[0][2], entries[0][3])]
        self.logical.setdefault(name, {})[edge] = entries

    def hold(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """Before a step of several micro-batches: each bucketed parameter's ``.grad`` so far, taken out of it.

        During the step nothing is wrapped (``wrap``): the lowered program's bucketed edges hand their
        gradients back unreduced, so the micro-batches' partial gradients accumulate in ``.grad`` locally and
        ``reduce_held`` reduces their sum once, after the step's last backward (DDP's ``no_sync``)."""
        kept = {}
        for name, p in params.items():
            kept[name], p.grad = p.grad, None
        return kept

    def reduce_held(
        self, params: dict[str, torch.Tensor], kept: dict[str, torch.Tensor | None], counter: CollectiveCounter | None
    ) -> None:
        """After the step's micro-batches: one all-reduce per bucket of the partial gradients accumulated in
        ``.grad`` (the parameters with one: on a pipeline, those of this rank's stages, alike on every rank of
        the bucket's axis group), added to what ``hold`` took out."""
        rnd = _Round(self, params, counter)
        for name, p in params.items():
            if p.grad is not None:
                rnd.of[name].grads[name] = p.grad.contiguous()
            p.grad = kept[name]
        rnd.finish()

    def wrap(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The source value forward reads for a bucketed parameter."""
        if not self.defers(name):
            return param
        return _BucketedSource.apply(param, self.round, name)
