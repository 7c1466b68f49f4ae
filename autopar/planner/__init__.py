"""Planning: ``autopar.plan`` from capture to a ``Plan``, and the plan's report.

``pipeline`` drives the stages: capture, strategies, cost, the search problem
(``problem``), the search, and the assembly of the chosen strategies into a ``Plan``
(``assemble``); ``recompute`` decides which repeated blocks backward recomputes and
prices them, ``errors`` says why no plan fits.  User hints restrict the strategies first (``hints``, written in the
forms ``hint_forms`` accepts).  ``schema`` holds the ``Plan`` itself, serialized as
versioned JSON; ``report`` and ``explain`` print what it chose and why.
"""

from __future__ import annotations

from .errors import MemoryCapError
from .explain import render_explanation
from .hint_forms import Layout
from .hints import UnmatchedHintError
from .pipeline import PlanningContext, plan, plan_from_context, prepare, rebatch
from .recompute_tables import RECOMPUTE_OPTIONS
from .plan_table import describe_nodes, describe_plan, describe_recompute, render_table
from .schema import FAMILIES, Plan, check_writable
from .solving import SEARCH_BUDGET_S

__all__ = [
    "FAMILIES",
    "Layout",
    "MemoryCapError",
    "Plan",
    "PlanningContext",
    "RECOMPUTE_OPTIONS",
    "SEARCH_BUDGET_S",
    "UnmatchedHintError",
    "check_writable",
    "describe_nodes",
    "describe_plan",
    "describe_recompute",
    "plan",
    "plan_from_context",
    "prepare",
    "rebatch",
    "render_explanation",
    "render_table",
]
