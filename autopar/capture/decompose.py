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
op (then planned by its rule or the replicate fallback).  Every node the rewrite
emits carries ``node.meta[DECOMPOSED]``, a ``CrossEntropyPart`` (the loss it
came from and its role above): where the plan keeps the classes whole, lowering
runs the pieces from ``x`` to ``nll * valid`` as one fused log-softmax again
(``lower/fused_loss.py``: the rule; ``strategies/fuse.py``: what it saves).

Two smaller rewrites make other models' ops plannable by the existing rules:

* ``x.type_as(other)`` -> ``x.to(other.dtype)`` (RoBERTa, Gemma): ``other`` is read
  for its dtype only, so it is not made a data input that would need a placement;
* an in-place op on an intermediate -> its out-of-place form, the aliases read
  afterwards rebuilt from the result (Falcon's ``mlp_output += attention_output``,
  T5's ``shifted[..., 1:] = ids[..., :-1]``): see ``_functionalize_inplace``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["decompose_for_planning", "cross_entropy_reference", "CrossEntropyPart", "DECOMPOSED", "LOGIT_ROLES"]

log = logging.getLogger(__name__)
aten = torch.ops.aten
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}

#: ``node.meta`` key of every node ``_decompose_cross_entropy`` emits: a ``CrossEntropyPart``
DECOMPOSED = "autopar_decomposed"
#: the roles computed from the logits, up to the masked per-row loss ``"masked"`` (``nll * valid``):
#: what lowering may run as one fused log-softmax where the class dim is whole (``autopar/lower/fused_loss.py``)
LOGIT_ROLES = frozenset(
    "max_input max shifted exp sum_exp log_sum_exp target_logit nll "
    "sum_logit mean_logit smooth nll_part smooth_part smoothed rows masked".split()
)


@dataclass(frozen=True, slots=True)
class CrossEntropyPart:
    """What one node of a decomposed cross-entropy is (``node.meta[DECOMPOSED]``).

    ``group``: the name of the ``cross_entropy_loss`` node it replaces (one per
    loss); ``role``: which line of the decomposition (module docstring) it computes:
    ``max_input``/``max`` (``m``), ``shifted`` (``z``), ``exp``, ``sum_exp`` (``s``),
    ``log_sum_exp``, ``valid``, ``zeros``, ``safe_target`` (``t'``), ``index``
    (``t'`` unsqueezed), ``target_logit`` (``zt``), ``nll``, the smoothing terms
    (``sum_logit``, ``mean_logit``, ``smooth``, ``nll_part``, ``smooth_part``,
    ``smoothed``), ``rows`` (per-row loss), ``valid_float``, ``masked`` (``nll *
    valid``), ``total``, ``count``, ``mean``.  ``label_smoothing`` and
    ``num_classes`` are the loss's, so a pass can rebuild the rows from the logits.
    """

    group: str
    role: str
    label_smoothing: float
    num_classes: int


def decompose_for_planning(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` in place (every decomposition this module knows)."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(vals)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.cross_entropy_loss.default:
            _decompose_cross_entropy(gm.graph, node, fake_mode)
        elif node.target is aten.type_as.default:
            _decompose_type_as(gm.graph, node, fake_mode)
        else:
            _functionalize_inplace(gm.graph, node, fake_mode)


def _decompose_type_as(graph: fx.Graph, node: fx.Node, fake_mode) -> None:
    """``x.type_as(other)`` -> ``x.to(other.dtype)``: only other's dtype is read, so it is no data input."""
    x, other = node.args[0], node.args[1]
    with graph.inserting_before(node):
        out = _emit(graph, fake_mode, node, aten.to.dtype, x, other.meta["val"].dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _functional_of(target):
    """The out-of-place overload of an in-place aten op (``add_.Tensor`` -> ``add.Tensor``), or None."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.name.endswith("_") or schema.name.endswith("__"):
        return None
    first = schema.arguments[0] if schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write:
        return None
    packet = getattr(aten, schema.name.split("::")[-1][:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _storage(node: fx.Node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


#: views that keep every element in order (their inverse is a reshape back to the parent's shape)
_RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.alias.default,
}


def _scatter_back(view: fx.Node, new_child: fx.Node):
    """(target, args) computing the parent of ``view`` with ``view``'s elements replaced by ``new_child``.

    None for a view with no such inverse here (expand, as_strided, diagonal, ...).
    """
    parent, t = view.args[0], view.target
    rest = list(view.args[1:])
    if t is aten.slice.Tensor:
        return aten.slice_scatter.default, (parent, new_child, *rest)
    if t is aten.select.int:
        return aten.select_scatter.default, (parent, new_child, *rest)
    if t in _RESHAPES and not view.kwargs:
        return aten.reshape.default, (new_child, list(parent.meta["val"].shape))
    if t is aten.transpose.int and not view.kwargs:
        return aten.transpose.int, (new_child, *rest)
    if t is aten.permute.default and not view.kwargs:
        dims = [d % len(rest[0]) for d in rest[0]]
        return aten.permute.default, (new_child, sorted(range(len(dims)), key=dims.__getitem__))
    return None


def _functionalize_inplace(graph: fx.Graph, node: fx.Node, fake_mode) -> None:
    """``a.add_(b)`` on an intermediate ``a`` -> ``a2 = add(a, b)``, later reads of ``a``'s aliases rebuilt from ``a2``.

    Rules see values, not buffers: an in-place op would make the planner place
    ``a`` and the op's output independently although they are one storage, and a
    rank running it on a redistributed copy would not update the views it holds.
    The rewrite (functionalization, as torch's own) is exact: ``a`` is a chain of
    views of the tensor ``r`` that owns the storage (often ``a`` itself), ``r2`` is
    ``r`` with ``a2`` scattered back along that chain (``slice_scatter``,
    ``select_scatter``, an inverse reshape or permutation: T5's
    ``shifted[..., 1:] = ids[..., :-1]``), and every alias read after the op, a
    chain of views of ``r``, reads that chain replayed on ``r2``.

    Left in place (the op falls back to replicate): graph inputs (parameters,
    buffers, user inputs), and aliases this cannot rebuild (a view with no inverse
    here, or an alias that is no chain of views of ``r``); a warning names them.
    """
    functional = _functional_of(node.target)
    if functional is None or not node.args or not isinstance(node.args[0], fx.Node):
        return
    base = node.args[0]
    ref = _storage(base)
    if base.op != "call_function" or ref is None:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    # values sharing ``a``'s storage made before the op: the mutation shows through every one of them
    aliases = {n for n in graph.nodes if order[n] < order[node] and (s := _storage(n)) is not None and s == ref}

    def parent(x: fx.Node) -> fx.Node | None:
        ok = x.op == "call_function" and x.args and isinstance(x.args[0], fx.Node) and x.args[0] in aliases
        return x.args[0] if ok else None

    up = [base]  # base, its parent, ..., the storage owner
    while (p := parent(up[-1])) is not None:
        up.append(p)
    root = up[-1]
    chains: dict[fx.Node, list[fx.Node]] = {}
    for a in sorted(aliases, key=order.__getitem__):
        if not any(order[u] > order[node] for u in a.users if u is not node):
            continue
        chain, x = [], a
        while x is not root and (p := parent(x)) is not None:
            chain.append(x)
            x = p
        if x is not root:
            return _leave(node, a)
        chains[a] = chain[::-1]
    if any(_scatter_back(v, v) is None for v in up[:-1]):
        return _leave(node, root)
    with graph.inserting_before(node):
        if functional is aten.copy.default:  # no autograd formula: the value is src cast and broadcast
            dst, src = node.args[0].meta["val"], node.args[1]
            out = _emit(graph, fake_mode, node, aten._to_copy.default, src, dtype=dst.dtype)
            if tuple(out.meta["val"].shape) != tuple(dst.shape):
                out = _emit(graph, fake_mode, node, aten.expand.default, out, list(dst.shape))
        else:
            out = _emit(graph, fake_mode, node, functional, *node.args, **node.kwargs)
    new = cursor = out
    for v in up[:-1]:  # scatter the new value back up to the storage owner
        target, args = _scatter_back(v, new)
        with graph.inserting_after(cursor):
            new = cursor = _emit(graph, fake_mode, v, target, *args)
    replayed: dict[fx.Node, fx.Node] = {root: new}
    for a, chain in chains.items():
        for v in chain:
            if v not in replayed:
                with graph.inserting_after(cursor):
                    replayed[v] = cursor = _emit(
                        graph, fake_mode, v, v.target, replayed[v.args[0]], *v.args[1:], **v.kwargs
                    )
        for u in [u for u in a.users if u is not node and order.get(u, -1) > order[node]]:
            u.replace_input_with(a, replayed[a])
            _refresh_aliases(u, ref, fake_mode)
    node.replace_all_uses_with(out)  # the op returns its (mutated) first argument
    graph.erase_node(node)


def _refresh_aliases(node: fx.Node, old, fake_mode) -> None:
    """``node``, just re-pointed at a rewritten value, and the views read through it: recompute
    ``meta["val"]`` of each that still aliased the old storage ``old``, so a later in-place op
    on them is seen as writing the new value (BART: ``s[:, 1:] = ...`` then ``s[:, 0] = 2``;
    with a stale meta the second write looked like one into a dead tensor and was dropped)."""
    mine = _storage(node)
    if mine is None or mine != old:
        return
    node.meta["val"] = _fake_value(fake_mode, node.target, node.args, node.kwargs)
    for user in node.users:
        _refresh_aliases(user, old, fake_mode)


def _leave(node: fx.Node, alias: fx.Node) -> None:
    log.warning(
        "%s is left in place (replicated): %s shares the storage it mutates and is read afterwards, and "
        "autopar cannot rebuild it from an out-of-place result; write the update out of place in the model "
        "(e.g. torch.cat or Tensor.slice_scatter) to let it be sharded",
        node.format_node(),
        alias.name,
    )


def _emit(graph: fx.Graph, fake_mode, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """Insert ``target(*args)`` with its meta (val computed on fake tensors, module path kept)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["nn_module_stack"] = like.meta.get("nn_module_stack", {})
    node.meta["stack_trace"] = like.meta.get("stack_trace")
    node.meta["val"] = _fake_value(fake_mode, target, args, kwargs)
    return node


def _fake_value(fake_mode, target, args, kwargs):
    """``target(*args, **kwargs)`` run on the argument nodes' ``meta["val"]`` (fake tensors)."""
    fargs = fx.node.map_arg(args, lambda n: n.meta["val"])
    fkwargs = fx.node.map_arg(kwargs, lambda n: n.meta["val"])
    if fake_mode is None:
        return target(*fargs, **fkwargs)
    with fake_mode:
        return target(*fargs, **fkwargs)


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

    def e(role: str, target, *a, **k) -> fx.Node:
        out = _emit(graph, fake_mode, node, target, *a, **k)
        out.meta[DECOMPOSED] = CrossEntropyPart(node.name, role, eps, num_classes)
        return out

    with graph.inserting_before(node):
        m = e("max", aten.amax.default, e("max_input", aten.detach.default, x), [1], True)  # no grad: keeps nothing
        z = e("shifted", aten.sub.Tensor, x, m)
        s = e("sum_exp", aten.sum.dim_IntList, e("exp", aten.exp.default, z), [1], True)
        log_s = e("log_sum_exp", aten.log.default, s)
        valid = e("valid", aten.ne.Scalar, t, ignore)
        t_safe = e("safe_target", aten.where.self, valid, t, e("zeros", aten.zeros_like.default, t))
        zt = e("target_logit", aten.gather.default, z, 1, e("index", aten.unsqueeze.default, t_safe, 1))
        nll = e("nll", aten.sub.Tensor, log_s, zt)
        if eps > 0.0:
            mean_z = e("mean_logit", aten.div.Tensor, e("sum_logit", aten.sum.dim_IntList, z, [1], True), num_classes)
            smooth = e("smooth", aten.sub.Tensor, log_s, mean_z)
            nll = e(
                "smoothed",
                aten.add.Tensor,
                e("nll_part", aten.mul.Tensor, nll, 1.0 - eps),
                e("smooth_part", aten.mul.Tensor, smooth, eps),
            )
        nll = e("rows", aten.squeeze.dim, nll, 1)
        validf = e("valid_float", aten._to_copy.default, valid, dtype=x.meta["val"].dtype)
        nll = e("masked", aten.mul.Tensor, nll, validf)
        if reduction == "none":
            out = nll
        elif reduction == "sum":
            out = e("total", aten.sum.default, nll)
        else:
            out = e("mean", aten.div.Tensor, e("total", aten.sum.default, nll), e("count", aten.sum.default, validf))
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
