"""The rule interface: per-op-family rules on one mesh axis, expanded to the n-D mesh.

A *rule* is a function ``rule(call: OpCall, axis_size: int) -> list[AxisStrategy]``
registered for one or more aten ops with ``@register(aten.mm.default, ...)``.  It
sees the op's arguments with every tensor replaced by its ``TensorMeta`` (the
*local* meta under the placements already chosen on earlier mesh axes) and lists
the ways one axis of ``axis_size`` ranks can run the op: a placement for each
tensor input and each tensor output, plus any collectives the op itself issues
(``OpComm``) and the name of a local kernel when the local computation is not the
op itself (``kernel``, see ``autopar.strategies.kernels``).

Rules never see the mesh or other axes: ``expand_to_mesh`` enumerates axis 0's
strategies on global metas, shrinks the metas by the chosen placements, and asks
the rule again for axis 1 on the local metas, and so on.  Divisibility and other
shape conditions are therefore checked by each rule on the shapes it is given.

Contract every rule keeps (the validator in tests checks it on random data):
running the op (or its ``kernel``) on each rank's local inputs and combining the
local outputs by their placements (``S``: concatenate, ``P``: reduce, ``R``: all
equal) gives the op's full output.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autopar.capture import OpCall
from autopar.placement import Partial, Placement, Replicate, Shard
from autopar.spec import TensorMeta
from autopar.transitions import input_grad_placements, output_grad_placements

__all__ = [
    "OpCall",
    "OpComm",
    "AxisStrategy",
    "OpStrategy",
    "Rule",
    "register",
    "rule_for",
    "replicate_strategy",
    "hinted_blocks",
    "expand_to_mesh",
    "shrink_meta",
    "FALLBACK",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OpComm:
    """A collective issued by the op itself on this axis (not by a transition).

    ``kind``: all_reduce | all_gather | reduce_scatter | all_to_all;
    ``phase``: forward | backward; ``bytes``: the buffer size as defined in
    ``costmodel.comm`` (the full buffer for all_reduce and the gathered size for
    all_gather/reduce_scatter); ``reduce_op``: "sum" or "max" for reductions.
    """

    kind: str
    phase: str
    bytes: int
    reduce_op: str = "sum"


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """One way one mesh axis runs an op: placements of tensor inputs and outputs."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    comm: tuple[OpComm, ...] = ()
    kernel: str | None = None

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.inputs + self.outputs)


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """An op's strategy on the whole mesh: per tensor input/output, one placement per axis.

    ``inputs[i][a]`` is input i's placement on mesh axis a.  ``comm[a]`` are the
    op's own collectives on axis a; ``kernels[a]`` the local kernel chosen on axis a
    (None: the op itself).  ``split[a]`` is True when axis a divides the op's work
    (any non-replicated placement), False when every rank of the axis repeats it.

    ``partial_grad[a]`` (only on an axis the op does not split): backward takes the
    output gradients as ``P(sum)`` on axis a and hands its input gradients back as
    ``P(sum)``.  Exact because a vector-Jacobian product is linear in the incoming
    gradient and every rank of the axis holds the same inputs (the same Jacobian):
    ``vjp(sum_r g_r) = sum_r vjp(g_r)``.  The reduction moves to wherever a
    gradient must be whole (a parameter, whose reduction overlaps with backward, or
    a split producer), and partial gradients from several consumers are summed
    locally first, so they are reduced once (Megatron's one ``f`` for q, k and v).
    """

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    comm: tuple[tuple[OpComm, ...], ...]
    kernels: tuple[str | None, ...]
    split: tuple[bool, ...]
    fallback: bool = False
    partial_grad: tuple[bool, ...] = ()

    def label(self) -> str:
        ins = " ".join("(" + ",".join(map(str, p)) + ")" for p in self.inputs)
        outs = " ".join("(" + ",".join(map(str, p)) + ")" for p in self.outputs)
        return f"{ins} -> {outs}" + partial_grad_suffix(self.partial_grad)

    def input_grad(self, pos: int) -> tuple[Placement, ...]:
        """Placement of the gradient this strategy's backward returns for tensor input ``pos``."""
        return input_grad_placements(self.inputs[pos], self.split, self.partial_grad)

    def output_grad(self, index: int) -> tuple[Placement, ...]:
        """Placement this strategy's backward needs the gradient of output ``index`` in."""
        return output_grad_placements(self.outputs[index], self.partial_grad)


def partial_grad_suffix(flags: tuple[bool, ...]) -> str:
    """How a label shows partial-gradient axes: `` grad P@0,1`` (empty when there are none)."""
    axes = [str(a) for a, f in enumerate(flags) if f]
    return f" grad P@{','.join(axes)}" if axes else ""


def partial_grad_flags(axes: list[int], ndim: int):
    """One flag tuple (per mesh axis) for each non-empty subset of ``axes``."""
    for k in range(1, len(axes) + 1):
        for subset in itertools.combinations(axes, k):
            yield tuple(a in subset for a in range(ndim))


def with_partial_grads(options: list[OpStrategy], mesh_shape: tuple[int, ...]) -> list[OpStrategy]:
    """``options`` followed by each strategy's partial-gradient variants (see ``OpStrategy``).

    A strategy that does not split axes ``A`` (of more than one rank) gets one
    variant per non-empty subset of ``A``; the caller offers them only where
    gradients flow.  The variants keep the placements, collectives and kernels, so
    their forward, compute and memory are those of the original; only which
    backward reductions happen where differs.
    """
    out = list(options)
    for s in options:
        axes = [a for a, sp in enumerate(s.split) if not sp and mesh_shape[a] > 1]
        out += [replace(s, partial_grad=flags) for flags in partial_grad_flags(axes, len(mesh_shape))]
    return out


Rule = Callable[[OpCall, int], "list[AxisStrategy]"]
_RULES: dict[Any, Rule] = {}

#: The kernel name a fallback strategy records (``rule_for`` returns None for it).
FALLBACK = "fallback"


#: Every rule module, by name under this package; importing one registers its rules.
RULE_MODULES = (
    "matmul",
    "conv",
    "pointwise",
    "reductions",
    "norms",
    "views",
    "embedding",
    "attention",
    "factories",
    "shard_hint",
)


@functools.cache
def load_rule_modules() -> None:
    """Import every rule module once (each registers its rules on import); a family not written yet falls back."""
    package = __name__.rpartition(".")[0]
    for name in RULE_MODULES:
        try:
            importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise


def register(*targets) -> Callable[[Rule], Rule]:
    """Register a rule for one or more aten op overloads (or python callables).

    A target may also be an op's name as ``str(op)`` gives it
    (``"transformers.grouped_mm_fallback.default"``): a custom op of a library autopar
    does not import, which exists only once that library has registered it.
    """

    def deco(fn: Rule) -> Rule:
        for t in targets:
            if t in _RULES and _RULES[t] is not fn:
                raise AssertionError(f"two rules registered for {t}: {_RULES[t].__name__} and {fn.__name__}")
            _RULES[t] = fn
        return fn

    return deco


def rule_for(target) -> Rule | None:
    """The registered rule for an op, or None (the op then falls back to replicate)."""
    load_rule_modules()
    rule = _RULES.get(target)
    return rule if rule is not None or isinstance(target, str) else _RULES.get(str(target))


def registered_targets() -> list:
    load_rule_modules()
    return list(_RULES)


def hinted_blocks(call: OpCall, output_index: int, dim: int) -> list[int]:
    """Block counts (> 1) that ``call.block_hints`` asks for on ``dim`` of output ``output_index``."""
    return sorted({b for (o, d, b) in call.block_hints if o == output_index and d == dim and b > 1})


def replicate_strategy(call: OpCall) -> AxisStrategy:
    """Every input and output replicated: always correct, the op runs whole on every rank."""
    return AxisStrategy(tuple(Replicate() for _ in call.inputs), tuple(Replicate() for _ in call.outputs))


def shrink_meta(meta: TensorMeta, placement: Placement, axis_size: int) -> TensorMeta:
    """The meta one axis leaves on each rank (largest piece for uneven shards)."""
    if not isinstance(placement, Shard):
        return meta
    shape = list(meta.shape)
    block = shape[placement.dim] // placement.blocks
    shape[placement.dim] = -(-block // axis_size) * placement.blocks
    return meta.with_shape(shape)


def _valid_placement(meta: TensorMeta, p: Placement, axis_size: int) -> bool:
    if isinstance(p, Shard):
        if p.dim >= meta.ndim:
            return False
        size = meta.shape[p.dim]
        if size % p.blocks:
            return False
        return size // p.blocks >= axis_size  # every rank gets at least one element per block
    if isinstance(p, Partial):
        return meta.is_float
    return True


def expand_to_mesh(call: OpCall, mesh_shape: tuple[int, ...], rule: Rule | None) -> list[OpStrategy]:
    """All strategies of an op on the n-D mesh: the product of per-axis strategies.

    Axis ``a``'s strategies are enumerated on the local metas left by the choices
    on axes ``0..a-1``.  A strategy whose shard gives some rank no element (on any
    axis, or nested over several: ``_every_rank_gets_an_element``), or shards a
    non-float tensor as Partial, is dropped.  With no rule, or when the
    rule yields nothing, the op falls back to replicate on every axis.
    """
    results: list[OpStrategy] = []

    def recurse(axis: int, c: OpCall, chosen: list[AxisStrategy]) -> None:
        if axis == len(mesh_shape):
            if _every_rank_gets_an_element(call, chosen, mesh_shape):
                results.append(_combine(chosen))
            return
        size = mesh_shape[axis]
        options = _axis_options(c, size, rule)
        for s in options:
            if size > 1 and not all(
                _valid_placement(m, p, size) for m, p in zip(c.inputs + c.outputs, s.inputs + s.outputs)
            ):
                continue
            ins = tuple(shrink_meta(m, p, size) for m, p in zip(c.inputs, s.inputs))
            outs = tuple(shrink_meta(m, p, size) for m, p in zip(c.outputs, s.outputs))
            recurse(axis + 1, c.with_metas(ins, outs), chosen + [s])

    recurse(0, call, [])
    if rule is None:
        return [_combine([replicate_strategy(call)] * len(mesh_shape), fallback=True)]
    if not results:
        fb = replicate_strategy(call)
        results = [_combine([fb] * len(mesh_shape), fallback=True)]
    # dedupe, keep first occurrence (rules list their preferred strategies first)
    seen: dict[tuple, OpStrategy] = {}
    for s in results:
        seen.setdefault((s.inputs, s.outputs, s.kernels), s)
    return list(seen.values())


def every_rank_gets_an_element(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> bool:
    """Whether no rank's piece of a tensor of ``shape`` under ``placements`` (one per axis) is empty.

    Checking each axis on the *largest* piece the earlier axes leave
    (``shrink_meta``) misses the smaller ones: 3 rows split by 2 then by 2 are
    pieces 2, 1 and then 1, 1, 1, 0.  Nested ``tensor_split``s leave at least
    ``floor(n / (k1 * k2 * ...))`` per block (``floor(floor(n/a)/b) == floor(n/(ab))``),
    so a dim must hold, per block, at least the product of its splitting axes' sizes.
    """
    ways: dict[int, int] = {}
    blocks: dict[int, int] = {}
    for p, size in zip(placements, mesh_shape):
        if isinstance(p, Shard) and size > 1:
            ways[p.dim] = ways.get(p.dim, 1) * size
            blocks[p.dim] = max(blocks.get(p.dim, 1), p.blocks)
    return all(d < len(shape) and shape[d] // blocks[d] >= k for d, k in ways.items())


def _every_rank_gets_an_element(call: OpCall, per_axis: list[AxisStrategy], mesh_shape: tuple[int, ...]) -> bool:
    """``every_rank_gets_an_element`` for every tensor of ``call`` under the per-axis strategies."""
    for t, meta in enumerate(call.inputs + call.outputs):
        placements = tuple((s.inputs + s.outputs)[t] for s in per_axis)
        if not every_rank_gets_an_element(meta.shape, placements, mesh_shape):
            return False
    return True


def _axis_options(call: OpCall, axis_size: int, rule: Rule | None) -> list[AxisStrategy]:
    rep = replicate_strategy(call)
    if axis_size == 1 or rule is None:
        return [rep]
    options = list(rule(call, axis_size))
    for s in options:
        if len(s.inputs) != len(call.inputs) or len(s.outputs) != len(call.outputs):
            raise AssertionError(
                f"rule for {call.name} gave {len(s.inputs)} input / {len(s.outputs)} output placements "
                f"for an op with {len(call.inputs)} tensor inputs and {len(call.outputs)} outputs"
            )
    if not any(s.is_replicated for s in options):
        options.append(rep)
    return options


def _combine(per_axis: list[AxisStrategy], fallback: bool = False) -> OpStrategy:
    n_in = len(per_axis[0].inputs)
    n_out = len(per_axis[0].outputs)
    return OpStrategy(
        inputs=tuple(tuple(s.inputs[i] for s in per_axis) for i in range(n_in)),
        outputs=tuple(tuple(s.outputs[i] for s in per_axis) for i in range(n_out)),
        comm=tuple(s.comm for s in per_axis),
        kernels=tuple(s.kernel for s in per_axis),
        split=tuple(not s.is_replicated for s in per_axis),
        fallback=fallback,
    )
