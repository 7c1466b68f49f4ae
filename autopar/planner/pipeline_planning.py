"""Micro-batched plans, one candidate at a time: one mesh axis carries a pipeline of stages, each stage sharded
over the other axes; or micro-batches accumulated without one.  Which candidate a plan takes is
``pipeline_choice``'s.

``plan(..., microbatches=m)`` without a pipeline plans one micro-batch on the whole mesh (its memory is the step's:
one micro-batch's activations at a time) and prices the step as ``m`` of them plus one optimizer step
(``step_cost``); ``ShardedModule.train_step`` runs them one after another, the gradients accumulating.

``plan(..., pipeline="pp", microbatches=m, schedule=...)`` (``pipelined``) makes a plan whose ranks along
axis ``pp`` (size ``p``) each run a contiguous run of the model's layers, ``v`` stages per rank (``interleaved``:
``virtual_stages=v``, or with ``"auto"`` each of 2, 4, 8, ... that the layers fill, ``virtual_choices``; else 1),
over ``m`` micro-batches of the batch (one ``PipelineSchedule``):

1. the *stage mesh* is the mesh without the pipeline axis (a mesh of that axis alone: the axis at size 1);
2. the model is captured at the micro-batch (the example's first ``1/m`` of the batch, ``split_microbatches``);
3. the search plans the whole graph on the stage mesh at that shape, and ``lift`` puts the plan on the full
   mesh: every value replicated along the pipeline axis (no collective runs along it; the stages' sends and the
   sums of weights used on two stages are the runtime's, ``autopar.compiled.pipeline_runner``);
4. the stages split the chain of layers (``stage_assignment.chain_layers``: every module-list entry, alike or
   not, in graph order) into ``p v`` runs; the ops before the first layer run on the first stage, those after
   the last on the last (``stage_assignment.stage_of_nodes`` has the rule for every op).

Pricing (``stage_prices``): the plan's own charge of every node summed per layer, its ends and the values
crossing each cut; for GPipe and 1F1B the split is ``search.stages.split_stages``' (uneven where that pays, each
stage's state plus its micro-batches in flight under the cap), for interleaved schedules an even split priced by
the list schedule; the step adds the slowest rank's optimizer step.  The stage-mesh search itself runs without
the cap, for one micro-batch of the step: what runs once per step (the optimizer, its all-gathers, the bucketed
gradient reductions, ``runtime/buckets.py``'s ``hold``) at ``1 / m`` of its time (``TrainingSettings.microbatches``),
so the search weighs each term as the pipeline pays it.  The stage mesh's axes keep the links they have on the whole
mesh (``context.graph_context``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.cost import least_schedule_time
from autopar.mesh import Mesh
from autopar.placement import Replicate
from autopar.search import INF, NoSplitFits
from costmodel import DeviceProfile

from .context import PlanningContext
from .errors import MemoryCapError
from .plan_parts import PipelinePlan, PlanCost, PlanMemory, StagePart
from .problem_tables import PS_PER_S
from .schema import Plan
from .stage_assignment import chain_layers, layer_span
from .stage_prices import ChainPrices, PricedPipeline, Speed, chain_prices, flow_shop_priced, priced_stages

__all__ = [
    "PipelineSchedule",
    "RunBoundTerms",
    "check_layers",
    "check_schedule",
    "dominated_runs",
    "fewest_virtual",
    "microbatch_choices",
    "objective_beaten_above",
    "pipeline_axis",
    "pipelined",
    "run_bound_terms",
    "schedule_runs",
    "stage_mesh",
    "step_at_least",
    "step_at_least_of",
    "step_cost",
    "virtual_choices",
]


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """How a pipeline runs one step: schedule ``name`` (``cost.SCHEDULES``) over ``m`` micro-batches, ``v`` stages
    per rank (``interleaved``: 2 or more; the others: 1)."""

    name: str
    m: int
    v: int = 1


def pipeline_axis(mesh: Mesh, axis: str) -> int:
    """The index of the pipeline axis ``axis`` on ``mesh``; ValueError when it is not an axis of size > 1."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"pipeline={axis!r}: {mesh} has no axis of that name (axes: {', '.join(mesh.axis_names)}). Fix: pass "
            "one of those names (e.g. Mesh((2, 2), axis_names=('pp', 'tp')) and pipeline='pp'), or pipeline='none'"
        )
    index = mesh.axis_names.index(axis)
    if mesh.shape[index] < 2:
        raise ValueError(
            f"pipeline={axis!r}: axis {axis!r} of {mesh} has size {mesh.shape[index]}, and a pipeline needs at "
            "least 2 stages. Fix: pipeline an axis of size >= 2, or pipeline='none'"
        )
    return index


def stage_mesh(mesh: Mesh, axis: int) -> Mesh:
    """The mesh each stage is sharded over: ``mesh`` without axis ``axis`` (a one-axis mesh: that axis at size 1)."""
    if mesh.ndim == 1:
        return Mesh((1,), axis_names=mesh.axis_names)
    keep = [k for k in range(mesh.ndim) if k != axis]
    return Mesh(tuple(mesh.shape[k] for k in keep), axis_names=tuple(mesh.axis_names[k] for k in keep))


def pipelined(
    ctx: PlanningContext,
    micro_plan: Plan,
    mesh: Mesh,
    axis: int,
    schedule: PipelineSchedule,
    cap: int | None,
    *,
    layers: list[tuple[str, tuple[int, ...]]] | None = None,
    seen: dict[int, StagePlanWork] | None = None,
) -> Plan:
    """The pipelined plan on ``mesh`` whose stages run ``micro_plan`` (searched on ``ctx``: one micro-batch on
    ``stage_mesh(mesh, axis)``), split and priced for ``schedule`` (its micro-batches and stages per rank) under
    ``cap`` per device (module docstring).  ``layers``: ``chain_layers(ctx.graph)`` where the caller has it (None:
    found here).  ``seen``: what was derived already from the stage plans priced on ``ctx`` along ``axis``
    (``StagePlanWork``, by the plan's ``id``), which does not depend on the schedule: shared by the caller between
    the schedules it prices, filled here.  Raises ``MemoryCapError`` when no split fits."""
    p, v, m = mesh.shape[axis], schedule.v, schedule.m
    layers = chain_layers(ctx.graph) if layers is None else layers
    settings = ctx.coster.settings
    if settings.microbatches != m:
        raise ValueError(f"the stage plan was priced for {settings.microbatches} micro-batches per step, not {m}")
    speed, late = _schedule_pricing(settings.profile, mesh, p)
    try:
        work = StagePlanWork.of(ctx, micro_plan, mesh, axis, layers, seen if seen is not None else {})
        priced = priced_stages(work.prices, schedule.name, m, p, v, cap, speed, recv_when_free=late)
    except NoSplitFits as e:
        raise MemoryCapError(f"no pipelined plan fits: {e}", e.least_bytes) from None
    names = [name for name, _ in layers]
    stages = tuple(
        dataclasses.replace(st, layers=_stage_name(names, st, j, len(priced.stages)))
        for j, st in enumerate(priced.stages)
    )
    bubble = priced.bubble_s / max(priced.step_s - priced.optimizer_s, 1e-30)
    pipe = PipelinePlan(mesh.axis_names[axis], schedule.name, stages, v, bubble)
    return lift(micro_plan, mesh, axis, pipe, m, priced, cap, work.lifted)


@dataclass(frozen=True)
class StagePlanWork:
    """What ``pipelined`` derives from a stage plan whatever the schedule: the chain's prices (``chain_prices``)
    and its placements on the whole mesh (``lifted_placements``)."""

    plan: Plan
    prices: ChainPrices
    lifted: tuple[dict, dict, dict]

    @staticmethod
    def of(ctx: PlanningContext, plan: Plan, mesh: Mesh, axis: int, layers: list, seen: dict) -> StagePlanWork:
        """``plan``'s, from ``seen`` (by ``id``, the plan kept beside) where it is there, else derived and kept."""
        work = seen.get(id(plan))
        if work is None or work.plan is not plan:
            link = ctx.coster.settings.profile.link_for_axis(mesh.shape, axis)
            prices = chain_prices(ctx.graph, plan, layers, link, ctx.coster.settings.microbatches)
            work = seen[id(plan)] = StagePlanWork(plan, prices, lifted_placements(plan, mesh, axis))
        return work


def step_at_least(
    micro_plan: Plan, ctx: PlanningContext, mesh: Mesh, p: int, run: PipelineSchedule, terms: RunBoundTerms
) -> float | None:
    """A lower bound on the step of every pipeline ``run`` (``m`` micro-batches, ``v`` stages per rank) over ``p``
    ranks of ``mesh`` whose stages run a plan searched on ``ctx`` (one micro-batch on the stage mesh), under a
    memory bound or not (``stage_fitting``); ``micro_plan``: its free search; ``terms``: ``P``, ``O`` and ``l``
    below, ``run_bound_terms(ctx)`` (one per context, shared by its runs).  None where the search proved none.

    A stage plan's objective per micro-batch is ``X = W + R``: ``W`` its ops' forward and backward with the moves
    into them (what the stages run per micro-batch, ``stage_prices.chain_prices``) and ``R`` what its other nodes
    are charged: ``R_p`` its parameters' optimizer steps and once-per-step reductions at ``1 / m``
    (``cost.coster``), ``R_o`` the rest (inputs, output sinks), which the pipeline's step counts nowhere.  The step is
    the schedule's time over the stages plus the slowest rank's optimizer step (``stage_prices.priced_stages``)::

        step >= (c W + m R_p / p) / s

    * the schedule's time is at least ``c W`` (``cost.least_schedule_time``): ``c = (m + p - 1) / p`` for GPipe and
      1F1B priced by the flow shop's formula (``search.stages``), ``1 / (1 - (1 - 1/m)^p)`` where the step is a
      simulated list schedule (ranks that share cores, a host that posts each receive when free), and
      interleaved ``m / p`` plus ``(p - 1) / 2`` times the least stage: the stages split the ``n`` layers evenly,
      so each holds at least ``n // (p v)`` of them, each layer at least ``l`` (its ops at their cheapest
      strategies, no move, no recomputation: what any stage plan charges it at least);
    * the slowest rank's optimizer step is at least the ranks' mean, ``m R_p / p`` (every parameter is held by
      at least one stage);
    * ``s``: the most a rank computes faster while others idle (``max_lending``; 1 on devices of their own).

    Every stage plan has ``X >= X*`` (the free plan's objective where the search was exact, else its proven lower
    bound), ``R_p <= P`` and ``R_o <= O`` (each such node's costliest strategy).  As ``c >= m / p`` the bound is
    least where ``R_p`` takes the most of ``X* - O`` it can::

        step >= (c (X* - O - r) + m r / p) / s,    r = min(P, max(X* - O, 0)),  X* - O - r >= 0 else 0"""
    least_ps = micro_plan.search.least_objective_ps
    return None if least_ps is None else step_at_least_of(least_ps, ctx, mesh, p, run, terms)


def step_at_least_of(
    least_ps: int, ctx: PlanningContext, mesh: Mesh, p: int, run: PipelineSchedule, terms: RunBoundTerms
) -> float:
    """``step_at_least`` from ``X*`` itself (``least_ps``, or any lower bound on it: the bound does not decrease
    with ``X*``, so one from a lower bound on ``X*`` is a lower bound too)."""
    m, profile = run.m, ctx.coster.settings.profile
    r = min(terms.params_ps, max(least_ps - terms.others_ps, 0))
    work = max(least_ps - terms.others_ps - r, 0)
    flow_shop = flow_shop_priced(run.v, *_schedule_pricing(profile, mesh, p))  # as pipelined prices the run
    stage_least = terms.layers // (p * run.v) * terms.layer_ps
    schedule_ps = least_schedule_time(work, p, m, run.v, flow_shop=flow_shop, stage_least_s=stage_least)
    return (schedule_ps + m * r / p) / PS_PER_S / max_lending(profile, mesh)


def objective_beaten_above(
    ctx: PlanningContext, mesh: Mesh, p: int, runs: list[PipelineSchedule], terms: RunBoundTerms, fastest_s: float
) -> int:
    """The stage objective ``X`` (ps) past which every run's ``step_at_least_of`` is above ``fastest_s``: a free
    stage search of ``ctx`` that proves its optimum above it (``SearchRun.above``, ``BeatenError``) proves every
    run slower than the fastest candidate, before its plan is assembled.  Per run, the least ``X`` whose bound
    passes ``fastest_s``, found by bisection (the bound does not decrease with ``X`` and grows without limit with
    it); the most of them, less one."""

    def beaten_from(run: PipelineSchedule) -> int:
        def beats(x: int) -> bool:
            return step_at_least_of(x, ctx, mesh, p, run, terms) > fastest_s

        lo, hi = -1, 1 << 20  # beats(lo) false (or lo = -1), beats(hi) true once hi is large enough
        while not beats(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if beats(mid) else (mid, hi)
        return hi

    return max(beaten_from(run) for run in runs) - 1


@dataclass(frozen=True, slots=True)
class RunBoundTerms:
    """What ``step_at_least`` reads of a stage context besides the objective, picoseconds: ``params_ps`` (``P``)
    the most any stage plan charges its parameter nodes and ``others_ps`` (``O``) its other nodes that are not
    ops (inputs, buffers, output sinks), each node at its costliest strategy; ``layer_ps`` (``l``) the least any
    stage plan charges one layer's ops (the layer whose ops cost least at their cheapest strategies) and
    ``layers`` (``n``) the layers a pipeline splits."""

    params_ps: int
    others_ps: int
    layer_ps: int = 0
    layers: int = 0


def run_bound_terms(ctx: PlanningContext) -> RunBoundTerms:
    """``ctx``'s ``RunBoundTerms``.  ``l`` is a lower bound on what a stage plan charges each layer: an op's charge
    is its time at its strategy plus the moves into it (never negative), and recomputation only adds a forward
    (``recompute_tables``), so each op charges at least its cheapest strategy's time in ``ctx``'s tables."""
    tables, nodes = ctx.tables, ctx.graph.nodes
    params = others = 0
    for i, row in enumerate(tables.node_time_ps):
        if i < len(nodes) and nodes[i].kind == "op":
            continue
        finite = row[row < INF]
        most = int(finite.max()) if finite.size else 0
        if i < len(nodes) and nodes[i].kind == "param":
            params += most
        else:
            others += most
    layers = chain_layers(ctx.graph)

    def least(i: int) -> int:
        row = tables.node_time_ps[i]
        finite = row[row < INF]
        return int(finite.min()) if finite.size else 0

    layer_ps = min((sum(least(i) for i in ops) for _, ops in layers), default=0)
    return RunBoundTerms(params, others, layer_ps, len(layers))


def max_lending(profile: DeviceProfile, mesh: Mesh) -> float:
    """The most ``DeviceProfile.compute_speed`` lends a rank of ``mesh`` while others idle (1.0 without shared
    cores): the core-share rule's and the measured table's largest figure."""
    ranks = _ranks_sharing_cores(profile, mesh)
    if ranks is None:
        return 1.0
    figures = [profile.compute_speed(k, ranks) for k in range(1, ranks)]
    table = profile.core_lending
    if table is not None and table.ranks == ranks:
        figures += [s for row in table.speed for s in row]
    return max(1.0, *figures)


def dominated_runs(runs: list[PipelineSchedule], profile: DeviceProfile, mesh: Mesh, p: int) -> list[PipelineSchedule]:
    """The GPipe runs of ``runs`` that 1F1B beats or ties whatever the stage plan: those with a 1F1B run of the
    same ``m`` among ``runs`` where the split is priced by the flow shop's formula (``flow_shop_priced``).

    For one stage plan both are priced by the same formula over the same stage times (``search.stages``: GPipe's
    step exactly, 1F1B's bounded from above by it and priced so), and stage ``j`` holds ``h_j`` micro-batches'
    activations, ``m`` under GPipe and ``min(m, p - j) <= m`` under 1F1B, so every split that fits under GPipe fits
    under 1F1B with the same step: 1F1B's best split is at least as fast and fits where GPipe's does, and a tie
    keeps 1F1B (``pipeline_choice.SCHEDULE_ORDER``).  Where the schedule is simulated (ranks that share cores, a
    host that is its device) the two differ, and both are priced."""
    if not flow_shop_priced(1, *_schedule_pricing(profile, mesh, p)):
        return []
    one_f_one_b = {run.m for run in runs if run.name == "1f1b"}
    return [run for run in runs if run.name == "gpipe" and run.m in one_f_one_b]


def _schedule_pricing(profile: DeviceProfile, mesh: Mesh, p: int) -> tuple[Speed | None, bool]:
    """(``speed``, ``recv_when_free``) of ``stage_prices.priced_stages`` for a pipeline of ``p`` ranks on ``mesh``:
    how its ranks lend cores (``shared_cores_speed``), and whether each receive is posted only when its rank is
    free (a host that is the device, ``host_runs_ahead`` false)."""
    return shared_cores_speed(profile, mesh, p), not profile.host_runs_ahead


def shared_cores_speed(profile: DeviceProfile, mesh: Mesh, p: int) -> Speed | None:
    """``speed(k, w)`` of a pipeline of ``p`` ranks on ``mesh`` whose ranks share their node's cores
    (``DeviceProfile.compute_speed`` for an action of ``w`` seconds): while ``k`` pipeline ranks compute, so do
    ``k / p`` of the node's ranks (each pipeline rank is a group of the other axes' ranks, spread alike over the
    nodes).  None where nothing is lent: each rank has its own device, or the node's ranks do not outnumber its
    cores."""
    ranks = _ranks_sharing_cores(profile, mesh)
    if ranks is None:
        return None
    return lambda k, w: profile.compute_speed(max(1, round(ranks * k / p)), ranks, w)


def _ranks_sharing_cores(profile: DeviceProfile, mesh: Mesh) -> int | None:
    """The ranks of ``mesh`` on one node where they outnumber the node's cores (they lend them when idle); None
    where each rank has its own device or the cores are enough."""
    ranks = min(mesh.size, profile.devices_per_node)
    return ranks if profile.cores_per_node and ranks > profile.cores_per_node else None


def virtual_choices(schedule: str, asked: int | str, p: int, layers: int) -> list[int]:
    """The stages per rank a ``p``-rank ``schedule`` over ``layers`` layers is tried with: 1 for GPipe and
    1F1B; for ``interleaved`` ``asked`` (``virtual_stages``: an int) or, for ``"auto"``, each of 2, 4, 8, ...
    More stages per rank cut the bubble to ``(p - 1) / (v m + p - 1)`` of the step, send each micro-batch over
    ``p v - 1`` cuts instead of ``p - 1`` and hold more in flight early (``cost.in_flight``): the pricing weighs
    the three.  Only ``v`` with ``p v <= layers`` (a stage of at least one layer): empty when there is none."""
    if schedule != "interleaved":
        return [1] if p <= layers else []
    if asked != "auto":
        return [asked] if p * asked <= layers else []
    return [2**k for k in range(1, layers.bit_length()) if p * 2**k <= layers]


def fewest_virtual(schedule: str, asked: int | str) -> int:
    """The fewest stages per rank ``virtual_choices`` tries for ``schedule``: what ``check_layers`` needs."""
    return 1 if schedule != "interleaved" else 2 if asked == "auto" else asked


def _stage_name(names: list[str], stage: StagePart, j: int, count: int) -> str:
    """The layers of stage ``j`` of ``count`` (``transformer.h.0-5``), the ends marked on the first and last."""
    named = layer_span(names[stage.first_layer : stage.stop_layer])
    return ("(before) " if j == 0 else "") + named + (" (after)" if j == count - 1 else "")


def microbatch_choices(batch: int | None, p: int, others: int, schedules: tuple[str, ...]) -> list[int]:
    """``microbatches="auto"``'s candidates: 1 without a pipeline (``p = 1``); with one, the fewest micro-batches
    of at least ``p``, ``2 p`` and ``4 p`` (the bubble ``(p - 1) / (m + p - 1)`` under a half, a third, a fifth)
    that split the batch evenly, that one of ``schedules`` runs and, where some do, whose micro-batch splits
    evenly over the ``others`` ranks of the other axes.  Raises ValueError when the batch splits into none."""
    if p == 1 or batch is None:
        return [1]
    runs = [m for m in range(p, batch + 1) if batch % m == 0 and any(schedule_runs(s, p, m) for s in schedules)]
    if not runs:
        names = " or ".join(schedules)
        raise ValueError(
            f"a batch of {batch} does not split into micro-batches a {p}-stage {names} pipeline runs (at least "
            f"{p}{', a multiple of it' if schedules == ('interleaved',) else ''}). Fix: a batch of {p} or more, "
            "or a smaller pipeline axis"
        )
    even = [m for m in runs if (batch // m) % others == 0] or runs
    return sorted({min((m for m in even if m >= k * p), default=max(even)) for k in (1, 2, 4)})


def schedule_runs(schedule: str, p: int, m: int) -> bool:
    """Whether ``torch.distributed.pipelining`` runs ``schedule`` on ``p`` ranks with ``m`` micro-batches: 1F1B
    needs at least ``p`` (each stage runs one in flight before its first backward), interleaved a multiple of
    ``p`` (micro-batches go in groups of the ranks)."""
    return not (schedule == "1f1b" and m < p) and not (schedule == "interleaved" and m % p)


def check_schedule(schedule: str, p: int, m: int) -> None:
    """ValueError with the fix when ``schedule`` does not run ``m`` micro-batches on ``p`` ranks
    (``schedule_runs``)."""
    if schedule_runs(schedule, p, m):
        return
    if schedule == "1f1b":
        raise ValueError(
            f"schedule='1f1b' on {p} pipeline stages needs at least {p} micro-batches (each stage runs one in "
            f"flight before its first backward), got microbatches={m}. Fix: pass microbatches={p} or more, or "
            "schedule='gpipe'"
        )
    raise ValueError(
        f"schedule='interleaved' sends micro-batches in groups of the {p} pipeline ranks: microbatches={m} is "
        f"not a multiple of {p}. Fix: pass microbatches={p * max(1, m // p)} or schedule='1f1b'"
    )


def check_layers(axis: str, model: str, layers: list, p: int, v: int) -> None:
    """ValueError with the fix when ``layers`` (``chain_layers``) cannot fill ``p v`` stages."""
    if not layers:
        raise ValueError(
            f"pipeline={axis!r}: {model} has no layers (entries of an nn.ModuleList or nn.Sequential of two or "
            "more) to split into stages; autopar cuts pipelines between layers, not inside ops. Fix: hold the "
            "repeated blocks in an nn.ModuleList, or pipeline='none'"
        )
    if len(layers) < p * v:
        names = ", ".join(n for n, _ in layers[:4]) + (", ..." if len(layers) > 4 else "")
        raise ValueError(
            f"pipeline={axis!r}: {p * v} stages ({p} ranks x {v} per rank) but {model} has {len(layers)} layers to "
            f"split ({names}). Fix: pipeline a smaller axis"
            + (", schedule='1f1b' (one stage per rank)" if v > 1 else "")
            + ", or no pipeline"
        )


def lifted_placements(inner: Plan, mesh: Mesh, axis: int) -> tuple[dict, dict, dict]:
    """The ``params``, ``inputs`` and ``nodes`` of ``inner`` (planned on ``stage_mesh(mesh, axis)``) on ``mesh``:
    every placement replicated along ``axis``."""

    def on_mesh(placements: tuple) -> tuple:
        if len(placements) == mesh.ndim:  # a one-axis mesh: the stage mesh kept the axis at size 1
            return tuple(Replicate() if k == axis else pl for k, pl in enumerate(placements))
        return (*placements[:axis], Replicate(), *placements[axis:])

    def kernels(per_axis: tuple) -> tuple:
        return per_axis if len(per_axis) == mesh.ndim else (*per_axis[:axis], None, *per_axis[axis:])

    params = {
        k: dataclasses.replace(v, placements=on_mesh(v.placements), state_placements=on_mesh(v.state_placements))
        for k, v in inner.params.items()
    }
    inputs = {k: dataclasses.replace(v, placements=on_mesh(v.placements)) for k, v in inner.inputs.items()}
    nodes = {
        k: dataclasses.replace(
            v,
            inputs=tuple(on_mesh(pl) for pl in v.inputs),
            outputs=tuple(on_mesh(pl) for pl in v.outputs),
            kernels=kernels(v.kernels),
        )
        for k, v in inner.nodes.items()
    }
    return params, inputs, nodes


def lift(
    inner: Plan,
    mesh: Mesh,
    axis: int,
    pipe: PipelinePlan,
    m: int,
    priced: PricedPipeline,
    cap,
    lifted: tuple[dict, dict, dict] | None = None,
) -> Plan:
    """``inner`` (planned on ``stage_mesh(mesh, axis)`` for one micro-batch) on ``mesh``: every placement
    replicated along ``axis`` (``lifted``: ``lifted_placements`` where the caller has them), priced as the
    pipeline runs (``priced``: its split's step and fullest rank)."""
    params, inputs, nodes = lifted_placements(inner, mesh, axis) if lifted is None else lifted
    name = mesh.axis_names[axis]
    work = priced.step_s - priced.bubble_s - priced.optimizer_s
    terms = {"pipeline stages (forward + backward)": work, "pipeline bubble": priced.bubble_s}
    terms["optimizer step"] = priced.optimizer_s
    return dataclasses.replace(
        inner,
        mesh=mesh,
        settings=dataclasses.replace(inner.settings, mem_cap_bytes=cap),
        params=params,
        inputs=inputs,
        nodes=nodes,
        collectives=tuple(c for c in inner.collectives if c.axis != name),  # a size-1 axis moves nothing
        cost=PlanCost(work + priced.optimizer_s, 0.0, priced.step_s, terms),
        memory=_rank_memory(inner.memory, priced, cap),
        pipeline=pipe,
        microbatches=m,
        alternatives=(),
    )


def step_cost(micro: PlanCost, m: int) -> PlanCost:
    """A step of ``m`` accumulated micro-batches from the plan of one (``micro``, priced per micro-batch:
    what runs once per step at ``1 / m`` of its time, ``cost.coster``): ``T = m t_micro``, each term ``m``
    times."""
    terms = {k: t * m for k, t in micro.terms.items()}
    return PlanCost(micro.compute_s * m, micro.comm_s * m, micro.total_s * m, terms)


def _rank_memory(micro: PlanMemory, priced: PricedPipeline, cap: int | None) -> PlanMemory:
    """The fullest rank's memory: its stages' state, split into parameters, gradients and optimizer state as the
    whole model's is, and its micro-batches' activations in flight."""
    whole = micro.params_bytes + micro.grads_bytes + micro.optimizer_bytes
    share = [part * priced.state_bytes // max(whole, 1) for part in (micro.params_bytes, micro.grads_bytes)]
    return PlanMemory(
        per_device_bytes=priced.memory_bytes,
        params_bytes=share[0],
        grads_bytes=share[1],
        optimizer_bytes=priced.state_bytes - sum(share),
        activations_bytes=priced.activation_bytes,
        cap_bytes=cap,
    )
