"""Compute rules (matmul, pointwise, reductions, norms) checked on real data by the validator.

Every case runs every strategy of its rule on a simulated mesh and compares with
the op on full tensors; the second half pins the exact strategies offered.
"""

from __future__ import annotations

import pytest
import torch

from autopar.placement import Partial, Replicate, Shard
from autopar.strategies.base import AxisStrategy, OpCall, register
from autopar.strategies.validate import StrategyCheck, assert_rule_valid, make_call, validate_op

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]
_g = torch.Generator().manual_seed(0)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


def pos(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_g) + 0.5


def mask(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=_g) > 0.5


def ints(*shape: int) -> torch.Tensor:
    return torch.randint(0, 3, shape, generator=_g)


def case(target, args, kwargs=None, hints=(), *, id: str):
    return pytest.param(target, args, kwargs or {}, frozenset(hints), id=id)


CASES = [
    # matmul family: odd sizes (5, 7, 53) the meshes do not divide
    case(aten.mm.default, (r(5, 7), r(7, 6)), id="mm-uneven"),
    case(aten.addmm.default, (r(48), r(6, 16), r(16, 48)), hints=[(0, 1, 3)], id="addmm-c_attn-blocks3"),
    case(aten.addmm.default, (r(1, 12), r(5, 8), r(8, 12)), {"beta": 0.5, "alpha": 2.0}, id="addmm-bias2d-beta"),
    case(aten.linear.default, (r(2, 5, 8), r(53, 8), r(53)), id="linear-bias-vocab53"),
    case(aten.linear.default, (r(8), r(12, 8)), id="linear-1d-nobias"),
    case(aten.bmm.default, (r(3, 5, 8), r(3, 8, 6)), id="bmm"),
    case(aten.baddbmm.default, (r(5, 6), r(3, 5, 8), r(3, 8, 6)), id="baddbmm-bcast-bias"),
    case(aten.matmul.default, (r(3, 1, 5, 8), r(4, 8, 6)), id="matmul-batch-bcast"),
    case(aten.matmul.default, (r(2, 3, 5, 8), r(8, 7)), id="matmul-nd-2d"),
    case(aten.matmul.default, (r(8), r(3, 8, 6)), id="matmul-1d-nd"),
    case(aten.matmul.default, (r(3, 5, 8), r(8)), id="matmul-nd-1d"),
    case(aten.einsum.default, ("bij,bjk->bik", [r(3, 5, 8), r(3, 8, 6)]), id="einsum-bmm"),
    case(aten.einsum.default, ("...ij,kj", [r(2, 3, 5, 8), r(7, 8)]), id="einsum-ellipsis-implicit"),
    case(aten.einsum.default, ("ij,jk->k", [r(5, 8), r(8, 6)]), id="einsum-lhs-only-sum"),
    case(aten.mv.default, (r(5, 8), r(8)), id="mv"),
    case(aten.addmv.default, (r(5), r(5, 8), r(8)), id="addmv"),
    case(aten.dot.default, (r(7), r(7)), id="dot"),
    # pointwise: broadcasting, scalars, casts, bool/int outputs
    case(aten.add.Tensor, (r(4, 12), r(12)), hints=[(0, 1, 3)], id="add-bcast-blocks"),
    case(aten.add.Tensor, (r(5, 7), 1.0), id="add-scalar"),
    case(aten.sub.Tensor, (r(5, 1), r(1, 7)), id="sub-outer-bcast"),
    case(aten.mul.Tensor, (r(5, 7), 0.5), id="mul-scalar"),
    case(aten.mul.Tensor, (r(5, 7), -2.0), id="mul-negative-scalar"),
    case(aten.mul.Tensor, (r(2, 5, 7), r(5, 1)), id="mul-bcast"),
    case(aten.mul.Tensor, (r(5, 7), torch.tensor(3.0)), id="mul-0d-tensor"),
    case(aten.div.Tensor, (r(5, 7), pos(7)), id="div-bcast"),
    case(aten.neg.default, (r(5, 7),), id="neg"),
    case(aten.pow.Tensor_Scalar, (r(5, 7), 3.0), id="pow"),
    case(aten.rsqrt.default, (pos(5, 7),), id="rsqrt"),
    case(aten.exp.default, (r(5, 7),), id="exp"),
    case(aten.log.default, (pos(5, 7),), id="log"),
    case(aten.gelu.default, (r(5, 7),), {"approximate": "tanh"}, id="gelu-tanh"),
    case(aten.silu.default, (r(5, 7),), id="silu"),
    case(aten.tanh.default, (r(5, 7),), id="tanh"),
    case(aten.to.dtype, (r(5, 7), torch.float64), id="to-dtype"),
    case(aten.to.dtype, (r(5, 7), torch.int64), id="to-int"),
    case(
        aten.to.dtype_layout,
        (mask(5, 7),),
        {"dtype": torch.float32, "layout": torch.strided, "device": torch.device("cpu")},
        id="to-dtype_layout",
    ),
    case(aten.contiguous.default, (r(5, 7),), id="contiguous"),
    case(aten.alias.default, (r(5, 7),), id="alias"),
    case(aten.clone.default, (r(5, 7),), id="clone"),
    case(aten.lift_fresh_copy.default, (r(5, 7),), id="lift_fresh_copy"),
    case(aten.copy.default, (r(5, 7), r(7)), id="copy-bcast"),
    case(aten.fill.Scalar, (r(5, 7), 2.0), id="fill-scalar"),
    case(aten.fill.Tensor, (r(5, 7), torch.tensor(1.5)), id="fill-tensor"),
    case(aten.eq.Tensor, (ints(5, 7), ints(7)), id="eq"),
    case(aten.le.Tensor, (ints(5, 1), ints(1, 7)), id="le"),
    case(aten.ne.Scalar, (ints(5, 7), 1), id="ne-scalar"),
    case(aten.__and__.Tensor, (mask(5, 7), mask(1, 7)), id="and"),
    case(aten.where.self, (mask(5, 7), r(5, 7), r(7)), id="where"),
    case(aten.where.ScalarOther, (mask(5, 7), r(5, 7), 0.0), id="where-scalar-zero"),
    case(aten.masked_fill.Scalar, (r(5, 7), mask(5, 7), float("-inf")), id="masked_fill-inf"),
    case(aten.clamp.default, (r(5, 7), -0.5, 0.5), id="clamp"),
    case(aten.maximum.default, (r(5, 7), r(5, 7)), id="maximum"),
    # reductions
    case(aten.sum.dim_IntList, (r(4, 6, 5), [1]), id="sum-dim"),
    case(aten.sum.dim_IntList, (r(4, 6, 5), [-1], True), id="sum-keepdim"),
    case(aten.sum.default, (r(5, 7),), id="sum-all"),
    case(aten.sum.dim_IntList, (mask(4, 6), [1]), id="sum-bool"),
    case(aten.mean.dim, (r(4, 7, 5), [-1], True), id="mean-keepdim"),
    case(aten.mean.dim, (r(4, 7, 5), [1, 2]), id="mean-two-dims-uneven"),
    case(aten.mean.default, (r(5, 7),), id="mean-all"),
    case(aten.amax.default, (r(4, 7, 5), [-1], True), id="amax-keepdim"),
    case(aten.amax.default, (r(5, 7),), id="amax-all"),
    case(aten.max.default, (r(5, 7),), id="max-all"),
    case(aten.amin.default, (r(4, 6, 5), [1]), id="amin"),
    case(aten.max.dim, (r(4, 6, 5), 1), id="max-dim-two-outputs"),
    case(aten.argmax.default, (r(4, 6, 5), 2, True), id="argmax"),
    case(aten.logsumexp.default, (r(4, 6, 5), [1]), id="logsumexp"),
    case(aten.var.correction, (r(4, 6, 5), [1]), {"correction": 1, "keepdim": True}, id="var"),
    case(aten._softmax.default, (r(4, 6, 5), -1, False), id="_softmax"),
    case(aten._log_softmax.default, (r(4, 6, 5), 1, False), id="_log_softmax"),
    case(aten.softmax.int, (r(4, 6, 5), -1), id="softmax"),
    case(aten.cumsum.default, (r(4, 7), -1), id="cumsum"),
    case(aten.cumsum.default, (ints(4, 7), 0), id="cumsum-int"),
    case(aten.diff.default, (r(4, 7),), id="diff"),
    case(aten.histc.default, (ints(6, 5).double(), 4, 0, 3), id="histc-moe-router-counts"),
    case(aten.topk.default, (r(4, 6, 7), 3), id="topk"),  # Mixtral's router: (values, indices)
    case(aten.topk.default, (r(4, 7, 6), 2, 1, False), id="topk-dim1-smallest"),
    case(aten.sort.default, (r(4, 7), 0, True), id="sort"),
    case(aten.sort.stable, (ints(4, 7),), {"stable": True}, id="sort-stable-int"),
    case(aten.argsort.default, (r(4, 7),), id="argsort"),
    case(aten.diff.default, (ints(4, 12), 1, -1, ints(4, 1)), id="diff-int-prepend"),  # HF packed-sequence mask
    case(aten.diff.default, (r(5, 6, 4), 2, 1, r(5, 1, 4), r(5, 2, 4)), id="diff-n2-prepend-append"),
    # norms and dropout
    case(aten.layer_norm.default, (r(4, 6, 8), [8], r(8), r(8), 1e-5), id="layer_norm"),
    case(aten.native_layer_norm.default, (r(4, 6, 8), [6, 8], r(6, 8), r(6, 8), 1e-5), id="native_layer_norm"),
    case(aten.rms_norm.default, (r(4, 6, 8), [8], r(8), 1e-6), id="rms_norm"),
    case(aten.group_norm.default, (r(4, 6, 5), 3, r(6), r(6)), id="group_norm"),
    case(aten.dropout.default, (r(4, 6), 0.0, True), id="dropout-p0"),
    case(aten.native_dropout.default, (r(4, 6), 0.5, False), id="native_dropout-eval"),
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "mesh" + "x".join(map(str, m)))
@pytest.mark.parametrize("target,args,kwargs,hints", CASES)
def test_every_strategy_is_valid(target, args, kwargs, hints, mesh_shape):
    checks = assert_rule_valid(target, args, kwargs, mesh_shape=mesh_shape, block_hints=hints)
    assert all(isinstance(c, StrategyCheck) and c.ok for c in checks)
    assert not any(c.strategy.fallback for c in checks)  # a rule answered, not the fallback
    assert any(not c.strategy.inputs or any(c.strategy.split) for c in checks)  # something is split


# ---------------------------------------------------------------- the strategies offered


def labels(target, args, kwargs=None, *, mesh_shape=(2,), hints=()) -> list[str]:
    checks = assert_rule_valid(target, args, kwargs, mesh_shape=mesh_shape, block_hints=frozenset(hints))
    return [c.strategy.label() + "".join(f" [{k}]" for k in c.strategy.kernels if k) for c in checks]


def test_mm_offers_exactly_the_einsum_strategies():
    assert sorted(labels(aten.mm.default, (r(6, 8), r(8, 10)))) == sorted(
        [
            "(S(0)) (R) -> (S(0))",  # M
            "(R) (S(1)) -> (S(1))",  # N
            "(S(1)) (S(0)) -> (P(sum))",  # K
            "(P(sum)) (R) -> (P(sum))",  # linear in lhs
            "(R) (P(sum)) -> (P(sum))",  # linear in rhs
            "(R) (R) -> (R)",
        ]
    )


def test_mm_drops_a_dim_smaller_than_the_axis_and_expands_to_2d():
    got = labels(aten.mm.default, (r(3, 8), r(8, 6)), mesh_shape=(4,))
    assert len(got) == 5 and "(S(0)) (R) -> (S(0))" not in got
    got2d = labels(aten.mm.default, (r(4, 8), r(8, 6)), mesh_shape=(2, 2))
    assert len(got2d) == 36  # 6 per axis, every pair valid
    assert "(P(sum),R) (R,P(sum)) -> (P(sum),P(sum))" in got2d  # lhs partial on axis 0, rhs on axis 1


def test_nested_uneven_splits_never_leave_a_rank_an_empty_piece():
    """3 rows split on both axes of a 2x2 mesh are pieces 2, 1 and then 1, 1, 1, 0: not offered; 5 rows (3, 2
    then 2, 1, 1, 1) are.  Each axis alone only sees the largest piece the earlier one left."""
    three = labels(aten.mm.default, (r(3, 8), r(8, 6)), mesh_shape=(2, 2))
    assert "(S(0),S(0)) (R,R) -> (S(0),S(0))" not in three
    assert "(S(0),R) (R,R) -> (S(0),R)" in three  # one axis alone is fine
    five = labels(aten.mm.default, (r(5, 8), r(8, 6)), mesh_shape=(2, 2))
    assert "(S(0),S(0)) (R,R) -> (S(0),S(0))" in five


def test_addmm_block_hint_splits_inside_each_of_q_k_v():
    args = (r(48), r(6, 16), r(16, 48))  # bias, x, W: W holds q | k | v side by side
    plain = labels(aten.addmm.default, args)
    hinted = labels(aten.addmm.default, args, hints=[(0, 1, 3)])
    assert len(plain) == 6 and len(hinted) == 7
    assert set(hinted) - set(plain) == {"(S(0)[3]) (R) (S(1)[3]) -> (S(1)[3])"}
    assert "(P(sum)) (S(1)) (S(0)) -> (P(sum))" in plain  # K split: the bias becomes partial too
    got2d = labels(aten.addmm.default, args, mesh_shape=(2, 2), hints=[(0, 1, 3)])
    assert "(S(0)[3],S(0)[3]) (R,R) (S(1)[3],S(1)[3]) -> (S(1)[3],S(1)[3])" in got2d


def test_linear_bias_follows_the_output():
    got = labels(aten.linear.default, (r(2, 5, 8), r(53, 8), r(53)))
    assert sorted(got) == sorted(
        [
            "(S(0)) (R) (R) -> (S(0))",
            "(S(1)) (R) (R) -> (S(1))",
            "(R) (S(0)) (S(0)) -> (S(2))",  # column parallel: weight rows = output features
            "(S(2)) (S(1)) (P(sum)) -> (P(sum))",  # row parallel
            "(P(sum)) (R) (P(sum)) -> (P(sum))",
            "(R) (P(sum)) (P(sum)) -> (P(sum))",
            "(R) (R) (R) -> (R)",
        ]
    )


def test_matmul_broadcast_batch_dim_is_replicated_on_the_size1_operand():
    got = labels(aten.matmul.default, (r(3, 1, 5, 8), r(4, 8, 6)))
    assert "(S(0)) (R) -> (S(0))" in got  # lhs-only batch dim
    assert "(R) (S(0)) -> (S(1))" in got  # lhs broadcasts (size 1) this batch dim
    assert "(S(3)) (S(1)) -> (P(sum))" in got
    assert len(got) == 8


def test_bmm_and_einsum_agree():
    args = (r(3, 5, 8), r(3, 8, 6))
    assert labels(aten.bmm.default, args) == labels(aten.einsum.default, ("bij,bjk->bik", list(args)))
    assert "(S(0)) (S(0)) -> (S(0))" in labels(aten.bmm.default, args)


def test_einsum_with_repeated_labels_is_replicate_only():
    checks = validate_op(aten.einsum.default, ("ii,ij->j", [r(4, 4), r(4, 6)]), mesh_shape=(2,))
    assert [c.strategy.label() for c in checks] == ["(R) (R) -> (R)"] and checks[0].ok


def test_pointwise_broadcast_partials_and_blocks():
    got = labels(aten.add.Tensor, (r(4, 12), r(12)), hints=[(0, 1, 3)])
    assert sorted(got) == sorted(
        [
            "(S(0)) (R) -> (S(0))",
            "(S(1)) (S(0)) -> (S(1))",
            "(S(1)[3]) (S(0)[3]) -> (S(1)[3])",
            "(P(sum)) (P(sum)) -> (P(sum))",
            "(P(max)) (R) -> (P(max))",
            "(R) (P(max)) -> (P(max))",
            "(R) (R) -> (R)",
        ]
    )


@pytest.mark.parametrize(
    "target,args,psum,pmax",
    [
        (aten.mul.Tensor, (r(4, 6), 0.5), True, True),
        (aten.mul.Tensor, (r(4, 6), -0.5), True, False),
        (aten.div.Tensor, (r(4, 6), pos(6)), True, False),
        (aten.add.Tensor, (r(4, 6), 1.0), False, True),
        (aten.neg.default, (r(4, 6),), True, False),
        (aten.to.dtype, (r(4, 6), torch.float64), True, True),
        (aten.to.dtype, (r(4, 6), torch.int32), False, False),
        (aten.exp.default, (r(4, 6),), False, True),
        (aten.gelu.default, (r(4, 6),), False, False),
        (aten.rsqrt.default, (pos(4, 6),), False, False),
        (aten.pow.Tensor_Scalar, (r(4, 6), 2), False, False),
        (aten.eq.Tensor, (r(4, 6), r(4, 6)), False, False),
    ],
)
def test_pointwise_partial_policy(target, args, psum, pmax):
    got = " ".join(labels(target, args))
    assert ("-> (P(sum))" in got) == psum
    assert ("-> (P(max))" in got) == pmax


def test_mul_of_two_partials_is_never_offered():
    got = labels(aten.mul.Tensor, (r(4, 6), r(4, 6)))
    assert "(P(sum)) (P(sum)) -> (P(sum))" not in got
    assert {"(P(sum)) (R) -> (P(sum))", "(R) (P(sum)) -> (P(sum))"} <= set(got)


def test_sum_keepdim_maps_output_dims():
    assert sorted(labels(aten.sum.dim_IntList, (r(4, 6, 5), [1]))) == sorted(
        [
            "(S(0)) -> (S(0))",
            "(S(1)) -> (P(sum))",
            "(S(2)) -> (S(1))",
            "(P(sum)) -> (P(sum))",
            "(R) -> (R)",
        ]
    )
    assert "(S(2)) -> (S(2))" in labels(aten.sum.dim_IntList, (r(4, 6, 5), [1], True))


def test_mean_over_a_sharded_dim_uses_the_global_count_kernel():
    got = labels(aten.mean.dim, (r(4, 7, 5), [1], True), mesh_shape=(4,))  # 7 rows on 4 ranks: 2,2,2,1
    assert sorted(got) == sorted(
        [
            "(S(0)) -> (S(0))",
            "(S(1)) -> (P(sum)) [mean_as_partial_sum]",
            "(S(2)) -> (S(2))",
            "(P(sum)) -> (P(sum))",
            "(R) -> (R)",
        ]
    )


def _plain_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(1)


@register(_plain_mean)
def _plain_mean_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    return [AxisStrategy((Shard(1),), (Partial("sum"),))]  # the tempting rule, without the kernel


@pytest.mark.parametrize("rows", [8, 7])
def test_summing_local_means_is_wrong_even_or_uneven(rows):
    verdict = {c.strategy.label(): c.ok for c in validate_op(_plain_mean, (r(3, rows),), mesh_shape=(4,))}
    assert verdict == {"(S(1)) -> (P(sum))": False, "(R) -> (R)": True}


def test_amax_and_softmax_and_cumsum():
    assert "(S(1)) -> (P(max))" in labels(aten.amax.default, (r(4, 6), [1]))
    assert "(S(1)) -> (P(max))" in labels(aten.max.default, (r(4, 6),))
    assert not any("P(" in s for s in labels(aten.amin.default, (r(4, 6), [1])))
    soft = labels(aten._softmax.default, (r(4, 6, 5), -1, False))
    assert sorted(soft) == sorted(["(S(0)) -> (S(0))", "(S(1)) -> (S(1))", "(R) -> (R)"])
    scan = labels(aten.cumsum.default, (r(4, 6), 1))
    assert sorted(scan) == sorted(["(S(0)) -> (S(0))", "(P(sum)) -> (P(sum))", "(R) -> (R)"])


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_grouped_mm_of_experts_splits_columns_or_k_never_rows_or_experts(mesh_shape):
    """Hugging Face's per-expert matmul (Mixtral, Qwen-MoE, ...): rows sorted by expert, expert 1 has none."""
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback.default
    got = set(labels(op, (r(5, 4), r(3, 4, 6), torch.tensor([2, 2, 5])), mesh_shape=mesh_shape))
    if mesh_shape == (2,):
        assert {"(R) (S(2)) (R) -> (S(1))", "(S(1)) (S(1)) (R) -> (P(sum))", "(P(sum)) (R) (R) -> (P(sum))"} <= got
    assert not any("S(0)" in lab for lab in got), got


def test_histc_counts_add_up_only_over_a_fixed_range():
    fixed = labels(aten.histc.default, (r(6, 5), 4, -1.0, 1.0))
    assert {"(S(0)) -> (P(sum))", "(S(1)) -> (P(sum))"} <= set(fixed), fixed
    data_range = labels(aten.histc.default, (r(6, 5), 4))  # min == max == 0: the range comes from the data
    assert not any("P(sum)" in lab for lab in data_range), data_range


def test_diff_shards_every_dim_but_its_own_and_passes_partial_sum():
    got = labels(aten.diff.default, (r(5, 6, 4), 1, 1, r(5, 1, 4)))
    assert sorted(got) == sorted(
        [
            "(S(0)) (S(0)) -> (S(0))",
            "(S(2)) (S(2)) -> (S(2))",
            "(P(sum)) (P(sum)) -> (P(sum))",
            "(R) (R) -> (R)",
        ]
    )


def test_topk_never_shards_its_dim():
    got = labels(aten.topk.default, (r(4, 6, 7), 3, 1))
    assert sorted(got) == sorted(["(S(0)) -> (S(0)) (S(0))", "(S(2)) -> (S(2)) (S(2))", "(R) -> (R) (R)"])


def test_layer_norm_shards_leading_dims_only():
    got = labels(aten.layer_norm.default, (r(4, 6, 8), [8], r(8), r(8), 1e-5))
    assert sorted(got) == sorted(["(S(0)) (R) (R) -> (S(0))", "(S(1)) (R) (R) -> (S(1))", "(R) (R) (R) -> (R)"])
    native = labels(aten.native_layer_norm.default, (r(4, 6, 8), [6, 8], r(6, 8), r(6, 8), 1e-5))
    assert sorted(native) == sorted(["(S(0)) (R) (R) -> (S(0)) (S(0)) (S(0))", "(R) (R) (R) -> (R) (R) (R)"])


def test_dropout_shards_any_dim_never_partial():
    got = labels(aten.dropout.default, (r(4, 6, 5), 0.0, True))
    assert sorted(got) == sorted(["(S(0)) -> (S(0))", "(S(1)) -> (S(1))", "(S(2)) -> (S(2))", "(R) -> (R)"])


# ---------------------------------------------------------------- the validator itself


def _gelu_op(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


@register(_gelu_op)
def _wrong_partial_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    return [
        AxisStrategy((Shard(0),), (Shard(0),)),
        AxisStrategy((Partial("sum"),), (Partial("sum"),)),
        AxisStrategy((Shard(1),), (Replicate(),)),
    ]


def test_validator_catches_wrong_strategies_and_names_them():
    checks = validate_op(_gelu_op, (r(4, 6),), mesh_shape=(2,))
    verdict = {c.strategy.label(): c.ok for c in checks}
    assert verdict == {
        "(S(0)) -> (S(0))": True,
        "(P(sum)) -> (P(sum))": False,
        "(S(1)) -> (R)": False,
        "(R) -> (R)": True,
    }
    with pytest.raises(AssertionError) as err:
        assert_rule_valid(_gelu_op, (r(4, 6),), mesh_shape=(2,))
    msg = str(err.value)
    assert "2 of 4 strategies are wrong" in msg
    assert "- (P(sum)) -> (P(sum)): output 0: combined value differs" in msg
    assert "- (S(1)) -> (R): output 0: mesh axis 0 is Replicate but the piece at coordinate 1" in msg
    assert msg.startswith("_gelu_op on mesh (2,) (inputs (4, 6))")


def _chunk_op(x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.chunk(x, 2, dim=1))


@register(_chunk_op)
def _chunk_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    return [AxisStrategy((Shard(0),), (Shard(0), Shard(0))), AxisStrategy((Shard(1),), (Shard(1), Shard(1)))]


def test_validator_handles_multi_output_lists():
    verdict = {c.strategy.label(): c.ok for c in validate_op(_chunk_op, (r(4, 6),), mesh_shape=(2,))}
    # S(1) would need each chunk split inside itself (blocks), a contiguous S(1) is wrong
    assert verdict == {"(S(0)) -> (S(0)) (S(0))": True, "(S(1)) -> (S(1)) (S(1))": False, "(R) -> (R) (R)": True}


def _kernel_op(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


@register(_kernel_op)
def _missing_kernel_rule(call: OpCall, axis_size: int) -> list[AxisStrategy]:
    return [AxisStrategy((Shard(0),), (Partial("sum"),), kernel="no_such_kernel")]


def test_validator_reports_an_unregistered_kernel():
    bad = [c for c in validate_op(_kernel_op, (r(4, 6),)) if not c.ok]
    assert len(bad) == 1 and "'no_such_kernel' is not registered" in bad[0].message


def test_assert_rule_valid_needs_a_rule():
    with pytest.raises(ValueError, match="no rule is registered"):
        assert_rule_valid(lambda x: x, (r(2),))


def test_make_call_orders_tensors_like_pytree():
    call, outs = make_call(aten.addmm.default, (r(6), r(3, 4), r(4, 6)), {"beta": 2.0})
    assert [m.shape for m in call.inputs] == [(6,), (3, 4), (4, 6)]
    assert [m.shape for m in call.outputs] == [(3, 6)] and outs[0].shape == (3, 6)
    assert call.kwargs == {"beta": 2.0}
