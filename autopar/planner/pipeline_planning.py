"""Micro-batched plans: one mesh axis carries a pipeline of stages, each stage sharded over the other axes; or
micro-batches accumulated without one.

``plan(..., microbatches=m)`` without a pipeline plans one micro-batch on the whole mesh (its memory is the step's:
one micro-batch's activations at a time) and prices the step as ``m`` of them plus one optimizer step
(``step_cost``); ``ShardedModule.train_step`` runs them one after another, the gradients accumulating.

``plan(..., pipeline="pp", microbatches=m, schedule=...)`` (``plan_pipelined``) makes a plan whose ranks along
axis ``pp`` (size ``p``) each run a contiguous run of the model's layers, ``v`` stages per rank (``v = 2`` for
``interleaved``, else 1), over ``m`` micro-batches of the batch:

1. the *stage mesh* is the mesh without the pipeline axis (a mesh of that axis alone: the axis at size 1);
2. the model is captured at the micro-batch (the example's first ``1/m`` of the batch, ``split_microbatches``);
3. the search plans the whole graph on the stage mesh at that shape, and ``lift`` puts the plan on the full
   mesh: every value replicated along the pipeline axis (no collective runs along it; the stages' sends and the
   sums of weights used on two stages are the runtime's, ``autopar.compiled.pipeline_runner``);
4. the stages split the chain of layers (``chain_layers``: every module-list entry, alike or not, in graph order)
   evenly into ``p v`` runs; the ops before the first layer run on the first stage, those after the last on the
   last (``stage_of_nodes`` has the rule for every op).

Pricing (this version): the step is priced as equal stages (``step_cost``: ``T = (m v + p - 1) / (p v) t_micro
+ t_step / p``, ``autopar.cost.pipeline``'s closed form, the bubble ``(p - 1) / (m v + p - 1)`` of the
micro-batch part), and each rank's memory as ``1 / p`` of the model state plus the activations of the
micro-batches it holds in flight (``cost.in_flight`` on the first rank, the most), ``1 / (p v)`` of one
micro-batch's each.  The stage-mesh search runs without the cap; a cap the estimate breaks raises
``MemoryCapError``.  Searching the split, ``m`` and the schedule jointly with each stage's sharding
(``autopar.search.stages``) is the next step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from autopar.capture import OpGraph, batch_of, find_layers, split_microbatches
from autopar.cost import bubble_fraction, in_flight
from autopar.mesh import Mesh
from autopar.placement import Replicate
from autopar.search import Deadline

from .context import hinted_context, prepare_context
from .errors import MemoryCapError
from .options import HintOptions, PlanOptions
from .plan_parts import PipelinePlan, PlanCost, PlanMemory, StagePart
from .recompute_modes import search_modes
from .regions import convex_layers
from .schema import Plan
from .solving import SearchRun

__all__ = ["chain_layers", "plan_pipelined", "stage_of_nodes", "stage_mesh"]

log = logging.getLogger(__name__)


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


def chain_layers(graph: OpGraph) -> list[tuple[str, tuple[int, ...]]]:
    """The layers a pipeline splits, in graph order: every module-list entry whose ops are convex
    (``capture.find_layers``), alike or not, as (name, op node indices), ordered by their first op."""
    layers = find_layers(graph)
    convex = convex_layers(graph, layers)
    return sorted(((name, ops) for name, ops in layers.items() if name in convex), key=lambda item: min(item[1]))


def even_stages(layer_count: int, stages: int) -> tuple[tuple[int, int], ...]:
    """``[first, stop)`` layer ranges of ``stages`` runs as equal as they go, the longer ones first."""
    base, extra = divmod(layer_count, stages)
    out, first = [], 0
    for j in range(stages):
        stop = first + base + (1 if j < extra else 0)
        out.append((first, stop))
        first = stop
    return tuple(out)


def stage_of_nodes(graph: OpGraph, pipeline: PipelinePlan) -> dict[str, int]:
    """Op node name -> the stage (position in ``pipeline.stages``) that runs it.

    A layer's ops run on the stage holding the layer.  Any other op runs on the latest stage among the ops it
    reads (the head after the last layer: the last stage); an op that reads no op of a stage (masks, positions,
    rotary tables made from the inputs alone) runs on the earliest stage among its readers, so it is made once
    and sent on, and an op read by none on the last stage.  Raises AssertionError when an op would read a value
    of a later stage (layers that are not a chain)."""
    layers = chain_layers(graph)
    stage_of_layer = {k: j for j, part in enumerate(pipeline.stages) for k in range(part.first_layer, part.stop_layer)}
    pinned = {i: stage_of_layer[k] for k, (_, ops) in enumerate(layers) for i in ops}
    stage: dict[int, int] = {}
    for node in graph.nodes:  # forward: the latest stage read
        if node.kind != "op":
            continue
        read = [stage[u] for u, _ in node.inputs if u in stage]
        if node.index in pinned:
            stage[node.index] = pinned[node.index]
        elif read:
            stage[node.index] = max(read)
    users: dict[int, list[int]] = {}
    for node in graph.nodes:
        for u, _ in node.inputs:
            users.setdefault(u, []).append(node.index)
    last = len(pipeline.stages) - 1
    for node in reversed(graph.nodes):  # backward: what reads no stage runs on its earliest reader's
        if node.kind == "op" and node.index not in stage:
            read_by = [stage[v] for v in users.get(node.index, ()) if v in stage]
            stage[node.index] = min(read_by) if read_by else last
    for node in graph.nodes:
        for u, _ in node.inputs:
            if u in stage and node.index in stage and stage[u] > stage[node.index]:
                raise AssertionError(
                    f"pipeline stages: op {node.name} (stage {stage[node.index]}) reads {graph.nodes[u].name} of a "
                    f"later stage {stage[u]}: the layers do not form a chain"
                )
    return {graph.nodes[i].name: j for i, j in stage.items()}


def plan_pipelined(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs,
    example_kwargs: dict | None,
    options: PlanOptions,
    hint_options: HintOptions,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Plan, OpGraph]:
    """The plan that runs the batch as ``options.microbatches`` micro-batches, through a pipeline along
    ``options.pipeline`` or (``pipeline="none"``) accumulated on the whole mesh, and the graph it was made on
    (captured at the micro-batch; module docstring)."""
    piped = options.pipeline != "none"
    axis = pipeline_axis(mesh, options.pipeline) if piped else -1
    p = mesh.shape[axis] if piped else 1
    v = 2 if piped and options.schedule == "interleaved" else 1
    args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    m = options.microbatches
    if m == "auto":
        m = auto_microbatches(batch_of(tuple(args), dict(example_kwargs or {})), p, mesh.size // p, options.schedule)
    if piped:
        _check_schedule(options.schedule, p, m)
    (micro_args, micro_kwargs), *_ = split_microbatches(tuple(args), dict(example_kwargs or {}), m)
    # accumulated micro-batches hold one micro-batch's activations at a time: the cap holds as it is
    inner = dataclasses.replace(options, pipeline="none", microbatches=1, mem_cap=None if piped else options.mem_cap)
    ctx = prepare_context(
        model, stage_mesh(mesh, axis) if piped else mesh, micro_args, micro_kwargs, inner, hint_options
    )
    if piped:
        layers = chain_layers(ctx.graph)
        _check_layers(options.pipeline, type(model).__name__, layers, p, v)
    hinted_ctx, resolved = hinted_context(ctx, None)
    run = SearchRun(Deadline.after(inner.search_budget_s), progress)
    micro_plan = search_modes(ctx, hinted_ctx, resolved, ctx.options, run).plan
    if not piped:
        return dataclasses.replace(micro_plan, microbatches=m, cost=step_cost(micro_plan.cost, m)), ctx.graph
    stages = _stage_parts(micro_plan, [name for name, _ in layers], options.schedule, p, m, v)
    pipe = PipelinePlan(options.pipeline, options.schedule, stages, v, bubble_fraction(options.schedule, p, m, v))
    plan = lift(micro_plan, mesh, axis, pipe, m)
    cap = options.mem_cap
    plan = dataclasses.replace(
        plan,
        settings=dataclasses.replace(plan.settings, mem_cap_bytes=cap),
        memory=dataclasses.replace(plan.memory, cap_bytes=cap),
    )
    if cap is not None and plan.memory.per_device_bytes > cap:
        raise MemoryCapError(
            f"no pipelined plan fits: {plan.memory.per_device_bytes} bytes per device estimated (the stage-mesh plan's "
            f"state over {p} stages plus {m} micro-batches' activations in flight) against the cap of {cap}. Fix: "
            "more micro-batches, a longer pipeline axis, recompute='full', or a larger cap"
        )
    return plan, ctx.graph


def auto_microbatches(batch: int | None, p: int, others: int, schedule: str) -> int:
    """``microbatches="auto"``: 1 without a pipeline (``p = 1``); with one, the most micro-batches up to ``4 p``
    (the bubble ``(p - 1) / (m + p - 1)`` under a fifth) that split the batch evenly, each micro-batch still
    splitting evenly over the ``others`` ranks of the other axes, and that the schedule runs; failing that, the
    fewest the schedule runs.  Searching ``m`` with the stages is the next step (module docstring)."""
    if p == 1 or batch is None:
        return 1
    runs = [m for m in range(1, batch + 1) if batch % m == 0 and _schedule_runs(schedule, p, m)]
    if not runs:
        raise ValueError(
            f"a batch of {batch} does not split into micro-batches a {p}-stage {schedule} pipeline runs (at least "
            f"{p}{', a multiple of it' if schedule == 'interleaved' else ''}). Fix: a batch of {p} or more, or "
            "schedule='gpipe'"
        )
    even = [m for m in runs if m <= 4 * p and (batch // m) % others == 0]
    return max(even) if even else min(runs)


def _schedule_runs(schedule: str, p: int, m: int) -> bool:
    return not (schedule == "1f1b" and m < p) and not (schedule == "interleaved" and m % p)


def _stage_parts(micro: Plan, layers: list[str], schedule: str, p: int, m: int, v: int) -> tuple[StagePart, ...]:
    """The even split's stages, priced as equal stages: each ``1 / (p v)`` of a micro-batch's ops, its rank
    holding ``1 / p`` of the model state and its micro-batches in flight (``_pipeline_memory``)."""
    per_micro = sum(t for k, t in micro.cost.terms.items() if not per_step(k))
    out = []
    for j, (a, b) in enumerate(even_stages(len(layers), p * v)):
        held = in_flight(schedule, p, m, j % p, v)
        memory = _pipeline_memory(micro.memory, p, v, held).per_device_bytes
        named = layer_span(layers[a:b])
        named = ("(before) " if j == 0 else "") + named + (" (after)" if j == p * v - 1 else "")
        out.append(StagePart(a, b, named, per_micro / (p * v), memory))
    return tuple(out)


def layer_span(names: list[str]) -> str:
    """``transformer.h.0-3`` for a run of one module list's entries, else the first and last name."""
    if not names:
        return ""
    prefix, _, first = names[0].rpartition(".")
    last_prefix, _, last = names[-1].rpartition(".")
    if len(names) == 1:
        return names[0]
    if prefix == last_prefix and first.isdigit() and last.isdigit():
        return f"{prefix}.{first}-{last}"
    return f"{names[0]} .. {names[-1]}"


def _check_schedule(schedule: str, p: int, m: int) -> None:
    """What ``torch.distributed.pipelining`` runs: 1F1B at least ``p`` micro-batches, interleaved a multiple of
    ``p``."""
    if schedule == "1f1b" and m < p:
        raise ValueError(
            f"schedule='1f1b' on {p} pipeline stages needs at least {p} micro-batches (each stage runs one in "
            f"flight before its first backward), got microbatches={m}. Fix: pass microbatches={p} or more, or "
            "schedule='gpipe'"
        )
    if schedule == "interleaved" and m % p:
        raise ValueError(
            f"schedule='interleaved' sends micro-batches in groups of the {p} pipeline ranks: microbatches={m} is "
            f"not a multiple of {p}. Fix: pass microbatches={p * max(1, m // p)} or schedule='1f1b'"
        )


def _check_layers(axis: str, model: str, layers: list, p: int, v: int) -> None:
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


def lift(inner: Plan, mesh: Mesh, axis: int, pipe: PipelinePlan, microbatches: int) -> Plan:
    """``inner`` (planned on ``stage_mesh(mesh, axis)`` for one micro-batch) on ``mesh``: every placement
    replicated along ``axis``, priced as the pipeline runs (module docstring)."""

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
    name = mesh.axis_names[axis]
    collectives = tuple(c for c in inner.collectives if c.axis != name)  # a size-1 axis moves nothing
    return dataclasses.replace(
        inner,
        mesh=mesh,
        params=params,
        inputs=inputs,
        nodes=nodes,
        collectives=collectives,
        cost=step_cost(inner.cost, microbatches, mesh.shape[axis], pipe.virtual),
        memory=_pipeline_memory(
            inner.memory,
            mesh.shape[axis],
            pipe.virtual,
            in_flight(pipe.schedule, mesh.shape[axis], microbatches, 0, pipe.virtual),
        ),
        pipeline=pipe,
        microbatches=microbatches,
        alternatives=(),
    )


def per_step(term: str) -> bool:
    """Whether a cost term (``PlanCost.terms``) is paid once per step, not per micro-batch: the optimizer step and
    what runs with it (the all-gather of ZeRO-sharded weights)."""
    return term == "optimizer step" or term.endswith("(optimizer)")


def step_cost(micro: PlanCost, m: int, p: int = 1, v: int = 1) -> PlanCost:
    """A step of ``m`` micro-batches from the plan of one (``micro``), with equal stages on ``p`` pipeline ranks
    (``v`` per rank; ``p = 1``: accumulated on the whole mesh):

        T = (m v + p - 1) / (p v) t_micro + t_step / p

    ``t_micro``: the terms each micro-batch pays (ops, their collectives), of which each of the ``p v`` stages
    runs ``1 / (p v)``; ``(m v + p - 1)`` stage slots pass on the slowest rank, ``(p - 1)`` of them the bubble
    (its own term); ``t_step``: the terms paid once per step (``per_step``), each stage for its own weights."""
    scale = m / p
    terms = {k: t / p if per_step(k) else t * scale for k, t in micro.terms.items()}
    per_micro = sum(t for k, t in micro.terms.items() if not per_step(k))
    if p > 1:
        terms["pipeline bubble"] = per_micro * (p - 1) / (p * v)
    compute = sum(t for k, t in terms.items() if k in ("ops (forward + backward)", "optimizer step"))
    total = sum(terms.values())
    return PlanCost(compute, total - compute - terms.get("pipeline bubble", 0.0), total, terms)


def _pipeline_memory(micro: PlanMemory, p: int, v: int, held: int) -> PlanMemory:
    """A rank's memory with equal stages: ``1 / p`` of the model state plus ``held`` stage-micro-batches in
    flight, ``1 / (p v)`` of one micro-batch's activations each (the first rank holds the most)."""
    state = [-(-b // p) for b in (micro.params_bytes, micro.grads_bytes, micro.optimizer_bytes)]
    activations = -(-micro.activations_bytes * held // (p * v))
    return PlanMemory(
        per_device_bytes=sum(state) + activations,
        params_bytes=state[0],
        grads_bytes=state[1],
        optimizer_bytes=state[2],
        activations_bytes=activations,
        cap_bytes=micro.cap_bytes,
    )
