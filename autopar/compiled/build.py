"""``autopar.compile``: a plan turned into an ordinary ``nn.Module`` on each rank.

    sharded = autopar.compile(model, mesh, example_inputs=(ids,))   # inside a process group
    loss = sharded(ids, labels=labels)          # default: the same global batch on every rank
    loss.backward(); opt.step()                 # any torch optimizer over sharded.parameters()

``compile`` plans on rank 0 (or loads a plan), lowers the plan and returns this
rank's ``ShardedModule`` (``module.py``: what it holds and how it runs).

Where the shards come from: ``model`` with real weights on every rank (each keeps
its piece); a meta-device ``model`` plus a full ``state_dict``; or
``weights_from_rank0=True``, where rank 0 alone holds real weights and sends each
parameter to the others.

Lazy compile: ``example_inputs=None`` plans on the first call (see ``compile``).
Bad input fails before any collective where it can: a plan for another mesh,
model, input shapes or traced graph, ranks that disagree on the input shapes at
compile time (``checks.py``); world size != mesh size and a missing process group
fail in ``MeshGroups``; inputs of other shapes than the compiled ones raise in
``ShardedModule.forward``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import OpGraph, capture
from autopar.mesh import Mesh
from autopar.planner import SEARCH_BUDGET_S, Plan
from autopar.runtime import DEFAULT_BUCKET_BYTES
from costmodel import optimizer_spec, precision

from .checks import check_plan_graph, check_plan_inputs, check_same_inputs_on_every_rank, check_state_dict, load_plan
from .module import ShardedModule

__all__ = ["compile", "default_profile", "training_precision"]

log = logging.getLogger(__name__)


def default_profile(groups) -> str:
    dev = getattr(groups, "device", torch.device("cpu"))
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    return "h100" if "h100" in name or "h200" in name else "a100"


def compile(
    model: nn.Module,
    mesh: Mesh,
    *,
    example_inputs=None,
    example_kwargs: dict | None = None,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    plan: Plan | str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    weights_from_rank0: bool = False,
    input_mode: str = "global",
    seed: int = 0,
    family: str | None = None,
    allow_state_sharding: bool = True,
    grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    hints: dict | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    dtype: str | None = None,
    optimizer: str = "adamw",
    recompute: str = "auto",
    devices_per_node: int | None = None,
    search_budget_s: float | None = SEARCH_BUDGET_S,
) -> ShardedModule:
    """Plan (or load ``plan``) and build this rank's ``ShardedModule``.

    Must be called on every rank inside an initialized default process group whose
    world size equals ``mesh.size``; ``mesh`` is an ``autopar.Mesh`` or a torch
    ``DeviceMesh`` (``Mesh.from_device_mesh``).  ``family`` forces the search into one family
    (``"data parallel"``, ``"sharded parameters"``, ``"tensor parallel"``);
    ``allow_state_sharding=False`` keeps every gradient and optimizer state with its
    parameter (no ZeRO-1/2; see ``runtime/zero.py`` for how ZeRO plans run).
    ``grad_bucket_bytes``: data-parallel gradient all-reduces are issued per bucket
    of about that many bytes, overlapped with backward (``runtime/buckets.py``);
    ``None`` or 0 issues the plan's per-edge all-reduces one by one.

    ``example_inputs=None`` (and no ``example_kwargs``) compiles lazily: the module
    captures and plans on its first call, with that call's inputs (every rank must
    call with the same shapes; this is checked), and later calls must keep those
    shapes.  Until then ``parameters()`` are the full parameters, so an optimizer
    can be built first: compiling re-points the same Parameter objects at this
    rank's pieces; ``.plan`` raises ``NotCompiledError``.  Lazy compilation needs
    ``input_mode="global"`` (local pieces do not say the global shapes).

    ``hints``, ``input_placements``, ``output_placements``, ``strict``: semi-auto
    mode, passed to the planner as in ``autopar.plan`` (ignored with ``plan=``).
    ``recompute`` (``"auto"``, ``"none"``, ``"selective"``, ``"full"``): what backward
    recomputes, as in ``autopar.plan`` (ignored with ``plan=``: the plan says).
    ``search_budget_s``: the search's wall-clock budget, as in ``autopar.plan``.

    ``dtype``: the training precision the plan prices (``costmodel.PRECISIONS``);
    None: the one the model's parameters are in (``training_precision``): float32
    parameters "fp32", bfloat16 ones "bf16-pure" (bf16 compute, gradients and
    optimizer state, as torch.optim keeps them).  ``optimizer``: the one whose
    state the plan's memory counts (``costmodel.OPTIMIZERS``: "adamw", "adam",
    "sgd", "sgd_momentum", "none"); any torch optimizer runs whatever it says.

    ``devices_per_node``: the job's ranks per node, so axes whose ranks span nodes are
    priced on the profile's inter-node link (``autopar.prepare``); None: torchrun's
    ``LOCAL_WORLD_SIZE`` when the job spans nodes (``runtime.ranks_per_node``), else
    the profile's figure.

    A ``plan=`` is checked against the model (mesh, parameter names and shapes,
    input shapes) before anything runs, on every rank alike.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime import MeshGroups, ranks_per_node

    if isinstance(mesh, DeviceMesh):  # torch's, as DTensor users hold one
        mesh = Mesh.from_device_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh {mesh!r}: expected an autopar.Mesh (e.g. autopar.Mesh((2, 2), axis_names=('dp', 'tp'))) "
            "or a torch DeviceMesh"
        )
    lazy = example_inputs is None and example_kwargs is None
    if lazy and input_mode == "local":
        raise ValueError(
            "autopar.compile(example_inputs=None, input_mode='local'): a lazy compile plans from the first call's "
            "inputs, which in local mode are only this rank's pieces; pass example_inputs= with the global "
            "shapes, or use input_mode='global'"
        )
    plan_obj = None if plan is None else load_plan(plan, mesh, model)
    if plan is None:
        dtype = dtype or training_precision(model)
        precision(dtype), optimizer_spec(optimizer)  # unknown names fail here, on every rank alike
    groups = MeshGroups(mesh)
    full_params = _full_parameters(model, state_dict, weights_from_rank0)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def build(args: tuple, kwargs: dict) -> tuple[OpGraph, Plan]:
        check_same_inputs_on_every_rank(args, kwargs)
        if plan_obj is None:
            found, graph = _plan_on_rank0(
                model,
                mesh,
                args,
                kwargs,
                groups,
                mem_cap=mem_cap,
                profile=profile,
                family=family,
                allow_state_sharding=allow_state_sharding,
                dtype=dtype,
                optimizer=optimizer,
                grad_bucket_bytes=grad_bucket_bytes,
                recompute=recompute,
                search_budget_s=search_budget_s,
                devices_per_node=devices_per_node if devices_per_node is not None else ranks_per_node(),
                hint_options={
                    "hints": hints,
                    "input_placements": input_placements,
                    "output_placements": output_placements,
                    "strict": strict,
                },
            )
        else:
            found, graph = plan_obj, capture(model, args, kwargs)
            check_plan_inputs(found, graph)
            check_plan_graph(found, graph, model)
        return graph, found

    sharded = ShardedModule(
        groups,
        build=build,
        input_mode=input_mode,
        full_params=full_params,
        buffers=buffers,
        seed=seed,
        state_keys=list(model.state_dict().keys()),
        grad_bucket_bytes=grad_bucket_bytes,
    )
    sharded.train(model.training)  # the mode the model was in; dropout follows sharded.train() / .eval()
    if not lazy:
        args = (
            tuple(example_inputs)
            if isinstance(example_inputs, (tuple, list))
            else (() if example_inputs is None else (example_inputs,))
        )
        sharded._compile(args, dict(example_kwargs or {}))
    return sharded


def training_precision(model: nn.Module) -> str:
    """The ``costmodel.PRECISIONS`` name of training ``model`` as it is, from its floating parameters' dtypes.

    All float32 (or none): "fp32"; all bfloat16: "bf16-pure".  Any other mix is
    priced as "fp32" (the larger figures), with a warning naming the dtypes.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        return "bf16-pure"
    if dtypes - {torch.float32}:
        log.warning(
            "%s has %s parameters: the plan prices fp32 training (pass compile(dtype=...) to choose)",
            type(model).__name__,
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
        )
    return "fp32"


def _plan_on_rank0(
    model,
    mesh,
    args,
    kwargs,
    groups,
    *,
    mem_cap,
    profile,
    family,
    allow_state_sharding=True,
    hint_options=None,
    dtype="fp32",
    optimizer="adamw",
    grad_bucket_bytes=DEFAULT_BUCKET_BYTES,
    recompute="auto",
    search_budget_s=SEARCH_BUDGET_S,
    devices_per_node=None,
) -> tuple[Plan, OpGraph]:
    """Rank 0 searches, every rank gets its plan (broadcast as JSON) and captures the graph itself.

    One search instead of one per rank, and every rank runs the very same plan.
    The others only trace the model (cheap) to execute it.
    """
    from autopar.planner import plan_from_context, prepare

    box: list = [None]
    graph = None
    if dist.get_rank() == 0:
        try:
            ctx = prepare(
                model,
                mesh,
                example_inputs=args,
                example_kwargs=kwargs,
                profile=profile or default_profile(groups),
                dtype=dtype,
                optimizer=optimizer,
                grad_bucket_bytes=grad_bucket_bytes,
                devices_per_node=devices_per_node,
                **(hint_options or {}),
            )
            graph = ctx.graph
            box[0] = plan_from_context(
                ctx,
                mem_cap=mem_cap,
                compare_families=False,
                allow_state_sharding=allow_state_sharding,
                family=family,
                recompute=recompute,
                search_budget_s=search_budget_s,
            ).to_json()
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            box[0] = e
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise ValueError(f"planning failed on rank 0: {box[0]}") from box[0]
    if graph is None:
        graph = capture(model, args, kwargs)
    return Plan.from_json(box[0]), graph


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
