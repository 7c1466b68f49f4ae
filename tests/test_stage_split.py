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
from autopar.search.stages import EndOfStep, SharedState, StageCosts, split_stages, step_of_split


def _random_layers(rng: np.random.Generator, n: int) -> StageCosts:
    forward = rng.uniform(0.5, 3.0, n)
    moments = [tuple(int(x) for x in rng.integers(0, 40, n)) for _ in range(3)] if rng.random() < 0.5 else []
    return StageCosts(
        tuple(forward.tolist()),
        tuple((forward * rng.uniform(1.5, 2.5, n)).tolist()),  # backward about twice forward, not exactly
        tuple(int(x) for x in rng.integers(10, 100, n)),
        tuple(int(x) for x in rng.integers(1, 30, n)),
        *moments,
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
    end = EndOfStep(int(rng.integers(0, 30)), int(rng.integers(0, 3)))
    held = [in_flight(schedule, p, m, j) for j in range(p)]
    every = [step_of_split(layers, b, held, m, ends, end=end) for b in _splits(n, p)]
    for split in every:  # each stage's memory is the module docstring's M_j, summed here by hand
        assert list(split.memory_bytes) == [_stage_bytes(layers, ends, end, held, split.bounds, j) for j in range(p)]
    fullest = sorted(max(s.memory_bytes) for s in every)
    cap = None if seed % 5 == 0 else int(fullest[int(rng.integers(0, len(fullest)))] + int(rng.integers(-5, 5)))
    fitting = [s for s in every if cap is None or max(s.memory_bytes) <= cap]
    if not fitting:
        with pytest.raises(ValueError, match=f"needs on its fullest stage is {fullest[0]} bytes"):
            split_stages(layers, held, m, cap, ends, end=end)
        return
    got = split_stages(layers, held, m, cap, ends, end=end)
    best = min(s.step_s for s in fitting)
    assert math.isclose(got.step_s, best, rel_tol=1e-12), (seed, got, best)
    assert cap is None or max(got.memory_bytes) <= cap
    assert got == step_of_split(layers, got.bounds, held, m, ends, end=end)  # what it reports is its split's


def _stage_bytes(layers: StageCosts, ends, end: EndOfStep, held: list[int], bounds, j: int) -> int:
    """``M_j = S_j + max(h_j A_j + W_j, E_j)``, ``E_j = max(min(G_j, max(b, g_j)), t g_j)``, over stage j's layers
    and its ends, written out."""
    p = len(bounds) - 1
    rows = [(layers, k) for k in range(bounds[j], bounds[j + 1])]
    rows += [(ends[0], 0)] * (j == 0) + [(ends[1], 0)] * (j == p - 1)

    def values(name):
        return [getattr(c, name)[k] if getattr(c, name) else 0 for c, k in rows]

    state, acts = sum(values("state_bytes")), sum(values("act_bytes"))
    work, flat, largest = max(values("work_bytes")), sum(values("flat_bytes")), max(values("largest_grad_bytes"))
    bucket = min(flat, max(end.bucket_bytes, largest)) if end.bucket_bytes else 0  # 0: no buckets
    at_end = max(bucket, end.temporaries * largest)
    return state + max(held[j] * acts + work, at_end)


def test_a_stage_holds_its_working_set_or_the_steps_last_bucket() -> None:
    """Two layers on two 1F1B stages (2 and 1 micro-batches in flight), state 16 and activations 10 each: a backward
    working set of 7 on layer 0 adds to stage 0's 2 x 10 (16 + 27 = 43); where the activations are small (1 each),
    the end of the step sets the peak: stage 0's bucketed gradients 12 in buckets of 5 copy at most 5 (16 + 5 =
    21); stage 1's 4 copy whole, or the optimizer's 2 temporaries on its largest gradient 2 (16 + 4 = 20)."""
    big = StageCosts((1.0, 1.0), (2.0, 2.0), (16, 16), (10, 10), (7, 3), (4, 4), (3, 2))
    assert step_of_split(big, (0, 1, 2), [2, 1], 2, end=EndOfStep(5, 2)).memory_bytes == (43, 29)
    small = StageCosts((1.0, 1.0), (2.0, 2.0), (16, 16), (1, 1), (0, 0), (12, 4), (3, 2))
    assert step_of_split(small, (0, 1, 2), [2, 1], 2, end=EndOfStep(5, 1)).memory_bytes == (21, 20)
    assert step_of_split(small, (0, 1, 2), [2, 1], 2, end=EndOfStep(5, 2)).memory_bytes == (22, 20)  # 2 x 3 > 5
    assert step_of_split(small, (0, 1, 2), [2, 1], 2).memory_bytes == (18, 17)  # no end given: the additive bound


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


def test_a_weight_two_positions_read_is_held_once_by_a_stage_that_runs_both() -> None:
    """A tied embedding of 8 state bytes (4 of them its gradient, all bucketed) read by the prelude and by layer 1,
    in both positions' figures: the stage that runs both holds it once.  Three layers of state 10, activations 1,
    ends of state 8 (the prelude: the embedding) and 0: split (0, 2, 3) puts both readers on stage 0 (8 + 20 - 8 +
    1 x 2 = 22 with 1 micro-batch in flight), split (0, 1, 3) one on each (8 + 10 + 1, and 20 + 1 + 0 copies)."""
    layers = StageCosts((1.0,) * 3, (2.0,) * 3, (10, 10, 10), (1, 1, 1))
    ends = (StageCosts((0.0,), (0.0,), (8,), (0,)), StageCosts((0.0,), (0.0,), (0,), (0,)))
    tied = SharedState(8, 4, 4, 0.0, layers=(1,), prelude=True)
    assert step_of_split(layers, (0, 2, 3), [1, 1], 1, ends, shared=[tied]).memory_bytes == (22, 11)
    assert step_of_split(layers, (0, 1, 3), [1, 1], 1, ends, shared=[tied]).memory_bytes == (19, 22)
    assert step_of_split(layers, (0, 2, 3), [1, 1], 1, ends).memory_bytes == (30, 11)  # not said: counted twice
    assert tied.copies(0, 3, True, True) == 1 and tied.copies(2, 3, False, True) == 0


def _one_run(layers, ends, held, end, shared, j: int, i: int, k: int) -> tuple[float, float, int]:
    """(F, B, M) of stage ``j`` of ``len(held)`` on layers ``[i, k)`` by the module docstring's formulas, summed
    layer by layer: the referee of the prices ``_StageGrids`` takes from prefix sums."""
    p, run = len(held), range(i, k)
    f, b = sum(layers.forward_s[x] for x in run), sum(layers.backward_s[x] for x in run)
    s, a = sum(layers.state_bytes[x] for x in run), sum(layers.act_bytes[x] for x in run)
    work, flat = max(layers.at("work_bytes", x) for x in run), sum(layers.at("flat_bytes", x) for x in run)
    largest = max(layers.at("largest_grad_bytes", x) for x in run)
    for one, here in ((ends[0], j == 0), (ends[1], j == p - 1)):
        if here:
            f, b, s, a = f + one.forward_s[0], b + one.backward_s[0], s + one.state_bytes[0], a + one.act_bytes[0]
            work, flat = max(work, one.at("work_bytes", 0)), flat + one.at("flat_bytes", 0)
            largest = max(largest, one.at("largest_grad_bytes", 0))
    for one in shared:  # held once on the stage however many of its positions read it
        extra = one.copies(i, k, j == 0, j == p - 1)
        s, flat = s - extra * one.state_bytes, flat - extra * one.flat_bytes
    return f, b, s + max(held[j] * a + work, end.bytes(flat, largest))


@pytest.mark.parametrize("seed", range(12))
def test_every_runs_prices_at_once_are_the_one_run_prices(seed: int) -> None:
    """The split prices every stage over every run at once (``_StageGrids``, array operations from prefix sums):
    the module docstring's ``F``, ``B`` and ``M_j`` of each run summed layer by layer (with ends, the step's end
    and parameters read in several positions), byte for byte and to float rounding; ``step_of_split`` reports one
    split's runs from the same arrays; and a cap no split fits names the least fullest stage of every split,
    brute force."""
    from autopar.search.stages import _Pipeline, _Prefix, _StageGrids

    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 9))
    p = int(rng.integers(1, min(4, n) + 1))
    layers, ends = _random_layers(rng, n), (_one(rng), _one(rng))
    end = EndOfStep(int(rng.integers(0, 30)), int(rng.integers(0, 3)))
    shared = [
        SharedState(
            int(rng.integers(1, 20)), 2, int(rng.integers(0, 5)), 0.0,
            layers=tuple(sorted(set(rng.integers(0, n, 2).tolist()))), prelude=bool(rng.random() < 0.5),
            postlude=bool(rng.random() < 0.5),
        )
        for _ in range(int(rng.integers(0, 3)))
    ]  # fmt: skip
    held = [in_flight("1f1b", p, 4, j) for j in range(p)]
    pipe = _Pipeline(_Prefix(layers), *ends, tuple(held), (), end, tuple(shared))
    grids = _StageGrids(pipe, n)
    for j in range(p):
        f, b, mem = grids.stage(j)
        for i in range(n):
            for k in range(i + 1, n + 1):
                want_f, want_b, want_mem = _one_run(layers, ends, held, end, shared, j, i, k)
                assert mem[i, k].item() == want_mem
                assert (f[i, k].item(), b[i, k].item()) == pytest.approx((want_f, want_b), rel=1e-12, abs=1e-15)
    every = [step_of_split(layers, bounds, held, 4, ends, end=end, shared=shared) for bounds in _splits(n, p)]
    least = min(max(s.memory_bytes) for s in every)
    with pytest.raises(ValueError, match=f"needs on its fullest stage is {least} bytes"):
        split_stages(layers, held, 4, least - 1, ends, end=end, shared=shared)
