"""Fake values for graphs capture copies: a fresh meta storage, a fake tensor laid on a given storage, and the
node-name pattern of export's counters.

``batch`` (a symbolic graph specialized at a batch) and ``stamp`` (a layer's program repeated to the full depth)
both copy an exported graph with new ``meta["val"]`` fake tensors whose storages must be shared exactly where the
values they stand for share theirs (``saved.storage_roots`` reads views from them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["NUMBERED", "fake_on", "meta_storage"]

#: a node name with export's counter: ``add_3`` is ("add", "3"); the first of a base has none
NUMBERED = re.compile(r"^(.*)_(\d+)$")


def meta_storage(nbytes: int) -> torch.UntypedStorage:
    """A new storage of ``nbytes`` on the meta device."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()


def fake_on(
    like: torch.Tensor, storage, offset: int, size: Sequence[int], stride: Sequence[int], mode: FakeTensorMode
) -> torch.Tensor:
    """A fake tensor of ``like``'s dtype, device and ``requires_grad`` at ``offset`` of ``storage`` with ``size`` and
    ``stride``, in ``mode``."""
    meta = torch.empty(0, dtype=like.dtype, device="meta").set_(storage, offset, size, stride)
    return FakeTensor(mode, meta.requires_grad_(like.requires_grad), like.device)
