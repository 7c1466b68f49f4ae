"""Planning: ``autopar.plan`` from capture to a ``Plan``, and the plan's report.

``options`` holds what a plan is made for (``PlanOptions``), what the user fixed
(``HintOptions``) and the one table of the planning keywords every entry point takes
(``PLAN_KEYWORDS``).  ``driver`` drives the stages: capture, strategies, cost, the
search problem (``problem_tables``), the search, and the assembly of the chosen
strategies into a ``Plan`` (``assemble``); ``solving`` searches one problem under the cap
(the peak loop), ``recompute_modes`` once per recompute mode; ``recompute_tables``
prices the repeated blocks backward recomputes, ``errors`` says why no plan fits.  User
hints restrict the strategies first (``hints``, written in the forms ``hint_forms``
accepts).  ``schema`` holds the ``Plan`` itself, serialized as versioned JSON, its parts
typed values (``plan_parts``); ``plan_table`` and ``explain`` print what it chose and why.
"""

from __future__ import annotations

from .driver import PlanningContext, plan, plan_from_context, prepare, prepare_context, rebatch, search_context
from .errors import MemoryCapError
from .explain import render_explanation
from .hint_forms import Layout, hint_from_text, hints_from_file
from .hints import UnmatchedHintError
from .mesh_choice import check_devices, logical_meshes, plan_devices, plan_on, planning_order
from .options import (
    PLAN_KEYWORDS,
    SEARCH_BUDGET_S,
    SOLVERS,
    HintOptions,
    Keyword,
    OptionError,
    PlanOptions,
    device_profile,
    training_precision,
)
from .pipeline_choice import plan_model
from .plan_parts import (
    Collective,
    FallbackOp,
    FamilyAlternative,
    InputPlacement,
    NodePlacement,
    OpHints,
    ParamPlacement,
    PipelinePlan,
    PlanCost,
    PlanHints,
    PlanMemory,
    PlanSettings,
    PlanThroughput,
    RecomputeLayers,
    RecomputeTrial,
    SearchStats,
    StagePart,
)
from .plan_table import (
    describe_nodes,
    describe_pipeline,
    describe_plan,
    describe_recompute,
    describe_throughput,
    render_table,
)
from .recompute_tables import RECOMPUTE_OPTIONS
from .schema import FAMILIES, Plan, check_writable
from .stage_assignment import chain_layers, stage_of_nodes

__all__ = [
    "Collective",
    "FAMILIES",
    "FallbackOp",
    "FamilyAlternative",
    "HintOptions",
    "InputPlacement",
    "Keyword",
    "Layout",
    "MemoryCapError",
    "NodePlacement",
    "OpHints",
    "OptionError",
    "PLAN_KEYWORDS",
    "ParamPlacement",
    "Plan",
    "PlanCost",
    "PlanHints",
    "PlanMemory",
    "PlanThroughput",
    "PlanOptions",
    "PipelinePlan",
    "PlanSettings",
    "PlanningContext",
    "RECOMPUTE_OPTIONS",
    "RecomputeLayers",
    "RecomputeTrial",
    "SEARCH_BUDGET_S",
    "SOLVERS",
    "SearchStats",
    "StagePart",
    "UnmatchedHintError",
    "chain_layers",
    "check_writable",
    "describe_nodes",
    "describe_plan",
    "describe_pipeline",
    "describe_throughput",
    "describe_recompute",
    "device_profile",
    "hint_from_text",
    "hints_from_file",
    "plan",
    "plan_from_context",
    "plan_model",
    "plan_devices",
    "plan_on",
    "planning_order",
    "check_devices",
    "logical_meshes",
    "prepare",
    "prepare_context",
    "rebatch",
    "render_explanation",
    "render_table",
    "search_context",
    "stage_of_nodes",
    "training_precision",
]
