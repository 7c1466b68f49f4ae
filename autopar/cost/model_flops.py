"""Model FLOPs of a training step: the figure throughput is compared by (TFLOP/s per device, MFU).

The standard count (Chowdhery et al., "PaLM", 2022, appendix B; Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", 2021, section 5.1), for a step over ``T`` tokens of a model of
``N`` trainable parameters:

    model FLOPs = 6 N T + sum over attention cores of 12 b h d s_q s_kv
                = 6 N T + 12 L H S T          (L layers of width H = h d, self-attention over sequences of S)

``6 N T``: every parameter is used in one multiply-add (2 FLOPs) per token forward, and backward is twice forward
(the input's and the weight's gradients).  The attention term is what parameters do not count: the two matmuls
between activations of each attention core (``q k^T`` and its softmax times ``v``, ``4 b h d s_q s_kv`` FLOPs
forward), three times, for any core the graph holds: fused (``scaled_dot_product_attention``) or written out (a
matmul whose operands are both activations).  A causal mask is not discounted, as the convention has it.

``N`` counts each parameter tensor once (a tied embedding and head: once).  ``T`` is the elements of the step's
token ids: the graph's first integer input (``(batch, sequence)``), times the micro-batches of the step; a model
without one counts its samples (the batch).

MFU (model FLOPs utilization) is model FLOPs per second per device over the device's peak for the compute dtype;
the FLOPs recomputation adds (``ModelFlops.with_recompute``: each recomputed op's forward run again in backward)
are not model FLOPs: they count in the hardware's utilization (HFU), not in MFU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.capture import OpGraph
from costmodel import forward_flops, op_family

__all__ = ["ModelFlops", "count_model_flops"]


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """A step's model FLOPs (module docstring): ``per_step`` = ``6 parameters tokens + attention``;
    ``with_recompute``: plus the forwards recomputation runs again."""

    per_step: float
    with_recompute: float
    parameters: int
    tokens: int
    attention: float


def count_model_flops(graph: OpGraph, microbatches: int = 1, recomputed: frozenset[str] = frozenset()) -> ModelFlops:
    """The model FLOPs of a step of ``microbatches`` runs of ``graph`` (one micro-batch); ``recomputed``: the names
    of the ops run again in backward (``NodePlacement.recompute``)."""
    parameters = sum(math.prod(n.outputs[0].shape) for n in graph.nodes if n.kind == "param" and n.requires_grad)
    tokens = _tokens(graph) * microbatches
    attention = extra = 0.0
    for node in graph.nodes:
        if node.kind != "op":
            continue
        if _is_attention_core(graph, node):
            attention += 3.0 * forward_flops(node.call)
        if node.name in recomputed:
            extra += forward_flops(node.call)
    attention *= microbatches
    per_step = 6.0 * parameters * tokens + attention
    return ModelFlops(per_step, per_step + extra * microbatches, parameters, tokens, attention)


def _tokens(graph: OpGraph) -> int:
    """The elements of the first integer input (token ids), else the batch (the first input's leading dim)."""
    inputs = [n for n in graph.nodes if n.kind == "input" and n.outputs]
    for node in inputs:
        meta = node.outputs[0]
        if not meta.dtype.is_floating_point and not meta.dtype.is_complex and meta.dtype.itemsize > 1 and meta.shape:
            return math.prod(meta.shape)
    return next((n.outputs[0].shape[0] for n in inputs if n.outputs[0].shape), 1)


def _is_attention_core(graph: OpGraph, node) -> bool:
    """A fused attention op, or a batched matmul of two activations (neither operand a parameter, seen through
    the views and casts between them: ``x @ w.t()`` is a parameter's)."""
    family = op_family(node.call)
    if family == "sdpa":
        return True
    if family != "matmul" or len(node.inputs) < 2 or any(len(m.shape) < 3 for m in node.call.inputs[:2]):
        return False
    return not any(_from_parameter(graph, i) for i, _ in node.inputs[:2])


def _from_parameter(graph: OpGraph, index: int) -> bool:
    """Whether node ``index`` is a parameter, or a chain of one-input ops (views, casts) of one."""
    node = graph.nodes[index]
    while node.kind == "op" and len(node.inputs) == 1:
        node = graph.nodes[node.inputs[0][0]]
    return node.kind == "param"
