"""``autopar.shard(x, placements)``: an activation hint written in the model's own code.

It is the identity on values: run unpartitioned, the model computes exactly what
it did before (one copy of ``x``).  Traced by ``torch.export`` (non-strict) it
stays in the graph as the custom op ``torch.ops.autopar.shard.default`` with the
placements as a string argument (``"S(0),R"``), so the planner fixes the tensor's
spec there: the op's only strategy reads and writes that spec
(``strategies.shard_hint``), and the search places whatever collectives it takes to
get there and away.  Executed by ``autopar.compile`` it is the identity on the
local piece.  Its gradient passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .placement import Placement, format_placements, parse_placements

__all__ = ["shard", "SHARD_OP", "spec_of"]


@torch.library.custom_op("autopar::shard", mutates_args=())
def _shard_op(x: torch.Tensor, placements: str) -> torch.Tensor:
    return x.clone()  # a custom op may not return its input; one copy is the price of the marker


@_shard_op.register_fake
def _shard_fake(x: torch.Tensor, placements: str) -> torch.Tensor:
    return torch.empty_like(x)


def _shard_backward(ctx, grad: torch.Tensor):
    return grad, None


_shard_op.register_autograd(_shard_backward)

#: The traced op (what an fx node's ``target`` is).
SHARD_OP = torch.ops.autopar.shard.default


def shard(x: torch.Tensor, placements: Sequence[str | Placement] | str) -> torch.Tensor:
    """Mark ``x`` to be laid out as ``placements`` (one per mesh axis: ``["S(0)", "R"]``).

    A ``Layout`` result (``autopar.Layout``) is accepted too.  Returns a tensor
    equal to ``x``.  The placements are checked against the mesh and the tensor's
    shape when the model is planned (``autopar.planner.hints``).
    """
    to_placements = getattr(placements, "placements", None)
    parsed = to_placements() if callable(to_placements) else parse_placements(placements)
    return _shard_op(x, ",".join(format_placements(parsed)))


def spec_of(node_args: tuple) -> tuple[Placement, ...]:
    """The placements a traced ``autopar::shard`` call carries (its second argument)."""
    return parse_placements(node_args[1])
