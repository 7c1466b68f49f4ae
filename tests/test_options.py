"""Issue 30: one options object per concern, and one table of the planning keywords.

``autopar.plan``, ``prepare``, ``plan_from_context``, ``compile`` and ``autopar plan`` take the
same planning keywords with the same defaults (``autopar.planner.PLAN_KEYWORDS``); each builds
``PlanOptions``/``HintOptions`` once, which check every value and name the option; and a plan
made through ``plan`` is the plan ``compile`` makes from the same keywords.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import autopar
from autopar.cli import build_parser
from autopar.compiled.build import _plan_here
from autopar.models import load_model
from autopar.planner import (
    PLAN_KEYWORDS,
    HintOptions,
    OptionError,
    PlanOptions,
    device_profile,
    plan_from_context,
    prepare,
)
from autopar.planner.options import job_profile

#: What each entry point takes besides the planning keywords (its own inputs and report or runtime options).
OWN = {
    "plan": {"model", "mesh", "devices", "example_inputs", "example_kwargs", "loss_fn", "example_target"}
    | {"compare_families", "progress"},
    "prepare": {"model", "mesh", "example_inputs", "example_kwargs", "loss_fn", "example_target", "reuse_batch"},
    "plan_from_context": {"ctx", "compare_families", "progress"},
    "compile": {"model", "mesh", "devices", "example_inputs", "example_kwargs", "loss_fn", "example_target", "plan"}
    | {"state_dict", "weights_from_rank0", "input_mode", "seed"},
}
ENTRY_POINTS = {name: getattr(autopar, name) for name in OWN}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_the_table_keywords_with_its_defaults(name):
    params = inspect.signature(ENTRY_POINTS[name]).parameters
    listed = [p for p in params if p in PLAN_KEYWORDS]
    assert listed == list(PLAN_KEYWORDS), f"{name}: the planning keywords, in the table's order"
    for kw in PLAN_KEYWORDS.values():
        p = params[kw.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"{name}({kw.name}=) is not keyword-only"
        assert p.default == kw.default and type(p.default) is type(kw.default), (name, kw.name, p.default)
    assert set(params) - set(PLAN_KEYWORDS) == OWN[name], f"{name} takes keywords the table does not list"


def test_the_options_objects_are_the_table():
    plan_rows = [k for k in PLAN_KEYWORDS.values() if k.concern in ("price", "search")]
    hint_rows = [k for k in PLAN_KEYWORDS.values() if k.concern == "hints"]
    assert len(plan_rows) + len(hint_rows) == len(PLAN_KEYWORDS) == 19
    for cls, rows in ((PlanOptions, plan_rows), (HintOptions, hint_rows)):
        assert {f.name: f.default for f in dataclasses.fields(cls)} == {k.name: k.default for k in rows}
        assert cls.__dataclass_params__.frozen and hasattr(cls, "__slots__")
    assert PlanOptions() == PlanOptions.from_keywords({k: k_.default for k, k_ in PLAN_KEYWORDS.items()})
    assert all(k.doc and len(k.doc) <= 100 and "\n" not in k.doc for k in PLAN_KEYWORDS.values())


def test_the_cli_flags_default_to_the_table():
    parser = build_parser()
    plan_parser = next(a for a in parser._actions if a.dest == "command").choices["plan"]
    by_flag = {s: a for a in plan_parser._actions for s in a.option_strings}
    api_only = {k.name for k in PLAN_KEYWORDS.values() if k.flag is None}
    assert api_only == {"input_placements", "output_placements"}
    for kw in PLAN_KEYWORDS.values():
        if kw.flag is not None:
            action = by_flag[kw.flag]
            assert (action.dest, action.default) == (kw.name, kw.default), kw.flag
    args = parser.parse_args(["plan", "gpt2-tiny"])
    assert PlanOptions.from_keywords(vars(args)) == PlanOptions()
    given = parser.parse_args(
        ["plan", "gpt2-tiny", "--mem-cap", "1GiB", "--family", "tensor-parallel", "--no-state-sharding"]
        + ["--grad-bucket-bytes", "0", "--search-budget", "5", "--dtype", "bf16"]
    )
    assert PlanOptions.from_keywords(vars(given)) == PlanOptions(
        mem_cap=2**30,
        family="tensor parallel",
        allow_state_sharding=False,
        grad_bucket_bytes=None,
        search_budget_s=5.0,
        dtype="bf16",
    )


@pytest.mark.parametrize(
    "options,says",
    [
        ({"solver": "dpp"}, "solver 'dpp': expected one of ('dp', 'ilp'). Fix: pass 'dp'"),
        ({"recompute": "some"}, "recompute 'some': expected one of ('auto', 'none', 'selective', 'full'). Fix:"),
        ({"family": "dp"}, "family 'dp': expected one of ('data parallel', 'sharded parameters', 'tensor parallel')"),
        ({"mem_cap": "lots"}, "mem_cap 'lots': memory size 'lots': expected bytes or a number with a unit"),
        ({"dtype": "fp8"}, "dtype 'fp8': unknown training precision 'fp8'; expected one of ['bf16', 'bf16-pure'"),
        ({"optimizer": "lion"}, "optimizer 'lion': unknown optimizer 'lion'; expected one of ['adam', 'adamw'"),
        ({"profile": "tpu9"}, "profile 'tpu9': unknown device profile 'tpu9'"),
        ({"devices_per_node": 0}, "devices_per_node 0: expected an int >= 1. Fix: pass the ranks each node runs"),
        ({"grad_bucket_bytes": -1}, "grad_bucket_bytes -1: expected an int >= 0. Fix:"),
        ({"search_budget_s": 0}, "search_budget_s 0: expected a positive number of seconds. Fix:"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_a_bad_option_is_named_with_what_was_expected_and_the_fix(options, says):
    with pytest.raises(OptionError) as e:
        PlanOptions(**options)
    assert str(e.value).startswith(says), str(e.value)
    assert e.value.option == next(iter(options))


class _NeverTraced(torch.nn.Module):
    def forward(self, x):
        raise AssertionError("the model was traced before the options were checked")


@pytest.mark.parametrize("name", ["plan", "prepare"])
def test_entry_points_check_the_options_before_tracing(name):
    mesh = autopar.Mesh((2,))
    with pytest.raises(OptionError, match="solver 'cpsat'"):
        ENTRY_POINTS[name](_NeverTraced(), mesh, example_inputs=(torch.randn(4, 8),), solver="cpsat")
    with pytest.raises(TypeError, match="hints list: expected a mapping of pattern -> value"):
        ENTRY_POINTS[name](_NeverTraced(), mesh, example_inputs=(torch.randn(4, 8),), hints=["*.weight"])


def test_the_profile_default_is_the_job_device():
    """``profile=None``: a process group's device, else the model's GPU; meta or CPU models plan for h100."""
    assert device_profile(torch.device("cpu")) == "cpu" and device_profile(torch.device("meta")) == "h100"
    assert device_profile(None) == "h100"
    assert job_profile(torch.nn.Linear(2, 2)) == "h100"  # on the CPU, outside a process group: planned ahead
    assert job_profile(torch.nn.Linear(2, 2, device="meta")) == "h100"
    resolved = PlanOptions().resolved(torch.nn.Linear(2, 2, dtype=torch.bfloat16))
    assert (resolved.profile, resolved.dtype, resolved.devices_per_node) == ("h100", "bf16-pure", None)
    assert PlanOptions(profile="a100", dtype="fp32").resolved(torch.nn.Linear(2, 2)).profile == "a100"


@pytest.fixture(scope="module")
def tiny():
    return load_model("gpt2-tiny", batch=4, seq=32)


OPTION_SETS = {
    "defaults": {},
    "capped": {"mem_cap": "3MiB", "dtype": "bf16", "optimizer": "sgd", "hints": {"*.mlp.c_fc.weight": ["R"]}},
    "forced": {"family": "tensor parallel", "allow_state_sharding": False, "recompute": "none", "strict": True},
}


def _split(keywords: dict) -> tuple[PlanOptions, HintOptions]:
    return PlanOptions.from_keywords(keywords), HintOptions.from_keywords(keywords)


@pytest.mark.parametrize("label", sorted(OPTION_SETS))
def test_plan_is_the_plan_compile_makes_from_the_same_keywords(tiny, label):
    model, args, kwargs = tiny
    keywords = OPTION_SETS[label]
    mesh = autopar.Mesh((2,))
    via_plan = autopar.plan(model, mesh, example_inputs=args, example_kwargs=kwargs, compare_families=False, **keywords)
    via_compile, graph = _plan_here(model, mesh, args, kwargs, *_split(keywords))
    assert via_plan.to_json() == via_compile.to_json()
    assert graph.model_name == "GPT2LMHeadModel"
    settings = via_plan.settings
    assert (settings.profile, settings.dtype, settings.optimizer) == (
        "h100",
        keywords.get("dtype", "fp32"),
        keywords.get("optimizer", "adamw"),
    )
    assert settings.mem_cap_bytes == (3 * 2**20 if "mem_cap" in keywords else None)


def test_plan_from_context_starts_from_the_options_prepare_was_given(tiny):
    """A keyword left at its default keeps the context's; a priced one given anew prices the graph again."""
    model, args, kwargs = tiny
    mesh = autopar.Mesh((2,))
    inputs = {"example_inputs": args, "example_kwargs": kwargs, "compare_families": False}
    ctx = prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, mem_cap="3MiB", optimizer="sgd")
    assert (ctx.options.mem_cap, ctx.options.optimizer, ctx.options.profile) == (3 * 2**20, "sgd", "h100")
    kept = plan_from_context(ctx, compare_families=False)
    assert kept.to_json() == autopar.plan(model, mesh, mem_cap="3MiB", optimizer="sgd", **inputs).to_json()
    repriced = plan_from_context(ctx, dtype="bf16", recompute="none", compare_families=False)
    want = autopar.plan(model, mesh, mem_cap="3MiB", optimizer="sgd", dtype="bf16", recompute="none", **inputs)
    assert repriced.to_json() == want.to_json()
    assert ctx.options.dtype == "fp32"  # the context itself is unchanged
