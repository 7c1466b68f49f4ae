"""What ``autopar.compile`` checks before anything runs: the plan, the weights and the inputs against the model.

Bad input fails before any collective where it can, on every rank alike, naming
what differs and the fix: a plan for another mesh, model, input shapes or traced
graph (``load_plan``, ``check_plan_inputs``, ``check_plan_graph``), a state dict
that does not fit the model (``check_state_dict``), ranks that disagree on the
input shapes at compile time (``check_same_inputs_on_every_rank``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import OpGraph
from autopar.mesh import Mesh
from autopar.planner import Plan

__all__ = [
    "check_plan_graph",
    "check_plan_inputs",
    "check_same_inputs_on_every_rank",
    "check_state_dict",
    "load_plan",
]


def check_state_dict(state_dict, params: dict[str, nn.Parameter]) -> None:
    """Every parameter of the model is in ``state_dict`` as a tensor of its shape and dtype (before anything runs)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict={type(state_dict).__name__}: expected a mapping of parameter names to tensors, "
            "e.g. model.state_dict() of the full model"
        )
    bad = [f"{k}: missing" for k in params if k not in state_dict]
    for k, p in params.items():
        value = state_dict.get(k)
        if k not in state_dict:
            continue
        if not isinstance(value, torch.Tensor):
            bad.append(f"{k}: a {type(value).__name__}, expected a tensor of shape {tuple(p.shape)}")
        elif tuple(value.shape) != tuple(p.shape) or value.dtype != p.dtype:
            bad.append(
                f"{k}: shape {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}, the model's parameter "
                f"is {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            )
        elif value.is_meta:
            bad.append(f"{k}: on the meta device (no values); expected the weights")
    if bad:
        raise ValueError(
            f"state_dict does not fit the model: {len(bad)} parameters differ:{_bullets(bad)}\n"
            "Fix: pass the full (unsharded) state dict of this model, e.g. model.state_dict() of the model built "
            "with real weights, converted to the model's dtype"
        )


def _bullets(items: list[str], limit: int = 5) -> str:
    more = f"\n  - ... and {len(items) - limit} more" if len(items) > limit else ""
    return "".join(f"\n  - {m}" for m in items[:limit]) + more


def _shape_differences(got: dict, planned: dict, where: str) -> list[str]:
    """One line per name whose shape differs between ``got`` (``where``: "in the model", "given") and the plan."""
    bad = [
        f"{name}: shape {shape} {where}, {planned[name]} in the plan"
        if name in planned
        else f"{name}: {where} {shape}, not in the plan"
        for name, shape in got.items()
        if planned.get(name) != shape
    ]
    return bad + [f"{name}: in the plan {shape}, not {where}" for name, shape in planned.items() if name not in got]


def load_plan(plan, mesh: Mesh, model: nn.Module) -> Plan:
    """``plan`` as a Plan, checked against the mesh and the model's parameter names and shapes."""
    if isinstance(plan, Plan):
        found = plan
    elif isinstance(plan, (str, Path)):
        found = Plan.from_json(plan)
    else:
        raise TypeError(f"plan={type(plan).__name__}: expected an autopar Plan or the path of a plan JSON file")
    if tuple(found.mesh.shape) != tuple(mesh.shape):
        raise ValueError(
            f"the plan is for mesh {found.mesh} (shape {tuple(found.mesh.shape)}) but compile got {mesh} (shape "
            f"{tuple(mesh.shape)}); pass autopar.Mesh({tuple(found.mesh.shape)}, axis_names="
            f"{tuple(found.mesh.axis_names)}) or re-plan for this mesh"
        )
    planned: dict[str, tuple[int, ...]] = {}
    for fqn, entry in found.params.items():
        for name in (fqn, *entry.tied_to):
            planned[name] = entry.shape
    held = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if bad := _shape_differences(held, planned, "in the model"):
        raise ValueError(
            f"the plan (for {found.model}) does not match the model {type(model).__name__}: {len(bad)} parameters "
            f"differ:{_bullets(bad)}\nFix: pass the plan made for this model (autopar plan ... -o plan.json), "
            "or leave plan= out to let compile plan it"
        )
    return found


def check_plan_inputs(plan: Plan, graph: OpGraph) -> None:
    """The inputs the plan was made for have the shapes of the inputs compile got."""
    got = {n.fqn: tuple(n.outputs[0].shape) for n in graph.nodes if n.kind == "input"}
    planned = {k: v.shape for k, v in plan.inputs.items() if v.kind == "input"}
    if bad := _shape_differences(got, planned, "given"):
        raise ValueError(
            f"the inputs do not match the plan's (for {plan.model}):{_bullets(bad)}\nFix: pass inputs of the "
            "shapes the plan was made for, or re-plan with these inputs"
        )


def check_plan_graph(plan: Plan, graph: OpGraph, model: nn.Module) -> None:
    """The plan's op nodes are the ops of the graph this rank traced (same names, same aten ops).

    torch.export traces the kernels the model's tensors run, so a plan made on
    another device (``meta``, CUDA) or another library version can describe another
    graph: HF attention's ``.contiguous()`` of a transposed output is a copy on one
    device and a no-op on another.
    """
    traced = {n.name: str(n.target) for n in graph.nodes if n.kind == "op"}
    planned = {name: entry.op for name, entry in plan.nodes.items()}
    bad = [f"{name}: {op} in the plan, not in the traced graph" for name, op in planned.items() if name not in traced]
    bad += [f"{name}: {op} in the traced graph, not in the plan" for name, op in traced.items() if name not in planned]
    bad += [
        f"{name}: {op} in the plan, {traced[name]} in the traced graph"
        for name, op in planned.items()
        if name in traced and traced[name] != op
    ]
    if bad:
        raise ValueError(
            f"the plan (for {plan.model}) describes another graph than {type(model).__name__} traces here: "
            f"{len(bad)} ops differ:{_bullets(bad)}\ntorch.export records the ops the model's tensors run, which "
            "can differ between devices (a plan made on the meta device or a GPU, used on CPU) and library "
            "versions.\nFix: plan on the device and versions you run on (the same dtype and example inputs), "
            "or leave plan= out to let compile plan it"
        )


def _input_signature(args: tuple, kwargs: dict) -> list[str]:
    flat = torch.utils._pytree.tree_flatten((args, kwargs))[0]
    return [f"{tuple(t.shape)} {t.dtype}".replace("torch.", "") if torch.is_tensor(t) else repr(t) for t in flat]


def check_same_inputs_on_every_rank(args: tuple, kwargs: dict) -> None:
    """Every rank compiles with inputs of the same shapes (else their graphs differ and collectives would hang)."""
    mine = _input_signature(args, kwargs)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, sig in enumerate(every) if sig != every[0]]
    if differ:
        raise ValueError(
            "autopar.compile: the ranks got inputs of different shapes:"
            + _bullets([f"rank {r}: {', '.join(every[r])}" for r in [0, *differ]], limit=4)
            + "\nFix: every rank passes the same global batch (input_mode='global'); for per-rank data "
            "compile with example_inputs of the global shapes and input_mode='local'"
        )
