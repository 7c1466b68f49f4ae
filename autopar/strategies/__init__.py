"""Strategies: every op's ways to run sharded on the mesh, one rule module per op family (``base`` has the contract).

``build_candidates(graph, mesh)`` turns a captured ``OpGraph`` into the
``CandidateGraph``, the strategy table the cost stage prices: for every op node its
``OpStrategy`` list (placements per tensor input and output, per mesh axis; the op's
own collectives; its local kernel), for every source its placements.  Rules register
per aten op with ``@register``; ``rule_for`` finds them (importing the rule modules on
first use).  ``kernels`` holds the local computations a strategy may name instead of
the op itself, ``fuse`` how the cost model prices a cross-entropy that lowering runs fused.
"""

from __future__ import annotations

from .base import AxisStrategy, OpCall, OpComm, OpStrategy, expand_to_mesh, load_rule_modules, register, rule_for
from .candidates import CandidateGraph, SourceStrategy, build_candidates
from .fuse import fused_keeps, prices_as_fused
from .kernels import KERNELS, KernelContext
from .views import localize_size_args

# every rule module registers its rules and the local kernels it names (``KERNELS``) on import
load_rule_modules()

__all__ = [
    "AxisStrategy",
    "OpCall",
    "OpComm",
    "OpStrategy",
    "expand_to_mesh",
    "register",
    "rule_for",
    "CandidateGraph",
    "KERNELS",
    "KernelContext",
    "SourceStrategy",
    "build_candidates",
    "fused_keeps",
    "localize_size_args",
    "prices_as_fused",
]
