"""Rules for convolutions: conv1d/2d/3d (int and string padding), conv_transpose1d/2d/3d, convolution.

A convolution with ``G`` groups cuts its input channels into ``G`` equal groups and
its output channels likewise; output group ``g`` reads input group ``g`` only.  The
weight is ``(C_out, C_in/G, *k)`` (transposed: ``(C_in, C_out/G, *k)``), so on the
weight one channel side is laid out as ``G`` blocks on dim 0 and the other side is
the per-group count.  ``G`` is read from the shapes the rule is given
(``C_in / weight.shape[1]``; transposed ``C_out / weight.shape[1]``), which are
local after earlier mesh axes: an axis that splits whole groups leaves fewer.

Strategies on one mesh axis of ``n`` ranks (``c`` is the channel dim: 1, or 0 for
an unbatched input), each exact for uneven ``torch.tensor_split`` pieces unless said:

1. batch: input ``S(0)`` -> output ``S(0)``, weight and bias ``R`` (images are
   independent);
2. output channels inside every group, input ``R``: the weight's output side
   ``S[G]``, bias ``S(0)[G]`` -> output ``S(c)[G]`` (``S(c)`` when ``G == 1``).  Each
   rank holds the same share of every group's output channels with the weight rows
   that make them, so the op with the same ``groups`` gives exactly them;
3. whole groups (``G > 1`` and ``n`` divides ``G``): input ``S(c)``, weight ``S(0)``,
   bias ``S(0)`` -> output ``S(c)``.  Each rank holds ``G/n`` whole groups of input,
   weight and output, and runs the op with ``groups = G/n`` (the
   ``conv_group_split`` kernels).  Depthwise convolutions (``G == C_in``) split this
   way with no communication;
4. input channels inside every group: input ``S(c)[G]``, the weight's input side
   ``S[G]`` -> output ``P(sum)``, bias ``P(sum)``.  Each rank sums its share of every
   group's input channels; the bias, ``R -> P`` for free, is added once in total;
5. linearity: input or weight ``P(sum)``, the other ``R``, bias ``P(sum)`` ->
   output ``P(sum)`` (a convolution is bilinear in input and weight);
6. spatial dim ``j`` of a non-transposed convolution whose windows tile it
   (padding 0, dilated kernel span <= stride, ``size == out_size * stride``): input
   and output ``S(c+1+j)``, weight and bias ``R``.  Exact when the stride is 1 or
   ``n`` divides the output size, so every input piece is whole windows (ViT's patch
   embedding; a 1x1 convolution at any size).

Splits inside groups (2 and 4) need more channels per group than ranks: a rule
sees the largest piece earlier axes left, and other ranks may hold one channel
fewer, which must still give every rank a channel (a convolution over zero
channels fails or returns the wrong shape, unlike a zero-length ``mm``).
Overlapping windows would need halo exchange: not offered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from autopar.placement import Partial, Placement, Replicate, Shard

from .base import AxisStrategy, OpCall, register
from .kernels import KernelContext, register_kernel
from .pointwise import resolve_ops

__all__ = ["conv_strategies", "conv_groups", "GROUP_SPLIT_KERNELS"]

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")

_OPS = resolve_ops(
    [
        "conv1d.default",
        "conv2d.default",
        "conv3d.default",
        "conv1d.padding",
        "conv2d.padding",
        "conv3d.padding",
        "conv_transpose1d.default",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "convolution.default",
    ]
)
_TRANSPOSED = {op for op in _OPS if "conv_transpose" in str(op)}


def _arguments(target, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every schema argument of ``target`` by name: given positionally, by keyword, or its default."""
    out = {}
    for i, a in enumerate(target._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _per_dim(value: Any, nd: int) -> list:
    """A per-spatial-dim argument (stride, padding, dilation) as one entry per dim."""
    if isinstance(value, (int, str)):
        return [value] * nd
    value = list(value)
    return value * nd if len(value) == 1 else value


def _is_transposed(target, a: dict[str, Any]) -> bool:
    return target in _TRANSPOSED or bool(a.get("transposed", False))


def conv_groups(call: OpCall) -> int | None:
    """The group count the shapes of ``call`` imply (local shapes give local groups); None if malformed."""
    x, w = call.inputs[0], call.inputs[1]
    if x.ndim not in (w.ndim, w.ndim - 1) or w.ndim < 3:
        return None
    c = 1 if x.ndim == w.ndim else 0
    a = _arguments(call.target, call.args, call.kwargs)
    channels = call.outputs[0].shape[c] if _is_transposed(call.target, a) else x.shape[c]
    per_group = w.shape[1]
    if per_group == 0 or channels % per_group:
        return None
    return channels // per_group


def _tiles(call: OpCall, j: int, axis_size: int) -> bool:
    """Whether spatial dim ``j`` splits into whole windows on ``axis_size`` ranks (strategy 6)."""
    x, w, out = call.inputs[0], call.inputs[1], call.outputs[0]
    nd = w.ndim - 2
    a = _arguments(call.target, call.args, call.kwargs)
    stride, padding, dilation = (_per_dim(a[k], nd)[j] for k in ("stride", "padding", "dilation"))
    span = dilation * (w.shape[2 + j] - 1) + 1
    if padding not in (0, "valid") and not (padding == "same" and span == 1):
        return False
    size, out_size = x.shape[x.ndim - nd + j], out.shape[out.ndim - nd + j]
    return span <= stride and size == out_size * stride and (stride == 1 or out_size % axis_size == 0)


def conv_strategies(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """The strategies of the module docstring for one convolution on one axis of ``axis_size`` ranks."""
    groups = conv_groups(call)
    if groups is None:
        return []
    x, w, out = call.inputs[0], call.inputs[1], call.outputs[0]
    a = _arguments(call.target, call.args, call.kwargs)
    transposed = _is_transposed(call.target, a)
    batched = x.ndim == w.ndim
    c = 1 if batched else 0
    has_bias = len(call.inputs) == 3
    # the weight's output and input channel sides: (dim, blocks)
    w_out, w_in = ((1, 1), (0, groups)) if transposed else ((0, groups), (1, 1))

    def make(xp: Placement, wp: Placement, bp: Placement, op: Placement, kernel: str | None = None) -> AxisStrategy:
        ins = (xp, wp, bp) if has_bias else (xp, wp)
        return AxisStrategy(ins, (op,), kernel=kernel)

    result = []
    if batched:
        result.append(make(Shard(0), R, R, Shard(0)))
    if out.shape[c] // groups > axis_size:
        result.append(make(R, Shard(*w_out), Shard(0, groups), Shard(c, groups)))
    if groups > 1 and groups % axis_size == 0:
        result.append(make(Shard(c), Shard(0), Shard(0), Shard(c), GROUP_SPLIT_KERNELS[call.target]))
    if x.shape[c] // groups > axis_size:
        result.append(make(Shard(c, groups), Shard(*w_in), PSUM, PSUM))
    result += [make(PSUM, R, PSUM, PSUM), make(R, PSUM, PSUM, PSUM)]
    if not transposed:
        nd = w.ndim - 2
        for j in range(nd):
            if _tiles(call, j, axis_size):
                result.append(make(Shard(c + 1 + j), R, R, Shard(c + 1 + j)))
    return result


@register(*_OPS)
def conv_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Convolutions (module docstring); [] (replicate only) for shapes not covered."""
    return conv_strategies(call, axis_size)


# ----------------------------------------------------------------------------- whole-group kernels


def _group_split_kernel(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    def kernel(ctx: KernelContext, *args, **kwargs) -> torch.Tensor:
        """``op`` on whole groups: each axis that chose this kernel divides the group count by its size."""
        parts = math.prod(ctx.mesh_shape[ax] for ax in ctx.axes)
        groups = _arguments(op, args, kwargs)["groups"] // parts
        at = [a.name for a in op._schema.arguments].index("groups")
        if at < len(args):
            args = (*args[:at], groups, *args[at + 1 :])
        else:
            kwargs = {**kwargs, "groups": groups}
        return op(*args, **kwargs)

    kernel.__name__ = f"conv_group_split_{op.__name__.replace('.', '_')}"
    return kernel


def _register_group_split_kernels() -> dict[Any, str]:
    names = {}
    for op in _OPS:
        names[op] = f"conv_group_split.{op}"
        register_kernel(names[op])(_group_split_kernel(op))
    return names


#: The whole-group kernel's name for each registered op (strategy 3).
GROUP_SPLIT_KERNELS: dict[Any, str] = _register_group_split_kernels()
