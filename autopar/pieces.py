"""Pieces of tensors on a mesh: cut a full tensor into one rank's piece under a sharding layout, and glue pieces back.

``shard_tensor`` gives the local piece a mesh coordinate holds under a placement
tuple (one placement per mesh axis); ``combine`` is its inverse over every
coordinate; ``piece_boxes`` describes a piece as the blocks of the global tensor it
holds whole (checkpoints and cross-mesh reshards move boxes).  The strategy
validator uses the first two to simulate a whole mesh in one process; the execution
engine uses ``shard_tensor`` to cut parameters and inputs.

Layout contract (nested, the one ``expand_to_mesh`` and ``spec.local_shape`` use):

- ``Shard(d, blocks)`` on mesh axis ``a`` applies to the *local* tensor the axes
  before ``a`` left: that local dim is viewed as ``blocks`` equal blocks, each is
  split across the axis by ``torch.tensor_split`` sizes, and the rank's piece is
  the concatenation of its part of every block.  Several axes sharding one dim
  therefore nest in mesh-axis order (axis 1 splits the axis-0 piece), exactly as
  a rule on axis 1, which sees the local shapes, reasons.  A rank's elements are
  always in increasing global order (``dim_ranges`` lists them).
- ``Replicate`` leaves the tensor whole; ``combine`` checks the copies are equal.
- ``Partial(op)``: the full value is the ``op``-reduction of the pieces over the
  axis.  Partial axes are applied after the shards, first mesh axis first, so the
  full value is ``reduce_axis0(reduce_axis1(...))``; ``combine`` reduces the last
  Partial axis first.  Mixed sum/max partials are therefore well defined.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .placement import Partial, Placement, Replicate, Shard, shard_piece

__all__ = [
    "Box",
    "shard_tensor",
    "combine",
    "dim_index",
    "dim_ranges",
    "coordinates",
    "piece_boxes",
    "unlayable_reason",
]


def coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every mesh coordinate in row-major order."""
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _check_args(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], what: str
) -> None:
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{what}: {len(placements)} placements {tuple(map(str, placements))} for a mesh of "
            f"{len(mesh_shape)} axes {tuple(mesh_shape)}; give one placement per mesh axis"
        )
    for axis, p in enumerate(placements):
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise TypeError(f"{what}: placement {p!r} on mesh axis {axis} is not a Shard/Replicate/Partial")
        if isinstance(p, Shard) and p.dim >= len(shape):
            raise ValueError(f"{what}: {p} on mesh axis {axis} but the tensor has shape {tuple(shape)}")


def dim_index(size: int, entries: list[tuple[Shard, int, int]], *, where: str = "") -> torch.Tensor:
    """Global indices one rank holds on a dim of ``size``, in local order (nested contract).

    ``entries`` lists ``(shard, axis_size, axis_coordinate)`` in mesh-axis order for
    the axes that shard this dim.  Raises ValueError when a block-wise shard meets
    a local piece that is not a multiple of its blocks.
    """
    idx = torch.arange(size)
    for shard, parts, index in entries:
        n = idx.numel()
        if n % shard.blocks:
            raise ValueError(
                f"{where}{shard}: the local piece of this dim has {n} elements (global {size}), not a "
                f"multiple of {shard.blocks} blocks; use a block count that divides every rank's piece"
            )
        blk = n // shard.blocks
        start, length = shard_piece(blk, parts, index)
        sel = [torch.arange(b * blk + start, b * blk + start + length) for b in range(shard.blocks)]
        idx = idx[torch.cat(sel)]
    return idx


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in idx.tolist():
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _entries(d: int, placements, mesh_shape, coordinate) -> list[tuple[Shard, int, int]]:
    return [(p, mesh_shape[a], coordinate[a]) for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]


def dim_ranges(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
) -> list[list[tuple[int, int]]]:
    """Per tensor dim, the global ``(start, stop)`` runs this coordinate holds, in increasing order."""
    return [
        _runs(dim_index(size, _entries(d, placements, mesh_shape, coordinate), where=f"dim {d}: "))
        for d, size in enumerate(shape)
    ]


@dataclass(frozen=True, slots=True)
class Box:
    """A block of a global tensor held whole by one rank: its global ``offsets`` and ``sizes``, and where
    it starts in that rank's local piece (``local_offsets``)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]


def piece_boxes(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]
) -> tuple[Box, ...]:
    """The boxes the piece at mesh ``coordinate`` under ``placements`` consists of (module docstring).

    Their union is the piece; over every coordinate, the boxes of distinct pieces
    cover the tensor exactly once (replicas repeat the same boxes).  A tensor with
    no elements is one empty box on every rank, so the checkpoint still records it.
    """
    shape = tuple(int(s) for s in shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                f"a tensor of shape {shape} is {p} on mesh axis {axis}: a partial value is not a piece of the "
                "tensor, so it has no boxes; reduce it first (parameters and optimizer state never are partial)"
            )
    if any(s == 0 for s in shape):
        return (Box((0,) * len(shape), shape, (0,) * len(shape)),)
    per_dim = []
    for runs in dim_ranges(shape, tuple(placements), tuple(mesh_shape), tuple(coordinate)):
        local, entries = 0, []
        for start, stop in runs:
            entries.append((start, stop - start, local))
            local += stop - start
        per_dim.append(entries)
    return tuple(
        Box(tuple(e[0] for e in combo), tuple(e[1] for e in combo), tuple(e[2] for e in combo))
        for combo in itertools.product(*per_dim)
    )


def unlayable_reason(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> str | None:
    """Why some mesh coordinate has no piece under ``placements`` (a block count not dividing
    its piece), or None when every coordinate can be laid out."""
    if not any(isinstance(p, Shard) and p.blocks > 1 for p in placements):
        return None  # plain shards always lay out (tensor_split sizes)
    return _unlayable_blocks(tuple(shape), tuple(placements), tuple(mesh_shape))


@functools.lru_cache(maxsize=1 << 16)  # pure, and asked once per transition priced (runtime.redistribute)
def _unlayable_blocks(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> str | None:
    """``unlayable_reason`` where some placement cuts blocks.  A dim's pieces at each shard of it take at most two
    sizes (``shard_piece``: the first ``size % parts`` one more), so the sizes every coordinate reaches are followed
    as a set, a few per level, not per coordinate; only where one is not a multiple of its blocks are the
    coordinates walked, to name the first in row-major order (a mesh of thousands of ranks has thousands)."""
    if all(_blocks_divide(size, d, placements, mesh_shape) for d, size in enumerate(shape)):
        return None
    sharding = {a for a, p in enumerate(placements) if isinstance(p, Shard)}
    # the reason depends only on the sharding axes' indices: the first failing coordinate has 0 on the others
    for coord in coordinates(tuple(s if a in sharding else 1 for a, s in enumerate(mesh_shape))):
        for d, size in enumerate(shape):
            n = size  # dim_index's piece sizes, without building index tensors
            for shard, parts, index in _entries(d, placements, mesh_shape, coord):
                if n % shard.blocks:
                    return (
                        f"dim {d}: {shard}: the local piece of this dim has {n} elements (global {size}), not a "
                        f"multiple of {shard.blocks} blocks; use a block count that divides every rank's piece "
                        f"(mesh coordinate {coord})"
                    )
                n = shard_piece(n // shard.blocks, parts, index)[1] * shard.blocks
    raise AssertionError("a block count failed on the sizes but on no coordinate")  # the two walks disagree


def _blocks_divide(size: int, d: int, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether every piece size of dim ``d`` that any coordinate reaches is a multiple of each shard's blocks."""
    sizes = {size}
    for a, p in enumerate(placements):
        if not (isinstance(p, Shard) and p.dim == d):
            continue
        if any(n % p.blocks for n in sizes):
            return False
        parts = mesh_shape[a]
        sizes = {shard_piece(n // p.blocks, parts, i)[1] * p.blocks for n in sizes for i in {0, parts - 1}}
    return True


def _dim_indices(shape, placements, mesh_shape, coordinate) -> list[torch.Tensor | None]:
    """Per dim the index tensor, or None for a dim no axis shards."""
    out: list[torch.Tensor | None] = []
    for d, size in enumerate(shape):
        entries = _entries(d, placements, mesh_shape, coordinate)
        out.append(dim_index(size, entries, where=f"tensor of shape {tuple(shape)}, dim {d}: ") if entries else None)
    return out


def _generator(seed: int, *key) -> torch.Generator:
    digest = hashlib.sha256(repr((seed,) + key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _partial_piece(
    value: torch.Tensor,
    placements: tuple[Placement, ...],
    axis: int,
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    seed: int | None,
) -> torch.Tensor:
    """This coordinate's piece of ``value`` on a Partial axis (see ``shard_tensor``)."""
    p = placements[axis]
    k = mesh_shape[axis]
    me = coordinate[axis]
    if seed is None:
        if p.op == "sum":
            return value.clone() if me == 0 else torch.zeros_like(value)
        return value.clone()  # max of equal copies is the value: the cheapest valid P(max)
    # Ranks that must agree on this split draw the same noise: key it by what ``value``
    # depends on (shard coordinates, earlier Partial axes), never by Replicate axes or
    # later Partial axes, whose ranks hold identical copies of this split.
    key = tuple(
        c if isinstance(q, Shard) or (isinstance(q, Partial) and b < axis) else None
        for b, (q, c) in enumerate(zip(placements, coordinate, strict=True))
    )
    g = _generator(seed, axis, key, tuple(value.shape))
    work = value.double() if value.dtype != torch.float64 else value
    # noise on the values' own scale: pieces far larger than the value would turn
    # float rounding into apparent errors downstream
    finite = work[torch.isfinite(work)].abs()
    scale = float(finite.mean()) if finite.numel() and float(finite.mean()) > 0 else 1.0
    noise = torch.randn((k,) + tuple(value.shape), generator=g, dtype=torch.float64) * scale
    if p.op == "sum":
        piece = work / k + noise[me] - noise.mean(dim=0)
    else:
        owner = torch.randint(0, k, tuple(value.shape), generator=g)
        piece = torch.where(owner == me, work, work - noise[me].abs() - scale / 8)
    return piece.to(value.dtype)


def shard_tensor(
    full: torch.Tensor,
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    *,
    partial_seed: int | None = None,
) -> torch.Tensor:
    """The local piece of ``full`` held at mesh ``coordinate`` under ``placements`` (one per axis).

    Shards cut index ranges (module docstring); Replicate keeps the tensor whole.
    Partial axes then split the value into pieces whose reduction over the axis
    gives it back: with ``partial_seed`` the pieces are random (sum: random parts
    adding up; max: on each element one random rank holds the value, the others a
    strictly smaller one), deterministic in the seed and identical whichever rank
    asks; without a seed ``P(sum)`` puts the value on coordinate 0 of the axis and
    zeros elsewhere, and ``P(max)`` puts the value on every rank.  Partial is only
    defined for floating tensors.  The result never aliases ``full``.
    """
    placements = tuple(placements)
    mesh_shape = tuple(mesh_shape)
    coordinate = tuple(coordinate)
    _check_args(tuple(full.shape), placements, mesh_shape, "shard_tensor")
    if len(coordinate) != len(mesh_shape) or any(not 0 <= c < s for c, s in zip(coordinate, mesh_shape, strict=False)):
        raise ValueError(f"shard_tensor: coordinate {coordinate} is not on a mesh of shape {mesh_shape}")
    local = full
    for d, idx in enumerate(_dim_indices(tuple(full.shape), placements, mesh_shape, coordinate)):
        if idx is not None:
            local = local.index_select(d, idx)
    local = local.clone() if local is full else local
    for axis, p in enumerate(placements):
        if isinstance(p, Partial):
            if not (full.dtype.is_floating_point or full.dtype.is_complex):
                raise ValueError(
                    f"shard_tensor: {p} on mesh axis {axis} for a {full.dtype} tensor; Partial placements "
                    "need a floating dtype (integer and bool tensors are Shard or Replicate)"
                )
            local = _partial_piece(local, placements, axis, mesh_shape, coordinate, partial_seed)
    return local


def _reduce_axis(
    pieces: dict[tuple[int, ...], torch.Tensor], axis: int, p: Placement, mesh_shape: tuple[int, ...]
) -> dict[tuple[int, ...], torch.Tensor]:
    """Fold one non-Shard axis: reduce (Partial) or check equal (Replicate); the axis coordinate becomes 0."""
    out: dict[tuple[int, ...], torch.Tensor] = {}
    groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
    for c, t in pieces.items():
        groups.setdefault(c[:axis] + (0,) + c[axis + 1 :], []).append((c[axis], t))
    for key, members in groups.items():
        members.sort(key=lambda m: m[0])
        ts = [t for _, t in members]
        shapes = {tuple(t.shape) for t in ts}
        if len(shapes) != 1:
            raise AssertionError(f"mesh axis {axis} ({p}): pieces at {key} have different shapes {sorted(shapes)}")
        if isinstance(p, Replicate):
            ref = ts[0]
            for i, t in enumerate(ts[1:], start=1):
                if not _same(t, ref):
                    diff = _max_abs_diff(t, ref)
                    raise AssertionError(
                        f"mesh axis {axis} is Replicate but the piece at coordinate {i} of the axis "
                        f"(others {key}) differs from coordinate 0: max abs difference {diff:.3g}"
                    )
            out[key] = ref
        elif p.op == "sum":
            out[key] = torch.stack(ts).sum(dim=0).to(ts[0].dtype)
        else:
            out[key] = torch.stack(ts).amax(dim=0)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (replicated copies of a NaN are still copies)."""
    if torch.equal(a, b):
        return True
    if a.dtype != b.dtype or not (a.dtype.is_floating_point or a.dtype.is_complex):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return float((a != b).sum())
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(a.double()) & torch.isnan(b.double()), torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0


def combine(
    pieces: Mapping[tuple[int, ...], torch.Tensor],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    global_shape: tuple[int, ...],
) -> torch.Tensor:
    """Rebuild the full tensor from every coordinate's local piece (inverse of ``shard_tensor``).

    ``pieces`` maps each mesh coordinate to its local tensor.  Partial axes are
    reduced (last Partial axis first), Replicate axes must hold identical pieces
    (AssertionError with the largest difference otherwise), and Shard pieces are
    written back at their global index ranges, blocks included.  A piece whose
    shape does not match its ranges, or a missing coordinate, raises AssertionError.
    """
    placements = tuple(placements)
    mesh_shape = tuple(mesh_shape)
    global_shape = tuple(int(s) for s in global_shape)
    _check_args(global_shape, placements, mesh_shape, "combine")
    missing = [c for c in coordinates(mesh_shape) if c not in pieces]
    if missing:
        raise AssertionError(f"combine: no piece for mesh coordinates {missing[:4]}{'...' if len(missing) > 4 else ''}")
    work = {tuple(c): t for c, t in pieces.items()}
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        if not isinstance(p, Shard):
            work = _reduce_axis(work, axis, p, mesh_shape)
    any_piece = next(iter(work.values()))
    out = torch.empty(global_shape, dtype=any_piece.dtype)
    seen = torch.zeros(global_shape, dtype=torch.int32)
    for c, t in work.items():
        idxs = [
            torch.arange(n) if i is None else i
            for i, n in zip(_dim_indices(global_shape, placements, mesh_shape, c), global_shape, strict=True)
        ]
        want = tuple(i.numel() for i in idxs)
        if tuple(t.shape) != want:
            raise AssertionError(
                f"combine: the piece at coordinate {c} has shape {tuple(t.shape)} but placements "
                f"{tuple(map(str, placements))} of a {global_shape} tensor give it {want}"
            )
        idx = torch.meshgrid(*idxs, indexing="ij") if idxs else ()
        out[idx] = t
        seen[idx] += 1
    if global_shape and not bool((seen == 1).all()):
        raise AssertionError(f"combine: pieces cover some elements {int(seen.max())} times and some not at all")
    return out
