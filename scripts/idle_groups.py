"""What idle process groups cost a training step on local CPU ranks.

    python scripts/idle_groups.py                 # 4 gloo ranks; 0, 50, 100, 200 idle groups
    python scripts/idle_groups.py --ranks 2 --groups 0,20

Each gloo process group keeps a thread whose event loop wakes every 10 ms, used or not, and torch keeps every group
``dist.new_group`` made until ``dist.destroy_process_group``.  This times a fixed step (40 matmuls of 256x512 by
512x512 on one thread, then an all-reduce of 1 MiB over every rank) with more and more idle groups of every rank
alive: the median of 7 timings of 10 steps between barriers, per count.  It is why autopar makes each set of rank
lines' groups once per process (``autopar.runtime.shared_groups``).  Printed figures only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar.measure.ranks import on_ranks


def _rank(rank: int, world: int, counts: list[int]) -> list[tuple[int, float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    a, b, buf = torch.randn(256, 512), torch.randn(512, 512), torch.randn(1 << 18)

    def step() -> None:
        for _ in range(40):
            a @ b
        dist.all_reduce(buf)

    out, made = [], 0
    for count in counts:
        while made < count:
            dist.new_group(ranks=list(range(world)))
            made += 1
        for _ in range(3):
            step()
        times = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            dist.barrier()
            times.append((time.perf_counter() - t0) / 10)
        out.append((count, statistics.median(times)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="local gloo ranks (default 4)")
    ap.add_argument("--groups", default="0,50,100,200", help="idle group counts to time, increasing")
    a = ap.parse_args()
    counts = sorted(int(x) for x in a.groups.split(","))
    rows = on_ranks(_rank, a.ranks, counts, timeout_s=1800)
    base = rows[0][1]
    for count, seconds in rows:
        print(f"{count:5d} idle groups: step {seconds * 1e3:7.1f} ms ({seconds / base:.2f}x)")


if __name__ == "__main__":
    main()
