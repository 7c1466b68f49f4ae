"""``autopar.compile``: a plan turned into an ordinary ``nn.Module`` on each rank.

    sharded = autopar.compile(model, mesh, example_inputs=(ids,))   # inside a process group
    loss = sharded(ids, labels=labels)          # default: the same global batch on every rank
    loss.backward(); opt.step()                 # any torch optimizer over sharded.parameters()

The module holds this rank's shards as ``nn.Parameter``s under the original
names (``named_parameters()`` yields ``transformer.h.0.attn.c_attn.weight`` etc.),
runs the captured graph on local tensors (``executor.ShardedInterpreter``) and
returns full tensors: the loss as planned (the plan makes it replicated), other
outputs gathered (outside the plan's collective list, which covers the training
step).

Input modes: ``input_mode="global"`` (default) — every rank passes the same global
batch and keeps its planned piece; ``input_mode="local"`` — each rank passes only
its own piece (e.g. its data-parallel slice from a DistributedSampler), which must
have the local shape the plan gives it (``sharded.local_input_shapes``).

Where the shards come from: ``model`` with real weights on every rank (each keeps
its piece); a meta-device ``model`` plus a full ``state_dict``; or
``weights_from_rank0=True``, where rank 0 alone holds real weights and sends each
parameter to the others.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .capture import OpGraph, capture
from .executor import ExecutionPlan, ShardedInterpreter
from .layout import shard_tensor
from .mesh import Mesh
from .placement import Replicate
from .plan_types import Plan
from .spec import TensorMeta, local_shape

__all__ = ["compile", "ShardedModule"]

log = logging.getLogger(__name__)


def _default_profile(groups) -> str:
    dev = getattr(groups, "device", torch.device("cpu"))
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    return "h100" if "h100" in name or "h200" in name else "a100"


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, value)


class ShardedModule(nn.Module):
    """One rank's part of a compiled model (see the module docstring)."""

    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        groups,
        *,
        input_mode: str,
        full_params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        seed: int,
        arg_names: list[str],
        state_keys: list[str],
    ) -> None:
        super().__init__()
        if input_mode not in ("global", "local"):
            raise ValueError(f"input_mode {input_mode!r}: expected 'global' (same batch everywhere) or 'local'")
        self.plan = plan
        self.mesh = plan.mesh
        self.input_mode = input_mode
        self._graph = graph
        self._xplan = ExecutionPlan.from_plan(graph, plan)
        self._groups = groups
        self.collective_counter = None  # set a runtime.CollectiveCounter to record every collective issued
        self.trace = None  # set a dict to record each op's local outputs (op node name -> tensors)
        self._seed = seed
        self._step = 0
        self._arg_names = arg_names
        coord = tuple(groups.coordinate)
        self._coord = coord
        self._param_node: dict[str, str] = {}
        for node in graph.params():
            placement = self._xplan.sources[node.name][0]
            full = full_params[node.fqn]
            local = shard_tensor(full.detach(), placement, self.mesh.shape, coord).clone().to(groups.device)
            _set_param(self, node.fqn, nn.Parameter(local, requires_grad=full.requires_grad))
            self._param_node[node.fqn] = node.name
        self._buffers_full = {k: v.to(groups.device) for k, v in buffers.items()}
        self._state_keys = list(state_keys)
        self.local_input_shapes = {
            n.fqn: local_shape(n.outputs[0].shape, self._xplan.sources[n.name][0], self.mesh.shape, coord)
            for n in graph.nodes
            if n.kind == "input"
        }

    # ---- running ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        values = self._source_values(args, kwargs)
        interp = ShardedInterpreter(
            self._xplan,
            self._groups,
            self.collective_counter,
            seed=self._seed,
            step=self._step,
            source_values=values,
            trace=self.trace,
        )
        self._step += 1
        outs = interp.run(*[None] * len([n for n in self._graph.gm.graph.nodes if n.op == "placeholder"]))
        return self._gather_outputs(outs)

    def _source_values(self, args, kwargs) -> dict[str, torch.Tensor]:
        given = dict(zip(self._arg_names, args))
        given.update(kwargs)
        values: dict[str, torch.Tensor] = {}
        params = dict(self.named_parameters())
        for n in self._graph.nodes:
            if n.kind == "param":
                values[n.name] = params[n.fqn]
            elif n.kind == "buffer":
                full = self._buffers_full[n.fqn]
                values[n.name] = shard_tensor(full, self._xplan.sources[n.name][0], self.mesh.shape, self._coord)
            elif n.kind == "input":
                if n.fqn not in given:
                    raise ValueError(
                        f"input {n.fqn!r} missing: the model was compiled with inputs "
                        f"{[m.fqn for m in self._graph.nodes if m.kind == 'input']}"
                    )
                values[n.name] = self._local_input(n, given[n.fqn])
        return values

    def _local_input(self, node, value: torch.Tensor) -> torch.Tensor:
        placement = self._xplan.sources[node.name][0]
        value = value.to(self._groups.device)
        if self.input_mode == "local":
            expected = self.local_input_shapes[node.fqn]
            if tuple(value.shape) != tuple(expected):
                raise ValueError(
                    f"input {node.fqn!r}: local shape {tuple(value.shape)} but this rank's piece under "
                    f"{','.join(map(str, placement))} is {tuple(expected)} (global "
                    f"{node.outputs[0].shape}); pass each rank's own slice, or use input_mode='global'"
                )
            return value
        if tuple(value.shape) != tuple(node.outputs[0].shape):
            raise ValueError(
                f"input {node.fqn!r}: shape {tuple(value.shape)} but the model was compiled for "
                f"{node.outputs[0].shape}; compile again with example inputs of the new shape"
            )
        return shard_tensor(value, placement, self.mesh.shape, self._coord)

    def _gather_outputs(self, outs):
        from .runtime.redistribute import redistribute

        flat, spec = torch.utils._pytree.tree_flatten(outs)
        refs = self._graph.outputs
        full = tuple(Replicate() for _ in self.mesh.shape)
        result = []
        for k, (value, (node_idx, out_idx)) in enumerate(zip(flat, refs)):
            node = self._graph.nodes[node_idx]
            src = self._xplan.output_placement(node.name, out_idx)
            if src != full:
                counter = self.collective_counter if k == self._graph.loss_output else None
                value = redistribute(
                    value,
                    node.outputs[out_idx],
                    src,
                    full,
                    full,
                    self._xplan.grad_target(node.name, out_idx),
                    self._groups,
                    counter,
                )
            result.append(value)
        return torch.utils._pytree.tree_unflatten(result, spec) if len(result) > 1 else result[0]

    # ---- full views -------------------------------------------------------------------
    def _full(self, local: torch.Tensor, fqn: str) -> torch.Tensor:
        from .runtime.redistribute import redistribute_local

        node = self._graph.nodes[next(n.index for n in self._graph.params() if n.fqn == fqn)]
        placement = self._xplan.sources[node.name][0]
        meta = TensorMeta(node.outputs[0].shape, local.dtype)
        full = tuple(Replicate() for _ in self.mesh.shape)
        return redistribute_local(local.detach(), meta, placement, full, self._groups)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{original FQN: full tensor}, tied aliases and buffers included (like model.state_dict())."""
        out = {fqn: self._full(p, fqn) for fqn, p in self.named_parameters()}
        for alias, canon in self._graph.tied.items():
            out[alias] = out[canon]
        out.update({k: v.clone() for k, v in self._buffers_full.items()})
        return {k: out[k] for k in self._state_keys}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """{original FQN: full gradient} (None where no gradient was computed)."""
        return {fqn: None if p.grad is None else self._full(p.grad, fqn) for fqn, p in self.named_parameters()}


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
) -> ShardedModule:
    """Plan (or load ``plan``) and build this rank's ``ShardedModule``.

    Must be called on every rank inside an initialized default process group whose
    world size equals ``mesh.size``.  ``example_inputs=None`` is not supported yet:
    pass the inputs of the shapes you will train with.  ``family`` forces the
    search into one family (``"data parallel"``, ``"sharded parameters"``,
    ``"tensor parallel"``).
    """
    from .runtime.groups import MeshGroups

    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh {mesh!r}: expected an autopar.Mesh")
    groups = MeshGroups(mesh)
    if example_inputs is None and example_kwargs is None:
        raise ValueError(
            "autopar.compile needs example_inputs (and/or example_kwargs) with the shapes you will "
            "train with; lazy compilation on the first call is not implemented yet"
        )
    args = (
        tuple(example_inputs)
        if isinstance(example_inputs, (tuple, list))
        else (() if example_inputs is None else (example_inputs,))
    )
    kwargs = dict(example_kwargs or {})
    full_params = _full_parameters(model, state_dict, weights_from_rank0)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    if plan is None:
        plan_obj, graph = _plan_on_rank0(model, mesh, args, kwargs, groups, mem_cap=mem_cap, profile=profile,
                                         family=family)
    else:
        plan_obj = plan if isinstance(plan, Plan) else Plan.from_json(plan)
        if tuple(plan_obj.mesh.shape) != tuple(mesh.shape):
            raise ValueError(f"the plan is for mesh {plan_obj.mesh} but compile got {mesh}; pass the plan's mesh")
        graph = capture(model, args, kwargs)
    arg_names = _arg_names(model, len(args))
    return ShardedModule(
        graph,
        plan_obj,
        groups,
        input_mode=input_mode,
        full_params=full_params,
        buffers=buffers,
        seed=seed,
        arg_names=arg_names,
        state_keys=list(model.state_dict().keys()),
    )


def _plan_on_rank0(model, mesh, args, kwargs, groups, *, mem_cap, profile, family) -> tuple[Plan, OpGraph]:
    """Rank 0 searches, every rank gets its plan (broadcast as JSON) and captures the graph itself.

    One search instead of one per rank, and every rank runs the very same plan.
    The others only trace the model (cheap) to execute it.
    """
    from .planner import plan_from_context, prepare

    box: list = [None]
    graph = None
    if dist.get_rank() == 0:
        try:
            ctx = prepare(model, mesh, example_inputs=args, example_kwargs=kwargs,
                          profile=profile or _default_profile(groups), dtype="fp32")
            graph = ctx.graph
            box[0] = plan_from_context(ctx, mem_cap=mem_cap, compare_families=False, allow_state_sharding=False,
                                       family=family).to_json()
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


def _arg_names(model: nn.Module, n: int) -> list[str]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return params[:n]


def _full_parameters(model: nn.Module, state_dict, weights_from_rank0: bool) -> dict[str, Any]:
    params = dict(model.named_parameters())
    if state_dict is not None:
        missing = [k for k in params if k not in state_dict]
        if missing:
            raise ValueError(
                f"state_dict lacks {len(missing)} parameters (first: {missing[:3]}); "
                "pass model.state_dict() of the full model"
            )
        return {k: state_dict[k].detach().requires_grad_(p.requires_grad) for k, p in params.items()}
    if any(p.is_meta for p in params.values()) and not weights_from_rank0:
        raise ValueError(
            "the model is on the meta device: pass state_dict= with the full weights, or "
            "weights_from_rank0=True with real weights on rank 0"
        )
    if weights_from_rank0:
        out = {}
        for k, p in params.items():
            t = p.detach().clone() if dist.get_rank() == 0 else torch.empty(p.shape, dtype=p.dtype)
            dist.broadcast(t, src=0)
            out[k] = t.requires_grad_(p.requires_grad)
        return out
    return params
