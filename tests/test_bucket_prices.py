"""The gradient buckets priced as the runtime fills them (autopar/planner/bucket_prices.py), against the formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from costmodel import collective_time_s, load_profile

MIB = 2**20


class _TwoLayers(nn.Module):
    """Two 4 MiB weights: backward fills the 1 MiB first bucket with the second layer's weight alone (a gradient
    larger than the cap has a bucket of its own), then a bucket with the first layer's, ready when backward ends."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1024, 1024, bias=False)
        self.b = nn.Linear(1024, 1024, bias=False)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


def _data_parallel(bucket_bytes):
    return autopar.plan(
        _TwoLayers(),
        autopar.Mesh((4,), axis_names=("dp",)),
        example_inputs=(torch.randn(64, 1024),),
        profile="h100",
        hints={"*": ["R"]},
        input_placements={"x": ["S(0)"]},
        allow_state_sharding=False,
        grad_bucket_bytes=bucket_bytes,
    )


def _reductions(plan) -> dict[str, tuple[float, float]]:
    """Weight -> (exposed, hidden) seconds of its gradient's all-reduce in the plan."""
    return {
        c.tensor: (c.time_s, c.hidden_s) for c in plan.collectives if (c.kind, c.phase) == ("all_reduce", "backward")
    }


def test_a_bucket_pays_its_own_latency_and_the_last_one_is_exposed_whole():
    """The search prices each 4 MiB gradient at its share ``w = t(B) 4 MiB / B`` of a full bucket's all-reduce
    (B = 25 MiB), ``1 - o`` of it exposed; the runtime runs two 4 MiB buckets, ``t(4 MiB)`` each, the first
    layer's after backward (whole), the second layer's overlapped (``1 - o`` exposed)."""
    plan = _data_parallel(25 * MIB)
    h100 = load_profile("h100")
    link, o, issue = h100.intra_node, h100.grad_reduce_overlap, h100.op_overhead_s()  # each collective is an op
    t4 = collective_time_s("all_reduce", 4 * MIB, 4, link) + issue
    share = (collective_time_s("all_reduce", 25 * MIB, 4, link) + issue) * 4 / 25
    assert t4 > share  # a bucket of its own pays a whole latency, its share of a full bucket a sixth of one
    reductions = _reductions(plan)
    assert reductions["p_a_weight"] == pytest.approx((t4, 0.0), abs=1e-12)
    assert reductions["p_b_weight"] == pytest.approx((t4 * (1 - o), t4 * o))
    added = (t4 - share * (1 - o)) + (t4 * (1 - o) - share * (1 - o))
    assert plan.cost.total_s * 1e12 == pytest.approx(plan.search.objective_ps + added * 1e12)
    assert plan.cost.terms["all_reduce (backward)"] == pytest.approx(t4 * (2 - o))
