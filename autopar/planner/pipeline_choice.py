"""Whether, where and how a plan pipelines: the planner's choice among micro-batched plans (``plan_model``: every
plan on a mesh; ``mesh_choice.plan_on`` calls it for ``autopar.plan``, ``autopar.compile`` and ``autopar plan``).

The candidates are every combination the options leave open:

* the pipeline axis: ``pipeline="none"``: none; an axis name: that axis; ``"auto"``: none, and every axis of
  size ``p >= 2`` that can carry one: the model returns a loss (a pipeline trains through ``train_step``), no
  hints are given (they name placements on the whole mesh) and it has at least ``p v`` layers;
* the micro-batches ``m``: an int as given; ``"auto"``: without a pipeline 1, or, only when one micro-batch of
  the whole batch does not fit the cap, the fewest accumulated micro-batches that fit; with a pipeline,
  ``pipeline_planning.microbatch_choices`` (the fewest of at least ``p``, ``2 p``, ``4 p``);
* the schedule: as given, or ``"auto"``: each of 1F1B, GPipe and interleaved 1F1B that runs ``p`` ranks and
  ``m`` micro-batches (``pipeline_planning.schedule_runs``) with enough layers; interleaved with each count of
  stages per rank ``virtual_choices`` gives (``virtual_stages``: as given, or 2, 4, 8, ...).  GPipe is not priced
  where the flow shop's formula prices it as 1F1B (``pipeline_planning.dominated_runs``: 1F1B is then as fast for
  every stage plan and holds less), and is listed with why (``Candidate.note``).

Each pipelined candidate is priced exactly as a forced one (``pipeline_planning.pipelined``).  Work is shared: one
capture per micro-batch size (a small graph's sizes specialized from one symbolic capture, ``capture.batch``, when
several are needed: ``SYMBOLIC_CAPTURE_NODES``), one stage-mesh search per (axis, ``m``) whose prices every schedule
splits (``stage_prices``: no search per schedule), and where the cap needs weighted searches, one walk per weight
(schedules holding as many micro-batches in flight share it).  Chosen: the fastest step (``Plan.cost.total_s``)
among the candidates that fit the cap; a tie keeps no pipeline, else the earlier (the axes in mesh order, fewer
micro-batches, 1F1B, GPipe, interleaved).  When none fits, ``MemoryCapError`` names the least memory any candidate
needed.

The plan without a pipeline is searched last, bounded by the fastest pipelined step ``s`` (``SearchRun.above``):
its searches stop where a lower bound on their objective (first the optimum without the cap) is above ``s``,
and it is listed as at least that bound (``Candidate.at_least_s``).  That is exact: the searched objective is the
step less what is priced after the search (the gradient reductions past backward, ``assemble.overlap_bounded``,
never negative), so a plan whose objective is above ``s`` is slower.  On 96 layers on 4 x 8 x 8 the capped
search it skips was about 3 of the 11 s of search.

Likewise a pipelined candidate whose every stage plan is proven slower than the fastest candidate so far (of this
mesh, or of the meshes before it) is not priced: ``pipeline_planning.step_at_least`` bounds every pipeline run
(schedule, ``m`` micro-batches, stages per rank) by its free stage search's objective with the run's least bubble
(GPipe and 1F1B on devices of their own: ``(m + p - 1) / p`` of one micro-batch's work), which skips the stage
fitting (weighted searches) of candidates that cannot win; listed as at least that bound.  A forced axis is never
skipped.  On 96 layers on 4 x 8 x 8 (49 candidates) the bound without the bubble took the search from 15-18 s
to 9.7 s, the same choice.  The bound does not decrease with the free search's objective, so the free search
itself is given the objective past which every run of its ``m`` is beaten (``objective_beaten_above``, as
``SearchRun.above``): where it proves its optimum above that, it stops (``BeatenError``) before its plan is
assembled, and each run is listed as at least the bound from the proof (4 of the 9 free searches there).  The
weighted searches of a run's stage fitting are bounded the same way (``_stage_fit``; ``stage_fitting``, Bounded):
measured on Llama 3 405B at (32, 32, 8) of 8,192 H100s planned after a mesh of 14.6 s, 92 -> 76 s (two runs side
by side), the same plan.

``Plan.timings`` of the chosen plan adds up the whole choice: ``capture_s``, ``strategies_s`` and ``search_s``
over every candidate, and ``candidates``, how many were priced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import torch

from autopar.capture import OpGraph, batch_of, capture, capture_template, specialize, split_microbatches
from autopar.mesh import Mesh
from autopar.search import BeatenError, ChainError, Deadline
from autopar.units import format_bytes
from costmodel import check_devices_per_node

from .context import PlanningContext, graph_context, hinted_context, prepare_context
from .context_search import search_context
from .errors import MemoryCapError
from .heap import FrozenHeap
from .options import HintOptions, PlanOptions
from .pipeline_planning import (
    PipelineSchedule,
    RunBoundTerms,
    check_layers,
    check_schedule,
    dominated_runs,
    fewest_virtual,
    microbatch_choices,
    objective_beaten_above,
    pipeline_axis,
    pipelined,
    run_bound_terms,
    schedule_runs,
    stage_mesh,
    step_at_least,
    step_at_least_of,
    step_cost,
    virtual_choices,
)
from .plan_parts import Candidate
from .plan_table import describe_candidate, describe_schedule
from .problem_tables import PS_PER_S
from .recompute_modes import search_modes
from .schema import Plan
from .solving import CheckedPlans, SearchRun
from .stage_assignment import chain_layers
from .stage_fitting import StageFit, fit_stages, held_at_most
from .stage_floor import StageFloors
from .throughput import with_throughput

__all__ = ["Captures", "NoCandidateError", "PipelineChoice", "SharedPlanning", "plan_model"]

log = logging.getLogger(__name__)

#: ``schedule="auto"``'s candidates, in the order a tie keeps (1F1B holds fewer micro-batches than GPipe)
SCHEDULE_ORDER = ("1f1b", "gpipe", "interleaved")

#: why a GPipe candidate is not priced where 1F1B is (``pipeline_planning.dominated_runs``)
DOMINATED_BY_1F1B = "not priced: 1F1B is no slower, holds less"

#: the most accumulated micro-batch counts tried when one micro-batch of the whole batch does not fit
ACCUMULATION_TRIES = 6

#: The largest graph whose smaller micro-batches are specialized from one symbolic capture (``PipelineChoice._graph``)
#: instead of captured statically per size.  A symbolic export costs more per node than a static one, and more so the
#: larger the graph; a specialization costs little on a small graph.  Measured (this 2-core machine, torch 2.13,
#: seconds for one static capture / the symbolic one / one specialization): gpt2-tiny, 144 nodes: 0.6 / 0.7 / 0.03;
#: llama-tiny, 183: 0.8 / 1.0 / 0.07; GPT-2 small, 644: 0.8-1.3 / 2.9 / 0.08; Llama 3 405B, 7,995: 3.0 / 33 / 2.2, so
#: its 3 sizes of a forced 16-stage pipeline took 40 s through the symbolic capture and take 9 s statically.
SYMBOLIC_CAPTURE_NODES = 1000


def plan_model(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs,
    example_kwargs: dict | None,
    options: PlanOptions,
    hint_options: HintOptions,
    *,
    compare_families: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Plan, OpGraph]:
    """The plan of ``model`` on ``mesh`` under ``options`` and the graph it was made on (at the micro-batch when
    it runs several).  Without micro-batches (``options.micro_batched`` false) one search of the whole batch on
    the whole mesh; else the fastest candidate (module docstring)."""
    with FrozenHeap() as heap:  # the collector kept off each capture and its strategies once built
        if not options.micro_batched:
            ctx = prepare_context(model, mesh, example_inputs, example_kwargs, options, hint_options)
            heap.keep()
            plan = search_context(ctx, compare_families=compare_families, progress=progress)
            return with_throughput(plan, ctx.graph), ctx.graph
        shared = SharedPlanning(heap)
        choice = PipelineChoice(model, mesh, example_inputs, example_kwargs, options, hint_options, progress, shared)
        return choice.best(compare_families)


class PipelineChoice:
    """The candidates of one ``plan_model`` call, priced one after another, and the fastest that fits so far.

    ``graphs``: the captures per micro-batch size; ``priced``: every candidate with its step and memory (a
    candidate that did not fit: no step, the least memory it needed); ``missed``: those candidates' errors."""

    def __init__(
        self,
        model,
        mesh: Mesh,
        example_inputs,
        example_kwargs,
        options,
        hint_options,
        progress,
        shared: SharedPlanning,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"mesh {mesh!r}: expected an autopar.Mesh, e.g. autopar.Mesh((2, 4), axis_names=('dp', 'tp'))"
            )
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.model, self.mesh, self.args, self.kwargs = model, mesh, tuple(args), dict(example_kwargs or {})
        self.options, self.hint_options, self.progress = options.resolved(model), hint_options, progress
        self.shared = shared
        self.inner = dataclasses.replace(self.options, pipeline="none", microbatches=1)
        if self.options.devices_per_node is not None:
            check_devices_per_node(mesh.shape, self.options.devices_per_node)  # before any capture
        self.batch = batch_of(self.args, self.kwargs)
        self.run = SearchRun(Deadline.after(options.search_budget_s), progress)
        self.found: tuple[Plan, OpGraph] | None = None
        self.priced: list[Candidate] = []
        self.missed: list[MemoryCapError] = []
        self.skipped: list[str] = []  # why a pipeline axis or micro-batch count was not tried (not forced)
        self.floors: dict[tuple[int, int], StageFloors | None] = {}  # per (axis, m): the interleaved runs' floors
        self.timings = {"capture_s": 0.0, "strategies_s": 0.0, "search_s": 0.0, "candidates": 0.0}

    def best(self, compare_families: bool) -> tuple[Plan, OpGraph]:
        """The fastest candidate that fits (module docstring); MemoryCapError when none does."""
        asked = self.options.pipeline
        axes = [] if asked == "none" else [pipeline_axis(self.mesh, asked)] if asked != "auto" else self._auto_axes()
        for axis in axes:
            self._pipelines(axis, forced=asked != "auto" and not self.shared.placed)
        if asked in ("none", "auto"):  # last: the pipelines' fastest bounds its search (a tie still goes to it)
            self._no_pipeline(compare_families)
        if self.found is None and not self.priced:
            raise NoCandidateError(self.mesh.shape, "; ".join(self.skipped))
        if self.found is None:
            beaten = [c.at_least_s for c in self.priced if c.at_least_s is not None]
            if beaten and self.shared.beat is not None:  # every candidate that may fit: slower than another mesh's
                raise BeatenError(min(beaten) * PS_PER_S, int(self.shared.beat * PS_PER_S))
            if len(self.missed) == 1:  # one candidate: its own words (micro-batched already: not offered as a fix)
                missed = self.missed[0]
                raise MemoryCapError(missed.problem, missed.min_mem_bytes) from None
            missed = [c for c in self.priced if c.memory_bytes is not None]  # (a dominated one was not tried)
            least = min(missed, key=lambda c: c.memory_bytes)  # none fitted: every one tried missed
            cap = format_bytes(self.options.mem_cap) if self.options.mem_cap else "none"
            raise MemoryCapError(
                f"no plan fits the memory cap of {cap} per device: of the {len(self.missed)} candidates tried "
                f"(pipelines, micro-batches, schedules), {least.what} needs the least, "
                f"{format_bytes(least.memory_bytes)}",
                least.memory_bytes,
            )
        plan, graph = self.found
        ranked = tuple(sorted(self.priced, key=_rank))
        plan = with_throughput(plan, graph)
        return dataclasses.replace(plan, timings=dict(plan.timings, **self.timings), candidates=ranked), graph

    # ---- candidates ----------------------------------------------------------------------------------------
    def _no_pipeline(self, compare_families: bool) -> None:
        """The plan without a pipeline: ``m`` micro-batches as given; ``"auto"``: the whole batch at once, else
        the fewest accumulated micro-batches that fit.  Bounded by the fastest candidate priced (module
        docstring): where the whole batch at once is proven slower, more micro-batches are not tried, as where it
        fits, since accumulating runs the same ops on ``1 / m`` of the rows ``m`` times and the once-per-step work
        once (no faster, the cost model's roofline and fixed costs per op and collective)."""
        asked = self.options.microbatches
        counts = [asked] if asked != "auto" else [1] + self._accumulations()
        for m in counts:
            what = "no pipeline" if m == 1 else f"{m} accumulated micro-batches"
            ctx = self._context(m, self.mesh, None, self.inner)
            try:
                with self._timing("search_s"):
                    if m == 1:
                        run = dict(compare_families=compare_families, progress=self.progress, above=self._above(1))
                        plan = search_context(ctx, **run)
                    else:
                        plan = self._search(ctx, above=self._above(m))
                        plan = dataclasses.replace(plan, microbatches=m, cost=step_cost(plan.cost, m))
            except MemoryCapError as e:
                self._missed(e, what)
                continue
            except BeatenError as e:  # proven slower than a pipeline: as accumulating more would be (docstring)
                self._beaten(what, e.lower_bound_ps * m / PS_PER_S)
                return
            self._offer(plan, ctx.graph, ties_win=True)
            return

    def _beaten(self, what: str, at_least_s: float) -> None:
        self.timings["candidates"] += 1
        self.priced.append(Candidate(what, None, None, at_least_s=at_least_s))
        log.info("candidate %s: at least %.4g s, slower than the fastest priced", what, at_least_s)

    def _proven_slower(self, at_least_s: float | None) -> bool:
        """Whether a step of at least ``at_least_s`` is slower than the fastest candidate (of this mesh, or of the
        meshes planned before it: ``SharedPlanning.beat``)."""
        fastest = self._fastest_s()
        return at_least_s is not None and fastest is not None and at_least_s > fastest

    def _fastest_s(self) -> float | None:
        """The fastest step priced so far, of this mesh or of the meshes before it (None: none yet)."""
        met = [s for s in (self.shared.beat, self.found and self.found[0].cost.total_s) if s]
        return min(met) if met else None

    def _above(self, m: int) -> int | None:
        """``SearchRun.above`` for a search of one of ``m`` micro-batches: the fastest candidate's step over
        ``m`` (a step of ``m`` micro-batches is ``m`` of them, ``step_cost``), in the search's picoseconds."""
        fastest = self._fastest_s()
        return int(fastest * PS_PER_S / m) if fastest is not None else None

    def _accumulations(self) -> list[int]:
        if self.batch is None:
            return []
        return [m for m in range(2, self.batch + 1) if self.batch % m == 0][:ACCUMULATION_TRIES]

    def _auto_axes(self) -> list[int]:
        """The axes ``pipeline="auto"`` tries: size >= 2, and only for a model that returns a loss and no hints."""
        if self.hint_options.given:
            log.info("pipeline='auto': hints are given (placements on the whole mesh); no pipeline is tried")
            return []
        if self.batch is None or self._graph(1).loss_output is None:
            log.info("pipeline='auto': the model returns no loss (a pipeline trains through train_step); none tried")
            return []
        return [k for k, size in enumerate(self.mesh.shape) if size >= 2]

    def _pipelines(self, axis: int, *, forced: bool) -> None:
        """Every (``m``, schedule, stages per rank) of a pipeline along ``axis``: one stage-mesh search per ``m``,
        split and priced per schedule.  ``forced`` (the user named the axis): what cannot run raises with its fix
        instead of being skipped."""
        p, others = self.mesh.shape[axis], self.mesh.size // self.mesh.shape[axis]
        schedules = SCHEDULE_ORDER if self.options.schedule == "auto" else (self.options.schedule,)
        asked, virtual = self.options.microbatches, self.options.virtual_stages
        name, model = self.mesh.axis_names[axis], type(self.model).__name__
        try:
            counts = [asked] if asked != "auto" else microbatch_choices(self.batch, p, others, schedules)
        except ValueError as e:  # the batch is too small for this many stages
            if forced:
                raise
            log.info("pipeline='auto': no pipeline along %r: %s", name, e)
            self.skipped.append(f"no pipeline along {name!r}: {e}")
            return
        captured = next(iter(self.shared.captures.graphs.values()), None)  # every size has the same layers
        known = len(chain_layers(captured)) if captured is not None and not forced else None
        if known is not None and not self._fills(p, known, schedules):  # before any capture at a new size
            self._too_few_layers(known, p, name)
            return
        for m in counts:
            if forced and len(schedules) == 1:
                check_schedule(schedules[0], p, m)
            ctx = self._context(m, stage_mesh(self.mesh, axis), axis, self.inner)
            layers = chain_layers(ctx.graph)
            runs = [
                PipelineSchedule(s, m, v)
                for s in schedules
                if schedule_runs(s, p, m)
                for v in virtual_choices(s, virtual, p, len(layers))
            ]
            if forced and not runs:
                check_layers(name, model, layers, p, min(fewest_virtual(s, virtual) for s in schedules))
            if not runs:  # too few layers, or (a given schedule or count) no schedule runs p ranks with m
                self._none_run(len(layers), p, m, name, schedules)
                continue
            for run in dominated_runs(runs, ctx.coster.settings.profile, self.mesh, p):  # 1F1B's at least as good
                runs.remove(run)
                what = f"a pipeline along {name!r}, {describe_schedule(run.name, m, run.v)}"
                self.priced.append(Candidate(what, None, None, note=DOMINATED_BY_1F1B))
            terms = run_bound_terms(ctx)
            checked = CheckedPlans()  # the free search and every weighted one meet the same plans
            free, proven_ps = self._free_search(ctx, p, runs, terms, forced, checked)
            fits: dict[int, StageFit] = {}  # the weighted searches of one weight, shared by the runs that hold it
            seen: dict = {}  # what each stage plan priced gives whatever the schedule (``pipelined``), likewise
            for run in runs:
                what = f"a pipeline along {name!r}, {describe_schedule(run.name, m, run.v)}"
                if free is None:  # its free search proved every run slower than the fastest: bounded by the proof
                    self._beaten(what, step_at_least_of(proven_ps, ctx, self.mesh, p, run, terms))
                    continue
                at_least = step_at_least(free, ctx, self.mesh, p, run, terms)
                if not forced and self._proven_slower(at_least):  # no stage plan of this run can beat the fastest
                    self._beaten(what, at_least)
                    continue
                weight = held_at_most(run.name, p, m, run.v)
                if weight not in fits:
                    held = [r for r in runs if held_at_most(r.name, p, m, r.v) == weight]
                    above = None if forced else self._objective_above(ctx, p, held, terms)
                    fits[weight] = self._stage_fit(ctx, free, weight, above, checked)
                self._priced_pipeline(fits[weight], ctx, axis, run, layers, seen, terms)

    def _fills(self, p: int, layers: int, schedules) -> bool:
        """Whether ``layers`` repeated layers fill ``p`` stages under some schedule of ``schedules``."""
        return any(virtual_choices(s, self.options.virtual_stages, p, layers) for s in schedules)

    def _too_few_layers(self, layers: int, p: int, name: str) -> None:
        why = f"the model has {layers} repeated layers to split over {p} stages along {name!r}"
        if why not in self.skipped:  # once, not per micro-batch count
            self.skipped.append(why)

    def _none_run(self, layers: int, p: int, m: int, name: str, schedules) -> None:
        """Why no run of ``m`` micro-batches along ``name`` is tried: the layers do not fill ``p`` stages, else no
        schedule of ``schedules`` runs ``p`` ranks with ``m`` micro-batches (``schedule_runs``)."""
        if not self._fills(p, layers, schedules):
            self._too_few_layers(layers, p, name)
        else:
            self.skipped.append(
                f"no schedule of {', '.join(schedules)} runs {p} stages along {name!r} with {m} micro-batches"
            )

    def _free_search(
        self,
        ctx: PlanningContext,
        p: int,
        runs: list[PipelineSchedule],
        terms: RunBoundTerms,
        forced: bool,
        checked: CheckedPlans,
    ) -> tuple[Plan | None, int | None]:
        """The free stage search of ``ctx`` (one micro-batch on the stage mesh, no cap), ``(plan, None)``; or, where
        a fastest candidate bounds it (``objective_beaten_above``: not for a forced axis), ``(None, lower bound on
        its objective)`` once the search proves every run of ``runs`` slower than that candidate (``BeatenError``):
        the plan is not assembled, and the bound stands for each run's (``step_at_least_of``)."""
        above = None if forced else self._objective_above(ctx, p, runs, terms)
        with self._timing("search_s"):
            try:
                return self._search(ctx, above=above, checked=checked), None
            except BeatenError as e:
                return None, int(e.lower_bound_ps)

    def _objective_above(
        self, ctx: PlanningContext, p: int, runs: list[PipelineSchedule], terms: RunBoundTerms
    ) -> int | None:
        """The stage objective past which the fastest candidate so far beats every run of ``runs`` over ``p``
        stages (``objective_beaten_above``; None: no candidate yet)."""
        fastest = self._fastest_s()
        return None if fastest is None else objective_beaten_above(ctx, self.mesh, p, runs, terms, fastest)

    def _stage_fit(
        self, ctx: PlanningContext, free: Plan, weight: int, above: int | None, checked: CheckedPlans
    ) -> StageFit:
        """The walk of the searches of ``ctx`` with activations weighted ``weight`` times, bounded by ``above``
        (``_objective_above`` of the runs that hold ``weight``; None: unbounded, as for a forced axis): a search
        that proves every plan under its bound past it proves each of those runs slower (``stage_fitting``,
        Bounded).  Its searches keep their probes' plans, within ``PROBE_GAP`` of each bound's optimum (``refine``
        False): the walk bisects bounds itself, as the peak loop does, and a plan it keeps is known to its own
        tolerance only (``stage_fitting``, Probes)."""
        weighted = dataclasses.replace(ctx, activation_weight=weight)
        search = functools.partial(self._search, weighted, checked=checked, above=above, refine=False)
        return StageFit(search, free, weight, self.run.deadline)

    def _priced_pipeline(
        self,
        fit: StageFit,
        ctx: PlanningContext,
        axis: int,
        run: PipelineSchedule,
        layers,
        seen: dict,
        terms: RunBoundTerms,
    ) -> None:
        """The pipeline along ``axis`` run as ``run``, its stage plan the fastest of ``fit``'s walk whose split fits
        the cap (``stage_fitting``): offered, kept as a miss, or listed as at least the bound its walk proved
        (``terms``: ``step_at_least``'s) where every plan it met is slower than the fastest candidate; not forced, its
        walk skips the bounds whose plans all lose (``stage_fitting``, Losing runs)."""
        cap, name = self.options.mem_cap, self.mesh.axis_names[axis]
        what = f"a pipeline along {name!r}, {describe_schedule(run.name, run.m, run.v)}"
        price = functools.partial(
            pipelined, ctx, mesh=self.mesh, axis=axis, schedule=run, cap=cap, layers=layers, seen=seen
        )
        p = self.mesh.shape[axis]
        forced = self.options.pipeline != "auto" and not self.shared.placed  # as ``best`` decides it
        loses = None if forced else lambda x: self._proven_slower(step_at_least_of(x, ctx, self.mesh, p, run, terms))
        floor = None  # an interleaved split is known before its stage plan: its floor (``stage_floor``)
        if not forced and run.name == "interleaved":
            floor = functools.partial(self._floor_ps, ctx, axis, run, terms, fit.free.search.objective_ps)
        try:
            with self._timing("search_s"):
                plan = fit_stages(fit, price, cap, loses, floor)
        except MemoryCapError as e:
            self._missed(e, what)
            return
        except BeatenError as e:
            self._beaten(what, step_at_least_of(int(e.lower_bound_ps), ctx, self.mesh, p, run, terms))
            return
        self._offer(plan, ctx.graph)

    def _floor_ps(
        self, ctx: PlanningContext, axis: int, run: PipelineSchedule, terms: RunBoundTerms, free_ps: int
    ) -> int:
        """A lower bound on the stage objective of every plan of ``ctx`` whose even interleaved split as ``run`` along
        ``axis`` fits the cap (``stage_floor``; 0 where it gives none), searched only as far as beating the fastest
        candidate needs; ``terms``: ``run_bound_terms(ctx)``; ``free_ps``: the free stage plan's objective (the
        Lagrange slope's scale).  The floors of one context share their tables (``floors``)."""
        key = (axis, run.m)
        if key not in self.floors:
            try:
                self.floors[key] = StageFloors.of(ctx)
            except ChainError:
                self.floors[key] = None
        floors, p, fastest = self.floors[key], self.mesh.shape[axis], self._fastest_s()
        if floors is None or fastest is None or self.options.mem_cap is None:
            return 0
        enough = objective_beaten_above(ctx, self.mesh, p, [run], terms, fastest)
        scale = max(free_ps, 1) / (p * self.options.mem_cap)
        try:
            return floors.floor_ps(p, run.m, run.v, self.options.mem_cap, scale, enough)
        except ChainError:
            return 0

    # ---- shared work ---------------------------------------------------------------------------------------
    def _missed(self, error: MemoryCapError, what: str) -> None:
        self.missed.append(error)
        self.priced.append(Candidate(what, None, error.min_mem_bytes))

    def _offer(self, plan: Plan, graph: OpGraph, ties_win: bool = False) -> None:
        """A candidate priced: kept where it is the fastest so far (``ties_win``: or as fast)."""
        self.timings["candidates"] += 1
        what, step = describe_candidate(plan), plan.cost.total_s
        self.priced.append(Candidate(what, step, plan.memory.per_device_bytes))
        log.info("candidate %s: step %.4g s", what, step)
        if self.found is None or step < self.found[0].cost.total_s or ties_win and step == self.found[0].cost.total_s:
            self.found = (plan, graph)

    def _search(
        self,
        ctx: PlanningContext,
        mem_cap: int | None = None,
        above: int | None = None,
        checked: CheckedPlans | None = None,
        refine: bool = True,
    ) -> Plan:
        """The plan of one micro-batch on ``ctx`` under ``mem_cap`` where given (a pipeline's stage plan,
        ``stage_fitting``: the stage context has no cap of its own); ``above``: ``SearchRun.above``; ``checked``:
        ``SearchRun.checked``, the peak checks shared by the searches of ``ctx``; ``refine``: ``SearchRun.refine``."""
        hinted_ctx, resolved = hinted_context(ctx, None)
        run = dataclasses.replace(self.run, above=above, checked=checked, refine=refine)
        options = ctx.options if mem_cap is None else dataclasses.replace(ctx.options, mem_cap=mem_cap)
        return search_modes(ctx, hinted_ctx, resolved, options, run).plan

    @contextlib.contextmanager
    def _timing(self, key: str):
        """Adds the seconds of the ``with`` body to ``timings[key]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] += time.perf_counter() - start

    def _micro(self, m: int) -> int:
        """The rows of one of ``m`` micro-batches (ValueError with the fix when the batch does not split)."""
        if m == 1:
            return self.batch or 0
        if self.batch is None or self.batch % m:
            split_microbatches(self.args, self.kwargs, m)  # raises with the fix
        return self.batch // m

    def _context(self, m: int, mesh: Mesh, axis: int | None, options: PlanOptions) -> PlanningContext:
        """The context of one of ``m`` micro-batches on ``mesh`` (the stage mesh of a pipeline along ``axis``,
        or with ``axis`` None the whole mesh), priced per micro-batch, without the cap for a pipeline's stages
        (their split keeps it, and ``stage_fitting`` bounds the stage search where the fastest plan's does not)."""
        if axis is not None:
            options = dataclasses.replace(options, mem_cap=None)
        self._micro(m)
        graph = self._graph(m)
        ctx = graph_context(graph, mesh, self.mesh, axis, options, self.hint_options, m)
        self.timings["strategies_s"] += ctx.timings.get("strategies_s", 0.0)
        self.shared.heap.keep()
        return ctx

    def _graph(self, m: int) -> OpGraph:
        """The model captured at one of ``m`` micro-batches: statically, or specialized from one symbolic capture
        where that is cheaper (``_symbolic``)."""
        graphs = self.shared.captures.graphs
        if m not in graphs:
            with self._timing("capture_s"):
                if self.batch is None or m == 1 or not self._symbolic():
                    (args, kwargs), *_ = (
                        split_microbatches(self.args, self.kwargs, m) if m > 1 else [(self.args, self.kwargs)]
                    )
                    graphs[m] = capture(self.model, args, kwargs)
                else:
                    if self.shared.captures.template is None:
                        self.shared.captures.template = capture_template(self.model, self.args, self.kwargs)
                    graphs[m] = specialize(self.shared.captures.template, self._micro(m))[0]
            self.shared.heap.keep(shared=True)  # every mesh of a device count's plan reads it
        return graphs[m]

    def _symbolic(self) -> bool:
        """Whether a smaller micro-batch is specialized from one symbolic capture of the model rather than captured
        statically: only where the options need several sizes and a capture made so far has at most
        ``SYMBOLIC_CAPTURE_NODES`` nodes (none made yet: statically, so the first tells the size)."""
        if self.options.pipeline != "auto" and self.options.microbatches != "auto":
            return False
        made = self.shared.captures.graphs
        return bool(made) and min(len(g.nodes) for g in made.values()) <= SYMBOLIC_CAPTURE_NODES


@dataclasses.dataclass
class Captures:
    """The model captured per micro-batch count (``graphs``) and the symbolic capture they were specialized
    from (``template``; None until one is needed): one model's, shared by every mesh it is planned on."""

    graphs: dict[int, OpGraph] = dataclasses.field(default_factory=dict)
    template: object | None = None


@dataclasses.dataclass
class SharedPlanning:
    """What the plans of one model share, on one mesh or on each mesh of a device count (``mesh_choice``): the
    collector kept off each capture and its strategies once built (``heap``, ``FrozenHeap.keep``), the captures
    per micro-batch count (``captures``), and the fastest step met on a mesh planned before (``beat``: this
    mesh's searches bounded by it; None: none yet).  ``placed``: a named pipeline axis was put there by the mesh
    enumeration (``plan_devices``' ``pp``), not asked for by the user: where it cannot run it is skipped, and its
    searches are bounded by the fastest step, as ``pipeline="auto"``'s are."""

    heap: FrozenHeap
    captures: Captures = dataclasses.field(default_factory=Captures)
    beat: float | None = None
    placed: bool = False


class NoCandidateError(ValueError):
    """No candidate of a mesh can run: its pipelines are skipped (too few layers or rows for its stages) and no plan
    without one is asked for (``SharedPlanning.placed``: a mesh the enumeration made for a pipeline).  ``why``: why
    each was skipped."""

    def __init__(self, shape: tuple[int, ...], why: str) -> None:
        super().__init__(f"mesh {shape}: nothing can run: {why}")
        self.why = why


def _rank(c: Candidate) -> tuple:
    """Fastest first (a candidate bounded slower by its bound), then those that did not fit by least memory."""
    step = c.step_s if c.step_s is not None else c.at_least_s
    return (step is None, step or 0.0, c.memory_bytes or 0)
