"""One fidelity case's plans on local CPU ranks, phase by phase: each plan's price against its phases' wall time
and the CPU time its ranks spent.

    python scripts/rank_phases.py llama-bench 4 --profile p.toml
    python scripts/rank_phases.py gpt2-bench 2x2 --variants "auto,family:tensor parallel" --steps 10

Where ``autopar fidelity`` finds every plan predicted below what it measures by about one level (0.81 on
2026-12-02, below 1 in every whole run kept in ``docs/measurements/``), this splits the excess in two.  The case's
variants (``configs/benchmarks/fidelity.toml``'s names; pipelined and accumulated plans are skipped: their steps go
through ``train_step``) are planned with ``--profile`` as the harness plans them
(``measure.fidelity.plan_variants``), compiled on ``--ranks`` gloo ranks (one thread each), warmed up, and each
run ``--steps`` times alone, every step between two barriers (``measure.step_phases.timed_step``: forward,
backward, the AdamW step with ``zero_grad``).  Per plan it prints:

* the price: the step, and its terms (``Plan.cost.terms``: ops, optimizer step, each collective kind);
* ``wall``: the median step over the barriers, and each phase's median on rank 0;
* ``cpu``: the CPU time of every rank's process (its threads, gloo's included) summed over the ranks, per step,
  and that over the cores the ranks can use (``os.sched_getaffinity``, at most one per rank): what the step would
  take were those cores never idle;
* ``idle``: ``wall - cpu / cores`` over ``wall``, the share of the step no rank's CPU used (a rank waiting in a
  collective for one the scheduler has not run yet, with more ranks than cores); and ``cpu / cores`` over the
  price: the CPU work the price misses or adds.

Printed figures only; the cost model is not changed by it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from autopar.cli_types import mesh_shape
from autopar.measure import fidelity
from autopar.measure.benchmark import load_benchmark, mesh_axis_names
from autopar.measure.ranks import on_ranks
from autopar.measure.step_phases import PHASES, timed_step


def _rank(rank: int, world: int, model_name: str, mesh: tuple, labels: list[str], profile: str, steps: int):
    """On every rank: plan (rank 0), compile, time; rank 0 returns [(plan, wall s, phase walls, phase CPUs summed)]."""
    import torch.distributed as dist

    from autopar import compiled
    from autopar.mesh import Mesh
    from autopar.planner import Plan

    torch.set_num_threads(1)
    bench = load_benchmark()
    model = next(m for m in bench.models if m.name == model_name)
    variants = tuple(v for v in bench.variants if v.label in labels)
    plans, _ = fidelity._plans_from_rank0(rank, model, mesh, variants, profile)
    net, inputs = fidelity.loss_model(model, "cpu")
    amesh = Mesh(mesh, axis_names=mesh_axis_names(mesh))
    out = []
    for names, text in plans:
        plan = Plan.from_json(text)
        if plan.microbatches > 1:
            continue
        sharded = compiled.compile(net, amesh, example_inputs=inputs, plan=plan)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
        for _ in range(2):
            timed_step(sharded, inputs, {}, opt)
        walls, phases = [], []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            _, each = timed_step(sharded, inputs, {}, opt)
            dist.barrier()
            walls.append(time.perf_counter() - t0)
            phases.append(each)
        cpu = [sum(p[k][1] for p in phases) / steps for k in range(len(PHASES))]
        every: list = [None] * world
        dist.all_gather_object(every, cpu)
        summed = [sum(r[k] for r in every) for k in range(len(PHASES))]
        phase_walls = [statistics.median(p[k][0] for p in phases) for k in range(len(PHASES))]
        out.append((names, plan, statistics.median(walls), phase_walls, summed))
        del sharded, opt
    return out if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a model of the fixed benchmark, e.g. llama-bench")
    ap.add_argument("mesh", type=mesh_shape, help="its mesh, e.g. 4 or 2x2 (the ranks are its size)")
    ap.add_argument(
        "--variants",
        default="auto,family:data parallel,family:sharded parameters,family:tensor parallel",
        help="comma-separated variants of the benchmark",
    )
    ap.add_argument("--profile", default="cpu", help="the profile to plan and price with (a calibrated TOML)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per plan")
    a = ap.parse_args()
    ranks = math.prod(a.mesh)
    rows = on_ranks(
        _rank,
        ranks,
        a.model,
        a.mesh,
        a.variants.split(","),
        a.profile,
        a.steps,
        timeout_s=1800,
        collective_timeout_s=600,
    )
    cores = min(len(os.sched_getaffinity(0)), ranks)  # one thread per rank
    for names, plan, wall, phase_walls, summed in rows:
        priced, busy = plan.cost.total_s, sum(summed) / cores
        print(f"{', '.join(names)}: {plan.family}")
        print(f"  price {priced * 1e3:.0f} ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in plan.cost.terms.items()))
        print(
            f"  wall {wall * 1e3:.0f} ms ("
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in zip(PHASES, phase_walls))
            + f"); cpu of {ranks} ranks {sum(summed) * 1e3:.0f} ms ("
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in zip(PHASES, summed))
            + f"), over {cores} cores {busy * 1e3:.0f} ms"
        )
        print(
            f"  price / wall {priced / wall:.2f}; idle {(wall - busy) / wall:.0%} of the wall; "
            f"cpu over the cores / price {busy / priced:.2f}"
        )


if __name__ == "__main__":
    main()
