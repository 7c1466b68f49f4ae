"""Rules for normalizations and dropout: layer_norm, native_layer_norm, rms_norm, _fused_rms_norm,
group_norm, dropout, native_dropout.

Normalizations compute statistics over their trailing ``normalized_shape`` dims
(group_norm: over each sample's groups), so only the *leading* dims may be sharded:
input ``S(d)``, every output ``S(d)`` (the saved mean/rstd of the native forms keep
the leading dims), weight and bias ``R``.  Sharding a normalized dim would need
the statistics all-reduced; that is a kernel with an ``OpComm``, not offered here.
None of them is linear, so no Partial.

Dropout is elementwise: ``S`` on any dim (the mask of ``native_dropout`` alike),
never Partial (the mask would scale each rank's piece differently).  Masks are
drawn by the execution's RNG policy: ranks that hold a tensor replicated on an
axis must draw the same mask there (same seed on the axis), ranks holding
different shards draw their own part (offset seeds).  The validator checks
dropout with ``p=0`` or ``train=False``, where it is deterministic.
"""

from __future__ import annotations

import torch

from autopar.placement import Placement, Replicate, Shard

from .base import AxisStrategy, OpCall, register
from .pointwise import arg, hinted_blocks, resolve_ops

__all__ = ["leading_dim_strategies"]

aten = torch.ops.aten
R = Replicate()


def leading_dim_strategies(call: OpCall, axis_size: int, n_leading: int) -> list[AxisStrategy]:
    """``S(d)`` on input 0 and every output for each of the first ``n_leading`` dims; other inputs ``R``."""
    x = call.inputs[0]
    rest: tuple[Placement, ...] = (R,) * (len(call.inputs) - 1)
    out = []
    for d in range(min(n_leading, x.ndim)):
        if x.shape[d] < axis_size or any(o.ndim <= d or o.shape[d] != x.shape[d] for o in call.outputs):
            continue
        for blocks in [1] + hinted_blocks(call, 0, d):
            if x.shape[d] % blocks == 0:
                out.append(AxisStrategy((Shard(d, blocks),) + rest, (Shard(d, blocks),) * len(call.outputs)))
    return out


@register(
    *resolve_ops(["layer_norm.default", "native_layer_norm.default", "rms_norm.default", "_fused_rms_norm.default"])
)
def layer_norm_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """layer_norm / rms_norm families: S on the dims before ``normalized_shape``; weight, bias R."""
    normalized = arg(call, 1, "normalized_shape")
    n = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    return leading_dim_strategies(call, axis_size, call.inputs[0].ndim - n)


@register(*resolve_ops(["group_norm.default"]))
def group_norm_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """group_norm: statistics per sample and group, so only the batch dim (0) may be sharded."""
    return leading_dim_strategies(call, axis_size, 1)


@register(*resolve_ops(["dropout.default", "native_dropout.default"]))
def dropout_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """dropout: S on any dim (mask included), never Partial; masks follow the RNG policy above."""
    x = call.inputs[0]
    return leading_dim_strategies(call, axis_size, x.ndim)
