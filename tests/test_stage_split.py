"""The pipeline stage split (``search/stages.py``) against brute force, and its step formula against the schedules.

Issue 31's planning terms: the split is exact for its objective (the least step over every contiguous split that
fits the cap), its step formula is the GPipe list schedule's exactly and bounds 1F1B's from above, and 1F1B's
memory rule (the first stages hold more micro-batches) gives the first stages fewer layers where the cap binds.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopar.cost.pipeline import in_flight, step_time
from autopar.search.stages import StageCosts, split_stages, step_of_split


def _random_layers(rng: np.random.Generator, n: int) -> StageCosts:
    forward = rng.uniform(0.5, 3.0, n)
    return StageCosts(
        tuple(forward.tolist()),
        tuple((forward * rng.uniform(1.5, 2.5, n)).tolist()),  # backward about twice forward, not exactly
        tuple(int(x) for x in rng.integers(10, 100, n)),
        tuple(int(x) for x in rng.integers(1, 30, n)),
    )


def _one(rng: np.random.Generator) -> StageCosts:
    return _random_layers(rng, 1)


def _splits(n: int, p: int):
    """Every split of n layers into p non-empty contiguous runs, as bounds."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        yield (0, *cuts, n)


@pytest.mark.parametrize("seed", range(40))
def test_the_split_is_the_best_of_every_split_that_fits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    p = int(rng.integers(1, min(4, n) + 1))
    m = int(rng.integers(1, 7))
    schedule = str(rng.choice(["gpipe", "1f1b"]))
    layers, ends = _random_layers(rng, n), (_one(rng), _one(rng))
    held = [in_flight(schedule, p, m, j) for j in range(p)]
    every = [step_of_split(layers, b, held, m, ends) for b in _splits(n, p)]
    fullest = sorted(max(s.memory_bytes) for s in every)
    cap = None if seed % 5 == 0 else int(fullest[int(rng.integers(0, len(fullest)))] + int(rng.integers(-5, 5)))
    fitting = [s for s in every if cap is None or max(s.memory_bytes) <= cap]
    if not fitting:
        with pytest.raises(ValueError, match=f"needs on its fullest stage is {fullest[0]} bytes"):
            split_stages(layers, held, m, cap, ends)
        return
    got = split_stages(layers, held, m, cap, ends)
    best = min(s.step_s for s in fitting)
    assert math.isclose(got.step_s, best, rel_tol=1e-12), (seed, got, best)
    assert cap is None or max(got.memory_bytes) <= cap
    assert got == step_of_split(layers, got.bounds, held, m, ends)  # what it reports is its split's


@pytest.mark.parametrize("seed", range(20))
def test_the_step_formula_is_gpipes_schedule_and_bounds_1f1b(seed: int) -> None:
    """``T = sum_j (F_j + B_j) + (m - 1) (max F + max B)``: the GPipe list schedule's makespan exactly (a flow
    shop of identical micro-batches, forward then backward), and never below 1F1B's."""
    rng = np.random.default_rng(100 + seed)
    n, m = int(rng.integers(2, 9)), int(rng.integers(1, 9))
    p = int(rng.integers(1, min(5, n) + 1))
    layers = _random_layers(rng, n)
    bounds = next(itertools.islice(_splits(n, p), int(rng.integers(0, math.comb(n - 1, p - 1))), None))
    split = step_of_split(layers, bounds, [m] * p, m)
    gpipe = step_time("gpipe", list(split.forward_s), list(split.backward_s), m)
    one_f_one_b = step_time("1f1b", list(split.forward_s), list(split.backward_s), m)
    assert math.isclose(split.step_s, gpipe, rel_tol=1e-12)
    assert one_f_one_b <= split.step_s * (1 + 1e-12)


def test_1f1b_memory_gives_the_first_stages_fewer_layers() -> None:
    """Eight equal layers on four 1F1B stages with m = 8: stage j holds min(8, 4 - j) micro-batches, so under a cap
    the even split (2 layers each) misses on stage 0; the split found moves layers to the later stages, and the
    step is the least among the splits that fit (the slowest stage sets it)."""
    layers = StageCosts((1.0,) * 8, (2.0,) * 8, (10,) * 8, (10,) * 8)
    held = [in_flight("1f1b", 4, 8, j) for j in range(4)]
    assert held == [4, 3, 2, 1]
    even = step_of_split(layers, (0, 2, 4, 6, 8), held, 8)
    assert even.memory_bytes == (100, 80, 60, 40)
    got = split_stages(layers, held, 8, cap_bytes=90)
    sizes = [b - a for a, b in zip(got.bounds, got.bounds[1:])]
    assert sizes[0] < 2 and sum(sizes) == 8 and max(got.memory_bytes) <= 90, got
    assert got.step_s > even.step_s  # the cap costs time: the slowest stage has more layers than 2
    free = split_stages(layers, held, 8)
    assert free.bounds == (0, 2, 4, 6, 8) and free.step_s == even.step_s


def test_more_stages_than_layers_is_a_clear_error() -> None:
    layers = StageCosts((1.0,) * 3, (2.0,) * 3, (1,) * 3, (1,) * 3)
    with pytest.raises(ValueError, match="4 pipeline stages for 3 layers: each stage needs at least one layer"):
        split_stages(layers, [1, 1, 1, 1], 4)
