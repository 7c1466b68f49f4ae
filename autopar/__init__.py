"""autopar: a graph compiler that auto-partitions PyTorch models over a device mesh."""

from __future__ import annotations

from .mesh import Mesh
from .placement import Partial, Replicate, Shard, parse_placement, parse_placements
from .spec import ShardingSpec, TensorMeta

__version__ = "0.1.0"

__all__ = ["Mesh", "Shard", "Replicate", "Partial", "parse_placement", "parse_placements", "ShardingSpec", "TensorMeta"]
