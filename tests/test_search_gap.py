"""The chained search stopped within a gap (the planner's ``PLAN_GAP``, and larger gaps that make every pass merge
pairs) against the exact search and brute force: a real plan that fits, within the gap of the optimum, with a
lower bound that does not pass it; and the time budget returning a real plan with the bound it proved."""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from chain_cases import mixed, variant
from search_problems import chain_problem

from autopar.planner.solving import PLAN_GAP, PROBE_GAP, PeakLoop, Probe, SearchRun
from autopar.search import Deadline, InfeasibleError, Start, min_memory, solve_dp
from autopar.search.chain import solve_chain
from autopar.search.problem import SearchProblem, Solution

GAPS = (PLAN_GAP, 2.0**-7, 2.0**-4)


def _case(seed: int) -> tuple[SearchProblem, list[list[int]]]:
    """The random chains of the exactness tests (tests/test_scale.py), a few deeper ones among them."""
    rng = np.random.default_rng(seed)
    if seed >= 100:
        return chain_problem(seed, int(rng.choice([9, 13, 24, 40])), 2, 3, float(rng.choice([0.02, 0.1, 0.3])))
    return chain_problem(
        seed, int(rng.integers(3, 7)), int(rng.integers(2, 5)), int(rng.integers(2, 4)), float(rng.choice([0.05, 0.3]))
    )


@functools.cache
def _feasible_cases() -> tuple[tuple[int, SearchProblem, list[list[int]], Solution], ...]:
    """(seed, problem, blocks, exact optimum) of every random chain of :func:`_case` that has a plan."""
    out = []
    for seed in [*range(40), *range(100, 108)]:
        problem, blocks = _case(seed)
        try:
            out.append((seed, problem, blocks, solve_chain(problem, blocks)))
        except InfeasibleError:
            continue
    return tuple(out)


def _check_within(problem: SearchProblem, got: Solution, exact_time: int, rel_gap: float, where: str) -> None:
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes), where
    assert problem.forbidden_in(got.choice) == [], where
    assert got.mem_bytes <= problem.mem_cap_bytes, where
    assert got.time_lower_bound <= exact_time <= got.time, where
    assert got.time - got.time_lower_bound <= rel_gap * got.time, where


@pytest.mark.parametrize("rel_gap", GAPS)
def test_gapped_chain_is_within_its_gap_of_the_exact_optimum(rel_gap: float) -> None:
    """On the exactness tests' random chains: within the gap of the exact optimum, and the merging passes
    (which spend part of the gap) really ran."""
    merged = 0
    for seed, problem, blocks, exact in _feasible_cases():
        got = solve_chain(problem, blocks, rel_gap=rel_gap)
        _check_within(problem, got, exact.time, rel_gap, f"seed {seed}, gap {rel_gap}")
        merged += got.stats.get("merge_error", 0) > 0
    if rel_gap > PLAN_GAP:
        assert merged >= 3  # passes did merge pairs (else the merging path is untested here)


def test_a_search_seeded_with_a_coarser_one_ends_as_the_unseeded_one() -> None:
    """The peak loop's plan is searched again at PLAN_GAP from its coarse probe (``seed``): the same guarantee as
    a search from scratch (within the gap of the exact optimum; exact at gap 0), starting from the probe's plan
    and proven bound, and never worse than the probe's plan."""
    seeded = 0
    for seed, problem, blocks, exact in _feasible_cases():
        coarse = solve_chain(problem, blocks, rel_gap=2.0**-4)
        for rel_gap in (0.0, PLAN_GAP):
            got = solve_chain(problem, blocks, rel_gap=rel_gap, start=Start(seed=coarse))
            _check_within(problem, got, exact.time, max(rel_gap, 1e-12), f"seed {seed}, gap {rel_gap}, seeded")
            assert got.time <= coarse.time and got.time_lower_bound >= coarse.time_lower_bound
            if rel_gap == 0.0:
                assert (got.time, got.mem_bytes) == (exact.time, exact.mem_bytes), f"seed {seed}"
        seeded += coarse.time > exact.time  # the seed was not the optimum: the passes improved on it
    assert seeded >= 3


def _variants(problem: SearchProblem, blocks: list[list[int]], seed: int) -> tuple[SearchProblem, ...]:
    """Two more variants of every block: the block recomputed (time up, memory down), twice as strongly."""
    once = variant(problem, blocks, seed)
    return once, variant(once, blocks, seed + 50)


@pytest.mark.parametrize("seed", range(20))
def test_chain_with_three_variants_per_layer_against_brute_force(seed: int) -> None:
    """20 random chains whose every block picks one of three variants: the exact chain equals the best flat
    optimum over all 3^blocks assignments, and the gapped chains are within their gaps of it."""
    rng = np.random.default_rng(seed)
    problem, blocks = chain_problem(seed, n_blocks=int(rng.integers(3, 5)), block_nodes=3, max_k=3, cap_quantile=None)
    others = _variants(problem, blocks, seed)
    options = (problem, *others)
    least = min(min_memory(p).mem_bytes for p in options)
    cap = int(least + float(rng.choice([0.1, 0.3, 0.6])) * (solve_dp(problem).mem_bytes - least))
    best = None
    for picks in itertools.product(range(3), repeat=len(blocks)):
        flat = _pick(options, blocks, picks).with_cap(cap)
        try:
            sol = solve_dp(flat)
        except InfeasibleError:
            continue
        if best is None or (sol.time, sol.mem_bytes) < best[:2]:
            best = (sol.time, sol.mem_bytes, picks)
    capped = problem.with_cap(cap)
    variants = tuple(p.with_cap(cap) for p in others)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_chain(capped, blocks, variants=variants)
        return
    exact = solve_chain(capped, blocks, variants=variants)
    assert (exact.time, exact.mem_bytes) == best[:2], f"seed {seed}: chain {exact.stats['block_variants']}, {best}"
    for rel_gap in GAPS:
        got = solve_chain(capped, blocks, variants=variants, rel_gap=rel_gap)
        picked = _pick(options, blocks, got.stats["block_variants"]).with_cap(cap)
        _check_within(picked, got, best[0], rel_gap, f"seed {seed}, gap {rel_gap}")


def _pick(options: tuple[SearchProblem, ...], blocks: list[list[int]], picks) -> SearchProblem:
    """The flat problem whose block i takes ``options[picks[i]]``'s terms (the rest: ``options[0]``'s)."""
    out = options[0]
    for j, option in enumerate(options[1:], start=1):
        out = mixed(out, option, blocks, [p == j for p in picks])
    return out


def test_a_search_past_its_budget_returns_a_real_plan_with_its_proven_bound() -> None:
    """A deadline that has passed: the chain returns a plan it holds (under the cap, re-evaluated) with a lower
    bound at most the exact optimum, and says the budget stopped it."""
    problem, blocks = chain_problem(104, 24, 2, 3, 0.1)
    exact = solve_chain(problem, blocks)
    spent = Deadline.after(1e-9)
    got = solve_chain(problem, blocks, rel_gap=PLAN_GAP, deadline=spent)
    assert got.stats["budget_hit"]
    assert problem.evaluate(got.choice) == (got.time, got.mem_bytes)
    assert got.mem_bytes <= problem.mem_cap_bytes
    assert got.time_lower_bound <= exact.time <= got.time
    flat = solve_dp(problem, rel_gap=PLAN_GAP, deadline=spent)
    assert flat.time_lower_bound <= exact.time <= flat.time and flat.mem_bytes <= problem.mem_cap_bytes


def test_deadline_rejects_a_budget_that_is_not_positive() -> None:
    assert Deadline.after(None) is None
    with pytest.raises(ValueError, match="search_budget_s: expected a positive number of seconds"):
        Deadline.after(0)


def test_a_stopped_search_mixes_the_layers_of_its_hull_plans() -> None:
    """Past the deadline a chain whose every layer may recompute (a second variant: slower, less memory) has only
    its Lagrange plans, each choosing alike in every layer; it returns the plan under the cap with the last layers
    of a faster plan over it laid on (``search.mixing``): a real plan (re-evaluated with the variants it names),
    under the cap, no faster than the exact optimum, on most chains faster than every plan it met, with layers of
    both variants, and closing most of the distance from the best plan met to the optimum (86% on these chains,
    2026-11-28)."""
    mixes, before, after = 0, 0, 0
    for seed in range(12):
        problem, blocks = chain_problem(seed, n_blocks=16, block_nodes=3, max_k=2, cap_quantile=None)
        recomputed = variant(problem, blocks, seed)
        options = (problem, recomputed)
        least = min_memory(_pick(options, blocks, [1] * len(blocks))).mem_bytes
        cap = least + (solve_dp(problem).mem_bytes - least) // 2
        capped, variants = problem.with_cap(cap), (recomputed.with_cap(cap),)
        try:
            exact = solve_chain(capped, blocks, variants=variants)
        except InfeasibleError:
            continue
        got = solve_chain(capped, blocks, variants=variants, rel_gap=PLAN_GAP, deadline=Deadline.after(1e-9))
        picks = got.stats["block_variants"]
        flat = _pick(options, blocks, picks).with_cap(cap)
        assert flat.evaluate(got.choice) == (got.time, got.mem_bytes), f"seed {seed}"
        assert got.mem_bytes <= cap and exact.time <= got.time, f"seed {seed}"
        met = got.stats.get("mixed_from", got.time)
        assert got.time <= met, f"seed {seed}"
        mixes += got.time < met and 0 < sum(picks[1:]) < len(picks) - 1
        before, after = before + met - exact.time, after + got.time - exact.time
    assert mixes >= 8 and after <= 0.25 * before, (mixes, after, before)


class _Space:
    """A stand-in ``SearchSpace`` for ``PeakLoop``: a search under bound b returns the plan of the least time whose
    searched memory is within b, from ``plans`` ((time, searched memory, step peak) each), stopped at the gap asked
    (its proven bound ``time (1 - gap)``, rounded up); ``searches`` records each search's (bound, gap)."""

    ctx = SimpleNamespace(blocks=[[0]])
    options = SimpleNamespace(solver="dp")
    above = None

    def __init__(self, plans: list[tuple[int, int, int]], run: SearchRun | None = None) -> None:
        self.plans, self.searches, self.peaks = plans, [], {}
        self.run = run or SearchRun()

    def search(self, bound, gap, seed=None, at_cap=True):
        self.searches.append((bound, gap))
        time, mem, peak = min(p for p in self.plans if bound is None or p[1] <= bound)
        gap = PLAN_GAP if gap is None else gap
        sol = Solution((len(self.searches),), time, mem, False, "dp", 0.0, {"lower_bound": time - int(time * gap)})
        self.peaks[sol.choice] = peak
        return Probe(sol, list(sol.choice))

    def peak_of(self, probe: Probe) -> int:
        return self.peaks[tuple(probe.choice)]


def test_the_peak_loop_refines_a_plan_found_at_the_cap_and_keeps_a_bisected_ones_probe() -> None:
    """``PeakLoop``: where the first plan (at the cap) fits, it is searched again at ``PLAN_GAP`` (its proven gap
    closes to it); where its peak is over the cap, the loop tightens the bound until a plan fits, and that plan,
    a tightened bound's optimum known to the loop's tolerance only, keeps its probe's gap (no search at
    ``PLAN_GAP``); and where the caller keeps probes (``SearchRun.refine`` False: the stage fitting's walk), the
    first plan keeps its probe's gap too."""
    cap = 1000
    t = 10**9  # picoseconds: 1 ms
    fits_first = _Space([(t, 900, 950), (2 * t, 500, 600)])
    got = PeakLoop(fits_first, cap, None).run()
    assert [g for _, g in fits_first.searches] == [PROBE_GAP, None] and got.sol.time == t
    assert got.sol.time - got.sol.time_lower_bound <= got.sol.time * PLAN_GAP
    bisected = _Space([(t, 900, 1100), (2 * t, 500, 600)])  # the fastest plan's peak is over the cap
    got = PeakLoop(bisected, cap, None).run()
    assert got.sol.time == 2 * t and all(g == PROBE_GAP for _, g in bisected.searches) and len(bisected.searches) >= 2
    assert got.sol.time - got.sol.time_lower_bound == pytest.approx(2 * t * PROBE_GAP, abs=1)
    probing = _Space([(t, 900, 950), (2 * t, 500, 600)], SearchRun(refine=False))  # a caller that bisects itself
    got = PeakLoop(probing, cap, None).run()
    assert [g for _, g in probing.searches] == [PROBE_GAP] and got.sol.time == t
    assert got.sol.time - got.sol.time_lower_bound == pytest.approx(t * PROBE_GAP, abs=1)
