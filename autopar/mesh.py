"""The device mesh: an n-D array of ranks with named axes."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Mesh"]


@dataclass(frozen=True, slots=True)
class Mesh:
    """An n-D device mesh.

    ``shape`` is the size of each axis: an int (one axis) or a tuple of ints, each
    ``>= 1`` (``Mesh((2, 4))``; the CLI's ``--mesh 2x4``).  ``axis_names`` names the
    axes: a tuple of distinct, non-empty strings, or one string, which is one name
    (``"dp"``) or names joined by commas as the CLI's ``--axis-names`` takes them
    (``"dp,tp"``); default ``axis0, axis1, ...``.  ``ranks`` lists the global rank at
    each mesh position in row-major order (default ``0..size-1``; any order is
    allowed, so non-contiguous layouts such as MindSpore's work).  Distinct ranks
    other than ``0..size-1`` make a sub-mesh of a larger world (Paddle's
    ``ProcessMesh``): ``autopar.reshard`` moves tensors between sub-meshes, while
    planning and ``compile`` run on a mesh over the whole world (``MeshGroups``
    checks it).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    ranks: tuple[int, ...] = field(default=())

    def __init__(
        self,
        shape: int | Sequence[int],
        axis_names: str | Sequence[str] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        shape = _shape(shape)
        names = _axis_names(axis_names, len(shape))
        if len(names) != len(shape):
            raise ValueError(
                f"Mesh axis_names {names} has {len(names)} names but shape {shape} has {len(shape)} axes; "
                "give one name per axis, e.g. axis_names=('dp', 'tp')"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"Mesh axis_names {names}: names must be distinct; rename the repeated axis")
        size = math.prod(shape)
        rank_ids = tuple(range(size)) if ranks is None else tuple(_int(r, "Mesh ranks", ranks) for r in ranks)
        if len(rank_ids) != size or len(set(rank_ids)) != size or min(rank_ids) < 0:
            raise ValueError(
                f"Mesh ranks {rank_ids}: expected {size} distinct global ranks >= 0 for shape {shape}, one per mesh "
                f"position in row-major order (e.g. a permutation of 0..{size - 1})"
            )
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

    def is_world(self, world_size: int) -> bool:
        """Whether the mesh holds every rank of a world of ``world_size`` (not a sub-mesh of it)."""
        return sorted(self.ranks) == list(range(world_size))

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

    def axis_groups(self, axis: int | str | tuple[int, ...]) -> list[list[int]]:
        """The rank groups along one axis (each group: ranks that differ only on that axis), or along several axes
        flattened into one (a tuple: ranks that differ only on those axes)."""
        axes = {self.axis_index(a) for a in axis} if isinstance(axis, tuple) else {self.axis_index(axis)}
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            c = self.coordinate(r)
            groups.setdefault(tuple(x for k, x in enumerate(c) if k not in axes), []).append(r)
        return [groups[k] for k in sorted(groups)]

    def axis_label(self, axis: int | tuple[int, ...]) -> str:
        """The name a collective on ``axis`` is listed under: the axis's, or ``dp+tp`` for one collective over
        several axes' groups flattened into one (``Plan.flat_grad_axes``)."""
        return self.axis_names[axis] if isinstance(axis, int) else "+".join(self.axis_names[a] for a in axis)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict) -> Mesh:
        """The inverse of ``to_dict``; a missing or malformed field is a ``ValueError`` naming it."""
        if not isinstance(d, dict) or "shape" not in d:
            raise ValueError(f"mesh {d!r}: expected a table with 'shape' (and 'axis_names', 'ranks')")
        try:
            return cls(d["shape"], axis_names=d.get("axis_names"), ranks=d.get("ranks"))
        except TypeError as e:
            raise ValueError(str(e)) from None

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"


def _int(value, what: str, given) -> int:
    """``value`` as an int; floats (``2.5``, even ``2.0``), bools and strings are a ``TypeError`` naming ``what``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} {given!r}: {value!r} is a bool; expected whole numbers, e.g. Mesh((2, 4))")
    try:
        return operator.index(value)  # ints, numpy and torch integers; never truncates a float
    except TypeError:
        raise TypeError(
            f"{what} {given!r}: {value!r} is a {type(value).__name__}; expected whole numbers, e.g. Mesh((2, 4))"
        ) from None


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, str):
        raise TypeError(
            f"Mesh shape {shape!r}: expected an int or a tuple of ints, not a string; "
            f"the CLI's --mesh 2x4 is Mesh((2, 4)) in Python"
        )
    try:
        sizes = (operator.index(shape),) if not isinstance(shape, bool) else None
    except TypeError:
        sizes = None
    if sizes is None:
        if not hasattr(shape, "__iter__"):
            _int(shape, "Mesh shape", shape)  # raises, naming the type
        sizes = tuple(_int(s, "Mesh shape", shape) for s in shape)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"Mesh shape {sizes}: expected one or more axis sizes >= 1, e.g. Mesh((2, 4))")
    return sizes


def _axis_names(axis_names, ndim: int) -> tuple[str, ...]:
    if axis_names is None:
        return tuple(f"axis{i}" for i in range(ndim))
    if isinstance(axis_names, str):  # "dp" is one name, "dp,tp" two (the CLI's --axis-names form)
        names = tuple(n.strip() for n in axis_names.split(","))
    elif isinstance(axis_names, Sequence):
        names = tuple(axis_names)
    else:
        raise TypeError(
            f"Mesh axis_names {axis_names!r}: expected a tuple of strings or one string, e.g. ('dp', 'tp') or 'dp,tp'"
        )
    if wrong := [n for n in names if not isinstance(n, str)]:
        raise TypeError(
            f"Mesh axis_names {names}: {wrong[0]!r} is a {type(wrong[0]).__name__}; expected strings, "
            "e.g. axis_names=('dp', 'tp')"
        )
    if bad := [n for n in names if not n.strip()]:
        raise ValueError(
            f"Mesh axis_names {names}: {bad[0]!r} is not a name; give one non-empty string per axis, "
            "e.g. axis_names=('dp', 'tp')"
        )
    return names


def _world_size(default: int) -> int:
    """The default process group's size, or ``default`` when there is none."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else default
