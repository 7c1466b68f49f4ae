"""The timing side of ``autopar fidelity`` (``measure.fidelity``): the machine probe, the interleaved timed rounds
over a case's compiled plans, the contest's choice of plans to time again, and the measured pipeline bubble."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import stats
from .benchmark import PIPELINE_AUTO

__all__ = ["Rounds", "contenders", "contenders_from_rank0", "machine_probe", "measured_bubbles"]


def machine_probe():
    """A fixed piece of work timed on every rank at once between barriers (calibrate's compute chunk: 3
    matmuls of 256 x 1024 x 256, a few ms): run before a case is planned and at the start of each timed round,
    its ratio says how the machine's speed moved between the calibration and the timing (``CaseResult``)."""
    import torch.distributed as dist

    from .calibrate import compute_chunk, rank_device, sync_device

    device = rank_device()
    chunk = compute_chunk(device)

    def timed() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        chunk()
        sync_device(device)
        dist.barrier()
        return time.perf_counter() - t0

    timed()  # warm
    return timed


@dataclass
class Rounds:
    """Interleaved timed rounds over some of a case's compiled plans (``_measure_case``): each round runs every
    plan of the set once, in an order that rotates by one per round, for ``steps`` training steps between two
    barriers; each plan's seconds per step are appended to ``times[i]``, its pipeline stages' compute and
    scheduled time added to ``busy[i]`` and ``scheduled[i]``; each round starts with the machine probe, its
    seconds appended to ``probe_s``."""

    runs: list
    step: Any
    steps: int
    device: torch.device
    times: list[list[float]]
    busy: list[float]
    scheduled: list[float]
    probe: Any
    probe_s: list[float] = field(default_factory=list)

    def run(self, which, rounds: int) -> None:
        import torch.distributed as dist

        from .calibrate import sync_device

        which = list(which)
        for r in range(rounds):
            self.probe_s.append(self.probe())
            for j in range(len(which)):
                i = which[(j + r) % len(which)]
                sharded = self.runs[i][1]
                dist.barrier()
                t0, busy0, scheduled0 = time.perf_counter(), sharded.pipeline_busy_s, sharded.pipeline_schedule_s
                for _ in range(self.steps):
                    self.step(i)
                sync_device(self.device)  # the kernels queued, not only launched
                dist.barrier()
                self.times[i].append((time.perf_counter() - t0) / self.steps)
                self.busy[i] += sharded.pipeline_busy_s - busy0
                self.scheduled[i] += sharded.pipeline_schedule_s - scheduled0


def contenders(labels: list[tuple[str, ...]], times: list[list[float]], margin: float) -> list[int]:
    """The plans a contest re-times: those whose median step is within ``margin`` of the fastest's, and the
    search's own (``auto``, ``pipeline:auto``), which the report compares with the fastest."""
    medians = [stats.median(t) for t in times]
    fastest = min(medians)
    return [
        i
        for i, (lab, m) in enumerate(zip(labels, medians))
        if m <= (1 + margin) * fastest or {"auto", PIPELINE_AUTO} & set(lab)
    ]


def contenders_from_rank0(rank: int, plans, times: list[list[float]], margin: float) -> list[int]:
    """``contenders`` of rank 0's times, the same on every rank (each rank timed the rounds itself)."""
    import torch.distributed as dist

    box: list = [contenders([labels for labels, _ in plans], times, margin) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measured_bubbles(runs, busy: list[float], scheduled: list[float]) -> list[float | None]:
    """Per plan: the share of its schedule's time a rank of its pipeline spent outside its stages' forward and
    backward (sends, waits), averaged over the ranks: the bubble as ``cost.pipeline`` prices it, over the
    schedule's time (the step less the optimizer and the reductions after the schedule); None without a
    pipeline."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (busy, scheduled))
    out = []
    for i, (plan, _, _) in enumerate(runs):
        shares = [b[i] / s[i] for b, s in every if s[i] > 0]
        out.append(1.0 - sum(shares) / len(shares) if plan.pipeline is not None and shares else None)
    return out
