"""Rules for tensor factories: ops whose output does not depend on any input's values.

``arange``, ``zeros``, ``ones``, ``full``, ``empty``, ``scalar_tensor`` take no
tensor input; ``new_ones``/``new_zeros``/``new_full``/``new_empty`` take one that
only supplies dtype and device.  Their output is replicated by construction:
every rank builds the same (small: position ids, masks, scalars) tensor, which
costs no communication, so ``R`` is the only output placement offered.  These
ops are registered so the planner reports them as reasoned, not as "fallback".

``zeros_like``/``ones_like``/``full_like``/``empty_like`` take their shape from
their input, so a shard of the input gives the same shard of the output.

Because ``new_*`` and ``*_like`` never read their input's values, the input may have any
placement (every ``S(d)``, ``P(sum)``, ``P(max)``, ``R``): requiring ``R`` would
make the planner all-gather a tensor only its dtype is taken from.

Random factories (``rand``, ``randn``, ...) are deliberately absent: ``R`` would
need the same RNG stream on every rank, which the lowering does not promise.
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard

from .base import AxisStrategy, OpCall, register

__all__: list[str] = []

aten = torch.ops.aten
_R = Replicate()


@register(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.zeros.default,
    aten.ones.default,
    aten.full.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
)
def factory_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """No tensor input: the output is built whole on every rank (``R``; added by ``expand_to_mesh``)."""
    return []


@register(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
def new_factory_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """``self.new_*(size)``: any input placement, output ``R`` (only ``self``'s dtype/device are read)."""
    src = call.inputs[0]
    ins = [Shard(d) for d in range(src.ndim)] + [Partial("sum"), Partial("max")]
    return [AxisStrategy((p,), (_R,) * len(call.outputs)) for p in ins]


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default)
def like_factory_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """``*_like(self)``: the output has ``self``'s shape and a constant value.

    ``S(d) -> S(d)``: each rank builds its piece's shape.  ``P(op) -> R``: the
    pieces all have the full shape and the constant is the same everywhere.
    """
    src = call.inputs[0]
    strategies = [AxisStrategy((Shard(d),), (Shard(d),)) for d in range(src.ndim)]
    return strategies + [AxisStrategy((Partial(op),), (_R,)) for op in ("sum", "max")]
