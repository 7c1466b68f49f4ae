"""``search_context``: one search of a prepared context, the step every plan without micro-batches takes
(``autopar.plan``, ``plan_from_context``, ``compile``; ``pipeline_choice`` for its no-pipeline candidate)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from autopar.search import Deadline

from .context import PlanningContext, check_no_pipeline, hinted_context, repriced
from .options import HintOptions, PlanOptions
from .recompute_modes import search_modes, with_families
from .schema import Plan
from .solving import SearchRun

__all__ = ["search_context"]


def search_context(
    ctx: PlanningContext,
    options: PlanOptions | None = None,
    hint_options: HintOptions | None = None,
    *,
    compare_families: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    above: int | None = None,
) -> Plan:
    """``plan_from_context`` on the options objects: ``ctx.options`` updated by ``options``' fields that are
    not at their defaults (None: ``ctx.options``), and ``hint_options`` in place of the context's hints (None:
    those).  ``above``: ``SearchRun.above`` (``BeatenError`` where every plan is proven slower)."""
    options = ctx.options if options is None else ctx.options.updated_by(options)
    check_no_pipeline(options, "plan_from_context")
    if options.priced() != ctx.options.priced():
        ctx = repriced(ctx, options)
    run = SearchRun(Deadline.after(options.search_budget_s), progress, above)
    start = time.perf_counter()
    hinted_ctx, resolved = hinted_context(ctx, hint_options)
    found = search_modes(ctx, hinted_ctx, resolved, options, run)
    if compare_families:
        free = options.allow_state_sharding and options.family is None and not resolved.allowed(hinted_ctx.cand)
        plan = with_families(found, hinted_ctx, options, run, free)
    else:
        plan = found.plan
    # every search of the call (each recompute mode, the peak loop's, the family rows'), not only the kept plan's
    return dataclasses.replace(plan, timings=dict(plan.timings, search_s=time.perf_counter() - start))
