"""``pipeline="auto"``, ``schedule="auto"``, ``microbatches="auto"``: the planner's choice among micro-batched plans
(``autopar.planner.pipeline_choice``), checked against the forced plans it chooses from."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

import autopar
from autopar.models import load_model
from autopar.planner import MemoryCapError

H100 = pathlib.Path(__file__).resolve().parent.parent / "configs" / "devices" / "h100.toml"


def _plan(model, args, kwargs, mesh, **options):
    options = {"profile": "cpu", "compare_families": False, **options}
    return autopar.plan(model, mesh, example_inputs=args, example_kwargs=kwargs, **options)


def test_auto_is_the_fastest_of_the_forced_candidates():
    """Every (axis, micro-batches, schedule) ``auto`` prices is a plan a forced call makes; ``auto`` returns the
    fastest of them and of the plan without a pipeline.  A candidate it skips, listed as at least a bound, is
    slower than the chosen plan, and its forced plan is at least that bound (``step_at_least``; the plan without a
    pipeline: its search stopped by a bound)."""
    from autopar.planner.plan_table import describe_candidate

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 4})
    mesh = autopar.Mesh((2,), axis_names=("a",))
    chosen = _plan(model, args, kwargs, mesh, pipeline="auto")
    plain = _plan(model, args, kwargs, mesh)
    steps = {describe_candidate(plain): plain.cost.total_s}
    for axis in ("a",):
        for m in (2, 4, 8):  # microbatch_choices: the fewest of at least p, 2p and 4p
            for schedule in ("1f1b", "gpipe", "interleaved"):
                forced = _plan(model, args, kwargs, mesh, pipeline=axis, microbatches=m, schedule=schedule)
                steps[describe_candidate(forced)] = forced.cost.total_s
    assert chosen.timings["candidates"] == len(steps)
    assert chosen.cost.total_s == pytest.approx(min(steps.values()), rel=1e-12)
    assert steps[describe_candidate(chosen)] == pytest.approx(chosen.cost.total_s, rel=1e-12)
    # every candidate, fastest first, in the plan (not in its JSON) and in --explain
    from autopar.planner.explain import render_explanation

    priced = [c.step_s if c.step_s is not None else c.at_least_s for c in chosen.candidates]
    assert len(priced) == len(steps) and priced == sorted(priced) and priced[0] == chosen.cost.total_s
    assert {c.what for c in chosen.candidates} == set(steps)
    for c in chosen.candidates:  # not searched to its plan: its bound holds and loses
        if c.at_least_s is not None:
            assert c.step_s is None and chosen.cost.total_s < c.at_least_s <= steps[c.what] * (1 + 1e-12)
    text = render_explanation(chosen)
    assert "candidates priced (pipeline='auto')" in text and "a pipeline along 'a', interleaved" in text
    assert "candidates" not in chosen.to_json()


def test_a_pipelines_bound_holds_for_every_stage_plan(monkeypatch):
    """``step_at_least``: every pipeline run takes at least its bound, computed from its free stage search's objective
    ``X*``, on ranks that lend their cores (``s``: the cpu profile's largest lending figure; a simulated schedule)
    and on a GPU profile where nothing is lent (``s`` = 1; GPipe and 1F1B priced by the flow shop's formula),
    under no cap and under one the stage plans are walked down to (``stage_fitting``).  Checked on the forced
    plans, whose free stage plan the bound is computed from (a forced axis is never skipped by it).  With more
    than one stage the bound of GPipe and 1F1B is above the busiest rank's share of the work, ``m X* / (p s)``
    (the bubble: the flow shop's ``(m + p - 1) / m`` of it, less what the parameters' charges may take)."""
    import autopar.planner.pipeline_choice as choice
    from autopar.planner.pipeline_planning import max_lending
    from autopar.planner.problem_tables import PS_PER_S
    from costmodel import load_profile

    seen = []
    real = choice.step_at_least

    def recorded(free, ctx, mesh, p, run, charges):
        bound = real(free, ctx, mesh, p, run, charges)
        share = run.m * free.search.objective_ps / PS_PER_S / (p * max_lending(ctx.coster.settings.profile, mesh))
        seen.append((bound, share))
        return bound

    monkeypatch.setattr(choice, "step_at_least", recorded)
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 8})
    mesh = autopar.Mesh((4,), axis_names=("pp",))
    cpu = load_profile("cpu")
    assert max_lending(cpu, mesh) == max(2.0, *(s for row in cpu.core_lending.speed for s in row))
    assert max_lending(load_profile("h100"), autopar.Mesh((8,))) == 1.0
    for profile in ("cpu", "h100"):
        free = _plan(model, args, kwargs, mesh, profile=profile, pipeline="pp", microbatches=4, schedule="1f1b")
        for m, schedule in ((4, "1f1b"), (8, "gpipe"), (4, "interleaved")):
            for cap in (None, int(free.memory.per_device_bytes * 0.9)):
                plan = _plan(
                    model,
                    args,
                    kwargs,
                    mesh,
                    profile=profile,
                    pipeline="pp",
                    microbatches=m,
                    schedule=schedule,
                    mem_cap=cap,
                )
                (bound, share), *_ = seen
                assert 0 < bound <= plan.cost.total_s
                if schedule != "interleaved":
                    assert bound > share * 1.05, (profile, schedule, bound, share)
                seen.clear()


def test_gpipe_is_not_priced_where_the_flow_shop_prices_1f1b_alike():
    """``pipeline_planning.dominated_runs``: on devices of their own (h100) GPipe and 1F1B of the same stage plan
    are priced by one formula and 1F1B holds fewer micro-batches, so ``schedule="auto"`` does not price GPipe where
    it prices 1F1B, and lists it with why; forced, each GPipe run is no faster than 1F1B's, under no cap and under
    one the stage plans are walked down to.  Where ranks share cores (cpu) the schedules are simulated and both
    priced."""
    from autopar.planner.explain import render_explanation
    from autopar.planner.pipeline_choice import DOMINATED_BY_1F1B
    from autopar.planner.plan_table import describe_schedule

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 4})
    mesh = autopar.Mesh((2,), axis_names=("pp",))
    auto = _plan(model, args, kwargs, mesh, profile="h100", pipeline="pp")
    noted = {c.what for c in auto.candidates if c.note == DOMINATED_BY_1F1B}
    counts = (2, 4, 8)  # microbatch_choices: the fewest of at least p, 2p and 4p
    assert noted == {f"a pipeline along 'pp', {describe_schedule('gpipe', m, 1)}" for m in counts}
    assert DOMINATED_BY_1F1B in render_explanation(auto)
    free = _plan(model, args, kwargs, mesh, profile="h100", pipeline="pp", microbatches=8, schedule="gpipe")
    for cap in (None, int(free.memory.per_device_bytes * 0.8)):
        for m in counts:
            forced = {
                schedule: _plan(
                    model,
                    args,
                    kwargs,
                    mesh,
                    profile="h100",
                    pipeline="pp",
                    microbatches=m,
                    schedule=schedule,
                    mem_cap=cap,
                )
                for schedule in ("1f1b", "gpipe")
            }
            assert forced["1f1b"].cost.total_s <= forced["gpipe"].cost.total_s * (1 + 1e-12), (cap, m)
    cpu = _plan(model, args, kwargs, mesh, profile="cpu", pipeline="pp")
    assert not any(c.note for c in cpu.candidates)
    assert any("gpipe" in c.what and (c.step_s or c.at_least_s) for c in cpu.candidates)


def test_auto_tries_no_pipeline_for_a_model_without_a_loss_or_with_hints():
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 4})
    mesh = autopar.Mesh((2,), axis_names=("a",))
    no_loss = _plan(model, args, {}, mesh, pipeline="auto")  # no labels: a pipeline has nothing to train through
    assert no_loss.pipeline is None and no_loss.timings["candidates"] == 1
    hinted = _plan(model, args, kwargs, mesh, pipeline="auto", hints={"*.mlp.c_fc.weight": ["R"]})
    assert hinted.pipeline is None and hinted.timings["candidates"] == 1


def test_auto_skips_an_axis_the_batch_is_too_small_to_pipeline():
    """A batch of 2 cannot feed 4 stages (every schedule needs at least 4 micro-batches): ``auto`` pipelines along
    the axis of 2 only, where forcing the axis of 4 is an error that says so."""
    model, args, kwargs = load_model("gpt2-tiny", batch=2, seq=16, overrides={"n_layer": 4})
    mesh = autopar.Mesh((4, 2), axis_names=("a", "b"))
    chosen = _plan(model, args, kwargs, mesh, pipeline="auto")
    assert all("along 'a'" not in c.what for c in chosen.candidates)
    assert any("along 'b'" in c.what for c in chosen.candidates)
    with pytest.raises(ValueError, match="a batch of 2 does not split into micro-batches a 4-stage"):
        _plan(model, args, kwargs, mesh, pipeline="a")


def test_microbatches_auto_accumulates_only_when_the_whole_batch_does_not_fit():
    model, args, kwargs = load_model("gpt2-tiny", batch=16, seq=64)
    mesh = autopar.Mesh((2,), axis_names=("dp",))
    whole = _plan(model, args, kwargs, mesh, pipeline="auto", recompute="none")
    assert whole.microbatches == 1
    one = whole.memory.per_device_bytes
    # a cap under the whole batch's peak but over a quarter of its activations: accumulated micro-batches fit
    cap = whole.memory.params_bytes + whole.memory.grads_bytes + whole.memory.optimizer_bytes
    cap += (one - cap) // 2
    with pytest.raises(MemoryCapError):
        _plan(model, args, kwargs, mesh, mem_cap=cap, recompute="none")
    fits = _plan(model, args, kwargs, mesh, mem_cap=cap, recompute="none", pipeline="auto", family="data parallel")
    assert fits.pipeline is None and fits.microbatches > 1 and fits.memory.per_device_bytes <= cap


def _gpt_shaped(layers: int, batch: int):
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=4096, n_head=32, vocab_size=50257, n_positions=2048, use_cache=False
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(batch, 2048, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def _slow_fabric(tmp_path, slower: float) -> str:
    """The h100 profile with its inter-node link ``slower`` times under NVLink's 450 GB/s."""
    head, inter = H100.read_text().split("[inter_node]")
    inter = "\n".join(
        f"bandwidth_bytes_per_s = {450e9 / slower:.6g}" if line.startswith("bandwidth_bytes_per_s") else line
        for line in inter.splitlines()
    )
    path = tmp_path / f"h100-x{slower:g}.toml"
    path.write_text(head.replace('name = "h100"', f'name = "h100-x{slower:g}"') + "[inter_node]" + inter)
    return str(path)


def test_a_slow_fabric_pipelines_over_the_nodes_and_a_fast_node_does_not(tmp_path):
    """A 32-layer GPT-shaped model (width 4096, bf16, batch 16 x 2048) on 4 nodes x 8 GPUs whose inter-node link is
    20 x slower than NVLink: the data-parallel gradient sync over the nodes (0.11 s, each GPU's NIC carrying an
    eighth) outruns backward, so the search pipelines over the node axis (one activation per boundary crosses
    the slow link) and shards inside the node; GPT-2 small on one node does not pipeline.  At batch 32 and up
    backward hides that sync and no pipeline is right (``scripts/bench_pipeline_choice.py`` prints the grid of
    batches and fabrics)."""
    model, args, kwargs = _gpt_shaped(32, batch=16)
    mesh = autopar.Mesh((4, 8), axis_names=("node", "gpu"))
    common = {"dtype": "bf16", "mem_cap": "80GiB", "pipeline": "auto"}
    slow = _plan(model, args, kwargs, mesh, profile=_slow_fabric(tmp_path, 20), **common)
    assert slow.pipeline is not None and slow.pipeline.axis == "node", slow
    assert all(c.axis == "gpu" for c in slow.collectives)  # every collective inside the node
    flat = next(c for c in slow.candidates if c.what == "no pipeline")  # priced, or bounded, and slower
    assert (flat.step_s if flat.step_s is not None else flat.at_least_s) > slow.cost.total_s
    small, sargs, skwargs = load_model("gpt2", batch=32, seq=1024)
    node = _plan(small, sargs, skwargs, autopar.Mesh((8,), axis_names=("dp",)), profile="h100", **common)
    assert node.pipeline is None and node.family.startswith("data parallel"), node


@pytest.mark.parametrize("capped", [False, True], ids=["no cap", "a binding cap"])
def test_a_search_bounded_by_a_faster_plan_stops_at_a_true_bound(capped):
    """``search_context(..., above=)`` (``SearchRun.above``: how ``pipeline="auto"`` bounds the plan without a
    pipeline by the fastest pipeline): bounded below the plan's objective, the search stops with a bound between
    the two (``BeatenError``); bounded at or above it, it returns the same plan."""
    from autopar.planner import PlanOptions
    from autopar.planner.context_search import search_context
    from autopar.search import BeatenError

    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=32, overrides={"n_layer": 4})
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    ctx = autopar.prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile="cpu")
    free = search_context(ctx, compare_families=False)
    options = PlanOptions(mem_cap=int(free.memory.per_device_bytes * 0.8)) if capped else None
    plan = search_context(ctx, options, compare_families=False) if capped else free
    objective = plan.search.objective_ps
    assert not capped or objective > free.search.objective_ps  # the cap binds: its plan is slower
    assert plan.cost.total_s * 1e12 >= objective * (1 - 1e-12)  # the objective bounds the step (pipeline_choice)
    for above in (free.search.objective_ps // 2, (free.search.objective_ps + objective) // 2):
        if above >= objective:
            continue
        try:
            bounded = search_context(ctx, options, compare_families=False, above=above)
        except BeatenError as e:
            assert above < e.lower_bound_ps <= objective
        else:  # no bound proved it slower: searched to the same plan
            assert bounded.search.objective_ps == objective and above < objective
    with pytest.raises(BeatenError):  # below even the plan without a cap: the first bound stops it
        search_context(ctx, options, compare_families=False, above=free.search.objective_ps // 2)
    again = search_context(ctx, options, compare_families=False, above=objective)
    assert again.search.objective_ps == objective and again.cost.total_s == plan.cost.total_s
    # listed so in --explain, beside the candidate that bounded it
    from dataclasses import replace

    from autopar.planner.explain import render_explanation
    from autopar.planner.plan_parts import Candidate

    bounded = Candidate("no pipeline", None, None, at_least_s=plan.cost.total_s * 1.5)
    chosen = Candidate("a pipeline along 'dp', 1f1b, 2 micro-batches", plan.cost.total_s, 1 << 30)
    text = render_explanation(replace(plan, candidates=(chosen, bounded)))
    assert ">= 1.50x (bound)" in text and "chosen" in text


def test_a_free_stage_search_stops_once_every_run_of_its_count_is_beaten(monkeypatch):
    """``objective_beaten_above``: the least stage objective at which every run's bound passes the fastest step
    (one below it, some run's bound does not), given to the free stage search; where the search proves its optimum
    above it, the count's runs are listed at least their bound from the proof, each above the fastest and at most
    its forced plan's step; and the choice is the one made without the stop."""
    import re

    import autopar.planner.pipeline_choice as choice
    from autopar.planner.pipeline_planning import step_at_least_of

    calls, stopped = [], set()
    real_above, real_free = choice.objective_beaten_above, choice.PipelineChoice._free_search

    def above(ctx, mesh, p, runs, charges, fastest_s):
        x = real_above(ctx, mesh, p, runs, charges, fastest_s)
        calls.append(
            [
                (
                    fastest_s,
                    step_at_least_of(x, ctx, mesh, p, r, charges),
                    step_at_least_of(x + 1, ctx, mesh, p, r, charges),
                )
                for r in runs
            ]
        )
        return x

    def free(self, ctx, p, runs, charges, forced, *shared):
        got = real_free(self, ctx, p, runs, charges, forced, *shared)
        if got[0] is None:
            stopped.add(ctx.coster.settings.microbatches)
        return got

    monkeypatch.setattr(choice, "objective_beaten_above", above)
    monkeypatch.setattr(choice.PipelineChoice, "_free_search", free)
    model, args, kwargs = load_model("gpt2-tiny", batch=16, seq=16, overrides={"n_layer": 8})
    mesh = autopar.Mesh((4,), axis_names=("pp",))
    chosen = _plan(model, args, kwargs, mesh, pipeline="auto", profile="h100")  # its small micro-batches lose
    assert calls and stopped  # the stop ran, and proved some count's runs slower
    for runs in calls:
        assert all(after > fastest for fastest, _, after in runs) and any(at <= fastest for fastest, at, _ in runs)
    form = re.compile(r"along 'pp', (\w+)(?: \((\d+) stages per rank\))?, (\d+) micro-batches")
    checked = 0
    for c in chosen.candidates:
        run = form.search(c.what)
        if c.at_least_s is None or run is None or int(run[3]) not in stopped:
            continue
        schedule, v, m = run[1], int(run[2] or 1), int(run[3])
        virtual = {"virtual_stages": v} if schedule == "interleaved" else {}
        forced = _plan(
            model, args, kwargs, mesh, pipeline="pp", microbatches=m, schedule=schedule, profile="h100", **virtual
        )
        assert chosen.cost.total_s < c.at_least_s <= forced.cost.total_s * (1 + 1e-12), c.what
        checked += 1
    assert checked
    monkeypatch.setattr(choice, "objective_beaten_above", lambda *_: None)  # no stop: the same choice
    unstopped = _plan(model, args, kwargs, mesh, pipeline="auto", profile="h100")
    assert (unstopped.cost.total_s, unstopped.pipeline) == (chosen.cost.total_s, chosen.pipeline)


def test_micro_batches_captured_statically_plan_as_those_specialized_from_the_symbolic_capture(monkeypatch):
    """A large graph's micro-batch sizes are captured statically, a small one's specialized from one symbolic capture
    (``SYMBOLIC_CAPTURE_NODES``): the two give the same plan."""
    import autopar.planner.pipeline_choice as choice

    templates = []
    real = choice.capture_template
    monkeypatch.setattr(choice, "capture_template", lambda *a: templates.append(1) or real(*a))
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=16, overrides={"n_layer": 4})
    mesh = autopar.Mesh((2,), axis_names=("pp",))
    symbolic = _plan(model, args, kwargs, mesh, pipeline="auto")
    assert templates == [1]
    monkeypatch.setattr(choice, "SYMBOLIC_CAPTURE_NODES", 0)  # every graph counts as large
    static = _plan(model, args, kwargs, mesh, pipeline="auto")
    assert templates == [1]  # no second symbolic capture
    assert len(symbolic.candidates) > 1  # micro-batched candidates were priced on the captures compared
    assert (static.cost, static.pipeline, static.nodes, static.candidates) == (
        symbolic.cost,
        symbolic.pipeline,
        symbolic.nodes,
        symbolic.candidates,
    )
