"""Execution of a plan on one rank: the captured graph lowered to local ops and moves.

``lower(xplan, groups, state)`` rewrites the captured (decomposed) graph module,
once per rank, into an ``fx.GraphModule`` over this rank's *local* pieces: every
value is the local piece of the global tensor its node computes, in the
placement the plan gave that node, and every decision the plan fixes is made
while lowering, not per call:

1. each tensor input that changes placement (forward or gradient) goes through a
   ``MoveStep``: a precomputed ``runtime.redistribute.Move`` (global meta, ``src ->
   dst``, the gradient's ``grad_src -> grad_dst``), i.e. exactly the plan's
   ``transitions`` for the edge in forward and backward; a ZeRO parameter is read
   through ``zero.from_state_shard``, and an edge whose gradient goes to a
   data-parallel bucket keeps it unreduced (``runtime/buckets.py``).  Identity
   edges (the same placement, and the same gradient placement or no gradient)
   are plain data flow;
2. size arguments (view/reshape/expand/split ...) are already local
   (``strategies.views.localize_size_args``: local shapes are static per rank);
3. the op is the aten op itself, or an ``OpStep`` around the strategy's local
   kernel (``kernels.KERNELS``, bound to its ``KernelContext``), a random op, or an
   op reading an all-gathered parameter: that parameter is not kept for backward,
   the op saves a handle and backward gathers it again (FSDP), as the plan prices;
4. graph outputs are moved to full tensors, and the program returns one value
   per leaf of the model's output tree (``OpGraph.call``; constants included);
   only the loss's move is counted (the plan's list covers the training step,
   not gathering e.g. the logits);
5. the loss's last collective and the affine ops after it become one
   ``runtime.deferred.DeferredLossStep``: forward starts the collective and
   returns a pending loss, read (waited for) on first use; backward never waits
   for it (not in the instrumented variant).
6. a decomposed cross-entropy (``decompose.py``) whose logit pieces the plan
   keeps on whole rows (no class-dim shard, nothing partial, no move between
   them) runs as one fused log-softmax (``fused_loss.py`` has the rule): same value,
   gradients and moves, half the (N, C) tensors kept for backward.  The
   instrumented variant fuses it too, so ``SavedBytes`` measures what the fast
   program keeps, and records the unfused nodes' values beside it (``trace``).

The result prints as plain Python (``gm.code``: aten calls and the inserted
steps); ``ShardedModule.local_graph`` exposes it.  ``lower(..., instrument=True)``
wraps *every* op in an ``OpStep`` that also records each op's local outputs
(``state.trace``) and the bytes it saves for backward (``SavedBytes``); the
compiled module builds that variant only when one of them is asked for, so the
fast graph pays nothing.  The plan resolved per node and the state the steps read
per call are in ``program.py``; the steps themselves (moves, random ops, eval
forms) in ``steps.py``.

Buffers the forward writes (batch norm's running statistics and counter): the op
gets this rank's persistent piece of the buffer itself, so the update stays for
the next call and ``full_state_dict``; a plan that would hand it a moved copy is
refused (``_check_buffer_writes``), never a silently dropped update.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.placement import Replicate, Shard
from autopar.runtime import Move, defer_loss_tail
from autopar.spec import local_shape
from autopar.strategies import KERNELS, KernelContext, localize_size_args

from .fused_loss import emit_fused_loss, fusable_groups
from .program import ExecutionPlan, NodeExec, RunState
from .recompute import outline_regions
from .steps import EVAL_FORMS, MoveStep, OpOptions, OpStep, TraceDecomposed

__all__ = ["lower", "RANDOM_OPS", "VALUE_KEY"]

#: ``node.meta`` key of a lowered node standing for a captured value: the captured fx node's name.
VALUE_KEY = "autopar_value"

aten = torch.ops.aten
RANDOM_OPS = {
    aten.dropout.default,
    aten.native_dropout.default,
    aten.scaled_dot_product_attention.default,
    aten.bernoulli.p,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.feature_dropout.default,
    aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
}
# composite ops whose schema does not mark the arguments they update in place (in training)
_UNDECLARED_WRITES = {
    aten.batch_norm.default: ("running_mean", "running_var"),
    aten.native_batch_norm.default: ("running_mean", "running_var"),
    aten.instance_norm.default: ("running_mean", "running_var"),
}


def _argument(fxn: fx.Node, name: str):
    """The value ``fxn`` passes for its schema argument ``name`` (positional or keyword; None if absent)."""
    if name in fxn.kwargs:
        return fxn.kwargs[name]
    names = [a.name for a in fxn.target._schema.arguments]
    at = names.index(name) if name in names else len(fxn.args)
    return fxn.args[at] if at < len(fxn.args) else None


def _has_eval_form(fxn: fx.Node) -> bool:
    """Whether eval mode changes ``fxn``: an ``EVAL_FORMS`` op (a norm only when it keeps running statistics)."""
    if fxn.target not in EVAL_FORMS:
        return False
    names = {a.name for a in fxn.target._schema.arguments}
    return "running_mean" not in names or _argument(fxn, "running_mean") is not None


def written_arguments(target) -> set[str]:
    """Names of the arguments ``target`` writes in place: its schema's ``(a!)`` ones and ``_UNDECLARED_WRITES``."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return set()
    marked = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return marked | set(_UNDECLARED_WRITES.get(target, ()))


def _written_buffers(fxn: fx.Node, by_fx: dict) -> list[tuple[int, Any]]:
    """(tensor input position, buffer OpNode) of each model buffer ``fxn`` writes in place."""
    names = written_arguments(fxn.target)
    if not names:
        return []
    written = {a for n in names for a in pytree.tree_leaves(_argument(fxn, n)) if isinstance(a, fx.Node)}
    out = []
    for pos, a in enumerate(_tensor_args(fxn)):
        node = by_fx.get(a)
        if a in written and node is not None and node.kind == "buffer":
            out.append((pos, node))
    return out


def _check_buffer_writes(xplan: ExecutionPlan, opnode, ex: NodeExec, writes: list) -> None:
    """An op that writes a buffer must get the buffer's persistent piece: no move on that edge."""
    for pos, buf in writes:
        src = xplan.output_placement(buf.name, 0)
        if src != ex.inputs[pos]:
            raise ValueError(
                f"node {opnode.name} ({opnode.target}) updates buffer {buf.fqn} in place (running statistics), "
                f"but the plan's strategy for it reads the buffer at {ex.inputs[pos]} while the buffer is kept at "
                f"{src}: the update would land in a moved copy and be lost. Fix: hint the module "
                f"{opnode.module or '(the op)'} 'replicate', or use a plan whose strategy reads the buffer at {src}"
            )


def _moves_nothing(producer, src, dst, grad_src, grad_dst) -> bool:
    """An edge with nothing to run: the same placement forward and, where a gradient flows, backward."""
    no_grad = producer.kind in ("op", "buffer") and not producer.requires_grad  # its gradient never flows
    return src == dst and (grad_src == grad_dst or no_grad)


def _tensor_args(fxn: fx.Node) -> list[fx.Node]:
    """``fxn``'s tensor arguments in the order of its ``OpNode.inputs`` (flattened args, then kwargs)."""
    flat, _ = pytree.tree_flatten((fxn.args, fxn.kwargs))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _kernel(xplan: ExecutionPlan, opnode, ex: NodeExec, coordinate: tuple[int, ...]):
    """The op's local callable: its aten target, or the one kernel its strategies name, bound to its context."""
    names = {k for k in ex.kernels if k}
    if not names:
        return opnode.target
    if len(names) > 1:
        raise ValueError(
            f"node {opnode.describe()}: strategies name several kernels {sorted(names)} on "
            "different axes; choose a plan with one kernel per op"
        )
    (name,) = names
    axes = tuple(a for a, k in enumerate(ex.kernels) if k == name)
    ctx = KernelContext(xplan.mesh_shape, coordinate, ex.inputs, opnode.call.inputs, axes)
    return functools.partial(KERNELS[name], ctx)


def _seed_key(seed: int, opnode, ex: NodeExec, coordinate: tuple[int, ...]):
    sharded = [a for a in range(len(coordinate)) if any(isinstance(p[a], Shard) for p in ex.outputs)]
    return (seed, opnode.index, tuple(coordinate[a] for a in sharded))


def lower(
    xplan: ExecutionPlan,
    groups,
    state: RunState,
    *,
    seed: int = 0,
    state_shards: dict[str, torch.Tensor] | None = None,
    buckets=None,
    instrument: bool = False,
    defer_loss: bool = True,
) -> fx.GraphModule:
    """This rank's local program for ``xplan`` (see the module docstring).

    The module takes one positional argument per source node of ``xplan.graph``
    (parameters, buffers, inputs; ``kind != "op"``), in graph order, each this
    rank's piece under its planned placement, and returns the model's outputs
    (full tensors; the loss as planned).  ``state_shards``: ZeRO param node name ->
    its state shard (its argument is the buffer; ``runtime/zero.py``).
    ``buckets``: a ``runtime.buckets.GradBuckets`` whose parameters' edges hand
    their gradients to it unreduced (noted in it).  ``defer_loss=False`` keeps the
    loss's last collective a plain move (a pipeline's last stage hands the loss to
    its schedule).  Raises ValueError for a node whose strategies name several kernels.

    Every node that stands for a value of the captured graph carries that value's
    captured fx node name as ``meta[VALUE_KEY]`` (also the getitems standing for a
    recompute region's outputs), so a pass over the program
    (``stage_programs.split_program``) knows what each value is.
    """
    lowering = _Lowering(
        xplan, groups, state, seed=seed, state_shards=state_shards or {}, buckets=buckets, instrument=instrument
    )
    lowering.defer = defer_loss
    return lowering.run()


def _by_fx(graph) -> dict:
    """Captured fx node -> its ``OpNode``; a tied parameter's alias placeholder -> the parameter it aliases."""
    by_fx = {n.fx_node: n for n in graph.nodes if n.fx_node is not None}
    for fxn in graph.gm.graph.nodes:
        if fxn.op == "placeholder" and fxn.name in graph.placeholder_alias:
            by_fx[fxn] = graph.nodes[graph.placeholder_alias[fxn.name]]
    return by_fx


class _Lowering:
    """One run of ``lower``: the captured graph rewritten node by node into the local graph ``g``.

    State, filled in graph order: ``sources`` (source node name -> its placeholder,
    or the step that sums its uses' partial gradients first), ``env`` (captured fx
    node -> the lowered value standing for it), ``fused`` (member fx node -> its
    fused cross-entropy; ``fused_inputs``: (member, position) -> the value its edge
    from outside the group delivers), ``region_of`` (captured fx node -> its
    recompute region) and ``regions`` (region -> its lowered nodes, in order).
    """

    def __init__(
        self,
        xplan: ExecutionPlan,
        groups,
        state: RunState,
        *,
        seed: int,
        state_shards: dict[str, torch.Tensor],
        buckets,
        instrument: bool,
    ) -> None:
        self.xplan, self.groups, self.state, self.graph = xplan, groups, state, xplan.graph
        self.seed, self.state_shards, self.buckets, self.instrument = seed, state_shards, buckets, instrument
        self.defer = True  # defer the loss's last collective (``lower(defer_loss=)``)
        self.coord = tuple(groups.coordinate)
        self.dev = getattr(groups, "device", torch.device("cpu"))
        self.rng_devices = (self.dev,) if self.dev.type == "cuda" else ()
        self.by_fx = _by_fx(self.graph)
        self.g = fx.Graph()
        self.sources = self._sources()
        self.env: dict[fx.Node, Any] = {}
        self.fused = fusable_groups(xplan, self.by_fx, self._identity_edge)
        self.fused_inputs: dict[tuple[str, int], fx.Node] = {}
        self.region_of: dict[fx.Node, str | None] = {}
        self.regions: dict[str, list[fx.Node]] = {}

    def run(self) -> fx.GraphModule:
        """Lower every node, then the outputs; outline the recompute regions and defer the loss's tail."""
        for fxn in self.graph.gm.graph.nodes:
            self._lower_in_region(fxn)
        out_fx = next(n for n in self.graph.gm.graph.nodes if n.op == "output")
        output = self.g.output(tuple(self._outputs(out_fx)))
        # after the outputs: a region whose values the model returns (the head's logits) hands them out
        outline_regions(self.g, self.regions, self.graph.gm, self.state)
        self._defer_loss(list(output.args[0]))
        return fx.GraphModule(self.graph.gm, self.g, class_name="LocalProgram")

    def _sources(self) -> dict[str, fx.Node]:
        """One placeholder per source node, in graph order; a parameter whose uses' partial gradients are summed
        first reads through the step that sums them (or the data-parallel bucket that reduces the sum)."""
        graph, g = self.graph, self.g
        sources = {n.name: g.placeholder(n.name) for n in graph.nodes if n.kind != "op"}
        by_name = {n.name: n for n in graph.nodes}
        for name, acc in self.xplan.accumulate.items():
            node = by_name[name]
            placement, grad_state = self.xplan.sources[name]
            if self.buckets is not None and name in self.buckets:  # the bucket reduces the sum (its source wrap)
                self.buckets.note(name, "accumulated", node.outputs[0], acc, grad_state)
                continue
            move = Move(node.outputs[0], placement, placement, acc, grad_state, self.groups)
            step = MoveStep(f"accumulate_{name}", self.state, move, shard=self.state_shards.get(name), param=True)
            sources[name] = g.call_function(step, (sources[name],))
        return sources

    def _lower_in_region(self, fxn: fx.Node) -> None:
        """Lower ``fxn`` and, when it is in a recompute region, note what it lowered to as that region's."""
        opnode = self.by_fx.get(fxn)
        ex = self.xplan.nodes.get(opnode.name) if opnode is not None else None
        if ex is not None:
            self.region_of[fxn] = ex.recompute
        elif fxn.op == "call_function":  # getitem of a multi-output op: in its producer's region
            inputs = {self.region_of.get(a) for a in fxn.all_input_nodes}
            self.region_of[fxn] = inputs.pop() if len(inputs) == 1 else None
        tail = self.g._root.prev  # what fxn lowers to is appended after the current last node
        self._lower_node(fxn, opnode)
        value = self.env.get(fxn)
        if isinstance(value, fx.Node) and VALUE_KEY not in value.meta:
            value.meta[VALUE_KEY] = fxn.name
        region = self.region_of.get(fxn)
        if region is not None:
            node = tail.next
            while node is not self.g._root:
                self.regions.setdefault(region, []).append(node)
                node = node.next

    def _lower_node(self, fxn: fx.Node, opnode) -> None:
        """Emit ``fxn``'s local program into ``g`` (``env[fxn]``: the value it makes)."""
        if fxn.op == "placeholder":
            self.env[fxn] = self.sources[opnode.name] if opnode is not None else None  # None: an unused tied alias
            return
        if fxn.op == "output":
            return
        if fxn.op != "call_function" or opnode is None or opnode.kind != "op":
            self.env[fxn] = self.g.node_copy(fxn, self.env.__getitem__)
            return
        ex = self.xplan.nodes[opnode.name]
        if fxn in self.fused:  # a fused cross-entropy (fused_loss.py): only the edges from outside it are lowered
            self._lower_fused(fxn, opnode, ex)
        else:
            self.env[fxn] = self._lower_op(fxn, opnode, ex)

    def _edge(self, opnode, ex: NodeExec, pos: int, value: fx.Node, regather: list):
        """The value input ``pos`` of ``opnode`` reads: ``value`` itself, or a ``MoveStep`` on it (a moved
        parameter's (moved, local) pair and move appended to ``regather``, for an FSDP re-gather)."""
        src_node, out_idx = opnode.inputs[pos]
        producer = self.graph.nodes[src_node]
        src, dst = self.xplan.output_placement(producer.name, out_idx), ex.inputs[pos]
        grad_src = ex.input_grad(pos)
        grad_dst = self.xplan.grad_target(producer.name, out_idx)
        meta = producer.outputs[out_idx]
        buckets = self.buckets
        if buckets is not None and producer.name in buckets and producer.name not in self.xplan.accumulate:
            buckets.note(producer.name, (opnode.name, pos), meta, grad_src, grad_dst)  # reduced in a bucket
            grad_dst = grad_src
        # a ZeRO parameter is read from its buffer on each edge, unless its summed gradient is moved once
        shard = self.state_shards.get(producer.name) if producer.name not in self.xplan.accumulate else None
        if shard is None and _moves_nothing(producer, src, dst, grad_src, grad_dst):
            return value
        param = producer.kind == "param"
        step = MoveStep(
            f"move_{opnode.name}_{pos}",
            self.state,
            Move(meta, src, dst, grad_src, grad_dst, self.groups),
            shard=shard,
            param=param,
        )
        moved = self.g.call_function(step, (value,))
        if param and src != dst:
            regather.append(((moved, value), step.move))
        return moved

    def _identity_edge(self, opnode, ex: NodeExec, pos: int) -> bool:
        """Whether ``_edge`` lowers input ``pos`` as plain data flow (no bucket or ZeRO read: fused inputs are
        no parameters)."""
        producer, out_idx = self.graph.nodes[opnode.inputs[pos][0]], opnode.inputs[pos][1]
        src = self.xplan.output_placement(producer.name, out_idx)
        grad_dst = self.xplan.grad_target(producer.name, out_idx)
        return _moves_nothing(producer, src, ex.inputs[pos], ex.input_grad(pos), grad_dst)

    def _fused_node(self, name: str, target, *args, measure: bool = True) -> fx.Node:
        """One node of a fused cross-entropy's program (an ``OpStep`` in the instrumented program)."""
        if self.instrument:  # measured and traced like every op of the instrumented program (in a region: traced only)
            step = OpStep(name, self.state, target, OpOptions(instrument=True, measure=measure))
            return self.g.create_node("call_function", step, args, name=name)
        return self.g.create_node("call_function", target, args, name=name)

    def _lower_fused(self, fxn: fx.Node, opnode, ex: NodeExec) -> None:
        """A member of a fused group: its edges from outside the group, and at the group's result the fused form."""
        group = self.fused[fxn]
        for pos, (src, _) in enumerate(opnode.inputs):
            producer_fx = self.graph.nodes[src].fx_node
            if producer_fx not in group.members.values():
                value = self.env[_tensor_args(fxn)[pos]]
                self.fused_inputs[(fxn.name, pos)] = self._edge(opnode, ex, pos, value, [])
        if fxn is group.result:
            x, index, valid = (self.fused_inputs[k] for k in group.inputs())
            if self.instrument:
                trace = TraceDecomposed(f"trace_{group.part.group}", self.state, group)
                self.g.call_function(trace, (x, index, valid))
            measure = self.region_of.get(fxn) is None  # in a recompute region the checkpoint keeps what is saved
            node = functools.partial(self._fused_node, measure=measure)
            self.env[fxn] = emit_fused_loss(group, x, index, valid, node)

    def _local_args(self, fxn: fx.Node, opnode, ex: NodeExec) -> tuple[tuple, dict, list]:
        """``fxn``'s arguments on this rank: each tensor through its edge, the device and the sizes made local;
        and the edges' FSDP re-gathers (none for a recomputed op)."""
        flat, spec = pytree.tree_flatten((fxn.args, fxn.kwargs))
        pos, new_flat, regather = 0, [], []
        for a in flat:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                a = self._edge(opnode, ex, pos, self.env[a], regather)
                pos += 1
            elif isinstance(a, fx.Node):
                a = self.env[a]
            new_flat.append(a)
        if ex.recompute is not None:  # a recomputed op keeps nothing: backward gathers its parameters anew anyway
            regather = []
        args, kwargs = pytree.tree_unflatten(new_flat, spec)
        dev = self.dev
        if dev.type != "cpu":  # capture traced on the CPU: a factory's device=cpu (arange, zeros, ...) is the rank's
            args, kwargs = pytree.tree_map(lambda v: dev if isinstance(v, torch.device) else v, (args, kwargs))
        mesh_shape, coord = self.xplan.mesh_shape, self.coord
        shapes = [local_shape(m.shape, p, mesh_shape, coord) for m, p in zip(opnode.outputs, ex.outputs)]
        args, kwargs = localize_size_args(fxn.target, tuple(args), dict(kwargs), shapes)
        return args, kwargs, regather

    def _lower_op(self, fxn: fx.Node, opnode, ex: NodeExec) -> fx.Node:
        """An op: its aten call on the local arguments, or an ``OpStep`` where it needs more (module docstring)."""
        args, kwargs, regather = self._local_args(fxn, opnode, ex)
        fn = _kernel(self.xplan, opnode, ex, self.coord)
        random = fxn.target in RANDOM_OPS
        writes = _written_buffers(fxn, self.by_fx)
        _check_buffer_writes(self.xplan, opnode, ex, writes)
        eval_form = _has_eval_form(fxn)
        # an op whose only effect is a buffer update (num_batches_tracked.add_(1)) does not run in eval; one whose
        # result is read (a cache-like update) runs in both modes
        skips = [pos for pos, _ in writes] == [0] and not fxn.users and fxn.target not in EVAL_FORMS
        if self.instrument or random or regather or fn is not fxn.target or eval_form or skips:
            options = OpOptions(
                regather=tuple(m for _, m in regather),
                seed_key=_seed_key(self.seed, opnode, ex, self.coord) if random else None,
                rng_devices=self.rng_devices,
                instrument=self.instrument,
                measure=self.region_of.get(fxn) is None,  # in a recompute region the checkpoint keeps what is saved
                eval_target=fxn.target if eval_form else None,
                eval_skips=skips,
            )
            fn = OpStep(opnode.name, self.state, fn, options)
            if regather:
                args = (tuple(pair for pair, _ in regather), *args)
        return self.g.create_node("call_function", fn, args, kwargs, name=fxn.name)

    def _outputs(self, out_fx: fx.Node) -> list:
        """One value per leaf of the model's output tree (``OpGraph.call.outputs``): tensors gathered to full,
        constants as they are.  Only the loss's move is counted (the plan's list covers the step)."""
        xplan, graph = self.xplan, self.graph
        full = tuple(Replicate() for _ in xplan.mesh_shape)
        result = []
        for value, leaf in zip(out_fx.args[0], graph.call.outputs):
            if leaf.index is None:
                result.append(leaf.value)
                continue
            k = leaf.index
            value = self.env[value]
            node_idx, out_idx = graph.outputs[k]
            node = graph.nodes[node_idx]
            src = xplan.output_placement(node.name, out_idx)
            if src != full:
                move = Move(node.outputs[out_idx], src, full, full, xplan.grad_target(node.name, out_idx), self.groups)
                step = MoveStep(f"gather_output_{k}", self.state, move, counted=k == graph.loss_output)
                value = self.g.call_function(step, (value,))
            result.append(value)
        return result

    def _defer_loss(self, outs: list) -> None:
        """The loss's last collective, started without waiting (not in the instrumented program)."""
        graph = self.graph
        if self.instrument or graph.loss_output is None or not self.defer:
            return
        loss = outs[next(j for j, leaf in enumerate(graph.call.outputs) if leaf.index == graph.loss_output)]
        node_idx, out_idx = graph.outputs[graph.loss_output]
        if isinstance(loss, fx.Node):
            defer_loss_tail(self.g, loss, self.state, graph.nodes[node_idx].outputs[out_idx])
