"""Pricing a decomposed cross-entropy that lowering may run fused, as one log-softmax.

``decompose.py`` rewrites ``cross_entropy_loss`` before planning into its
log-sum-exp pieces, so the search can shard the class dim (Megatron's
vocab-parallel loss).  Where the plan keeps the classes whole (every logit role
placed ``R`` or ``S(0)`` on every axis, nothing moved between them), lowering
runs the group as one log-softmax instead (``autopar/lower/fused_loss.py`` has
the rule and the fused form): same value, gradients and moves.

Memory: fused, backward keeps one (N, C) tensor per rank (the log-softmax; the
gather keeps the same storage) where the pieces keep two (``exp``'s output and
the shifted logits the ``gather`` reads).  ``prices_as_fused`` and
``fused_keeps`` say, for the cost model's edge terms, when the gather's edge
keeps nothing of its own (``cost.Coster.edge_saved_bytes``).
"""

from __future__ import annotations

from torch import fx

from autopar.capture import DECOMPOSED, CrossEntropyPart
from autopar.placement import Replicate, Shard

__all__ = ["prices_as_fused", "fused_keeps"]


def prices_as_fused(node: fx.Node | None, pos: int) -> bool:
    """Whether the cost model should price edge ``pos`` of ``node`` by ``fused_keeps`` (the gather's logits input)."""
    part = node.meta.get(DECOMPOSED) if node is not None else None
    return isinstance(part, CrossEntropyPart) and part.role == "target_logit" and pos == 0


def fused_keeps(read) -> bool:
    """Whether the gather of a decomposed cross-entropy, reading its shifted logits as ``read``, keeps them.

    Unfused it does (``gather`` saves its input: a second (N, C) tensor beside
    ``exp``'s output); fused it keeps the log-softmax, which the ``exp`` node's
    term already prices (same shape, same placement), and nothing else.  Decided
    on the gather's own placement (whole rows: every axis ``R`` or ``S(0)``), the
    rule's condition on one node: a plan that keeps these rows whole but moves
    between the group's nodes (not fused) is under-priced by this tensor.
    """
    return not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in read)
