"""The device mesh: an n-D array of ranks with named axes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """An n-D device mesh.

    ``shape`` is the size of each axis, ``axis_names`` names them (default
    ``axis0, axis1, ...``), and ``ranks`` lists the global rank at each mesh
    position in row-major order (default ``0..size-1``; any permutation is allowed,
    so non-contiguous layouts such as MindSpore's work).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    ranks: tuple[int, ...] = field(default=())

    def __init__(self, shape, axis_names=None, ranks=None) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"Mesh shape {shape}: expected one or more axis sizes >= 1, e.g. Mesh((2, 4))")
        names = tuple(axis_names) if axis_names is not None else tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(
                f"Mesh axis_names {names} has {len(names)} names but shape {shape} has {len(shape)} axes; "
                "give one name per axis, e.g. axis_names=('dp', 'tp')"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh axis_names {names}: names must be distinct")
        size = math.prod(shape)
        rank_ids = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
        if sorted(rank_ids) != list(range(size)):
            raise ValueError(f"Mesh ranks {rank_ids}: expected a permutation of 0..{size - 1} for shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "ranks", rank_ids)

    @classmethod
    def from_device_mesh(cls, device_mesh) -> Mesh:
        """The ``Mesh`` of a ``torch.distributed.device_mesh.DeviceMesh``: its shape, dim names and rank layout."""
        ranks = device_mesh.mesh.flatten().tolist()
        if sorted(ranks) != list(range(len(ranks))) or len(ranks) != _world_size(len(ranks)):
            raise ValueError(
                f"DeviceMesh {device_mesh}: autopar needs a mesh over the whole world (ranks 0..world size - 1), "
                f"got ranks {ranks}; pass the root DeviceMesh, not a slice of it"
            )
        return cls(tuple(device_mesh.shape), device_mesh.mesh_dim_names, ranks=ranks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, axis: int | str) -> int:
        """Index of an axis given by position or name; a clear error for unknown names."""
        if isinstance(axis, int):
            if not 0 <= axis < self.ndim:
                raise ValueError(f"mesh axis {axis}: mesh {self} has axes 0..{self.ndim - 1}")
            return axis
        if axis not in self.axis_names:
            raise ValueError(f"mesh axis {axis!r} does not exist; mesh {self} has axes {list(self.axis_names)}")
        return self.axis_names.index(axis)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of a global rank."""
        pos = self.ranks.index(rank)
        coord = []
        for s in reversed(self.shape):
            coord.append(pos % s)
            pos //= s
        return tuple(reversed(coord))

    def axis_groups(self, axis: int | str) -> list[list[int]]:
        """The rank groups along one axis (each group: ranks that differ only on that axis)."""
        a = self.axis_index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            c = self.coordinate(r)
            groups.setdefault(c[:a] + c[a + 1 :], []).append(r)
        return [groups[k] for k in sorted(groups)]

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict) -> Mesh:
        return cls(tuple(d["shape"]), axis_names=tuple(d["axis_names"]), ranks=d.get("ranks"))

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"


def _world_size(default: int) -> int:
    """The default process group's size, or ``default`` when there is none."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else default
