"""The chained search without a cap breaks ties in time by memory from its time row (``Chain.fastest_plan``):
the decoded plan where it is the only fastest, each part that tied re-solved at its ports (``PortTable.
fastest_choice``, ``elimination.lexicographic``), and the exact pass only where the port states or a part's
variant tie.  Checked against the flat exact search, on chains whose costs are drawn from a few values (ties
everywhere) and from many (ties rare)."""

from __future__ import annotations

import numpy as np
import pytest
from chain_cases import variant
from search_problems import chain_problem

from autopar.search import solve_chain
from autopar.search.chain_tables import Chain
from autopar.search.dp import solve_dp
from autopar.search.elimination import EliminationModel, decode_lexicographic, lexicographic
from autopar.search.problem import solve_brute_force
from autopar.search.tables import PortTable


def _paths(monkeypatch) -> dict[str, int]:
    """Counts of how each uncapped chain search broke its ties: the time row's plan alone, parts re-solved, or
    the exact pass."""
    seen = {"alone": 0, "resolved": 0, "pass": 0}
    real_fastest, real_choice = Chain.fastest_plan, PortTable.fastest_choice

    def fastest(self):
        plan = real_fastest(self)
        seen["pass" if plan is None else "alone"] += 1
        return plan

    def choice(self, pair, alike):
        seen["resolved"] += 1
        return real_choice(self, pair, alike)

    monkeypatch.setattr(Chain, "fastest_plan", fastest)
    monkeypatch.setattr(PortTable, "fastest_choice", choice)
    return seen


@pytest.mark.parametrize("max_value", [3, 6, 100])
def test_uncapped_chain_breaks_ties_by_memory_as_the_flat_search_does(monkeypatch, max_value: int) -> None:
    """Least time, then least memory, equal to the flat exact search's on 40 chains per cost range; with few
    values some searches re-solve a tied part and none of them may be off by a byte."""
    seen = _paths(monkeypatch)
    for seed in range(40):
        problem, blocks = chain_problem(seed, 3 + seed % 6, 3, 3, None, max_value=max_value)
        got, want = solve_chain(problem, blocks), solve_dp(problem)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes), seed
        assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)
        assert got.optimal
    assert seen["alone"] > 0
    if max_value <= 6:
        assert seen["resolved"] > 0  # ties inside a part happened and were broken by re-solving it


def test_uncapped_chain_with_variants_breaks_ties_as_the_exact_pass_does(monkeypatch) -> None:
    """Blocks that may take another variant (recomputation's terms): the plan equals the exact pass's (the
    search with ``fastest_plan`` turned off)."""
    cases = []
    for seed in range(24):
        problem, blocks = chain_problem(seed, 3 + seed % 4, 3, 3, None, max_value=5)
        cases.append((problem, blocks, (variant(problem, blocks, seed),)))
    fast = [solve_chain(p, b, variants=v) for p, b, v in cases]
    monkeypatch.setattr(Chain, "fastest_plan", lambda self: None)
    for (p, b, v), got in zip(cases, fast):
        for q in (p, *v):
            q.forget()
        want = solve_chain(p, b, variants=v)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
        assert got.stats["block_variants"] is not None


@pytest.mark.parametrize("seed", range(12))
def test_lexicographic_elimination_is_the_brute_force_order(seed: int) -> None:
    """``lexicographic`` and its decoding give the plan of least time, then least memory, of a whole problem."""
    problem, _ = chain_problem(seed, 2, 2, 3, None, max_value=4)
    model = EliminationModel(problem)
    t_vals, m_vals = lexicographic(model)
    red = decode_lexicographic(model, t_vals, m_vals, np.zeros((1, len(model.k)), np.int64))
    want = solve_brute_force(problem)
    assert problem.evaluate(model.original_choice(red[0])) == (want.time, want.mem_bytes)
    assert (t_vals[model.final][0], m_vals[model.final][0]) == (want.time, want.mem_bytes)  # the base's in a table
