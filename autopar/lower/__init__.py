"""Lowering: a ``Plan`` and its ``OpGraph`` rewritten into one rank's local program.

``ExecutionPlan.from_plan`` resolves the plan against the captured graph (every
value's placements by fx node name); ``lower`` rewrites the graph into an
``fx.GraphModule`` of local ops (or their local kernels) with the moves between them
(the runtime's collectives), which is this rank's program.
"""

from __future__ import annotations

from .program import ExecutionPlan, RunState, SavedBytes
from .rewrite import lower
from .stage_programs import CarriedValue, StageProgram, split_program

__all__ = ["CarriedValue", "ExecutionPlan", "RunState", "SavedBytes", "StageProgram", "lower", "split_program"]
