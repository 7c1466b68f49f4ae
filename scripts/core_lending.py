"""How much faster a CPU rank computes while others idle, against what the cost model lends it.

    python scripts/core_lending.py --ranks 4 --ms 0.5 2 8 32 --profile cpu

Ranks that share a host's cores (4 gloo ranks on 2 cores) run at the rate a profile measured with all of them
busy; a rank idle in a pipeline's bubble lends its share to the others (``DeviceProfile.compute_speed``:
``min(1, cores / busy) / min(1, cores / ranks)``, 2x for one or two busy ranks of 4 on 2 cores).  This measures
it the way a pipeline idles (``autopar.measure.lending_ring``: ``k`` tokens go round a ring of the ranks, a rank
computes a chunk of matmuls when it holds one and otherwise waits on a gloo receive).  Per action length (the
chunk's time with every rank busy) and ``k``, it prints the speed measured (the all-busy chunk time over the
chunk time in the ring) beside the core-share rule and what the profile's ``[core_lending]`` table (written by
``autopar calibrate``) says.
"""

from __future__ import annotations

import argparse

from autopar.measure.lending_ring import LENGTHS_MS, measure_lending
from autopar.measure.ranks import on_ranks
from costmodel import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ms", type=float, nargs="+", default=list(LENGTHS_MS), help="action lengths (all busy)")
    ap.add_argument("--rounds", type=int, default=8, help="times each token goes round the ring")
    ap.add_argument("--profile", default="cpu", help="the profile whose compute_speed is printed beside")
    a = ap.parse_args()
    profile = load_profile(a.profile)
    lending = on_ranks(_rank, a.ranks, a.ms, a.rounds, timeout_s=600)
    print(f"{a.ranks} ranks, profile {a.profile} ({profile.cores_per_node} cores per node)")
    print("action (all busy)  busy ranks  measured speed  core-share rule  profile's table")
    for j, full in enumerate(lending.action_s):
        for k in range(1, a.ranks):
            rule = profile.compute_speed(k, a.ranks)
            table = profile.compute_speed(k, a.ranks, full)
            print(f"{full * 1e3:10.2f} ms {k:11d} {lending.speed[k - 1][j]:14.2f}x {rule:15.2f}x {table:15.2f}x")


def _rank(rank: int, world: int, lengths_ms: list[float], rounds: int):
    import torch

    torch.set_num_threads(1)
    return measure_lending(rank, world, lengths_ms, rounds)


if __name__ == "__main__":
    main()
