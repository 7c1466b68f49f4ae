"""The Lagrange floor of a chain whose parts weigh their memory on their own (``search.weighted_chain``): a lower
bound on the exact optimum under the weighted budget, found by the flat DP on the problem weighted node by node."""

from __future__ import annotations

import numpy as np
import pytest
from search_problems import chain_problem

from autopar.search import INF, InfeasibleError, SearchProblem, min_memory, solve_chain, solve_dp
from autopar.search.weighted_chain import WeightedChain, concave_peak_at_most, lagrange_floor


def _weighted(problem: SearchProblem, weight: list[int], cap: int | None = None) -> SearchProblem:
    """``problem`` with node ``i``'s memory and that of the edges into it times ``weight[i]`` (no base memory)."""
    return SearchProblem(
        problem.names,
        problem.node_time,
        tuple(m * w for m, w in zip(problem.node_mem, weight)),
        problem.edges,
        problem.edge_time,
        tuple(None if m is None else m * weight[v] for m, (_, v) in zip(problem.edge_mem, problem.edges)),
        cap,
    )


def _case(seed: int):
    """A random chain, a key per block ``1 ..`` (weights 1-4 in runs), random weights on ``B_0`` with the rest, the
    problems each key's blocks and the rest take, and the whole problem weighted node by node."""
    rng = np.random.default_rng(seed)
    problem, blocks = chain_problem(seed, int(rng.integers(3, 9)), int(rng.integers(2, 4)), 3, None)
    n = problem.n_nodes
    order = [int(x) for x in np.repeat(rng.integers(1, 5, len(blocks)), rng.integers(1, 3, len(blocks)))]
    order = order[: len(blocks) - 1]
    order += [order[-1]] * (len(blocks) - 1 - len(order))
    inside = {i for b in blocks[1:] for i in b}
    rest_weight = [1 if i in inside else int(rng.integers(0, 4)) for i in range(n)]
    whole = list(rest_weight)
    for b, key in zip(blocks[1:], order):
        for i in b:
            whole[i] = key
    chain = WeightedChain(blocks)
    chain.add_rest("rest", [_weighted(problem, rest_weight)])
    for w in set(order):
        chain.add_block(w, [_weighted(problem, [w] * n)])
    return problem, blocks, order, chain, whole


@pytest.mark.parametrize("seed", range(40))
def test_the_floor_is_at_most_the_optimum_under_the_weighted_budget(seed: int) -> None:
    problem, blocks, order, chain, whole = _case(seed)
    free = solve_dp(_weighted(problem, whole))
    rng = np.random.default_rng(seed + 1000)
    for fraction in (1.0, 0.9, 0.7, 0.5, float(rng.uniform(0.2, 1.0))):
        budget = int(free.mem_bytes * fraction)
        floor = lagrange_floor(chain, "rest", order, budget, lam_ref=free.time / max(free.mem_bytes, 1))
        try:
            exact = solve_dp(_weighted(problem, whole, budget))
        except InfeasibleError:  # no plan under the budget: any floor holds, and a large one says so
            continue
        assert floor <= exact.time, (fraction, floor, exact.time)
        if fraction == 1.0:  # the fastest plan is under the budget: lam = 0 gives its time, less the float slack
            assert floor >= free.time - 2


def test_a_budget_no_plan_meets_gives_a_floor_past_every_plan() -> None:
    """Below the least weighted memory ``L`` rises without limit: the grid follows it up past the slowest plan."""
    problem, blocks, order, chain, whole = _case(3)
    weighted = _weighted(problem, whole)
    least, free = min_memory(weighted), solve_dp(weighted)
    slowest = max(weighted.evaluate(c)[0] for c in _some_choices(weighted, 500))
    floor = lagrange_floor(chain, "rest", order, least.mem_bytes - 1, lam_ref=free.time / max(free.mem_bytes, 1))
    assert least.mem_bytes > 0 and floor > slowest


def test_the_floor_stops_once_it_passes_what_the_caller_needs() -> None:
    problem, blocks, order, chain, whole = _case(5)
    free = solve_dp(_weighted(problem, whole))
    budget = free.mem_bytes // 2
    full = lagrange_floor(chain, "rest", order, budget, lam_ref=free.time / free.mem_bytes)
    asked = free.time * 0.5
    early = lagrange_floor(_case(5)[3], "rest", order, budget, free.time / free.mem_bytes, asked)
    assert early > asked and early <= full


def test_with_one_key_and_variants_the_floor_is_under_the_chained_optimum() -> None:
    """Blocks and rest weighted alike: the floor bounds the chained search's optimum over the same variants."""
    problem, blocks = chain_problem(11, 6, 3, 3, 0.2)
    rng, drawn = np.random.default_rng(11), {}
    place = {i: j for block in blocks for j, i in enumerate(block)}  # a block node's position: alike in every block

    def moved(i: int, x: np.ndarray, sign: int) -> np.ndarray:
        key = (sign, place.get(i, -1 - i))
        if key not in drawn:
            drawn[key] = np.where(x < INF, np.maximum(x + sign * rng.integers(0, 30, x.shape), 0), x)
        return drawn[key]

    other = SearchProblem(
        problem.names,
        tuple(moved(i, t, 1) for i, t in enumerate(problem.node_time)),
        tuple(moved(i, m, -1) for i, m in enumerate(problem.node_mem)),
        problem.edges,
        problem.edge_time,
        problem.edge_mem,
        None,
    )
    base = _weighted(problem, [1] * problem.n_nodes)
    cap = problem.mem_cap_bytes - problem.base_mem_bytes
    chain = WeightedChain(blocks)
    chain.add_rest(0, [base, other])
    chain.add_block(0, [base, other])
    exact = solve_chain(base.with_cap(cap), blocks, variants=(other.with_cap(cap),))
    floor = lagrange_floor(chain, 0, [0] * (len(blocks) - 1), cap, lam_ref=exact.time / max(exact.mem_bytes, 1))
    assert floor <= exact.time
    assert floor >= exact.stats["lower_bound"] * 0.9  # the chain's own Lagrange bound at lam*, within the grid's


def _some_choices(problem: SearchProblem, count: int):
    rng = np.random.default_rng(0)
    for _ in range(count):
        c = [int(rng.integers(0, k)) for k in problem.num_choices]
        if not problem.forbidden_in(c):
            yield c


@pytest.mark.parametrize("seed", range(200))
def test_the_concave_peak_bound_is_at_least_the_peak(seed: int) -> None:
    """A concave function (the least of random lines, as ``L`` is) sampled at a few increasing points: the bound is at
    least its maximum over a dense grid from the first point on, and not below the best sample."""
    rng = np.random.default_rng(seed)
    slopes, offsets = rng.normal(0, 1, 6), rng.normal(0, 1, 6)
    slopes[0] = -abs(slopes[0]) - 0.1  # falls at last: a maximum exists

    def f(x):
        return np.min(slopes[:, None] * np.atleast_1d(x)[None, :] + offsets[:, None], axis=0)

    xs = np.sort(rng.uniform(0, 10, int(rng.integers(3, 12))))
    ys = f(xs)
    bound = concave_peak_at_most(list(xs), list(ys))
    dense = f(np.linspace(xs[0], 100, 200001)).max()
    assert bound >= dense - 1e-9 and bound >= ys.max()


def test_the_floor_skips_the_fine_steps_only_where_they_cannot_reach_what_is_asked() -> None:
    """Asked for more than the peak can be: the floor stops at the coarse grid, at the coarse best; asked for less than
    the full floor: it still passes what was asked."""
    problem, blocks, order, chain, whole = _case(5)
    free = solve_dp(_weighted(problem, whole))
    budget, ref = free.mem_bytes // 2, free.time / free.mem_bytes
    full = lagrange_floor(chain, "rest", order, budget, ref)
    assert lagrange_floor(_case(5)[3], "rest", order, budget, ref, full * 10) <= full
    assert lagrange_floor(_case(5)[3], "rest", order, budget, ref, full * 0.999) > full * 0.999
