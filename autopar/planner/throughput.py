"""A plan's throughput figures: its step's model FLOPs (``cost.model_flops``), model FLOP/s per device and MFU at
the predicted step time, against the profile's dense peak for the compute dtype (``Plan.throughput``)."""

from __future__ import annotations

import dataclasses

from autopar.capture import OpGraph
from autopar.cost import ModelFlops, count_model_flops
from costmodel import load_profile, precision

from .plan_parts import PlanThroughput
from .schema import Plan

__all__ = ["peak_flops", "throughput", "with_throughput"]


def with_throughput(plan: Plan, graph: OpGraph) -> Plan:
    """``plan`` with its ``throughput``; ``graph``: what the plan runs (one micro-batch of a step of
    ``plan.microbatches``)."""
    recomputed = frozenset(name for name, node in plan.nodes.items() if node.recompute)
    flops = count_model_flops(graph, plan.microbatches, recomputed)
    return dataclasses.replace(plan, throughput=throughput(flops, plan.cost.total_s, plan.mesh.size, peak_flops(plan)))


def throughput(flops: ModelFlops, step_s: float, devices: int, peak: float) -> PlanThroughput:
    """The figures of a step of ``step_s`` seconds on ``devices`` devices of dense peak ``peak`` FLOP/s."""
    counted = PlanThroughput(
        flops.per_step, flops.with_recompute, flops.parameters, flops.tokens, flops.attention, peak, 0.0, 0.0
    )
    return counted.at_step(step_s, devices)


def peak_flops(plan: Plan) -> float:
    """The dense peak FLOP/s of the plan's device for its compute dtype (the profile's ``peak_flops``)."""
    return load_profile(plan.settings.profile).peak_flops_for(precision(plan.settings.dtype).compute_dtype)
