"""Rules for lookups: ``embedding``, ``gather``, ``index_select``, advanced indexing (``index``, ``index_put``),
and their writing counterparts ``scatter``/``scatter_add``.

Each op reads rows of a table at integer positions.  On one mesh axis the table
can be split along the looked-up dim (vocab-parallel, Megatron/Paddle style):
each rank looks up only the rows it holds, writes zeros elsewhere, and the
output is ``P(sum)`` - exactly one rank holds each row, so the sum is the full
lookup.  Those strategies run the kernels ``masked_embedding``,
``masked_gather`` and ``masked_index_select`` (``autopar.strategies.kernels``), which take
the rank's global row ranges from ``KernelContext.shard_ranges`` and so work
for uneven shards (GPT-2's 50257-row vocabulary on 4 ranks).

Why the table split along the looked-up dim is never combined with split
indices on the same axis: the output would then have to be both split (by the
indices) and a partial sum (by the table) on one axis.  Rank r would hold only
its own positions, but the rows those positions need may live on another rank,
and no single placement of the output describes "my positions, my rows only".
"""

from __future__ import annotations

import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.spec import TensorMeta

from .base import AxisStrategy, OpCall, register
from .views import bound_args, hinted_blocks

__all__: list[str] = []

aten = torch.ops.aten
_R = Replicate()
_SUM = Partial("sum")


@register(aten.embedding.default)
def embedding_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """embedding(weight (V, D), indices (...)) -> (..., D).

    1. data parallel: indices ``S(i)``, weight ``R`` -> out ``S(i)``;
    2. embedding dim: weight ``S(1)``, indices ``R`` -> out ``S(last)`` (block-wise
       too when a consumer asks for blocks on the last dim);
    3. vocab-parallel: weight ``S(0)``, indices ``R`` -> out ``P(sum)``, kernel
       ``masked_embedding``.
    """
    weight, indices = call.inputs
    out = call.outputs[0]
    last = out.ndim - 1
    strategies = [AxisStrategy((_R, Shard(i)), (Shard(i),)) for i in range(indices.ndim)]
    for b in [1] + hinted_blocks(call, 0, last):
        if weight.ndim == 2 and weight.shape[1] % b == 0:
            strategies.append(AxisStrategy((Shard(1, b), _R), (Shard(last, b),)))
    if out.is_float:
        strategies.append(AxisStrategy((Shard(0), _R), (_SUM,), kernel="masked_embedding"))
    return strategies


@register(aten.gather.default)
def gather_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """gather(self, dim, index) -> out shaped like index; ``out[..i..] = self[..index[..i..]..]`` on ``dim``.

    1. self ``S(dim)``, index ``R`` -> out ``P(sum)``, kernel ``masked_gather``
       (the vocab-parallel cross-entropy's target logit);
    2. self ``S(d)``, index ``S(d)`` -> out ``S(d)`` for ``d != dim`` when self and
       index have the same size on ``d`` (the same split on both);
    3. self ``R``, index ``S(dim)`` -> out ``S(dim)``: positions along ``dim`` come
       from index values, so any split of the index rows is fine (not for other
       dims: there the local index position must match self's);
    4. self ``P(op)``, index ``R`` -> out ``P(op)``: gather selects, so it commutes
       with sum and max.
    """
    src, index = call.inputs
    out = call.outputs[0]
    dim = bound_args(call)["dim"] % max(src.ndim, 1)
    strategies = []
    if out.is_float:
        strategies.append(AxisStrategy((Shard(dim), _R), (_SUM,), kernel="masked_gather"))
    for d in range(src.ndim):
        if d != dim and src.shape[d] == index.shape[d]:
            strategies.append(AxisStrategy((Shard(d), Shard(d)), (Shard(d),)))
    if index.ndim:
        strategies.append(AxisStrategy((_R, Shard(dim)), (Shard(dim),)))
    strategies += [AxisStrategy((Partial(op), _R), (Partial(op),)) for op in ("sum", "max")]
    return strategies


@register(aten.index_select.default)
def index_select_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """index_select(self, dim, index (k,)) -> self's shape with ``dim`` of size k.

    1. self ``S(d)``, index ``R`` -> out ``S(d)`` for ``d != dim``;
    2. self ``R``, index ``S(0)`` -> out ``S(dim)``;
    3. self ``S(dim)``, index ``R`` -> out ``P(sum)``, kernel ``masked_index_select``;
    4. self ``P(op)``, index ``R`` -> out ``P(op)``.
    """
    src, index = call.inputs
    out = call.outputs[0]
    dim = bound_args(call)["dim"] % max(src.ndim, 1)
    strategies = [AxisStrategy((Shard(d), _R), (Shard(d),)) for d in range(src.ndim) if d != dim]
    if index.ndim == 1 and src.ndim:
        strategies.append(AxisStrategy((_R, Shard(0)), (Shard(dim),)))
    if out.is_float and src.ndim:
        strategies.append(AxisStrategy((Shard(dim), _R), (_SUM,), kernel="masked_index_select"))
    strategies += [AxisStrategy((Partial(op), _R), (Partial(op),)) for op in ("sum", "max")]
    return strategies


def _index_layout(src: TensorMeta, indices: list) -> tuple[dict[int, int], int] | None:
    """Where ``src[indices]`` puts each dim: ({kept src dim: out dim}, out dim of the first index dim).

    ``indices`` is ``index.Tensor``'s list (None for a whole dim, a TensorMeta for an
    index tensor).  The index tensors broadcast together to ``nb`` dims, which replace
    the indexed dims in place when those are adjacent and go first otherwise (NumPy's
    rule).  None when an index is a bool mask (its output size depends on values).
    """
    indexed = [i for i, x in enumerate(indices) if x is not None]
    metas = [x for x in indices if x is not None]
    if not indexed or any(m.dtype in (torch.bool, torch.uint8) for m in metas):
        return None
    nb = max(m.ndim for m in metas)
    adjacent = indexed[-1] - indexed[0] + 1 == len(indexed)
    first = indexed[0] if adjacent else 0
    kept = [d for d in range(src.ndim) if d not in indexed]
    mapping = {}
    for d in kept:
        before = d < indexed[0] if adjacent else False
        mapping[d] = d if before else (first + nb + (d - len(indexed) - first if adjacent else kept.index(d)))
    return mapping, first


@register(aten.index.Tensor, aten._unsafe_index.Tensor)
def index_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """index(self, indices): ``self[i0, :, i2, ...]`` with integer index tensors (advanced indexing).

    1. a dim no tensor indexes: self ``S(d)``, indices ``R`` -> out ``S`` where the dim lands;
    2. a dim of the indices' broadcast shape: self ``R``, every index tensor ``S`` on
       it (``R`` where it broadcasts) -> out ``S`` there: each output element reads
       only its own index values, so any split of them is fine;
    3. self ``P(op)``, indices ``R`` -> out ``P(op)``: indexing selects, so it
       commutes with sum and max.

    Bool-mask indices (data-dependent output size) get no rule (replicate).
    """
    src, out = call.inputs[0], call.outputs[0]
    indices = list(bound_args(call)["indices"])
    layout = _index_layout(src, indices)
    if layout is None:
        return []
    mapping, first = layout
    metas = call.inputs[1:]
    rest = (_R,) * len(metas)
    strategies = [AxisStrategy((Shard(d),) + rest, (Shard(o),)) for d, o in mapping.items()]
    nb = max(m.ndim for m in metas)
    for j in range(nb):
        size = out.shape[first + j]
        placed = [
            Shard(j - (nb - m.ndim)) if j >= nb - m.ndim and m.shape[j - (nb - m.ndim)] == size else _R for m in metas
        ]
        if size > 1 and any(isinstance(p, Shard) for p in placed):
            strategies.append(AxisStrategy((_R, *placed), (Shard(first + j),)))
    if out.is_float:
        strategies += [AxisStrategy((Partial(op),) + rest, (Partial(op),)) for op in ("sum", "max")]
    return strategies


@register(aten.index_put.default)
def index_put_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """index_put(self, indices, values, accumulate): ``self[indices] = values`` (``+=`` with accumulate).

    1. a dim no tensor indexes: self ``S(d)``, out ``S(d)``, values ``S`` on the dim
       it lines up with in ``self[indices]`` (``R`` where values broadcast it),
       indices ``R``: each rank writes its own slice of every selected row;
    2. self and values ``P(sum)``, indices ``R`` -> out ``P(sum)``: the written
       positions hold the sum of the values' pieces (or self's plus them), the
       others self's pieces, with or without accumulate.

    Bool-mask indices get no rule (replicate).
    """
    src, out = call.inputs[0], call.outputs[0]
    args = bound_args(call)
    layout = _index_layout(src, list(args["indices"]))
    if layout is None:
        return []
    mapping, _ = layout
    values = call.inputs[-1]
    n_idx = len(call.inputs) - 2
    sel_ndim = src.ndim - sum(1 for x in args["indices"] if x is not None) + max(m.ndim for m in call.inputs[1:-1])
    strategies = []
    for d, o in mapping.items():
        vd = o - (sel_ndim - values.ndim)
        vp = Shard(vd) if vd >= 0 and values.shape[vd] == src.shape[d] else _R
        strategies.append(AxisStrategy((Shard(d),) + (_R,) * n_idx + (vp,), (Shard(d),)))
    if out.is_float:
        strategies.append(AxisStrategy((_SUM,) + (_R,) * n_idx + (_SUM,), (_SUM,)))
    return strategies


@register(aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def scatter_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """scatter(self, dim, index, value | src) / scatter_add(self, dim, index, src): ``self`` with
    ``out[..index[..i..]..] = src[..i..]`` on ``dim`` (``+=`` for scatter_add; ``value`` for every i).

    1. a dim ``d != dim`` on which self, index and src have the same size: all ``S(d)``
       -> out ``S(d)``; each rank writes its own slice of the selected rows (DeepSeek's
       group mask ``zeros_like(scores).scatter_(1, idx, 1)`` on batch-sharded scores);
    2. ``src``/``scatter_add``: self and src ``P(sum)``, index ``R`` -> out ``P(sum)``: the
       written positions hold the sum of src's pieces (plus self's for scatter_add), the
       others self's.  Not for ``scatter.value``: every rank would write the value.
    """
    src_self, index = call.inputs[0], call.inputs[1]
    values = call.inputs[2:]  # src (scatter.src, scatter_add), none for scatter.value
    dim = bound_args(call)["dim"] % max(src_self.ndim, 1)
    strategies = []
    if index.ndim == src_self.ndim:
        for d in range(src_self.ndim):
            if d != dim and all(m.shape[d] == src_self.shape[d] for m in (index, *values)):
                strategies.append(AxisStrategy((Shard(d),) * len(call.inputs), (Shard(d),)))
    if values and call.outputs[0].is_float:
        strategies.append(AxisStrategy((_SUM, _R, _SUM), (_SUM,)))
    return strategies
