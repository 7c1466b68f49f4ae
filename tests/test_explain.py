"""What decided a plan (autopar/planner/explain.py) and the step's peak memory by phase (autopar/cost/peak.py)."""

from __future__ import annotations

import pytest

import autopar
from autopar.cli import main
from autopar.models import load_model
from autopar.planner.explain import deciding_terms, render_explanation


@pytest.fixture(scope="module")
def tiny_plan():
    model, args, kwargs = load_model("gpt2-tiny", batch=8, seq=64)
    return autopar.plan(model, autopar.Mesh((4,)), example_inputs=args, example_kwargs=kwargs, profile="cpu")


def test_cost_terms_add_up_to_the_step_and_name_each_collective(tiny_plan):
    terms = tiny_plan.cost.terms
    assert sum(terms.values()) == pytest.approx(tiny_plan.cost.total_s, rel=1e-9)
    assert terms["ops (forward + backward)"] > 0 and terms["optimizer step"] > 0
    per_kind = {}
    for c in tiny_plan.collectives:
        key = f"{c.kind} ({c.phase})"
        per_kind[key] = per_kind.get(key, 0.0) + c.time_s
    assert {k: v for k, v in terms.items() if "(" in k and not k.startswith("ops")} == pytest.approx(per_kind)
    for a in tiny_plan.alternatives:
        if a.feasible:
            assert sum(a.terms.values()) == pytest.approx(a.total_s, rel=1e-9)


def test_the_peak_follows_backward(tiny_plan):
    """Never above everything at once plus the largest working set, never below the optimizer step's."""
    m = tiny_plan.memory
    assert m.search_bytes == m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.activations_bytes
    step = m.params_bytes + m.optimizer_bytes + m.grads_bytes
    assert step <= m.per_device_bytes <= m.search_bytes + m.transient_bytes
    assert m.transient_bytes > 0 and m.peak_phase in ("backward", "optimizer step")
    if m.peak_phase == "optimizer step":
        assert m.per_device_bytes == step + m.transient_bytes


def test_deciding_terms_are_the_largest_differences():
    chosen = {"ops": 1.0, "all_reduce (backward)": 0.5, "optimizer step": 0.2}
    other = {"ops": 1.1, "all_gather (forward)": 0.4, "optimizer step": 0.2}
    assert deciding_terms(chosen, other) == [
        ("all_reduce (backward)", pytest.approx(-0.5)),
        ("all_gather (forward)", pytest.approx(0.4)),
        ("ops", pytest.approx(0.1)),
    ]


def test_explain_names_what_each_family_would_spend(tiny_plan, capsys):
    text = render_explanation(tiny_plan)
    assert "what the step time is spent on" in text and "optimizer step" in text
    slower = [a for a in tiny_plan.alternatives if a.feasible and a.total_s > tiny_plan.cost.total_s + 1e-9]
    assert slower and all(f"vs {a.family} (+" in text for a in slower), text
    assert (
        main(["plan", "gpt2-tiny", "--mesh", "4", "--profile", "cpu", "--batch", "8", "--seq", "64", "--explain"]) == 0
    )
    assert "what the step time is spent on" in capsys.readouterr().out
