"""Planning for a device count: the logical meshes of ``devices`` devices, each planned, the fastest kept
(``autopar.plan(model, devices=N)``, ``autopar plan MODEL --devices N``, ``autopar.compile(model, devices=N)``).

The meshes (``logical_meshes``) are the ordered factorizations of ``N``, row-major with the last axis
innermost, so consecutive ranks share a node (``DeviceProfile.link_for_axis`` prices each axis on the link its
groups use: inside a node, or across nodes when any group spans two):

* ``(N,)``, named ``("dp",)``;
* ``(a, b)`` with ``a b = N``, ``a, b >= 2``, named ``("dp", "tp")``;
* with ``pipeline="auto"`` also ``(p, a, b)``, named ``("pp", "dp", "tp")``, pipelined on ``pp`` (and each
  two-axis mesh may pipeline either axis, as ``pipeline="auto"`` does on a given mesh).  That pipeline is the
  enumeration's, not the user's (``SharedPlanning.placed``): its candidates are bounded by the fastest step so far
  and skipped where they cannot run, and a mesh none of whose candidates can run (more stages than layers) is
  listed with why (``NoCandidateError``), as ``pipeline="auto"`` does, not raised as a pipeline the user forced.

The names are labels: the search chooses what each axis does (data, sharded-parameter, tensor or sequence
parallel) and the plan's table says what it chose.  A third axis without a pipeline (a second data axis,
hybrid sharding) is not enumerated yet: the two-axis meshes carry every placement the search has.

Work is shared (``SharedPlanning``): the model is captured once per micro-batch size for every mesh, and each mesh's
searches are bounded by the fastest step found so far (``SearchRun.above``), so a mesh proven slower stops at its
bound and is listed as at least that. How much that saves depends on how soon a fast plan is met, so the meshes are
planned in ``planning_order``. On one node: the one-axis mesh first (cheap to plan, and the fastest for a model
data parallelism suits). On several nodes: the meshes whose innermost axis is one node's devices (its collectives,
the most frequent where it carries tensor parallelism, ride the node's link with all of its devices, and only the
outer axes cross nodes: how Megatron-LM and torchtitan lay out their largest runs), then the others, the one-axis
mesh among them: across nodes it is rarely the fastest, and planned first it is planned unbounded (Llama 3 405B at
16,384 GPUs: 42 s to find that it does not fit, against about 2 s to prove it slower once bounded). Within each
group, by their largest axis, smallest first (a collective's latency and the share of its bytes each rank sends grow
with its group, so the most balanced meshes are the likeliest fast for a model that needs several axes), then by
fewer axes, then by the largest axis that carries collectives (a pipeline axis sends only the stage boundaries, so
of (32, 64, 8) and (64, 32, 8), pipelined on the first axis, the second is the likelier fast).  Measured on Llama 3
405B at 8,192 GPUs, the one-axis plan's step was 72 times the published configuration's; at 16,384 GPUs the fastest
plan, 64 x 32 x 8, was met fifteenth, third once the node's devices went innermost first (with the collections left
to each mesh's end, ``heap``, the plan 1,497 -> 1,356 s; 1,225 s once GPipe is not priced where 1F1B dominates it;
1,115 s once walks that cannot win stop, ``stage_fitting``), and first once the one-axis mesh and the pipeline axis
were placed as above. The order is a search order only: every mesh is planned
or proven slower. Chosen: the fastest plan that fits the cap (the earlier mesh of ``logical_meshes`` on a tie,
whatever the planning order). ``Plan.meshes`` lists every mesh tried, fastest first, with its step, memory, model
FLOP/s per device and MFU, or why it lost. When no mesh fits, ``MemoryCapError`` names the least memory each mesh
needs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from autopar.capture import OpGraph
from autopar.mesh import Mesh
from autopar.search import BeatenError
from autopar.units import format_bytes
from costmodel import load_profile

from .errors import MemoryCapError
from .heap import FrozenHeap
from .options import HintOptions, PlanOptions
from .pipeline_choice import NoCandidateError, PipelineChoice, SharedPlanning, plan_model
from .plan_parts import MeshCandidate
from .problem_tables import PS_PER_S
from .schema import Plan

__all__ = ["check_devices", "logical_meshes", "plan_devices", "plan_on", "planning_order"]

log = logging.getLogger(__name__)


def check_devices(devices, devices_per_node: int) -> None:
    """ValueError with the fix unless ``devices`` is an int >= 1 that whole nodes of ``devices_per_node`` hold
    (one node's part, or a multiple of it)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: expected the number of devices, an int >= 1 (e.g. devices=8)")
    if devices > devices_per_node and devices % devices_per_node:
        raise ValueError(
            f"devices={devices} on nodes of {devices_per_node} devices: {devices} is not a multiple of "
            f"{devices_per_node}, so some node would be partly used. Fix: pass a multiple of {devices_per_node} "
            f"(e.g. devices={devices - devices % devices_per_node}), or devices_per_node= the devices each node "
            "gives the job"
        )


def logical_meshes(devices: int, pipeline: str = "none") -> list[Mesh]:
    """The meshes of ``devices`` devices, in the order they are planned (module docstring)."""
    meshes = [Mesh((devices,), axis_names=("dp",))]
    pairs = [(a, devices // a) for a in range(2, devices // 2 + 1) if devices % a == 0]
    meshes += [Mesh(pair, axis_names=("dp", "tp")) for pair in pairs]
    if pipeline == "auto":
        for p in range(2, devices // 4 + 1):
            if devices % p == 0:
                rest = devices // p
                meshes += [
                    Mesh((p, a, rest // a), axis_names=("pp", "dp", "tp"))
                    for a in range(2, rest // 2 + 1)
                    if rest % a == 0
                ]
    return meshes


def planning_order(meshes: list[Mesh], devices_per_node: int | None = None) -> list[tuple[int, Mesh]]:
    """``(index in meshes, mesh)`` in the order ``plan_devices`` plans them (module docstring).  On one node (or
    ``devices_per_node`` None): the first mesh (the one-axis one), then the rest by the largest axis, then by fewer
    axes, then by the largest axis that carries collectives (a three-axis mesh's pipeline axis carries none), then as
    listed.  Where the meshes span several nodes of ``devices_per_node``: those whose innermost axis is one node
    first, then the others, each group in that order, the one-axis mesh among the others."""
    spans_nodes = devices_per_node is not None and bool(meshes) and meshes[0].size > devices_per_node

    def key(item: tuple[int, Mesh]) -> tuple:
        mesh = item[1]
        one_node_inside = spans_nodes and mesh.shape[-1] == devices_per_node
        collectives = mesh.shape[1:] if mesh.ndim == 3 else mesh.shape  # ``logical_meshes``: ``pp`` outermost
        return (spans_nodes and not one_node_inside, max(mesh.shape), mesh.ndim, max(collectives), item[0])

    items = list(enumerate(meshes))
    if spans_nodes:
        return sorted(items, key=key)
    first, *rest = items
    return [first, *sorted(rest, key=key)]


def plan_on(
    model: torch.nn.Module,
    where: Mesh | int,
    example_inputs,
    example_kwargs: dict | None,
    options: PlanOptions,
    hint_options: HintOptions,
    *,
    compare_families: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Plan, OpGraph]:
    """The plan and its graph on ``where``: a mesh (``plan_model``), or a device count whose mesh the plan chooses
    (``plan_devices``); what ``autopar.plan``, ``autopar.compile`` and ``autopar plan`` call."""
    chooser = plan_devices if isinstance(where, int) else plan_model
    return chooser(
        model,
        where,
        example_inputs,
        example_kwargs,
        options,
        hint_options,
        compare_families=compare_families,
        progress=progress,
    )


def plan_devices(
    model: torch.nn.Module,
    devices: int,
    example_inputs,
    example_kwargs: dict | None,
    options: PlanOptions,
    hint_options: HintOptions,
    *,
    compare_families: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Plan, OpGraph]:
    """The fastest plan of ``model`` on any logical mesh of ``devices`` devices and the graph it was made on
    (module docstring).  ``options.devices_per_node`` (None: the profile's) places the axes on nodes;
    ``options.mem_cap`` None is the profile's device memory (``memory_bytes``)."""
    options = options.resolved(model)
    profile = load_profile(options.profile).with_devices_per_node(options.devices_per_node)
    check_devices(devices, profile.devices_per_node)
    if options.mem_cap is None:  # planned for real devices: at most what one holds
        options = dataclasses.replace(options, mem_cap=profile.memory_bytes)
    if hint_options.given:
        raise ValueError(
            "devices=: hints name placements on a mesh's axes, and this plan chooses the mesh. Fix: pass mesh= "
            "with the hints, or drop the hints"
        )
    if options.pipeline not in ("none", "auto"):
        raise ValueError(
            f"devices= with pipeline={options.pipeline!r}: the axes are named by the plan, so none can be named "
            "before it. Fix: pipeline='auto' (a pipeline on any axis where it pays) or 'none'"
        )
    tried: list[tuple[int, MeshCandidate]] = []
    timings: dict[str, float] = {}
    best: tuple[Plan, OpGraph] | None = None
    best_index = 0
    with FrozenHeap() as heap:
        shared = SharedPlanning(heap, placed=True)
        for index, mesh in planning_order(logical_meshes(devices, options.pipeline), profile.devices_per_node):
            mesh_options = options
            if mesh.ndim == 3:  # the third axis is there for a pipeline: on the outermost
                mesh_options = dataclasses.replace(options, pipeline="pp")
            shared.beat = None if best is None else best[0].cost.total_s
            choice = PipelineChoice(
                model, mesh, example_inputs, example_kwargs, mesh_options, hint_options, progress, shared
            )
            start, captured = time.perf_counter(), len(shared.captures.graphs)
            with heap.part():  # this mesh's contexts and searches: garbage at its end unless its plan is the best
                try:
                    row, found = _try_mesh(choice)
                finally:
                    for key, value in choice.timings.items():
                        timings[key] = timings.get(key, 0.0) + value
                del choice
            took, new = time.perf_counter() - start, len(shared.captures.graphs) - captured
            tried.append((index, dataclasses.replace(row, planning_s=took, new_captures=new)))
            faster = found is not None and (
                best is None or (found[0].cost.total_s, index) < (best[0].cost.total_s, best_index)
            )
            if faster:
                best, best_index = found, index
    listed = [c for _, c in sorted(tried, key=lambda item: item[0])]  # as logical_meshes lists them
    if best is None:
        raise _none_fit(devices, options, listed)
    plan, graph = best
    ranked = tuple(sorted(listed, key=_rank))
    timings["meshes"] = float(len(tried))
    return dataclasses.replace(plan, meshes=_with_notes(ranked, plan), timings=dict(plan.timings, **timings)), graph


def _try_mesh(choice: PipelineChoice) -> tuple[MeshCandidate, tuple[Plan, OpGraph] | None]:
    """The row of ``choice``'s mesh in ``Plan.meshes`` and its plan with its graph (None where no plan fits, every
    plan is proven slower than a mesh planned before, or nothing can run on it)."""
    shape, names = choice.mesh.shape, choice.mesh.axis_names
    try:
        plan, graph = choice.best(False)
    except MemoryCapError as e:
        return MeshCandidate(shape, names, None, e.min_mem_bytes), None
    except BeatenError as e:
        return MeshCandidate(shape, names, None, None, at_least_s=e.lower_bound_ps / PS_PER_S), None
    except NoCandidateError as e:  # a pipeline mesh whose stages outnumber the layers or the rows
        return MeshCandidate(shape, names, None, None, note=f"cannot run: {e.why}"), None
    return _candidate(plan), (plan, graph)


def _candidate(plan: Plan) -> MeshCandidate:
    f = plan.throughput
    return MeshCandidate(
        plan.mesh.shape,
        plan.mesh.axis_names,
        plan.cost.total_s,
        plan.memory.per_device_bytes,
        flops_per_device_s=f.flops_per_device_s if f else None,
        mfu=f.mfu if f else None,
        plan=plan.family + (f", pipeline on {plan.pipeline.axis}" if plan.pipeline else ""),
    )


def _rank(c: MeshCandidate) -> tuple:
    step = c.step_s if c.step_s is not None else c.at_least_s
    return (step is None, step or 0.0, c.memory_bytes or 0)


def _with_notes(ranked: tuple[MeshCandidate, ...], chosen: Plan) -> tuple[MeshCandidate, ...]:
    """Each mesh with why it lost (or ``chosen``)."""
    best = chosen.cost.total_s
    out = []
    for c in ranked:
        if (c.shape, c.axis_names) == (chosen.mesh.shape, chosen.mesh.axis_names):  # each mesh is tried once
            note = "chosen"
        elif c.step_s is not None:
            note = f"{c.step_s / best:.2f}x slower"
        elif c.at_least_s is not None:
            note = f"at least {c.at_least_s / best:.2f}x slower (search bounded)"
        elif c.note:
            note = c.note
        else:
            note = f"does not fit: needs {format_bytes(c.memory_bytes)}"
        out.append(dataclasses.replace(c, note=note))
    return tuple(out)


def _none_fit(devices: int, options: PlanOptions, tried: list[MeshCandidate]) -> MemoryCapError:
    tried = [c for c in tried if c.memory_bytes is not None]  # (a mesh where nothing can run needs nothing)
    least = min(tried, key=lambda c: c.memory_bytes or 0)
    each = "; ".join(f"{'x'.join(map(str, c.shape))}: {format_bytes(c.memory_bytes)}" for c in tried)
    cap = format_bytes(options.mem_cap) if options.mem_cap else "none"
    return MemoryCapError(
        f"no mesh of {devices} devices fits the memory cap of {cap} per device; the least each mesh needs: {each}",
        least.memory_bytes or 0,
    )
