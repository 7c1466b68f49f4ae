"""Pipelined plans (issue 31): what a forced pipeline plans, its stages, its JSON, and the bad inputs it refuses.

The runs on gloo ranks (training like one device) are in ``test_pipeline_run.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autopar
from autopar.capture import capture, split_microbatches
from autopar.models import config_dir, load_model
from autopar.planner import chain_layers, stage_of_nodes


def _gpt2(batch=8, layers=4):
    return load_model("gpt2-tiny", batch=batch, seq=16, overrides={"n_layer": layers})


def _plan(model, args, kwargs, mesh, **options):
    return autopar.plan(
        model, mesh, example_inputs=args, example_kwargs=kwargs, profile="cpu", compare_families=False, **options
    )


@pytest.fixture(scope="module")
def pp_plan():
    model, args, kwargs = _gpt2(layers=3)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "tp"))
    return model, args, kwargs, _plan(model, args, kwargs, mesh, pipeline="pp", microbatches=4, schedule="1f1b")


def test_a_forced_pipeline_splits_the_layers_and_replicates_along_its_axis(pp_plan):
    model, args, kwargs, plan = pp_plan
    pipe = plan.pipeline
    assert (pipe.axis, pipe.schedule, plan.microbatches, pipe.virtual) == ("pp", "1f1b", 4, 1)
    # three layers on two stages: every layer on one stage, in order
    bounds = [(s.first_layer, s.stop_layer) for s in pipe.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == 3 and bounds[0][1] == bounds[1][0] and 0 < bounds[0][1] < 3
    terms = plan.cost.terms
    assert plan.cost.total_s == pytest.approx(sum(terms.values()))
    assert pipe.bubble_fraction == pytest.approx(
        terms["pipeline bubble"] / (plan.cost.total_s - terms["optimizer step"])
    )
    assert pipe.bubble_fraction > 1 / 5  # at least the equal stages' (p - 1) / (m + p - 1): these are not equal
    # nothing runs along the pipeline axis: every value replicated there, no collective on it
    for node in plan.nodes.values():
        assert all(str(pl[0]) == "R" for pl in (*node.inputs, *node.outputs)), node
    assert all(c.axis != "pp" for c in plan.collectives)
    assert autopar.Plan.from_json(plan.to_json()).pipeline == pipe


def test_every_op_runs_on_one_stage_layers_where_the_split_puts_them(pp_plan):
    model, args, kwargs, plan = pp_plan
    (micro_args, micro_kwargs), *_ = split_microbatches(args, kwargs, plan.microbatches)
    graph = capture(model, micro_args, micro_kwargs)
    stage = stage_of_nodes(graph, plan.pipeline)
    ops = [n for n in graph.nodes if n.kind == "op"]
    assert set(stage) == {n.name for n in ops}
    layers = chain_layers(graph)
    assert [name for name, _ in layers] == [f"transformer.h.{i}" for i in range(3)]
    for k, (_, members) in enumerate(layers):
        assert {stage[graph.nodes[i].name] for i in members} == {0 if k < 2 else 1}
    by_module = {}
    for n in ops:
        by_module.setdefault(n.module, set()).add(stage[n.name])
    assert by_module["transformer.wte"] == {0} and by_module["lm_head"] == {1} and by_module["transformer.ln_f"] == {1}
    for n in ops:  # values flow forward through the stages only
        assert all(stage.get(graph.nodes[u].name, 0) <= stage[n.name] for u, _ in n.inputs)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).mean()


@pytest.mark.parametrize(
    "case,expected",
    [
        ("batch", r"the batch of 6 does not split into 4 equal micro-batches\. Fix: pass microbatches= a divisor"),
        ("stages", r"4 stages \(4 ranks x 1 per rank\) but GPT2LMHeadModel has 2 layers to split"),
        ("interleaved-stages", r"4 stages \(2 ranks x 2 per rank\).*Fix: .*schedule='1f1b'"),
        ("axis", r"pipeline='pp': Mesh\(dp=2, tp=2\) has no axis of that name \(axes: dp, tp\)"),
        ("axis-size", r"axis 'pp' of Mesh\(pp=1, tp=2\) has size 1, and a pipeline needs at least 2 stages"),
        ("no-layers", r"_MLP has no layers \(entries of an nn\.ModuleList.*not inside ops"),
        ("1f1b-m", r"schedule='1f1b' on 2 pipeline stages needs at least 2 micro-batches"),
        ("interleaved-m", r"microbatches=3 is not a multiple of 2"),
        ("schedule", r"schedule 'zb': expected one of \('gpipe', '1f1b', 'interleaved', 'auto'\)"),
        ("microbatches", r"microbatches 0: expected an int >= 1"),
        ("virtual-1f1b", r"virtual_stages 3: only the interleaved schedule runs several stages per rank.*Fix"),
        ("virtual-1", r"virtual_stages 1: expected an int >= 2"),
        ("virtual-stages", r"6 stages \(2 ranks x 3 per rank\) but GPT2LMHeadModel has 4 layers"),
    ],
)
def test_bad_pipelines_are_refused_with_the_fix(case, expected):
    model, args, kwargs = _gpt2(batch=6 if case == "batch" else 8, layers=2)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "tp"))
    options = {"pipeline": "pp", "microbatches": 4}
    if case == "stages":
        mesh = autopar.Mesh((4,), axis_names=("pp",))
    elif case == "interleaved-stages":
        options["schedule"] = "interleaved"
    elif case == "axis":
        mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    elif case == "axis-size":
        mesh = autopar.Mesh((1, 2), axis_names=("pp", "tp"))
    elif case == "no-layers":
        model, args, kwargs = _MLP(), (torch.randn(8, 8),), {}
    elif case in ("1f1b-m", "interleaved-m"):
        options.update(microbatches={"1f1b-m": 1, "interleaved-m": 3}[case])
        options["schedule"] = "1f1b" if case == "1f1b-m" else "interleaved"
        model, args, kwargs = _gpt2(batch=6 if case == "interleaved-m" else 8, layers=4)
    elif case == "schedule":
        options["schedule"] = "zb"
    elif case == "microbatches":
        options["microbatches"] = 0
    elif case.startswith("virtual"):
        options.update(schedule="1f1b" if case == "virtual-1f1b" else "interleaved")
        options["virtual_stages"] = 1 if case == "virtual-1" else 3
        model, args, kwargs = _gpt2(batch=8, layers=4)
    with pytest.raises(ValueError, match=expected):
        _plan(model, args, kwargs, mesh, **options)


def test_stage_prices_add_up_to_the_searched_plan_and_the_split_follows_them():
    """``planner.stage_prices``: every op's charge lands in one position of the chain (the layers' and the ends'
    times sum to the stage-mesh plan's ops), every weight in the stages reading it; and the split is chosen by
    those prices: a 50k-word head on the last stage leaves it one layer (an even split gives it two)."""
    from autopar.planner.pipeline_planning import stage_mesh
    from autopar.planner.stage_prices import chain_prices
    from costmodel import load_profile

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 4, "vocab_size": 50000})
    mesh = autopar.Mesh((2,), axis_names=("pp",))
    plan = _plan(model, args, kwargs, mesh, pipeline="pp", microbatches=4, schedule="1f1b")
    assert [(s.first_layer, s.stop_layer) for s in plan.pipeline.stages] == [(0, 3), (3, 4)]
    times = [s.time_s for s in plan.pipeline.stages]
    assert times[1] > 2 * times[0]  # the head outweighs three layers: the pace is the last stage's
    (micro_args, micro_kwargs), *_ = split_microbatches(args, kwargs, 4)
    micro = _plan(model, micro_args, micro_kwargs, stage_mesh(mesh, 0))
    graph = capture(model, micro_args, micro_kwargs)
    prices = chain_prices(graph, micro, chain_layers(graph), load_profile("cpu").intra_node)
    ops = [micro.node_costs[n.name] for n in graph.nodes if n.kind == "op"]
    parts = (prices.layers, prices.prelude, prices.postlude)
    charged = sum(sum(c.forward_s) + sum(c.backward_s) for c in parts)
    assert charged == pytest.approx(sum(c.ps for c in ops) / 1e12, rel=1e-9)
    assert sum(sum(c.act_bytes) for c in parts) == sum(c.nbytes for c in ops)
    weights = {n.name: micro.node_costs[n.name].nbytes for n in graph.nodes if n.kind == "param"}
    tied = weights[next(n.name for n in graph.nodes if n.kind == "param" and n.fqn == "transformer.wte.weight")]
    # the tied embedding is held by the first stage and the head's: counted on both ends
    assert sum(sum(c.state_bytes) for c in parts) == sum(weights.values()) + tied
    # fp32 AdamW on one device: a weight's gradient is a quarter of its state (weight, gradient, two moments)
    assert 4 * sum(prices.grad_bytes) == sum(sum(c.state_bytes) for c in parts)
    assert len(prices.cuts) == 3 and all(t > 0 for t in prices.cuts)


def test_autopar_plan_prints_the_stage_table_and_the_json_round_trips(capsys, tmp_path):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    argv = ["plan", "gpt2", "--mesh", "2x4", "--axis-names", "pp,tp", "--pipeline", "pp", "--no-compare", "-o"]
    assert main([*argv, str(out)]) == 0
    text = capsys.readouterr().out
    plan = autopar.Plan.from_json(out)
    pipe = plan.pipeline
    # schedule="auto" (the default): the search's pick among the three, priced on the same stage plan
    assert pipe.axis == "pp" and pipe.schedule in ("gpipe", "1f1b", "interleaved")
    count = len(pipe.stages)
    assert f"pipeline: {count} stages along axis 'pp' (2 ranks" in text and f"schedule {pipe.schedule}" in text
    rows = [line for line in text.splitlines() if "pp=0" in line or "pp=1" in line]
    assert len(rows) == count and "(before) transformer.h.0" in rows[0] and "11 (after)" in rows[-1]
    assert count == 2 * pipe.virtual  # interleaved: v stages per rank (the search's pick of 2, 4, ...)
    assert "bubble" in text and "stages" in text.split("step time")[1].splitlines()[0]
    # microbatches="auto": the candidates are the fewest of at least 2, 4 and 8 (p, 2p, 4p) whose micro-batch
    # still splits over the 4 other ranks: 8 rows -> 2 (4 rows each); 4 and 8 leave micro-batches of 2 and 1
    assert plan.microbatches == 2
    assert autopar.Plan.from_json(plan.to_json()).to_json() == plan.to_json()


def test_ranks_idle_in_the_bubble_lend_their_cores(tmp_path):
    """The cpu profile's 4 ranks share 2 cores (``cores_per_node``): a 4-stage pipeline, whose ranks are idle in
    its bubble, is priced faster under the core-share rule (the profile without its ``[core_lending]`` table) than
    on ranks with a device each (the profile without shared cores), by less than the most a lone rank gains (2 x).
    With the measured table a tiny model's actions (under a millisecond, where a lone rank measured 0.8 x) gain
    less than the rule says.  On 2 ranks, which do not outnumber the cores, nothing changes."""
    text = (config_dir() / "devices" / "cpu.toml").read_text()
    rule, own = tmp_path / "cpu-rule.toml", tmp_path / "cpu-own-devices.toml"
    rule.write_text(text[: text.index("[core_lending]")] + text[text.index("[peak_flops]") :])
    own.write_text(rule.read_text().replace("cores_per_node = 2", ""))
    model, args, kwargs = _gpt2(layers=4)
    steps = {}
    for profile in ("cpu", str(rule), str(own)):
        for ranks in (4, 2):
            mesh = autopar.Mesh((ranks,), axis_names=("pp",))
            plan = autopar.plan(
                model,
                mesh,
                example_inputs=args,
                example_kwargs=kwargs,
                profile=profile,
                compare_families=False,
                pipeline="pp",
                microbatches=4,
                schedule="1f1b",
            )
            steps[Path(profile).stem, ranks] = plan.cost.total_s
    assert steps["cpu-own-devices", 4] / 2 < steps["cpu-rule", 4] < steps["cpu-own-devices", 4]
    assert steps["cpu-rule", 4] < steps["cpu", 4]
    assert steps["cpu", 2] == pytest.approx(steps["cpu-own-devices", 2]) == pytest.approx(steps["cpu-rule", 2])


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])  # GPipe splits as 1F1B does
def test_stages_recompute_and_shard_their_state_to_fit_the_cap(schedule, virtual):
    """Where the fastest stage plan's split is over the cap, the stage search runs bounded (``stage_fitting``):
    the plan fits on every rank, recomputes layers, and is no faster than the free one; below what the least-memory
    stage plan needs there is no plan, and the error names that least."""
    model, args, kwargs = _gpt2(layers=2 * virtual)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    options = dict(pipeline="pp", microbatches=4, schedule=schedule)
    free = _plan(model, args, kwargs, mesh, **options)
    need = free.memory.per_device_bytes
    assert free.search.recompute_mode == "none"
    cap = int(need * 0.6)
    fits = _plan(model, args, kwargs, mesh, mem_cap=cap, **options)
    assert fits.memory.per_device_bytes <= cap
    assert max(s.memory_bytes for s in fits.pipeline.stages) <= cap
    assert fits.cost.total_s > free.cost.total_s
    assert sum(1 for n in fits.nodes.values() if n.recompute) > 0
    assert autopar.Plan.from_json(fits.to_json()).pipeline == fits.pipeline
    with pytest.raises(autopar.MemoryCapError, match="no pipelined plan fits") as refused:
        _plan(model, args, kwargs, mesh, mem_cap=need // 5, **options)
    least = refused.value.min_mem_bytes
    assert need // 5 < least < cap
    assert _plan(model, args, kwargs, mesh, mem_cap=least, **options).memory.per_device_bytes <= least


def test_stage_fitting_past_the_search_budget_keeps_the_fastest_split_that_fits(monkeypatch):
    """Past ``search_budget_s`` the stage fitting starts no bisection (``stage_fitting.fit_stages``): the plan still
    fits the cap, is marked ``budget_hit``, and is no faster than the plan the whole walk finds."""
    from autopar.planner import stage_fitting

    model, args, kwargs = _gpt2(layers=2)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    options = dict(pipeline="pp", microbatches=4, schedule="1f1b")
    cap = int(_plan(model, args, kwargs, mesh, **options).memory.per_device_bytes * 0.6)
    searched, real_under = [], stage_fitting.StageFit.under
    monkeypatch.setattr(
        stage_fitting.StageFit, "under", lambda self, bound: searched.append(bound) or real_under(self, bound)
    )
    whole = _plan(model, args, kwargs, mesh, mem_cap=cap, search_budget_s=None, **options)  # no budget, any load
    whole_bounds, searched[:] = list(searched), []
    late = _plan(model, args, kwargs, mesh, mem_cap=cap, search_budget_s=1e-6, **options)
    assert late.search.budget_hit and not whole.search.budget_hit
    assert max(s.memory_bytes for s in late.pipeline.stages) <= cap
    assert late.cost.total_s >= whole.cost.total_s
    assert 0 < len(searched) < len(whole_bounds)  # lowered to a split that fits, not bisected


def test_the_searches_of_one_stage_context_share_their_peak_checks(monkeypatch):
    """The free stage search and the weighted searches of its stage fitting meet the same plans again
    (``solving.CheckedPlans``): each (choice, recompute regions) is walked once, and the plan is the one each search
    checking its plans alone gives."""
    from autopar.planner import solving

    model, args, kwargs = _gpt2(layers=2)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    options = dict(pipeline="pp", microbatches=4, schedule="1f1b")
    cap = int(_plan(model, args, kwargs, mesh, **options).memory.per_device_bytes * 0.6)
    checks, walks = [], []
    real_check, real_walk = solving.CheckedPlans.breakdown, solving.breakdown
    monkeypatch.setattr(solving.CheckedPlans, "breakdown", lambda *a: checks.append(1) or real_check(*a))
    monkeypatch.setattr(solving, "breakdown", lambda *a: walks.append(1) or real_walk(*a))
    shared = _plan(model, args, kwargs, mesh, mem_cap=cap, **options)
    assert 0 < len(walks) < len(checks)
    monkeypatch.setattr(solving.CheckedPlans, "breakdown", lambda self, here, choice: real_walk(here, choice))
    alone = _plan(model, args, kwargs, mesh, mem_cap=cap, **options)
    assert (shared.cost, shared.memory, shared.pipeline, shared.nodes) == (
        alone.cost,
        alone.memory,
        alone.pipeline,
        alone.nodes,
    )


def test_weighted_tables_count_each_saved_byte_w_times_and_the_state_once():
    """The stage search's weighted memory row (``problem_tables.weighted``): an op's and an edge's bytes (what is
    saved for backward) ``w`` times, a parameter's state once; the evaluated memory of one choice is then
    ``state + w x activations``."""
    from autopar.planner import prepare
    from autopar.planner.problem_tables import weighted

    model, args, kwargs = _gpt2(layers=2)
    ctx = prepare(model, autopar.Mesh((2,)), example_inputs=args, example_kwargs=kwargs, profile="cpu")
    params = {n.index for n in ctx.graph.nodes if n.kind == "param"}
    tables = ctx.tables
    assert weighted(tables, 1, params) is tables
    three = weighted(tables, 3, params)
    assert weighted(tables, 3, params) is three  # built once
    choice = [0] * len(tables.names)
    state = sum(int(tables.node_mem[i][0]) for i in params)
    _, mem1 = tables.problem(None)[0].evaluate(choice)
    _, mem3 = three.problem(None)[0].evaluate(choice)
    assert mem1 > state and mem3 - state == 3 * (mem1 - state)


def test_the_weight_is_the_fullest_ranks_micro_batches_in_flight():
    from autopar.planner.stage_fitting import held_at_most

    assert held_at_most("gpipe", 4, 8) == 8  # every forward before any backward
    assert held_at_most("1f1b", 4, 8) == 4  # the first stage: p in flight
    assert held_at_most("interleaved", 2, 4) == 3  # Megatron's warmup + 1 = 5 stage-micro-batches over 2 stages
    assert held_at_most("interleaved", 2, 4, 3) == 3  # (2 - 1) 2 + 2 x 2 + 1 = 7 over 3 stages, rounded up


def test_interleaved_stages_per_rank_are_tried_as_the_layers_allow():
    from autopar.planner.pipeline_planning import fewest_virtual, virtual_choices

    assert virtual_choices("1f1b", "auto", 4, 32) == [1] and virtual_choices("1f1b", "auto", 4, 3) == []
    assert virtual_choices("interleaved", "auto", 4, 32) == [2, 4, 8]  # 4 x 8 = 32 stages of one layer
    assert virtual_choices("interleaved", "auto", 16, 126) == [2, 4]  # 16 x 8 = 128 > 126
    assert virtual_choices("interleaved", "auto", 4, 7) == []
    assert virtual_choices("interleaved", 3, 4, 12) == [3] and virtual_choices("interleaved", 3, 4, 11) == []
    assert (fewest_virtual("gpipe", 3), fewest_virtual("interleaved", "auto"), fewest_virtual("interleaved", 3)) == (
        1,
        2,
        3,
    )


def test_the_search_weighs_more_stages_per_rank():
    """``virtual_stages="auto"``: interleaved pipelines are priced with 2 and 4 stages per rank on 8 layers over 2
    ranks, and the plan keeps the faster.  On an H100 profile, where a GPT-2-sized stage computes far longer than a
    send takes, 4 per rank has the smaller bubble and wins; on the CPU profile (gloo's millisecond sends against a
    tiny model's stages) 2 does.  Forcing ``v`` gives ``2 v`` stages."""
    model, args, kwargs = load_model("gpt2", batch=8, seq=1024, overrides={"n_layer": 8})
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    options = dict(pipeline="pp", microbatches=4, schedule="interleaved", profile="h100", dtype="bf16")
    plans = {
        v: autopar.plan(
            model, mesh, example_inputs=args, example_kwargs=kwargs, compare_families=False, virtual_stages=v, **options
        )
        for v in ("auto", 2, 4)
    }
    two, four = plans[2].pipeline, plans[4].pipeline
    assert (len(two.stages), two.virtual, len(four.stages), four.virtual) == (4, 2, 8, 4)
    assert four.bubble_fraction < two.bubble_fraction and plans[4].cost.total_s < plans[2].cost.total_s
    assert plans["auto"].pipeline == four and plans["auto"].cost.total_s == plans[4].cost.total_s
    assert autopar.Plan.from_json(plans[4].to_json()).pipeline == four
    tiny, targs, tkwargs = _gpt2(batch=8, layers=8)
    on_cpu = dict(pipeline="pp", microbatches=4, schedule="interleaved")
    small = {v: _plan(tiny, targs, tkwargs, mesh, virtual_stages=v, **on_cpu) for v in (2, 4)}
    cheaper = min(small, key=lambda v: small[v].cost.total_s)
    assert _plan(tiny, targs, tkwargs, mesh, **on_cpu).pipeline.virtual == cheaper == 2


def _toy_walk(fits, beaten_above=None, loses=None):
    """``fit_stages`` on a toy stage search (``stage_fitting``): the plan under a bound ``C`` uses all of it and
    takes ``1e6 / C`` s (its objective, exact); its split fits where ``fits(C)``; searches whose plan is slower than
    ``beaten_above`` raise ``BeatenError`` instead; ``loses``: ``fit_stages``'.  The plan (or the error) and the
    bounds searched."""
    from types import SimpleNamespace

    from autopar.planner.errors import MemoryCapError
    from autopar.planner.stage_fitting import StageFit, fit_stages
    from autopar.search import BeatenError

    def plan_under(bound):
        memory = SimpleNamespace(params_bytes=0, grads_bytes=0, optimizer_bytes=0, activations_bytes=bound)
        search = SimpleNamespace(objective_ps=1e6 / bound, optimal=True, least_objective_ps=1e6 / bound)
        return SimpleNamespace(memory=memory, cost=SimpleNamespace(total_s=1e6 / bound), search=search)

    searched = []

    def search(bound):
        searched.append(bound)
        if beaten_above is not None and 1e6 / bound > beaten_above:
            raise BeatenError(1e6 / bound, beaten_above)
        return plan_under(bound)

    def price(plan):
        bound = plan.memory.activations_bytes
        if not fits(bound):
            raise MemoryCapError("the split is over the cap", bound * 3 // 2)
        return plan

    try:
        return fit_stages(StageFit(search, plan_under(5000), 1), price, 1000, loses), searched
    except (BeatenError, MemoryCapError) as e:
        return e, searched


def test_a_losing_run_walks_no_bound_whose_plans_all_lose():
    """``fit_stages``' ``loses`` (``stage_fitting``, Losing runs): a bound is not searched, and the bisection stops,
    once the objective the searches above it proved makes every plan under it lose; the plan is the one the
    whole walk finds where that one wins, and every bound skipped is one whose plan loses."""
    from autopar.planner.stage_fitting import StageFit
    from autopar.search import BeatenError

    def under_the_cap(bound):
        return bound * 3 // 2 <= 1000

    whole, whole_searched = _toy_walk(under_the_cap)  # the free plan at 5000 misses; 666 fits; bisected in vain
    assert whole_searched == [StageFit.snapped(b) for b in (666, 2833, 1749, 1207, 936)]  # searched on the grid
    kept, kept_searched = _toy_walk(under_the_cap, loses=lambda x: x > whole.cost.total_s * 1.01)
    assert kept.cost.total_s == whole.cost.total_s and kept_searched == whole_searched
    fastest = 300.0  # faster than every plan the bisection meets: it stops once the failing end's plan loses
    lost, searched = _toy_walk(under_the_cap, loses=lambda x: x > fastest)
    assert lost.cost.total_s == whole.cost.total_s and searched == whole_searched[:2]
    assert all(1e6 / bound > fastest for bound in whole_searched if bound not in searched)
    nothing, none_searched = _toy_walk(under_the_cap, loses=lambda x: x > 150.0)  # the free plan's 200 s loses
    assert isinstance(nothing, BeatenError) and nothing.lower_bound_ps == 200.0 and none_searched == []


def test_a_bounded_stage_fitting_keeps_every_plan_that_beats_the_fastest():
    """Weighted searches bounded by the fastest candidate (``stage_fitting``, Bounded): where the walk's plan is
    faster than that candidate the bounded walk finds the same plan; where it is slower the walk raises
    ``BeatenError`` with a bound above the fastest, and searches no bound below the first proven one; a bound proven
    beaten is taken as fitting, so the bisection above it still finds a faster plan that fits there."""
    from autopar.planner.stage_fitting import StageFit
    from autopar.search import BeatenError

    def under_the_cap(bound):  # the fullest rank holds 1.5 times the weighted bytes
        return bound * 3 // 2 <= 1000

    whole, whole_searched = _toy_walk(under_the_cap)
    assert whole.cost.total_s == pytest.approx(1e6 / 666)  # lowered to 5000 x 1000 / 7500, then bisected in vain
    kept, _ = _toy_walk(under_the_cap, beaten_above=whole.cost.total_s * 1.01)
    assert kept.cost.total_s == whole.cost.total_s
    lost, searched = _toy_walk(under_the_cap, beaten_above=whole.cost.total_s * 0.99)
    assert isinstance(lost, BeatenError) and lost.lower_bound_ps > whole.cost.total_s * 0.99
    assert min(searched) == 666 and len(searched) == len(whole_searched)

    def also_in_a_band(bound):  # a second band that fits (the ends of a split can): met by the bisection
        return under_the_cap(bound) or 1700 <= bound <= 1800

    band, _ = _toy_walk(also_in_a_band)
    beaten_band, _ = _toy_walk(also_in_a_band, beaten_above=1e6 / 1000)  # the lowered bound's plan is proven slower
    assert band.cost.total_s == beaten_band.cost.total_s == pytest.approx(1e6 / StageFit.snapped(1749))


def test_walks_of_one_weight_asking_bounds_a_hair_apart_share_their_searches():
    """Bounds on a grid (``stage_fitting``): two runs of one weight whose splits need a hair more or less than each
    other ask bounds a hair apart; searched rounded up to ``BOUND_BITS`` significant bits, the second walk makes no
    search of its own and finds the first's plan, whose split fits the cap for each; every bound searched is at
    least the bound asked and at most ``2^-8`` above it."""
    from types import SimpleNamespace

    from autopar.planner.errors import MemoryCapError
    from autopar.planner.stage_fitting import StageFit, fit_stages

    def plan_under(bound):  # uses all of its bound, takes 1e9 / bound s
        memory = SimpleNamespace(params_bytes=0, grads_bytes=0, optimizer_bytes=0, activations_bytes=bound)
        search = SimpleNamespace(objective_ps=1e9 / bound, optimal=True, least_objective_ps=1e9 / bound)
        return SimpleNamespace(memory=memory, cost=SimpleNamespace(total_s=1e9 / bound), search=search)

    searched, asked = [], []
    fit = StageFit(lambda bound: searched.append(bound) or plan_under(bound), plan_under(5_000_000), 1)
    real_snapped = fit.snapped
    fit.snapped = lambda bound: asked.append(bound) or real_snapped(bound)

    def split_needing(share):  # the fullest rank: ``share`` times the weighted bytes, and the ends
        def price(plan):
            need = int(plan.memory.activations_bytes * share) + 200_000
            if need > 1_000_000:
                raise MemoryCapError("the split is over the cap", need)
            return plan

        return price

    first = fit_stages(fit, split_needing(3.0), 1_000_000)
    alone = list(searched)
    second = fit_stages(fit, split_needing(3.0003), 1_000_000)
    assert searched == alone and len(alone) >= 3  # the second walk searched nothing of its own
    assert first.cost.total_s == second.cost.total_s
    assert first.memory.activations_bytes * 3.0003 + 200_000 <= 1_000_000  # its split fits the cap for both
    assert all(b <= StageFit.snapped(b) <= b * (1 + 2**-8) for b in asked)


def test_the_stage_fittings_searches_keep_their_probes(monkeypatch):
    """The weighted searches of the stage fitting keep their peak loops' probes (``SearchRun.refine`` False;
    ``stage_fitting``, Probes): none is searched again at ``PLAN_GAP`` where refining each would (here: ``PLAN_GAP``
    0, so every inexact probe would be), and the plan fits the cap within the walk's tolerance of the one whose walk
    refines every search."""
    from autopar.planner import pipeline_choice, solving

    monkeypatch.setattr(solving, "PLAN_GAP", 0.0)
    refined, real_refine = [], solving.PeakLoop.refine
    monkeypatch.setattr(
        solving.PeakLoop,
        "refine",
        lambda self, probe: refined.append(self.space.base.activation_weight) or real_refine(self, probe),
    )
    model, args, kwargs = _gpt2(layers=4)
    mesh = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
    options = dict(pipeline="pp", microbatches=4, schedule="gpipe", search_budget_s=None)
    cap = int(_plan(model, args, kwargs, mesh, **options).memory.per_device_bytes * 0.5)
    probes = _plan(model, args, kwargs, mesh, mem_cap=cap, **options)
    assert not [w for w in refined if w > 1] and max(s.memory_bytes for s in probes.pipeline.stages) <= cap
    real_search = pipeline_choice.PipelineChoice._search

    def refining(self, ctx, mem_cap=None, above=None, checked=None, refine=True):
        return real_search(self, ctx, mem_cap, above, checked, True)

    monkeypatch.setattr(pipeline_choice.PipelineChoice, "_search", refining)
    whole = _plan(model, args, kwargs, mesh, mem_cap=cap, **options)
    assert [w for w in refined if w > 1]  # the walk's searches, refined
    assert probes.cost.total_s == pytest.approx(whole.cost.total_s, rel=2.0**-8)
