"""Rules for reductions and scans: sum, mean, amax/amin, max/min, arg*, var/std, any/all,
logsumexp, prod, softmax/log_softmax, cumsum, diff, topk/sort, histc.

One generator, ``reduction_strategies``, covers every reduction on one mesh axis:

- a dim that is *not* reduced may be sharded: input ``S(d)``, every output
  ``S(d')`` with ``d'`` the dim's place in the output (``d`` with ``keepdim``,
  ``d`` minus the reduced dims before it without);
- a reduced dim may be sharded only when the op has a Partial form: ``sum`` ->
  ``P(sum)``, ``amax``/``max`` -> ``P(max)``; the rest (amin, min, arg*, var,
  logsumexp, any/all, prod, max.dim's indices) need a collective and offer nothing;
- a Partial input passes through when the op commutes with the reduction over
  ranks: ``P(sum)`` through sum, mean and cumsum (linear), ``P(max)`` through
  amax/max.

Mean over a sharded dim: each rank's local *mean* weighs its piece by the local
count, so summing local means is wrong (and stays wrong for uneven shards even
after dividing by the axis size).  The strategy is offered with the kernel
``"mean_as_partial_sum"``: each rank sums its piece and divides by the *global*
count of the reduced dims (from ``KernelContext.input_metas``), giving an exact
``P(sum)`` for even and uneven shards alike.  The kernel is also correct on every
other axis of the strategy, so it may be named on some axes and not others.

Softmax-like ops (softmax, log_softmax, their underscored forms) normalize along
one dim: ``S`` on every other dim, never ``P``.  ``cumsum`` scans one dim and ``diff``
differences along one: ``S`` on the others, ``P(sum)`` passes through.  Block hints on
an output dim add ``S(·)[b]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from autopar.placement import Partial, Placement, Replicate, Shard

from .base import AxisStrategy, OpCall, hinted_blocks, register
from .kernels import KernelContext, register_kernel
from .pointwise import arg, norm_dim, resolve_ops
from .views import bound_args

__all__ = ["reduction_strategies", "reduced_dims", "MEAN_KERNEL"]

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")
PMAX = Partial("max")

#: Kernel name of the mean-over-a-sharded-dim strategy.
MEAN_KERNEL = "mean_as_partial_sum"


def reduced_dims(call: OpCall, dim_arg, ndim: int) -> list[int]:
    """Normalized reduced dims; ``None`` or an empty list means every dim (aten's convention)."""
    if dim_arg is None:
        return list(range(ndim))
    dims = [dim_arg] if isinstance(dim_arg, int) else list(dim_arg)
    if not dims:
        return list(range(ndim))
    return sorted({norm_dim(d, ndim, call.name) for d in dims}) if ndim else []


def reduction_strategies(
    call: OpCall,
    axis_size: int,
    dims: Sequence[int],
    keepdim: bool,
    *,
    on_reduced: Placement | None = None,
    kernel: str | None = None,
    passthrough: Sequence[Partial] = (),
) -> list[AxisStrategy]:
    """Strategies of a reduction of input 0 over ``dims`` (module docstring).

    ``on_reduced``: the output placement when a reduced dim is sharded (None: not
    offered); ``kernel``: the local kernel that strategy needs; ``passthrough``:
    Partial placements that go through unchanged.  Extra tensor inputs are ``R``.
    """
    x = call.inputs[0]
    n_in, n_out = len(call.inputs), len(call.outputs)
    dims = set(dims)
    out: list[AxisStrategy] = []
    rest = (R,) * (n_in - 1)
    for d in range(x.ndim):
        if x.shape[d] < axis_size:
            continue
        if d in dims:
            if on_reduced is not None:
                out.append(AxisStrategy((Shard(d),) + rest, (on_reduced,) * n_out, kernel=kernel))
            continue
        od = d if keepdim else d - sum(1 for r in dims if r < d)
        for blocks in [1] + hinted_blocks(call, 0, od):
            if x.shape[d] % blocks == 0:
                out.append(AxisStrategy((Shard(d, blocks),) + rest, (Shard(od, blocks),) * n_out))
    for p in passthrough:
        out.append(AxisStrategy((p,) + rest, (p,) * n_out))
    return out


def _keepdim(call: OpCall, index: int) -> bool:
    return bool(arg(call, index, "keepdim", False))


@register(*resolve_ops(["sum.dim_IntList", "sum.default"]))
def sum_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """sum: sharded reduced dim -> P(sum); P(sum) passes through."""
    x = call.inputs[0]
    full = call.target is aten.sum.default
    dims = reduced_dims(call, None if full else arg(call, 1, "dim"), x.ndim)
    keep = False if full else _keepdim(call, 2)
    return reduction_strategies(call, axis_size, dims, keep, on_reduced=PSUM, passthrough=(PSUM,))


@register(*resolve_ops(["mean.dim", "mean.default"]))
def mean_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """mean: sharded reduced dim -> P(sum) through the ``mean_as_partial_sum`` kernel; P(sum) passes through."""
    x = call.inputs[0]
    full = call.target is aten.mean.default
    dims = reduced_dims(call, None if full else arg(call, 1, "dim"), x.ndim)
    keep = False if full else _keepdim(call, 2)
    return reduction_strategies(call, axis_size, dims, keep, on_reduced=PSUM, kernel=MEAN_KERNEL, passthrough=(PSUM,))


@register_kernel(MEAN_KERNEL)
def mean_as_partial_sum(
    ctx: KernelContext, x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Local sum over the reduced dims divided by their *global* element count: a P(sum) piece of the mean."""
    shape = ctx.input_metas[0].shape
    dims = (
        list(range(len(shape)))
        if dim is None or (not isinstance(dim, int) and not list(dim))
        else ([dim] if isinstance(dim, int) else list(dim))
    )
    count = math.prod(shape[d] for d in dims)
    acc = dtype if dtype is not None else x.dtype
    if not dims or not shape:
        return x.to(acc).clone()
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=acc) / count


@register(*resolve_ops(["amax.default", "max.default"]))
def amax_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """amax / max (full): sharded reduced dim -> P(max); P(max) passes through."""
    x = call.inputs[0]
    full = call.target is aten.max.default
    dims = reduced_dims(call, None if full else arg(call, 1, "dim", []), x.ndim)
    keep = False if full else _keepdim(call, 2)
    return reduction_strategies(call, axis_size, dims, keep, on_reduced=PMAX, passthrough=(PMAX,))


#: Reductions with no Partial form: schema positions of ``dim`` and ``keepdim``
#: (None: keyword-only).  Their full-reduction overloads keep no dim to shard and
#: are left to the replicate fallback.
_NONLINEAR: dict[str, tuple[int, int | None]] = {
    "amin.default": (1, 2),
    "logsumexp.default": (1, 2),
    "prod.dim_int": (1, 2),
    "any.dim": (1, 2),
    "any.dims": (1, 2),
    "all.dim": (1, 2),
    "all.dims": (1, 2),
    "max.dim": (1, 2),
    "min.dim": (1, 2),
    "argmax.default": (1, 2),
    "argmin.default": (1, 2),
    "var.dim": (1, 3),
    "std.dim": (1, 3),
    "var.correction": (1, None),
    "std.correction": (1, None),
}
_NONLINEAR_OPS = {op: pos for name, pos in _NONLINEAR.items() for op in resolve_ops([name])}


@register(*_NONLINEAR_OPS)
def reduce_nonlinear_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Reductions with no Partial form: only the dims they keep may be sharded."""
    dim_pos, keep_pos = _NONLINEAR_OPS[call.target]
    dim = arg(call, dim_pos, "dim")
    if dim is None and call.target in (aten.argmax.default, aten.argmin.default):
        return []  # reduces the flattened tensor
    dims = reduced_dims(call, dim, call.inputs[0].ndim)
    keep = bool(call.kwargs.get("keepdim", False) if keep_pos is None else arg(call, keep_pos, "keepdim", False))
    return reduction_strategies(call, axis_size, dims, keep)


@register(*resolve_ops(["_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int"]))
def softmax_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """softmax-like: S on every dim but the normalized one."""
    x = call.inputs[0]
    d = norm_dim(arg(call, 1, "dim"), x.ndim, call.name)
    return _all_but(call, axis_size, d, passthrough=())


@register(*resolve_ops(["cumsum.default", "cumprod.default", "logcumsumexp.default"]))
def scan_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Scans: S on every dim but the scanned one; P(sum) passes through cumsum (linear)."""
    x = call.inputs[0]
    d = norm_dim(arg(call, 1, "dim"), x.ndim, call.name)
    return _all_but(call, axis_size, d, passthrough=(PSUM,) if call.target is aten.cumsum.default else ())


@register(*resolve_ops(["topk.default", "sort.default", "sort.stable", "argsort.default", "argsort.stable"]))
def select_along_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """topk / sort / argsort along ``dim``: ``S`` on every other dim (values and indices alike), never ``P``.

    Sharding ``dim`` itself would need a merge of the ranks' candidates (a collective).
    """
    x = call.inputs[0]
    d_skip = norm_dim(bound_args(call)["dim"], x.ndim, call.name)
    n_out = len(call.outputs)
    return [
        AxisStrategy((Shard(d),), (Shard(d),) * n_out) for d in range(x.ndim) if d != d_skip and x.shape[d] >= axis_size
    ]


@register(*resolve_ops(["diff.default"]))
def diff_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """diff(self, n, dim, prepend, append): neighbour differences along ``dim``.

    ``S(d)`` for every ``d != dim`` on self and on ``prepend``/``append`` where they
    have self's size there (``R`` where they broadcast it); ``dim`` itself is never
    sharded (a difference spans two neighbouring pieces).  Linear in all its tensor
    inputs together: all ``P(sum)`` -> ``P(sum)``.
    """
    x = call.inputs[0]
    d_skip = norm_dim(arg(call, 2, "dim", -1), x.ndim, call.name)
    out = []
    for d in range(x.ndim):
        if d == d_skip or x.shape[d] < axis_size:
            continue
        ins = tuple(Shard(d) if m.ndim == x.ndim and m.shape[d] == x.shape[d] else R for m in call.inputs)
        out.append(AxisStrategy(ins, (Shard(d),)))
    out.append(AxisStrategy((PSUM,) * len(call.inputs), (PSUM,)))
    return out


@register(*resolve_ops(["histc.default"]))
def histc_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """histc(self, bins, min, max): counts of every element in ``bins`` equal bins of [min, max].

    Input ``S(d)`` (any dim) -> counts ``P(sum)``: every element lands in one rank's
    histogram, so the histograms add up (MoE routers count tokens per expert this way).
    Only for a fixed range (``min < max``): with ``min == max`` torch takes the range
    from the data, which differs from rank to rank.
    """
    args = bound_args(call)
    if not args["min"] < args["max"]:
        return []
    return [AxisStrategy((Shard(d),), (PSUM,)) for d in range(call.inputs[0].ndim)]


def _all_but(call: OpCall, axis_size: int, skip: int, passthrough: Sequence[Partial]) -> list[AxisStrategy]:
    x = call.inputs[0]
    out = []
    for d in range(x.ndim):
        if d == skip or x.shape[d] < axis_size:
            continue
        for blocks in [1] + hinted_blocks(call, 0, d):
            if x.shape[d] % blocks == 0:
                out.append(AxisStrategy((Shard(d, blocks),), (Shard(d, blocks),)))
    out += [AxisStrategy((p,), (p,)) for p in passthrough]
    return out
