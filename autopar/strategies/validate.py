"""The strategy validator: run every strategy of a rule on real data, one simulated mesh.

``validate_op`` checks the contract stated in ``base``: for each ``OpStrategy``
that ``expand_to_mesh`` gives for a call, every mesh coordinate runs the op (or
the strategy's kernel) on its local pieces of the inputs, the local outputs are
combined by the output placements (``layout.combine``), and the result must equal
the op's output on the full inputs.  Everything runs in one process; no process
group is needed.

How inputs are cut: ``Shard``/``Replicate`` as ``layout.shard_tensor``; a
``Partial`` input gets *random* pieces whose reduction is the input (sum: random
parts adding up; max: the value on one random rank per element, smaller values on
the others), so a rule that wrongly accepts a Partial input is caught.

Randomness: the validator compares values, so random ops must be called in a
deterministic form (``dropout`` with ``p=0`` or ``train=False``, ``native_dropout``
likewise); a random op validated with ``p > 0`` fails every sharded strategy.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.pieces import combine, coordinates, shard_tensor
from autopar.spec import TensorMeta, local_shape

from .base import FALLBACK, OpCall, OpStrategy, expand_to_mesh, rule_for
from .kernels import KERNELS, KernelContext
from .views import localize_size_args

__all__ = ["StrategyCheck", "make_call", "validate_op", "assert_rule_valid"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StrategyCheck:
    """The verdict on one strategy: ``ok``, the largest output error, and why it failed ("ok" if not)."""

    strategy: OpStrategy
    ok: bool
    max_abs_err: float
    message: str


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def make_call(
    target, args: tuple, kwargs: dict | None = None, *, block_hints: frozenset = frozenset()
) -> tuple[OpCall, list[torch.Tensor]]:
    """The ``OpCall`` a rule would see for real ``args``/``kwargs``, and the op's full outputs.

    Tensors become ``TensorMeta`` in pytree-flattening order of ``(args, kwargs)``;
    the outputs are found by running the op once (tensor leaves of its result, in order).
    """
    kwargs = dict(kwargs or {})
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    metas = [TensorMeta.of(a) if isinstance(a, torch.Tensor) else a for a in flat]
    margs, mkwargs = pytree.tree_unflatten(metas, spec)
    with torch.no_grad():
        full = _tensor_leaves(target(*args, **kwargs))
    call = OpCall(
        target=target,
        args=tuple(margs),
        kwargs=dict(mkwargs),
        inputs=tuple(TensorMeta.of(a) for a in flat if isinstance(a, torch.Tensor)),
        outputs=tuple(TensorMeta.of(t) for t in full),
        block_hints=frozenset(block_hints),
    )
    return call, full


def _op_name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__qualname__", str(target))


def _max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    if got.dtype == torch.bool or want.dtype == torch.bool:
        return float((got != want).sum())
    g, w = got.double(), want.double()
    both_nan = torch.isnan(g) & torch.isnan(w)
    same = g == w  # equal infinities give nan differences
    d = torch.where(both_nan | same, torch.zeros_like(g), (g - w).abs())
    return float(torch.nan_to_num(d, nan=math.inf).max())


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> bool:
    """allclose with ``atol`` relative to the output's scale (floats); exact for int/bool."""
    if not (got.dtype.is_floating_point or got.dtype.is_complex):
        return torch.equal(got, want)
    finite = want[torch.isfinite(want)] if want.numel() else want
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return torch.allclose(got, want, atol=atol * scale, rtol=rtol, equal_nan=True)


@dataclass(frozen=True, slots=True)
class _Case:
    """One call on real data that every strategy of its rule is checked against.

    ``flat``/``spec``: the call's ``(args, kwargs)`` flattened; ``tensor_pos``: the
    positions of its tensors in ``flat``; ``full_outs``: the op's outputs on the full
    inputs; ``cache``: (input index, placements, coordinate) -> local piece, shared by
    the strategies (``seed`` fixes the random Partial pieces).
    """

    call: OpCall
    flat: list
    spec: Any
    tensor_pos: list[int]
    full_outs: list[torch.Tensor]
    mesh_shape: tuple[int, ...]
    atol: float
    rtol: float
    seed: int
    cache: dict


def _check_strategy(case: _Case, strategy: OpStrategy) -> StrategyCheck:
    """Run ``strategy`` on every coordinate of the mesh and compare the combined outputs with the full op's."""
    kernels = sorted({k for k in strategy.kernels if k is not None and k != FALLBACK})
    if len(kernels) > 1:
        return StrategyCheck(strategy, False, math.inf, f"names several kernels {kernels}; at most one is supported")
    kernel = kernels[0] if kernels else None
    if kernel is not None and kernel not in KERNELS:
        why = f"kernel {kernel!r} is not registered in autopar.strategies.kernels"
        return StrategyCheck(strategy, False, math.inf, why)
    local_outs: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for coord in coordinates(case.mesh_shape):
        outs = _run_local(case, strategy, kernel, coord)
        if isinstance(outs, StrategyCheck):
            return outs
        local_outs[coord] = outs
    return _compare(case, strategy, local_outs)


def _run_local(case: _Case, strategy: OpStrategy, kernel: str | None, coord: tuple[int, ...]):
    """The tensor outputs of the op (or ``kernel``) on the local pieces at ``coord``, or a failed verdict."""
    mesh_shape, flat = case.mesh_shape, case.flat
    local_flat = list(flat)
    try:
        for i, pos in enumerate(case.tensor_pos):
            key = (i, strategy.inputs[i], coord)
            if key not in case.cache:
                case.cache[key] = shard_tensor(
                    flat[pos], strategy.inputs[i], mesh_shape, coord, partial_seed=case.seed * 1_000_003 + i
                )
            local_flat[pos] = case.cache[key].clone()  # a mutating local op cannot spoil the cache
    except ValueError as e:  # e.g. a block count that does not divide some rank's piece
        return StrategyCheck(strategy, False, math.inf, f"input {i} cannot be laid out at {coord}: {e}")
    largs, lkwargs = pytree.tree_unflatten(local_flat, case.spec)
    # size arguments (view, expand, split ...) are global in the graph: make them local
    shapes = [
        local_shape(tuple(o.shape), strategy.outputs[j], tuple(mesh_shape), coord) for j, o in enumerate(case.full_outs)
    ]
    call = case.call
    largs, lkwargs = localize_size_args(call.target, tuple(largs), dict(lkwargs), shapes)
    try:
        with torch.no_grad():
            if kernel is None:
                res = call.target(*largs, **lkwargs)
            else:
                axes = tuple(a for a, k in enumerate(strategy.kernels) if k == kernel) if kernel else ()
                ctx = KernelContext(tuple(mesh_shape), coord, strategy.inputs, call.inputs, axes)
                res = KERNELS[kernel](ctx, *largs, **lkwargs)
    except Exception as e:  # noqa: BLE001  (a failing local op is a verdict, not a crash)
        return StrategyCheck(strategy, False, math.inf, f"local op failed at {coord}: {type(e).__name__}: {e}")
    outs = _tensor_leaves(res)
    if len(outs) != len(case.full_outs):
        why = f"local op at {coord} gave {len(outs)} tensor outputs, expected {len(case.full_outs)}"
        return StrategyCheck(strategy, False, math.inf, why)
    return outs


def _compare(case: _Case, strategy: OpStrategy, local_outs: dict) -> StrategyCheck:
    """The verdict on the local outputs per coordinate, combined by the strategy's output placements."""
    worst = 0.0
    for j, want in enumerate(case.full_outs):
        try:
            got = combine(
                {c: o[j] for c, o in local_outs.items()}, strategy.outputs[j], case.mesh_shape, tuple(want.shape)
            )
        except (AssertionError, ValueError) as e:
            return StrategyCheck(strategy, False, math.inf, f"output {j}: {e}")
        if got.dtype != want.dtype:
            return StrategyCheck(
                strategy, False, math.inf, f"output {j}: combined dtype {got.dtype}, expected {want.dtype}"
            )
        err = _max_abs_err(got, want)
        worst = max(worst, err)
        if not _close(got, want, case.atol, case.rtol):
            return StrategyCheck(
                strategy, False, worst, f"output {j}: combined value differs from the full op, max abs error {err:.3g}"
            )
    return StrategyCheck(strategy, True, worst, "ok")


def validate_op(
    target,
    args: tuple,
    kwargs: dict | None = None,
    *,
    mesh_shape: tuple[int, ...] = (2,),
    block_hints: frozenset = frozenset(),
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> list[StrategyCheck]:
    """Check every strategy the registered rule gives for ``target`` on real ``args``/``kwargs``.

    Returns one ``StrategyCheck`` per ``OpStrategy`` of ``expand_to_mesh`` (the
    fallback replicate strategy included), in its order.  Floating outputs are
    compared with ``torch.allclose(atol * scale, rtol, equal_nan=True)`` where
    ``scale = max(1, max |full output|)``: a long contraction split over ranks (or
    fed random Partial pieces) rounds differently near zero, by about
    ``eps * K * scale``, while a wrong strategy errs by the size of the values.
    Integer and bool outputs must match exactly.  ``seed`` fixes the random Partial pieces.  An op without a
    rule yields the single replicate fallback.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    kwargs = dict(kwargs or {})
    call, full_outs = make_call(target, args, kwargs, block_hints=block_hints)
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    tensor_pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    strategies = expand_to_mesh(call, mesh_shape, rule_for(target))
    case = _Case(call, flat, spec, tensor_pos, full_outs, mesh_shape, atol, rtol, seed, cache={})
    checks = [_check_strategy(case, s) for s in strategies]
    log.debug(
        "validated %s on mesh %s: %d/%d strategies ok", call.name, mesh_shape, sum(c.ok for c in checks), len(checks)
    )
    return checks


def assert_rule_valid(
    target,
    args: tuple,
    kwargs: dict | None = None,
    *,
    mesh_shape: tuple[int, ...] = (2,),
    block_hints: frozenset = frozenset(),
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> list[StrategyCheck]:
    """``validate_op``, raising AssertionError that lists every failing strategy; returns the checks.

    Raises ValueError when no rule is registered for ``target`` (there is nothing to validate).
    """
    if rule_for(target) is None:
        raise ValueError(
            f"assert_rule_valid({_op_name(target)}): no rule is registered for this op; register one with "
            "@register in an autopar.strategies module listed in RULE_MODULES"
        )
    checks = validate_op(
        target, args, kwargs, mesh_shape=mesh_shape, block_hints=block_hints, atol=atol, rtol=rtol, seed=seed
    )
    bad = [c for c in checks if not c.ok]
    if bad:
        shapes = ", ".join(str(m.shape) for m in make_call(target, args, kwargs)[0].inputs)
        lines = [
            f"- {c.strategy.label()}"
            + (f" [kernels {c.strategy.kernels}]" if any(c.strategy.kernels) else "")
            + f": {c.message}"
            for c in bad
        ]
        raise AssertionError(
            f"{_op_name(target)} on mesh {tuple(mesh_shape)} (inputs {shapes}): {len(bad)} of {len(checks)} strategies "
            "are wrong:\n" + "\n".join(lines) + "\nFix the rule so these placements are not offered, "
            "or give them a kernel that computes the right local value."
        )
    return checks
