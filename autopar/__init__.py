"""autopar: a graph compiler that auto-partitions PyTorch models over a device mesh.

``autopar.plan(model, mesh, example_inputs=...)`` traces the model, enumerates
sharding strategies per op, prices them and searches for the fastest plan under
a per-device memory cap.  ``autopar.prepare`` + ``autopar.plan_from_context`` split
that in two so one capture serves many caps, and ``ctx.at_batch(b)`` (``rebatch``)
many batch sizes.  ``autopar.compile`` runs a plan on the ranks of a process group.
All four take the same planning keywords (``autopar.PLAN_KEYWORDS``), gathered into
``PlanOptions`` (what to plan for) and ``HintOptions`` (what the user fixed).
Each stage of the pipeline is a subpackage (capture, strategies, cost, search,
planner, lower, compiled; runtime is what the lowered program calls):
docs/architecture.md draws them and the types between them, and the module
docstrings hold the design decisions.  ``python -m autopar`` (or
``autopar``) is the command line (``autopar/cli.py``).
"""

from __future__ import annotations

from .mesh import Mesh
from .placement import Partial, Replicate, Shard, parse_placement, parse_placements
from .shard_op import shard
from .spec import ShardingSpec, TensorMeta

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "Shard",
    "Replicate",
    "Partial",
    "parse_placement",
    "parse_placements",
    "ShardingSpec",
    "TensorMeta",
    "plan",
    "prepare",
    "plan_from_context",
    "rebatch",
    "PlanningContext",
    "Plan",
    "PlanOptions",
    "HintOptions",
    "PLAN_KEYWORDS",
    "MemoryCapError",
    "CaptureError",
    "compile",
    "ShardedModule",
    "shard",
    "Layout",
    "save",
    "load",
    "reshard",
]

_FROM_PLANNER = (
    *("plan", "prepare", "plan_from_context", "rebatch", "PlanningContext", "MemoryCapError"),
    *("PlanOptions", "HintOptions", "PLAN_KEYWORDS"),
)


def __getattr__(name: str):
    # planning pulls in torch.export, costmodel and ortools: import on first use
    if name in _FROM_PLANNER:
        from . import planner

        return getattr(planner, name)
    if name == "Plan":
        from autopar.planner import Plan

        return Plan
    if name in ("compile", "ShardedModule"):
        from . import compiled

        return getattr(compiled, name)
    if name == "reshard":
        from autopar.runtime import reshard

        return reshard
    if name in ("save", "load"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name == "Layout":
        from autopar.planner import Layout

        return Layout
    if name == "CaptureError":
        from autopar.capture import CaptureError

        return CaptureError
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
