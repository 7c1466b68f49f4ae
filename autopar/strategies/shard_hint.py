"""Rule for ``autopar::shard`` (``autopar.shard(x, placements)``): the identity at a fixed spec.

The op's second argument names one placement per mesh axis (``"S(0),R"``).  A
rule sees one mesh axis and not its index, so on every axis it offers the
identity (input placement == output placement) for each placement the spec
names; ``expand_to_mesh`` combines them per axis, and the planner keeps only
the combination equal to the spec (``autopar.planner.hints``: every shard node is a
fixed spec), so the op's one strategy in the search reads and writes exactly
the hinted spec.  The identity is exact under every placement (the local piece
is passed through, a Partial stays the same partial sum), so the contract holds.
"""

from __future__ import annotations

from autopar.placement import Replicate
from autopar.shard_op import SHARD_OP, spec_of

from .base import AxisStrategy, OpCall, register

__all__: list[str] = []


@register(SHARD_OP)
def shard_hint_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Identity strategies for the placements the hinted spec names (``R -> R`` is added by the expansion)."""
    wanted = dict.fromkeys(p for p in spec_of(call.args) if not isinstance(p, Replicate))
    return [AxisStrategy((p,), (p,)) for p in wanted]
