"""Convolution rules (``autopar.strategies.conv``) checked on real data, planned, and run.

Every case runs every strategy the rule offers on a simulated mesh and compares
with the op on full tensors (``validate.assert_rule_valid``); channel counts per
group (5, 7) are divided by none of the meshes, so the shards are uneven.  The
middle part pins the strategies offered; the end plans a ViT (its patch embedding
is a Conv2d) and trains a grouped/depthwise conv stack on 4 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from autopar.strategies.conv import GROUP_SPLIT_KERNELS
from autopar.strategies.validate import assert_rule_valid

aten = torch.ops.aten
MESHES = [(2,), (3,), (2, 2)]
_g = torch.Generator().manual_seed(0)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


def case(target, *args, id: str):
    return pytest.param(target, args, id=id)


# conv args after (input, weight, bias): stride, padding, dilation, groups
CASES = [
    case(aten.conv1d.default, r(3, 5, 11), r(7, 5, 3), r(7), [2], [1], [2], 1, id="conv1d-bias"),
    case(aten.conv1d.default, r(3, 5, 11), r(7, 5, 3), None, [2], [1], [2], 1, id="conv1d-nobias"),
    case(aten.conv1d.default, r(3, 10, 11), r(14, 5, 3), r(14), [2], [1], [2], 2, id="conv1d-bias-groups2"),
    case(aten.conv1d.default, r(3, 10, 11), r(14, 5, 3), None, [2], [1], [2], 2, id="conv1d-nobias-groups2"),
    case(aten.conv1d.default, r(5, 11), r(7, 5, 3), r(7), id="conv1d-unbatched"),
    case(aten.conv1d.padding, r(3, 10, 11), r(14, 5, 3), r(14), [1], "same", [2], 2, id="conv1d-same-groups2"),
    case(aten.conv2d.default, r(3, 5, 9, 10), r(7, 5, 3, 2), r(7), [2, 1], [1, 0], [1, 2], 1, id="conv2d-bias"),
    case(aten.conv2d.default, r(3, 5, 9, 10), r(7, 5, 3, 2), None, [2, 1], [1, 0], [1, 2], 1, id="conv2d-nobias"),
    case(aten.conv2d.default, r(3, 10, 9, 8), r(14, 5, 3, 2), r(14), [1, 2], [0, 1], [2, 1], 2, id="conv2d-groups2"),
    case(aten.conv2d.default, r(3, 10, 9, 8), r(14, 5, 3, 2), None, [1, 2], [0, 1], [2, 1], 2, id="conv2d-g2-nobias"),
    case(aten.conv2d.default, r(2, 12, 7, 7), r(12, 1, 3, 3), r(12), [1, 1], [1, 1], [1, 1], 12, id="conv2d-depthwise"),
    case(aten.conv2d.default, r(3, 3, 16, 12), r(5, 3, 4, 4), r(5), [4, 4], id="conv2d-patch-embedding"),
    case(aten.conv2d.default, r(3, 5, 7, 9), r(7, 5, 1, 1), r(7), id="conv2d-1x1"),
    case(aten.conv3d.default, r(2, 10, 5, 6, 4), r(14, 5, 2, 3, 1), r(14), [1, 2, 1], [0, 1, 0], [1, 1, 1], 2, id="3d"),
    case(aten.conv_transpose1d.default, r(3, 5, 6), r(5, 7, 3), r(7), [2], [1], [1], 1, id="conv_transpose1d"),
    case(aten.conv_transpose2d.input, r(3, 10, 5, 4), r(10, 7, 3, 3), r(14), [2, 2], [1, 0], [1, 0], 2, id="convT2d"),
    case(aten.convolution.default, r(3, 10, 9), r(14, 5, 3), r(14), [2], [1], [1], False, [0], 2, id="convolution"),
    case(aten.convolution.default, r(3, 10, 9), r(10, 7, 3), None, [2], [1], [1], True, [1], 2, id="convolution-T"),
]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "mesh" + "x".join(map(str, m)))
@pytest.mark.parametrize("target,args", CASES)
def test_every_strategy_is_valid(target, args, mesh_shape):
    checks = assert_rule_valid(target, args, mesh_shape=mesh_shape)
    assert not any(c.strategy.fallback for c in checks)
    assert any(any(c.strategy.split) for c in checks)  # more than replicate is offered


# ---------------------------------------------------------------- the strategies offered


def offered(target, *args, mesh_shape=(2,)) -> set[str]:
    """Labels of the (validated) strategies, `` @kernel`` appended where one runs."""
    checks = assert_rule_valid(target, args, mesh_shape=mesh_shape)
    return {c.strategy.label() + "".join(f" @{k}" for k in c.strategy.kernels if k) for c in checks}


def test_conv2d_offers_batch_output_and_input_channel_splits():
    got = offered(aten.conv2d.default, r(3, 5, 9, 10), r(7, 5, 3, 2), r(7), [2, 1], [1, 0], [1, 2], 1)
    assert got == {
        "(S(0)) (R) (R) -> (S(0))",  # batch
        "(R) (S(0)) (S(0)) -> (S(1))",  # output channels: weight rows, bias with them
        "(S(1)) (S(1)) (P(sum)) -> (P(sum))",  # input channels: the bias is added once in the sum
        "(P(sum)) (R) (P(sum)) -> (P(sum))",  # linear in the input
        "(R) (P(sum)) (P(sum)) -> (P(sum))",  # linear in the weight
        "(R) (R) (R) -> (R)",
    }


def test_a_split_inside_groups_needs_more_channels_than_ranks():
    """Two output channels on two ranks: a rank beside an uneven earlier split could hold none."""
    got = offered(aten.conv1d.default, r(3, 2, 8), r(2, 2, 3))
    assert "(S(0)) (R) -> (S(0))" in got
    assert not {"(R) (S(0)) -> (S(1))", "(S(1)) (S(1)) -> (P(sum))"} & got


def test_groups_split_whole_groups_or_inside_every_group():
    args = (r(3, 10, 11), r(14, 5, 3), None, [2], [1], [2], 2)
    kernel = GROUP_SPLIT_KERNELS[aten.conv1d.default]
    got = offered(aten.conv1d.default, *args)
    assert {
        "(R) (S(0)[2]) -> (S(1)[2])",  # a share of each group's output channels
        f"(S(1)) (S(0)) -> (S(1)) @{kernel}",  # one whole group per rank, run with groups=1
        "(S(1)[2]) (S(1)) -> (P(sum))",  # a share of each group's input channels
    } <= got
    got3 = offered(aten.conv1d.default, *args, mesh_shape=(3,))
    assert not any("@" in s for s in got3)  # 3 ranks cannot hold whole groups of 2
    assert {"(R) (S(0)[2]) -> (S(1)[2])", "(S(1)[2]) (S(1)) -> (P(sum))"} <= got3


def test_depthwise_conv_splits_its_groups_on_both_axes():
    kernel = GROUP_SPLIT_KERNELS[aten.conv2d.default]
    got = offered(aten.conv2d.default, r(2, 12, 7, 7), r(12, 1, 3, 3), r(12), [1], [1], [1], 12, mesh_shape=(2, 2))
    assert f"(S(1),S(1)) (S(0),S(0)) (S(0),S(0)) -> (S(1),S(1)) @{kernel} @{kernel}" in got
    assert not any("[12]" in s for s in got)  # one channel per group: nothing to split inside a group


def test_transposed_weight_holds_input_channels_on_dim_0():
    got = offered(aten.conv_transpose2d.input, r(3, 10, 5, 4), r(10, 7, 3, 3), r(14), [2, 2], [1, 0], [1, 0], 2)
    assert {"(R) (S(1)) (S(0)[2]) -> (S(1)[2])", "(S(1)[2]) (S(0)[2]) (P(sum)) -> (P(sum))"} <= got


def test_spatial_split_only_where_windows_tile_the_dim():
    patch = (r(3, 3, 16, 12), r(5, 3, 4, 4), r(5), [4, 4])  # 4 x 3 patches of 4x4: whole patches per rank
    rows, cols = "(S(2)) (R) (R) -> (S(2))", "(S(3)) (R) (R) -> (S(3))"
    got2, got3 = (offered(aten.conv2d.default, *patch, mesh_shape=m) for m in [(2,), (3,)])
    assert rows in got2 and cols not in got2
    assert cols in got3 and rows not in got3
    assert "(S(2)) (R) (R) -> (S(2))" in offered(
        aten.conv2d.default, r(3, 5, 7, 9), r(7, 5, 1, 1), r(7), mesh_shape=(3,)
    )
    overlapping = offered(aten.conv2d.default, r(3, 5, 8, 8), r(7, 5, 3, 3), None, [1, 1], [1, 1])
    assert not any("S(2)" in s or "S(3)" in s for s in overlapping)


# ---------------------------------------------------------------- planning and running


def test_vit_patch_embedding_is_planned_by_the_conv_rule():
    import autopar
    from autopar.planner.driver import plan_from_context, prepare

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = {"image_size": 16, "patch_size": 4, "hidden_size": 24, "num_hidden_layers": 1, "num_attention_heads": 3}
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**vit, intermediate_size=50, num_labels=5))
    pixels, labels = torch.randn(2, 3, 16, 16), torch.tensor([1, 3])
    ctx = prepare(model, autopar.Mesh((2,)), example_inputs=(pixels,), example_kwargs={"labels": labels})
    plan = plan_from_context(ctx, compare_families=False)
    conv = [n for n in plan.nodes.values() if n.op == "aten.conv2d.default"]
    assert len(conv) == 1 and not conv[0].fallback
    assert not [f for f in plan.fallback_ops if "conv" in f.op]


class _ConvStack(torch.nn.Module):
    """Depthwise, pointwise, grouped and grouped-transposed 1-D convolutions (a wav2vec2-like front end)."""

    def __init__(self):
        super().__init__()
        self.dw = torch.nn.Conv1d(64, 64, 5, padding=2, groups=64)
        self.pw = torch.nn.Conv1d(64, 128, 1)
        self.grouped = torch.nn.Conv1d(128, 128, 3, padding=1, groups=16)
        self.up = torch.nn.ConvTranspose1d(128, 64, 3, stride=2, groups=4)

    def forward(self, x):
        return self.up(self.grouped(self.pw(self.dw(x)))).square().mean()


def _conv_stack():
    torch.manual_seed(0)
    return _ConvStack(), torch.randn(2, 64, 512)


def _conv_rank_fn(rank, world, cap):
    import autopar

    model, x = _conv_stack()
    sharded = autopar.compile(model, autopar.Mesh((2, 2)), example_inputs=(x,), mem_cap=cap)
    loss = sharded(x)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    kernels = sorted({k for n in sharded.plan.nodes.values() for k in n.kernels if k})
    return loss.detach(), sharded.full_grads(), kernels


def test_grouped_convs_train_on_four_ranks_like_one_device():
    """Under half the data-parallel memory the plan splits groups (the kernels run), and stays exact."""
    from dist_utils import run_ranks

    import autopar
    from autopar.planner.driver import plan_from_context, prepare

    model, x = _conv_stack()
    ctx = prepare(model, autopar.Mesh((2, 2)), example_inputs=(x,))
    cap = int(0.5 * plan_from_context(ctx, family="data parallel", compare_families=False).memory.per_device_bytes)
    results = run_ranks(_conv_rank_fn, 4, cap, timeout_s=300)
    loss = model(x)
    loss.backward()
    for got_loss, grads, kernels in results:
        assert set(kernels) & set(GROUP_SPLIT_KERNELS.values()), f"no convolution split its groups: {kernels}"
        torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-4, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
