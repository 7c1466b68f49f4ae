"""The plan's typed parts and their versioned JSON (``planner.plan_parts``, ``planner.schema``).

Every field of every part survives ``to_json`` / ``from_json`` with its type (placements as
``Placement`` values, tuples as tuples), and plans written by the previous version still read:
``tests/data/plan_v1_*.json`` were written by autopar at commit 1219cd6 (schema version 1) for the
calls in ``V1_CALLS`` and read here against what this version plans for the same calls; written again in version
1's form (memory parts by their old names, no field version 1 lacks) where planning changed: version 1 has no
``flat_grad_axes``, so a plan reducing a gradient over flattened axes reads with its collectives but not the set.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

import autopar
from autopar.models import load_model
from autopar.placement import Placement, Replicate, Shard, parse_placements
from autopar.planner import (
    Collective,
    FallbackOp,
    FamilyAlternative,
    InputPlacement,
    NodePlacement,
    OpHints,
    ParamPlacement,
    PipelinePlan,
    Plan,
    PlanCost,
    PlanHints,
    PlanMemory,
    PlanSettings,
    RecomputeLayers,
    RecomputeTrial,
    SearchStats,
    StagePart,
)

DATA = Path(__file__).parent / "data"
PARTS = (
    Collective,
    PipelinePlan,
    StagePart,
    FallbackOp,
    FamilyAlternative,
    InputPlacement,
    NodePlacement,
    OpHints,
    ParamPlacement,
    PlanCost,
    PlanHints,
    PlanMemory,
    PlanSettings,
    RecomputeLayers,
    RecomputeTrial,
    SearchStats,
)
#: The plan calls the version-1 files were written for (gpt2-tiny, batch 4, seq 32).
V1_CALLS = {
    "plan_v1_gpt2_tiny.json": {"mesh": (4,)},
    "plan_v1_gpt2_tiny_hinted_recompute.json": {
        "mesh": (2, 2),
        "recompute": "full",
        "hints": {"*.mlp.c_fc.weight": ["R", "S(1)"]},
        "mem_cap": "1GiB",
    },
}


def _plan_for(call: dict) -> Plan:
    model, args, kwargs = load_model("gpt2-tiny", batch=4, seq=32)
    options = {k: v for k, v in call.items() if k != "mesh"}
    return autopar.plan(model, autopar.Mesh(call["mesh"]), example_inputs=args, example_kwargs=kwargs, **options)


@pytest.fixture(scope="module")
def hinted_plan() -> Plan:
    return _plan_for(V1_CALLS["plan_v1_gpt2_tiny_hinted_recompute.json"])


def _with_every_field_set(plan: Plan) -> Plan:
    """``plan`` with a value other than the default in every field a planned gpt2-tiny leaves at it (what an
    approximate or budget-bound search, a fallback op, a buffer, a kernel, op hints, a tied parameter's
    partial gradient and a gradient reduction hidden behind backward would write: gpt2-tiny's gradients fill one
    bucket, reduced after backward)."""
    mesh_axes = len(plan.mesh.shape)
    name, node = next(iter(plan.nodes.items()))
    odd_node = dataclasses.replace(node, kernels=("matmul_tp",) * mesh_axes, fallback=True)
    odd_collective = dataclasses.replace(plan.collectives[0], output=True, recompute=True, hidden_s=1e-6)
    trials = (
        RecomputeTrial("none", False, min_per_device_bytes=123),
        RecomputeTrial("full", True, total_s=1.5e-3, per_device_bytes=456),
        RecomputeTrial("selective", None, at_least_s=2e-3),
        RecomputeTrial("per layer", None, skipped="search budget"),
    )
    search = dataclasses.replace(
        plan.search,
        approximate=True,
        why="too wide",
        lower_bound_ps=plan.search.objective_ps - 1000,
        gap=1000 / plan.search.objective_ps,
        peak_searches=3,
        peak_lower_ps=plan.search.objective_ps - 10,
        budget_hit=True,
        budget_s=0.5,
        kept_family_plan=True,
        recompute_mode="per layer",
        recompute_layers=RecomputeLayers(none=1, selective=1, full=2),
        recompute_rest=("before.0",),
        recompute_modes=trials,
    )
    alternatives = plan.alternatives + (
        FamilyAlternative.no_plan("data parallel", min_per_device_bytes=789, proven=False),
        FamilyAlternative.no_plan("tensor parallel", why="no axis can split it"),
    )
    shard = (Shard(0, blocks=3),) + (Replicate(),) * (mesh_axes - 1)
    hints = PlanHints(
        params=dict(plan.hints.params),
        inputs={"input_ids": shard},
        ops={name: OpHints(inputs={1: shard}, outputs={0: shard})},
        replicate=("transformer.h.0",),
        recompute=("transformer.h.1?",),
    )
    buffer = InputPlacement(shard, (4, 32), kind="buffer")
    params = dict(plan.params)
    first = next(iter(params))
    params[first] = dataclasses.replace(params[first], partial_grad_axes=(plan.mesh.axis_names[0],))
    return dataclasses.replace(
        plan,
        params=params,
        settings=dataclasses.replace(plan.settings, solver="ilp", devices_per_node=2),
        inputs=dict(plan.inputs, bias=buffer),
        nodes=dict(plan.nodes, **{name: odd_node}),
        collectives=plan.collectives + (odd_collective,),
        fallback_ops=(FallbackOp(name, node.op, node.module),),
        alternatives=alternatives,
        search=search,
        hints=hints,
        pipeline=PipelinePlan("axis0", "interleaved", (StagePart(0, 1, "transformer.h.0", 1e-3, 100),), 2, 0.25),
        microbatches=4,
    )


def _parts_in(value, seen: dict[type, list]) -> None:
    """Every part value inside ``value``, by class."""
    if type(value) in PARTS:
        seen.setdefault(type(value), []).append(value)
        for f in dataclasses.fields(value):
            _parts_in(getattr(value, f.name), seen)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _parts_in(v, seen)
    elif isinstance(value, dict):
        for v in value.values():
            _parts_in(v, seen)


def _unset_fields(plan: Plan) -> list[str]:
    """``Class.field`` of each part field that holds its default everywhere in ``plan`` (or no part of the class
    is in it): the round trip would not test it."""
    seen: dict[type, list] = {}
    for f in dataclasses.fields(plan):
        _parts_in(getattr(plan, f.name), seen)
    unset = []
    for cls in PARTS:
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                default = dataclasses.MISSING
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if not any(getattr(v, f.name) != default for v in seen.get(cls, [])):
                unset.append(f"{cls.__name__}.{f.name}")
    return unset


def test_every_typed_field_round_trips(hinted_plan):
    plan = _with_every_field_set(hinted_plan)
    assert _unset_fields(plan) == []  # every field of every part is exercised below
    text = plan.to_json()
    back = Plan.from_json(text)
    for f in dataclasses.fields(Plan):
        if f.name not in ("timings", "node_costs"):  # wall-clock, and the search's charges: never written
            assert getattr(back, f.name) == getattr(plan, f.name), f.name
    assert back.to_json() == text
    # the values come back typed: placements, tuples, int keys (equality alone would not tell a list apart)
    param = next(iter(back.params.values()))
    assert isinstance(param, ParamPlacement) and isinstance(param.placements, tuple)
    assert all(isinstance(p, Placement) for p in param.placements)
    assert back.hints.ops[next(iter(back.hints.ops))].outputs[0][0] == Shard(0, blocks=3)
    assert isinstance(back.memory, PlanMemory) and isinstance(back.cost, PlanCost)
    assert isinstance(back.search.recompute_layers, RecomputeLayers)
    assert isinstance(back.settings, PlanSettings) and back.settings.devices_per_node == 2
    assert isinstance(back.search, SearchStats) and back.search.recompute_modes[2].at_least_s == 2e-3


def test_fields_holding_nothing_are_left_out_of_the_json(hinted_plan):
    """A field whose default is "nothing" is written only when set, so the JSON keeps version 1's shape."""
    d = hinted_plan.to_dict()
    assert d["schema_version"] == 2
    data_parallel = _plan_for(V1_CALLS["plan_v1_gpt2_tiny.json"])  # the tied embedding's gradient: partial
    flagged = sorted(k for k, p in data_parallel.to_dict()["params"].items() if "partial_grad_axes" in p)
    assert flagged == ["transformer.wte.weight"] == [k for k, p in data_parallel.params.items() if p.partial_grad_axes]
    for name, p in d["params"].items():  # written where set only
        assert ("partial_grad_axes" in p) == bool(hinted_plan.params[name].partial_grad_axes), name
    recomputed = [n for n in d["nodes"].values() if "recompute" in n]
    assert 0 < len(recomputed) < len(d["nodes"]) and all(n["recompute"] for n in recomputed)
    again = [c for c in d["collectives"] if "recompute" in c]
    assert again and len(again) == sum(c.recompute for c in hinted_plan.collectives) < len(d["collectives"])
    assert "devices_per_node" not in d["settings"] and "budget_hit" not in d["search"]
    assert d["settings"]["recompute"] == "full" and d["settings"]["mem_cap_bytes"] == 1 << 30  # no default: kept
    assert set(d["memory"]) == {f.name for f in dataclasses.fields(PlanMemory)}  # every memory part is set
    assert d["params"]["transformer.h.0.mlp.c_fc.weight"]["placements"] == ["R", "S(1)"]  # printed placements


@pytest.mark.parametrize("name", sorted(V1_CALLS))
def test_a_version_1_plan_reads_as_this_version_plans_it(name):
    old = Plan.from_json(DATA / name)
    assert json.loads((DATA / name).read_text())["schema_version"] == 1
    new = _plan_for(V1_CALLS[name])
    assert old.memory == new.memory  # version 1's "params", "grads", ... read as params_bytes, grads_bytes, ...
    assert old.cost.total_s == pytest.approx(new.cost.total_s, rel=1e-12)
    assert old.cost.terms == pytest.approx(new.cost.terms, rel=1e-12)
    assert old.params == new.params and old.inputs == new.inputs and old.nodes == new.nodes
    assert old.collectives == new.collectives and old.fallback_ops == new.fallback_ops
    assert old.settings == new.settings and old.search == new.search and old.hints == new.hints
    assert old.family == new.family and old.alternatives == new.alternatives
    assert old.throughput is None and new.throughput is not None  # model FLOPs came after version 1
    assert old.flat_grad_axes == ()  # version 1 cannot say which gradients reduce over flattened axes
    assert (
        old.to_json() == dataclasses.replace(new, throughput=None, flat_grad_axes=()).to_json()
    )  # written again, it is this version's plan


def test_a_version_1_plan_keeps_what_it_says():
    d = json.loads((DATA / "plan_v1_gpt2_tiny_hinted_recompute.json").read_text())
    plan = Plan.from_dict(d)
    assert plan.memory.params_bytes == d["memory"]["params"] and plan.memory.cap_bytes == 1 << 30
    assert plan.hints.params["transformer.h.0.mlp.c_fc.weight"] == parse_placements("R,S(1)")
    assert plan.search.recompute_layers == RecomputeLayers(none=0, selective=0, full=2)
    recomputed = {n.recompute for n in plan.nodes.values() if n.recompute}
    assert recomputed == {"transformer.h.0", "transformer.h.1"}
    assert any(c.recompute for c in plan.collectives)
    # a key version 1 wrote that this version does not know is dropped, not an error
    d["search"]["retired_statistic"] = 1
    assert Plan.from_dict(d).search == plan.search


@pytest.mark.parametrize(
    "edit,expected",
    [
        (
            lambda d: d["memory"].update(per_device_bytes="3 MiB"),
            r"field memory\.per_device_bytes: expected an integer, got str '3 MiB'",
        ),
        (lambda d: d["search"].update(surprise=1), r"field search: unknown key 'surprise'"),
        (lambda d: d["memory"].pop("grads_bytes"), r"field memory: missing key 'grads_bytes'"),
        (
            lambda d: d["params"]["transformer.wte.weight"].update(placements=["S(x)"]),
            r"field params\.transformer\.wte\.weight\.placements\[0\]: placement 'S\(x\)'",
        ),
        (
            lambda d: d["collectives"][0].update(time_s=True),
            r"field collectives\[0\]\.time_s: expected a number, got bool",
        ),
    ],
    ids=["wrong-type", "unknown-key", "missing-key", "bad-placement", "bool-for-float"],
)
def test_a_bad_part_names_its_field(hinted_plan, edit, expected):
    d = hinted_plan.to_dict()
    edit(d)
    with pytest.raises(ValueError, match=expected):
        Plan.from_dict(d)


def test_the_parts_are_frozen_values():
    for cls in PARTS:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert hasattr(cls, "__slots__"), cls
    for cls in PARTS:
        for name, tp in typing.get_type_hints(cls).items():
            assert typing.get_origin(tp) is not list, f"{cls.__name__}.{name}: a list in a frozen value"
