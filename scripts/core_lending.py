"""How much faster a CPU rank computes while others idle, against what the cost model lends it.

    python scripts/core_lending.py --ranks 4 --ms 0.5 2 8 32 --profile cpu

Ranks that share a host's cores (4 gloo ranks on 2 cores) run at the rate a profile measured with all of them
busy; a rank idle in a pipeline's bubble lends its share to the others (``DeviceProfile.compute_speed``:
``min(1, cores / busy) / min(1, cores / ranks)``, 2x for one or two busy ranks of 4 on 2 cores).  This measures
it the way a pipeline idles: ``k`` tokens go round a ring of the ranks, a rank computes a chunk of matmuls when it
holds one and otherwise waits on a gloo receive.  Per action length (the chunk's time with every rank busy) and
``k``, it prints the speed measured (the all-busy chunk time over the chunk time in the ring) beside the model's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autopar.measure.ranks import on_ranks
from costmodel import load_profile


def _chunk_fn(reps: int):
    a = torch.randn(128, 128)

    def chunk() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            a @ a
        return time.perf_counter() - t

    return chunk


def _all_busy(chunk, trials: int = 8) -> float:
    dist.barrier()
    times = [chunk() for _ in range(trials)]
    dist.barrier()
    return statistics.median(times[2:])


def _ring(chunk, rank: int, world: int, k: int, rounds: int) -> float:
    """Mean chunk time while ``k`` tokens go ``rounds`` times round the ring (the rest of the time: a receive)."""
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


def _rank(rank: int, world: int, lengths_ms: list[float], rounds: int) -> list | None:
    torch.set_num_threads(1)
    probe = _chunk_fn(10)
    per_rep = _all_busy(probe) / 10
    rows = []
    for ms in lengths_ms:
        reps = torch.tensor([max(1, round(ms / 1e3 / per_rep))])
        dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # every rank the same chunk
        chunk = _chunk_fn(int(reps))
        full = _all_busy(chunk)
        for k in range(1, world):
            rows.append((ms, k, full, _ring(chunk, rank, world, k, rounds)))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    return gathered if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ms", type=float, nargs="+", default=[0.5, 2.0, 8.0, 32.0], help="action lengths (all busy)")
    ap.add_argument("--rounds", type=int, default=4, help="times each token goes round the ring")
    ap.add_argument("--profile", default="cpu", help="the profile whose compute_speed is printed beside")
    a = ap.parse_args()
    profile = load_profile(a.profile)
    gathered = on_ranks(_rank, a.ranks, a.ms, a.rounds, timeout_s=600)
    print(f"{a.ranks} ranks, profile {a.profile} ({profile.cores_per_node} cores per node)")
    print("action (all busy)  busy ranks  measured speed  model speed")
    for i, (_, k, _, _) in enumerate(gathered[0]):
        full = statistics.mean(rows[i][2] for rows in gathered)
        ring = statistics.mean(rows[i][3] for rows in gathered)
        model = profile.compute_speed(k, a.ranks)
        print(f"{full * 1e3:10.2f} ms {k:11d} {full / ring:14.2f}x {model:11.2f}x")


if __name__ == "__main__":
    main()
