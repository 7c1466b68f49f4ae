"""Rules for elementwise ops: unary, binary (Tensor/Scalar overloads), where, comparisons, casts.

Sharding (one mesh axis): for every output dim ``d``, each tensor input whose
broadcast-aligned dim (shapes aligned from the right) has the output's size is
``S(d_in)``; inputs that broadcast on it (size 1, or missing) are ``R``; the output
is ``S(d)``.  A block hint ``(0, d, b)`` adds the same strategy with ``S(·)[b]``.

Partial (linearity): an op keeps ``P(sum)`` only when it is linear in its Partial
inputs, and ``P(max)`` only when it commutes with a max over ranks:

- ``P(sum)``: add/sub with every operand a Partial tensor; mul with exactly one
  Partial tensor and the rest Replicate or scalars; div with a Partial numerator
  only; neg; casts and copies (to, _to_copy, clone, contiguous, alias, detach, lift_fresh_copy);
  where with both values Partial; masked_fill with a zero fill.
- ``P(max)``: casts and copies; add/sub of a Replicate tensor or scalar (``a - b``
  only with ``a`` Partial); mul/div by a positive python scalar; maximum with any
  Partial operands; where/masked_fill whose Partial values sit beside Replicate
  ones; nondecreasing functions (exp, relu, sigmoid, tanh, clamp, hardtanh).

Everything else is nonlinear and never takes Partial.  ``expand_to_mesh`` drops
Partial on integer or bool tensors, so comparisons and integer casts never
produce it.

Also home to small helpers the other compute rule modules share (``arg``,
``norm_dim``, ``resolve_ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.spec import TensorMeta

from .base import AxisStrategy, OpCall, hinted_blocks, register

__all__ = ["arg", "norm_dim", "resolve_ops", "pointwise_strategies"]

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")
PMAX = Partial("max")


# ---------------------------------------------------------------- shared helpers


def arg(call: OpCall, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (positional ``index`` in the schema) of the call, or ``default``."""
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int, op: str = "") -> int:
    """A dim index made non-negative (``-1`` -> ``ndim - 1``); 0-d tensors accept dim 0 / -1."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise ValueError(f"{op}: dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % n


def resolve_ops(names: Iterable[str]) -> list:
    """Aten overloads from ``"name.overload"`` strings, skipping those this torch lacks."""
    out = []
    for n in names:
        base, _, overload = n.partition(".")
        packet = getattr(aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None:
            out.append(op)
    return out


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _dedupe(strategies: list[AxisStrategy]) -> list[AxisStrategy]:
    seen, out = set(), []
    for s in strategies:
        key = (s.inputs, s.outputs, s.kernel)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


# ---------------------------------------------------------------- the generator


def pointwise_strategies(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    """Shard strategies of an elementwise op: every output dim, inputs aligned by broadcasting.

    Every output gets the same placement (elementwise ops with several outputs
    produce same-shaped outputs).  Returns [] when an input has more dims than
    the output (not an elementwise broadcast).
    """
    out = call.outputs[0]
    if any(m.ndim > out.ndim for m in call.inputs) or any(o.shape != out.shape for o in call.outputs):
        return []
    result = []
    for d, size in enumerate(out.shape):
        if size < axis_size:
            continue
        for blocks in [1] + hinted_blocks(call, 0, d):
            if size % blocks:
                continue
            ins: list[Placement] = []
            for m in call.inputs:
                di = d - (out.ndim - m.ndim)
                ins.append(Shard(di, blocks) if di >= 0 and m.shape[di] == size else R)
            result.append(AxisStrategy(tuple(ins), (Shard(d, blocks),) * len(call.outputs)))
    return result


def _partial(call: OpCall, combos: list[tuple[Placement, ...]], p: Partial) -> list[AxisStrategy]:
    return [AxisStrategy(tuple(c), (p,) * len(call.outputs)) for c in combos]


def _only_tensors(call: OpCall, *names: tuple[int, str]) -> bool:
    return all(isinstance(arg(call, i, n), TensorMeta) for i, n in names)


def _one_of(n: int, p: Placement) -> list[tuple[Placement, ...]]:
    """Each input in turn Partial, the others Replicate."""
    return [tuple(p if j == i else R for j in range(n)) for i in range(n)]


# Partial policies: call -> extra strategies.  ``n`` is the number of tensor inputs.


def _copy_policy(call: OpCall) -> list[AxisStrategy]:
    n = len(call.inputs)
    return _partial(call, [(PSUM,) + (R,) * (n - 1)], PSUM) + _partial(call, [(PMAX,) + (R,) * (n - 1)], PMAX)


def _neg_policy(call: OpCall) -> list[AxisStrategy]:
    return _partial(call, [(PSUM,)], PSUM)


def _monotone_policy(call: OpCall) -> list[AxisStrategy]:
    return _partial(call, [(PMAX,)], PMAX) if len(call.inputs) == 1 else []


def _add_policy(call: OpCall, *, sub: bool) -> list[AxisStrategy]:
    n = len(call.inputs)
    alpha = arg(call, 2, "alpha", 1)
    if n == 2:  # tensor (+/-) tensor
        out = _partial(call, [(PSUM, PSUM)], PSUM)
        maxes = [(PMAX, R)] + ([] if sub or not _positive(alpha) else [(R, PMAX)])
        return out + _partial(call, maxes, PMAX)
    if n == 1 and _only_tensors(call, (0, "self")):  # tensor (+/-) scalar
        return _partial(call, [(PMAX,)], PMAX)
    return []


def _mul_policy(call: OpCall) -> list[AxisStrategy]:
    n = len(call.inputs)
    out = _partial(call, _one_of(n, PSUM), PSUM)
    if n == 1 and _positive(arg(call, 1, "other")):
        out += _partial(call, [(PMAX,)], PMAX)
    return out


def _div_policy(call: OpCall) -> list[AxisStrategy]:
    if not _only_tensors(call, (0, "self")):
        return []
    n = len(call.inputs)
    out = _partial(call, [(PSUM,) + (R,) * (n - 1)], PSUM)
    if n == 1 and _positive(arg(call, 1, "other")):
        out += _partial(call, [(PMAX,)], PMAX)
    return out


def _maximum_policy(call: OpCall) -> list[AxisStrategy]:
    return _partial(call, [(PMAX, PMAX), (PMAX, R), (R, PMAX)], PMAX) if len(call.inputs) == 2 else []


def _where_policy(call: OpCall) -> list[AxisStrategy]:
    # inputs: condition, then whichever of self/other are tensors
    n = len(call.inputs)
    if n == 3:
        return _partial(call, [(R, PSUM, PSUM)], PSUM) + _partial(
            call, [(R, PMAX, PMAX), (R, PMAX, R), (R, R, PMAX)], PMAX
        )
    if n == 2:
        scalar = arg(call, 2, "other") if call.target is aten.where.ScalarOther else arg(call, 1, "self")
        out = _partial(call, [(R, PMAX)], PMAX)
        if scalar == 0 and not isinstance(scalar, bool):
            out += _partial(call, [(R, PSUM)], PSUM)
        return out
    return []


def _masked_fill_policy(call: OpCall) -> list[AxisStrategy]:
    if len(call.inputs) == 3:  # masked_fill.Tensor: the value is a 0-d tensor
        return _partial(call, [(PSUM, R, PSUM)], PSUM) + _partial(call, [(PMAX, R, R)], PMAX)
    out = _partial(call, [(PMAX, R)], PMAX)
    value = arg(call, 2, "value")
    if value == 0 and not isinstance(value, bool):
        out += _partial(call, [(PSUM, R)], PSUM)
    return out


def _make_rule(policy: Callable[[OpCall], list[AxisStrategy]] | None):
    def rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
        strategies = pointwise_strategies(call, axis_size)
        if policy is not None and call.inputs:
            strategies += policy(call)
        return _dedupe(strategies)

    return rule


# ---------------------------------------------------------------- registration

_NONLINEAR = [
    "abs",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "cos",
    "cosh",
    "sin",
    "sinh",
    "tan",
    "erf",
    "erfc",
    "erfinv",
    "exp2",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "sign",
    "sgn",
    "square",
    "frac",
    "round",
    "round.decimals",
    "logit",
    "gelu",
    "silu",
    "mish",
    "elu",
    "leaky_relu",
    "softplus",
    "hardswish",
    "hardsigmoid",
    "celu",
    "selu",
    "logical_not",
    "bitwise_not",
    "isnan",
    "isinf",
    "isfinite",
    "isneginf",
    "isposinf",
    "nan_to_num",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "remainder.Tensor",
    "remainder.Scalar",
    "fmod.Tensor",
    "fmod.Scalar",
    "atan2",
    "minimum",
    "fmin",
    "min.other",
    "clamp.Tensor",
    "eq.Tensor",
    "eq.Scalar",
    "ne.Tensor",
    "ne.Scalar",
    "lt.Tensor",
    "lt.Scalar",
    "le.Tensor",
    "le.Scalar",
    "gt.Tensor",
    "gt.Scalar",
    "ge.Tensor",
    "ge.Scalar",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and.Tensor",
    "bitwise_and.Scalar",
    "bitwise_or.Tensor",
    "bitwise_or.Scalar",
    "bitwise_xor.Tensor",
    "bitwise_xor.Scalar",
    "__and__.Tensor",
    "__and__.Scalar",
    "__or__.Tensor",
    "__or__.Scalar",
    "__xor__.Tensor",
    "__xor__.Scalar",
    "rsub.Tensor",
    "rsub.Scalar",
    "div.Tensor_mode",
    "div.Scalar_mode",
    "floor_divide",
    "floor_divide.Scalar",
    "lerp.Scalar",
    "lerp.Tensor",
    "addcmul",
    "addcdiv",
    "where.Scalar",
    "threshold",
    "copy",  # copy(self, src): src broadcast to self (what an in-place copy_ becomes)
    "fill.Scalar",  # fill(self, value): self's shape, every element value (what an in-place fill_ becomes)
    "fill.Tensor",  # ... value a 0-d tensor, so it broadcasts (Replicate)
]
_MONOTONE = ["exp", "relu", "sigmoid", "tanh", "clamp", "clamp_min", "clamp_max", "hardtanh", "floor", "ceil", "trunc"]
_COPIES = [
    "to.dtype",
    "to.dtype_layout",
    "to.device",
    "_to_copy",
    "clone",
    "contiguous",
    "alias",
    "detach",
    "lift_fresh_copy",  # a tensor literal in forward (DeBERTa's scale): a copy of a lifted constant
]
_POLICIES: dict[str, Callable[[OpCall], list[AxisStrategy]]] = {
    "neg": _neg_policy,
    "add.Tensor": lambda c: _add_policy(c, sub=False),
    "sub.Tensor": lambda c: _add_policy(c, sub=True),
    "add.Scalar": lambda c: _add_policy(c, sub=False),
    "sub.Scalar": lambda c: _add_policy(c, sub=True),
    "mul.Tensor": _mul_policy,
    "mul.Scalar": _mul_policy,
    "div.Tensor": _div_policy,
    "div.Scalar": _div_policy,
    "maximum": _maximum_policy,
    "fmax": _maximum_policy,
    "max.other": _maximum_policy,
    "where.self": _where_policy,
    "where.ScalarOther": _where_policy,
    "where.ScalarSelf": _where_policy,
    "masked_fill.Scalar": _masked_fill_policy,
    "masked_fill.Tensor": _masked_fill_policy,
}
_POLICIES.update({n: _copy_policy for n in _COPIES})
_POLICIES.update({n: _monotone_policy for n in _MONOTONE})
_POLICIES.update({n: None for n in _NONLINEAR})  # type: ignore[misc]

#: Every aten overload this module registers.
POINTWISE_OPS: list = []
for _name, _policy in _POLICIES.items():
    for _op in resolve_ops([_name]):
        register(_op)(_make_rule(_policy))
        POINTWISE_OPS.append(_op)
