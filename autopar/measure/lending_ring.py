"""Measure how much of a waiting CPU rank's cores the others get (``costmodel.lending``), the way a pipeline idles.

``k`` tokens go round a ring of the node's ranks; a rank holding one computes a chunk of matmuls and passes it
on, the others wait in a gloo receive, so ``k`` ranks compute at a time.  Per chunk length (its time with every
rank busy) and ``k`` in ``1 .. ranks - 1``, the speed is the all-busy chunk time over the chunk time in the ring
(means over the ranks).  ``autopar calibrate`` runs it on CPU ranks that outnumber their cores and writes the
profile's ``[core_lending]`` table; ``scripts/core_lending.py`` prints it beside the core-share rule.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from costmodel import CoreLending

__all__ = ["LENGTHS_MS", "measure_lending"]

#: Chunk lengths measured (milliseconds with every rank busy): from shorter than a scheduler's time slice to
#: several slices, where lending reaches the core-share rule.
LENGTHS_MS = (0.5, 2.0, 8.0, 32.0)


def _chunk_fn(reps: int) -> Callable[[], float]:
    a = torch.randn(128, 128)

    def chunk() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            a @ a
        return time.perf_counter() - t

    return chunk


def _all_busy(chunk: Callable[[], float], trials: int = 8) -> float:
    import torch.distributed as dist

    dist.barrier()
    times = [chunk() for _ in range(trials)]
    dist.barrier()
    return statistics.median(times[2:])


def _ring(chunk: Callable[[], float], rank: int, world: int, k: int, rounds: int) -> float:
    """Mean chunk time while ``k`` tokens go ``rounds`` times round the ring (the rest of the time: a receive)."""
    import torch.distributed as dist

    starts = {round(i * world / k) for i in range(k)}
    token, sends, spent = torch.zeros(1), [], []
    dist.barrier()
    for c in range(k * rounds):
        if not (c == 0 and rank in starts):
            dist.recv(token, (rank - 1) % world)
        spent.append(chunk())
        sends.append(dist.isend(token.clone(), (rank + 1) % world))
    if rank in starts:
        dist.recv(token, (rank - 1) % world)
    for work in sends:
        work.wait()
    dist.barrier()
    return statistics.mean(spent)


def measure_lending(rank: int, world: int, lengths_ms: Sequence[float] = LENGTHS_MS, rounds: int = 8) -> CoreLending:
    """The lending of this job's ``world`` ranks (every rank calls it and gets the same table; gloo, one thread
    each, as ``autopar run``'s CPU ranks).  About 20 s for 4 ranks, the default lengths and 8 rounds (4 rounds spread
    up to 25% between runs at 3 ms)."""
    import torch.distributed as dist

    if world < 2:
        raise ValueError(f"core lending needs at least 2 ranks, got {world}")
    probe = _chunk_fn(10)
    per_rep = _all_busy(probe) / 10
    mine = []  # per length: (all-busy chunk time, [ring chunk time for k = 1 .. world - 1])
    for ms in lengths_ms:
        reps = torch.tensor([max(1, round(ms / 1e3 / per_rep))])
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # every rank the same chunk
        chunk = _chunk_fn(int(reps))
        mine.append((_all_busy(chunk), [_ring(chunk, rank, world, k, rounds) for k in range(1, world)]))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    full = [statistics.mean(rows[j][0] for rows in gathered) for j in range(len(lengths_ms))]
    speed = tuple(
        tuple(full[j] / statistics.mean(rows[j][1][k] for rows in gathered) for j in range(len(lengths_ms)))
        for k in range(world - 1)
    )
    order = sorted(range(len(full)), key=full.__getitem__)  # lengths measured, increasing
    return CoreLending(world, tuple(full[j] for j in order), tuple(tuple(row[j] for j in order) for row in speed))
