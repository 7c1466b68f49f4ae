"""Pipeline schedules (``autopar.cost.pipeline``): the closed forms the planner will price with must equal the
list schedule of the orders ``torch.distributed.pipelining`` runs, and the activations held must be what those
orders hold."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autopar.cost.pipeline import (
    SCHEDULES,
    Transfer,
    bubble_fraction,
    in_flight,
    least_schedule_time,
    rank_orders,
    schedule_run,
    step_time,
)
from costmodel import CoreLending, load_profile

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


def test_no_split_of_the_work_runs_faster_than_the_least_schedule_time():
    """``least_schedule_time``: over random unequal stages, the list schedule of every schedule (sped up by at most
    ``s`` while ranks idle: at least the bound over ``s``) and the flow shop's formula are at least the bound of their
    kind; equal stages meet the flow shop's; the split that makes ``m t_r + sum_(i<r) t_i`` the same ``T`` for every
    rank sums to the work whose bound is ``T`` (the closed form's derivation); and the bound is above the busiest
    rank's share wherever ``p, m > 1``."""
    rng = random.Random(5)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 9)
        f = [rng.uniform(0.1, 2.0) for _ in range(p)]
        b = [2 * x * rng.uniform(0.5, 1.5) for x in f]
        work = sum(f) + sum(b)
        for schedule in ("gpipe", "1f1b"):
            if schedule == "1f1b" and m < p:
                continue
            assert step_time(schedule, f, b, m) >= least_schedule_time(work, p, m) * (1 - 1e-12)
            lent = schedule_run(schedule, f, b, m, speed=lambda k, w, p=p: 1 + (p - k) / max(p, 1))
            assert lent.step_s >= least_schedule_time(work, p, m) / 2 * (1 - 1e-12)
        formula = work + (m - 1) * (max(f) + max(b))
        assert formula >= least_schedule_time(work, p, m, flow_shop=True) * (1 - 1e-12)
        if p > 1 and m > 1:
            assert least_schedule_time(work, p, m) > m * work / p
    for p, v, m in INTERLEAVED:
        f = [rng.uniform(0.1, 2.0) for _ in range(p * v)]
        b = [2 * x for x in f]
        assert step_time("interleaved", f, b, m, v=v) >= least_schedule_time(sum(f) + sum(b), p, m, v) * (1 - 1e-12)
    # equal stages: the flow shop's bound is its step
    assert least_schedule_time(12.0, 4, 8, flow_shop=True) == pytest.approx(step_time("1f1b", [1.0] * 4, [2.0] * 4, 8))
    # the equalizing split meets the list schedule's bound (GPipe: each rank's m t_r after the stages before it)
    p, m, T = 3, 4, 10.0
    t, done = [], 0.0
    for _ in range(p):
        t.append((T - done) / m)
        done += t[-1]
    bound = least_schedule_time(done, p, m)
    assert bound == pytest.approx(T)
    assert step_time("gpipe", [x / 3 for x in t], [2 * x / 3 for x in t], m) >= bound * (1 - 1e-12)


def test_no_interleaved_split_whose_stages_each_take_at_least_c_beats_the_bound_with_c():
    """``least_schedule_time``'s interleaved bound with ``stage_least_s = c``: over random stages each of at least
    ``c`` (the first chunk's at exactly ``c``, the worst case the bound assumes, or random), the list schedule, sped
    up or not while ranks idle, is at least ``m W / p + c (p - 1) / 2`` (over the speed-up); and the bound is tight
    to within the first chunk: stages equal at ``c`` reach ``m W / p + (p - 1) c`` at most."""
    rng = random.Random(11)
    for p, v, m in INTERLEAVED + [(8, 2, 8), (8, 4, 16), (6, 2, 12)]:
        for skewed in (False, True):
            c = rng.uniform(0.5, 1.5)
            t = [c if skewed and j < p else c + rng.uniform(0.0, 3.0) for j in range(p * v)]
            f = [x / 3 for x in t]
            b = [2 * x / 3 for x in t]
            bound = least_schedule_time(sum(t), p, m, v, stage_least_s=c)
            assert bound >= m * sum(t) / p + c * (p - 1) / 2 * (1 - 1e-12)
            assert step_time("interleaved", f, b, m, v=v) >= bound * (1 - 1e-12)
            lent = schedule_run("interleaved", f, b, m, v=v, speed=lambda k, w, p=p: 1 + (p - k) / max(p, 1))
            assert lent.step_s >= bound / 2 * (1 - 1e-12)
        equal = [c] * (p * v)
        step = step_time("interleaved", [x / 3 for x in equal], [2 * x / 3 for x in equal], m, v=v)
        assert step <= m * sum(equal) / p + (p - 1) * c * (1 + 1e-12)


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


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_simulation_at_full_speed_is_the_list_schedule(schedule):
    """``schedule_run`` with a speed of 1 everywhere (ranks that do not share cores) steps as the list schedule,
    and each rank computes its stages' forwards and backwards, no more."""
    rng = random.Random(5)
    for _ in range(20):
        p, v = rng.randint(2, 4), (2 if schedule == "interleaved" else 1)
        m = p * rng.randint(1, 3)
        f = [rng.uniform(0.5, 2.0) for _ in range(p * v)]
        b = [rng.uniform(1.0, 4.0) for _ in range(p * v)]
        run = schedule_run(schedule, f, b, m, v=v, transfer=Transfer(0.1), speed=lambda k, w: 1.0)
        assert run.step_s == pytest.approx(step_time(schedule, f, b, m, v=v, transfer_s=0.1))
        want_busy = [m * sum(f[j] + b[j] for j in range(r, p * v, p)) for r in range(p)]
        assert run.busy_s == pytest.approx(want_busy)


def test_a_receive_posted_when_the_rank_is_free_delays_it_by_the_whole_transfer():
    """Two stages, two micro-batches, GPipe, forward = backward = 1 s, each transfer 0.5 s.  Sent as soon as the
    sender finishes (a host running ahead posted the receive long before), stage 1's second forward starts as
    its first ends (the value came at 2.5 s): F(1,*) on [1.5, 2.5], [2.5, 3.5], B(1,*) to 5.5, B(0,*) on
    [5, 6], [6, 7]: 7 s.  With the receive posted only once the receiver is free (``Transfer.when_receiver_free``: CPU
    ranks), the second value starts moving at 2.5 s: F(1,1) on [3, 4], B(1,*) to 6, B(0,0) on [5.5, 6.5] and
    B(0,1) waits for its gradient until 7: 8 s.  Without transfers the two agree."""
    f, b = [1.0, 1.0], [1.0, 1.0]
    late = Transfer(0.5, when_receiver_free=True)
    assert schedule_run("gpipe", f, b, 2, transfer=Transfer(0.5)).step_s == pytest.approx(7.0)
    assert schedule_run("gpipe", f, b, 2, transfer=late).step_s == pytest.approx(8.0)
    for schedule in ("gpipe", "1f1b"):
        assert schedule_run(schedule, f, b, 4, transfer=Transfer(0.0, True)).step_s == pytest.approx(
            step_time(schedule, f, b, 4)
        )
    assert schedule_run("1f1b", f, b, 4, transfer=late).step_s > step_time("1f1b", f, b, 4, transfer_s=0.5)


def test_a_rank_alone_on_shared_cores_goes_faster_and_moves_do_not():
    """Two ranks, one micro-batch: only one computes at any time.  On cores shared so that one rank alone goes
    2 x, the step halves; a stage that is all moves (``compute_share`` 0) does not speed up; half and half,
    its time is ``c / s + (1 - c)`` of its work."""
    f, b = [1.0, 1.0], [2.0, 2.0]
    full = schedule_run("gpipe", f, b, 1)
    assert full.step_s == pytest.approx(6.0) and full.busy_s == pytest.approx((3.0, 3.0))
    alone = schedule_run("gpipe", f, b, 1, speed=lambda k, w: 2.0 if k == 1 else 1.0)
    assert alone.step_s == pytest.approx(3.0) and alone.busy_s == pytest.approx((1.5, 1.5))
    moves = schedule_run("gpipe", f, b, 1, speed=lambda k, w: 2.0, compute_share=[0.0, 0.0])
    assert moves.step_s == pytest.approx(6.0)
    half = schedule_run("gpipe", f, b, 1, speed=lambda k, w: 2.0, compute_share=[0.5, 0.5])
    assert half.step_s == pytest.approx(6.0 * (0.5 / 2 + 0.5))


def test_ranks_sharing_cores_lend_them_when_idle():
    """``DeviceProfile.compute_speed``: 4 ranks on 2 cores run at half a core each; one or two computing run at a
    whole core (2 x), three at two thirds (4/3 x); ranks with a device each (a GPU profile) never speed up, nor
    ranks that do not outnumber the cores."""
    cpu, gpu = load_profile("cpu"), load_profile("h100")
    assert cpu.cores_per_node == 2 and gpu.cores_per_node == 0
    assert [cpu.compute_speed(k, 4) for k in (1, 2, 3, 4)] == pytest.approx([2.0, 2.0, 4 / 3, 1.0])
    assert cpu.compute_speed(1, 2) == 1.0 and gpu.compute_speed(1, 8) == 1.0


def test_lending_follows_the_action_length_measured():
    """``CoreLending.speed_at``: between two measured lengths the speed is interpolated in log length (at the
    geometric mean, the mean of the two), held beyond the ends, 1 with every rank busy.  ``compute_speed`` uses the
    table only for the rank count it was measured on and when the action's length is given; else the
    core-share rule."""
    lending = CoreLending(4, (0.001, 0.1), ((0.9, 2.0), (0.9, 1.9), (0.8, 1.2)))  # in both orders: as measured
    assert lending.fitted == lending.speed
    assert lending.speed_at(1, 0.01) == pytest.approx(1.45)  # sqrt(0.001 x 0.1): half-way in log length
    assert lending.speed_at(1, 1e-5) == 0.9 and lending.speed_at(1, 10.0) == 2.0
    assert lending.speed_at(3, 0.001) == 0.8 and lending.speed_at(4, 0.05) == 1.0
    cpu = dataclasses.replace(load_profile("cpu"), core_lending=lending)
    assert cpu.compute_speed(1, 4, 0.1) == 2.0 and cpu.compute_speed(2, 4, 0.001) == 0.9
    assert cpu.compute_speed(1, 4) == 2.0 and cpu.compute_speed(3, 4) == pytest.approx(4 / 3)  # no length: the rule
    assert cpu.compute_speed(1, 8, 0.001) == pytest.approx(4.0)  # 8 ranks on 2 cores: not measured, the rule


def test_the_measured_lending_is_fitted_to_its_two_orders_and_capped_by_the_cores():
    """A measured table out of order (one busy rank lent 2.38x at 16 ms, 1.5x at 43 ms; two busy 1.08x at 0.7 ms,
    0.62x at 1.9 ms: a profile of 2026-11-29) answers from its least-squares fit in both orders: rows pooled where
    a longer action was lent less, columns where more busy ranks ran faster.  ``compute_speed`` caps it at the
    core-share rule (4 ranks on 2 cores: 2x, 2x, 4/3x), and the profile keeps the table as measured."""
    measured = ((1.63, 0.99, 2.38, 1.5), (1.08, 0.62, 2.02, 1.46), (0.89, 0.68, 1.72, 1.13))
    lending = CoreLending(4, (0.00066, 0.0019, 0.0164, 0.043), measured)
    fit = lending.fitted
    assert all(a <= b + 1e-12 for row in fit for a, b in zip(row, row[1:]))  # longer: lent no less
    assert all(fit[k][j] >= fit[k + 1][j] - 1e-12 for k in range(2) for j in range(4))  # more busy: no faster
    assert fit[0] == pytest.approx((1.31, 1.31, 1.94, 1.94))  # pooled pairs: (1.63 + 0.99) / 2, (2.38 + 1.5) / 2
    assert fit[2] == pytest.approx((0.785, 0.785, 1.425, 1.425))
    assert lending.to_table()["speed"] == [list(r) for r in measured]  # written back as measured
    cpu = dataclasses.replace(load_profile("cpu"), core_lending=lending)
    assert cpu.compute_speed(1, 4, 0.043) == pytest.approx(1.94)
    assert cpu.compute_speed(3, 4, 0.043) == pytest.approx(4 / 3)  # the fit's 1.425 is over a whole core


def test_a_short_action_gets_less_of_the_idle_cores():
    """Two ranks, one micro-batch, GPipe: forwards of 1 s, backwards of 2 s, one rank computing at a time.  Lent
    2 x only for actions of 1.5 s or more, the forwards take their full 1 s and the backwards 1 s each: 2 + 2 =
    4 s (6 s unlent, 3 s with every action lent)."""
    f, b = [1.0, 1.0], [2.0, 2.0]
    run = schedule_run("gpipe", f, b, 1, speed=lambda k, w: 2.0 if w >= 1.5 else 1.0)
    assert run.step_s == pytest.approx(4.0)


@pytest.mark.parametrize(
    "table, message",
    [
        ({"ranks": 4, "action_s": [0.01]}, r"expected exactly the keys \['action_s', 'ranks', 'speed'\]"),
        ({"ranks": 1, "action_s": [0.01], "speed": []}, "ranks must be an int >= 2"),
        ({"ranks": 3, "action_s": [0.01, 0.001], "speed": [[1, 1], [1, 1]]}, "action_s must be increasing"),
        ({"ranks": 3, "action_s": [0.01], "speed": [[1.0]]}, r"speed must hold 2 rows \(1 .. 2 busy ranks\)"),
        ({"ranks": 2, "action_s": [0.01], "speed": [[0.0]]}, "speeds must be positive"),
    ],
)
def test_a_bad_lending_table_is_named(tmp_path, table, message):
    """A profile's ``[core_lending]`` table that does not fit is refused, naming the file and what was expected."""
    import tomli_w

    from costmodel import profile_dict

    data = profile_dict("cpu")
    data["core_lending"] = table
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        load_profile(str(path))
    assert "bad.toml" in str(err.value)


def test_a_stage_holds_its_micro_batches_beside_the_gradients_born_so_far():
    """A stage's peak beyond its parameters and optimizer state, followed over its rank's actions (the step starts
    without gradients): two equal layers on 2 ranks, each saving A = 10 per micro-batch, its gradients G = 4 of its
    state S = 16.  1F1B, m = 2: stage 0 runs F F B B: the most is 2 A before its first backward, so it holds
    S - G + 2 A = 32 (the additive bound S + 2 A says 36).  m = 4: a forward follows its first backward (F F B F B
    F B B), so 2 A + G: 36.  GPipe, m = 4: 4 A before any backward: S - G + 4 A = 52 (additive 56)."""
    from autopar.planner.stage_prices import ChainPrices, priced_stages
    from autopar.search import StageCosts

    layers = StageCosts((1.0, 1.0), (2.0, 2.0), (16, 16), (10, 10))
    nothing = StageCosts((0.0,), (0.0,), (0,), (0,))
    prices = ChainPrices(layers, nothing, nothing, (0.0,) * 4, (0.0,), (1.0,) * 4, (4, 4, 0, 0))
    held = {(s, m): priced_stages(prices, s, m, 2, 1, None) for s, m in (("1f1b", 2), ("1f1b", 4), ("gpipe", 4))}
    assert [held[k].stages[0].memory_bytes for k in held] == [32, 36, 52]
    assert held["1f1b", 2].memory_bytes == 32 and held["1f1b", 2].state_bytes == 16
    # stage 1 (the last) runs F B F B in 1F1B: one micro-batch beside the gradients, max(A, A + G): 16 + 10
    assert held["1f1b", 4].stages[1].memory_bytes == 26


def test_a_backward_holds_its_working_set_beside_the_micro_batches_in_flight():
    """As above (1F1B, m = 2 on 2 ranks, A = 10, G = 4 of S = 16), with backward working sets of 7 (layer 0) and 3
    (layer 1) and the step's end (buckets of 5, the optimizer's 2 temporaries on the largest gradient, 3 and 2).
    Stage 0 (F F B B): 2 A + W = 27 before its first backward, so S - G + 27 = 39 (the split's bound
    S + 2 A + W says 43); its end holds G + max(min(4, 5), 2 x 3) = 10, less.  Stage 1 (F B F B): A + G + W = 17 at
    its second backward: 16 - 4 + 17 = 29."""
    from autopar.planner.stage_prices import ChainPrices, priced_stages
    from autopar.search import EndOfStep, StageCosts

    layers = StageCosts((1.0, 1.0), (2.0, 2.0), (16, 16), (10, 10), (7, 3), (4, 4), (3, 2))
    nothing = StageCosts((0.0,), (0.0,), (0,), (0,))
    prices = ChainPrices(layers, nothing, nothing, (0.0,) * 4, (0.0,), (1.0,) * 4, (4, 4, 0, 0), EndOfStep(5, 2))
    priced = priced_stages(prices, "1f1b", 2, 2, 1, None)
    assert [st.memory_bytes for st in priced.stages] == [39, 29]
    small = StageCosts((1.0, 1.0), (2.0, 2.0), (16, 16), (1, 1), (0, 0), (12, 4), (3, 2))
    prices = ChainPrices(small, nothing, nothing, (0.0,) * 4, (0.0,), (1.0,) * 4, (12, 4, 0, 0), EndOfStep(5, 1))
    # stage 0 ends with its 12 bytes of gradients and one bucket's flat copy of 5: S - G + G + 5 = 21
    assert [st.memory_bytes for st in priced_stages(prices, "1f1b", 2, 2, 1, None).stages] == [21, 20]
