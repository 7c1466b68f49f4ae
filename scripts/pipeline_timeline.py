"""A pipelined plan's schedule as its ranks ran it, action by action, against the schedule the cost model simulated.

    python -m torch.distributed.run --nproc-per-node 4 scripts/pipeline_timeline.py llama-bench --mesh 4 \\
        --variant pipeline:tp/1f1b/m4 --profile docs/measurements/cpu4-2026-12-02-views-profiles/llama-bench-4.toml

For finding where ``autopar fidelity``'s predicted step of a pipelined plan parts from the measured one: the
fidelity benchmark's ``--variant`` (``pipeline:<axis>/<schedule>/m<N>``, or ``pipeline:auto``) is planned with
``--profile`` as the harness plans it, compiled on the torchrun ranks (gloo, one thread each, as the harness runs
them), warmed up, and ``--steps`` training steps run with every stage's forward and backward of a micro-batch
timed on its rank (``time.perf_counter``: one clock for the processes of a host).  For the median step it prints:

* per stage: the plan's forward + backward of one micro-batch (at full load, every rank computing: the profile's
  rate) and the measured median forward and backward;
* per rank: its actions in order with start, length, and the *gap* before each: the time from the moment the
  action could start (the rank free and, for an action that reads another rank's value, that action ended) to its
  start: a transfer, the schedule's own work (posting sends and receives), or a rank not scheduled on a core;
* the measured schedule time and bubble, the plan's predicted ones, a *replay*: the list schedule
  (``cost.pipeline.schedule_run``) of the measured action lengths with no transfer time, so that measured minus
  replay is what the gaps cost on the critical path;
* per rank: the median time of the schedule's steps, of the rest of ``train_step`` (splitting the batch, the
  loss's sum over the pipeline, a shared weight's gradient sum) and of the optimizer's step with ``zero_grad``.

Printed figures only; the cost model is not changed by it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from peak_composition import _variant_plan, prepared  # scripts/ is on the path when run as a script

import autopar
from autopar.cost.pipeline import Action, dependencies, schedule_run
from autopar.measure.benchmark import load_benchmark
from autopar.runtime import init_distributed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a model of the benchmark (configs/benchmarks/fidelity.toml by default)")
    ap.add_argument("--mesh", default="4", help="mesh shape, e.g. 4 or 2x2 (as many torchrun processes)")
    ap.add_argument("--benchmark", default=None, help="the fidelity benchmark file (default the fixed one)")
    ap.add_argument("--variant", required=True, help="a pipelined fidelity variant, e.g. pipeline:tp/1f1b/m4")
    ap.add_argument("--profile", default="cpu", help="device profile (name or TOML), as the harness plans with")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    init_distributed("gloo")
    torch.set_num_threads(1)  # as autopar fidelity runs its ranks
    model = next((m for m in load_benchmark(a.benchmark).models if m.name == a.model), None)
    if model is None:
        raise SystemExit(f"{a.model} is not a model of the benchmark")
    net, inputs, mesh, ctx = prepared(model, a.mesh, a.profile)
    plan = _variant_plan(ctx, model, a.variant, net, inputs, a.profile)
    if plan.pipeline is None:
        raise SystemExit(f"variant {a.variant}: the plan has no pipeline ({plan.family})")
    sharded = autopar.compile(net, mesh, example_inputs=inputs, plan=plan)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
    sharded.train_step(*inputs)  # builds the runner
    runner = sharded._runner
    log: list[tuple[str, int, int, float, float]] = []  # (kind, stage, micro-batch, start, end)
    for stage in runner.stages:
        _record(stage, "forward_one_chunk", "F", log)
        _record(stage, "backward_one_chunk", "B", log)
    steps = []
    for i in range(a.warmup + a.steps):
        log.clear()
        dist.barrier()
        before = runner.schedule_s
        t0 = time.perf_counter()
        sharded.train_step(*inputs)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= a.warmup:
            steps.append((t0, t1, list(log), runner.schedule_s - before, t2 - t1))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, steps)
    if dist.get_rank() == 0:
        _report(plan, every, a)
    dist.destroy_process_group()


def _record(stage, method: str, kind: str, log: list) -> None:
    """Wrap ``stage.method`` so each call appends (kind, stage index, micro-batch, start, end) to ``log``."""
    inner = getattr(stage, method)

    def timed(*args, **kwargs):
        micro = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            log.append((kind, stage.stage_index, int(micro), t0, time.perf_counter()))

    setattr(stage, method, timed)


def _report(plan, every: list, a) -> None:
    """Print the median step's timeline (module docstring)."""
    pipe, m = plan.pipeline, plan.microbatches
    stages = len(pipe.stages)
    world_p = stages // pipe.virtual
    walls = [max(e[i][1] for e in every) - min(e[i][0] for e in every) for i in range(len(every[0]))]
    i = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]
    t0 = min(e[i][0] for e in every)
    acts = {Action(k, s, mb): (b - t0, e - t0) for rank in every for k, s, mb, b, e in rank[i][2]}
    head = f"{a.model} mesh {a.mesh} {a.variant}: {plan.family}"
    print(f"{head}, {stages} stages over {world_p} ranks, {m} micro-batches")
    print(f"profile {a.profile}; median of {len(walls)} steps (train_step, without the optimizer)")
    print("stage  predicted F+B   measured F      B    (medians over micro-batches and steps)")
    fwd, bwd = [], []
    for j, part in enumerate(pipe.stages):
        f = statistics.median(e - b for r in every for s in r for k, st, _, b, e in s[2] if k == "F" and st == j)
        g = statistics.median(e - b for r in every for s in r for k, st, _, b, e in s[2] if k == "B" and st == j)
        fwd.append(f)
        bwd.append(g)
        print(f"{j:5d}  {part.time_s * 1e3:9.1f} ms  {f * 1e3:8.1f} ms {g * 1e3:8.1f} ms")
    busy = []
    for r in range(world_p):
        mine = sorted((v[0], v[1], act) for act, v in acts.items() if act.stage % world_p == r)
        busy.append(sum(e - b for b, e, _ in mine))
        free, line = 0.0, []
        for b, e, act in mine:
            ready = max([free] + [acts[d][1] for d in dependencies(act, stages) if d in acts])
            name = f"{act.kind}{act.stage}.{act.micro}"
            line.append(f"{name} @{b * 1e3:.0f} +{(e - b) * 1e3:.1f} gap {(b - ready) * 1e3:.1f}")
            free = e
        print(f"rank {r}: " + "; ".join(line))
    wall = walls[i]
    replay = schedule_run(pipe.schedule, fwd, bwd, m, v=pipe.virtual)
    print(f"measured schedule {wall * 1e3:.1f} ms, bubble {1 - statistics.mean(busy) / wall:.2f}")
    print(f"replay of the measured lengths, no transfer time: {replay.step_s * 1e3:.1f} ms")
    for r, steps in enumerate(every):  # the step's parts on each rank, medians over the steps
        inside = statistics.median(s[3] for s in steps)
        around = statistics.median(s[1] - s[0] - s[3] for s in steps)
        opt = statistics.median(s[4] for s in steps)
        parts = f"schedule {inside * 1e3:.1f} ms, rest of train_step {around * 1e3:.1f} ms"
        print(f"rank {r}: {parts}, optimizer {opt * 1e3:.1f} ms")
    print(f"plan: step {plan.cost.total_s * 1e3:.1f} ms (with the optimizer), bubble {pipe.bubble_fraction:.2f}")
    for key, value in plan.cost.terms.items():
        print(f"  {key}: {value * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
