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
   them) runs as one fused log-softmax (``fuse.py`` has the rule): same value,
   gradients and moves, half the (N, C) tensors kept for backward.  The
   instrumented variant fuses it too, so ``SavedBytes`` measures what the fast
   program keeps, and records the unfused nodes' values beside it (``trace``).

The result prints as plain Python (``gm.code``: aten calls and the inserted
steps); ``ShardedModule.local_graph`` exposes it.  What changes between calls
lives in one ``RunState`` the steps share: the ``CollectiveCounter`` (every move
records its collectives there), the step number (for RNG seeds), and the
instrumentation.  ``lower(..., instrument=True)`` wraps *every* op in an
``OpStep`` that also records each op's local outputs (``state.trace``) and the
bytes it saves for backward (``SavedBytes``); the compiled module builds that
variant only when one of them is asked for, so the fast graph pays nothing.

Randomness (dropout): a random op re-seeds the RNG from (seed, step, node, this
rank's coordinates on the axes where the op's output is *sharded*), so ranks
that hold the same (replicated) values draw the same mask and ranks holding
different shards draw their own parts — Megatron's and Paddle's local/global
seed policy.  The RNG state around the op is restored afterwards.

Train and eval mode: the graph is traced in train mode.  When the compiled module
is in eval mode (``RunState.training`` False, from ``ShardedModule.eval()``), the
ops whose behaviour ``nn.Module.eval()`` switches in the aten graph run their
eval form: dropout (``aten.dropout``, ``aten.native_dropout``: ``train=False``)
and attention dropout (``scaled_dot_product_attention``: ``dropout_p=0``)
feature and alpha dropout, batch and instance norm with running statistics (which
they then normalize with, not the batch's) (``EVAL_FORMS``); an op whose only
effect is a buffer update (``num_batches_tracked.add_(1)``, result unused) is
skipped, as a module in eval mode updates no running statistics.  Python
branches on ``self.training`` inside the model were decided when it was traced
(train mode) and stay so.

Buffers the forward writes (batch norm's running statistics and counter): the op
gets this rank's persistent piece of the buffer itself, so the update stays for
the next call and ``full_state_dict``; a plan that would hand it a moved copy is
refused (``_check_buffer_writes``), never a silently dropped update.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.capture import OpGraph
from autopar.placement import Placement, Replicate, Shard, parse_placements
from autopar.runtime import Move, defer_loss_tail, from_state_shard
from autopar.spec import local_shape
from autopar.strategies import (
    KERNELS,
    FusedLoss,
    KernelContext,
    decomposed_values,
    emit_fused_loss,
    fusable_groups,
    localize_size_args,
)
from autopar.transitions import input_grad_placements, output_grad_placements, partial_on, producer_grad_placement

__all__ = ["ExecutionPlan", "RunState", "lower", "SavedBytes", "RANDOM_OPS", "EVAL_FORMS"]

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
# op -> (argument, the value eval mode gives it): what nn.Module.eval() changes in a train-mode graph
# (batch and instance norm: only with running statistics; without, eval mode normalizes by the batch too)
EVAL_FORMS = {
    aten.dropout.default: ("train", False),
    aten.native_dropout.default: ("train", False),
    aten.feature_dropout.default: ("train", False),
    aten.alpha_dropout.default: ("train", False),
    aten.feature_alpha_dropout.default: ("train", False),
    aten.scaled_dot_product_attention.default: ("dropout_p", 0.0),
    aten.batch_norm.default: ("training", False),
    aten.native_batch_norm.default: ("training", False),
    aten._native_batch_norm_legit.default: ("training", False),
    aten.instance_norm.default: ("use_input_stats", False),
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


def _eval_form(target, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``target``'s arguments with its ``EVAL_FORMS`` entry applied (positional or keyword, as given)."""
    name, value = EVAL_FORMS[target]
    names = [a.name for a in target._schema.arguments]
    at = names.index(name)
    if at < len(args):
        return (*args[:at], value, *args[at + 1 :]), kwargs
    return args, {**kwargs, name: value}


@dataclass
class NodeExec:
    """What one op node needs at run time (placements parsed from the plan)."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    kernels: tuple[str | None, ...]
    split: tuple[bool, ...]
    partial_grad: tuple[bool, ...] = ()  # axes where backward runs on P(sum) gradients

    def input_grad(self, pos: int) -> tuple[Placement, ...]:
        """The gradient placement this op's backward hands back for input ``pos``."""
        return input_grad_placements(self.inputs[pos], self.split, self.partial_grad)


@dataclass
class ExecutionPlan:
    """The plan resolved against one captured graph: placements of every value by fx node name."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    nodes: dict[str, NodeExec]
    sources: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]]  # fx name -> (placement, grad target)
    # param fx name -> where its uses' gradients are summed, when not its state placement (partial_grad_axes)
    accumulate: dict[str, tuple[Placement, ...]] = field(default_factory=dict)

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
            flags = _axis_flags(plan, entry, f"node {n.name}")
            if any(f and sp for f, sp in zip(flags, split)):
                raise ValueError(
                    f"node {n.name}: partial_grad_axes {entry['partial_grad_axes']} include an axis the op "
                    "splits; partial gradients are only exact where every rank of the axis repeats the op"
                )
            nodes[n.name] = NodeExec(ins, outs, tuple(entry["kernels"]), split, flags)
        if missing:
            raise ValueError(
                f"the plan does not match the model {graph.model_name}: {len(missing)} graph nodes are not in it "
                f"(first: {', '.join(missing[:3])}); re-plan this model with the same example input shapes"
            )
        sources, accumulate = {}, {}
        for n in graph.nodes:
            if n.kind == "param":
                if n.fqn not in plan.params:
                    raise ValueError(f"the plan has no placement for parameter {n.fqn}; re-plan this model")
                p = plan.params[n.fqn]
                # (placement, state placement): gradients go to the state (ZeRO-1/2 when they differ)
                sources[n.name] = (parse_placements(p["placements"]), parse_placements(p["state_placements"]))
                flags = _axis_flags(plan, p, f"parameter {n.fqn}")
                if any(flags):
                    accumulate[n.name] = partial_on(sources[n.name][1], flags)
            elif n.kind in ("input", "buffer"):
                pl = parse_placements(plan.inputs[n.fqn or n.name]["placements"])
                sources[n.name] = (pl, tuple(producer_grad_placement(p) for p in pl))
        return cls(graph, mesh_shape, nodes, sources, accumulate)

    def output_placement(self, name: str, index: int) -> tuple[Placement, ...]:
        if name in self.nodes:
            return self.nodes[name].outputs[index]
        return self.sources[name][0]

    def grad_target(self, name: str, index: int) -> tuple[Placement, ...]:
        """Where the gradients of ``name``'s output ``index`` are summed (what each consumer edge delivers)."""
        if name in self.nodes:
            return output_grad_placements(self.nodes[name].outputs[index], self.nodes[name].partial_grad)
        return self.accumulate.get(name, self.sources[name][1])


def _axis_flags(plan, entry: dict, what: str) -> tuple[bool, ...]:
    """``entry["partial_grad_axes"]`` (axis names) as one flag per mesh axis."""
    names = list(plan.mesh.axis_names)
    given = entry.get("partial_grad_axes", [])
    unknown = [a for a in given if a not in names]
    if unknown:
        raise ValueError(f"{what}: partial_grad_axes {unknown} are not axes of the plan's mesh {names}")
    return tuple(a in given for a in names) if given else ()


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
def _regather_saved(gathered: tuple, counter, record: SavedBytes | None = None, op: str = ""):
    """FSDP: an op that saves an all-gathered parameter keeps only a handle; backward gathers it again.

    ``gathered`` lists (full tensor, (local shard, Move)).  A saved tensor that
    shares storage with a gathered parameter is packed as the recipe to rebuild it
    (the shard and the view's size/stride/offset); unpacking issues the plan's
    backward all-gather (the Move's forward steps, recorded as ``"backward"``).
    Every other saved tensor is kept as is and, when ``record`` is given, measured
    there (``SavedBytes``).  With nothing gathered and no record this is a no-op.
    """
    if not gathered and record is None:
        yield
        return
    # autograd keeps the pack hook alive with every tensor it saved (until backward): it must not hold the
    # gathered tensors themselves, or every gathered parameter lives until backward; their storages' addresses
    # identify them while the op runs
    by_storage = {full.untyped_storage().data_ptr(): recipe for full, recipe in gathered}
    del gathered

    def pack(t: torch.Tensor):
        recipe = by_storage.get(t.untyped_storage().data_ptr())
        if recipe is not None:
            return ("regather", recipe, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)
        if record is not None:
            record.add(t, op)
        return t

    def unpack(packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "regather"):
            return packed
        _, (local, move), size, stride, offset, _ = packed
        return move.local(local.detach(), counter, phase="backward").as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@dataclass
class RunState:
    """What may change between calls of a lowered graph; its steps read it (``ShardedModule`` sets it per call).

    ``counter``: a ``CollectiveCounter`` every move records in (or None);
    ``step``: the call number, part of every random op's seed; ``training``: the
    module's mode (False: ``EVAL_FORMS`` ops run their eval form); ``trace``: when a
    dict, op node name -> this rank's local outputs; ``saved``: when given, the
    bytes ops save for backward are measured there.  ``trace`` and ``saved`` are
    only honoured by a graph lowered with ``instrument=True``.
    """

    counter: Any = None
    step: int = 0
    training: bool = True
    trace: dict[str, list[torch.Tensor]] | None = None
    saved: SavedBytes | None = None


class _Step:
    """A callable the lowered graph calls; ``__name__`` is what ``gm.code`` shows."""

    def __init__(self, name: str, state: RunState) -> None:
        self.__name__ = self.__qualname__ = name
        self.state = state


class MoveStep(_Step):
    """One edge's ``Move`` (or a ZeRO read, ``shard`` given) in the lowered graph.

    Records in ``state.counter`` unless ``counted`` is false; a moved parameter
    (``param``) is marked as model state in ``state.saved`` when measuring.
    """

    def __init__(self, name: str, state: RunState, move: Move, *, shard=None, param=False, counted=True) -> None:
        super().__init__(name, state)
        self.move, self.shard, self.param, self.counted = move, shard, param, counted

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        counter = self.state.counter if self.counted else None
        if self.shard is None:
            out = self.move(x, counter)
        else:  # read the ZeRO buffer; the gradient goes to the state shard
            out = from_state_shard(self.shard, x, self.move, counter)
        if self.param and self.state.saved is not None:
            self.state.saved.add_parameter(out)  # a moved copy of a parameter is model state too
        return out


class OpStep(_Step):
    """One op that needs more than its aten call: a kernel, an RNG seed, FSDP re-gather or instrumentation.

    Called as ``step(*args, **kwargs)``, or ``step(pairs, *args, **kwargs)`` with
    ``regather`` moves, ``pairs`` holding each gathered parameter's (full, local
    piece) in the same order.  ``seed_key``: (seed, node index, sharded
    coordinates) of a random op; the RNG seed also takes ``state.step``.
    ``eval_target``: the aten op whose ``EVAL_FORMS`` entry applies when
    ``state.training`` is False (then no RNG is forked: the eval form draws nothing).
    ``eval_skips``: the op only writes a model buffer (its result is unused), and in
    eval mode is not run (its first argument, the buffer it writes, is returned).
    """

    def __init__(
        self,
        name: str,
        state: RunState,
        fn,
        *,
        regather=(),
        seed_key=None,
        rng_devices=(),
        instrument=False,
        eval_target=None,
        eval_skips=False,
    ):
        super().__init__(name, state)
        self.fn, self.regather, self.seed_key, self.instrument = fn, tuple(regather), seed_key, instrument
        self.rng_devices = list(rng_devices)
        self.eval_target, self.eval_skips = eval_target, eval_skips

    def seed(self, step: int) -> int:
        seed, index, coords = self.seed_key
        return zlib.crc32(repr((seed, step, index, coords)).encode()) & 0x7FFFFFFF

    def __call__(self, *args, **kwargs):
        state = self.state
        gathered = ()
        if self.regather:
            gathered = tuple((full, (local, move)) for (full, local), move in zip(args[0], self.regather))
            args = args[1:]
        with _regather_saved(gathered, state.counter, state.saved if self.instrument else None, self.__name__):
            if self.eval_skips and not state.training:
                out = args[0]
            elif self.eval_target is not None and not state.training:
                args, kwargs = _eval_form(self.eval_target, args, kwargs)
                out = self.fn(*args, **kwargs)
            elif self.seed_key is None:
                out = self.fn(*args, **kwargs)
            else:
                with torch.random.fork_rng(devices=self.rng_devices):
                    if self.rng_devices:
                        torch.manual_seed(self.seed(state.step))
                    else:  # CPU ranks: only the CPU generator (torch.manual_seed also queues lazy device seeding)
                        torch.default_generator.manual_seed(self.seed(state.step))
                    out = self.fn(*args, **kwargs)
        if self.instrument and state.trace is not None:
            state.trace[self.__name__] = [
                t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            ]
        return out


class _TraceDecomposed(_Step):
    """Instrumented program only: records what a fused cross-entropy's unfused nodes would output (``state.trace``)."""

    def __init__(self, name: str, state: RunState, group: FusedLoss) -> None:
        super().__init__(name, state)
        self.group = group

    def __call__(self, x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        if self.state.trace is not None:
            self.state.trace.update(decomposed_values(self.group, x, index, valid))


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
) -> fx.GraphModule:
    """This rank's local program for ``xplan`` (see the module docstring).

    The module takes one positional argument per source node of ``xplan.graph``
    (parameters, buffers, inputs; ``kind != "op"``), in graph order, each this
    rank's piece under its planned placement, and returns the model's outputs
    (full tensors; the loss as planned).  ``state_shards``: ZeRO param node name ->
    its state shard (its argument is the buffer; ``runtime/zero.py``).
    ``buckets``: a ``runtime.buckets.GradBuckets`` whose parameters' edges hand
    their gradients to it unreduced (noted in it).  Raises ValueError for a node
    whose strategies name several kernels.
    """
    graph = xplan.graph
    state_shards = state_shards or {}
    coord = tuple(groups.coordinate)
    dev = getattr(groups, "device", torch.device("cpu"))
    rng_devices = [dev] if dev.type == "cuda" else []
    by_fx = {n.fx_node: n for n in graph.nodes if n.fx_node is not None}
    for fxn in graph.gm.graph.nodes:
        if fxn.op == "placeholder" and fxn.name in graph.placeholder_alias:
            by_fx[fxn] = graph.nodes[graph.placeholder_alias[fxn.name]]
    g = fx.Graph()
    sources = {n.name: g.placeholder(n.name) for n in graph.nodes if n.kind != "op"}
    by_name = {n.name: n for n in graph.nodes}
    for name, acc in xplan.accumulate.items():  # parameters whose uses' partial gradients are summed first
        node = by_name[name]
        placement, grad_state = xplan.sources[name]
        if buckets is not None and name in buckets:  # the bucket reduces the sum (its source wrap)
            buckets.note(name, "accumulated", node.outputs[0], acc, grad_state)
            continue
        move = Move(node.outputs[0], placement, placement, acc, grad_state, groups)
        step = MoveStep(f"accumulate_{name}", state, move, shard=state_shards.get(name), param=True)
        sources[name] = g.call_function(step, (sources[name],))
    env: dict[fx.Node, Any] = {}

    def edge(opnode, ex: NodeExec, pos: int, value: fx.Node, regather: list):
        src_node, out_idx = opnode.inputs[pos]
        producer = graph.nodes[src_node]
        src, dst = xplan.output_placement(producer.name, out_idx), ex.inputs[pos]
        grad_src = ex.input_grad(pos)
        grad_dst = xplan.grad_target(producer.name, out_idx)
        meta = producer.outputs[out_idx]
        if buckets is not None and producer.name in buckets and producer.name not in xplan.accumulate:
            buckets.note(producer.name, (opnode.name, pos), meta, grad_src, grad_dst)  # reduced in a bucket
            grad_dst = grad_src
        # a ZeRO parameter is read from its buffer on each edge, unless its summed gradient is moved once
        shard = state_shards.get(producer.name) if producer.name not in xplan.accumulate else None
        if shard is None and _moves_nothing(producer, src, dst, grad_src, grad_dst):
            return value
        param = producer.kind == "param"
        step = MoveStep(
            f"move_{opnode.name}_{pos}",
            state,
            Move(meta, src, dst, grad_src, grad_dst, groups),
            shard=shard,
            param=param,
        )
        moved = g.call_function(step, (value,))
        if param and src != dst:
            regather.append(((moved, value), step.move))
        return moved

    def fused_node(name: str, target, *args):
        if instrument:  # measured and traced like every op of the instrumented program
            return g.create_node("call_function", OpStep(name, state, target, instrument=True), args, name=name)
        return g.create_node("call_function", target, args, name=name)

    def identity_edge(opnode, ex: NodeExec, pos: int) -> bool:  # (no bucket or ZeRO read: fused inputs are no params)
        producer, out_idx = graph.nodes[opnode.inputs[pos][0]], opnode.inputs[pos][1]
        src, grad_dst = xplan.output_placement(producer.name, out_idx), xplan.grad_target(producer.name, out_idx)
        return _moves_nothing(producer, src, ex.inputs[pos], ex.input_grad(pos), grad_dst)

    fused = fusable_groups(xplan, by_fx, identity_edge)
    fused_inputs: dict[tuple[str, int], fx.Node] = {}  # (member, position) -> the value its edge delivers

    out_fx = None
    for fxn in graph.gm.graph.nodes:
        opnode = by_fx.get(fxn)
        if fxn.op == "placeholder":
            env[fxn] = sources[opnode.name] if opnode is not None else None  # None: an unused tied alias
            continue
        if fxn.op == "output":
            out_fx = fxn
            continue
        if fxn.op != "call_function" or opnode is None or opnode.kind != "op":
            env[fxn] = g.node_copy(fxn, lambda n: env[n])
            continue
        ex = xplan.nodes[opnode.name]
        if fxn in fused:  # a fused cross-entropy (autopar/fuse.py): only the edges from outside it are lowered
            group = fused[fxn]
            for pos, (src, _) in enumerate(opnode.inputs):
                producer_fx = graph.nodes[src].fx_node
                if producer_fx not in group.members.values():
                    value = env[_tensor_args(fxn)[pos]]
                    fused_inputs[(fxn.name, pos)] = edge(opnode, ex, pos, value, [])
            if fxn is group.result:
                x, index, valid = (fused_inputs[k] for k in group.inputs())
                if instrument:
                    g.call_function(_TraceDecomposed(f"trace_{group.part.group}", state, group), (x, index, valid))
                env[fxn] = emit_fused_loss(group, x, index, valid, fused_node)
            continue
        flat, spec = pytree.tree_flatten((fxn.args, fxn.kwargs))
        pos, new_flat, regather = 0, [], []
        for a in flat:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                a = edge(opnode, ex, pos, env[a], regather)
                pos += 1
            elif isinstance(a, fx.Node):
                a = env[a]
            new_flat.append(a)
        args, kwargs = pytree.tree_unflatten(new_flat, spec)
        shapes = [local_shape(m.shape, p, xplan.mesh_shape, coord) for m, p in zip(opnode.outputs, ex.outputs)]
        args, kwargs = localize_size_args(fxn.target, tuple(args), dict(kwargs), shapes)
        fn = _kernel(xplan, opnode, ex, coord)
        random = fxn.target in RANDOM_OPS
        writes = _written_buffers(fxn, by_fx)
        _check_buffer_writes(xplan, opnode, ex, writes)
        eval_form = _has_eval_form(fxn)
        # an op whose only effect is a buffer update (num_batches_tracked.add_(1)) does not run in eval; one whose
        # result is read (a cache-like update) runs in both modes
        skips = [pos for pos, _ in writes] == [0] and not fxn.users and fxn.target not in EVAL_FORMS
        if instrument or random or regather or fn is not fxn.target or eval_form or skips:
            fn = OpStep(
                opnode.name,
                state,
                fn,
                regather=[m for _, m in regather],
                seed_key=_seed_key(seed, opnode, ex, coord) if random else None,
                rng_devices=rng_devices,
                instrument=instrument,
                eval_target=fxn.target if eval_form else None,
                eval_skips=skips,
            )
            if regather:
                args = (tuple(pair for pair, _ in regather), *args)
        env[fxn] = g.create_node("call_function", fn, args, kwargs, name=fxn.name)
    outs = _lower_outputs(xplan, groups, state, g, env, out_fx)
    g.output(tuple(outs))
    if not instrument and graph.loss_output is not None:  # the loss's last collective, started without waiting
        loss = outs[next(j for j, leaf in enumerate(graph.call.outputs) if leaf.index == graph.loss_output)]
        node_idx, out_idx = graph.outputs[graph.loss_output]
        if isinstance(loss, fx.Node):
            defer_loss_tail(g, loss, state, graph.nodes[node_idx].outputs[out_idx])
    return fx.GraphModule(graph.gm, g, class_name="LocalProgram")


def _lower_outputs(xplan: ExecutionPlan, groups, state: RunState, g: fx.Graph, env: dict, out_fx: fx.Node) -> list:
    """One value per leaf of the model's output tree (``OpGraph.call.outputs``): tensors gathered to full, constants
    as they are.  Only the loss's move is counted (the plan's list covers the step)."""
    graph = xplan.graph
    full = tuple(Replicate() for _ in xplan.mesh_shape)
    result = []
    for value, leaf in zip(out_fx.args[0], graph.call.outputs):
        if leaf.index is None:
            result.append(leaf.value)
            continue
        k = leaf.index
        value = env[value]
        node_idx, out_idx = graph.outputs[k]
        node = graph.nodes[node_idx]
        src = xplan.output_placement(node.name, out_idx)
        if src != full:
            move = Move(node.outputs[out_idx], src, full, full, xplan.grad_target(node.name, out_idx), groups)
            step = MoveStep(f"gather_output_{k}", state, move, counted=k == graph.loss_output)
            value = g.call_function(step, (value,))
        result.append(value)
    return result
