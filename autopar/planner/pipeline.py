"""``autopar.plan``: capture -> candidates -> costs -> search -> Plan.

Needs no process group and no real weights (meta-device models plan).  Besides
the best plan under the cap, the planner solves the same problem restricted to
each *family* (``families``) so the report can show why the winner won.
User hints (``hints=``, ``input_placements=``, ``output_placements=``, and
``autopar.shard`` calls in the model) are one more restriction (``autopar.planner.hints``):
hinted nodes keep only the strategies that match, the search places the rest.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autopar.capture import (
    BatchTemplate,
    Blocks,
    OpGraph,
    capture,
    capture_template,
    find_blocks,
    specialize,
    static_template,
)
from autopar.cost import Coster, TrainingSettings
from autopar.mesh import Mesh
from autopar.runtime import DEFAULT_BUCKET_BYTES
from autopar.search import BeatenError, ChainError, Deadline
from autopar.strategies import CandidateGraph, SourceStrategy, build_candidates
from autopar.units import parse_bytes
from costmodel import check_devices_per_node, load_profile, optimizer_spec, precision

from .errors import MemoryCapError
from .hints import ResolvedHints, resolve_hints
from .problem_tables import PS_PER_S, ProblemTables, build_tables
from .recompute_tables import RECOMPUTE_OPTIONS
from .regions import block_regions, hinted_regions, rest_regions, selective_regions
from .schema import FAMILIES, Plan
from .solving import SEARCH_BUDGET_S, family_plans, plan_under

__all__ = ["plan", "PlanningContext", "prepare", "rebatch", "plan_from_context", "FAMILIES", "MemoryCapError"]

log = logging.getLogger(__name__)


@dataclass
class PlanningContext:
    """Everything computed before the search, reusable across caps and batch sizes (plan reuse).

    ``plan_from_context(ctx, mem_cap=...)`` searches it under any cap;
    ``ctx.at_batch(b)`` (``rebatch``) gives the context of the same model at another
    batch size, re-using the capture when ``prepare(..., reuse_batch=True)`` made one.
    """

    graph: OpGraph
    mesh: Mesh
    cand: CandidateGraph
    coster: Coster
    tables: ProblemTables
    settings: dict[str, Any]
    timings: dict[str, float]
    hints: ResolvedHints | None = None  # the hints given to prepare (autopar.shard calls always)
    blocks: Blocks | None = None  # repeated layers: the search solves one and chains them (search.chain)
    template: BatchTemplate | None = None  # the capture at_batch re-uses (autopar.capture.batch)
    hint_args: dict[str, Any] | None = None  # prepare's hint arguments, resolved again at another batch
    recaptured: str | None = None  # why at_batch captured the model again instead of re-using the capture
    recompute: dict[int, str] = field(default_factory=dict)  # op node -> recomputed block (planner.recompute_tables)

    def at_batch(self, batch: int) -> PlanningContext:
        """This context at another global batch size (see ``rebatch``)."""
        return rebatch(self, batch)


def prepare(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    example_inputs=(),
    example_kwargs=None,
    profile: str = "h100",
    dtype: str = "fp32",
    optimizer: str = "adamw",
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    reuse_batch: bool = False,
    grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    devices_per_node: int | None = None,
) -> PlanningContext:
    """Capture the model and price every candidate (the part of planning independent of the cap).

    ``grad_bucket_bytes``: the gradient bucket size the runtime will use
    (``compile(grad_bucket_bytes=)``; None: none), which prices data-parallel
    gradient all-reduces as it runs them (``Coster.grad_move_steps``).

    The hints (``autopar.planner.hints``) are checked here and kept in the context; a hinted
    placement no candidate has (a parameter stored in a layout no consumer reads)
    is added as a candidate, so the search can keep it.

    ``reuse_batch=True`` captures with a symbolic batch (dim 0 of every tensor input,
    example batch >= 2; slower than a static capture: 1.3x measured at 12 GPT layers,
    about 2.5x at 96 on a loaded machine) so that
    ``ctx.at_batch(b)`` re-plans at another batch without tracing the model again
    (``autopar.capture.batch``).  Without it, ``at_batch`` captures the model again.

    ``devices_per_node``: the job's ranks per node when it uses fewer devices per node
    than the profile's node has (two nodes of 2 ranks: 2), so mesh axes whose ranks
    span nodes are priced on the profile's inter-node link (``DeviceProfile.link_for_axis``);
    None keeps the profile's figure.  The plan's settings record it.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh {mesh!r}: expected an autopar.Mesh, e.g. autopar.Mesh((2, 4), axis_names=('dp', 'tp'))")
    settings = {"profile": profile, "dtype": dtype, "optimizer": optimizer, "grad_bucket_bytes": grad_bucket_bytes}
    if devices_per_node is not None:
        load_profile(profile).with_devices_per_node(devices_per_node)  # checks the value before the capture
        check_devices_per_node(mesh.shape, devices_per_node)
        settings["devices_per_node"] = devices_per_node
    hint_args = {
        "hints": hints,
        "input_placements": input_placements,
        "output_placements": output_placements,
        "strict": strict,
    }
    timings: dict[str, float] = {}
    with _no_full_collections():
        t0 = time.perf_counter()
        if reuse_batch:
            template = capture_template(model, example_inputs, example_kwargs)
            timings["capture_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            graph, _ = specialize(template, template.batch)
            timings["specialize_s"] = time.perf_counter() - t1
        else:
            graph = capture(model, example_inputs, example_kwargs)
            template = static_template(model, example_inputs, example_kwargs)
            timings["capture_s"] = time.perf_counter() - t0
        return _price(graph, mesh, settings, hint_args, timings, template)


def rebatch(ctx: PlanningContext, batch: int) -> PlanningContext:
    """The context of ``ctx``'s model, mesh, settings and hints at global batch ``batch``.

    With a symbolic capture (``prepare(..., reuse_batch=True)``) the graph is
    specialized to ``batch`` in O(nodes) (``autopar.capture.batch``) into the graph a
    static capture at that batch gives, so the plan JSON is that of a fresh ``plan``
    (``tests/test_rebatch.py``); ``timings`` says ``capture_s`` 0 and ``specialize_s``.
    Otherwise, or when the symbolic graph does not hold at ``batch`` (batch 1, a
    check in the model's code), the model is captured again and ``ctx.recaptured``
    says why.  Strategies, prices and blocks are always rebuilt: they depend on the
    shapes.  ``ctx`` itself stays valid.
    """
    if ctx.template is None:
        raise ValueError(
            f"this context of {ctx.graph.model_name} keeps no model to re-plan at batch {batch}; "
            "build it with autopar.planner.prepare(..., reuse_batch=True)"
        )
    timings: dict[str, float] = {}
    with _no_full_collections():
        t0 = time.perf_counter()
        graph, why = specialize(ctx.template, batch)
        took = time.perf_counter() - t0
        timings["capture_s"], timings["specialize_s"] = (took, 0.0) if why is not None else (0.0, took)
        out = _price(graph, ctx.mesh, ctx.settings, ctx.hint_args or {}, timings, ctx.template)
    out.recaptured = why
    return out


def _price(graph: OpGraph, mesh: Mesh, settings: dict, hint_args: dict, timings: dict, template) -> PlanningContext:
    """Candidates, hints, cost tables and blocks of a captured graph."""
    t1 = time.perf_counter()
    training = TrainingSettings(
        load_profile(settings["profile"]).with_devices_per_node(settings.get("devices_per_node")),
        precision(settings["dtype"]),
        optimizer_spec(settings["optimizer"]),
        settings.get("grad_bucket_bytes", DEFAULT_BUCKET_BYTES),
    )
    cand = build_candidates(graph, mesh.shape)
    resolved = resolve_hints(
        graph,
        mesh,
        hint_args.get("hints"),
        input_placements=hint_args.get("input_placements"),
        output_placements=hint_args.get("output_placements"),
        strict=hint_args.get("strict", False),
    )
    cand = _with_sources(cand, resolved.missing_sources(cand))
    coster = Coster(cand, training)
    tables = build_tables(cand, coster)
    tables.problem(None)  # the SearchProblem, checked once: each cap and re-plan shares it
    timings["strategies_s"] = time.perf_counter() - t1
    return PlanningContext(
        graph,
        mesh,
        cand,
        coster,
        tables,
        dict(settings),
        timings,
        resolved,
        find_blocks(graph),
        template,
        dict(hint_args),
    )


@contextlib.contextmanager
def _no_full_collections():
    """Python's cyclic GC without automatic full collections (young generations still collected).

    Tracing and pricing a deep model make millions of long-lived objects, and each
    automatic full collection walks every object in the process: six of them came
    in a 96-layer prepare, about 2 s of its 8.  The thresholds are restored on the
    way out, so the collector runs as before afterwards.
    """
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _with_sources(cand: CandidateGraph, extra: dict[int, tuple]) -> CandidateGraph:
    """The candidates plus, per source node, one more placement (stored with its state)."""
    if not extra:
        return cand
    strategies = list(cand.strategies)
    for i, placement in extra.items():
        strategies[i] = strategies[i] + [SourceStrategy(placement, placement)]
    return CandidateGraph(cand.graph, cand.mesh_shape, strategies)


def plan(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    example_inputs=(),
    example_kwargs: dict | None = None,
    mem_cap: int | str | None = None,
    profile: str = "h100",
    dtype: str = "fp32",
    optimizer: str = "adamw",
    solver: str = "dp",
    compare_families: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    recompute: str = "auto",
    devices_per_node: int | None = None,
    search_budget_s: float | None = SEARCH_BUDGET_S,
) -> Plan:
    """The fastest training plan of ``model`` on ``mesh`` that fits ``mem_cap`` per device.

    ``example_inputs``/``example_kwargs`` are passed to ``model`` (meta tensors are
    fine).  ``mem_cap``: bytes or a string with units (``"40GiB"``); None: no cap.
    ``solver``: ``"dp"`` (exact dynamic programming) or ``"ilp"`` (CP-SAT).
    Raises ``MemoryCapError`` when no plan fits, naming the smallest reachable memory.

    Semi-auto mode (``autopar.planner.hints`` has the forms and checks): ``hints`` maps
    parameter-FQN patterns to placements (``{"*.mlp.c_fc.weight": ["R", "S(1)"]}``),
    module patterns to ``"replicate"`` or to a MindSpore-style matmul strategy
    (``((2, 1), (1, 4))``); ``input_placements``/``output_placements`` fix graph
    inputs and outputs.  Hinted tensors keep their placements; the search chooses
    the rest.  A pattern matching nothing warns (``strict=True``: raises).
    ``progress(stage, done, total)`` is called as planning goes (``autopar.launch.progress`` draws it).
    ``recompute``: ``"auto"`` (recompute in backward where that makes the fastest plan
    that fits the cap), ``"none"``, ``"selective"`` (each repeated block's attention core
    and activations) or ``"full"`` (whole blocks); ``planner.recompute_tables``.
    ``devices_per_node``: the job's ranks per node (``prepare``).
    ``search_budget_s``: the search's wall-clock budget (``plan_from_context``).
    """
    if progress is not None:
        progress("capture + strategies", 0, 1)
    ctx = prepare(
        model,
        mesh,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        profile=profile,
        dtype=dtype,
        optimizer=optimizer,
        hints=hints,
        input_placements=input_placements,
        output_placements=output_placements,
        strict=strict,
        devices_per_node=devices_per_node,
    )
    return plan_from_context(
        ctx,
        mem_cap=mem_cap,
        solver=solver,
        compare_families=compare_families,
        progress=progress,
        recompute=recompute,
        search_budget_s=search_budget_s,
    )


def _regions_once(ctx: PlanningContext, kind: str, blocks: dict[int, str], find):
    """``find(ctx, blocks)`` (``planner.regions``), found once per context and kind: it does not depend on the cap."""
    key = (kind, tuple(sorted(blocks.items())))
    if key not in ctx.tables.regions:
        ctx.tables.regions[key] = find(ctx, blocks)
    return ctx.tables.regions[key]


def plan_from_context(
    ctx: PlanningContext,
    *,
    mem_cap: int | str | None = None,
    solver: str = "dp",
    compare_families: bool = True,
    allow_state_sharding: bool = True,
    family: str | None = None,
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    recompute: str = "auto",
    search_budget_s: float | None = SEARCH_BUDGET_S,
) -> Plan:
    """Search a prepared context under a cap (re-planning with another cap reuses the context).

    ``allow_state_sharding=False`` keeps every parameter's gradient and optimizer
    state with the parameter (no ZeRO-1/2), for runtimes that do not shard state.
    ``family`` (one of ``FAMILIES``) confines the search to that family: a forced
    data-parallel, sharded-parameter or tensor-parallel plan.
    ``hints``/``input_placements``/``output_placements``/``strict`` (as in ``plan``)
    replace the hints given to ``prepare``; None keeps those.  ``recompute`` (``"auto"``,
    ``"none"``, ``"selective"``, ``"full"``): what backward recomputes, nothing, the
    weightless runs of each repeated block that pay (``planner.regions``) or whole
    blocks; ``"auto"``, under a cap, lets each layer choose among the three in one
    chained search (``solving.plan_under``'s ``per_layer``).  Where the layers do not
    chain, or the step's peak held the per-layer plan back by more than 2^-8 of the step,
    it also searches each mode for every layer alike and keeps the fastest plan
    (``search["recompute_modes"]``).
    ``search_budget_s`` (None: no budget): past it the searches stop with the best plan they have met and
    the bound they proved (``search["budget_hit"]``, ``gap``), the peak loop keeps the fastest plan that fits
    so far, and the recomputation modes not yet searched are not (``recompute_modes``).
    """
    deadline = Deadline.after(search_budget_s)
    cap = parse_bytes(mem_cap) if mem_cap is not None else None
    if solver not in ("dp", "ilp"):
        raise ValueError(f"solver {solver!r}: expected 'dp' (dynamic programming) or 'ilp' (CP-SAT)")
    if recompute not in RECOMPUTE_OPTIONS:
        raise ValueError(f"recompute {recompute!r}: expected one of {RECOMPUTE_OPTIONS}")
    hinted_ctx, resolved = _hinted_context(ctx, hints, input_placements, output_placements, strict)
    common = {
        "solver": solver,
        "allow_state_sharding": allow_state_sharding,
        "family": family,
        "progress": progress,
        "deadline": deadline,
    }
    found = _search_modes(ctx, hinted_ctx, resolved, cap, recompute, common)
    if not compare_families:
        return found.plan
    free_to_choose = allow_state_sharding and family is None and not resolved.allowed(hinted_ctx.cand)
    return _with_families(found, hinted_ctx, cap, solver, deadline, free_to_choose)


@dataclass(frozen=True, slots=True)
class _Searched:
    """The plan the recompute modes' searches kept, and the recompute regions the family rows are searched with
    (the plan's own mode; none for a per-layer plan)."""

    plan: Plan
    compared_regions: dict[int, str]


def _with_families(found: _Searched, ctx, cap, solver: str, deadline, free_to_choose: bool) -> Plan:
    """``found``'s plan with the best plan of each family beside it (``solving.family_plans``, searched once, for
    the plan kept).  Where the plan is free to be any (no hints, family or state rule) and a family's plan fits
    and is faster, that plan is the one returned: the peak loop bisects the additive bound, which the step's peak
    does not follow, so a forced family's loop can land on a faster plan that fits."""
    plan = found.plan
    compared = family_plans(ctx, cap, solver, found.compared_regions, deadline)
    alternatives = [entry for entry, _ in compared]
    faster = min((p for _, p in compared if p is not None), key=lambda p: p.cost["total_s"], default=None)
    if not free_to_choose or faster is None or faster.cost["total_s"] >= plan.cost["total_s"]:
        return replace(plan, alternatives=alternatives)
    regions = block_regions(ctx)
    search = dict(faster.search, kept_family_plan=True, **(_layer_modes(faster, regions, ctx.graph) if regions else {}))
    memory = dict(faster.memory, cap_bytes=cap)
    return replace(faster, settings=plan.settings, search=search, memory=memory, alternatives=alternatives)


def _search_modes(ctx, hinted_ctx, resolved, cap: int | None, recompute: str, common: dict) -> _Searched:
    """The recompute modes' searches of ``plan_from_context`` (its docstring), the family rows not made."""
    solver, deadline = common["solver"], common["deadline"]
    regions = block_regions(hinted_ctx)
    if recompute in ("full", "selective") and not regions:
        raise ValueError(
            f"recompute={recompute!r}: {ctx.graph.model_name} has no repeated blocks (layers) to recompute; "
            "use recompute='none' (or 'auto')"
        )
    forced = hinted_regions(hinted_ctx, regions, resolved.recompute)  # the layers recompute hints name
    unforced = {i: r for i, r in regions.items() if i not in forced}
    selective = (
        {**_regions_once(hinted_ctx, "selective", unforced, selective_regions), **forced}
        if recompute in ("auto", "selective")
        else {}
    )
    # recomputation only adds time: without a cap (or without more to recompute) "auto" never needs more than
    # the hints; its modes go from the most memory to the least
    auto = ["none", "selective", "full"] if cap is not None and unforced else ["none"]
    rest_parts = (  # the part before the layers only: recomputing the part after them never lowers the peak
        _regions_once(hinted_ctx, "rest", regions, lambda c, b: rest_regions(c, b, ("before",)))
        if recompute == "auto" and cap is not None
        else []
    )
    rest = {i: r for part in rest_parts for i, r in part.items()}
    mode_regions = {"none": forced, "selective": selective, "full": regions}
    if rest and unforced:  # one mode for all layers: the rest recomputed too, with whole layers (the least)
        auto.append("full+rest")
        mode_regions["full+rest"] = {**regions, **rest}
    best, best_mode, failed, tried = None, None, None, []
    if recompute == "auto" and len(auto) > 1 and solver == "dp" and hinted_ctx.blocks is not None:
        # every layer picks its own: saved, selective or whole, in one chained search (a cap no choice meets
        # raises here: the search covered every mode of every layer).  Its optimum is the plan unless the
        # step's peak made the search tighten its bound (a heuristic): then one mode for all layers may do better
        layers = (forced, selective, regions) if selective != forced else (forced, regions)
        # the rest of the graph at block granularity (its parts recomputed together: one more choice, made with
        # the first layer's, each crossing costs the chain a rest table)
        rests = tuple({**layer, **rest} for layer in layers) if rest else ()
        free = plan_under(hinted_ctx, resolved, None, forced, unless_over=cap, **common)
        if free is not None and free.memory["per_device_bytes"] <= cap:  # the fastest plan fits: the optimum
            settings = dict(free.settings, mem_cap_bytes=cap, recompute=recompute)
            search = dict(free.search, **_layer_modes(free, regions, hinted_ctx.graph))
            memory = dict(free.memory, cap_bytes=cap)
            return _Searched(replace(free, settings=settings, search=search, memory=memory), forced)
        try:
            found = plan_under(
                hinted_ctx,
                resolved,
                cap,
                forced,
                per_layer=layers,
                per_rest=rests,
                **common,
            )
        except ChainError as e:  # the layers do not chain (hinted layers differ, say): one mode for all, below
            log.info("recompute per layer needs the chained search (%s): one mode for every layer", e)
        except MemoryCapError as e:  # no plan's peak fits: the error names the least peak the modes know, below
            failed = e
            tried.append({"recompute": "per layer", "feasible": False, "min_per_device_bytes": e.min_mem_bytes})
        else:
            # one mode for every layer is a plan of this search too: it can beat the plan found only where the
            # peak held that back, and by at most the gap to the optimum at the cap (solving.plan_under)
            gap = found.search["objective_ps"] - found.search.get("peak_lower_ps", found.search["objective_ps"])
            if found.search["peak_searches"] == 1 or gap <= found.search["objective_ps"] >> 8:
                search = dict(found.search, **_layer_modes(found, regions, hinted_ctx.graph))
                chosen = replace(found, settings=dict(found.settings, recompute=recompute), search=search)
                return _Searched(chosen, forced)
            best, best_mode = found, "per layer"
            tried.append(_tried("per layer", found))
    for mode in auto if recompute == "auto" else [recompute]:
        if mode == "selective" and recompute == "auto" and selective == forced:
            continue  # no run pays in these blocks: the same as "none"
        above = best.search["objective_ps"] if best is not None else None
        if best is not None and deadline is not None and deadline.passed():
            tried.append({"recompute": mode, "feasible": None, "skipped": "search budget"})
            continue
        try:
            found = plan_under(hinted_ctx, resolved, cap, mode_regions[mode], above=above, **common)
        except BeatenError as e:  # a bound proves this mode slower than the plan in hand: not searched further
            tried.append({"recompute": mode, "feasible": None, "at_least_s": e.lower_bound_ps / PS_PER_S})
            continue
        except MemoryCapError as e:  # the least-memory plan of each search is its least additive memory's: the
            # error names the one whose peak is the least
            if failed is None or e.min_mem_bytes < failed.min_mem_bytes:
                failed = e
            tried.append(
                {
                    "recompute": mode,
                    "feasible": False,
                    "min_per_device_bytes": e.min_mem_bytes,
                }
            )
            continue
        tried.append(_tried(mode, found))
        if best is None or found.cost["total_s"] < best.cost["total_s"]:
            best, best_mode = found, mode
    if best is None:
        if recompute == "none" and len(regions) > len(forced):  # the search did not try recomputing the layers
            raise MemoryCapError(
                f"{failed.problem}\n  (recompute 'none': recomputing the {ctx.graph.model_name} layers in backward "
                "was not tried; recompute 'auto' tries it)",
                failed.min_mem_bytes,
            ) from None
        raise failed
    search = dict(best.search, **_layer_modes(best, regions, hinted_ctx.graph)) if regions else dict(best.search)
    if best_mode != "per layer":
        search["recompute_mode"] = "full" if best_mode == "full+rest" else best_mode
    if len(tried) > 1:
        search["recompute_modes"] = tried
    compared = forced if best_mode == "per layer" else mode_regions[best_mode]
    return _Searched(replace(best, settings=dict(best.settings, recompute=recompute), search=search), compared)


def _tried(mode: str, plan: Plan) -> dict[str, Any]:
    return {
        "recompute": mode,
        "feasible": True,
        "total_s": plan.cost["total_s"],
        "per_device_bytes": plan.memory["per_device_bytes"],
    }


def _layer_modes(plan: Plan, blocks: dict[int, str], graph: OpGraph) -> dict[str, Any]:
    """``recompute_mode`` (one mode, or ``"per layer"``), ``recompute_layers`` (layers per mode) and
    ``recompute_rest`` (the regions recomputed outside the layers, ``regions.rest_regions``) of a plan."""
    names: dict[str, list[str]] = {}
    for i, block in blocks.items():
        names.setdefault(block, []).append(graph.nodes[i].name)
    counts = {"none": 0, "selective": 0, "full": 0}
    for block, ops in names.items():
        marks = {plan.nodes[n].get("recompute") for n in ops if n in plan.nodes} - {None}
        counts["none" if not marks else "full" if marks == {block} else "selective"] += 1
    used = [m for m, c in counts.items() if c]
    inside = {graph.nodes[i].name for i in blocks}
    rest = sorted(
        {e["recompute"] for n, e in plan.nodes.items() if "recompute" in e and n not in inside},
        key=lambda r: (not r.startswith("before"), r),  # in graph order: before the layers, after them
    )
    return {"recompute_mode": used[0] if len(used) == 1 else "per layer", "recompute_layers": counts} | (
        {"recompute_rest": rest} if rest else {}
    )


def _hinted_context(ctx: PlanningContext, hints, input_placements, output_placements, strict: bool):
    """(context, resolved hints): the context's own hints, or new ones with any candidates they add."""
    if hints is None and input_placements is None and output_placements is None:
        resolved = ctx.hints or resolve_hints(ctx.graph, ctx.mesh)
        return ctx, resolved
    resolved = resolve_hints(
        ctx.graph,
        ctx.mesh,
        hints,
        input_placements=input_placements,
        output_placements=output_placements,
        strict=strict,
    )
    extra = resolved.missing_sources(ctx.cand)
    if extra:  # a fresh context: the caller's one stays valid for unhinted plans
        cand = _with_sources(ctx.cand, extra)
        coster = Coster(cand, ctx.coster.settings)
        ctx = replace(ctx, cand=cand, coster=coster, tables=build_tables(cand, coster), hints=resolved)
    return ctx, resolved
