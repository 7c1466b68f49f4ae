"""Costing: the time and memory of every candidate strategy and every edge.

A training step is forward + backward + optimizer step.  For each node and
strategy (all on local shapes):

* op time  = roofline(forward) + roofline(backward, when gradients flow)
             + the op's own collectives (``OpComm``), per mesh axis and its link;
  Reductions of *parameter* gradients in backward are discounted by the
  profile's ``grad_reduce_overlap`` (bucketed and overlapped with backward, as
  DDP and FSDP do); the table reports their exposed time;
* parameter time = the optimizer step (memory-bound: it reads and writes the
  parameter, its gradient and its optimizer state) + for each axis where the state
  is sharded but the parameter is not (ZeRO-1/2), the all-gather of the updated
  parameter + for a parameter that sums its uses' partial gradients first
  (``SourceStrategy.accumulated_grad``), that one reduction at its exposed time;
* a step of ``m`` micro-batches (``TrainingSettings.microbatches``: a pipeline's stages, or gradient
  accumulation) is priced per micro-batch: what runs once per step (the optimizer step and its all-gathers,
  the bucketed gradient reductions, which then run after the step's last backward, not overlapped) at
  ``1 / m`` of its time, the rest in full; ``m`` times that is the step;
* memory = activations saved for backward and, for parameters, parameters +
  gradients + optimizer state (``costmodel.memory``).  What each op keeps is
  derived from the op itself (``autopar.cost.saved``: its inputs, outputs and own
  tensors, on the local shapes; scaled_dot_product_attention in the profile's
  ``attention_saves`` form, a dropout mask at its ``dropout_mask_bytes``).  A kept
  tensor costs its storage root's bytes once (a view keeps its base), as a node
  term (the op's own tensors, an output its op keeps) or on the input edges of
  the ops that keep it (``autopar.cost.saved_shares``), so the total stays a sum
  of node and edge terms.

For each edge ``u -> v`` and strategy pair: the forward transitions of the tensor
from ``u``'s output placement to the placement ``v`` reads, and, when gradients
flow, the backward transitions of its gradient from the placement ``v``'s
backward hands back to the one ``u``'s needs (``OpStrategy.input_grad`` /
``output_grad``: ``P(sum)`` on partial-gradient axes; ``transitions`` module).  A
parameter that is all-gathered before use (sharded storage) is not kept: when
its consumer needs it in backward it is gathered again there (FSDP); an
activation that is moved (the executor makes a new tensor) and kept by its
consumer costs that copy's bytes on the edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from autopar.capture import OpNode
from autopar.placement import Placement
from autopar.runtime import DEFAULT_BUCKET_BYTES
from autopar.spec import TensorMeta, local_meta
from autopar.strategies import (
    KERNELS,
    CandidateGraph,
    KernelContext,
    SourceStrategy,
    fused_keeps,
    localize_size_args,
    prices_as_fused,
)
from autopar.transitions import transitions
from costmodel import (
    DeviceProfile,
    LinkProfile,
    OptimizerSpec,
    TrainingPrecision,
    backward_flops,
    bytes_moved,
    collective_time_s,
    forward_flops,
    is_matmul_like,
    model_state_bytes,
    op_family,
    op_time_s,
)

from .moves import MoveSteps
from .pair_tables import PairTable
from .saved import NOTHING_SAVED, SavedForBackward
from .saved_shares import graph_saved, saved_by

__all__ = ["TrainingSettings", "Coster"]

aten = torch.ops.aten
_DROPOUT = {aten.dropout.default, aten.native_dropout.default}


@dataclass(frozen=True)
class TrainingSettings:
    """What a step is made of: the device, the precision and the optimizer.

    ``grad_bucket_bytes``: the runtime's data-parallel gradient bucket size
    (``runtime/buckets.py``; None: no buckets, each gradient all-reduced alone).
    """

    profile: DeviceProfile
    precision: TrainingPrecision
    optimizer: OptimizerSpec
    grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    #: the links of the mesh's axes when the mesh is a part of the job's (a pipeline stage's mesh: each axis keeps
    #: the link it has in the job's mesh, ``planner.context.graph_context``); None: the profile's
    #: ``link_for_axis`` of the mesh itself
    axis_links: tuple[LinkProfile, ...] | None = None
    #: the micro-batches of one step: the search prices one micro-batch, and what runs once per step (the
    #: optimizer, its all-gathers, the bucketed gradient reductions) at ``1 / microbatches`` of its time
    microbatches: int = 1


#: an op's backward time to its forward time: a matmul's backward runs two matmuls of its size
BACKWARD_TO_FORWARD = 2.0
#: backward's share of an op's forward + backward time
BACKWARD_SHARE = BACKWARD_TO_FORWARD / (1.0 + BACKWARD_TO_FORWARD)


class Coster:
    """Prices strategies of one CandidateGraph under one TrainingSettings (with caches)."""

    def __init__(self, cand: CandidateGraph, settings: TrainingSettings) -> None:
        self.cand = cand
        self.graph = cand.graph
        self.mesh_shape = cand.mesh_shape
        self.settings = settings
        if settings.axis_links is not None:
            self.links = list(settings.axis_links)
        else:
            self.links = [settings.profile.link_for_axis(self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self._trans_cache: dict = {}
        self._moves = MoveSteps(self.mesh_shape)  # the runtime's step lists, scaled from one reference per form
        self._comm_s: dict = {}  # (kind, bytes, axis) -> comm_time_s
        self._ids: dict = {}  # meta or placements -> small int (edge_matrices' cache keys)
        self._pair_tables: dict = {}  # (meta id, kind of move, ...) -> PairTable (edge_matrices)
        self._bytes_cache: dict = {}  # (meta, placements) -> local bytes at compute precision
        self._internal_cache: dict = {}  # (id(strategy), node_mem_key) -> internal bytes (strategies outlive it)
        # what the ops save for backward on the global metas: the graph's and the profile's attention kernel's
        # alone, so the same for every mesh the graph is priced on (``OpGraph.derived``, ``saved_shares``)
        attention = settings.profile.attention_saves
        kept = self.graph.derived(("saved for backward", attention), lambda: graph_saved(self.graph, attention))
        self._layouts, self._saved, self._root = kept.layouts, kept.saved, kept.roots
        self.saved_outputs, self.edge_shares = kept.saved_outputs, kept.edge_shares

    def edge_mem_key(self, v: OpNode, pos: int) -> tuple:
        """What ``edge_matrices`` depends on beyond the tensor, the two strategy lists and the nodes' kinds.  Of the
        edge's share (``GraphSaved.edge_shares``) only whether it is the root's first saving edge counts (it pays the
        remainder, ``edge_saved_bytes``): the 2 L edges of a rotary table L layers read share two keys, not 2 L."""
        share = self.edge_shares.get((v.index, pos))
        if share is not None:
            root_kept, k, n, numel = share
            share = (root_kept, k == 0, n, numel)
        return (share, pos in self.saved_inputs(v), prices_as_fused(v.fx_node, pos))

    def node_mem_key(self, node: OpNode) -> tuple:
        """What ``node_mem_bytes`` depends on beyond the call, the strategies and ``saved_outputs``."""
        nodes = self.graph.nodes
        return tuple((nodes[u].requires_grad, self._layouts.get((u, o))) for u, o in node.inputs)

    # ---- sizes ----------------------------------------------------------------------
    def compute_meta(self, meta: TensorMeta) -> TensorMeta:
        """The meta at training precision (float tensors take the compute dtype)."""
        if meta.dtype is not None and meta.dtype.is_floating_point:
            return TensorMeta(meta.shape, self.settings.precision.compute_dtype)
        return meta

    def local_bytes(self, meta: TensorMeta, placements: tuple[Placement, ...]) -> int:
        key = (meta, placements)
        hit = self._bytes_cache.get(key)
        if hit is None:
            hit = self._bytes_cache[key] = local_meta(self.compute_meta(meta), placements, self.mesh_shape).nbytes
        return hit

    # ---- collectives ----------------------------------------------------------------
    def grad_exposed(self, producer: OpNode, *, per_step: bool = False) -> float:
        """Fraction of a backward gradient collective's time on the critical path.

        Reductions of parameter gradients overlap with the rest of backward
        (``DeviceProfile.grad_reduce_overlap``); activation gradients do not, nor does
        the one reduction per step of a micro-batched step's bucketed gradients
        (``per_step``: it runs after the step's last backward, ``runtime/buckets.py``).
        """
        if producer.kind != "param" or per_step:
            return 1.0
        return 1.0 - self.settings.profile.grad_reduce_overlap

    def comm_time_s(self, kind: str, nbytes: int, axis: int | tuple[int, ...]) -> float:
        """The collective's time on the axis's link plus one op's overhead (the runtime issues it as a step);
        ``axis`` a tuple: one collective over those axes' groups flattened into one (``flat_link``)."""
        key = (kind, nbytes, axis)
        hit = self._comm_s.get(key)
        if hit is None:
            if isinstance(axis, tuple):
                size, link = math.prod(self.mesh_shape[a] for a in axis), self.flat_link(axis)
            else:
                size, link = self.mesh_shape[axis], self.links[axis]
            t = collective_time_s(kind, nbytes, size, link)
            hit = self._comm_s[key] = t + self.settings.profile.op_overhead_s() if t > 0 else 0.0
        return hit

    def flat_link(self, axes: tuple[int, ...]) -> LinkProfile:
        """The link of one group over ``axes`` flattened: the profile's for that group on the mesh
        (``DeviceProfile.link_for_axis``); on a pipeline stage's mesh (its axes' links given, each the one it has in
        the job's mesh) the slowest of theirs, which the flattened ring crosses."""
        if self.settings.axis_links is None:
            return self.settings.profile.link_for_axis(self.mesh_shape, axes)
        return min((self.links[a] for a in axes), key=lambda link: link.bandwidth_bytes_per_s)

    def flattens(self, axes: tuple[int, ...]) -> bool:
        """Whether a gradient bucket partial on ``axes`` (two or more) is all-reduced as one collective over their
        flattened group rather than once per axis, one after the other: the cheaper for a full bucket (both
        ``comm_time_s``, each collective with its op overhead).  The same for every bucket of those axes."""
        bucket = self.settings.grad_bucket_bytes or 0
        per_axis = sum(self.comm_time_s("all_reduce", bucket, a) for a in axes)
        return self.comm_time_s("all_reduce", bucket, tuple(axes)) < per_axis

    def grad_move_steps(self, producer: OpNode, meta: TensorMeta, src, dst) -> list[tuple[Any, float, float]]:
        """(step, whole seconds, the fraction of them exposed) of each collective moving ``producer``'s gradient
        from ``src`` to ``dst``, per micro-batch (``_grad_terms``); (None, inf, 1.0) where the runtime cannot."""
        steps = self._moves.steps(self.compute_meta(meta), src, dst)
        if steps is None:
            return [(None, math.inf, 1.0)]  # the runtime cannot run this move on the nested layout: forbidden
        steps = [t for t in steps if t.kind is not None]
        terms = self._grad_terms(producer, [(t.kind, t.bytes, t.axis) for t in steps])
        if len(terms) < len(steps):  # one bucketed all-reduce over the axes' flattened group (_grad_terms)
            steps = [replace(steps[0], axis=tuple(sorted(t.axis for t in steps)))]
        return [(t, whole, exposed) for t, (whole, exposed) in zip(steps, terms, strict=True)]

    def grad_move_time_s(self, producer: OpNode, meta: TensorMeta, src, dst, pair=None) -> float:
        """The exposed seconds of ``grad_move_steps`` (the edge tables' hot path; ``pair``: ``MoveSteps``'s key)."""
        steps = self._moves.collectives(self.compute_meta(meta), src, dst, pair)
        if steps is None:
            return math.inf
        return sum(whole * exposed for whole, exposed in self._grad_terms(producer, steps))

    def _grad_terms(self, producer: OpNode, steps: list[tuple[str, int, int]]) -> list[tuple[float, float]]:
        """(whole seconds, exposed fraction) per collective (kind, bytes, axis) of a move of a gradient.

        A parameter's gradient whose move is all-reduces, one per axis, is what the
        runtime's gradient buckets reduce (``runtime/buckets.py``): it then costs its
        bytes' share of a full bucket's all-reduce (the latency paid once per bucket,
        not once per parameter), overlapped with backward (``grad_exposed``); in a step of
        ``m`` micro-batches (``TrainingSettings.microbatches``) the buckets reduce once,
        after the last backward: ``1 / m`` of it per micro-batch, all exposed.  Partial on
        several axes, a bucket is reduced once per axis or, where that is cheaper
        (``flattens``), by one all-reduce over the axes' flattened group (torchtitan's
        flattened mesh dims): one term then, for the merged collective.  Any other move
        costs its collectives one by one, each micro-batch.
        """
        if self._bucketed(producer, steps):
            bucket, m = self.settings.grad_bucket_bytes, self.settings.microbatches
            exposed = self.grad_exposed(producer, per_step=m > 1)
            axes = tuple(sorted(axis for _, _, axis in steps))
            if len(axes) > 1 and self.flattens(axes):
                axes = (axes,)  # one collective over their flattened group
            nbytes = steps[0][1]  # an all-reduce's bytes are the buffer's, alike on every axis
            return [(self.comm_time_s("all_reduce", bucket, a) * nbytes / bucket / m, exposed) for a in axes]
        exposed = self.grad_exposed(producer)
        return [(self.comm_time_s(kind, nbytes, axis), exposed) for kind, nbytes, axis in steps]

    def _bucketed(self, producer: OpNode, steps: list[tuple[str, int, int]]) -> bool:
        """Whether the runtime's gradient buckets reduce this move of ``producer``'s gradient (its collectives
        as (kind, bytes, axis)): all-reduces only, one per axis (``runtime.buckets.bucketable``)."""
        return bool(
            producer.kind == "param"
            and self.settings.grad_bucket_bytes
            and steps
            and all(kind == "all_reduce" for kind, _, _ in steps)
            and len({axis for _, _, axis in steps}) == len(steps)
        )

    def bucketed_grad_bytes(self, producer: OpNode, meta: TensorMeta, src, dst) -> int:
        """Bytes of ``producer``'s gradient that go into a gradient bucket when it moves from ``src`` to ``dst``
        (0: the move is not bucketed, ``grad_move_steps``): the bucket's flat copy holds them until reduced."""
        if producer.kind != "param" or not self.settings.grad_bucket_bytes or src == dst:
            return 0
        steps = self._moves.collectives(self.compute_meta(meta), src, dst)
        return steps[0][1] if steps is not None and self._bucketed(producer, steps) else 0

    def transition_time_s(self, meta: TensorMeta, src, dst) -> float:
        """Seconds of the collectives moving ``meta`` from ``src`` to ``dst`` (inf: the runtime cannot)."""
        key = (meta, src, dst)
        hit = self._trans_cache.get(key)
        if hit is None:
            hit = self._trans_cache[key] = self._move_time_s(meta, src, dst, None)
        return hit

    def _move_time_s(self, meta: TensorMeta, src, dst, pair) -> float:
        # the collectives of the runtime's step list, None where it cannot run on the nested layout
        steps = self._moves.collectives(self.compute_meta(meta), src, dst, pair)
        if steps is None:
            return math.inf  # the runtime cannot run this move on the nested layout: forbidden
        return sum(self.comm_time_s(kind, nbytes, axis) for kind, nbytes, axis in steps)

    # ---- nodes ----------------------------------------------------------------------
    def node_time_s(self, node: OpNode, strategy) -> float:
        if isinstance(strategy, SourceStrategy):
            return self._param_time_s(node, strategy) if node.kind == "param" else 0.0
        return self._op_time_s(node, strategy, forward_only=False)

    def forward_time_s(self, node: OpNode, strategy) -> float:
        """An op's forward alone (its roofline and the collectives it issues in forward): what recomputing it
        in backward adds to the step."""
        if isinstance(strategy, SourceStrategy):
            return 0.0
        return self._op_time_s(node, strategy, forward_only=True)

    def _op_time_s(self, node: OpNode, strategy, *, forward_only: bool) -> float:
        call = node.call
        ins = tuple(local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.inputs, strategy.inputs))
        outs = tuple(
            local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.outputs, strategy.outputs)
        )
        local = call.with_metas(ins, outs)
        dtype = outs[0].dtype if outs else torch.float32
        matmul, attention = is_matmul_like(local), op_family(local) == "sdpa"
        nbytes, prof = bytes_moved(local), self.settings.profile
        t = op_time_s(forward_flops(local), nbytes, prof, dtype, matmul=matmul, attention=attention)
        if node.requires_grad and not forward_only:
            t += op_time_s(
                backward_flops(local), 2 * nbytes, prof, dtype, matmul=matmul, backward=True, attention=attention
            )
        for axis, comms in enumerate(strategy.comm):
            t += sum(self.comm_time_s(c.kind, c.bytes, axis) for c in comms if not forward_only or c.phase == "forward")
        return t

    def optimizer_step_s(self, node: OpNode, s: SourceStrategy) -> float:
        """The optimizer's update of this parameter's state shard, as torch.optim runs it: ``passes`` tensors
        of the shard's size read and written at the profile's optimizer bandwidth (memory-bound; the measured
        ``optimizer_bandwidth_bytes_per_s``, else the memory bandwidth), plus one per-kernel overhead
        (``optimizer_op_overhead_s``, else the op overhead) for each of its ``ops_per_param`` kernels unless the
        profile's optimizer steps many parameters per kernel (foreach); per micro-batch
        (``TrainingSettings.microbatches``: once per step)."""
        opt, prof = self.settings.optimizer, self.settings.profile
        shard_bytes = self.param_state_bytes(node, s).grads  # one tensor the size of the state shard
        bandwidth = prof.optimizer_bandwidth_bytes_per_s or prof.mem_bandwidth_bytes_per_s * prof.memory_efficiency
        per_kernel = prof.op_overhead_s() if prof.optimizer_op_overhead_s is None else prof.optimizer_op_overhead_s
        t = opt.passes * shard_bytes / bandwidth
        return (t + (0.0 if prof.optimizer_foreach else opt.ops_per_param * per_kernel)) / self.per_step

    @property
    def per_step(self) -> int:
        """The micro-batches one step's once-per-step work is shared by (``TrainingSettings.microbatches``)."""
        return self.settings.microbatches

    def step_collective_s(self, kind: str, nbytes: int, axis: int) -> float:
        """One of the optimizer step's collectives (``step_collectives``), per micro-batch."""
        return self.comm_time_s(kind, nbytes, axis) / self.per_step

    def _param_time_s(self, node: OpNode, s: SourceStrategy) -> float:
        t = self.optimizer_step_s(node, s)
        t += sum(self.step_collective_s(kind, nbytes, axis) for axis, kind, nbytes in self.step_collectives(node, s))
        return t + sum(whole * exposed for _, whole, exposed in self.accumulated_steps(node, s))

    def accumulated_steps(self, node: OpNode, s: SourceStrategy) -> list[tuple[Any, float, float]]:
        """(step, whole seconds, exposed fraction) of the one reduction of a parameter's summed partial
        gradients (``grad_move_steps``)."""
        moves = s.accumulated_grad if isinstance(s, SourceStrategy) else None
        if moves is None:
            return []
        return self.grad_move_steps(node, node.outputs[0], moves[0], moves[1])

    def step_collectives(self, node: OpNode, s: SourceStrategy) -> list[tuple[int, str, int]]:
        """(axis, kind, bytes) the optimizer step issues: all-gather of the updated param (ZeRO-1/2)."""
        out = []
        meta = TensorMeta(node.outputs[0].shape, self.settings.precision.param_dtype)
        for axis, (p, st) in enumerate(zip(s.placement, s.state)):
            if p != st and self.mesh_shape[axis] > 1:
                out += [
                    (t.axis, t.kind, t.bytes)
                    for t in transitions(meta, s.state, s.placement, self.mesh_shape)
                    if t.axis == axis
                ]
        return out

    def param_state_bytes(self, node: OpNode, s: SourceStrategy):
        meta = node.outputs[0]
        p_local = local_meta(meta, s.placement, self.mesh_shape).numel
        st_local = local_meta(meta, s.state, self.mesh_shape).numel
        return model_state_bytes(p_local, st_local, self.settings.precision, self.settings.optimizer)

    # ---- saved for backward -------------------------------------------------------------
    def _kernel(self, node: OpNode, strategy):
        """(fn, ctx) of the local kernel ``strategy`` runs instead of the op, at coordinate 0; None: the op."""
        names = {k for k in strategy.kernels if k}
        if len(names) != 1 or next(iter(names)) not in KERNELS:
            return None
        name = next(iter(names))
        axes = tuple(a for a, k in enumerate(strategy.kernels) if k == name)
        ctx = KernelContext(self.mesh_shape, (0,) * len(self.mesh_shape), strategy.inputs, node.call.inputs, axes)
        return KERNELS[name], ctx

    def storage_root(self, ref: tuple[int, int]) -> tuple[int, int]:
        """The (node, output) owning the storage of ``ref`` (itself unless it is a view: ``saved.storage_roots``)."""
        return self._root.get(ref, ref)

    def storage_bytes(self, ref: tuple[int, int], placements) -> int:
        """Local bytes of the storage behind ``ref`` (node, output) read in ``placements``: a view keeps its whole
        base, assumed split across ranks like the view."""
        meta = self.graph.nodes[ref[0]].outputs[ref[1]]
        root = self.storage_root(ref)
        numel = self.graph.nodes[root[0]].outputs[root[1]].numel
        return self.local_bytes(meta, placements) * numel // max(meta.numel, 1)

    def kept_by(self, node: OpNode) -> SavedForBackward:
        """What ``node``'s op keeps for backward at the captured (global) shapes: input positions, output
        indices and the bytes of its own tensors (``NOTHING_SAVED`` for a parameter or an op no grad reaches)."""
        return self._saved.get(node.index) or NOTHING_SAVED

    def saved_inputs(self, node: OpNode) -> tuple[int, ...]:
        """Positions of the tensor inputs ``node`` keeps for backward (none if no grad flows)."""
        saved = self._saved.get(node.index)
        return saved.inputs if saved is not None else ()

    def internal_bytes(self, node: OpNode, strategy) -> int:
        """Bytes of the tensors ``node`` makes for its backward under ``strategy`` (one rank's, coordinate 0).

        Derived from the local op (``saved.saved_for_backward``); a training dropout's
        mask is the profile's ``dropout_mask_bytes`` per element (its form is device
        dependent: a float mask on CPU, a bool one on CUDA).  An op that makes no
        tensor of its own on the global shapes makes none on local ones (unless a
        local kernel runs instead), which spares most ops a local trace.
        """
        if node.kind != "op" or not node.requires_grad or isinstance(strategy, SourceStrategy):
            return 0
        if node.target in _DROPOUT and self._saved[node.index].internal_bytes:  # p > 0 in training: a mask
            mask = local_meta(node.outputs[0], strategy.outputs[0], self.mesh_shape).numel
            return mask * self.settings.profile.dropout_mask_bytes
        if not self._saved[node.index].internal_bytes and not any(strategy.kernels):
            return 0
        key = (id(strategy), self.node_mem_key(node))
        hit = self._internal_cache.get(key)
        if hit is None:
            hit = self._internal_cache[key] = self._local_internal_bytes(node, strategy)
        return hit

    def _local_internal_bytes(self, node: OpNode, strategy) -> int:
        call = node.call
        ins = tuple(local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.inputs, strategy.inputs))
        outs = tuple(
            local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.outputs, strategy.outputs)
        )
        local = call.with_metas(ins, outs)
        args, kwargs = localize_size_args(local.target, local.args, local.kwargs, [o.shape for o in outs])
        local = replace(local, args=tuple(args), kwargs=dict(kwargs))
        attention = self.settings.profile.attention_saves
        return saved_by(self.graph, self._layouts, attention, node, local, self._kernel(node, strategy)).internal_bytes

    def activation_bytes(self, node: OpNode, strategy) -> int:
        """Bytes this node keeps alive for backward under ``strategy``.

        Its outputs whose storage some op keeps (``saved_outputs``: the op's own
        output, or a consumer's saved input or a view of it, each storage once) and
        the tensors it makes for its own backward (``internal_bytes``).
        """
        if node.kind == "param":
            return 0
        total = 0
        for o, meta in enumerate(node.outputs):
            if (node.index, o) in self.saved_outputs:
                total += self.local_bytes(meta, strategy.outputs[o])
        return total + self.internal_bytes(node, strategy)

    def edge_saved_bytes(self, u: OpNode, out_idx: int, v: OpNode, pos: int, src, dst, grad_moves: bool = False) -> int:
        """Bytes kept for backward that the edge ``u.out_idx -> v.input[pos]`` pays (``autopar.cost.saved_shares``).

        The edge moves when it has a transition in either direction (``src != dst``,
        or ``grad_moves``: the gradient's placement changes, e.g. Megatron's f, an
        identity forward): the executor then hands ``v`` a new tensor.
        """
        share = self.edge_shares.get((v.index, pos))
        if share is None or u.kind == "param":
            return 0
        if src != dst or grad_moves:
            return self.local_bytes(u.outputs[out_idx], dst)
        root_kept, k, n, _ = share
        if root_kept or prices_as_fused(v.fx_node, pos) and not fused_keeps(dst):  # fused: the log-softmax instead
            return 0
        nbytes = self.storage_bytes((u.index, out_idx), src)
        return nbytes // n + (nbytes % n if k == 0 else 0)

    def node_mem_bytes(self, node: OpNode, strategy) -> int:
        if node.kind == "param":
            return self.param_state_bytes(node, strategy).total
        return self.activation_bytes(node, strategy)

    # ---- edges ----------------------------------------------------------------------
    def edge_matrices(self, u: OpNode, out_idx: int, v: OpNode, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, mem_bytes) matrices over (u strategy, v strategy) for tensor u.out_idx -> v.input[pos]."""
        su, sv = self.cand.strategies[u.index], self.cand.strategies[v.index]
        meta = u.outputs[out_idx]
        grad = u.requires_grad and v.requires_grad and meta.is_float
        regather = u.kind == "param" and pos in self.saved_inputs(v)  # a kept gathered parameter: gathered again
        param = u.kind == "param"  # its gradient may go into a bucket (grad_move_steps)
        # a cell depends on u's strategy only through (output placement, its gradient's) and on v's
        # only through (input placement, the gradient it returns): price each distinct pair once
        row_of, rows = _distinct([(s.outputs[out_idx], s.output_grad(out_idx)) for s in su])
        col_of, cols = _distinct([(s.inputs[pos], s.input_grad(pos)) for s in sv])
        # placements as small ints (equal placements, equal ids): the pair loop hashes ints only
        ids = self._ids
        mid = ids.setdefault(meta, len(ids))
        row_ids = [(ids.setdefault(p, len(ids)), ids.setdefault(q, len(ids))) for p, q in rows]
        col_ids = [(ids.setdefault(p, len(ids)), ids.setdefault(q, len(ids))) for p, q in cols]
        keeps = self.edge_shares.get((v.index, pos)) is not None and u.kind != "param"  # else 0 (edge_saved_bytes)
        forward = self._pair_table(mid, "move").lookup(
            [sid for sid, _ in row_ids],
            [did for did, _ in col_ids],
            lambda i, j: self._move_time_s(meta, rows[i][0], cols[j][0], (row_ids[i][0], col_ids[j][0])),
        )
        time = forward * 2 if regather else forward  # FSDP: the op keeps a handle, backward gathers it again
        if grad:  # the gradient comes back from v's input gradient (g) to u's output gradient (grad_target)
            back = self._pair_table(mid, "grad", param).lookup(
                [gid for _, gid in col_ids],
                [tid for _, tid in row_ids],
                lambda j, i: self.grad_move_time_s(u, meta, cols[j][1], rows[i][1], (col_ids[j][1], row_ids[i][1])),
            )
            time = time + back.T
        shape = (len(rows), len(cols))
        mem = np.zeros(shape, dtype=np.int64)
        if keeps:
            for i, ((src, _), (_, tid)) in enumerate(zip(rows, row_ids, strict=True)):
                for j, ((dst, _), (_, gid)) in enumerate(zip(cols, col_ids, strict=True)):
                    mem[i, j] = self.edge_saved_bytes(u, out_idx, v, pos, src, dst, gid != tid)
        pick = np.ix_(row_of, col_of)
        return np.ascontiguousarray(time[pick], dtype=np.float64), mem[pick]

    def _pair_table(self, *key) -> PairTable:
        """The ``PairTable`` of one tensor id and kind of move (``edge_matrices``)."""
        table = self._pair_tables.get(key)
        if table is None:
            table = self._pair_tables[key] = PairTable()
        return table


def _distinct(items: list) -> tuple[np.ndarray, list]:
    """(index of each item in the distinct list, the distinct items in first-seen order)."""
    first: dict = {}
    index = np.array([first.setdefault(x, len(first)) for x in items], dtype=np.intp)
    return index, list(first)
