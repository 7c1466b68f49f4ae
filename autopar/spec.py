"""Tensor metadata and sharding specs: what a tensor is, and how the mesh lays it out.

A ``ShardingSpec`` holds one placement per mesh axis.  Several axes may shard the
same dim: they split it in mesh-axis order (axis 0 first, then axis 1 splits each
axis-0 piece), as MindSpore's Layout ``("dp", "tp")`` on one dim and DTensor do.
Local sizes follow ``torch.tensor_split`` (see ``placement.shard_sizes``); cost and
memory use the largest local piece, which rank 0 of each axis holds.  Which global
indices a rank holds is ``layout.dim_ranges`` (nested semantics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .placement import Placement, Replicate, Shard, shard_piece

__all__ = ["TensorMeta", "ShardingSpec", "local_shape", "local_meta"]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of a (global, or local under some placements) tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize if self.dtype is not None else 4

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype is not None and (self.dtype.is_floating_point or self.dtype.is_complex)

    def with_shape(self, shape) -> TensorMeta:
        return TensorMeta(tuple(int(s) for s in shape), self.dtype)

    @classmethod
    def of(cls, t) -> TensorMeta:
        """Meta of a torch tensor (real, meta or fake)."""
        return cls(tuple(int(s) for s in t.shape), t.dtype)


def _split_dim(size: int, placement: Shard, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of a dim under one Shard on an axis of ``parts`` ranks.

    Block-wise shards split each of the ``placement.blocks`` equal blocks; their
    local piece is the concatenation of one piece per block, so ``start`` is the
    offset within the first block.
    """
    blocks = placement.blocks
    block = size // blocks
    start, length = shard_piece(block, parts, index)
    return start, length * blocks


def local_shape(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...] | None = None,
) -> tuple[int, ...]:
    """Local shape at a mesh coordinate (default: all zeros, the largest piece)."""
    out = list(shape)
    coord = coordinate or (0,) * len(mesh_shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            _, out[p.dim] = _split_dim(out[p.dim], p, mesh_shape[axis], coord[axis])
    return tuple(out)


def local_meta(meta: TensorMeta, placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> TensorMeta:
    """Largest local piece of a tensor under the given placements."""
    return meta.with_shape(local_shape(meta.shape, placements, mesh_shape))


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """A tensor's placements, one per mesh axis, with its global meta."""

    placements: tuple[Placement, ...]
    meta: TensorMeta

    def __post_init__(self) -> None:
        for p in self.placements:
            if isinstance(p, Shard) and p.dim >= len(self.meta.shape):
                raise ValueError(f"{p} on a tensor of shape {self.meta.shape}: dim out of range")

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def local_meta(self, mesh_shape: tuple[int, ...]) -> TensorMeta:
        return local_meta(self.meta, self.placements, mesh_shape)

    def __str__(self) -> str:
        return "(" + ", ".join(str(p) for p in self.placements) + ")"
