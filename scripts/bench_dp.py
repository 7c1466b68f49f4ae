"""Solve time of the exact DP against CP-SAT on transformer-like problems.

    python scripts/bench_dp.py                      # k=10, 4/12/24/48 layers, CP-SAT limit 60 s
    python scripts/bench_dp.py --k 40 --cpsat-limit 120
    python scripts/bench_dp.py --layers 12 --caps 0.2,0.5,0.8 --no-cpsat

Generating a problem places its cap between the min-memory plan and the min-time plan
(two DP solves, not timed).  Times are wall-clock on this machine (``dp cpu s`` is the
DP's process time, steadier on a shared machine); the ratio column is CP-SAT wall time
/ DP wall time in the same run.  CP-SAT's status is OPTIMAL only when it proves
it; otherwise its best plan and bound are shown against the DP's optimum.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from autopar.search import InfeasibleError, solve_cpsat, solve_dp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from search_problems import transformer_like_problem  # noqa: E402  (the tests' problem generators)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,12,24,48", help="comma-separated block counts")
    ap.add_argument("--k", type=int, default=10, help="max strategies per node (10: 1-D mesh, 40: 2-D mesh)")
    ap.add_argument("--caps", default="0.5", help="comma-separated cap fractions between min-memory and min-time plans")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpsat-limit", type=float, default=60.0, help="CP-SAT time limit per problem, seconds")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    ap.add_argument("--no-cpsat", action="store_true")
    args = ap.parse_args()
    head = (
        f"{'layers':>6} {'nodes':>6} {'k':>3} {'cap':>4} | {'dp s':>7} {'dp cpu s':>8} {'dp time ps':>14} "
        f"{'pairs':>9} | {'cpsat s':>8} {'status':>9} {'cpsat gap':>10} {'bound gap':>10} {'ratio':>7}"
    )
    print(head)
    print("-" * len(head))
    for layers in (int(x) for x in args.layers.split(",")):
        for frac in (float(x) for x in args.caps.split(",")):
            problem = transformer_like_problem(layers, args.k, args.seed, cap_fraction=frac)
            tick, cpu = time.perf_counter(), time.process_time()
            dp = solve_dp(problem)
            dp_s, dp_cpu = time.perf_counter() - tick, time.process_time() - cpu
            row = (
                f"{layers:>6} {problem.n_nodes:>6} {args.k:>3} {frac:>4} | {dp_s:>7.2f} {dp_cpu:>8.2f} {dp.time:>14} "
                f"{dp.stats['pairs']:>9} |"
            )
            if args.no_cpsat:
                print(row, flush=True)
                continue
            tick = time.perf_counter()
            try:
                ref = solve_cpsat(problem, time_limit_s=args.cpsat_limit, workers=args.workers)
                status = ref.stats["status"]
                gap = f"{(ref.time - dp.time) / dp.time:>10.2e}"
                bound = f"{(dp.time - ref.stats['best_bound']) / dp.time:>10.2e}"
                if ref.optimal and ref.time != dp.time:
                    status = "MISMATCH"
            except (TimeoutError, InfeasibleError) as err:
                status, gap, bound = type(err).__name__[:9], f"{'-':>10}", f"{'-':>10}"
            cp_s = time.perf_counter() - tick
            print(f"{row} {cp_s:>8.2f} {status:>9} {gap} {bound} {cp_s / dp_s:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
