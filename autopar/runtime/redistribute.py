"""Redistribution on real ranks: run ``transitions()``'s steps, one collective per step.

``redistribute_local(x, meta, src, dst, groups)`` takes this rank's local piece of
the global tensor ``meta`` under placements ``src`` and returns its piece under
``dst``.  It executes exactly ``transitions(meta, src, dst, mesh.shape,
include_local=True)`` in order, so the collectives issued (and recorded in a
``CollectiveCounter``) are the plan's list:

===============  ===========================================================
step             how it runs on the axis group (pieces per ``layout.py``)
===============  ===========================================================
all_gather       S(d)[b] -> R: each rank's piece flattened and zero-padded to
                 the largest piece, ``dist.all_gather``, trimmed, then written
                 back at its indices on dim ``d`` (blocks re-interleaved)
all_to_all       S(i) -> S(j): rank m sends rank r the part of its piece that r
                 owns under S(j); chunks padded to the largest, one
                 ``dist.all_to_all_single``, trimmed and placed (i == j with
                 different blocks works too)
all_reduce       P(op) -> R: ``dist.all_reduce`` with SUM or MAX
reduce_scatter   P(sum) -> S(d): native padded reduce-scatter when
                 ``groups.native_reduce_scatter`` (nccl default); otherwise
                 all-reduce + local slice.  Recorded as one ``reduce_scatter``
                 with the planned bytes either way
slice (None)     R -> S(d): this coordinate's piece, no communication
mask (None)      R -> P(sum): the value on axis coordinate 0, zeros elsewhere;
                 R -> P(max): the value on every rank
===============  ===========================================================

Pieces are put in mesh order by axis coordinate, not group rank (the two differ
on permuted meshes; see ``MeshGroups.axis_order``).  Bool tensors travel as uint8.

Nested layouts: when several mesh axes shard one dim, axis ``b`` splits the piece
axis ``a < b`` left (``layout.py``).  A step on axis ``a`` that moves dim ``d`` is
therefore only a collective over axis ``a``'s group while no inner axis ``b > a``
shards ``d``; and reducing ``P(op)`` on axis ``a`` commutes with an inner
``P(op')`` only when ``op == op'``.  ``nesting_conflict`` names a step list that
breaks either rule or passes through a placement the layout cannot hold (a block
count that does not divide some rank's piece); ``redistribute_local`` refuses it
with a ValueError rather than returning wrong values or issuing collectives the
plan did not price.  The check is a pure function of (meta, src, dst, mesh shape),
so every rank refuses before any collective and none is left waiting.  (A piece
of the wrong shape on one rank is only detected there: the others then wait in
the first collective until the process group's timeout.)

``Move`` is one edge resolved once (global meta, ``src``/``dst`` and the gradient's
``grad_src``/``grad_dst``, this rank's groups); calling it runs ``Redistribute``, the
autograd function (``redistribute`` builds a Move and calls it): forward moves the
value ``src -> dst``, backward moves the gradient ``grad_src -> grad_dst`` (see
``transitions.consumer_grad_placement`` / ``producer_grad_placement``), so a
``P -> R`` all-reduce has an identity backward (Megatron's g) and a replicated
input to a split computation gets its ``P(sum)`` gradient all-reduced (f).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from autopar.pieces import dim_index, unlayable_reason
from autopar.placement import Partial, Placement, Replicate, Shard, parse_placements
from autopar.spec import TensorMeta, local_shape
from autopar.transitions import AxisTransition, transitions

from .counter import CollectiveCounter
from .groups import MeshGroups

__all__ = ["redistribute_local", "redistribute", "Redistribute", "Move", "nesting_conflict", "nesting_steps"]

logger = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# ---- planning (pure) -----------------------------------------------------------------
def _fmt(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _touched_dims(step: AxisTransition) -> tuple[int, ...]:
    """Tensor dims whose layout the step changes (a Shard on either side)."""
    return tuple(p.dim for p in (step.src, step.dst) if isinstance(p, Shard))


def _conflict(
    steps: Sequence[AxisTransition], src: tuple[Placement, ...], mesh_shape: tuple[int, ...], shape: tuple[int, ...]
) -> str | None:
    """Why the step list cannot run on the nested layout, or None (see the module docstring)."""
    if (bad := unlayable_reason(shape, src, mesh_shape)) is not None:
        return f"the source placements {_fmt(src)} do not lay out a {shape} tensor: {bad}"
    current = list(src)
    for st in steps:
        a = st.axis
        what = f"step {st.kind or 'local'} {st.src} -> {st.dst} on mesh axis {a}"
        dims = _touched_dims(st)
        for b in range(a + 1, len(mesh_shape)):
            q = current[b]
            if mesh_shape[b] == 1:
                continue
            if isinstance(q, Shard) and q.dim in dims:
                return (
                    f"{what} moves dim {q.dim}, which inner mesh axis {b} still shards ({q}); on the nested "
                    f"layout axis {b} splits axis {a}'s piece, so axis {b} must be un-sharded (all_gather) "
                    f"before this step and re-sliced after it"
                )
            if st.kind in ("all_reduce", "reduce_scatter") and isinstance(q, Partial) and q.op != st.src.op:
                return (
                    f"{what} reduces with {st.src.op} while inner mesh axis {b} is still {q}; the full value "
                    f"is reduce_axis{a}(reduce_axis{b}(...)), so axis {b} must be reduced first"
                )
        current[a] = st.dst
        if (bad := unlayable_reason(shape, current, mesh_shape)) is not None:
            return (
                f"{what} leaves the tensor in {_fmt(current)}, which the nested layout cannot hold: {bad}; "
                "the step list should not pass through that placement"
            )
    return None


@functools.lru_cache(maxsize=1 << 16)  # the planner prices ~15k distinct moves of a large model
def _steps(
    meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> tuple[tuple[AxisTransition, ...], str | None]:
    steps = tuple(transitions(meta, src, dst, mesh_shape, include_local=True))
    return steps, _conflict(steps, src, mesh_shape, tuple(meta.shape))


def nesting_steps(
    meta: TensorMeta, src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[tuple[AxisTransition, ...], str | None]:
    """``transitions(..., include_local=True)`` and ``nesting_conflict``'s answer, computed once (cached)."""
    return _steps(meta, tuple(parse_placements(src)), tuple(parse_placements(dst)), tuple(mesh_shape))


def nesting_conflict(
    meta: TensorMeta, src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]
) -> str | None:
    """Why ``transitions(meta, src, dst, mesh_shape)`` cannot run on the nested layout, or None when it can."""
    return nesting_steps(meta, src, dst, mesh_shape)[1]


def _placements(value, groups: MeshGroups, what: str) -> tuple[Placement, ...]:
    ps = tuple(parse_placements(value))
    if len(ps) != groups.mesh.ndim:
        raise ValueError(
            f"redistribute: {what} {_fmt(ps)} has {len(ps)} placements but mesh {groups.mesh} has "
            f"{groups.mesh.ndim} axes; give one placement per mesh axis"
        )
    return ps


# ---- transport: coordinate-ordered collectives on flat, padded buffers ---------------
def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _unwire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(torch.bool) if dtype == torch.bool else t


def _padded(flat: torch.Tensor, width: int) -> torch.Tensor:
    if flat.numel() == width:
        return flat.contiguous()
    buf = flat.new_zeros(width)
    buf[: flat.numel()] = flat
    return buf


def _start_gather(
    flat: torch.Tensor, numels: list[int], groups: MeshGroups, axis: int
) -> Callable[[], list[torch.Tensor]]:
    """Start an all-gather of one flat piece per rank (``numels[c]`` at axis coordinate c);
    the returned function waits and gives the pieces by coordinate."""
    width = max(numels)
    if width == 0:  # every piece empty: nothing to move (same decision on every rank)
        return lambda: [flat.new_empty(0) for _ in numels]
    buf = _padded(flat, width)
    out = [torch.empty_like(buf) for _ in numels]
    work = dist.all_gather(out, buf, group=groups.axis_group(axis), async_op=True)

    def finish() -> list[torch.Tensor]:
        work.wait()
        by_coord: list[torch.Tensor] = [buf] * len(numels)
        for g, c in enumerate(groups.axis_order(axis)):
            by_coord[c] = out[g][: numels[c]]
        return by_coord

    return finish


def _exchange(
    chunks: list[torch.Tensor], recv_numels: list[int], width: int, groups: MeshGroups, axis: int
) -> list[torch.Tensor]:
    """All-to-all: ``chunks[c]`` goes to axis coordinate c; returns what each coordinate sent, by coordinate."""
    if width == 0:
        return [chunks[0].new_empty(0) for _ in chunks]
    order = groups.axis_order(axis)
    send = torch.stack([_padded(chunks[c], width) for c in order])  # row g -> group rank g
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.axis_group(axis))
    by_coord: list[torch.Tensor] = [recv[0]] * len(chunks)
    for g, c in enumerate(order):
        by_coord[c] = recv[g][: recv_numels[c]]
    return by_coord


def _start_all_reduce(x: torch.Tensor, op: str, groups: MeshGroups, axis: int) -> Callable[[], torch.Tensor]:
    """Start an all-reduce of a copy of ``x``; the returned function waits and gives it."""
    y = x.contiguous().clone()
    work = dist.all_reduce(y, op=_REDUCE_OPS[op], group=groups.axis_group(axis), async_op=True)
    return lambda: (work.wait(), y)[1]


def _all_reduce(x: torch.Tensor, op: str, groups: MeshGroups, axis: int) -> torch.Tensor:
    return _start_all_reduce(x, op, groups, axis)()


def _native_reduce_scatter(chunks: list[torch.Tensor], numel_me: int, groups: MeshGroups, axis: int) -> torch.Tensor:
    width = max(c.numel() for c in chunks)
    if width == 0:
        return chunks[0].new_empty(0)
    send = torch.cat([_padded(chunks[c], width) for c in groups.axis_order(axis)])  # concatenated form
    out = send.new_empty(width)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, send, op=dist.ReduceOp.SUM, group=groups.axis_group(axis))
    return out[:numel_me]


# ---- steps ---------------------------------------------------------------------------
def _with(shape: Sequence[int], changes: dict[int, int]) -> tuple[int, ...]:
    return tuple(changes.get(d, s) for d, s in enumerate(shape))


@functools.lru_cache(maxsize=1024)
def _pieces_index_cpu(n: int, shard: Shard, parts: int) -> tuple[torch.Tensor, ...]:
    return tuple(dim_index(n, [(shard, parts, m)]) for m in range(parts))


def _pieces_index(n: int, shard: Shard, parts: int, device: torch.device) -> list[torch.Tensor]:
    """For each axis coordinate, the indices (in a dim of ``n``) its piece holds, on ``device``."""
    return [i.to(device) for i in _pieces_index_cpu(n, shard, parts)]


def _start_step_all_gather(
    x: torch.Tensor, st: AxisTransition, frame: tuple[int, ...], groups: MeshGroups
) -> Callable[[], torch.Tensor]:
    """Start the all-gather step ``st``; the returned function waits and assembles the ``frame``-shaped result."""
    shard, a = st.src, st.axis
    d, k = shard.dim, groups.axis_size(a)
    idx = _pieces_index(frame[d], shard, k, x.device)
    shapes = [_with(frame, {d: i.numel()}) for i in idx]
    xw = _wire(x)
    gathered = _start_gather(xw.reshape(-1), [math.prod(s) for s in shapes], groups, a)

    def finish() -> torch.Tensor:
        pieces = [p.view(s) for p, s in zip(gathered(), shapes)]
        if shard.blocks == 1:  # plain shards are contiguous ranges in coordinate order
            return _unwire(torch.cat(pieces, dim=d), x.dtype)
        out = xw.new_empty(frame)
        for i, p in zip(idx, pieces):
            out.index_copy_(d, i, p)
        return _unwire(out, x.dtype)

    return finish


def _step_all_to_all(x: torch.Tensor, st: AxisTransition, frame: tuple[int, ...], groups: MeshGroups) -> torch.Tensor:
    a = st.axis
    k, me = groups.axis_size(a), groups.axis_rank(a)
    si, sj = st.src, st.dst
    i, j = si.dim, sj.dim
    xw = _wire(x)
    if i != j:
        src_idx = _pieces_index(frame[i], si, k, x.device)
        dst_idx = _pieces_index(frame[j], sj, k, x.device)
        rest = math.prod(_with(frame, {i: 1, j: 1}))
        chunks = [xw.index_select(j, dst_idx[r]).reshape(-1) for r in range(k)]
        recv_shapes = [_with(frame, {i: src_idx[m].numel(), j: dst_idx[me].numel()}) for m in range(k)]
        width = rest * max(t.numel() for t in src_idx) * max(t.numel() for t in dst_idx)
        got = _exchange(chunks, [math.prod(s) for s in recv_shapes], width, groups, a)
        pieces = [g.view(s) for g, s in zip(got, recv_shapes)]
        if si.blocks == 1:
            return _unwire(torch.cat(pieces, dim=i), x.dtype)
        out = xw.new_empty(_with(frame, {j: dst_idx[me].numel()}))
        for m in range(k):
            out.index_copy_(i, src_idx[m], pieces[m])
        return _unwire(out, x.dtype)
    # same dim, different blocks: rank m sends r the indices both own, in m's local order
    n = frame[i]
    src_idx = _pieces_index_cpu(n, si, k)  # index bookkeeping on the CPU, moved to x.device where used
    dst_idx = _pieces_index_cpu(n, sj, k)
    rest = math.prod(_with(frame, {i: 1}))
    common = [[int(torch.isin(src_idx[m], dst_idx[r]).sum()) for r in range(k)] for m in range(k)]
    chunks = [
        xw.index_select(i, torch.isin(src_idx[me], dst_idx[r]).nonzero().flatten().to(x.device)).reshape(-1)
        for r in range(k)
    ]
    recv_shapes = [_with(frame, {i: common[m][me]}) for m in range(k)]
    width = rest * max(max(row) for row in common)
    got = _exchange(chunks, [math.prod(s) for s in recv_shapes], width, groups, a)
    position = torch.full((n,), -1, dtype=torch.long)
    position[dst_idx[me]] = torch.arange(dst_idx[me].numel())
    out = xw.new_empty(_with(frame, {i: dst_idx[me].numel()}))
    for m in range(k):
        held = src_idx[m][torch.isin(src_idx[m], dst_idx[me])]
        out.index_copy_(i, position[held].to(x.device), got[m].view(recv_shapes[m]))
    return _unwire(out, x.dtype)


def _step_reduce_scatter(x: torch.Tensor, st: AxisTransition, groups: MeshGroups) -> torch.Tensor:
    a, shard = st.axis, st.dst
    k, me = groups.axis_size(a), groups.axis_rank(a)
    idx = _pieces_index(x.shape[shard.dim], shard, k, x.device)
    if groups.native_reduce_scatter:
        chunks = [x.index_select(shard.dim, i).reshape(-1) for i in idx]
        shape = _with(x.shape, {shard.dim: idx[me].numel()})
        return _native_reduce_scatter(chunks, math.prod(shape), groups, a).view(shape)
    # emulation (older gloo builds have no reduce-scatter): all-reduce, keep this rank's piece; the
    # counter still records one reduce_scatter with the planned bytes (the plan prices the real one)
    return _all_reduce(x, "sum", groups, a).index_select(shard.dim, idx[me])


def _step_local(x: torch.Tensor, st: AxisTransition, groups: MeshGroups) -> tuple[torch.Tensor, bool]:
    """R -> S slice or R -> P mask; returns (tensor, whether it is a new tensor)."""
    me = groups.axis_rank(st.axis)
    if isinstance(st.dst, Shard):
        idx = _pieces_index_cpu(x.shape[st.dst.dim], st.dst, groups.axis_size(st.axis))[me]
        return x.index_select(st.dst.dim, idx.to(x.device)), True
    if isinstance(st.dst, Partial):
        if st.dst.op == "sum" and me != 0:
            return torch.zeros_like(x), True
        return x, False
    raise AssertionError(f"local step {st.src} -> {st.dst} on mesh axis {st.axis}: expected R -> S or R -> P")


def _run_step(
    x: torch.Tensor, st: AxisTransition, current: list[Placement], shape: tuple[int, ...], groups: MeshGroups
) -> tuple[torch.Tensor, bool]:
    if st.kind is None:
        return _step_local(x, st, groups)
    if st.kind in ("all_reduce", "all_gather"):
        return start_collective(x, st, current, shape, groups)(), True
    if st.kind == "reduce_scatter":
        return _step_reduce_scatter(x, st, groups), True
    frame = _frame(st, current, shape, groups)
    if st.kind == "all_to_all":
        return _step_all_to_all(x, st, frame, groups), True
    raise AssertionError(f"transition kind {st.kind!r} on mesh axis {st.axis} has no runtime implementation")


def _frame(st: AxisTransition, current: Sequence[Placement], shape: tuple[int, ...], groups: MeshGroups):
    """This rank's local shape with ``st``'s axis replicated: what a gather along that axis assembles."""
    replicated = list(current)
    replicated[st.axis] = Replicate()
    return local_shape(shape, tuple(replicated), groups.mesh.shape, groups.coordinate)


def start_collective(
    x: torch.Tensor, st: AxisTransition, current: Sequence[Placement], shape: tuple[int, ...], groups: MeshGroups
) -> Callable[[], torch.Tensor]:
    """Start step ``st`` (an ``all_reduce`` or ``all_gather`` of a global ``shape`` tensor now placed
    ``current``) without waiting; the returned function waits and gives the step's result."""
    if st.kind == "all_reduce":
        return _start_all_reduce(x, st.reduce_op, groups, st.axis)
    if st.kind == "all_gather":
        return _start_step_all_gather(x, st, _frame(st, current, shape, groups), groups)
    raise AssertionError(f"transition kind {st.kind!r}: only all_reduce and all_gather start asynchronously")


# ---- public --------------------------------------------------------------------------
def _checked_steps(
    x: torch.Tensor, shape: tuple[int, ...], src, dst, groups: MeshGroups, want: tuple[int, ...]
) -> tuple[AxisTransition, ...]:
    """The step list for ``x`` (bytes counted with ``x.dtype``); ValueError for a wrong piece or a nesting conflict."""
    if tuple(x.shape) != want:
        raise ValueError(
            f"redistribute {_fmt(src)} -> {_fmt(dst)}: the local piece has shape {tuple(x.shape)} but "
            f"a global {shape} tensor under {_fmt(src)} on mesh {groups.mesh} gives coordinate "
            f"{groups.coordinate} shape {want}; pass this rank's own piece (layout.shard_tensor)"
        )
    steps, conflict = _steps(TensorMeta(shape, x.dtype), src, dst, groups.mesh.shape)
    if conflict is not None:
        raise ValueError(
            f"redistribute a global {shape} tensor {_fmt(src)} -> {_fmt(dst)} on mesh "
            f"{groups.mesh}: transitions() gives steps the nested layout cannot run: {conflict}. "
            "Fix: plan this edge through an intermediate placement (e.g. replicate that axis first)"
        )
    return steps


def _run_steps(
    x: torch.Tensor,
    steps: tuple[AxisTransition, ...],
    shape: tuple[int, ...],
    src: tuple[Placement, ...],
    groups: MeshGroups,
    phase: str,
    counter: CollectiveCounter | None,
) -> torch.Tensor:
    out, fresh = x.detach(), False
    with torch.no_grad():
        current = list(src)
        for st in steps:
            out, new = _run_step(out, st, current, shape, groups)
            fresh = fresh or new
            current[st.axis] = st.dst
            if st.kind is not None and counter is not None:
                counter.record(st.kind, st.axis, phase, st.bytes, st.reduce_op)
        if not fresh:
            out = out.clone()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("redistribute %s %s -> %s (%s): %d steps", shape, _fmt(src), _fmt(current), phase, len(steps))
    return out


def redistribute_local(
    x: torch.Tensor,
    meta: TensorMeta,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    groups: MeshGroups,
    *,
    phase: str = "forward",
    counter: CollectiveCounter | None = None,
) -> torch.Tensor:
    """This rank's piece under ``dst`` of the global tensor ``meta`` whose piece under ``src`` is ``x``.

    ``meta.shape`` is the global shape; bytes are counted with ``x.dtype``.  Runs
    ``transitions(..., include_local=True)`` step by step and records every
    collective step (kind, axis, phase, planned bytes, reduce op) in ``counter``.
    Must be called by every rank of the mesh with the same ``meta``/``src``/``dst``.
    The result is a new tensor without autograd history (never aliases ``x``).
    Raises ValueError when ``x`` is not the piece ``src`` gives this rank, or when
    the step list cannot run on the nested layout (``nesting_conflict``).
    """
    src = _placements(src, groups, "src")
    dst = _placements(dst, groups, "dst")
    shape = tuple(int(s) for s in meta.shape)
    want = local_shape(shape, src, groups.mesh.shape, groups.coordinate)
    steps = _checked_steps(x, shape, src, dst, groups, want)
    return _run_steps(x, steps, shape, src, groups, phase, counter)


@dataclass(frozen=True, eq=False)
class Move:
    """One edge's redistribution on this rank, resolved once: ``src -> dst`` forward, ``grad_src -> grad_dst`` back.

    ``meta`` is the global tensor; ``grad_src`` is the placement of the gradient the
    consumer hands back (``consumer_grad_placement``), ``grad_dst`` the one the
    producer needs (``producer_grad_placement``).  Placements are parsed and both
    step lists looked up at construction; a step list the nested layout cannot run
    raises (ValueError) when it would be run, as ``redistribute_local`` does.
    ``redistribute`` and ``zero.from_state_shard`` take a Move; the compiled module
    builds one per edge that moves (``autopar.lower``).
    """

    meta: TensorMeta
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    grad_src: tuple[Placement, ...]
    grad_dst: tuple[Placement, ...]
    groups: MeshGroups = field(repr=False)
    shape: tuple[int, ...] = field(init=False, repr=False)
    _want: tuple[tuple[int, ...], tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        g = self.groups
        for name in ("src", "dst", "grad_src", "grad_dst"):
            object.__setattr__(self, name, _placements(getattr(self, name), g, name))
        shape = tuple(int(s) for s in self.meta.shape)
        object.__setattr__(self, "shape", shape)
        want = tuple(local_shape(shape, p, g.mesh.shape, g.coordinate) for p in (self.src, self.grad_src))
        object.__setattr__(self, "_want", want)

    @property
    def moves_value(self) -> bool:
        """Whether forward changes the placement (else it is a copy)."""
        return self.src != self.dst

    @property
    def moves_grad(self) -> bool:
        """Whether backward changes the gradient's placement."""
        return self.grad_src != self.grad_dst

    def local(self, x: torch.Tensor, counter: CollectiveCounter | None = None, *, phase: str = "forward"):
        """``redistribute_local(x, meta, src, dst)``: the moved piece, no autograd history."""
        steps = _checked_steps(x, self.shape, self.src, self.dst, self.groups, self._want[0])
        return _run_steps(x, steps, self.shape, self.src, self.groups, phase, counter)

    def forward_value(self, x: torch.Tensor, counter: CollectiveCounter | None = None) -> torch.Tensor:
        """The value an autograd function's forward gives for ``x``: ``local(x)`` where the placement changes, else a
        view of ``x`` (only the gradient moves): the reader then keeps ``x``'s own storage for backward, as the cost
        model prices an edge that does not move (``cost.saved_shares``), not a copy per call (per micro-batch in
        flight, under a pipeline or accumulation)."""
        return self.local(x, counter) if self.moves_value else x.view_as(x)

    def local_grad(self, grad: torch.Tensor, counter: CollectiveCounter | None = None) -> torch.Tensor:
        """The gradient moved ``grad_src -> grad_dst`` (phase ``"backward"``)."""
        steps = _checked_steps(grad, self.shape, self.grad_src, self.grad_dst, self.groups, self._want[1])
        return _run_steps(grad, steps, self.shape, self.grad_src, self.groups, "backward", counter)

    def check_grad(self, dtype: torch.dtype) -> None:
        """Raise (in forward, on every rank alike) when the gradient's move cannot run on the nested layout."""
        conflict = _steps(TensorMeta(self.shape, dtype), self.grad_src, self.grad_dst, self.groups.mesh.shape)[1]
        if conflict is not None:
            raise ValueError(
                f"redistribute a global {self.shape} tensor: the gradient's move {_fmt(self.grad_src)} -> "
                f"{_fmt(self.grad_dst)} on mesh {self.groups.mesh} cannot run on the nested layout: {conflict}. "
                "Fix: plan this edge through an intermediate placement"
            )

    def __call__(self, x: torch.Tensor, counter: CollectiveCounter | None = None) -> torch.Tensor:
        """Differentiable move of ``x`` (``Redistribute``); without autograd, ``local``."""
        if not (x.requires_grad and torch.is_grad_enabled()):
            return self.local(x, counter)
        self.check_grad(x.dtype)
        return Redistribute.apply(x, self, counter)


class Redistribute(torch.autograd.Function):
    """Autograd redistribution by a ``Move``: forward ``src -> dst``, backward ``grad_src -> grad_dst``.

    Both phases are recorded in ``counter`` (``"forward"`` / ``"backward"``).  A move whose forward keeps the
    placement (only the gradient moves: Megatron's ``f``, a tied or data-parallel weight's gradient reduced where
    one of its readers reads it) gives a view of ``x``, not a copy (``Move.forward_value``).
    """

    @staticmethod
    def forward(ctx, x, move: Move, counter):  # noqa: D102
        ctx.move, ctx.counter = move, counter
        out = move.forward_value(x, counter)
        if not (out.is_floating_point() or out.is_complex()):
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        with ctx.move.groups.collectives("backward"):
            return ctx.move.local_grad(grad, ctx.counter), None, None


def redistribute(
    x: torch.Tensor,
    meta: TensorMeta,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    grad_src: tuple[Placement, ...],
    grad_dst: tuple[Placement, ...],
    groups: MeshGroups,
    counter: CollectiveCounter | None = None,
) -> torch.Tensor:
    """Differentiable ``redistribute_local`` (``Move(meta, src, dst, grad_src, grad_dst, groups)(x, counter)``).

    Both directions are checked up front, so errors surface in forward.
    """
    return Move(meta, src, dst, grad_src, grad_dst, groups)(x, counter)
