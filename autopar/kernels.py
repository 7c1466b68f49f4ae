"""Local kernels: what a rank computes when a strategy's local op is not the op itself.

Most strategies run the original aten op on local shards.  A few need a different
local computation, named by ``AxisStrategy.kernel``: e.g. a vocab-parallel
embedding looks up only the rows its shard holds and zeroes the rest, giving a
``P(sum)`` output.  A kernel is ``fn(ctx, *local_args, **kwargs) -> local output(s)``
with tensors in ``local_args`` replaced by the rank's local pieces; ``ctx`` says
which global index ranges this rank holds.  Kernels issue no collectives: every
collective is a transition or an ``OpComm`` placed by the plan.

The strategy validator (tests) and the lowering (execution) both call kernels
through ``KERNELS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .mesh import Mesh  # noqa: F401  (documented type of KernelContext.mesh_shape's origin)
from .placement import Placement, Shard
from .spec import TensorMeta, shard_range

__all__ = ["KernelContext", "KERNELS", "register_kernel"]


@dataclass(frozen=True)
class KernelContext:
    """Where this rank sits: mesh shape, its coordinate, and the global inputs' specs.

    ``input_placements[i]`` holds input i's placement on every mesh axis and
    ``input_metas[i]`` its global meta; ``axes`` lists the mesh axes whose strategy
    named this kernel (a kernel may be chosen on some axes and not others).
    """

    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    input_placements: tuple[tuple[Placement, ...], ...]
    input_metas: tuple[TensorMeta, ...]
    axes: tuple[int, ...]

    def shard_ranges(self, input_index: int, dim: int) -> list[tuple[int, int]]:
        """Global (start, stop) ranges of ``dim`` of input ``input_index`` held by this rank."""
        entries = [
            (p, self.mesh_shape[a], self.coordinate[a])
            for a, p in enumerate(self.input_placements[input_index])
            if isinstance(p, Shard) and p.dim == dim
        ]
        return shard_range(self.input_metas[input_index].shape[dim], entries)


KERNELS: dict[str, Callable] = {}


def register_kernel(name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in KERNELS:
            raise AssertionError(f"kernel {name!r} registered twice")
        KERNELS[name] = fn
        return fn

    return deco
