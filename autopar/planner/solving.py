"""Search one planning problem under a memory cap, check the step's peak, and assemble the plan.

``plan_under`` is what ``plan_from_context`` runs per recompute mode: it restricts the
strategies (hints, a forced family, state sharding off: ``SearchSpace``), solves exactly
(``solve_problem``: the chained search over repeated layers, else the flat DP, or
CP-SAT), checks the peak of the step (``cost.peak_memory``) against the cap and
tightens the search's additive bound where the peak is above it (``PeakLoop``), and
assembles the ``Plan``.  Given ``Recomputed.per_layer`` (the recompute regions of a few
variants), every repeated layer takes the variant the chained search picks for it:
recomputed or not, selectively or whole, per layer (``search.chain``'s variants; the
planner's tables price each layer from its own choice alone, ``kept.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autopar.capture import Blocks
from autopar.search import ChainError, Deadline, InfeasibleError, Solution, Start, solve_chain, solve_cpsat, solve_dp

from .assemble import assemble_plan, breakdown, node_costs
from .errors import MemoryCapError, cap_error, no_plan_error
from .families import family_restriction, param_nodes
from .hints import ResolvedHints, resolve_hints
from .options import PlanOptions
from .plan_parts import FamilyAlternative, PlanSettings, hints_of
from .problem_tables import ProblemTables, to_problem, weighted
from .recompute_tables import recomputed_tables
from .schema import FAMILIES, Plan

if TYPE_CHECKING:
    from .context import PlanningContext

__all__ = [
    "PLAN_GAP",
    "CheckedPlans",
    "PeakLoop",
    "Recomputed",
    "SearchRun",
    "SearchSpace",
    "family_plans",
    "plan_under",
    "solve_problem",
]

log = logging.getLogger(__name__)

_PEAK_TRIES = 8
_REFINE_TRIES = 3  # searches at PLAN_GAP of the peak loop's plan (``PeakLoop.refine``)
#: The planner's searches stop once their plan is proven within this share of the optimum (``rel_gap`` of
#: ``search.solve_chain`` / ``search.solve_dp``): 2^-12, 16 times finer than the peak loop's tolerance (2^-8)
#: and far below the cost model's own error (a few percent against measured steps).  Measured on a 96-layer
#: GPT (8x8, per-layer recompute at a binding cap): proving the last 0.02% was 5 of the search's 7 s, over
#: near-equal mixes of saved, selective and whole layers.
PLAN_GAP = 2.0**-12
#: The searches of the peak loop (``PeakLoop``) stop within this share of their optimum: the loop decides
#: between bounds at 2^-8 of the step, so finer probes buy nothing; the plan it keeps is searched again at
#: ``PLAN_GAP`` (its bound's optimum, as every other plan's).
PROBE_GAP = 2.0**-9


@dataclass(frozen=True, slots=True)
class SearchRun:
    """How one plan's searches run: the ``deadline`` they stop at (``PlanOptions.search_budget_s``, from when the
    search began), the ``progress(stage, done, total)`` callback (None: none), and ``above``: the step, in
    picoseconds of the searched objective, of a plan the caller has already (another candidate's,
    ``pipeline_choice``): the recompute modes' searches stop with ``BeatenError`` where a bound proves every plan
    slower (None: search to the plan).  ``checked``: the plans whose step peak was checked, shared by every search
    of one context (``CheckedPlans``; None: each ``plan_under`` keeps its own).  ``refine``: the peak loop searches
    its plan again at ``PLAN_GAP`` (``PeakLoop.refine``); False: it keeps its probe's plan (within ``PROBE_GAP``,
    its proven gap in its stats), as a loop that bisected does, for a caller that bisects bounds itself (the stage
    fitting's weighted searches)."""

    deadline: Deadline | None = None
    progress: Callable[[str, int, int], None] | None = None
    above: int | None = None
    checked: CheckedPlans | None = None
    refine: bool = True


class CheckedPlans:
    """The step breakdowns (``assemble.breakdown``: the peak check) of the plans checked so far on one context, by
    (choice, recompute regions): the searches of one context (a pipeline's free stage search and the weighted
    searches of its stage fitting, each recompute mode, each bound of the peak loop) meet the same plans again.
    A breakdown depends on the context's graph, candidates, coster and mesh, the plan's choice and the regions its
    ops recompute, not on the search's bound, cap or activation weight, so one context's searches may share it.
    Measured (Llama 3 405B on (2, 4096), ``pipeline="auto"``): 274 checks of about 0.5 s, 193 of them distinct."""

    def __init__(self) -> None:
        self.found: dict[tuple, Any] = {}
        self.walks = 0  # the breakdowns walked (the rest were met again)

    def breakdown(self, here, choice: list[int]):
        """``assemble.breakdown(here, choice)`` (``here``: the context with the plan's recompute regions), walked
        once per (choice, regions)."""
        key = (tuple(choice), tuple(sorted(here.recompute.items())))
        if key not in self.found:
            self.found[key] = breakdown(here, choice)
            self.walks += 1
        return self.found[key]


@dataclass(frozen=True, slots=True)
class Recomputed:
    """What backward recomputes in one search: the ops of ``regions`` (op node -> region; none when empty), or,
    given ``per_layer`` (region maps each repeated layer chooses from; ``regions`` is then the first's), what
    each layer picks.  ``per_rest``: more region maps, each one of ``per_layer``'s with the rest of the graph
    recomputed too, which the rest with the first layer may take instead (the rest's choice and the first
    layer's made together: ``search.chain``'s ``rest_variants``)."""

    regions: dict[int, str]
    per_layer: tuple[dict[int, str], ...] = ()
    per_rest: tuple[dict[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Probe:
    """One search's plan: its solution and its choice as indices into every node's strategies."""

    sol: Solution
    choice: list[int]

    @property
    def key(self) -> tuple:
        """(choice, the variant each layer took): one choice of strategies may come back with other variants."""
        return tuple(self.choice), tuple(self.sol.stats.get("block_variants", ()))


@dataclass(frozen=True, slots=True)
class NoFit:
    """A search with no plan under its bound: the search's error (its least-memory plan) and the restricted
    problem's kept strategies (``to_problem``'s ``keep``)."""

    error: InfeasibleError
    keep: Any


def plan_under(
    ctx: PlanningContext,
    resolved: ResolvedHints,
    recomputed: Recomputed,
    options: PlanOptions,
    run: SearchRun,
    *,
    above: int | None = None,
    unless_over: int | None = None,
) -> Plan | None:
    """``plan_from_context`` on a context its hints (``resolved``) were applied to, under ``options.mem_cap``
    (None: no cap) with ``options``' solver, family and state rule, the ops ``recomputed`` says recomputed.
    ``above``: the objective of a plan met already (another recompute mode's); ``BeatenError`` when a bound
    proves every plan here slower.  ``ChainError`` when ``recomputed.per_layer`` is given and the layers do not
    chain.  ``unless_over``: None instead of the plan when its searched (additive) memory is above it, before
    the plan is assembled (the planner asks whether the fastest plan fits a cap).  ``run.deadline``: the
    searches stop there (``search.deadline``) and so does the peak loop, keeping the fastest plan that fits."""
    space = SearchSpace(ctx, resolved, recomputed, options, run, above)
    loop = PeakLoop(space, options.mem_cap, run.deadline)
    best = loop.run(unless_over)
    if best is None:
        return None
    here = space.contexts.get(best.key, space.ctx)
    settings = PlanSettings(**here.settings, mem_cap_bytes=options.mem_cap, solver=options.solver)
    parts = space.parts.get(best.key) or breakdown(here, best.choice)
    result = assemble_plan(here, best.choice, best.sol, settings, (), parts)
    search = replace(result.search, peak_searches=loop.searches)  # > 1: the peak, not the bound, held it back
    if run.deadline is not None and (loop.late or best.sol.stats.get("budget_hit")):
        search = replace(search, budget_hit=True, budget_s=run.deadline.budget_s)
    if loop.lower is not None:
        search = replace(search, peak_lower_ps=int(loop.lower))
    # search_s is the whole call's: search_context times every search (modes, peak loop, family rows)
    return replace(
        result,
        timings=dict(space.ctx.timings),
        hints=hints_of(resolved.record),
        search=search,
        node_costs=node_costs(here, best.choice, parts),
    )


class SearchSpace:
    """The strategies one ``plan_under`` may choose from (hints, a forced family, state sharding off) and its
    searches under a bound; the context and breakdown of each plan whose peak was checked, by ``Probe.key``
    (per layer: the context with the regions its layers chose)."""

    def __init__(self, ctx, resolved: ResolvedHints, recomputed: Recomputed, options: PlanOptions, run, above):
        self.base, self.resolved, self.recomputed, self.options, self.run, self.above = (
            ctx,
            resolved,
            recomputed,
            options,
            run,
            above,
        )
        per_layer, regions = recomputed.per_layer, recomputed.regions
        self.variant_tables = [recomputed_tables(ctx, r) for r in per_layer[1:]]  # the first is ``regions``'
        self.rest_tables = [recomputed_tables(ctx, r) for r in recomputed.per_rest]
        if regions or per_layer:
            ctx = replace(ctx, tables=recomputed_tables(ctx, regions), recompute=regions)
        self.ctx = ctx
        self.hinted = resolved.allowed(ctx.cand)
        family = options.family
        self.family_node, self.allow_edge = family_restriction(ctx, family) if family else (None, None)
        self.params = param_nodes(ctx)
        check_family_keeps_hints(ctx, family, self.hinted, self.allow_node)
        # else allow_node is always True
        self.restricted = bool(self.hinted) or not options.allow_state_sharding or self.family_node is not None
        self.parts: dict[tuple, Any] = {}
        self.contexts: dict[tuple, Any] = {}
        self.checked = run.checked if run.checked is not None else CheckedPlans()

    def allow_node(self, i: int, s: int) -> bool:
        if i in self.hinted and s not in self.hinted[i]:
            return False
        if not self.options.allow_state_sharding and i in self.params:
            st = self.ctx.cand.strategies[i][s]
            if st.state != st.placement:
                return False
        return self.family_node is None or self.family_node(i, s)

    def search(
        self, bound: int | None, gap: float | None, seed: Solution | None = None, at_cap: bool = True
    ) -> Probe | NoFit:
        """The plan under ``bound``, within ``gap`` of its optimum (None: ``PLAN_GAP``), or ``NoFit``; ``seed``: a
        solution of the search under the same bound to start from (``solve_problem``).  ``at_cap``: ``bound`` is
        the cap itself, so a bound the search proves (``BeatenError`` past ``above``) holds for every plan the
        peak loop can return; under a bound it tightened (``PeakLoop``) a proof says nothing of the looser bounds
        it may bisect back to, so those searches run to their plan."""
        allow = {"allow_node": self.allow_node if self.restricted else None, "allow_edge": self.allow_edge}
        weight, params = self.base.activation_weight, self.params

        def problem_of(tables: ProblemTables):  # the stage plan of a pipeline weighs activations (weighted)
            return to_problem(weighted(tables, weight, params), bound, **allow)

        problem, keep = problem_of(self.ctx.tables)
        variants = tuple(problem_of(t)[0] for t in self.variant_tables)
        rests = tuple(problem_of(t)[0] for t in self.rest_tables)
        solver, blocks = self.options.solver, self.ctx.blocks
        try:
            start = Start(self.above if at_cap else None, seed)
            sol = solve_problem(problem, solver, blocks, variants, rests, self.run, start=start, rel_gap=gap)
        except InfeasibleError as e:
            if e.min_mem_bytes is None and self.hinted:
                raise contradiction_error(self.ctx, self.resolved) from None
            if e.min_mem_bytes is None:  # no plan at all in the restricted space, whatever the cap
                raise no_plan_error(self.ctx, self.options.family, self.options.allow_state_sharding) from None
            return NoFit(e, keep)
        return Probe(sol, self.full_choice(sol, keep))

    def full_choice(self, sol: Solution, keep) -> list[int]:
        """``sol``'s choice as indices into every node's strategies (the restricted problem keeps some)."""
        return [int(keep[i][c]) for i, c in enumerate(sol.choice)] if self.restricted else list(sol.choice)

    def peak_of(self, probe: Probe) -> int:
        """The step's peak memory of ``probe``'s plan (its breakdown and context kept)."""
        per_layer = self.recomputed.per_layer
        here = self.ctx if not per_layer else _layers_chose(self.base, self.recomputed, probe.sol, probe.choice)
        self.contexts[probe.key] = here
        self.parts[probe.key] = self.checked.breakdown(here, probe.choice)
        return self.parts[probe.key].memory.per_device_bytes

    def error_context(self, no_fit: NoFit):
        """The context that prices the least-memory plan of ``no_fit`` (per layer: with the regions it chose)."""
        least = no_fit.error.min_mem_solution
        if not self.recomputed.per_layer or least is None:
            return self.ctx
        return _layers_chose(self.base, self.recomputed, least, self.full_choice(least, no_fit.keep))


class PeakLoop:
    """The peak-memory bisection of one ``plan_under``: the bound on the searched (additive) memory, lowered until
    a plan's step peak fits the cap, then bisected towards the fastest plan that fits.

    The search bounds the additive memory (everything held at once); the step's peak (autopar.cost.peak) is
    checked against the cap.  Where it is above, the bound is set below that plan's searched memory by the
    excess (doubled each time) and 2^-8 of the cap, and searched again until a plan's peak fits; then the bound
    is bisected between the largest that fitted (``fits``) and the least searched memory of a plan that did not
    (``over``; any bound from a plan's memory up to the bound that found it finds it again; how far the peak
    exceeds the searched memory differs from plan to plan), keeping the fastest plan that fits (``best``).
    Tightened past every plan (a bound with no plan at all, ``under``, is bisected with the plan over it
    first), the least-memory plan is taken if its peak fits.

    What the bisection can still gain is bounded: the optimum under a bound b is non-increasing in b, so every
    bound between ``fits`` and ``over`` gives a plan with time in [t(over), t(best)] (``over_time``: the optimum
    under the bound that found ``over``, or the lower bound that search proved, ``Solution.time_lower_bound``,
    where it stopped within ``PLAN_GAP``).  It stops once that gap, or the bounds' gap, is at most 2^-8 of the
    step (of the cap: ``tolerance``).  ``lower``, the optimum at the cap itself (likewise), bounds every plan any
    bound <= cap gives (``Plan.search.peak_lower_ps``: the planner's other recompute modes need not be searched
    when the plan is within the tolerance of it).  Past the deadline the loop keeps the fastest plan that fits so
    far (``late``).  Every search of the loop probes at ``PROBE_GAP``, the first (at the cap) too where the chained
    search runs, and the plan kept is searched again at ``PLAN_GAP`` (``refine``), starting from where its probe
    stopped (its plan and proven bound: ``search.solve_chain``'s ``seed``), so proving the last share costs
    once, and only for the plan kept (the flat DP takes no seed: there the first search runs at ``PLAN_GAP``),
    and not where the caller's plan is faster than the probe's proven bound (``beaten``).  Measured (a
    24-layer GPT, width 3072, 8x8, 24 GiB, per-layer recomputation): the first search at
    ``PLAN_GAP`` took 60 s, 56 of them proving its last 0.3%, and then its plan's peak missed the cap.

    Nor is it refined where the loop bisected (``over``: a plan's peak was over the cap, so the plan kept is the
    optimum of a tightened bound, not of the cap).  Its distance from the fastest plan that fits is then known only
    to the bisection's tolerance (2^-8 of the step, or of the cap in bound), and proving the last 2^-9 to 2^-12
    under one bound would not make it known better: the probe's plan is kept with its own proven gap
    (``Plan.search.gap``, at most ``PROBE_GAP``).  Measured (Llama-7B shapes, 64 devices, 8x8, bf16): that refinement
    was 17 s of the mesh's 27 s, for a plan 0.009% faster.
    """

    def __init__(self, space: SearchSpace, cap: int | None, deadline: Deadline | None) -> None:
        self.space, self.cap, self.deadline = space, cap, deadline
        self.bound = cap  # the next search's bound on the searched memory
        self.fits: int | None = None
        self.over: int | None = None
        self.over_time: int | None = None
        self.under: int | None = None
        self.best: Probe | None = None
        self.best_bound: int | None = None  # the bound that found ``best``
        self.lower: int | None = None
        self.searches = 0
        self.late = False  # the deadline had passed when the loop ended
        self.probe_gap = max(PROBE_GAP, PLAN_GAP) if cap is not None else None  # never finer than the plan's own
        # the first search probes too where its refinement can start from it (the chained search takes a seed);
        # the flat DP starts afresh, so there the first search is the plan's own
        chained = space.ctx.blocks is not None and space.options.solver == "dp"
        self.first_gap = self.probe_gap if chained else None
        self.tolerance = max(cap >> 8, 1 << 20) if cap is not None else 0

    def run(self, unless_over: int | None = None) -> Probe | None:
        """The fastest plan whose peak fits (refined); None when the first plan's searched memory is above
        ``unless_over``.  ``MemoryCapError`` when no plan's peak fits."""
        for attempt in range(_PEAK_TRIES + 1):
            if self.best is not None and self.deadline is not None and self.deadline.passed():
                break  # out of time: the fastest plan that fits so far
            self.searches += 1
            bound = self.bound if attempt < _PEAK_TRIES or self.best is not None else 0
            found = self.space.search(bound, self.probe_gap if attempt else self.first_gap, at_cap=bound == self.cap)
            if isinstance(found, NoFit):
                done = self.no_plan_under(found, attempt)
            elif unless_over is not None and found.sol.mem_bytes > unless_over:
                return None
            else:
                done = self.checked(found, attempt)
            if done:
                break
        self.late = self.deadline is not None and self.deadline.passed()
        sol = self.best.sol
        coarse = sol.time - sol.time_lower_bound > sol.time * PLAN_GAP
        bisected = self.over is not None  # the plan is a tightened bound's: known to the loop's tolerance only
        settled = not self.space.run.refine or self.late or bisected or self.beaten(sol)
        if self.best_bound is not None and coarse and not settled:
            self.best = self.refine(self.best)
        return self.best

    def beaten(self, sol: Solution) -> bool:
        """Whether refining the loop's plan ``sol`` is moot: the caller has a plan (``SearchSpace.above``, another
        candidate's or mesh's) faster than every plan under ``sol``'s bound (``sol.time_lower_bound`` above it),
        so the refined plan would lose too.  The probe's plan is kept, its proven gap in its stats: a plan that
        fits, priced exactly, within ``PROBE_GAP`` of the optimum under its bound.  (Measured: Llama-7B shapes on
        16 x 4 of 64 devices, where 8 x 8 was 0.6% faster: the refinement was 14 of the mesh's 26 s.)"""
        above = self.space.above
        return above is not None and sol.time_lower_bound > above

    def no_plan_under(self, no_fit: NoFit, attempt: int) -> bool:
        """A bound with no plan: bisect towards the plan that was over, or take the least-memory plan if its peak
        fits.  Whether the loop is done."""
        cap, least = self.cap, no_fit.error.min_mem_solution
        if self.best is not None:
            return True
        if attempt == 0 or least is None:
            raise cap_error(self.space.error_context(no_fit), cap, no_fit.error, no_fit.keep) from None
        self.under = self.bound  # no plan's searched memory is this small
        if self.over - self.under > self.tolerance and attempt < _PEAK_TRIES - 1:
            self.bound = (self.under + self.over) // 2
            return False
        probe = Probe(least, self.space.full_choice(least, no_fit.keep))
        if self.space.peak_of(probe) > cap:
            raise cap_error(self.space.contexts[probe.key], cap, no_fit.error, no_fit.keep) from None
        self.best = probe
        return True

    def checked(self, probe: Probe, attempt: int) -> bool:
        """``probe``'s peak against the cap: kept if it fits and is the fastest so far, and the next bound set.
        Whether the loop is done."""
        cap, sol = self.cap, probe.sol
        if cap is None:
            if self.space.recomputed.per_layer:
                self.space.peak_of(probe)  # its context: the regions its layers chose
            self.best = probe
            return True
        peak = self.space.peak_of(probe)
        if log.isEnabledFor(logging.DEBUG):  # the memory breakdown's key walks the whole choice
            memory = self.space.parts[probe.key].memory
            log.debug(
                "peak search %d: bound %s, searched memory %d, peak %d, cap %d, time %d ps (%s)",
                attempt,
                self.bound,
                sol.mem_bytes,
                peak,
                cap,
                sol.time,
                memory,
            )
        self.lower = sol.time_lower_bound if self.lower is None else self.lower
        if peak <= cap:
            if self.best is None or (sol.time, sol.mem_bytes) < (self.best.sol.time, self.best.sol.mem_bytes):
                self.best, self.best_bound = probe, self.bound
            self.fits = self.bound
            if self.over is None:
                return True  # the bound's own optimum fits: nothing faster does
        else:
            self.over, self.over_time = sol.mem_bytes, sol.time_lower_bound  # each bound from its memory: no faster
        return self.step(sol, peak, attempt)

    def step(self, sol: Solution, peak: int, attempt: int) -> bool:
        """The next bound after ``sol`` (peak ``peak``), or done when the bisection can gain no more."""
        cap = self.cap
        if self.best is None:  # below by the excess, doubled each time, and the tolerance (the excess varies a little)
            self.bound = sol.mem_bytes - ((peak - cap) << attempt) - (cap >> 8)
            if self.under is not None:  # not past a bound that had no plan
                self.bound = max(self.bound, (self.under + sol.mem_bytes) // 2)
            return False
        best = self.best.sol
        if (
            self.over - self.fits <= self.tolerance
            or best.time - self.over_time <= best.time >> 8
            or attempt == _PEAK_TRIES - 1
        ):
            return True
        self.bound = (self.fits + self.over) // 2
        return False

    def refine(self, probe: Probe) -> Probe:
        """The loop's plan (a probe's, within ``PROBE_GAP`` of the optimum under ``best_bound``) searched again at
        ``PLAN_GAP``.  The finer plan replaces it where it is no slower and its peak fits the cap; where its peak
        is over, the bound steps below its memory by the excess (as the loop does) and the search runs again, at
        most ``_REFINE_TRIES`` times.  Else the probe's plan stays, with the first finer search's lower bound
        where that is the tighter (it bounds the optimum under the same bound).  The first finer search starts
        from the probe's solution (same bound: ``seed``); at the cap, its lower bound tightens ``lower``."""
        sol, bound, cap = probe.sol, self.best_bound, self.cap
        lower, tries = sol.time_lower_bound, 0
        while tries < _REFINE_TRIES:
            tries += 1
            finer = self.space.search(bound, None, seed=sol if tries == 1 else None, at_cap=bound == cap)
            if isinstance(finer, NoFit) or finer.sol.time > sol.time:
                break
            if tries == 1:
                lower = max(lower, finer.sol.time_lower_bound)
                if bound == cap and self.lower is not None:
                    self.lower = max(self.lower, lower)
            peak = self.space.peak_of(finer)
            if peak <= cap:
                self.searches += tries
                return finer
            bound = finer.sol.mem_bytes - (peak - cap) - (cap >> 8)
        self.searches += tries
        if lower > sol.time_lower_bound:
            sol = replace(sol, stats=dict(sol.stats, lower_bound=lower, gap=(sol.time - lower) / sol.time))
        return Probe(sol, probe.choice)


def _layers_chose(ctx, recomputed: Recomputed, sol: Solution, choice: list[int]):
    """The context whose recompute regions are those each layer's variant has (``sol.stats["block_variants"]``;
    the first layer's indexes ``per_layer + per_rest``, and the rest's regions come with it); AssertionError
    unless its tables price ``choice`` as the search did (each layer priced from its own choice)."""
    per_layer = recomputed.per_layer
    picks = sol.stats.get("block_variants", (0,) * len(ctx.blocks.nodes))
    inside = {i for nodes in ctx.blocks.nodes for i in nodes}
    first = (*per_layer, *recomputed.per_rest)[picks[0]]
    regions = {i: r for i, r in first.items() if i not in inside}
    for b, (nodes, j) in enumerate(zip(ctx.blocks.nodes, picks)):
        chosen = first if b == 0 else per_layer[j]
        regions.update((i, chosen[i]) for i in nodes if i in chosen)
    mixed = replace(ctx, tables=recomputed_tables(ctx, regions), recompute=regions)
    searched = weighted(mixed.tables, ctx.activation_weight, param_nodes(ctx))  # as SearchSpace.search weighs them
    got = searched.problem(None)[0].evaluate(choice)
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
    variants=(),
    rest_variants=(),
    run: SearchRun | None = None,
    *,
    start: Start | None = None,
    rel_gap: float | None = None,
) -> Solution:
    """The optimum, or a plan proven within ``rel_gap`` of it (None: ``PLAN_GAP``, read at the call; 0: exact);
    ``start.above`` (a time met already) lets the chained search stop early (``BeatenError``).
    ``variants`` (problems whose layers' terms are alternatives) and ``rest_variants`` (alternatives of the rest
    with the first layer; ``search.chain``) need the chained search: ``ChainError`` when it does not apply.
    ``run``: its deadline, where the search returns its best plan and proven bound (CP-SAT does not read it),
    and its progress callback.  ``start.seed``: a solution of the same problem the chained search starts from
    (``search.solve_chain``; the flat DP and CP-SAT start afresh)."""
    start = start or Start()
    if solver != "dp":
        return solve_cpsat(problem)
    rel_gap = PLAN_GAP if rel_gap is None else rel_gap
    progress, deadline = (run.progress, run.deadline) if run is not None else (None, None)
    if blocks is not None:
        try:
            return solve_chain(
                problem,
                [list(b) for b in blocks.nodes],
                progress=progress,
                start=start,
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
    ctx: PlanningContext, options: PlanOptions, regions: dict[int, str] | None = None, deadline: Deadline | None = None
) -> list[tuple[FamilyAlternative, Plan | None]]:
    """The fastest plan of each forced family (``FAMILIES``) under ``options.mem_cap``, with the recompute
    ``regions`` the plan they are compared with has: each through ``plan_under``'s peak loop as the chosen plan
    went, so a row's memory is the step's peak and a row that fits says so only when that peak is within the cap.
    A family whose plan does not do what the family names (data parallel at a batch smaller than every mesh
    axis) is a row with no plan and the reason (``why``).  Each row comes with its plan (None where there is
    none)."""
    unhinted = resolve_hints(ctx.graph, ctx.mesh)
    out: list[tuple[FamilyAlternative, Plan | None]] = []
    for family in FAMILIES:
        plan = None
        why = _family_impossible(ctx, family)
        try:
            if why:
                raise ValueError(why)
            forced = replace(options, family=family, allow_state_sharding=True)
            plan = plan_under(ctx, unhinted, Recomputed(regions or {}), forced, SearchRun(deadline))
        except MemoryCapError as e:
            proven = "approximate" not in e.problem
            entry = FamilyAlternative.no_plan(family, min_per_device_bytes=int(e.min_mem_bytes), proven=proven)
        except ValueError:  # no plan of that family at any memory
            entry = FamilyAlternative.no_plan(family, why=why or None)
        else:
            entry = FamilyAlternative.fitting(family, plan.cost, plan.memory)
        out.append((entry, plan))
    return out


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
