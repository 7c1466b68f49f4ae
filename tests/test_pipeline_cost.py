"""Pipeline schedules (``autopar.cost.pipeline``): the closed forms the planner will price with must equal the
list schedule of the orders ``torch.distributed.pipelining`` runs, and the activations held must be what those
orders hold."""

from __future__ import annotations

import random

import pytest

from autopar.cost.pipeline import SCHEDULES, bubble_fraction, in_flight, rank_orders, step_time

PLAIN = [(s, p, m) for s in ("gpipe", "1f1b") for p in range(1, 6) for m in range(1, 10)]
INTERLEAVED = [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p)]


@pytest.mark.parametrize("schedule,p,m", PLAIN)
def test_equal_stages_take_m_plus_p_minus_one_slots(schedule, p, m):
    f, b = 1.0, 2.0
    assert step_time(schedule, [f] * p, [b] * p, m) == pytest.approx((m + p - 1) * (f + b))
    assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,v,m", INTERLEAVED)
def test_interleaving_divides_the_bubble_by_the_virtual_stages(p, v, m):
    f, b = 0.5, 1.0  # per virtual stage: 1/v of a rank's layers
    took = step_time("interleaved", [f] * (p * v), [b] * (p * v), m, v=v)
    assert took == pytest.approx((m * v + p - 1) * (f + b))
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx((p - 1) / (m * v + p - 1))


def _held(order) -> int:
    """The most forwards a rank has run whose backward it has not."""
    held = most = 0
    for act in order:
        held += 1 if act.kind == "F" else -1
        most = max(most, held)
    return most


@pytest.mark.parametrize("schedule,p,m", PLAIN)
def test_activations_held_follow_the_schedule(schedule, p, m):
    orders = rank_orders(schedule, p, m)
    for r, order in enumerate(orders):
        assert _held(order) == in_flight(schedule, p, m, r)
        want = m if schedule == "gpipe" else min(m, p - r)
        assert in_flight(schedule, p, m, r) == want


@pytest.mark.parametrize("p,v,m", INTERLEAVED)
def test_interleaved_orders_hold_megatrons_warmup_plus_one(p, v, m):
    for r, order in enumerate(rank_orders("interleaved", p, m, v)):
        assert _held(order) == in_flight("interleaved", p, m, r, v) == min((p - r - 1) * 2 + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_runs_each_of_its_actions_once(schedule):
    p, v, m = (3, 2, 6) if schedule == "interleaved" else (3, 1, 5)
    orders = rank_orders(schedule, p, m, v)
    for r, order in enumerate(orders):
        stages = [j for j in range(p * v) if j % p == r]
        assert sorted(order) == sorted(type(order[0])(kind, j, i) for kind in "FB" for j in stages for i in range(m))


def test_gpipe_with_unequal_stages_is_the_flow_shop_form():
    """All forwards then all backwards: each phase is a flow shop of identical jobs, so
    T = sum_j (f_j + b_j) + (m - 1) (max_j f_j + max_j b_j)."""
    rng = random.Random(31)
    for _ in range(50):
        p, m = rng.randint(1, 6), rng.randint(1, 9)
        f = [rng.uniform(0.5, 2.0) for _ in range(p)]
        b = [rng.uniform(1.0, 4.0) for _ in range(p)]
        want = sum(f) + sum(b) + (m - 1) * (max(f) + max(b))
        assert step_time("gpipe", f, b, m) == pytest.approx(want)


def test_one_f_one_b_is_never_slower_than_gpipe_and_transfers_add_per_hop():
    rng = random.Random(7)
    for _ in range(50):
        p, m = rng.randint(2, 6), rng.randint(1, 9)
        f = [rng.uniform(0.5, 2.0) for _ in range(p)]
        b = [rng.uniform(1.0, 4.0) for _ in range(p)]
        assert step_time("1f1b", f, b, m) <= step_time("gpipe", f, b, m) + 1e-9
    # equal stages, one micro-batch: the forward and backward each cross p - 1 links
    assert step_time("1f1b", [1.0] * 4, [2.0] * 4, 1, transfer_s=0.25) == pytest.approx(4 * 3.0 + 2 * 3 * 0.25)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: rank_orders("zero-bubble", 2, 4), "expected one of gpipe, 1f1b, interleaved"),
        (lambda: rank_orders("interleaved", 4, 6, 2), "m=6 is not a multiple"),
        (lambda: rank_orders("1f1b", 4, 8, 2), "runs one stage per rank"),
        (lambda: rank_orders("gpipe", 0, 8), "p=0"),
        (lambda: step_time("1f1b", [1.0, 1.0], [1.0], 2), "one forward and one backward time per stage"),
    ],
)
def test_bad_schedules_say_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()
