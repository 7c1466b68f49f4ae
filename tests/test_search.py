"""The search: the exact DP against brute force and against CP-SAT, to the picosecond."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from search_problems import random_problem, transformer_like_problem

from autopar.search import (
    INF,
    Deadline,
    InfeasibleError,
    SearchProblem,
    min_memory,
    solve_brute_force,
    solve_cpsat,
    solve_dp,
)
from autopar.search.prune import prune_dominated


def _brute_frontier(problem: SearchProblem) -> list[tuple[int, int]]:
    pts = sorted(
        {
            problem.evaluate(c)
            for c in itertools.product(*map(range, problem.num_choices))
            if not problem.forbidden_in(c)
        }
    )
    out: list[tuple[int, int]] = []
    for t, m in pts:
        if not out or m < out[-1][1]:
            out.append((t, m))
    return out


def _check_plan(problem: SearchProblem, sol) -> None:
    assert problem.evaluate(sol.choice) == (sol.time, sol.mem_bytes)
    assert problem.forbidden_in(sol.choice) == []
    if problem.mem_cap_bytes is not None:
        assert sol.mem_bytes <= problem.mem_cap_bytes


def _tiny(seed: int) -> SearchProblem:
    rng = np.random.default_rng(seed)
    quantile = [0.0, 0.1, 0.3, 0.6, None][seed % 5]
    return random_problem(seed, int(rng.integers(1, 8)), int(rng.integers(1, 5)), edge_prob=0.3, cap_quantile=quantile)


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force_on_tiny_problems(seed: int) -> None:
    problem = _tiny(seed)
    try:
        want = solve_brute_force(problem)
    except InfeasibleError as err:
        with pytest.raises(InfeasibleError) as got:
            solve_dp(problem)
        assert got.value.min_mem_bytes == err.min_mem_bytes
        return
    got = solve_dp(problem, frontier=seed % 2 == 0)
    _check_plan(problem, got)
    assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)  # both break time ties by memory
    assert got.optimal and got.solver == "dp"
    if seed % 2 == 0:
        assert got.stats["frontier_exact"] and got.stats["frontier"] == _brute_frontier(problem)


@pytest.mark.parametrize("seed", range(12))
def test_min_memory_matches_brute_force(seed: int) -> None:
    problem = _tiny(seed).with_cap(None)
    plans = [c for c in itertools.product(*map(range, problem.num_choices)) if not problem.forbidden_in(c)]
    want = min((problem.evaluate(c)[1], problem.evaluate(c)[0]) for c in plans)
    got = min_memory(problem)
    assert (got.mem_bytes, got.time) == want
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)


def _small(seed: int) -> SearchProblem:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(4, 17))
    max_k = int(rng.integers(1, 5))
    edge_prob = float(rng.choice([0.05, 0.15, 0.3]))
    quantile = float(rng.choice([0.02, 0.1, 0.25, 0.5, 0.9]))
    return random_problem(1000 + seed, n, max_k, edge_prob=edge_prob, cap_quantile=quantile, inf_prob=0.08)


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_cpsat_optimum_exactly(seed: int) -> None:
    problem = _small(seed)
    try:
        ref = solve_cpsat(problem, time_limit_s=30)
    except InfeasibleError as err:
        with pytest.raises(InfeasibleError) as got:
            solve_dp(problem)
        assert got.value.min_mem_bytes == err.min_mem_bytes
        return
    assert ref.optimal, f"CP-SAT did not prove optimality on {problem.summary()}"
    got = solve_dp(problem)
    _check_plan(problem, ref)
    _check_plan(problem, got)
    assert got.time == ref.time


def test_cap_binds_and_both_solvers_agree_on_a_small_transformer() -> None:
    problem = transformer_like_problem(1, 3, seed=1, cap_fraction=0.5, chain_ops=0.5)
    free = solve_dp(problem.with_cap(None))
    assert free.mem_bytes > problem.mem_cap_bytes  # the cap really binds
    got, ref = solve_dp(problem), solve_cpsat(problem, time_limit_s=60)
    assert ref.optimal
    assert got.time == ref.time > free.time
    _check_plan(problem, got)


@pytest.mark.parametrize("seed", range(6))
def test_infeasible_cap_reports_the_brute_force_minimum(seed: int) -> None:
    problem = _tiny(100 + seed).with_cap(None)
    least = min(
        problem.evaluate(c)[1]
        for c in itertools.product(*map(range, problem.num_choices))
        if not problem.forbidden_in(c)
    )
    problem = problem.with_cap(least - 1)
    for solver in (solve_dp, solve_cpsat, solve_brute_force):
        with pytest.raises(InfeasibleError) as err:
            solver(problem)
        assert err.value.min_mem_bytes == least
        assert err.value.cap_bytes == least - 1
        assert err.value.min_mem_solution.mem_bytes == least
        assert str(least) in str(err.value) and str(least - 1) in str(err.value)
    # exactly at the minimum it fits
    assert solve_dp(problem.with_cap(least)).mem_bytes == least


def _chain(times: list[list[int]], pair: list[list[int]], cap: int | None = None) -> SearchProblem:
    arr = [np.array(t, np.int64) for t in times]
    return SearchProblem(
        tuple(f"op{i}" for i in range(len(arr))),
        tuple(arr),
        tuple(np.zeros_like(a) for a in arr),
        tuple((i, i + 1) for i in range(len(arr) - 1)),
        tuple(np.array(pair, np.int64) for _ in range(len(arr) - 1)),
        tuple(None for _ in range(len(arr) - 1)),
        cap,
    )


def test_forbidden_entries_are_avoided() -> None:
    # The cheapest choice (0) of op1 is forbidden, and so is pair (1, 1) on every edge.
    problem = _chain([[5, 1], [INF, 3], [2, 4]], [[0, 7], [7, INF]])
    for solver in (solve_dp, solve_cpsat, solve_brute_force):
        sol = solver(problem)
        assert sol.choice == (0, 1, 0) and sol.time == 5 + 3 + 2 + 7 + 7
    # With forbidden entries everywhere on random problems, no plan uses one.
    for seed in range(10):
        problem = random_problem(seed, 12, 4, edge_prob=0.2, cap_quantile=None, inf_prob=0.4)
        _check_plan(problem, solve_dp(problem))


def test_every_plan_forbidden_raises() -> None:
    with pytest.raises(InfeasibleError, match="op1"):
        solve_dp(_chain([[1, 2], [INF, INF], [1, 1]], [[0, 0], [0, 0]]))
    # Each choice alone is fine, but the triangle's pairs admit no plan.
    ne = np.array([[INF, 0], [0, INF]], np.int64)
    problem = SearchProblem(
        ("a", "b", "c"),
        tuple(np.zeros(2, np.int64) for _ in range(3)),
        tuple(np.zeros(2, np.int64) for _ in range(3)),
        ((0, 1), (1, 2), (0, 2)),
        (ne, ne, ne),
        (None, None, None),
        None,
    )
    for solver in (solve_dp, solve_cpsat):
        with pytest.raises(InfeasibleError):
            solver(problem)


def test_degenerate_problems() -> None:
    empty = SearchProblem((), (), (), (), (), (), 10, 7)
    assert (solve_dp(empty).time, solve_dp(empty).mem_bytes) == (0, 7)
    single = _chain([[4]], [], cap=None)
    assert solve_dp(single).choice == (0,)
    ones = _chain([[4], [1], [2]], [[3]])
    assert solve_dp(ones).time == 4 + 1 + 2 + 3 + 3


def test_progress_reports_every_step() -> None:
    calls: list[tuple[int, int]] = []
    solve_dp(random_problem(3, 30, 4, edge_prob=0.1, cap_quantile=0.3), progress=lambda d, n: calls.append((d, n)))
    total = calls[-1][1]
    assert [d for d, _ in calls[-total:]] == list(range(1, total + 1))


def test_validation_names_the_culprit() -> None:
    good = _chain([[1, 2], [3, 4]], [[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"node_time\[1\] \(op1\): expected dtype int64"):
        SearchProblem(
            good.names,
            (good.node_time[0], np.array([1.0, 2.0])),
            good.node_mem,
            good.edges,
            good.edge_time,
            good.edge_mem,
            None,
        )
    with pytest.raises(ValueError, match=r"edges\[0\] = \(1, 0\): expected 0 <= u < v"):
        SearchProblem(good.names, good.node_time, good.node_mem, ((1, 0),), good.edge_time, good.edge_mem, None)
    with pytest.raises(ValueError, match=r"edge_time\[0\] \(op0 -> op1\): expected shape \(2, 2\)"):
        SearchProblem(
            good.names, good.node_time, good.node_mem, good.edges, (np.zeros((2, 3), np.int64),), good.edge_mem, None
        )
    with pytest.raises(ValueError, match="duplicate edge"):
        SearchProblem(
            good.names, good.node_time, good.node_mem, good.edges * 2, good.edge_time * 2, good.edge_mem * 2, None
        )
    with pytest.raises(ValueError, match="choice has 1 entries"):
        good.evaluate((0,))


@pytest.mark.parametrize("k", [4, 10])
def test_transformer_like_twelve_layers(k: int) -> None:
    problem = transformer_like_problem(12, k, seed=0, cap_fraction=0.5)
    assert 900 <= problem.n_nodes <= 1200
    sol = solve_dp(problem)
    _check_plan(problem, sol)
    free = solve_dp(problem.with_cap(None))
    assert free.mem_bytes > problem.mem_cap_bytes >= min_memory(problem).mem_bytes
    assert sol.time >= free.time
    assert sol.stats["lower_bound"] <= sol.time <= sol.stats["upper_bound"]


def test_frontier_of_a_transformer_spans_both_extremes() -> None:
    problem = transformer_like_problem(2, 6, seed=3, cap_fraction=None)
    front = solve_dp(problem, frontier=True).stats["frontier"]
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(front, front[1:]))  # a staircase
    fastest, smallest = solve_dp(problem), min_memory(problem)
    assert front[0] == (fastest.time, fastest.mem_bytes)
    assert front[-1] == (smallest.time, smallest.mem_bytes)
    assert len(front) > 10


def test_values_past_inf_are_named() -> None:
    ok = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match=r"node_time\[1\] \(b\): values must lie in \[-INF, INF\]"):
        SearchProblem(("a", "b"), (ok, np.array([0, INF + 1], np.int64)), (ok, ok), (), (), (), None)


@pytest.mark.parametrize("seed", range(6))
def test_vectorized_evaluate_equals_the_term_by_term_sum(seed: int) -> None:
    problem = random_problem(seed, 9, 4, edge_prob=0.4, cap_quantile=None)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        c = tuple(int(rng.integers(k)) for k in problem.num_choices)
        assert problem.evaluate(c) == problem._evaluate_slow(c)
    t = list(problem.node_time)
    t[0] = np.full_like(t[0], INF)  # forbidden: the exact Python-int path answers
    forbidden = SearchProblem(
        problem.names, tuple(t), problem.node_mem, problem.edges, problem.edge_time, problem.edge_mem, None
    )
    c = (0,) * problem.n_nodes
    assert forbidden.evaluate(c) == forbidden._evaluate_slow(c) and forbidden.evaluate(c)[0] >= INF


def test_a_shared_array_is_checked_for_every_node_that_holds_it() -> None:
    bad = np.array([1, INF + 1], np.int64)
    good = np.array([1, 2], np.int64)
    with pytest.raises(ValueError, match=r"node_time\[0\] \(a\)[^\n]*\n  - node_time\[2\] \(c\)"):
        SearchProblem(("a", "b", "c"), (bad, good, bad), (good, good, good), (), (), (), None)


# ---- dominance pruning (search/prune.py) ---------------------------------------------------
def _with_copies(problem: SearchProblem, seed: int) -> SearchProblem:
    """``problem`` with extra strategies per node: exact copies of existing ones, and copies
    made worse (a nonnegative noise on the node's entries and its edges' rows), so no
    (T, M) point of any plan changes and the optimum under any cap stays the same."""
    rng = np.random.default_rng(seed)
    src, nt, nm = [], [], []
    for t in problem.node_time:
        extra = rng.integers(0, t.size, int(rng.integers(1, 3)))
        src.append(np.concatenate([np.arange(t.size), extra]))
        worse = rng.random(extra.size) < 0.5
        nt.append(np.concatenate([np.zeros(t.size, np.int64), worse * rng.integers(0, 5, extra.size)]))
        nm.append(np.concatenate([np.zeros(t.size, np.int64), worse * rng.integers(0, 5, extra.size)]))

    def worse(arr: np.ndarray, noise: np.ndarray) -> np.ndarray:
        return np.where(arr >= INF, INF, np.minimum(arr + noise, INF)).astype(np.int64)

    def edge(arr: np.ndarray | None, u: int, v: int, noise: list[np.ndarray]) -> np.ndarray | None:
        if arr is None:
            return None
        return worse(arr[np.ix_(src[u], src[v])], noise[u][:, None] + noise[v][None, :])

    return SearchProblem(
        problem.names,
        tuple(worse(t[s], n) for t, s, n in zip(problem.node_time, src, nt)),
        tuple(m[s] + n for m, s, n in zip(problem.node_mem, src, nm)),
        problem.edges,
        tuple(edge(t, u, v, nt) for t, (u, v) in zip(problem.edge_time, problem.edges)),
        tuple(edge(m, u, v, nm) for m, (u, v) in zip(problem.edge_mem, problem.edges)),
        problem.mem_cap_bytes,
        problem.base_mem_bytes,
    )


@pytest.mark.parametrize("seed", range(16))
def test_pruned_dp_matches_brute_force_with_dominated_copies(seed: int) -> None:
    base = random_problem(2000 + seed, 6, 3, edge_prob=0.3, cap_quantile=None, inf_prob=0.1)
    problem = _with_copies(base, seed)
    kept = prune_dominated(problem, problem.allowed_choices())
    assert sum(map(len, kept)) <= sum(base.num_choices) < sum(problem.num_choices)  # every copy went
    front = _brute_frontier(problem)
    assert solve_dp(problem, frontier=True).stats["frontier"] == front == _brute_frontier(base)
    least = front[-1][1]
    for cap in (least - 1, least, (least + front[0][1]) // 2, front[0][1]):
        capped = problem.with_cap(cap)
        try:
            want = solve_brute_force(capped)
        except InfeasibleError as err:
            with pytest.raises(InfeasibleError) as got:
                solve_dp(capped)
            assert got.value.min_mem_bytes == err.min_mem_bytes == least
            continue
        got = solve_dp(capped)
        _check_plan(capped, got)
        assert (got.time, got.mem_bytes) == (want.time, want.mem_bytes)
    assert (min_memory(problem).mem_bytes, min_memory(problem).time) == (least, front[-1][0])


@pytest.mark.parametrize("seed", range(8))
def test_pruned_dp_equals_cpsat_with_dominated_copies(seed: int) -> None:
    problem = _with_copies(_small(seed), seed)
    try:
        ref = solve_cpsat(problem, time_limit_s=30)  # CP-SAT sees every strategy: an independent check
    except InfeasibleError as err:
        with pytest.raises(InfeasibleError) as got:
            solve_dp(problem)
        assert got.value.min_mem_bytes == err.min_mem_bytes
        return
    assert ref.optimal
    got = solve_dp(problem)
    _check_plan(problem, got)
    assert got.time == ref.time


def test_dominance_keeps_the_first_of_equals_and_never_prunes_kept_nodes() -> None:
    # op0: 0 and 2 are equal, 1 is faster alone but dearer on the edge, 3 is 0 made worse
    problem = SearchProblem(
        ("op0", "op1"),
        (np.array([5, 4, 5, 6], np.int64), np.array([1, 1], np.int64)),
        (np.array([2, 2, 2, 2], np.int64), np.array([0, 0], np.int64)),
        ((0, 1),),
        (np.array([[0, 3], [1, 3], [0, 3], [0, 3]], np.int64),),
        (np.array([[0, 0], [0, 0], [0, 0], [0, 1]], np.int64),),
        None,
    )
    got = prune_dominated(problem, problem.allowed_choices())
    assert [a.tolist() for a in got] == [[0, 1], [0]]  # op1's 1 loses to 0 on the edge whatever op0 picks
    kept = prune_dominated(problem, problem.allowed_choices(), keep=frozenset({0}))
    assert [a.tolist() for a in kept] == [[0, 1, 2, 3], [0]]
    # a forbidden pair of the dominated side (a1, b1): its memory there does not count, so a0 wins
    inf = SearchProblem(
        ("a", "b"),
        (np.array([1, 1], np.int64), np.array([1, 0], np.int64)),
        (np.zeros(2, np.int64), np.zeros(2, np.int64)),
        ((0, 1),),
        (np.array([[0, 0], [0, INF]], np.int64),),
        (np.array([[0, 9], [0, 0]], np.int64),),
        None,
    )
    assert [a.tolist() for a in prune_dominated(inf, inf.allowed_choices())] == [[0], [0, 1]]


@pytest.mark.parametrize("seed", range(6))
def test_dominance_filter_equals_the_all_pairs_definition(seed: int) -> None:
    """``prune._dominated`` filters pairs column by column, then in blocks on the pairs left: on matrices wide
    enough for both phases, with equal rows and near-equal ones, it marks exactly what comparing every pair
    on every column marks."""
    from autopar.search.prune import _dominated

    rng = np.random.default_rng(seed)
    k, cols = int(rng.integers(20, 90)), int(rng.integers(40, 200))
    dom = rng.integers(0, 3, (k, cols)).astype(np.int64)
    dom[rng.integers(0, k, k // 3)] = dom[0]  # equal strategies: the first of them stays
    sub = dom + (rng.random((k, cols)) < 0.2)  # the dominated side's pairs may weigh more (forbidden pairs)
    ge = (dom[:, None, :] <= sub[None, :, :]).all(axis=2)
    np.fill_diagonal(ge, False)
    strict = ge & (~ge.T | np.tri(k, k, -1, dtype=bool).T)
    assert (_dominated(dom, sub) == strict.any(axis=0)).all()


def test_dominance_pruning_past_its_deadline_keeps_what_is_left() -> None:
    """Pruning stopped by a spent deadline removes nothing more: the search over what is left is still exact."""
    problem = _with_copies(random_problem(2100, 6, 3, edge_prob=0.3, cap_quantile=None, inf_prob=0.1), 7)
    allowed = problem.allowed_choices()
    stopped = prune_dominated(problem, allowed, deadline=Deadline.after(1e-9))
    assert [a.tolist() for a in stopped] == [a.tolist() for a in allowed]
    assert sum(a.size for a in prune_dominated(problem, allowed)) < sum(a.size for a in allowed)
