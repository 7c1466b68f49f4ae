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

Activations held (:func:`in_flight`): the most micro-batches whose forward a rank has run and whose backward it
has not, each holding one stage's saved activations: ``m`` (``gpipe``), ``w_r = min(m, p - r)`` on rank ``r``
(``1f1b``), ``min(w_r + 1, m v)`` stage-micro-batches (``interleaved``, ``w_r`` above).  A stage's memory is its
model state plus that many micro-batches' activations; the cap holds on every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "bubble_fraction", "in_flight", "rank_orders", "step_time", "warmup"]

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
    crossing between ranks ``transfer_s``."""
    stages = len(forward_s)
    if len(backward_s) != stages or stages % v:
        raise ValueError(
            f"expected one forward and one backward time per stage ({stages}, {len(backward_s)}), a multiple of v={v}"
        )
    p = stages // v
    orders = rank_orders(schedule, p, m, v)
    done: dict[Action, float] = {}
    at = [0] * p  # next action per rank
    free = [0.0] * p  # when each rank is free
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for r in range(p):
            while at[r] < len(orders[r]):
                act = orders[r][at[r]]
                start = _ready_at(act, done, stages, p, transfer_s)
                if start is None:
                    break
                begin = max(free[r], start)
                free[r] = begin + (forward_s if act.kind == "F" else backward_s)[act.stage]
                done[act] = free[r]
                at[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise AssertionError(f"{schedule} order deadlocks (p={p}, m={m}, v={v})")
    return max(free)


def _ready_at(act: Action, done: dict, stages: int, p: int, transfer_s: float) -> float | None:
    """When ``act``'s inputs are there (None: a dependency has not run yet)."""
    deps = []
    if act.kind == "F" and act.stage > 0:
        deps.append(Action("F", act.stage - 1, act.micro))
    if act.kind == "B":
        deps.append(Action("F", act.stage, act.micro))
        if act.stage < stages - 1:
            deps.append(Action("B", act.stage + 1, act.micro))
    start = 0.0
    for d in deps:
        if d not in done:
            return None
        cross = d.stage % p != act.stage % p
        start = max(start, done[d] + (transfer_s if cross else 0.0))
    return start


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a step with equal stages and free transfers: ``(p - 1) / (m v + p - 1)``."""
    _check(schedule, p, m, v)
    return (p - 1) / (m * v + p - 1)
