"""Planning time at depth: GPT-shaped models of 12..96 layers, chained search against CP-SAT.

    python scripts/bench_search.py                         # 12,24,48,96 layers, CP-SAT limit 600 s
    python scripts/bench_search.py --layers 12,96 --cpsat-limit 30
    python scripts/bench_search.py --no-cpsat --cap 40GiB

Each model: width 4096 (32 heads), seq 2048, vocab 50257, global batch 16, bf16 with fp32
optimizer state (AdamW), the h100 profile, mesh 8x8 (dp across nodes over InfiniBand, tp
inside a node over NVLink), per-device cap 80 GiB, built on the meta device (a
transformers GPT2Config).  Columns: capture s (torch.export + OpGraph), strategies s
(candidates + cost tables), search s (the planner's search: the chained exact DP over the
repeated layers), peak RSS of this process so far, the objective (step time), the plan's
memory per device, and CP-SAT on the same SearchProblem (its time, or 'over N s'; run in a
forked child so its memory is not in the RSS column).
Timings are wall-clock on this machine; run on an idle machine and take the min of runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time

import torch
import transformers

from autopar.mesh import Mesh
from autopar.planner import plan_from_context, prepare
from autopar.problem_builder import PS_PER_S, to_problem
from autopar.search import InfeasibleError, solve_cpsat
from autopar.units import format_bytes, parse_bytes


def gpt_shaped(layers: int, *, width: int, heads: int, vocab: int, seq: int, batch: int):
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="12,24,48,96", help="comma-separated layer counts")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--cap", default="80GiB", help="per-device memory cap")
    ap.add_argument("--cpsat-limit", type=float, default=600.0, help="CP-SAT time limit per model, seconds")
    ap.add_argument("--no-cpsat", action="store_true")
    args = ap.parse_args()
    mesh = Mesh(tuple(int(s) for s in args.mesh.split("x")), axis_names=("dp", "tp"))
    cap = parse_bytes(args.cap)
    head = (
        f"{'layers':>6} {'nodes':>6} {'blocks':>6} | {'capture s':>9} {'strat s':>8} {'search s':>8} "
        f"{'peak RSS':>10} | {'objective s':>12} {'mem/device':>11} | {'cpsat':>12} {'cpsat obj':>12}"
    )
    print(head, "-" * len(head), sep="\n")
    for layers in (int(x) for x in args.layers.split(",")):
        model, margs, mkwargs = gpt_shaped(
            layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq, batch=args.batch
        )
        ctx = prepare(model, mesh, example_inputs=margs, example_kwargs=mkwargs, profile="h100", dtype="bf16")
        result = plan_from_context(ctx, mem_cap=cap, compare_families=False)
        t = result.timings
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        objective = result.search["objective_ps"] / PS_PER_S
        blocks = ctx.blocks.count if ctx.blocks else 0
        row = (
            f"{layers:>6} {len(ctx.graph.nodes):>6} {blocks:>6} | {t['capture_s']:>9.2f} {t['strategies_s']:>8.2f} "
            f"{t['search_s']:>8.2f} {format_bytes(rss):>10} | {objective:>12.6f} "
            f"{format_bytes(result.memory['per_device_bytes']):>11} |"
        )
        if args.no_cpsat:
            print(row, flush=True)
            continue
        problem, _ = to_problem(ctx.tables, cap)
        cps, obj = _cpsat_in_child(problem, args.cpsat_limit, result.search["objective_ps"])
        print(f"{row} {cps:>12} {obj:>12}", flush=True)


def _cpsat(problem, limit_s: float, want_ps: int, out) -> None:
    tick = time.perf_counter()
    try:
        ref = solve_cpsat(problem, time_limit_s=limit_s)
        took = time.perf_counter() - tick
        obj = f"{ref.time / PS_PER_S:.6f}" + (" MISMATCH" if ref.optimal and ref.time != want_ps else "")
        out.put((f"{took:.1f} s" if ref.optimal else f"over {limit_s:g} s", obj))
    except (TimeoutError, InfeasibleError):
        out.put((f"over {limit_s:g} s", "-"))


def _cpsat_in_child(problem, limit_s: float, want_ps: int) -> tuple[str, str]:
    """CP-SAT in a forked child, so its memory stays out of this process's peak RSS column."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_cpsat, args=(problem, limit_s, want_ps, out))
    child.start()
    result = out.get()
    child.join()
    return result


if __name__ == "__main__":
    main()
