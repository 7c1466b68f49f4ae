"""``PieceTensor``: one rank's piece of a sharded tensor, as torch's distributed checkpoint (DCP) reads and writes it.

A ``PieceTensor`` has the *global* shape and dtype of the value it stands for and
holds only this rank's piece of it (``local``) under a placement tuple on the
mesh (``layout.py``'s nested contract: uneven ``tensor_split`` shards and
block-wise ``S(d)[b]`` shards included).  It carries no data of its own: it is a
wrapper subclass (``_make_wrapper_subclass``) that implements DCP's
``_Checkpointable`` protocol, the same extension point ``DTensor`` uses:

- ``__create_write_items__`` lists one DCP ``SHARD`` write item per *box* this
  rank holds: a box is a product of one run of consecutive global indices per
  dim (``layout.dim_ranges``).  A plain or uneven shard is one box; a block-wise
  shard is one box per block; a replicated tensor is one box covering it all, on
  every rank of the replicas, and DCP's ``dedup_save_plans`` writes it once
  (``layout.piece_boxes``).
- ``__create_chunk_list__`` lists the same boxes for loading: DCP's read planner
  intersects them with the chunks of the checkpoint, whatever layout wrote it, so
  loading under another plan, mesh or world size is a reshard.
- ``__get_tensor_shard__`` returns the box as a ``narrow`` view of ``local``:
  saving reads this rank's piece without a copy of the whole value, and loading
  writes into the live tensor in place.

Boxes are found by their global offsets (DCP rewrites the index hint of a write
item to its position in the checkpoint's chunk list, so the hint is not ours).
Ops other than detaching, copying to a device and cloning raise
``NotImplementedError`` with the reason: a ``PieceTensor`` is a checkpoint handle, not a distributed tensor
(``local`` is the piece to compute with).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.pieces import Box, piece_boxes
from autopar.placement import Placement

__all__ = ["Box", "PieceTensor", "piece_boxes"]

aten = torch.ops.aten


class PieceTensor(torch.Tensor):
    """A tensor of the global shape that holds one rank's piece (``local``) made of ``boxes`` (module docstring)."""

    local: torch.Tensor
    boxes: tuple[Box, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: tuple[int, ...], boxes: tuple[Box, ...]) -> PieceTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=local.dtype, device=local.device, requires_grad=False
        )
        out.local = local
        out.boxes = tuple(boxes)
        return out

    def __init__(self, local: torch.Tensor, shape: tuple[int, ...], boxes: tuple[Box, ...]) -> None:
        held = sum(_numel(b.sizes) for b in boxes)
        if held != local.numel():
            raise AssertionError(
                f"PieceTensor of global shape {tuple(shape)}: its boxes hold {held} elements but the local piece "
                f"has shape {tuple(local.shape)} ({local.numel()} elements)"
            )

    @classmethod
    def of(
        cls,
        local: torch.Tensor,
        shape: tuple[int, ...],
        placements: tuple[Placement, ...],
        mesh_shape: tuple[int, ...],
        coordinate: tuple[int, ...],
    ) -> PieceTensor:
        """The piece ``local`` of a ``shape`` tensor, held at ``coordinate`` under ``placements``."""
        return cls(local.detach(), shape, piece_boxes(shape, placements, mesh_shape, coordinate))

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return (
            f"PieceTensor(shape={tuple(self.shape)}, dtype={self.dtype}, local={tuple(self.local.shape)}, "
            f"boxes={len(self.boxes)})"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        this = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return PieceTensor(this.local.detach(), tuple(this.shape), this.boxes)
        if func in (aten._to_copy.default, aten.clone.default):  # DCP's staging copies (async_save) do this
            local = func(this.local, *args[1:], **kwargs)
            return PieceTensor(local, tuple(this.shape), this.boxes)
        raise NotImplementedError(
            f"{func} on a PieceTensor of global shape {tuple(this.shape)}: a PieceTensor is one rank's piece of a "
            "sharded value, made for torch.distributed.checkpoint; compute on its .local piece, or gather the "
            "full value with ShardedModule.full_state_dict()"
        )

    # ---- torch.distributed.checkpoint's _Checkpointable protocol --------------------------------
    def __create_write_items__(self, fqn: str, object: object) -> list[WriteItem]:  # noqa: A002, D105
        props = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for b in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:  # noqa: D105
        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:  # noqa: D105
        offsets = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
        for b in self.boxes:
            if b.offsets == offsets:
                return self.box(b)
        raise ValueError(
            f"{index.fqn}: this rank holds no box at global offsets {offsets} of the {tuple(self.shape)} tensor "
            f"(its boxes start at {[b.offsets for b in self.boxes]})"
        )

    def box(self, b: Box) -> torch.Tensor:
        """The elements of box ``b`` as a view of ``local`` (an empty box: an empty tensor, nothing to move)."""
        if 0 in b.sizes:
            return self.local.new_empty(b.sizes)
        view = self.local
        for d, (start, size) in enumerate(zip(b.local_offsets, b.sizes, strict=True)):
            if (start, size) != (0, view.shape[d]):
                view = view.narrow(d, start, size)
        return view


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
