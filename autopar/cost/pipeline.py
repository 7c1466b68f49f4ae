"""Pipeline schedules: the order each rank runs its micro-batches in, the step time it takes, the activations it
holds (``planner.stage_prices`` prices pipelined plans with them).

A pipeline of ``p`` ranks runs ``s = p v`` stages (``v`` virtual stages per rank: interleaved schedules; 1
otherwise), stage ``j`` on rank ``j mod p``, over ``m`` micro-batches.  ``F(j, i)`` is stage j's forward of
micro-batch i, ``B(j, i)`` its backward.  Dependencies: ``F(j, i)`` after ``F(j - 1, i)`` (and the transfer of
its output), ``B(j, i)`` after ``B(j + 1, i)`` (and the transfer of the gradient) and after ``F(j, i)``; a rank
runs its actions one at a time in its schedule's order (:func:`rank_orders`).

Orders (the ones ``torch.distributed.pipelining`` runs):

* ``gpipe``: every forward, then every backward (``ScheduleGPipe``);
* ``1f1b``: ``w_r = min(p - r, m)`` warm-up forwards, then one backward and one forward alternately, then
  the remaining backwards (``Schedule1F1B``; Megatron's non-interleaved schedule has one warm-up forward less
  and runs the forward first: the same timeline);
* ``interleaved``: Megatron's interleaved 1F1B (``ScheduleInterleaved1F1B``): micro-batches go in groups of
  ``p``, each group through the rank's ``v`` stages in turn; ``w_r = min((p - r - 1) 2 + (v - 1) p, m v)``
  warm-up forwards, then one forward and one backward alternately, then the remaining backwards.  ``m`` must be
  a multiple of ``p``.

Step time (:func:`step_time`, by list scheduling of those orders: exact for any per-stage times).  With equal
stages (forward ``f``, backward ``b`` per stage and micro-batch, no transfer time) it is the closed form

    T = (m v + p - 1) (f + b)        (``gpipe``, ``1f1b``: v = 1)

of which ``(p - 1) (f + b)`` is the bubble: the fraction ``(p - 1) / (m v + p - 1)`` of the step
(:func:`bubble_fraction`); interleaving divides the bubble by ``v`` because each rank's stage is ``1 / v`` of its
layers (``f``, ``b`` are per virtual stage).  ``tests/test_pipeline_cost.py`` checks the closed form against
the list schedule, and the schedule's dependencies.

Ranks that share cores (:func:`schedule_run`): CPU ranks on one host run at the rate their profile measured with
every rank busy; a rank idle in the bubble lends its share of the cores to the others, so a stage computes faster
while fewer ranks compute.  The step is then simulated event by event (between two events every rate is constant),
the stage's compute sped up and its collectives not.

Activations held (:func:`in_flight`): the most micro-batches whose forward a rank has run and whose backward it
has not, each holding one stage's saved activations: ``m`` (``gpipe``), ``w_r = min(m, p - r)`` on rank ``r``
(``1f1b``), ``min(w_r + 1, m v)`` stage-micro-batches (``interleaved``, ``w_r`` above).  A stage's memory is its
model state plus that many micro-batches' activations; the cap holds on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleRun",
    "Transfer",
    "bubble_fraction",
    "dependencies",
    "in_flight",
    "least_schedule_time",
    "rank_orders",
    "schedule_run",
    "step_time",
    "warmup",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """``kind`` "F" or "B" of stage ``stage`` on micro-batch ``micro``."""

    kind: str
    stage: int
    micro: int


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"a pipeline needs ranks, micro-batches and stages per rank >= 1, got p={p}, m={m}, v={v}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"{schedule} runs one stage per rank (v=1), got v={v}; interleaved runs several")
    if schedule == "interleaved" and m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches in groups of the {p} ranks: m={m} is not a multiple")


def warmup(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """The most stage-micro-batches rank ``rank`` holds activations of at once (module docstring)."""
    w = warmup(schedule, p, m, rank, v)
    return w if schedule != "interleaved" else min(w + 1, m * v)


def stage_counts(schedule: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Per stage ``j`` (on rank ``j mod p``): its micro-batches in flight at its rank's fullest moment by count, the
    first boundary between the rank's actions (``rank_orders``) where it holds the most stage-micro-batches.  A rank
    holds at least the activations of those at that moment (at any moment: its peak is the most over them), which is
    what a bound on its memory over all splits and stage plans may count (``planner.stage_floor``)."""
    counts = [0] * (p * v)
    for order in rank_orders(schedule, p, m, v):
        held: dict[int, int] = {}
        most, at_most = -1, {}
        for act in order:
            held[act.stage] = held.get(act.stage, 0) + (1 if act.kind == "F" else -1)
            if sum(held.values()) > most:
                most, at_most = sum(held.values()), dict(held)
        for stage, count in at_most.items():
            counts[stage] = count
    return tuple(counts)


def rank_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's actions in the order it runs them (module docstring)."""
    _check(schedule, p, m, v)
    orders = []
    for r in range(p):
        fwd = [Action("F", s, i) for s, i in _forward_sequence(schedule, p, m, v, r)]
        bwd = [Action("B", s, i) for s, i in _backward_sequence(schedule, p, m, v, r)]
        w = warmup(schedule, p, m, r, v)
        order = fwd[:w]
        for k in range(len(fwd) - w):  # steady state: one forward and one backward (1f1b: backward first)
            order += [bwd[k], fwd[w + k]] if schedule == "1f1b" else [fwd[w + k], bwd[k]]
        order += bwd[len(fwd) - w :]
        orders.append(order)
    return orders


def _forward_sequence(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple[int, int]]:
    """(stage, micro-batch) of rank r's forwards in order: by micro-batch, or (interleaved) in groups of p
    micro-batches, each group through the rank's stages r, r + p, ... in turn."""
    if schedule != "interleaved":
        return [(r, i) for i in range(m)]
    return [(c * p + r, g + i) for g in range(0, m, p) for c in range(v) for i in range(p)]


def _backward_sequence(schedule: str, p: int, m: int, v: int, r: int) -> list[tuple[int, int]]:
    """Rank r's backwards in order: the forwards' order with the stages reversed (the last stage first)."""
    if schedule != "interleaved":
        return [(r, i) for i in range(m)]
    return [(c * p + r, g + i) for g in range(0, m, p) for c in reversed(range(v)) for i in range(p)]


@dataclass(frozen=True, slots=True)
class Transfer:
    """How a value crossing between ranks moves: it takes ``seconds``; ``when_receiver_free``: it starts only once
    the receiving rank is free to post its receive (:func:`schedule_run`), else when the sender's action ends."""

    seconds: float = 0.0
    when_receiver_free: bool = False


@dataclass(frozen=True, slots=True)
class ScheduleRun:
    """A simulated step: its time (first forward to last backward) and, per rank, the seconds it computed (its
    stages' forwards and backwards; ``1 - busy_s[r] / step_s`` is rank r's bubble)."""

    step_s: float
    busy_s: tuple[float, ...]


def step_time(
    schedule: str,
    forward_s: list[float],
    backward_s: list[float],
    m: int,
    *,
    v: int = 1,
    transfer_s: float = 0.0,
) -> float:
    """The time from the first forward to the last backward: the list schedule of :func:`rank_orders` with
    stage ``j`` taking ``forward_s[j]`` / ``backward_s[j]`` per micro-batch (``p v`` stages) and each value
    crossing between ranks ``transfer_s`` (:func:`schedule_run` at full speed)."""
    return schedule_run(schedule, forward_s, backward_s, m, v=v, transfer=Transfer(transfer_s)).step_s


def schedule_run(
    schedule: str,
    forward_s: list[float],
    backward_s: list[float],
    m: int,
    *,
    v: int = 1,
    transfer: Transfer = Transfer(),
    speed: Callable[[int, float], float] | None = None,
    compute_share: Sequence[float] | None = None,
) -> ScheduleRun:
    """The step of :func:`rank_orders` simulated in time: a rank starts its next action once the action's inputs are
    there (:func:`_ready_at`) and it is free; ``forward_s`` / ``backward_s`` are the actions' work at full load.
    While ``k`` ranks run actions at once, the compute of each goes ``s = speed(k, w)`` times faster, ``w`` its
    action's work at full load (ranks sharing a host's cores: ``costmodel.DeviceProfile.compute_speed``, which lends
    less to short actions; None: 1, each rank its own device, which is the list schedule) and the rest (collectives
    inside a stage) does not: stage ``j``'s work, ``c_j`` compute (``compute_share[j]``, default 1), goes at the
    rate ``1 / (c_j / s + 1 - c_j)``. Between events (an action finishing, one becoming ready) the rates are
    constant, so each event is exact.

    ``transfer``: each value crossing to another rank takes ``transfer.seconds``.  With
    ``transfer.when_receiver_free`` it starts moving only once the receiving rank is free to
    post its receive (it has finished its previous action), so the transfer delays the receiver by its whole
    time even when the sender finished long before: a rendezvous link (gloo, NCCL) under a runtime whose host
    posts each receive just before the action that needs it, as ``torch.distributed.pipelining`` does; that host
    is the device itself where it does not run ahead (``DeviceProfile.host_runs_ahead`` false: CPU ranks).
    False: the transfer starts when the sender's action ends (a host running ahead of its device has posted the
    receive long before the device gets there)."""
    stages = len(forward_s)
    if len(backward_s) != stages or stages % v:
        raise ValueError(
            f"expected one forward and one backward time per stage ({stages}, {len(backward_s)}), a multiple of v={v}"
        )
    p = stages // v
    orders = rank_orders(schedule, p, m, v)
    work = {"F": forward_s, "B": backward_s}
    share = list(compute_share) if compute_share is not None else [1.0] * stages
    done: dict[Action, float] = {}
    at, busy, free = [0] * p, [0.0] * p, [0.0] * p  # free[r]: when rank r finished its last action
    running: dict[int, list] = {}  # rank -> [action, work left]
    now = 0.0
    while True:
        ready_later = []
        for r in range(p):
            if r in running or at[r] == len(orders[r]):
                continue
            act = orders[r][at[r]]
            start = _ready_at(act, done, stages, p, transfer.seconds, free[r] if transfer.when_receiver_free else 0.0)
            if start is not None and start <= now * (1 + 1e-12):  # ready now (up to the sum's rounding)
                running[r] = [act, work[act.kind][act.stage]]
            elif start is not None:
                ready_later.append(start)
        if not running and not ready_later:
            break
        rate = {r: _rate(act, work, share, speed, len(running)) for r, (act, _) in running.items()}
        step = min([left / rate[r] for r, (_, left) in running.items()] + [t - now for t in ready_later])
        for r in list(running):
            act, left = running[r]
            busy[r] += step
            if left <= step * rate[r] * (1 + 1e-12):
                done[act] = free[r] = now + step
                at[r] += 1
                del running[r]
            else:
                running[r][1] = left - step * rate[r]
        now += step
    if any(at[r] < len(orders[r]) for r in range(p)):
        raise AssertionError(f"{schedule} order deadlocks (p={p}, m={m}, v={v})")
    return ScheduleRun(now, tuple(busy))


def _rate(act: Action, work: dict, share: list[float], speed: Callable[[int, float], float] | None, k: int) -> float:
    """How fast ``act`` runs while ``k`` actions run: its compute share ``c`` sped up ``s`` times, the rest not."""
    full = work[act.kind][act.stage]
    s = 1.0 if speed is None else speed(k, full)
    c = share[act.stage]
    return 1.0 / (c / s + 1.0 - c)


def dependencies(act: Action, stages: int) -> list[Action]:
    """The actions ``act`` reads the output of (module docstring): the previous stage's forward of its micro-batch;
    for a backward, its own stage's forward and the next stage's backward of that micro-batch."""
    if act.kind == "F":
        return [Action("F", act.stage - 1, act.micro)] if act.stage > 0 else []
    deps = [Action("F", act.stage, act.micro)]
    return deps + [Action("B", act.stage + 1, act.micro)] if act.stage < stages - 1 else deps


def _ready_at(act: Action, done: dict, stages: int, p: int, transfer_s: float, posted_s: float) -> float | None:
    """When ``act``'s inputs are there (None: a dependency has not run yet): a value from another rank
    ``transfer_s`` after both its sender finished and the receive was posted (at ``posted_s``)."""
    start = 0.0
    for d in dependencies(act, stages):
        if d not in done:
            return None
        cross = d.stage % p != act.stage % p
        start = max(start, max(done[d], posted_s) + transfer_s if cross else done[d])
    return start


def least_schedule_time(
    work_s: float, p: int, m: int, v: int = 1, *, flow_shop: bool = False, stage_least_s: float = 0.0
) -> float:
    """The least time any split of ``work_s`` (one micro-batch's forward and backward over every stage) into a
    ``p``-rank schedule of ``m`` micro-batches takes, transfers free, each action at full speed:

    * ``flow_shop`` (GPipe and 1F1B priced by the formula ``sum_j t_j + (m - 1) (max_j f_j + max_j b_j)``,
      ``search.stages``): ``max_j t_j >= W / p``, so ``(m + p - 1) W / p``, equal stages reaching it;
    * a list schedule (:func:`schedule_run`), ``v = 1``: rank r starts after the forwards of the stages before it
      and ends before their backwards of its last micro-batch, so the step is at least ``m t_r + sum_(i<r) t_i``
      for every r.  Least over the splits where every rank's is the same ``T``: ``T - sum_(i<=r) t_i = (T -
      sum_(i<r) t_i)(1 - 1/m)``, so ``sum_(i<p) t_i = W = T (1 - (1 - 1/m)^p)``: ``T = W / (1 - (1 - 1/m)^p)``
      (a split under ``T`` everywhere would sum to less than ``W``, by induction on r);
    * interleaved (``v > 1``), every stage taking at least ``c = stage_least_s``: ``m W / p + c (p - 1) / 2``.
      Rank r's first action, stage r's forward of the first micro-batch, waits for the forwards of stages
      ``0 .. r - 1`` (ranks ``0 .. r - 1``' first chunks); its last action is a backward of stage r (each
      backward of its later stages ``r + k p`` leads down to stage r on the same rank), which the backwards of
      stages ``r - 1 .. 0`` follow.  So the step is at least ``m R_r + sum_(i<r) t_i >= m R_r + r c``, ``R_r``
      its stages' work per micro-batch, for every r; the mean over the ranks, with ``sum_r R_r = W``, is the
      bound.  (``c = 0``: the busiest rank's share, where the first chunk's stages may be small.)

    A rank sped up by at most ``s`` while others idle (``schedule_run``'s ``speed``) takes at least this over ``s``."""
    if v > 1:
        return m * work_s / p + stage_least_s * (p - 1) / 2
    if flow_shop:
        return (m + p - 1) * work_s / p
    return work_s / (1 - (1 - 1 / m) ** p)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step with equal stages and free transfers: ``(p - 1) / (m v + p - 1)``."""
    _check(schedule, p, m, v)
    return (p - 1) / (m * v + p - 1)
