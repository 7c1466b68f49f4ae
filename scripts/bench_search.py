"""Planning time at depth: GPT-shaped models of 12..96 layers, chained search against CP-SAT.

    python scripts/bench_search.py                         # 12,24,48,96 layers, CP-SAT limit 600 s
    python scripts/bench_search.py --layers 12 96 --cpsat-limit 30
    python scripts/bench_search.py --no-cpsat --cap 40GiB
    python scripts/bench_search.py --layers 96 --no-cpsat --sweep   # lower the cap until no plan fits
    python scripts/bench_search.py --layers 12 96 --batches 8 16 32   # re-plan at other batch sizes

Each model: width 4096 (32 heads), seq 2048, vocab 50257, global batch 16, bf16 with fp32
optimizer state (AdamW), the h100 profile, mesh 8x8 (dp across nodes over InfiniBand, tp
inside a node over NVLink), per-device cap 80 GiB, built on the meta device (a
transformers GPT2Config).  Columns: capture s (torch.export + OpGraph), strategies s
(candidates + cost tables + the SearchProblem built from them), search s (the planner's
search, the chained exact DP over the repeated layers, from cold: the fastest of
``--repeat`` runs, each with what the solver derived dropped), x first (that time over the
first model's), cpu s and its x first (the same search's CPU time, which other processes
on a shared machine inflate less), peak RSS of this process so far, the objective (step
time), the plan's memory per device, and CP-SAT on the same SearchProblem (its time, or
'over N s'; run in a forked child so its memory is not in the RSS column).

``--sweep`` then takes the last model and lowers the cap step by step (each step
``--sweep-step`` below the previous plan's memory), re-planning the prepared context (the
block tables are reused across caps): per cap the search time, objective, memory per
device, the plan's family and where its parameter bytes are stored how; then the error
of the first cap no plan fits, which names the smallest memory reachable.
``--batches 8 16 32`` times re-planning at other batch sizes instead: per layer count, one
symbolic capture (``prepare(..., reuse_batch=True)``, at the first batch), then per batch a
fresh prepare + search (capture, strategies, search seconds) against the reused path
(``ctx.at_batch(b)``: specialize, strategies, search seconds), the speed-up (fresh total /
reused total), and whether the two plans' objectives, and their JSON, are equal.

Timings are wall-clock on this machine; run on an idle machine and take the min of runs.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import resource
import time
from collections import Counter

import torch
import transformers

from autopar.cost.saved import _CACHE as saved_calls
from autopar.mesh import Mesh
from autopar.planner.driver import MemoryCapError, plan_from_context, prepare
from autopar.planner.problem_tables import PS_PER_S, to_problem
from autopar.planner.solving import solve_problem
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
    ap.add_argument("--layers", nargs="+", default=["12,24,48,96"], help="layer counts (12 24 or 12,24)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--cap", default="80GiB", help="per-device memory cap")
    ap.add_argument("--cpsat-limit", type=float, default=600.0, help="CP-SAT time limit per model, seconds")
    ap.add_argument("--no-cpsat", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="search runs per model (cold each): the fastest is shown")
    ap.add_argument("--sweep", action="store_true", help="then lower the cap on the last model until no plan fits")
    ap.add_argument(
        "--sweep-step", type=float, default=0.15, help="each cap this fraction below the last plan's memory"
    )
    ap.add_argument("--batches", nargs="+", type=int, help="time re-planning at these global batches instead")
    args = ap.parse_args()
    mesh = Mesh(tuple(int(s) for s in args.mesh.split("x")), axis_names=("dp", "tp"))
    cap = parse_bytes(args.cap)
    if args.batches:
        batch_reuse(args, mesh, cap)
        return
    head = (
        f"{'layers':>6} {'nodes':>6} {'blocks':>6} | {'capture s':>9} {'strat s':>8} {'search s':>8} {'x first':>7} "
        f"{'cpu s':>6} {'x first':>7} "
        f"{'peak RSS':>10} | {'objective s':>12} {'mem/device':>11} | {'cpsat':>12} {'cpsat obj':>12}"
    )
    print(head, "-" * len(head), sep="\n")
    first = None
    for layers in (int(x) for arg in args.layers for x in arg.split(",")):
        model, margs, mkwargs = gpt_shaped(
            layers, width=args.width, heads=args.heads, vocab=args.vocab, seq=args.seq, batch=args.batch
        )
        ctx = prepare(model, mesh, example_inputs=margs, example_kwargs=mkwargs, profile="h100", dtype="bf16")
        search_s, cpu_s = [], []
        for _ in range(max(1, args.repeat)):
            ctx.tables.problem(None)[0].forget()  # cold: block tables and min-sums built again
            result = plan_from_context(ctx, mem_cap=cap, compare_families=False)
            search_s.append(result.timings["search_s"])
            ctx.tables.problem(None)[0].forget()
            tick = time.process_time()  # the same search, CPU time: what other processes cannot inflate
            solve_problem(ctx.tables.problem(cap)[0], "dp", ctx.blocks)
            cpu_s.append(time.process_time() - tick)
        t = result.timings
        first = first or (min(search_s), min(cpu_s))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        objective = result.search.objective_ps / PS_PER_S
        blocks = ctx.blocks.count if ctx.blocks else 0
        row = (
            f"{layers:>6} {len(ctx.graph.nodes):>6} {blocks:>6} | {t['capture_s']:>9.2f} {t['strategies_s']:>8.2f} "
            f"{min(search_s):>8.3f} {min(search_s) / first[0]:>7.2f} {min(cpu_s):>6.3f} {min(cpu_s) / first[1]:>7.2f} "
            f"{format_bytes(rss):>10} | {objective:>12.6f} "
            f"{format_bytes(result.memory.per_device_bytes):>11} |"
        )
        if args.no_cpsat:
            print(row, flush=True)
            continue
        problem, _ = to_problem(ctx.tables, cap)
        cps, obj = _cpsat_in_child(problem, args.cpsat_limit, result.search.objective_ps)
        print(f"{row} {cps:>12} {obj:>12}", flush=True)
    if args.sweep:
        sweep(ctx, cap, args.sweep_step)


def batch_reuse(args, mesh: Mesh, cap: int) -> None:
    """Fresh prepare + plan at each batch against one symbolic capture re-used (see the module docstring)."""
    head = (
        f"{'layers':>6} {'batch':>5} | {'capture s':>9} {'strat s':>8} {'search s':>8} {'fresh s':>8} | "
        f"{'special s':>9} {'strat s':>8} {'search s':>8} {'reused s':>8} | {'speed-up':>8} {'same obj':>8} "
        f"{'same json':>9}"
    )
    print("fresh: prepare + plan at each batch; reused: ctx.at_batch(batch) + plan", head, "-" * len(head), sep="\n")
    for layers in (int(x) for arg in args.layers for x in arg.split(",")):
        shape = {"width": args.width, "heads": args.heads, "vocab": args.vocab, "seq": args.seq}
        model, margs, mkwargs = gpt_shaped(layers, batch=args.batches[0], **shape)
        tick = time.perf_counter()
        ctx = prepare(
            model, mesh, example_inputs=margs, example_kwargs=mkwargs, profile="h100", dtype="bf16", reuse_batch=True
        )
        took = time.perf_counter() - tick
        why = "" if ctx.template.symbolic else f": not symbolic, {ctx.template.reason}"
        print(
            f"{layers:>6} one symbolic capture at batch {args.batches[0]}: {ctx.timings['capture_s']:.2f} s "
            f"(prepare {took:.2f} s){why}",
            flush=True,
        )
        for batch in args.batches:
            saved_calls.clear()  # both paths start without the per-call cache of what ops save for backward
            reused = plan_from_context(ctx.at_batch(batch), mem_cap=cap, compare_families=False)
            saved_calls.clear()
            model, margs, mkwargs = gpt_shaped(layers, batch=batch, **shape)
            fresh_ctx = prepare(model, mesh, example_inputs=margs, example_kwargs=mkwargs, profile="h100", dtype="bf16")
            fresh = plan_from_context(fresh_ctx, mem_cap=cap, compare_families=False)
            del fresh_ctx, model
            f, r = fresh.timings, reused.timings
            fresh_s = f["capture_s"] + f["strategies_s"] + f["search_s"]
            reused_s = r["capture_s"] + r["specialize_s"] + r["strategies_s"] + r["search_s"]
            same_obj = fresh.search.objective_ps == reused.search.objective_ps
            print(
                f"{layers:>6} {batch:>5} | {f['capture_s']:>9.2f} {f['strategies_s']:>8.2f} {f['search_s']:>8.3f} "
                f"{fresh_s:>8.2f} | {r['specialize_s'] + r['capture_s']:>9.2f} {r['strategies_s']:>8.2f} "
                f"{r['search_s']:>8.3f} {reused_s:>8.2f} | {fresh_s / reused_s:>7.2f}x {str(same_obj):>8} "
                f"{str(fresh.to_json() == reused.to_json()):>9}",
                flush=True,
            )


def sweep(ctx, cap: int, step: float) -> None:
    """Lower the cap below each plan's memory until no plan fits (see the module docstring)."""
    head = f"{'cap':>11} {'search s':>8} {'objective s':>12} {'mem/device':>11}  {'family':<40} "
    head += "where the parameter bytes live"
    print(f"\ncap sweep, {ctx.graph.model_name} ({len(ctx.graph.nodes)} nodes)", head, "-" * len(head), sep="\n")
    while True:
        tick = time.perf_counter()
        try:
            plan = plan_from_context(ctx, mem_cap=cap, compare_families=False)
        except MemoryCapError as err:
            took = time.perf_counter() - tick
            print(f"{format_bytes(cap):>11} {took:>8.3f}  infeasible (time: search + error message):\n{err}")
            return
        mem = plan.memory.per_device_bytes
        print(
            f"{format_bytes(cap):>11} {plan.timings['search_s']:>8.3f} {plan.cost.total_s:>12.6f} "
            f"{format_bytes(mem):>11}  {plan.family:<40} {_where(plan)}",
            flush=True,
        )
        cap = int(min(cap, mem) * (1 - step))


def _where(plan) -> str:
    """The two commonest (stored, optimizer state) placements of the parameters, by bytes."""
    share: Counter = Counter()
    for p in plan.params.values():
        key = f"{','.join(map(str, p.placements))} state {','.join(map(str, p.state_placements))}"
        share[key] += math.prod(p.shape)
    total = sum(share.values())
    return "; ".join(f"[{k}] {100 * v / total:.0f}%" for k, v in share.most_common(2))


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
