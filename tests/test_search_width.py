"""The width safety net: past the joint-table budget the search approximates (mini-buckets,
search/minibucket.py), and says so: real plans, a valid lower bound, never a claim of proof."""

from __future__ import annotations

import numpy as np
import pytest
from search_problems import chain_problem, random_problem

from autopar.search import Deadline, InfeasibleError, chain_tables, min_memory, solve_cpsat, solve_dp
from autopar.search import dp as dp_module
from autopar.search.chain import ChainError, solve_chain

_BUDGET = 32  # cells per weight row: every problem below is wider


def _problem(seed: int):
    rng = np.random.default_rng(seed)
    quantile = float(rng.choice([0.1, 0.3, 0.6]))
    return random_problem(3000 + seed, 24, 5, edge_prob=0.15, cap_quantile=quantile, inf_prob=0.05)


@pytest.mark.parametrize("seed", range(12))
def test_approximate_plan_is_real_and_bracketed_by_the_bound(seed: int) -> None:
    problem = _problem(seed)
    exact = solve_dp(problem)  # wide, but small enough for the exact search
    got = solve_dp(problem, width_budget=_BUDGET)
    assert got.stats["approximate"] and got.stats["exact_width"] > _BUDGET >= got.stats["width"]
    assert got.optimal == (got.time == got.stats["lower_bound"] == exact.time)
    assert got.optimal == got.stats["optimal_time_proven"]
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)
    assert problem.forbidden_in(got.choice) == []
    assert got.mem_bytes <= problem.mem_cap_bytes
    assert got.stats["lower_bound"] <= exact.time <= got.time
    assert got.stats["gap"] == pytest.approx((got.time - got.stats["lower_bound"]) / got.time)
    if seed < 4:  # and CP-SAT, on the full domains, agrees with the exact search
        assert solve_cpsat(problem, time_limit_s=30).time == exact.time


def test_approximate_frontier_and_least_memory_are_real_plans() -> None:
    problem = _problem(0).with_cap(None)
    least = min_memory(problem)
    approx = min_memory(problem, width_budget=_BUDGET)
    assert not approx.optimal and approx.mem_bytes >= least.mem_bytes
    assert problem.evaluate(approx.choice) == (approx.time, approx.mem_bytes)
    assert approx.stats["lower_bound"] <= least.mem_bytes
    exact = solve_dp(problem, frontier=True).stats["frontier"]
    got = solve_dp(problem, width_budget=_BUDGET, frontier=True).stats
    assert not got["frontier_exact"]
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(got["frontier"], got["frontier"][1:]))
    # no approximate point beats the exact staircase
    for t, m in got["frontier"]:
        assert any(et <= t and em <= m for et, em in exact)


def test_approximate_infeasibility_is_not_claimed_as_proven() -> None:
    problem = _problem(1)
    least = min_memory(problem).mem_bytes
    with pytest.raises(InfeasibleError) as err:
        solve_dp(problem.with_cap(least - 1), width_budget=_BUDGET)
    assert err.value.approximate
    assert "approximate" in str(err.value) and "least-memory plan it found" in str(err.value)
    assert err.value.min_mem_bytes >= least
    with pytest.raises(InfeasibleError) as exact:
        solve_dp(problem.with_cap(least - 1))
    assert not exact.value.approximate and exact.value.min_mem_bytes == least


def test_a_chain_block_over_the_budget_sends_the_chain_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    problem, blocks = chain_problem(0, 4, 5, 4, cap_quantile=0.3)
    monkeypatch.setattr(dp_module, "WIDTH_BUDGET", 8)
    monkeypatch.setattr(chain_tables, "BLOCK_WIDTH_BUDGET", 8)
    with pytest.raises(ChainError, match="width budget"):
        solve_chain(problem, blocks)
    flat = solve_dp(problem)  # what the planner does on ChainError: the flat search, approximate here
    assert flat.stats["approximate"] and flat.mem_bytes <= problem.mem_cap_bytes


def test_shared_weight_model_past_the_budget_plans_approximately() -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    import autopar
    from autopar.planner.driver import plan_from_context, prepare
    from autopar.planner.problem_tables import to_problem

    config = transformers.AlbertConfig(  # four layers, one set of weights
        vocab_size=101,
        embedding_size=32,
        hidden_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
    )
    with torch.device("meta"):
        model = transformers.AlbertForMaskedLM(config)
    ids = torch.zeros(3, 12, dtype=torch.long, device="meta")
    args, kwargs = (ids,), {"labels": torch.zeros(3, 12, dtype=torch.long, device="meta")}
    ctx = prepare(model, autopar.Mesh((2, 2)), example_inputs=args, example_kwargs=kwargs, profile="h100")
    problem, _ = to_problem(ctx.tables, None)
    free = solve_dp(problem)  # every layer reads the shared weights: far past the budget
    assert free.stats["approximate"] and free.stats["exact_width"] > 10**6 * dp_module.WIDTH_BUDGET
    assert free.stats["lower_bound"] <= free.time and free.optimal == free.stats["optimal_time_proven"]
    # past its deadline the approximate search stops its windows and returns the plan decoded, saying so
    rushed = solve_dp(problem, deadline=Deadline.after(1e-9))
    assert rushed.stats["approximate"] and rushed.stats["budget_hit"] and rushed.stats["windows"] == 0
    assert problem.evaluate(rushed.choice) == (rushed.time, rushed.mem_bytes) and rushed.time >= free.time
    cap = int(free.mem_bytes * 0.8)
    capped = plan_from_context(ctx, mem_cap=cap, compare_families=False)
    assert capped.memory.per_device_bytes <= cap
    assert capped.search.optimal is False and capped.search.objective_ps > free.time  # the cap binds
    # the plan says it is approximate, with its bound and gap, and so does its table
    search = capped.search
    assert search.approximate and search.lower_bound_ps <= search.objective_ps
    assert search.gap == pytest.approx(1 - search.lower_bound_ps / search.objective_ps)
    from autopar.planner.plan_table import render_table

    assert f"approximate search, within {100 * search.gap:.2f}% of its lower bound" in " ".join(
        render_table(capped).split()
    )


@pytest.mark.parametrize("seed", range(4))
def test_thinned_only_is_a_real_plan_no_faster_than_the_optimum(seed: int) -> None:
    problem = _problem(seed)
    exact, thin = solve_dp(problem), solve_dp(problem, thinned_only=True)
    assert problem.evaluate(thin.choice) == (thin.time, thin.mem_bytes) and thin.mem_bytes <= problem.mem_cap_bytes
    assert thin.time >= exact.time and (not thin.optimal or thin.time == exact.time)
