"""Decompositions applied before planning, so generic rules can shard what fused ops hide.

``cross_entropy_loss(x, t)`` on logits ``x`` of shape (N, C) becomes the
numerically stable log-sum-exp form

    m    = amax(x.detach(), 1, keepdim)          # P(max) when C is sharded; no grad, so nothing saved
    z    = x - m
    s    = sum(exp(z), 1, keepdim)               # P(sum) when C is sharded
    zt   = gather(z, 1, t')                      # masked gather: P(sum) when C is sharded
    nll  = (log(s) - zt) * valid                 # valid = (t != ignore_index), t' = where(valid, t, 0)
    loss = sum(nll) / sum(valid)   (mean)  |  sum(nll)  (sum)  |  nll  (none)

With the class dim sharded, the only collectives are three all-reduces of N
floats (max, sum-exp, target logit): Megatron's vocab-parallel cross-entropy,
found by the search from the pieces, with the full logits never gathered.
``label_smoothing`` > 0 adds ``eps * (log(s) - mean_c(z))`` (a sum over C:
P(sum) again).  A class ``weight`` or inputs that are not (N, C) keep the fused
op (then planned by its rule or the replicate fallback).
"""

from __future__ import annotations

import torch
from torch import fx
from torch._guards import detect_fake_mode

__all__ = ["decompose_for_planning", "cross_entropy_reference"]

aten = torch.ops.aten
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def decompose_for_planning(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` in place (every decomposition this module knows)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(vals)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.cross_entropy_loss.default:
            _decompose_cross_entropy(gm.graph, node, fake_mode)


def _emit(graph: fx.Graph, fake_mode, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """Insert ``target(*args)`` with its meta (val computed on fake tensors, module path kept)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["nn_module_stack"] = like.meta.get("nn_module_stack", {})
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    fargs = fx.node.map_arg(args, lambda n: n.meta["val"])
    fkwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fargs, **fkwargs)
    else:
        node.meta["val"] = target(*fargs, **fkwargs)
    return node


def _decompose_cross_entropy(graph: fx.Graph, node: fx.Node, fake_mode) -> None:
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    for k, v in defaults.items():
        bound.setdefault(k, v)
    x, t = bound["self"], bound["target"]
    if bound["weight"] is not None or x.meta["val"].dim() != 2 or t.meta["val"].dim() != 1:
        return
    if t.meta["val"].dtype.is_floating_point:  # class probabilities, not indices
        return
    reduction, ignore, eps = (
        _REDUCTION[int(bound["reduction"])],
        int(bound["ignore_index"]),
        float(bound["label_smoothing"]),
    )
    num_classes = x.meta["val"].shape[1]
    e = lambda target, *a, **k: _emit(graph, fake_mode, node, target, *a, **k)  # noqa: E731
    with graph.inserting_before(node):
        m = e(aten.amax.default, e(aten.detach.default, x), [1], True)  # no grad: amax keeps nothing
        z = e(aten.sub.Tensor, x, m)
        s = e(aten.sum.dim_IntList, e(aten.exp.default, z), [1], True)
        log_s = e(aten.log.default, s)
        valid = e(aten.ne.Scalar, t, ignore)
        t_safe = e(aten.where.self, valid, t, e(aten.zeros_like.default, t))
        zt = e(aten.gather.default, z, 1, e(aten.unsqueeze.default, t_safe, 1))
        nll = e(aten.sub.Tensor, log_s, zt)
        if eps > 0.0:
            mean_z = e(aten.div.Tensor, e(aten.sum.dim_IntList, z, [1], True), num_classes)
            smooth = e(aten.sub.Tensor, log_s, mean_z)
            nll = e(aten.add.Tensor, e(aten.mul.Tensor, nll, 1.0 - eps), e(aten.mul.Tensor, smooth, eps))
        nll = e(aten.squeeze.dim, nll, 1)
        validf = e(aten._to_copy.default, valid, dtype=x.meta["val"].dtype)
        nll = e(aten.mul.Tensor, nll, validf)
        if reduction == "none":
            out = nll
        elif reduction == "sum":
            out = e(aten.sum.default, nll)
        else:
            out = e(aten.div.Tensor, e(aten.sum.default, nll), e(aten.sum.default, validf))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def cross_entropy_reference(
    x: torch.Tensor, t: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0
) -> torch.Tensor:
    """The decomposition above in eager PyTorch (tests compare it with F.cross_entropy)."""
    m = x.detach().amax(1, keepdim=True)
    z = x - m
    log_s = z.exp().sum(1, keepdim=True).log()
    valid = t != ignore_index
    zt = z.gather(1, torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1))
    nll = log_s - zt
    if label_smoothing > 0:
        nll = nll * (1 - label_smoothing) + (log_s - z.sum(1, keepdim=True) / x.shape[1]) * label_smoothing
    nll = nll.squeeze(1) * valid.to(x.dtype)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / valid.to(x.dtype).sum()
