"""``autopar.compile``: a plan turned into an ordinary ``nn.Module`` on each rank.

    sharded = autopar.compile(model, mesh, example_inputs=(ids,))   # inside a process group
    loss = sharded(ids, labels=labels)          # default: the same global batch on every rank
    loss.backward(); opt.step()                 # any torch optimizer over sharded.parameters()

``compile`` plans on rank 0 (or loads a plan), lowers the plan and returns this
rank's ``ShardedModule`` (``module.py``: what it holds and how it runs).  It takes
the planning keywords of ``autopar.plan`` (``autopar.planner.PLAN_KEYWORDS``), builds
the options objects once and hands them to the planner.

Where the shards come from: ``model`` with real weights on every rank (each keeps
its piece); a meta-device ``model`` plus a full ``state_dict``; or
``weights_from_rank0=True``, where rank 0 alone holds real weights and sends each
parameter to the others.

Lazy compile: ``example_inputs=None`` plans on the first call (see ``compile``).
Bad input fails before any collective where it can: bad options (``PlanOptions``),
a plan for another mesh, model, input shapes or traced graph, ranks that disagree
on the input shapes at compile time (``checks.py``); world size != mesh size and a
missing process group fail in ``MeshGroups``; inputs of other shapes than the
compiled ones raise in ``ShardedModule.forward``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import OpGraph, attach_loss, capture, split_microbatches
from autopar.mesh import Mesh
from autopar.planner import (
    HintOptions,
    Plan,
    PlanOptions,
    device_profile,
    plan_on,
    training_precision,
)

from .checks import check_plan_graph, check_plan_inputs, check_same_inputs_on_every_rank, check_state_dict, load_plan
from .module import ShardedModule

__all__ = ["compile", "default_profile", "training_precision"]

log = logging.getLogger(__name__)


def default_profile(groups) -> str:
    """The profile ``compile`` prices for the ranks of ``groups`` (``autopar.planner.device_profile`` of their
    device: ``profile=None``'s rule inside a process group)."""
    return device_profile(getattr(groups, "device", torch.device("cpu")))


def compile(
    model: nn.Module,
    mesh: Mesh | None = None,
    *,
    devices: int | None = None,
    example_inputs=None,
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    example_target=None,
    plan: Plan | str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    weights_from_rank0: bool = False,
    input_mode: str = "global",
    seed: int = 0,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    grad_bucket_bytes: int | None = 25 * 2**20,
    devices_per_node: int | None = None,
    solver: str = "dp",
    recompute: str = "auto",
    family: str | None = None,
    allow_state_sharding: bool = True,
    search_budget_s: float | None = 30.0,
    pipeline: str = "none",
    microbatches: int | str = "auto",
    schedule: str = "auto",
    virtual_stages: int | str = "auto",
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
) -> ShardedModule:
    """Plan (or load ``plan``) and build this rank's ``ShardedModule``.

    Must be called on every rank inside an initialized default process group whose
    world size equals ``mesh.size``; ``mesh`` is an ``autopar.Mesh`` or a torch
    ``DeviceMesh`` (``Mesh.from_device_mesh``).  ``devices=N`` instead of a mesh (the
    world size, e.g. ``dist.get_world_size()``) lets rank 0 choose the mesh as
    ``autopar.plan(model, devices=N)`` does; every rank builds the mesh of that plan.

    ``example_inputs=None`` (and no ``example_kwargs``) compiles lazily: the module
    captures and plans on its first call, with that call's inputs (every rank must
    call with the same shapes; this is checked), and later calls must keep those
    shapes.  Until then ``parameters()`` are the full parameters, so an optimizer
    can be built first: compiling re-points the same Parameter objects at this
    rank's pieces; ``.plan`` raises ``NotCompiledError``.  Lazy compilation needs
    ``input_mode="global"`` (local pieces do not say the global shapes).

    The planning keywords (``mem_cap`` ... ``strict``) are ``autopar.plan``'s, with its
    defaults, checked on every rank alike before anything runs; with ``plan=`` the plan
    says what was planned and only ``grad_bucket_bytes`` is used.  As ``profile=None``
    says, ``compile`` prices the device of its process group (``cpu`` on gloo CPU ranks,
    the GPU by name on nccl); ``dtype=None``: the model's parameters' precision
    (float32: "fp32", bfloat16: "bf16-pure"); ``optimizer``: the one whose state the plan's
    memory counts (any torch optimizer runs whatever it says); ``devices_per_node=None``:
    torchrun's ``LOCAL_WORLD_SIZE`` when the job spans nodes.  ``grad_bucket_bytes``:
    data-parallel gradient all-reduces are issued per bucket of about that many bytes,
    overlapped with backward (``runtime/buckets.py``); None or 0 issues the plan's per-edge
    all-reduces one by one.  ``allow_state_sharding=False`` keeps every gradient and
    optimizer state with its parameter (``runtime/zero.py`` says how ZeRO plans run).

    A ``plan=`` is checked against the model (mesh, parameter names and shapes,
    input shapes) before anything runs, on every rank alike.

    A model that does not return its loss: ``loss_fn=fn`` (``fn(output, target)``, a scalar)
    with ``example_target=t`` compiles ``fn(model(...), t)`` with the loss in the graph
    (``capture.with_loss``); the module is then called, and trained, with the target as a
    keyword: ``sharded.train_step(*inputs, target=t)``.  Its names are the model's.
    """
    options, hint_options = PlanOptions.from_keywords(locals()), HintOptions.from_keywords(locals())
    from autopar.runtime import MeshGroups  # torch.distributed's groups: imported when a job compiles

    lazy = example_inputs is None and example_kwargs is None and example_target is None
    model, example_kwargs = attach_loss(model, loss_fn, example_kwargs, example_target, lazy=lazy)
    if lazy and input_mode == "local":
        raise ValueError(
            "autopar.compile(example_inputs=None, input_mode='local'): a lazy compile plans from the first call's "
            "inputs, which in local mode are only this rank's pieces; pass example_inputs= with the global "
            "shapes, or use input_mode='global'"
        )
    traced = None  # the graph compile(devices=) planned with, reused by the build
    if devices is not None:  # rank 0 chooses the mesh; every rank runs that plan
        _check_devices_plan(mesh, devices, plan, lazy)
        args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
        plan, traced = _plan_on_rank0(model, devices, args, kwargs, options, hint_options)
        mesh = plan.mesh
    mesh = _as_mesh(mesh)
    plan_obj = None if plan is None else load_plan(plan, mesh, model)
    groups = MeshGroups(mesh)
    sharded = ShardedModule(
        groups,
        build=_Build(model, mesh, plan_obj, options, hint_options, traced),
        input_mode=input_mode,
        full_params=_full_parameters(model, state_dict, weights_from_rank0),
        buffers={k: v.detach().clone() for k, v in model.named_buffers()},
        seed=seed,
        state_keys=list(model.state_dict().keys()),
        grad_bucket_bytes=options.grad_bucket_bytes,
    )
    sharded.train(model.training)  # the mode the model was in; dropout follows sharded.train() / .eval()
    if not lazy:
        sharded._compile(_as_args(example_inputs), dict(example_kwargs or {}))
    return sharded


def _check_devices_plan(mesh, devices, plan, lazy: bool) -> None:
    """ValueError with the fix where ``compile(devices=N)`` cannot choose the mesh: a mesh or a plan given too
    (each names one already), a lazy compile (the mesh is chosen before any call), a world of another size."""
    if mesh is not None or plan is not None:
        given = "mesh=" if mesh is not None else "plan="
        raise ValueError(f"autopar.compile: devices= chooses the mesh, and {given} names one too. Fix: pass one")
    if lazy:
        raise ValueError(
            "autopar.compile(devices=...): the mesh is chosen before the model runs, from example inputs. Fix: "
            "pass example_inputs= (and example_kwargs=) with the global batch"
        )
    fix = "Fix: devices=dist.get_world_size(), inside torchrun or an initialized process group"
    if not dist.is_initialized():
        raise ValueError(f"autopar.compile(devices={devices}): no process group is initialized. {fix}")
    if dist.get_world_size() != devices:
        raise ValueError(
            f"autopar.compile(devices={devices}): the process group has {dist.get_world_size()} ranks. {fix}"
        )


def _as_args(example_inputs) -> tuple:
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    return () if example_inputs is None else (example_inputs,)


def _as_mesh(mesh) -> Mesh:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):  # torch's, as DTensor users hold one
        mesh = Mesh.from_device_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh {mesh!r}: expected an autopar.Mesh (e.g. autopar.Mesh((2, 2), axis_names=('dp', 'tp'))) "
            "or a torch DeviceMesh"
        )
    return mesh


class _Build:
    """What ``ShardedModule`` calls with the first inputs: the graph and plan of this rank (planned on rank 0 with
    the options, or the given plan checked against the graph this rank traces).  ``traced``: the graph the plan
    was made with from these inputs already (``compile(devices=)`` plans before building), used as it is."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Mesh,
        plan: Plan | None,
        options: PlanOptions,
        hints: HintOptions,
        traced: OpGraph | None = None,
    ):
        self.model, self.mesh, self.plan, self.options, self.hint_options = model, mesh, plan, options, hints
        self.traced = traced

    def __call__(self, args: tuple, kwargs: dict) -> tuple[OpGraph, Plan]:
        check_same_inputs_on_every_rank(args, kwargs)
        if self.traced is not None and self.plan is not None:
            return self.traced, self.plan
        if self.plan is None:
            found, graph = _plan_on_rank0(self.model, self.mesh, args, kwargs, self.options, self.hint_options)
            return graph, found
        graph = _capture_for(self.plan, self.model, args, kwargs)
        check_plan_inputs(self.plan, graph)
        check_plan_graph(self.plan, graph, self.model)
        return graph, self.plan


def _plan_on_rank0(
    model, mesh: Mesh | int, args: tuple, kwargs: dict, options: PlanOptions, hint_options: HintOptions
) -> tuple[Plan, OpGraph]:
    """Rank 0 searches, every rank gets its plan (broadcast as JSON) and captures the graph itself.

    One search instead of one per rank, and every rank runs the very same plan.
    The others only trace the model (cheap) to execute it.
    """
    box: list = [None]
    graph = None
    if dist.get_rank() == 0:
        try:
            found, graph = _plan_here(model, mesh, args, kwargs, options, hint_options)
            box[0] = found.to_json()
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            box[0] = e
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise ValueError(f"planning failed on rank 0: {box[0]}") from box[0]
    found = Plan.from_json(box[0])
    if graph is None:
        graph = _capture_for(found, model, args, kwargs)
    return found, graph


def _capture_for(plan: Plan, model, args: tuple, kwargs: dict) -> OpGraph:
    """The graph ``plan`` runs: the model captured at the call's shapes, or at the first micro-batch's when the
    plan runs several (its program runs one micro-batch at a time)."""
    if plan.microbatches > 1:
        (args, kwargs), *_ = split_microbatches(args, kwargs, plan.microbatches)
    return capture(model, args, kwargs)


def _plan_here(
    model, mesh: Mesh | int, args: tuple, kwargs: dict, options: PlanOptions, hint_options: HintOptions
) -> tuple[Plan, OpGraph]:
    """The plan ``compile`` runs and the graph it was made on, planned in this process on a mesh or a device
    count (no family rows: the report is not printed)."""
    return plan_on(model, mesh, args, kwargs, options, hint_options)


def _full_parameters(model: nn.Module, state_dict, weights_from_rank0: bool) -> dict[str, Any]:
    params = dict(model.named_parameters())
    if state_dict is not None:
        check_state_dict(state_dict, params)
        return {k: state_dict[k].detach().requires_grad_(p.requires_grad) for k, p in params.items()}
    if any(p.is_meta for p in params.values()) and not weights_from_rank0:
        raise ValueError(
            "the model is on the meta device: pass state_dict= with the full weights, or "
            "weights_from_rank0=True with real weights on rank 0"
        )
    if weights_from_rank0:
        # the broadcast runs on the backend's device: the rank's GPU on nccl, the CPU on gloo
        nccl = dist.get_backend() == "nccl"
        comm = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        out = {}
        for k, p in params.items():
            if dist.get_rank() == 0:
                t = p.detach().to(comm, copy=True)
            else:
                t = torch.empty(p.shape, dtype=p.dtype, device=comm)
            dist.broadcast(t, src=0)
            out[k] = t.requires_grad_(p.requires_grad)
        return out
    return params
