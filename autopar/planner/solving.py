"""Search one planning problem under a memory cap, check the step's peak, and assemble the plan.

``plan_under`` is what ``plan_from_context`` runs per recompute mode: it restricts the
strategies (hints, a forced family, state sharding off), solves exactly
(``solve_problem``: the chained search over repeated layers, else the flat DP, or
CP-SAT), checks the peak of the step (``cost.peak_memory``) against the cap and
tightens the search's additive bound where the peak is above it, and assembles the
``Plan``.  Given ``per_layer`` (the recompute regions of a few variants), every
repeated layer takes the variant the chained search picks for it: recomputed or not,
selectively or whole, per layer (``search.chain``'s variants; the planner's tables
price each layer from its own choice alone, ``kept.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autopar.capture import Blocks
from autopar.search import ChainError, Deadline, InfeasibleError, Solution, solve_chain, solve_cpsat, solve_dp

from .assemble import assemble_plan, breakdown
from .errors import MemoryCapError, cap_error, no_plan_error
from .families import family_restriction, param_nodes
from .hints import ResolvedHints
from .problem_tables import to_problem
from .recompute_tables import recomputed_tables
from .schema import FAMILIES, Plan

if TYPE_CHECKING:
    from .pipeline import PlanningContext

__all__ = ["PLAN_GAP", "SEARCH_BUDGET_S", "family_plans", "plan_under", "solve_problem"]

log = logging.getLogger(__name__)

_PEAK_TRIES = 8
_REFINE_TRIES = 3  # searches at PLAN_GAP of the peak loop's plan (``_refine``)
#: The planner's searches stop once their plan is proven within this share of the optimum (``rel_gap`` of
#: ``search.solve_chain`` / ``search.solve_dp``): 2^-12, 16 times finer than the peak loop's tolerance (2^-8)
#: and far below the cost model's own error (a few percent against measured steps).  Measured on a 96-layer
#: GPT (8x8, per-layer recompute at a binding cap): proving the last 0.02% was 5 of the search's 7 s, over
#: near-equal mixes of saved, selective and whole layers.
PLAN_GAP = 2.0**-12
#: The searches of the peak loop (``plan_under``) stop within this share of their optimum: the loop decides
#: between bounds at 2^-8 of the step, so finer probes buy nothing; the plan it keeps is searched again at
#: ``PLAN_GAP`` (its bound's optimum, as every other plan's).
PROBE_GAP = 2.0**-9
#: The default wall-clock budget of a plan's search (``plan(search_budget_s=...)``): past it the planner returns
#: the fastest plan it has met with the bound it proved.  Measured over ``scripts/sweep_search.py``'s 50
#: configurations the slowest search took 14 s, so the budget is a guard for shapes nobody has tried, not a
#: setting that changes ordinary plans.
SEARCH_BUDGET_S = 30.0


def plan_under(
    ctx: PlanningContext,
    resolved: ResolvedHints,
    cap: int | None,
    regions: dict[int, str],
    *,
    solver: str,
    allow_state_sharding: bool,
    family: str | None,
    progress,
    above: int | None = None,
    per_layer: tuple[dict[int, str], ...] = (),
    per_rest: tuple[dict[int, str], ...] = (),
    unless_over: int | None = None,
    deadline: Deadline | None = None,
) -> Plan | None:
    """``plan_from_context`` on a context its hints (``resolved``) were applied to, with the ops of ``regions``
    recomputed (none when empty).  ``above``: the objective of a plan met already (another recompute mode's);
    ``BeatenError`` when a bound proves every plan here slower.  ``per_layer``: region maps each repeated layer
    chooses from (``regions`` is then the first's); ``ChainError`` when the layers do not chain.  ``per_rest``:
    more region maps, each one of ``per_layer``'s with the rest of the graph recomputed too, which the rest with
    the first layer may take instead (the rest's choice and the first layer's made together: ``search.chain``'s
    ``rest_variants``).  ``unless_over``: None instead of the plan when its searched (additive) memory is above
    it, before the plan is assembled (the planner asks whether the fastest plan fits a cap).  ``deadline``: the
    searches stop there (``search.deadline``) and so does the peak loop, keeping the fastest plan that fits."""
    t0 = time.perf_counter()
    base = ctx
    variant_tables = [recomputed_tables(ctx, r) for r in per_layer[1:]]  # the first is ``regions``'
    rest_tables = [recomputed_tables(ctx, r) for r in per_rest]
    if regions or per_layer:
        ctx = replace(ctx, tables=recomputed_tables(ctx, regions), recompute=regions)
    hinted = resolved.allowed(ctx.cand)
    fam_node, allow_edge = family_restriction(ctx, family) if family else (None, None)
    params = param_nodes(ctx)

    def allow_node(i: int, s: int) -> bool:
        if i in hinted and s not in hinted[i]:
            return False
        if not allow_state_sharding and i in params:
            st = ctx.cand.strategies[i][s]
            if st.state != st.placement:
                return False
        return fam_node is None or fam_node(i, s)

    check_family_keeps_hints(ctx, family, hinted, allow_node)
    restricted = bool(hinted) or not allow_state_sharding or fam_node is not None  # else allow_node is always True

    def search(bound: int | None, gap: float | None = PROBE_GAP):
        """(solution, choice) under ``bound``, within ``gap`` of its optimum; (None, the InfeasibleError, keep)
        when nothing fits."""
        allow = {"allow_node": allow_node if restricted else None, "allow_edge": allow_edge}
        problem, keep = to_problem(ctx.tables, bound, **allow)
        variants = tuple(to_problem(t, bound, **allow)[0] for t in variant_tables)
        rests = tuple(to_problem(t, bound, **allow)[0] for t in rest_tables)
        try:
            sol = solve_problem(
                problem, solver, ctx.blocks, progress, above, variants, rests, rel_gap=gap, deadline=deadline
            )
        except InfeasibleError as e:
            if e.min_mem_bytes is None and hinted:
                raise contradiction_error(ctx, resolved) from None
            if e.min_mem_bytes is None:  # no plan at all in the restricted space, whatever the cap
                raise no_plan_error(ctx, family, allow_state_sharding) from None
            return None, e, keep
        return sol, full_choice(sol, keep), keep

    def full_choice(sol: Solution, keep) -> list[int]:
        """``sol``'s choice as indices into every node's strategies (the restricted problem keeps some)."""
        return [int(keep[i][c]) for i, c in enumerate(sol.choice)] if restricted else list(sol.choice)

    # (choice, the variant each layer took) -> the breakdown (the peak check's is the plan's) and the context (per
    # layer: the regions its layers chose).  One choice of strategies may come back with other variants.
    parts: dict[tuple, dict] = {}
    contexts: dict[tuple, Any] = {}

    def key(sol: Solution, choice: list[int]) -> tuple:
        return tuple(choice), tuple(sol.stats.get("block_variants", ()))

    def peak_of(sol: Solution, choice: list[int]) -> int:
        here = ctx if not per_layer else _layers_chose(base, per_layer, per_rest, sol, choice)
        contexts[key(sol, choice)] = here
        parts[key(sol, choice)] = breakdown(here, choice)
        return parts[key(sol, choice)]["memory"]["per_device_bytes"]

    def error_context(err: InfeasibleError, keep):
        """The context that prices the least-memory plan of ``err`` (per layer: with the regions it chose)."""
        least = err.min_mem_solution
        if not per_layer or least is None:
            return ctx
        return _layers_chose(base, per_layer, per_rest, least, full_choice(least, keep))

    # the search bounds the additive memory (everything held at once); the step's peak (autopar.cost.peak) is
    # checked against the cap.  Where it is above, the bound is set below that plan's searched memory by the
    # excess (doubled each time) and 2^-8 of the cap, and searched again until a plan's peak fits; then the
    # bound is bisected between the largest that fitted and the least searched memory of a plan that did not
    # (any bound from a plan's memory up to the bound that found it finds it again; how far the peak exceeds
    # the searched memory differs from plan to plan), keeping the fastest plan that fits.  Tightened past every
    # plan (a bound with no plan at all, ``under``, is bisected with the plan over it first), the least-memory
    # plan is taken if its peak fits.
    #
    # What the bisection can still gain is bounded: the optimum under a bound b is non-increasing in b, so every
    # bound between ``fits`` and ``over`` gives a plan with time in [t(over), t(best)] (``t(over)``: the optimum
    # under the bound that found ``over``, or the lower bound that search proved, ``Solution.time_lower_bound``,
    # where it stopped within ``PLAN_GAP``).  It stops once that gap, or the bounds' gap, is at most 2^-8 of the
    # step (of the cap).  ``lower``, the optimum at the cap itself (likewise), bounds every plan any bound <= cap
    # gives (Plan.search["peak_lower_ps"]: the planner's other recompute modes need not be
    # searched when the plan is within the tolerance of it).
    bound, fits, over, best, searches = cap, None, None, None, 0
    lower, over_time, under, best_bound = None, None, None, None
    probe = max(PROBE_GAP, PLAN_GAP) if cap is not None else None  # never finer than the plan's own search
    tolerance = max(cap >> 8, 1 << 20) if cap is not None else 0
    for attempt in range(_PEAK_TRIES + 1):
        if best is not None and deadline is not None and deadline.passed():
            break  # out of time: the fastest plan that fits so far
        searches += 1
        # the first search at the cap is most often the plan (its peak fits): at PLAN_GAP; the rest probe
        bounded = bound if attempt < _PEAK_TRIES or best is not None else 0
        sol, choice, keep = search(bounded, probe if attempt else None)
        if sol is None:
            err = choice
            least = err.min_mem_solution
            if best is not None:
                break
            if attempt == 0 or least is None:
                raise cap_error(error_context(err, keep), cap, err, keep) from None
            under = bound  # no plan's searched memory is this small: bisect towards the plan that was over
            if over - under > tolerance and attempt < _PEAK_TRIES - 1:
                bound = (under + over) // 2
                continue
            sol, choice = least, full_choice(least, keep)
            if peak_of(sol, choice) > cap:
                raise cap_error(contexts[key(sol, choice)], cap, err, keep) from None
            best = (sol, choice)
            break
        if unless_over is not None and sol.mem_bytes > unless_over:
            return None
        if cap is None:
            if per_layer:
                peak_of(sol, choice)
            best = (sol, choice)
            break
        peak = peak_of(sol, choice)
        if log.isEnabledFor(logging.DEBUG):  # the memory breakdown's key walks the whole choice
            log.debug(
                "peak search %d: bound %s, searched memory %d, peak %d, cap %d, time %d ps (%s)",
                attempt,
                bound,
                sol.mem_bytes,
                peak,
                cap,
                sol.time,
                parts[key(sol, choice)]["memory"],
            )
        lower = sol.time_lower_bound if lower is None else lower
        if peak <= cap:
            if best is None or (sol.time, sol.mem_bytes) < (best[0].time, best[0].mem_bytes):
                best, best_bound = (sol, choice), bound
            fits = bound
            if over is None:
                break  # the bound's own optimum fits: nothing faster does
        else:
            over, over_time = sol.mem_bytes, sol.time_lower_bound  # each bound from its memory to this one: no faster
        if best is None:  # below by the excess, doubled each time, and the tolerance (the excess varies a little)
            bound = sol.mem_bytes - ((peak - cap) << attempt) - (cap >> 8)
            if under is not None:  # not past a bound that had no plan
                bound = max(bound, (under + sol.mem_bytes) // 2)
        elif over - fits <= tolerance or best[0].time - over_time <= best[0].time >> 8 or attempt == _PEAK_TRIES - 1:
            break
        else:
            bound = (fits + over) // 2
    sol, choice = best
    late = deadline is not None and deadline.passed()
    if best_bound is not None and not late and sol.time - sol.time_lower_bound > sol.time * PLAN_GAP:
        sol, choice, more = _refine(search, peak_of, sol, choice, best_bound, cap)
        searches += more
    search_s = time.perf_counter() - t0
    timings = dict(ctx.timings, search_s=search_s)
    settings = dict(ctx.settings, mem_cap_bytes=cap, solver=solver)
    ctx = contexts.get(key(sol, choice), ctx)
    result = assemble_plan(ctx, choice, sol, settings, [], parts.get(key(sol, choice)))
    search = dict(result.search, peak_searches=searches)  # > 1: the peak, not the bound, held the plan back
    if deadline is not None and (late or sol.stats.get("budget_hit")):
        search.update(budget_hit=True, budget_s=deadline.budget_s)
    if lower is not None:
        search["peak_lower_ps"] = int(lower)
    return replace(result, timings=timings, hints=dict(resolved.record), search=search)


def _refine(search, peak_of, sol: Solution, choice: list[int], bound: int, cap: int) -> tuple[Solution, list, int]:
    """The peak loop's plan (a probe's, within ``PROBE_GAP`` of the optimum under ``bound``) searched again at
    ``PLAN_GAP``: (plan, choice, searches run).  The finer plan replaces it where it is no slower and its peak
    fits the cap; where its peak is over, the bound steps below its memory by the excess (as the peak loop
    does) and the search runs again, at most ``_REFINE_TRIES`` times.  Else the probe's plan stays, with the
    first finer search's lower bound where that is the tighter (it bounds the optimum under the same bound)."""
    lower, tries = sol.time_lower_bound, 0
    while tries < _REFINE_TRIES:
        tries += 1
        finer, finer_choice, _ = search(bound, None)
        if finer is None or finer.time > sol.time:
            break
        if tries == 1:
            lower = max(lower, finer.time_lower_bound)
        peak = peak_of(finer, finer_choice)
        if peak <= cap:
            return finer, finer_choice, tries
        bound = finer.mem_bytes - (peak - cap) - (cap >> 8)
    if lower > sol.time_lower_bound:
        sol = replace(sol, stats=dict(sol.stats, lower_bound=lower, gap=(sol.time - lower) / sol.time))
    return sol, choice, tries


def _layers_chose(
    ctx, per_layer: tuple[dict[int, str], ...], per_rest: tuple[dict[int, str], ...], sol: Solution, choice: list[int]
):
    """The context whose recompute regions are those each layer's variant has (``sol.stats["block_variants"]``;
    the first layer's indexes ``per_layer + per_rest``, and the rest's regions come with it); AssertionError
    unless its tables price ``choice`` as the search did (each layer priced from its own choice)."""
    picks = sol.stats.get("block_variants", (0,) * len(ctx.blocks.nodes))
    inside = {i for nodes in ctx.blocks.nodes for i in nodes}
    first = (*per_layer, *per_rest)[picks[0]]
    regions = {i: r for i, r in first.items() if i not in inside}
    for b, (nodes, j) in enumerate(zip(ctx.blocks.nodes, picks)):
        chosen = first if b == 0 else per_layer[j]
        regions.update((i, chosen[i]) for i in nodes if i in chosen)
    mixed = replace(ctx, tables=recomputed_tables(ctx, regions), recompute=regions)
    got = mixed.tables.problem(None)[0].evaluate(choice)
    if got != (sol.time, sol.mem_bytes):
        raise AssertionError(
            f"per-layer recomputation: the chosen layers price the plan at {got}, the search at "
            f"{(sol.time, sol.mem_bytes)} (a layer's terms depend on another layer's choice)"
        )
    return mixed


def check_family_keeps_hints(ctx: PlanningContext, family: str | None, hinted: dict, allow_node) -> None:
    if family is None:
        return
    for i, kept in hinted.items():
        if not any(allow_node(i, s) for s in kept):
            node = ctx.graph.nodes[i]
            raise ValueError(
                f"family {family!r} and the hints on {node.fqn or node.name} (shape {node.outputs[0].shape}) "
                f"exclude each other on {ctx.mesh}: no strategy keeps both.\n"
                "Fix: drop the family (family=None) to let the search complete the hints, or change the hints."
            )


def contradiction_error(ctx: PlanningContext, resolved: ResolvedHints) -> ValueError:
    labels = sorted({label for ls in resolved.labels.values() for label in ls})
    return ValueError(
        f"the hints {', '.join(labels)} together leave no valid plan of {ctx.graph.model_name} on {ctx.mesh}: "
        "every plan needs a move between hinted placements that autopar cannot make.\n"
        "Fix: hint fewer tensors, or placements that a collective can connect."
    )


def solve_problem(
    problem,
    solver: str,
    blocks: Blocks | None = None,
    progress=None,
    above: int | None = None,
    variants=(),
    rest_variants=(),
    rel_gap: float | None = None,
    deadline: Deadline | None = None,
) -> Solution:
    """The optimum, or a plan proven within ``rel_gap`` of it (None: ``PLAN_GAP``, read at the call; 0: exact);
    ``above`` (a time met already) lets the chained search stop early (``BeatenError``).
    ``variants`` (problems whose layers' terms are alternatives) and ``rest_variants`` (alternatives of the rest
    with the first layer; ``search.chain``) need the chained search: ``ChainError`` when it does not apply.
    ``deadline``: the search returns its best plan and proven bound there (CP-SAT does not read it)."""
    if solver != "dp":
        return solve_cpsat(problem)
    rel_gap = PLAN_GAP if rel_gap is None else rel_gap
    if blocks is not None:
        try:
            return solve_chain(
                problem,
                [list(b) for b in blocks.nodes],
                progress=progress,
                above=above,
                variants=variants,
                rest_variants=rest_variants,
                rel_gap=rel_gap,
                deadline=deadline,
            )
        except ChainError as e:
            if variants or rest_variants:
                raise
            log.info("the %d repeated blocks under %s do not chain (%s); solving flat", blocks.count, blocks.prefix, e)
    tick = None if progress is None else lambda done, total: progress("search", done, total)
    return solve_dp(problem, progress=tick, rel_gap=rel_gap, deadline=deadline)


# ---- families ---------------------------------------------------------------------------
def family_plans(
    ctx: PlanningContext,
    cap: int | None,
    solver: str,
    regions: dict[int, str] | None = None,
    deadline: Deadline | None = None,
) -> list[tuple[dict[str, Any], Plan | None]]:
    """The fastest plan of each forced family (``FAMILIES``) under ``cap``, with the recompute ``regions`` the
    plan they are compared with has: each through ``plan_under``'s peak loop as the chosen plan went, so a row's
    memory is the step's peak and a row that fits says so only when that peak is within the cap.  A family whose
    plan does not do what the family names (data parallel at a batch smaller than every mesh axis) is a row with
    no plan and the reason (``why``).  Each row comes with its plan (None where there is none)."""
    from .hints import resolve_hints

    unhinted = resolve_hints(ctx.graph, ctx.mesh)
    out: list[tuple[dict[str, Any], Plan | None]] = []
    for family in FAMILIES:
        entry: dict[str, Any] = {"family": family}
        plan = None
        why = _family_impossible(ctx, family)
        try:
            if why:
                raise ValueError(why)
            plan = plan_under(
                ctx,
                unhinted,
                cap,
                regions or {},
                solver=solver,
                allow_state_sharding=True,
                family=family,
                progress=None,
                deadline=deadline,
            )
        except MemoryCapError as e:
            entry.update(_no_plan(), min_per_device_bytes=int(e.min_mem_bytes), proven="approximate" not in e.problem)
        except ValueError:  # no plan of that family at any memory
            entry.update(_no_plan(), min_per_device_bytes=None, **({"why": why} if why else {}))
        else:
            entry.update(
                feasible=True,
                total_s=plan.cost["total_s"],
                compute_s=plan.cost["compute_s"],
                comm_s=plan.cost["comm_s"],
                per_device_bytes=plan.memory["per_device_bytes"],
                terms=plan.cost["terms"],
            )
        out.append((entry, plan))
    return out


def _no_plan() -> dict[str, Any]:
    return {
        "feasible": False,
        "proven": True,
        "total_s": None,
        "compute_s": None,
        "comm_s": None,
        "per_device_bytes": None,
    }


def _family_impossible(ctx: PlanningContext, family: str) -> str | None:
    """Why ``family`` has no plan worth the name on this context (None when it may): data parallelism splits
    the batch, which a batch smaller than every mesh axis cannot be."""
    if family != "data parallel":
        return None
    sizes = [n.outputs[0].shape[0] for n in ctx.graph.nodes if n.kind == "input" and n.outputs and n.outputs[0].ndim]
    batch = max(set(sizes), key=sizes.count) if sizes else None
    if batch is not None and batch < min(ctx.mesh.shape):
        return f"a batch of {batch} is smaller than every mesh axis ({ctx.mesh}): no axis can split it"
    return None
