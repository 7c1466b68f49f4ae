"""Execution of a plan on one rank: the captured graph run on local shards.

``ShardedInterpreter`` is an ``fx.Interpreter`` over the captured (decomposed)
graph module.  Every value in its environment is this rank's *local* piece of the
global tensor the node computes, in the placement the plan gave that node.  For
each op it:

1. redistributes every tensor input from its producer's placement to the one the
   op's strategy reads (``runtime.Redistribute``: the forward collectives of the
   edge, and in backward the gradient's, exactly the plan's ``transitions``);
2. rewrites size arguments (view/reshape/expand/split ...) from global to local
   shapes (``strategies.views.localize_size_args``);
3. runs the aten op, or the strategy's local kernel (``kernels.KERNELS``), on the
   local tensors.  A parameter that was all-gathered for the op is not kept for
   backward: the op saves a handle and backward gathers it again (FSDP), as the
   plan prices it.

Randomness (dropout): the RNG is re-seeded per op from (seed, step, node, this
rank's coordinates on the axes where the op's output is *sharded*), so ranks
that hold the same (replicated) values draw the same mask and ranks holding
different shards draw their own parts — Megatron's and Paddle's local/global
seed policy.
"""

from __future__ import annotations

import contextlib
import operator
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .capture import OpGraph
from .kernels import KERNELS, KernelContext
from .placement import Placement, Replicate, Shard, parse_placements
from .spec import local_shape
from .strategies.views import localize_size_args
from .transitions import consumer_grad_placement, producer_grad_placement

__all__ = ["ExecutionPlan", "ShardedInterpreter", "SavedBytes", "RANDOM_OPS"]

aten = torch.ops.aten
RANDOM_OPS = {
    aten.dropout.default,
    aten.native_dropout.default,
    aten.scaled_dot_product_attention.default,
    aten.bernoulli.p,
    aten.rand_like.default,
    aten.randn_like.default,
}


@dataclass
class NodeExec:
    """What one op node needs at run time (placements parsed from the plan)."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    kernels: tuple[str | None, ...]
    split: tuple[bool, ...]


@dataclass
class ExecutionPlan:
    """The plan resolved against one captured graph: placements of every value by fx node name."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    nodes: dict[str, NodeExec]
    sources: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]]  # fx name -> (placement, grad target)

    @classmethod
    def from_plan(cls, graph: OpGraph, plan) -> ExecutionPlan:
        mesh_shape = tuple(plan.mesh.shape)
        nodes: dict[str, NodeExec] = {}
        missing = []
        for n in graph.nodes:
            if n.kind != "op":
                continue
            entry = plan.nodes.get(n.name)
            if entry is None or entry["op"] != str(n.target):
                missing.append(f"{n.name} ({n.target})")
                continue
            ins = tuple(parse_placements(p) for p in entry["inputs"])
            outs = tuple(parse_placements(p) for p in entry["outputs"])
            split = tuple(any(not isinstance(p[a], Replicate) for p in ins + outs) for a in range(len(mesh_shape)))
            nodes[n.name] = NodeExec(ins, outs, tuple(entry["kernels"]), split)
        if missing:
            raise ValueError(
                f"the plan does not match the model {graph.model_name}: {len(missing)} graph nodes are not in it "
                f"(first: {', '.join(missing[:3])}); re-plan this model with the same example input shapes"
            )
        sources = {}
        for n in graph.nodes:
            if n.kind == "param":
                if n.fqn not in plan.params:
                    raise ValueError(f"the plan has no placement for parameter {n.fqn}; re-plan this model")
                p = plan.params[n.fqn]
                # (placement, state placement): gradients go to the state (ZeRO-1/2 when they differ)
                sources[n.name] = (parse_placements(p["placements"]), parse_placements(p["state_placements"]))
            elif n.kind in ("input", "buffer"):
                pl = parse_placements(plan.inputs[n.fqn or n.name]["placements"])
                sources[n.name] = (pl, tuple(producer_grad_placement(p) for p in pl))
        return cls(graph, mesh_shape, nodes, sources)

    def output_placement(self, name: str, index: int) -> tuple[Placement, ...]:
        if name in self.nodes:
            return self.nodes[name].outputs[index]
        return self.sources[name][0]

    def grad_target(self, name: str, index: int) -> tuple[Placement, ...]:
        if name in self.nodes:
            return tuple(producer_grad_placement(p) for p in self.nodes[name].outputs[index])
        return self.sources[name][1]


class SavedBytes:
    """What one forward packed for backward, measured by the executor's saved-tensor hook.

    ``add`` is called with every tensor an op saves for backward.  Parameters (a
    rank's local shards, the all-gathered copies the executor makes and views of
    either) are model state, not activations, and are not counted.  Every other
    saved tensor counts once per *storage*, at the storage's size: a saved view
    keeps its whole base alive, and two ops saving the same tensor (or views of
    one) hold one copy, as autograd does.  Only sizes are kept, never the tensors.
    ``by_op`` (storage bytes first recorded by each op node) helps find where a
    prediction is off.
    """

    def __init__(self, params) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._params = {StorageWeakRef(p.untyped_storage()) for p in params}
        self._gathered: list = []
        self._storages: dict = {}
        self.by_op: dict[str, int] = {}

    def add_parameter(self, t: torch.Tensor) -> None:
        """Mark ``t`` (a parameter's copy made by a transition) as model state for the rest of the forward."""
        self._gathered.append(self._ref(t.untyped_storage()))

    def add(self, t: torch.Tensor, op: str = "") -> None:
        ref = self._ref(t.untyped_storage())
        if ref in self._params or ref in self._storages or any(g == ref and not g.expired() for g in self._gathered):
            return
        self._storages[ref] = t.untyped_storage().nbytes()
        self.by_op[op] = self.by_op.get(op, 0) + self._storages[ref]

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages saved (parameters excluded)."""
        return sum(self._storages.values())


@contextlib.contextmanager
def _regather_saved(gathered: list, groups, counter, record: SavedBytes | None = None, op: str = ""):
    """FSDP: an op that saves an all-gathered parameter keeps only a handle; backward gathers it again.

    ``gathered`` lists (full tensor, (local shard, meta, src, dst)).  A saved tensor
    that shares storage with a gathered parameter is packed as the recipe to
    rebuild it (the shard and the view's size/stride/offset); unpacking issues the
    plan's backward all-gather.  Every other saved tensor is kept as is and, when
    ``record`` is given, measured there (``SavedBytes``).  With nothing gathered and
    no record this is a no-op.
    """
    if not gathered and record is None:
        yield
        return
    from .runtime.redistribute import redistribute_local

    def pack(t: torch.Tensor):
        for full, recipe in gathered:
            if t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                return ("regather", recipe, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)
        if record is not None:
            record.add(t, op)
        return t

    def unpack(packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "regather"):
            return packed
        _, (local, meta, src, dst), size, stride, offset, _ = packed
        full = redistribute_local(local.detach(), meta, src, dst, groups, phase="backward", counter=counter)
        return full.as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class ShardedInterpreter(fx.Interpreter):
    """Runs the captured graph on this rank's local tensors (see the module docstring)."""

    def __init__(
        self,
        xplan: ExecutionPlan,
        groups,
        counter=None,
        *,
        seed: int = 0,
        step: int = 0,
        source_values: dict[str, torch.Tensor] | None = None,
        trace: dict[str, list[torch.Tensor]] | None = None,
        saved: SavedBytes | None = None,
        state_shards: dict[str, torch.Tensor] | None = None,
        buckets=None,
    ) -> None:
        super().__init__(xplan.graph.gm, garbage_collect_values=True)
        self.xplan = xplan
        self.groups = groups
        self.counter = counter
        self.seed = seed
        self.step = step
        self.source_values = source_values or {}
        self.trace = trace  # when a dict: op node name -> this rank's local outputs (for tests and debugging)
        self.saved = saved  # when given: the bytes ops save for backward are measured there
        # ZeRO-1/2: param node name -> its state shard (its source value is the buffer; runtime/zero.py)
        self.state_shards = state_shards or {}
        self.buckets = buckets  # runtime.buckets.GradBuckets: data-parallel gradients reduced in buckets, or None
        self.coordinate = tuple(groups.coordinate)
        self.by_fx = {n.fx_node: n for n in xplan.graph.nodes if n.fx_node is not None}
        for fxn in self.module.graph.nodes:
            if fxn.op == "placeholder" and fxn.name in xplan.graph.placeholder_alias:
                self.by_fx[fxn] = xplan.graph.nodes[xplan.graph.placeholder_alias[fxn.name]]
        # value provenance: fx node -> (planning node name, output index) for placements
        self._origin: dict[fx.Node, tuple[str, int]] = {}

    # ---- sources ------------------------------------------------------------------------
    def placeholder(self, target, args, kwargs):
        node = self._current
        opnode = self.by_fx.get(node)
        if opnode is None:  # an unused alias placeholder of a tied parameter
            return None
        self._origin[node] = (opnode.name, 0)
        return self.source_values[opnode.name]

    def run_node(self, n: fx.Node) -> Any:
        self._current = n
        if n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if src in self._origin:
                self._origin[n] = (self._origin[src][0], int(n.args[1]))
        return super().run_node(n)

    # ---- ops ----------------------------------------------------------------------------
    def call_function(self, target, args, kwargs):
        node = self._current
        opnode = self.by_fx.get(node)
        if opnode is None or opnode.kind != "op":
            return super().call_function(target, args, kwargs)
        ex = self.xplan.nodes[opnode.name]
        from .runtime.redistribute import redistribute
        from .runtime.zero import from_state_shard

        flat, spec = pytree.tree_flatten((args, kwargs))
        fx_flat = pytree.tree_flatten((node.args, node.kwargs))[0]
        pos = 0
        new_flat = []
        regather: list[tuple[torch.Tensor, tuple]] = []
        for value, fx_arg in zip(flat, fx_flat):
            if isinstance(fx_arg, fx.Node) and isinstance(fx_arg.meta.get("val"), torch.Tensor):
                src_node, out_idx = opnode.inputs[pos]
                producer = self.xplan.graph.nodes[src_node]
                src = self.xplan.output_placement(producer.name, out_idx)
                dst = ex.inputs[pos]
                grad_src = tuple(consumer_grad_placement(p, s) for p, s in zip(dst, ex.split))
                grad_dst = self.xplan.grad_target(producer.name, out_idx)
                meta = producer.outputs[out_idx]
                if self.buckets is not None and self.buckets.defers(producer.name):
                    self.buckets.note(producer.name, meta, grad_src, grad_dst)  # reduced in a bucket instead
                    grad_dst = grad_src
                shard = self.state_shards.get(producer.name)
                if shard is not None or src != dst or grad_src != grad_dst:
                    local = value
                    if shard is None:
                        value = redistribute(value, meta, src, dst, grad_src, grad_dst, self.groups, self.counter)
                    else:  # read the ZeRO buffer; the gradient goes to the state shard
                        value = from_state_shard(
                            shard, value, meta, src, dst, grad_src, grad_dst, self.groups, self.counter
                        )
                    if producer.kind == "param" and src != dst:
                        regather.append((value, (local, meta.with_shape(meta.shape), src, dst)))
                    if producer.kind == "param" and self.saved is not None:
                        self.saved.add_parameter(value)  # a moved copy of a parameter is model state too
                pos += 1
            new_flat.append(value)
        args, kwargs = pytree.tree_unflatten(new_flat, spec)
        shapes = [
            local_shape(m.shape, p, self.xplan.mesh_shape, self.coordinate) for m, p in zip(opnode.outputs, ex.outputs)
        ]
        args, kwargs = localize_size_args(target, tuple(args), dict(kwargs), shapes)
        kernel = {k for k in ex.kernels if k}
        with _regather_saved(regather, self.groups, self.counter, self.saved, opnode.name):
            if target in RANDOM_OPS:
                with torch.random.fork_rng(devices=self._rng_devices()):
                    torch.manual_seed(self._op_seed(opnode.index, ex))
                    out = self._call(target, args, kwargs, kernel, ex, opnode)
            else:
                out = self._call(target, args, kwargs, kernel, ex, opnode)
        if self.trace is not None:
            self.trace[opnode.name] = [
                t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            ]
        return out

    def _call(self, target, args, kwargs, kernel, ex: NodeExec, opnode):
        if not kernel:
            return target(*args, **kwargs)
        if len(kernel) > 1:
            raise ValueError(
                f"node {opnode.describe()}: strategies name several kernels {sorted(kernel)} on "
                "different axes; choose a plan with one kernel per op"
            )
        name = kernel.pop()
        ctx = KernelContext(
            self.xplan.mesh_shape,
            self.coordinate,
            ex.inputs,
            opnode.call.inputs,
            tuple(a for a, k in enumerate(ex.kernels) if k == name),
        )
        return KERNELS[name](ctx, *args, **kwargs)

    def _op_seed(self, index: int, ex: NodeExec) -> int:
        sharded_axes = [
            a for a in range(len(self.xplan.mesh_shape)) if any(isinstance(p[a], Shard) for p in ex.outputs)
        ]
        key = (self.seed, self.step, index, tuple(self.coordinate[a] for a in sharded_axes))
        return zlib.crc32(repr(key).encode()) & 0x7FFFFFFF

    def _rng_devices(self) -> list:
        dev = getattr(self.groups, "device", torch.device("cpu"))
        return [dev] if dev.type == "cuda" else []
