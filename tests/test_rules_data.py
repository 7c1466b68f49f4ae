"""Rules for data movement: views, lookups, attention, factories (and their kernels).

Every registered op is validated on random data over meshes (2,), (4,) and (2, 2):
each strategy's local op (or kernel) on every simulated rank, combined by the
output placements, must equal the full op.  Ops whose arguments hold global sizes
(view, expand, split, ...) run locally with ``views.localize_size_args``; the
shared validator (``strategies.validate``) does not localize size arguments yet,
so those ops go through ``_check_localized`` below, a copy of its loop with that
one step added.  The other ops use ``assert_rule_valid`` directly.
"""

from __future__ import annotations

import math

import pytest
import torch

from autopar.kernels import KERNELS, KernelContext
from autopar.layout import combine, coordinates, dim_ranges, shard_tensor
from autopar.placement import Partial, Replicate, Shard
from autopar.strategies.base import FALLBACK, expand_to_mesh, registered_targets, rule_for
from autopar.strategies.validate import assert_rule_valid, make_call, validate_op
from autopar.strategies.views import _SIZE_ARGS, localize_size_args
from torch.utils import _pytree as pytree

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]
R = Replicate()


# ----------------------------------------------------------------------------- harness


def _localized_verdicts(target, args, kwargs, mesh_shape, block_hints, seed=0):
    """(strategy, ok, message) per strategy, local calls with ``localize_size_args`` (see module doc)."""
    call, full = make_call(target, args, kwargs, block_hints=block_hints)
    flat, spec = pytree.tree_flatten((tuple(args), kwargs))
    pos = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    out = []
    for s in expand_to_mesh(call, mesh_shape, rule_for(target)):
        kernel = next((k for k in s.kernels if k not in (None, FALLBACK)), None)
        local, msg = {}, "ok"
        for coord in coordinates(mesh_shape):
            lflat = list(flat)
            for i, p in enumerate(pos):
                lflat[p] = shard_tensor(flat[p], s.inputs[i], mesh_shape, coord, partial_seed=seed * 1_000_003 + i)
            largs, lkwargs = pytree.tree_unflatten(lflat, spec)
            shapes = [tuple(sum(hi - lo for lo, hi in r) for r in dim_ranges(tuple(t.shape), s.outputs[j],
                                                                              mesh_shape, coord))
                      for j, t in enumerate(full)]
            largs, lkwargs = localize_size_args(target, largs, lkwargs, shapes)
            try:
                if kernel is None:
                    res = target(*largs, **lkwargs)
                else:
                    axes = tuple(a for a, k in enumerate(s.kernels) if k == kernel)
                    res = KERNELS[kernel](KernelContext(mesh_shape, coord, s.inputs, call.inputs, axes),
                                          *largs, **lkwargs)
            except Exception as e:  # noqa: BLE001  (a failing local op is a verdict)
                msg = f"local op failed at {coord}: {type(e).__name__}: {e}"
                break
            local[coord] = [x for x in pytree.tree_leaves(res) if isinstance(x, torch.Tensor)]
        if msg == "ok":
            for j, want in enumerate(full):
                try:
                    got = combine({c: o[j] for c, o in local.items()}, s.outputs[j], mesh_shape, tuple(want.shape))
                except (AssertionError, ValueError) as e:
                    msg = f"output {j}: {e}"
                    break
                same = (torch.allclose(got, want, atol=1e-5, rtol=1e-4, equal_nan=True)
                        if want.is_floating_point() else torch.equal(got, want))
                if not same:
                    msg = f"output {j}: combined value differs from the full op"
                    break
        out.append((s, msg == "ok", msg))
    return out


def _label(s) -> str:
    k = sorted({k for k in s.kernels if k})
    return s.label() + (f" @{','.join(k)}" if k else "")


def check(target, *args, mesh=(2,), hints=(), expect_wrong=frozenset(), **kwargs) -> set[str]:
    """Validate every strategy of ``target(*args, **kwargs)`` on ``mesh``; return their labels.

    A label reads ``<inputs> -> <outputs>``, one parenthesized placement tuple per
    tensor (one placement per mesh axis), plus `` @kernel`` when a kernel runs.
    ``expect_wrong`` lists labels known to fail (they must fail, and nothing else may).
    """
    hints = frozenset(hints)
    if target in _SIZE_ARGS:
        verdicts = _localized_verdicts(target, args, kwargs, mesh, hints)
    else:
        if not expect_wrong:
            assert_rule_valid(target, args, kwargs, mesh_shape=mesh, block_hints=hints)
        verdicts = [(c.strategy, c.ok, c.message)
                    for c in validate_op(target, args, kwargs, mesh_shape=mesh, block_hints=hints)]
    assert not any(s.fallback for s, _, _ in verdicts), f"{target}: reported as fallback"
    wrong = {_label(s): m for s, ok, m in verdicts if not ok}
    assert set(wrong) == set(expect_wrong), (
        f"{target} on mesh {mesh}: wrong strategies {wrong}, expected wrong {sorted(expect_wrong)}")
    return {_label(s) for s, _, _ in verdicts}


def rnd(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def has(labels: set[str], *wanted: str) -> None:
    missing = [w for w in wanted if w not in labels]
    assert not missing, f"missing strategies {missing}; offered {sorted(labels)}"


def lacks(labels: set[str], *unwanted: str) -> None:
    present = [w for w in unwanted if w in labels]
    assert not present, f"strategies {present} must not be offered; offered {sorted(labels)}"


# ----------------------------------------------------------------------------- view / reshape


@pytest.mark.parametrize("mesh", MESHES + [(8,)])
def test_view_splits_hidden_into_heads(mesh):
    """GPT-2's view (2,16,768)->(2,16,12,64), head dim cut to 4: S(2) moves to the 12 heads when 12 % axis == 0."""
    labels = check(aten.view.default, rnd(2, 16, 48), [2, 16, -1, 4], mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(0)) -> (S(0))", "(S(1)) -> (S(1))", "(S(2)) -> (S(2))", "(P(sum)) -> (P(sum))",
            "(P(max)) -> (P(max))")
    if mesh == (4,):
        has(labels, "(S(2)) -> (S(2))", "(S(1)) -> (S(1))")
        lacks(labels, "(S(0)) -> (S(0))")  # batch 2 < 4 ranks
    if mesh == (2, 2):
        has(labels, "(S(0),S(2)) -> (S(0),S(2))", "(S(2),S(2)) -> (S(2),S(2))", "(S(2),P(sum)) -> (S(2),P(sum))")
    if mesh == (8,):
        lacks(labels, "(S(2)) -> (S(2))")  # 12 heads do not split evenly over 8
        has(labels, "(S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_merges_batch_and_sequence(mesh):
    """view (2,16,48)->(32,48): S on batch (outer) moves to the merged dim; S on sequence is not offered."""
    labels = check(aten.view.default, rnd(2, 16, 48), [-1, 48], mesh=mesh)
    assert not any(lab.startswith("(S(1)") for lab in labels), sorted(labels)
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(1))")
    if mesh == (2,):
        has(labels, "(S(0)) -> (S(0))")
    if mesh == (2, 2):
        has(labels, "(S(0),S(2)) -> (S(0),S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_uneven_one_to_one_dims(mesh):
    """(3,5,7)->(15,7): the 7-dim maps 1:1 and shards unevenly; the 3-dim (odd) never moves into 15."""
    labels = check(aten.reshape.default, rnd(3, 5, 7), [15, 7], mesh=mesh)
    lacks(labels, "(S(0)) -> (S(0))")
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_reshape_gqa_kv_heads_merge(mesh):
    """Llama's repeat_kv: (2,2,4,16,8)->(2,8,16,8) keeps S on the 2 kv heads only if 2 % axis == 0."""
    x = rnd(2, 2, 1, 16, 8).expand(2, 2, 4, 16, 8)
    labels = check(aten.reshape.default, x, [2, 8, 16, 8], mesh=mesh)
    if mesh == (2,):
        has(labels, "(S(1)) -> (S(1))", "(S(3)) -> (S(2))")
    if mesh == (4,):
        lacks(labels, "(S(1)) -> (S(1))")


@pytest.mark.parametrize("mesh", MESHES)
def test_view_block_shard_of_fused_qkv(mesh):
    """Fused qkv (3 x 12 heads of 4): (32,144)->(2,16,144) and (2,16,144)->(2,16,36,4) carry S[3]
    when a consumer asks for 3 blocks."""
    labels = check(aten.view.default, rnd(32, 144), [2, 16, 144], mesh=mesh, hints={(0, 2, 3)})
    labels2 = check(aten._unsafe_view.default, rnd(2, 16, 144), [2, 16, 36, 4], mesh=mesh, hints={(0, 2, 3)})
    if len(mesh) == 1:
        has(labels, "(S(1)[3]) -> (S(2)[3])", "(S(1)) -> (S(2))")
        has(labels2, "(S(2)[3]) -> (S(2)[3])")
    else:
        has(labels, "(S(1)[3],S(1)[3]) -> (S(2)[3],S(2)[3])")
        has(labels2, "(S(2)[3],S(2)[3]) -> (S(2)[3],S(2)[3])")


@pytest.mark.parametrize("mesh", MESHES)
def test_flatten_and_unflatten(mesh):
    labels = check(aten.flatten.using_ints, rnd(2, 8, 12, 4), 2, 3, mesh=mesh)
    labels2 = check(aten.unflatten.int, rnd(2, 8, 48), 2, [12, 4], mesh=mesh)
    if len(mesh) == 1:
        has(labels, "(S(2)) -> (S(2))")
        lacks(labels, "(S(3)) -> (S(2))")
        has(labels2, "(S(2)) -> (S(2))")
