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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.pieces import dim_index
from autopar.placement import Placement, Shard
from autopar.spec import TensorMeta

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
        """Global (start, stop) ranges of ``dim`` of input ``input_index`` held by this rank.

        In local order (increasing global order), adjacent ranges merged; the layout
        contract of ``autopar.pieces`` (each axis shards the piece earlier axes left,
        as the rules reason; ``layout.dim_ranges``).
        """
        entries = [
            (p, self.mesh_shape[a], self.coordinate[a])
            for a, p in enumerate(self.input_placements[input_index])
            if isinstance(p, Shard) and p.dim == dim
        ]
        size = self.input_metas[input_index].shape[dim]
        if not entries:
            return [(0, size)]
        idx = dim_index(size, entries)
        if idx.numel() == 0:
            return []
        cuts = (torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1).tolist()
        starts, stops = [0] + cuts, cuts + [idx.numel()]
        return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


KERNELS: dict[str, Callable] = {}


def register_kernel(name: str) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        if name in KERNELS:
            raise AssertionError(f"kernel {name!r} registered twice")
        KERNELS[name] = fn
        return fn

    return deco


# ----------------------------------------------------------------------------- lookup kernels
# Vocab-parallel lookups (strategies in ``autopar.strategies.embedding``): the table
# input is sharded along the looked-up dim, indices are whole; each rank looks up
# the rows it holds and writes zeros elsewhere, so the output is ``P(sum)``.


def _localize(ctx: KernelContext, input_index: int, dim: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global positions on ``dim`` of input ``input_index`` to this rank's local ones.

    Returns ``(local_index, held)``: ``held`` is True where the position lies in one of
    the rank's ranges (``ctx.shard_ranges``, laid side by side in the local piece);
    ``local_index`` is 0 where it does not, so it is always in bounds.
    """
    local = torch.zeros_like(index)
    held = torch.zeros_like(index, dtype=torch.bool)
    offset = 0
    for start, stop in ctx.shard_ranges(input_index, dim):
        inside = (index >= start) & (index < stop)
        local = torch.where(inside, index - start + offset, local)
        held |= inside
        offset += stop - start
    return local, held


def _zero_unheld(out: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    return torch.where(held, out, torch.zeros((), dtype=out.dtype, device=out.device))


@register_kernel("masked_embedding")
def masked_embedding(
    ctx: KernelContext,
    weight_local: torch.Tensor,
    indices: torch.Tensor,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``aten.embedding`` with ``weight`` sharded on dim 0 (vocab): rows not held give zeros.

    ``padding_idx`` is mapped to its local row when this rank holds it (its gradient
    stays zero) and dropped otherwise.  ``scale_grad_by_freq`` counts frequencies
    among the local lookups (positions not held count toward local row 0, whose
    gradient there is zero anyway, so only row 0's scale can differ).
    """
    local, held = _localize(ctx, 0, 0, indices)
    local_pad = -1
    if padding_idx is not None and padding_idx >= 0:
        pad_t = torch.tensor([padding_idx], dtype=indices.dtype, device=indices.device)
        pad_local, pad_held = _localize(ctx, 0, 0, pad_t)
        local_pad = int(pad_local.item()) if bool(pad_held.item()) else -1
    out = torch.ops.aten.embedding.default(weight_local, local, local_pad, scale_grad_by_freq, sparse)
    return _zero_unheld(out, held.unsqueeze(-1))


@register_kernel("masked_gather")
def masked_gather(
    ctx: KernelContext, self_local: torch.Tensor, dim: int, index: torch.Tensor, *, sparse_grad: bool = False
) -> torch.Tensor:
    """``aten.gather`` with ``self`` sharded on the gathered ``dim``: positions not held give zeros."""
    dim = dim % max(self_local.dim(), 1)
    local, held = _localize(ctx, 0, dim, index)
    out = torch.ops.aten.gather.default(self_local, dim, local, sparse_grad=sparse_grad)
    return _zero_unheld(out, held)


@register_kernel("masked_index_select")
def masked_index_select(ctx: KernelContext, self_local: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``aten.index_select`` with ``self`` sharded on ``dim``: positions not held give zeros."""
    dim = dim % max(self_local.dim(), 1)
    local, held = _localize(ctx, 0, dim, index)
    out = torch.ops.aten.index_select.default(self_local, dim, local)
    shape = [1] * out.dim()
    shape[dim] = -1
    return _zero_unheld(out, held.reshape(shape))
