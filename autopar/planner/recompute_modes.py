"""The recompute modes' searches of one plan, and the family rows beside the plan they keep.

``search_modes`` runs what ``plan_from_context``'s ``recompute`` asks (``ModeSearch``): under a
cap, ``"auto"`` first lets each repeated layer choose among saved, selective and whole in one
chained search (``solving.Recomputed.per_layer``); where the layers do not chain, or the step's
peak held that plan back by more than 2^-8 of the step, it also searches each mode for every
layer alike and keeps the fastest plan (``Plan.search.recompute_modes``).  ``with_families``
then searches the best plan of each family (``solving.family_plans``) beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autopar.capture import OpGraph
from autopar.search import BeatenError, ChainError

from .errors import MemoryCapError
from .hints import ResolvedHints
from .options import PlanOptions
from .plan_parts import RecomputeLayers, RecomputeTrial
from .problem_tables import PS_PER_S
from .regions import block_regions, hinted_regions, layer_regions, rest_regions, selective_regions
from .schema import Plan
from .solving import Recomputed, SearchRun, family_plans, plan_under

if TYPE_CHECKING:
    from .context import PlanningContext

__all__ = ["ModeSearch", "Searched", "search_modes", "with_families"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Searched:
    """The plan the recompute modes' searches kept, and the recompute regions the family rows are searched with
    (the plan's own mode; none for a per-layer plan)."""

    plan: Plan
    compared_regions: dict[int, str]


def search_modes(
    ctx: PlanningContext, hinted_ctx: PlanningContext, resolved: ResolvedHints, options: PlanOptions, run: SearchRun
) -> Searched:
    """The plan of ``options.recompute`` on ``hinted_ctx`` (``ctx`` with the hints applied), the family rows
    not made (the module docstring).  ``BeatenError`` where bounds prove every plan slower than ``run.above``."""
    modes = ModeSearch(ctx, hinted_ctx, resolved, options, run)
    if modes.per_layer_applies():
        found = modes.per_layer()
        if found is not None:
            return found
    for mode in modes.auto if options.recompute == "auto" else [options.recompute]:
        modes.one_mode(mode)
    return modes.kept()


def _regions_once(ctx: PlanningContext, kind: str, blocks: dict[int, str], find):
    """``find(ctx, blocks)`` (``planner.regions``), found once per context and kind: it does not depend on the cap."""
    key = (kind, tuple(sorted(blocks.items())))
    if key not in ctx.tables.regions:
        ctx.tables.regions[key] = find(ctx, blocks)
    return ctx.tables.regions[key]


class ModeSearch:
    """The region maps of each recompute mode, the searches run so far and the fastest plan they met.

    ``layers``: every layer's ops, alike or not (``regions.layer_regions``): what one mode for every layer
    recomputes; ``regions``: the repeated layers' (``regions.block_regions``), which each choose their own in the
    chained search (``per_layer``); ``forced``: the layers recompute hints name; ``selective``: the runs of the
    other layers that pay to recompute (``regions.selective_regions``); ``rest``: the part of the graph before
    the layers, recomputed at block granularity.  ``auto``: the modes ``"auto"`` searches, from the most memory
    to the least.
    """

    def __init__(self, ctx, hinted_ctx, resolved: ResolvedHints, options: PlanOptions, run: SearchRun) -> None:
        self.ctx, self.hinted_ctx, self.resolved, self.options, self.run = ctx, hinted_ctx, resolved, options, run
        asked, cap = options.recompute, options.mem_cap
        self.regions = block_regions(hinted_ctx)
        layers = self.layers = {**layer_regions(hinted_ctx), **self.regions}
        if asked in ("full", "selective") and not layers:
            raise ValueError(
                f"recompute={asked!r}: {ctx.graph.model_name} has no layers (module list entries) to recompute; "
                "use recompute='none' (or 'auto')"
            )
        forced = self.forced = hinted_regions(hinted_ctx, layers, resolved.recompute)
        self.unforced = {i: r for i, r in layers.items() if i not in forced}
        self.selective = (
            {**_regions_once(hinted_ctx, "selective", self.unforced, selective_regions), **forced}
            if asked in ("auto", "selective")
            else {}
        )
        # recomputation only adds time: without a cap (or without more to recompute) "auto" never needs more than
        # the hints
        self.auto = ["none", "selective", "full"] if cap is not None and self.unforced else ["none"]
        rest_parts = (  # the part before the layers only: recomputing the part after them never lowers the peak
            _regions_once(hinted_ctx, "rest", layers, lambda c, b: rest_regions(c, b, ("before",)))
            if asked == "auto" and cap is not None
            else []
        )
        self.rest = {i: r for part in rest_parts for i, r in part.items()}
        self.mode_regions = {"none": forced, "selective": self.selective, "full": layers}
        if self.rest and self.unforced:  # one mode for all layers: the rest recomputed too, with whole layers
            self.auto.append("full+rest")
            self.mode_regions["full+rest"] = {**layers, **self.rest}
        self.best: Plan | None = None
        self.best_mode: str | None = None
        self.failed: MemoryCapError | None = None  # the cap error naming the least peak the modes know
        self.tried: list[RecomputeTrial] = []

    def per_layer_applies(self) -> bool:
        """Whether each layer may choose its own mode: ``"auto"`` with more than one mode, the chained search."""
        return (
            self.options.recompute == "auto"
            and len(self.auto) > 1
            and self.options.solver == "dp"
            and self.hinted_ctx.blocks is not None
        )

    def per_layer(self) -> Searched | None:
        """Every layer picks its own: saved, selective or whole, in one chained search (a cap no choice meets
        raises here: the search covered every mode of every layer).  Its optimum is the plan unless the step's
        peak made the search tighten its bound (a heuristic): then one mode for all layers may do better, and
        None says to search them."""
        hinted_ctx, forced, cap = self.hinted_ctx, self.forced, self.options.mem_cap
        uncapped, above = replace(self.options, mem_cap=None), self.run.above  # BeatenError: the caller's is faster
        free = plan_under(
            hinted_ctx, self.resolved, Recomputed(forced), uncapped, self.run, above=above, unless_over=cap
        )
        if free is not None and free.memory.per_device_bytes <= cap:  # the fastest plan fits: the optimum
            settings = replace(free.settings, mem_cap_bytes=cap, recompute=self.options.recompute)
            search = replace(free.search, **_layer_modes(free, self.layers, hinted_ctx.graph))
            memory = replace(free.memory, cap_bytes=cap)
            return Searched(replace(free, settings=settings, search=search, memory=memory), forced)
        try:
            found = plan_under(hinted_ctx, self.resolved, self.per_layer_choices(), self.options, self.run, above=above)
        except ChainError as e:  # the layers do not chain (hinted layers differ, say): one mode for all
            log.info("recompute per layer needs the chained search (%s): one mode for every layer", e)
            return None
        except MemoryCapError as e:  # no plan's peak fits: the error names the least peak the modes know
            self.failed = e
            self.tried.append(RecomputeTrial("per layer", False, min_per_device_bytes=e.min_mem_bytes))
            return None
        # one mode for every layer is a plan of this search too: it can beat the plan found only where the
        # peak held that back, and by at most the gap to the optimum at the cap (solving.PeakLoop)
        lower = found.search.peak_lower_ps
        gap = 0 if lower is None else found.search.objective_ps - lower
        if found.search.peak_searches == 1 or gap <= found.search.objective_ps >> 8:
            search = replace(found.search, **_layer_modes(found, self.layers, hinted_ctx.graph))
            settings = replace(found.settings, recompute=self.options.recompute)
            return Searched(replace(found, settings=settings, search=search), forced)
        self.best, self.best_mode = found, "per layer"
        self.tried.append(_tried("per layer", found))
        return None

    def per_layer_choices(self) -> Recomputed:
        """What ``per_layer``'s capped search lets each repeated layer choose: saved (the hints' regions), selective
        and whole, and the rest of the graph recomputed with the first layer's choice where that may pay (where
        ``covers_every_mode``, every plan of one mode for all layers is among them)."""
        forced = self.forced
        # the repeated layers choose; a layer beside them keeps one map in every variant (the hints'), as the
        # chained search needs (only the blocks' terms differ between variants)
        regions = {**self.regions, **forced}
        selective = {i: r for i, r in self.selective.items() if i in regions}
        layers = (forced, selective, regions) if selective != forced else (forced, regions)
        # the rest of the graph at block granularity (its parts recomputed together: one more choice, made with
        # the first layer's, each crossing costs the chain a rest table)
        rests = tuple({**layer, **self.rest} for layer in layers) if self.rest else ()
        return Recomputed(forced, layers, rests)

    def covers_every_mode(self) -> bool:
        """Whether every plan the modes' searches can give (whichever ``recompute`` asks) is among
        ``per_layer_choices``' plans: the layers chain, and every layer the modes recompute is a repeated one (a layer
        beside them, T5's first, recomputed in one mode's plan, is no choice of ``per_layer_choices``)."""
        chained = self.options.solver == "dp" and self.hinted_ctx.blocks is not None
        return chained and set(self.layers) <= {**self.regions, **self.forced}.keys()

    def one_mode(self, mode: str) -> None:
        """Search ``mode`` for every layer alike; kept where it is the fastest plan so far."""
        asked, best, deadline = self.options.recompute, self.best, self.run.deadline
        if mode == "selective" and asked == "auto" and self.selective == self.forced:
            return  # no run pays in these blocks: the same as "none"
        if best is not None and deadline is not None and deadline.passed():
            self.tried.append(RecomputeTrial(mode, None, skipped="search budget"))
            return
        met = [t for t in (best.search.objective_ps if best is not None else None, self.run.above) if t is not None]
        above = min(met, default=None)
        recomputed = Recomputed(self.mode_regions[mode])
        try:
            found = plan_under(self.hinted_ctx, self.resolved, recomputed, self.options, self.run, above=above)
        except BeatenError as e:  # a bound proves this mode slower than the plan in hand: not searched further
            self.tried.append(RecomputeTrial(mode, None, at_least_s=e.lower_bound_ps / PS_PER_S))
            return
        except MemoryCapError as e:  # the least-memory plan of each search is its least additive memory's: the
            # error names the one whose peak is the least
            if self.failed is None or e.min_mem_bytes < self.failed.min_mem_bytes:
                self.failed = e
            self.tried.append(RecomputeTrial(mode, False, min_per_device_bytes=e.min_mem_bytes))
            return
        self.tried.append(_tried(mode, found))
        if best is None or found.cost.total_s < best.cost.total_s:
            self.best, self.best_mode = found, mode

    def kept(self) -> Searched:
        """The fastest plan met, with what each mode's search found; the cap error when none fits."""
        best, best_mode, regions, failed = self.best, self.best_mode, self.layers, self.failed
        beaten = [t.at_least_s for t in self.tried if t.at_least_s is not None]
        if best is None and beaten and self.run.above is not None:  # every mode that may fit: slower than the
            raise BeatenError(min(beaten) * PS_PER_S, self.run.above)  # caller's plan (the others do not fit)
        if best is None:
            if self.options.recompute == "none" and len(regions) > len(self.forced):  # layers recomputed untried
                raise MemoryCapError(
                    f"{failed.problem}\n  (recompute 'none': recomputing the {self.ctx.graph.model_name} layers in "
                    "backward was not tried; recompute 'auto' tries it)",
                    failed.min_mem_bytes,
                    failed.whole_batch,
                ) from None
            raise failed
        search = replace(best.search, **_layer_modes(best, regions, self.hinted_ctx.graph)) if regions else best.search
        if best_mode != "per layer":
            search = replace(search, recompute_mode="full" if best_mode == "full+rest" else best_mode)
        if len(self.tried) > 1:
            search = replace(search, recompute_modes=tuple(self.tried))
        compared = self.forced if best_mode == "per layer" else self.mode_regions[best_mode]
        settings = replace(best.settings, recompute=self.options.recompute)
        return Searched(replace(best, settings=settings, search=search), compared)


def with_families(found: Searched, ctx: PlanningContext, options: PlanOptions, run: SearchRun, free: bool) -> Plan:
    """``found``'s plan with the best plan of each family beside it (``solving.family_plans``, searched once, for
    the plan kept).  Where the plan is ``free`` to be any (no hints, family or state rule) and a family's plan
    fits and is faster, that plan is the one returned: the peak loop bisects the additive bound, which the step's
    peak does not follow, so a forced family's loop can land on a faster plan that fits."""
    plan, cap = found.plan, options.mem_cap
    compared = family_plans(ctx, options, found.compared_regions, run.deadline)
    alternatives = tuple(entry for entry, _ in compared)
    faster = min((p for _, p in compared if p is not None), key=lambda p: p.cost.total_s, default=None)
    if not free or faster is None or faster.cost.total_s >= plan.cost.total_s:
        return replace(plan, alternatives=alternatives)
    regions = {**layer_regions(ctx), **block_regions(ctx)}
    modes = _layer_modes(faster, regions, ctx.graph) if regions else {}
    search = replace(faster.search, kept_family_plan=True, **modes)
    memory = replace(faster.memory, cap_bytes=cap)
    return replace(faster, settings=plan.settings, search=search, memory=memory, alternatives=alternatives)


def _tried(mode: str, plan: Plan) -> RecomputeTrial:
    return RecomputeTrial(mode, True, total_s=plan.cost.total_s, per_device_bytes=plan.memory.per_device_bytes)


def _layer_modes(plan: Plan, blocks: dict[int, str], graph: OpGraph) -> dict[str, Any]:
    """``recompute_mode`` (one mode, or ``"per layer"``), ``recompute_layers`` (layers per mode) and
    ``recompute_rest`` (the regions recomputed outside the layers, ``regions.rest_regions``) of a plan."""
    names: dict[str, list[str]] = {}
    for i, block in blocks.items():
        names.setdefault(block, []).append(graph.nodes[i].name)
    counts = {"none": 0, "selective": 0, "full": 0}
    for block, ops in names.items():
        marks = {plan.nodes[n].recompute for n in ops if n in plan.nodes} - {None}
        counts["none" if not marks else "full" if marks == {block} else "selective"] += 1
    used = [m for m, c in counts.items() if c]
    inside = {graph.nodes[i].name for i in blocks}
    rest = sorted(
        {e.recompute for n, e in plan.nodes.items() if e.recompute and n not in inside},
        key=lambda r: (not r.startswith("before"), r),  # in graph order: before the layers, after them
    )
    mode = used[0] if len(used) == 1 else "per layer"
    return {"recompute_mode": mode, "recompute_layers": RecomputeLayers(**counts), "recompute_rest": tuple(rest)}
