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
  parameter;
* memory = activations saved for backward (the node's output, at its placement,
  when a consumer saves it; the dropout mask at the profile's bytes per element) and, for
  parameters, parameters + gradients + optimizer state (``costmodel.memory``).

For each edge ``u -> v`` and strategy pair: the forward transitions of the tensor
from ``u``'s output placement to the placement ``v`` reads, and, when gradients
flow, the backward transitions of its gradient (``transitions`` module).  A
parameter that is all-gathered before use (sharded storage) is not kept: when
its consumer needs it in backward it is gathered again there (FSDP); an activation that is transitioned and saved by its
consumer costs that copy's bytes on the edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from costmodel import collective_time_s, model_state_bytes, op_time_s
from costmodel import flops as flops_mod
from costmodel.memory import OptimizerSpec, TrainingPrecision
from costmodel.profiles import DeviceProfile

from .candidates import CandidateGraph, SourceStrategy
from .capture import OpNode
from .placement import Placement, Replicate
from .spec import TensorMeta, local_meta
from .transitions import consumer_grad_placement, producer_grad_placement, transitions

__all__ = ["TrainingSettings", "Coster", "saved_inputs", "saves_output"]

aten = torch.ops.aten

# Inputs (positions among tensor inputs) an op keeps for its backward, and whether
# it keeps its output.  Names are aten op names without overload.
_SAVES_ALL_INPUTS = {
    "mm",
    "bmm",
    "matmul",
    "einsum",
    "mul",
    "div",
    "pow",
    "gelu",
    "silu",
    "log",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "scaled_dot_product_attention",
    "where",
    "gather",
    "index",
    "sqrt",
    "cos",
    "sin",
}
_SAVES_LAST_TWO = {"addmm", "baddbmm"}  # bias not needed
_SAVES_INDEX_ONLY = {"embedding"}
_SAVES_OUTPUT = {
    "tanh",
    "exp",
    "rsqrt",
    "sigmoid",
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "scaled_dot_product_attention",
}


def _op_name(target) -> str:
    parts = str(target).split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def saved_inputs(node: OpNode) -> tuple[int, ...]:
    """Positions of the tensor inputs ``node`` saves for backward (none if no grad flows)."""
    if node.kind != "op" or not node.requires_grad:
        return ()
    name = _op_name(node.target)
    n = len(node.inputs)
    if name in _SAVES_LAST_TWO:
        return tuple(range(max(0, n - 2), n))
    if name == "linear":
        return tuple(range(min(n, 2)))
    if name in _SAVES_INDEX_ONLY:  # the looked-up table is not needed, only where the rows went
        return (n - 1,)
    if name in _SAVES_ALL_INPUTS:
        return tuple(range(n))
    return ()


def saves_output(node: OpNode) -> bool:
    return node.kind == "op" and node.requires_grad and _op_name(node.target) in _SAVES_OUTPUT


@dataclass(frozen=True)
class TrainingSettings:
    """What a step is made of: the device, the precision and the optimizer."""

    profile: DeviceProfile
    precision: TrainingPrecision
    optimizer: OptimizerSpec


class Coster:
    """Prices strategies of one CandidateGraph under one TrainingSettings (with caches)."""

    def __init__(self, cand: CandidateGraph, settings: TrainingSettings) -> None:
        self.cand = cand
        self.graph = cand.graph
        self.mesh_shape = cand.mesh_shape
        self.settings = settings
        self.links = [settings.profile.link_for_axis(self.mesh_shape, a) for a in range(len(self.mesh_shape))]
        self._trans_cache: dict = {}
        self._consumers = self.graph.consumers()
        saved = set()
        for v in self.graph.nodes:
            for pos in saved_inputs(v):
                saved.add(v.inputs[pos])
        self.saved_outputs = saved  # (node, output index) kept for backward by some consumer

    # ---- sizes ----------------------------------------------------------------------
    def compute_meta(self, meta: TensorMeta) -> TensorMeta:
        """The meta at training precision (float tensors take the compute dtype)."""
        if meta.dtype is not None and meta.dtype.is_floating_point:
            return TensorMeta(meta.shape, self.settings.precision.compute_dtype)
        return meta

    def local_bytes(self, meta: TensorMeta, placements: tuple[Placement, ...]) -> int:
        return local_meta(self.compute_meta(meta), placements, self.mesh_shape).nbytes

    # ---- collectives ----------------------------------------------------------------
    def grad_exposed(self, producer: OpNode) -> float:
        """Fraction of a backward gradient collective's time on the critical path.

        Reductions of parameter gradients overlap with the rest of backward
        (``DeviceProfile.grad_reduce_overlap``); activation gradients do not.
        """
        return 1.0 - self.settings.profile.grad_reduce_overlap if producer.kind == "param" else 1.0

    def comm_time_s(self, kind: str, nbytes: int, axis: int) -> float:
        """Ring time on the axis's link plus one kernel launch (a collective is a kernel too)."""
        t = collective_time_s(kind, nbytes, self.mesh_shape[axis], self.links[axis])
        return t + self.settings.profile.kernel_overhead_s if t > 0 else 0.0

    def transition_time_s(self, meta: TensorMeta, src, dst) -> float:
        key = (meta, src, dst)
        hit = self._trans_cache.get(key)
        if hit is None:
            from .runtime.redistribute import nesting_conflict

            m = self.compute_meta(meta)
            if nesting_conflict(m, src, dst, self.mesh_shape) is not None:
                hit = math.inf  # the runtime cannot run this move on the nested layout: forbidden
            else:
                hit = sum(self.comm_time_s(t.kind, t.bytes, t.axis) for t in transitions(m, src, dst, self.mesh_shape))
            self._trans_cache[key] = hit
        return hit

    # ---- nodes ----------------------------------------------------------------------
    def node_time_s(self, node: OpNode, strategy) -> float:
        if isinstance(strategy, SourceStrategy):
            return self._param_time_s(node, strategy) if node.kind == "param" else 0.0
        call = node.call
        ins = tuple(local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.inputs, strategy.inputs))
        outs = tuple(
            local_meta(self.compute_meta(m), p, self.mesh_shape) for m, p in zip(call.outputs, strategy.outputs)
        )
        local = call.with_metas(ins, outs)
        dtype = outs[0].dtype if outs else torch.float32
        matmul = flops_mod.is_matmul_like(local)
        nbytes = flops_mod.bytes_moved(local)
        t = op_time_s(flops_mod.forward_flops(local), nbytes, self.settings.profile, dtype, matmul=matmul)
        if node.requires_grad:
            t += op_time_s(flops_mod.backward_flops(local), 2 * nbytes, self.settings.profile, dtype, matmul=matmul)
        for axis, comms in enumerate(strategy.comm):
            t += sum(self.comm_time_s(c.kind, c.bytes, axis) for c in comms)
        return t

    def _param_time_s(self, node: OpNode, s: SourceStrategy) -> float:
        st = self.param_state_bytes(node, s)
        prof = self.settings.profile
        t = 2 * st.total / (prof.mem_bandwidth_bytes_per_s * prof.memory_efficiency)
        return t + sum(self.comm_time_s(kind, nbytes, axis) for axis, kind, nbytes in self.step_collectives(node, s))

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

    def activation_bytes(self, node: OpNode, strategy) -> int:
        """Bytes this node keeps alive for backward under ``strategy``."""
        if node.kind == "param":
            return 0
        total = 0
        for o, meta in enumerate(node.outputs):
            if (node.index, o) in self.saved_outputs or (o == 0 and saves_output(node)):
                total += self.local_bytes(meta, strategy.outputs[o])
        if node.kind == "op" and node.requires_grad and _op_name(node.target) in ("dropout", "native_dropout"):
            mask = local_meta(node.outputs[0], strategy.outputs[0], self.mesh_shape).numel
            total += mask * self.settings.profile.dropout_mask_bytes
        return total

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
        saves = pos in saved_inputs(v) and u.kind != "param"  # a kept gathered parameter is re-gathered
        time = np.zeros((len(su), len(sv)))
        mem = np.zeros((len(su), len(sv)), dtype=np.int64)
        for a, s_u in enumerate(su):
            src = s_u.outputs[out_idx]
            grad_target = (
                s_u.state if isinstance(s_u, SourceStrategy) else tuple(producer_grad_placement(p) for p in src)
            )
            for b, s_v in enumerate(sv):
                dst = s_v.inputs[pos]
                fwd = self.transition_time_s(meta, src, dst) if src != dst else 0.0
                t = fwd
                if fwd and u.kind == "param" and pos in saved_inputs(v):
                    t += fwd  # FSDP: the op keeps a handle, backward gathers it again
                if grad:
                    g = tuple(consumer_grad_placement(p, sp) for p, sp in zip(dst, s_v.split))
                    if g != grad_target:
                        t += self.transition_time_s(meta, g, grad_target) * self.grad_exposed(u)
                time[a, b] = t
                if saves and src != dst and _changes_data(src, dst):
                    mem[a, b] = self.local_bytes(meta, dst)
        return time, mem


def _changes_data(src, dst) -> bool:
    """A transition that makes a new tensor (not a free local slice of a replicated one)."""
    return any(not isinstance(s, Replicate) and s != d for s, d in zip(src, dst))
