"""``autopar.reshard``: move a sharded tensor from one (mesh, placements) layout to another, sub-meshes included.

    piece = autopar.reshard(piece, src=(Mesh((2,), ranks=(0, 1)), ["S(0)"]),
                            dst=(Mesh((2,), ranks=(2, 3)), ["S(1)"]), shape=(1024, 4096), dtype=torch.float32)

Every rank of the world calls it (SPMD), with the same layouts, shape and dtype;
``value`` is this rank's piece under ``src`` (None on ranks outside ``src``'s
mesh) and the result its piece under ``dst`` (None on ranks outside ``dst``'s).
A ``Mesh`` with ``ranks`` other than ``0..size-1`` is a sub-mesh of the world
(Paddle's ``ProcessMesh``); the two meshes may be disjoint, overlap, or be the same.

It moves the tensor the cheapest way the cost model knows:

- **The same mesh over the whole world**: the collectives of ``transitions(src,
  dst)`` (all-gather, all-to-all, all-reduce, reduce-scatter; ``redistribute_local``),
  one per step, the same moves a plan's edges make, priced as the plan prices them.
- **Otherwise** (sub-meshes, or a layout the nested steps cannot run): point to
  point, the plan of ``plan_transfers`` (pure, identical on every rank):

  * a piece is the boxes of the global tensor it holds (``layout.piece_boxes``);
  * for every box ``D`` of every destination rank ``d``, and every distinct source
    piece (the source ranks that differ only on ``Replicate`` axes hold the same
    one: replicas), each overlap of ``D`` with one of that piece's boxes is one
    *region*, taken from ``d`` itself when ``d`` is one of the replicas (a local
    copy, nothing sent), else from the replica with the fewest elements assigned so
    far (the lowest rank on ties), which spreads the sends over the replicas;
  * a ``Partial`` source is an addend per coordinate of its Partial axes: ``d``
    receives every addend of its regions and reduces them (sum or max) itself;
  * all regions one rank sends another travel as one message, in plan order.

  Every element of a destination piece is thus received once per addend and sent
  by one rank; the bytes each pair exchanges are ``TransferPlan.messages``, and
  ``reshard_cost`` prices them with ``costmodel.transfers_time_s`` (the busiest
  rank's sends or receives on the link between the two ranks).

Checks come first: the layouts (every mesh's ranks inside the world), shape and dtype every rank checks
alike; then each
rank checks its own pieces, and one all-reduce of a flag tells every rank whether
any piece was wrong, so a bad call raises on every rank instead of leaving some
waiting for a message that never comes.

``counter`` records what ran: the collectives (``redistribute_local``), or one
``"send"`` record per message this rank sent to another rank (axis ``-1``, phase
``"reshard"``, the message's bytes), so tests compare them with ``reshard_cost``.
A ``Partial`` destination is refused (reshard to ``R`` and mask it); a source with
``P(sum)`` and ``P(max)`` axes together too (their order of reduction matters).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.mesh import Mesh
from autopar.pieces import Box, coordinates, piece_boxes
from autopar.placement import Partial, Placement, Replicate, Shard, parse_placements
from autopar.spec import TensorMeta, local_shape
from autopar.transitions import transitions
from costmodel import DeviceProfile, collective_time_on_axis_s, transfers_time_s

from .counter import CollectiveCounter
from .groups import MeshGroups
from .redistribute import nesting_conflict, redistribute_local

__all__ = ["Region", "TransferPlan", "ReshardCost", "plan_transfers", "reshard", "reshard_cost", "uses_collectives"]

Layout = tuple[Mesh, tuple[Placement, ...]]


@dataclass(frozen=True, slots=True)
class Region:
    """A block of the global tensor one rank sends another: global ``offsets``/``sizes``, and where it starts
    in the sender's local piece (``src_at``) and in the receiver's (``dst_at``)."""

    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src_at: tuple[int, ...]
    dst_at: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The point-to-point plan of one reshard (module docstring); ``reduce_op`` for a Partial source."""

    regions: tuple[Region, ...]
    addends: int = 1
    reduce_op: str | None = None

    def messages(self, itemsize: int) -> dict[tuple[int, int], int]:
        """(source rank, destination rank) -> bytes sent, for every pair of distinct ranks that exchange any."""
        out: dict[tuple[int, int], int] = {}
        for r in self.regions:
            if r.src_rank != r.dst_rank and r.numel:
                key = (r.src_rank, r.dst_rank)
                out[key] = out.get(key, 0) + r.numel * itemsize
        return out


@dataclass(frozen=True, slots=True)
class ReshardCost:
    """How a reshard runs and what it costs: ``"collectives"`` (the ``steps``' kinds, axes and bytes) or
    ``"p2p"`` (``messages``: source, destination, bytes), and the cost model's ``time_s``."""

    how: str
    time_s: float
    steps: tuple[tuple[str, int, int], ...] = ()
    messages: tuple[tuple[int, int, int], ...] = ()

    @property
    def bytes(self) -> int:
        return sum(b for *_, b in self.steps) + sum(b for *_, b in self.messages)


def _layout(value: Any, what: str, shape: tuple[int, ...]) -> Layout:
    """``(mesh, placements)`` checked: one placement per axis, shard dims inside ``shape``."""
    try:
        mesh, placements = value
    except (TypeError, ValueError):
        raise TypeError(
            f"reshard: {what} {value!r}: expected a (Mesh, placements) pair, e.g. (mesh, ['S(0)', 'R'])"
        ) from None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"reshard: {what} mesh {mesh!r}: expected an autopar.Mesh (ranks= makes a sub-mesh)")
    pl = parse_placements(placements)
    if len(pl) != mesh.ndim:
        raise ValueError(
            f"reshard: {what} has {len(pl)} placements {[str(p) for p in pl]} for {mesh} with {mesh.ndim} axes; "
            "give one placement per mesh axis"
        )
    bad = [p for p in pl if isinstance(p, Shard) and p.dim >= len(shape)]
    if bad:
        raise ValueError(f"reshard: {what} shards dim {bad[0].dim} of a tensor of shape {shape}; use a dim it has")
    return mesh, pl


def _partial_op(placements: tuple[Placement, ...], what: str) -> str | None:
    ops = {p.op for p in placements if isinstance(p, Partial)}
    if len(ops) > 1:
        raise ValueError(
            f"reshard: {what} {[str(p) for p in placements]} mixes P(sum) and P(max) axes, whose reduction order "
            "matters; reduce one kind first (reshard to R on those axes)"
        )
    return next(iter(ops), None)


def _overlap(a: Box, b: Box) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of the intersection of two boxes, or None when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def plan_transfers(shape: tuple[int, ...], src: Layout, dst: Layout) -> TransferPlan:
    """The point-to-point plan taking every destination piece from the source pieces (module docstring)."""
    shape = tuple(int(s) for s in shape)
    (smesh, spl), (dmesh, dpl) = src, dst
    if any(isinstance(p, Partial) for p in dpl):
        raise ValueError(
            f"reshard: destination {[str(p) for p in dpl]} is partial; a reshard delivers values, not addends: "
            "reshard to R on that axis (every rank of it then holds the value)"
        )
    op = _partial_op(spl, "source")
    geometry = tuple(Replicate() if isinstance(p, Partial) else p for p in spl)
    # source ranks by (their piece, their addend): the ranks of one group are replicas of each other
    groups: dict[tuple, list[int]] = {}
    for coord, rank in zip(coordinates(smesh.shape), smesh.ranks, strict=True):  # both row-major
        piece = tuple(c for c, p in zip(coord, spl, strict=True) if isinstance(p, Shard))
        addend = tuple(c for c, p in zip(coord, spl, strict=True) if isinstance(p, Partial))
        groups.setdefault((piece, addend), []).append(rank)
    boxes = {
        key: piece_boxes(shape, geometry, smesh.shape, smesh.coordinate(ranks[0])) for key, ranks in groups.items()
    }
    assigned: dict[int, int] = {}
    regions: list[Region] = []
    for d_coord, d in zip(coordinates(dmesh.shape), dmesh.ranks, strict=True):
        for dbox in piece_boxes(shape, dpl, dmesh.shape, d_coord):
            for key in sorted(groups):
                replicas = groups[key]
                for sbox in boxes[key]:
                    met = _overlap(dbox, sbox)
                    if met is None:
                        continue
                    offsets, sizes = met
                    s = d if d in replicas else min(replicas, key=lambda r: (assigned.get(r, 0), r))
                    n = math.prod(sizes)
                    if s != d:
                        assigned[s] = assigned.get(s, 0) + n
                    regions.append(
                        Region(
                            s,
                            d,
                            offsets,
                            sizes,
                            tuple(lo + o - so for lo, o, so in zip(sbox.local_offsets, offsets, sbox.offsets)),
                            tuple(lo + o - do for lo, o, do in zip(dbox.local_offsets, offsets, dbox.offsets)),
                        )
                    )
    addends = math.prod(n for n, p in zip(smesh.shape, spl, strict=True) if isinstance(p, Partial))
    return TransferPlan(tuple(regions), addends, op)


def uses_collectives(shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout, world_size: int) -> bool:
    """Whether the reshard runs as collectives: one mesh over the whole world, and steps the nested layout runs."""
    (smesh, spl), (dmesh, dpl) = src, dst
    if (smesh.shape, smesh.ranks) != (dmesh.shape, dmesh.ranks) or not smesh.is_world(world_size):
        return False
    return nesting_conflict(TensorMeta(tuple(shape), dtype), spl, dpl, smesh.shape) is None


def reshard_cost(
    shape: tuple[int, ...], dtype: torch.dtype, src: Any, dst: Any, profile: DeviceProfile, *, world_size: int
) -> ReshardCost:
    """How ``reshard`` moves a ``shape`` tensor of ``dtype`` from ``src`` to ``dst`` in a world of ``world_size``
    ranks, and what the cost model says it takes (module docstring)."""
    shape = tuple(int(s) for s in shape)
    src, dst = _layout(src, "src", shape), _layout(dst, "dst", shape)
    if uses_collectives(shape, dtype, src, dst, world_size):
        mesh = src[0]
        steps = tuple(
            (st.kind, st.axis, st.bytes) for st in transitions(TensorMeta(shape, dtype), src[1], dst[1], mesh.shape)
        )
        time_s = sum(
            collective_time_on_axis_s(k, b, mesh_shape=mesh.shape, axis=a, profile=profile) for k, a, b in steps
        )
        return ReshardCost("collectives", time_s, steps=steps)
    sent = plan_transfers(shape, src, dst).messages(dtype.itemsize)
    messages = tuple((a, b, n) for (a, b), n in sorted(sent.items()))
    return ReshardCost("p2p", transfers_time_s(messages, profile), messages=messages)


def _slices(at: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + s) for a, s in zip(at, sizes, strict=True))


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def _p2p(
    x: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    src: Layout,
    dst: Layout,
    counter: CollectiveCounter | None,
) -> torch.Tensor | None:
    """This rank's part of ``plan_transfers``: pack and send, receive and place (or reduce)."""
    me = dist.get_rank()
    plan = plan_transfers(shape, src, dst)
    dmesh, dpl = dst
    device = x.device if x is not None else _device()
    out = None
    if me in dmesh.ranks:
        want = local_shape(shape, dpl, dmesh.shape, dmesh.coordinate(me))
        if plan.reduce_op == "max":  # Partial placements are floating (layout.shard_tensor)
            out = torch.full(want, -math.inf, dtype=dtype, device=device)
        else:
            out = torch.zeros(want, dtype=dtype, device=device)
    outgoing: dict[int, list[Region]] = {}
    incoming: dict[int, list[Region]] = {}
    for r in plan.regions:
        if r.src_rank == me and r.dst_rank != me:
            outgoing.setdefault(r.dst_rank, []).append(r)
        elif r.dst_rank == me and r.src_rank != me:
            incoming.setdefault(r.src_rank, []).append(r)
        elif r.src_rank == me:  # a local copy
            _place(out, r, x[_slices(r.src_at, r.sizes)], plan.reduce_op)
    ops, sends, recvs = [], [], {}
    for peer, regions in sorted(outgoing.items()):
        buf = _wire(torch.cat([x[_slices(r.src_at, r.sizes)].reshape(-1) for r in regions]).contiguous())
        sends.append(buf)
        ops.append(dist.P2POp(dist.isend, buf, peer))
        if counter is not None:
            counter.record("send", -1, "reshard", buf.numel() * dtype.itemsize)
    for peer, regions in sorted(incoming.items()):
        n = sum(r.numel for r in regions)
        recvs[peer] = torch.empty(n, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, recvs[peer], peer))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for peer, regions in incoming.items():
        flat, at = recvs[peer].to(dtype), 0
        for r in regions:
            _place(out, r, flat[at : at + r.numel].view(r.sizes), plan.reduce_op)
            at += r.numel
    return out


def _place(out: torch.Tensor, r: Region, values: torch.Tensor, op: str | None) -> None:
    target = out[_slices(r.dst_at, r.sizes)]
    if op == "sum":
        target.add_(values)
    elif op == "max":
        torch.maximum(target, values, out=target)
    else:
        target.copy_(values)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class _Job:
    """One tensor's reshard on this rank, checked as far as every rank can check it alike."""

    value: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout

    def piece_error(self, me: int) -> str | None:
        """Why ``value`` is not this rank's source piece (only this rank can tell), or None."""
        smesh, spl = self.src
        if me not in smesh.ranks:
            return None
        want = local_shape(self.shape, spl, smesh.shape, smesh.coordinate(me))
        got = None if self.value is None else tuple(self.value.shape)
        if got == want:
            return None
        return (
            f"reshard: rank {me} is at {smesh.coordinate(me)} of the source {smesh} and holds {got}, but "
            f"{[str(p) for p in spl]} of a {self.shape} tensor gives it a piece of shape {want}; pass its piece"
        )


def _job(value, src, dst, shape, dtype, world: int) -> _Job:
    """The checks every rank makes alike (layouts, shape, dtype), so a bad call fails everywhere at once."""
    if shape is None:
        raise ValueError("reshard: shape= (the global shape) is required: ranks outside the source hold no piece")
    shape = tuple(int(s) for s in shape)
    src, dst = _layout(src, "src", shape), _layout(dst, "dst", shape)
    for (mesh, _), what in ((src, "source"), (dst, "destination")):
        outside = [r for r in mesh.ranks if not 0 <= r < world]
        if outside:  # no rank could answer their messages: every rank refuses the call before any is sent
            raise ValueError(
                f"reshard: the {what} {mesh} holds ranks {mesh.ranks}, but ranks {outside} are outside the world "
                f"of {world} (ranks 0..{world - 1}); give the mesh ranks of this world, e.g. "
                f"Mesh({mesh.shape}, ranks={tuple(range(min(mesh.size, world)))}) where the sizes allow"
            )
    if dtype is None and not src[0].is_world(world):
        raise ValueError(
            f"reshard: the source {src[0]} holds ranks {src[0].ranks} of a world of {world}; the others have no "
            "piece to take the dtype from: pass dtype="
        )
    if any(isinstance(p, Partial) for p in dst[1]):
        plan_transfers(shape, src, dst)  # raises with the fix
    if dtype is None:
        dtype = value.dtype if value is not None else torch.float32  # no piece here: _agree refuses the call
    elif value is not None and value.dtype != dtype:
        value = value.to(dtype)  # dtype= is the result's: a piece in another dtype is converted first
    return _Job(value, shape, dtype, src, dst)


def _agree(errors: list[str], me: int) -> None:
    """Raise on every rank when any rank found an error in its own pieces (one all-reduce when none did)."""
    device = _device()
    flag = torch.tensor([1 if errors else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    if errors:
        raise ValueError(errors[0])
    bad = [r for r, e in enumerate(everyone) if e]
    raise ValueError(f"reshard: rank(s) {bad} were not given their source pieces: {everyone[bad[0]][0]}")


def _run(job: _Job, counter, groups) -> torch.Tensor | None:
    (smesh, spl), (_, dpl) = job.src, job.dst
    if uses_collectives(job.shape, job.dtype, job.src, job.dst, dist.get_world_size()):
        groups = groups if groups is not None and groups.mesh == smesh else MeshGroups(smesh)
        meta = TensorMeta(job.shape, job.dtype)
        return redistribute_local(job.value, meta, spl, dpl, groups, phase="reshard", counter=counter)
    return _p2p(job.value, job.shape, job.dtype, job.src, job.dst, counter)


def reshard(
    value: torch.Tensor | Mapping[str, torch.Tensor | None] | None,
    src: Any,
    dst: Any,
    *,
    shape: tuple[int, ...] | Mapping[str, tuple[int, ...]] | None = None,
    dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
    counter: CollectiveCounter | None = None,
    groups: MeshGroups | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None] | None:
    """This rank's piece under ``dst`` of the tensor whose piece under ``src`` is ``value`` (module docstring).

    ``src``/``dst`` are ``(Mesh, placements)`` pairs (placements as ``["S(0)", "R"]``
    or ``Placement`` objects).  A mapping ``value`` reshards a state dict: ``shape``
    (and ``dtype``, where given) are then mappings too, and ``src``/``dst`` one layout
    for every entry or a mapping of them; entries go in sorted key order, the same on
    every rank.  ``dtype`` is the result's: a piece held in another dtype is converted (it is required where
    some rank holds no source piece).  ``groups`` reuses a ``MeshGroups`` of the source mesh for the
    collective path (else one is made, which is itself collective).  Collective over
    the world: every rank calls it with the same layouts, shapes and dtypes.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("reshard: no default process group; call it on every rank of an initialized world")
    me, world = dist.get_rank(), dist.get_world_size()
    single = not isinstance(value, Mapping) and not isinstance(shape, Mapping)
    if single:
        jobs = {None: _job(value, src, dst, shape, dtype, world)}
    else:
        if not isinstance(shape, Mapping):
            raise TypeError("reshard of a state dict: pass shape= as a mapping of the same keys to global shapes")
        values = value or {}
        pick = lambda m, k: m[k] if isinstance(m, Mapping) else m  # noqa: E731
        jobs = {
            k: _job(values.get(k), pick(src, k), pick(dst, k), shape[k], pick(dtype, k), world) for k in sorted(shape)
        }
    _agree([e for job in jobs.values() if (e := job.piece_error(me))], me)
    out = {k: _run(job, counter, groups) for k, job in jobs.items()}
    return out[None] if single else out
