"""The floor of an interleaved run (``planner.stage_floor``): the weighted row it bounds is at most what the ranks of
any stage plan's even split need together, its floor is at most the objective of every stage plan that fits, and
the planner that prunes runs by it chooses what it chose without it."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.cost import stage_counts
from autopar.models import load_model
from autopar.planner import stage_floor
from autopar.planner.heap import FrozenHeap
from autopar.planner.options import HintOptions, PlanOptions
from autopar.planner.pipeline_choice import PipelineChoice, SharedPlanning
from autopar.planner.pipeline_planning import stage_mesh
from autopar.planner.stage_assignment import chain_layers, chain_slots, even_stages
from autopar.planner.stage_floor import StageFloors, kept_weights
from autopar.planner.stage_prices import _grad_bytes, chain_prices, priced_stages


@pytest.fixture(scope="module")
def stage_plans():
    """A GPT-2 of 8 layers on (2, 2), pipelined on the first axis at 4 micro-batches: its stage context and stage
    plans from the fastest down to ones searched under tighter bounds (weighted as the walk weighs them)."""
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 8})
    options = PlanOptions.from_keywords(dict(profile="cpu", pipeline="pp", microbatches=4, schedule="interleaved"))
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    with FrozenHeap() as heap:
        choice = PipelineChoice(model, mesh, args, kwargs, options, HintOptions(), None, SharedPlanning(heap))
        ctx = choice._context(4, stage_mesh(mesh, 0), 0, choice.inner)
        free = choice._search(ctx)
        weighted = dataclasses.replace(ctx, activation_weight=3)
        plans = [free]
        for share in (0.8, 0.6, 0.45):
            bound = int((free.memory.params_bytes + free.memory.grads_bytes + free.memory.optimizer_bytes) * 1.0)
            bound += int(3 * free.memory.activations_bytes * share)
            try:
                plans.append(choice._search(weighted, mem_cap=bound))
            except autopar.MemoryCapError:
                break
        yield mesh, ctx, plans


def _row_and_needs(ctx, plan, p: int, m: int, v: int) -> tuple[int, list[int]]:
    """The floor's row of ``plan`` (each parameter an op reads: its state less its gradient; each op: its searched
    bytes times its stage's count) and each rank's need under the even interleaved split, as the planner prices it."""
    layers = chain_layers(ctx.graph)
    n, counts = len(layers), stage_counts("interleaved", p, m, v)
    slots = chain_slots(ctx.graph, layers)[1]
    stage = {k: j for j, (a, b) in enumerate(even_stages(n, p * v)) for k in range(a, b)} | {n: 0, n + 1: p * v - 1}
    consumers, row = ctx.graph.consumers(), 0
    for node in ctx.graph.nodes:
        nbytes = plan.node_costs.get(node.name, (0, 0, 0, 0))[1]
        if node.kind == "op":
            row += counts[stage[slots[node.index]]] * nbytes
        elif node.kind == "param" and any(ctx.graph.nodes[u].kind == "op" for u, _, _ in consumers[node.index]):
            row += nbytes - _grad_bytes(node, plan)
    link = ctx.coster.settings.profile.link_for_axis((p, *ctx.mesh.shape), 0)
    priced = priced_stages(chain_prices(ctx.graph, plan, layers, link, m), "interleaved", m, p, v, None)
    return row, [stage.memory_bytes for stage in priced.stages[:p]]


@pytest.mark.parametrize("v", [2, 4])
def test_the_row_is_at_most_what_the_ranks_need_together(stage_plans, v: int) -> None:
    """The derivation in ``stage_floor``'s docstring, on real stage plans: ``sum_params (P_i) + sum_j n_j A_j <=
    sum_r need_r`` for each plan met (the free one and those of tighter bounds), so a split that fits ``cap`` on
    every rank has its row at most ``p cap``."""
    mesh, ctx, plans = stage_plans
    assert len(plans) >= 3
    for plan in plans:
        row, needs = _row_and_needs(ctx, plan, 2, 4, v)
        assert 0 < row <= sum(needs), (row, needs)


@pytest.mark.parametrize("v", [2, 4])
def test_the_floor_is_at_most_every_fitting_plans_objective_and_sees_the_cap(stage_plans, v: int) -> None:
    """Each plan fits the cap of its own fullest rank; the floor under that cap is at most its objective.  Under a
    cap whose ranks together hold less than any plan met needs (``p cap`` below every plan's row), the floor is above
    the free plan's objective: the floor sees the cap, which the bound from the free plan alone (``step_at_least``)
    cannot."""
    mesh, ctx, plans = stage_plans
    floors = StageFloors.of(ctx)
    assert floors is not None
    free_ps = plans[0].search.objective_ps
    for plan in plans:
        cap = max(_row_and_needs(ctx, plan, 2, 4, v)[1])
        floor = floors.floor_ps(2, 4, v, cap, free_ps / (2 * cap))
        assert floor <= plan.search.objective_ps, (floor, plan.search.objective_ps)
    below = min(_row_and_needs(ctx, plan, 2, 4, v)[0] for plan in plans) // 2 - 1
    assert floors.floor_ps(2, 4, v, below, free_ps / (2 * below)) > free_ps


def test_kept_weights_round_each_count_down_to_three_values() -> None:
    counts = stage_counts("interleaved", 4, 8, 4)
    assert counts == (7, 5, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 3, 1)
    assert kept_weights(counts) == (4,) * 14 + (3, 1)
    assert all(k <= c for k, c in zip(kept_weights(counts), counts))
    assert kept_weights((2, 1)) == (2, 1)


def test_the_planner_pruning_by_floors_chooses_what_it_chose_without_them(monkeypatch) -> None:
    """``pipeline="auto"`` on a cap the fastest stage plans miss: the same plan and step with the floors as without
    them, and the walks search fewer bounds."""
    from autopar.planner import stage_fitting

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 8})
    mesh = autopar.Mesh((2,), axis_names=("pp",))
    plan_of = dict(example_inputs=args, example_kwargs=kwargs, profile="cpu", compare_families=False)
    need = autopar.plan(model, mesh, pipeline="pp", microbatches=4, schedule="interleaved", **plan_of)
    options = dict(pipeline="auto", mem_cap=int(need.memory.per_device_bytes * 0.7), **plan_of)
    searched, real_under = [], stage_fitting.StageFit.under
    monkeypatch.setattr(stage_fitting.StageFit, "under", lambda self, b: searched.append(b) or real_under(self, b))
    with_floors = autopar.plan(model, mesh, **options)
    walked = len(searched)
    monkeypatch.setattr(stage_floor.StageFloors, "of", classmethod(lambda cls, ctx: None))
    searched[:] = []
    without = autopar.plan(model, mesh, **options)
    same = (with_floors.cost, with_floors.pipeline, with_floors.nodes)
    assert same == (without.cost, without.pipeline, without.nodes)
    assert walked <= len(searched)  # (on models this small no floor beats the fastest: see stage_floor)
