"""``autopar fidelity``: plans' predicted step time and memory against what the ranks measure.

    autopar calibrate -o p.toml && autopar fidelity --profile p.toml --ranks 4 --json f.json

The benchmark (``measure.benchmark``: models x meshes x plan variants) runs on
``ranks`` local CPU processes (gloo), or the ranks of a torchrun job.  Per model
and mesh, rank 0 prepares the model once and plans every variant under the given
profile; identical plans are measured once.  Every rank then compiles each plan
(``autopar.compile(plan=...)``) on the model with real, seeded weights and the same
global batch, warms each up, and times them in interleaved rounds: each round runs
every plan once, in an order that rotates by one per round, for
``steps_per_round`` training steps (forward, backward, ``AdamW.step()``,
``zero_grad()``) between two barriers, so the slowest rank sets the time and
background load falls on every plan alike.  A plan's time is the median over the
rounds and its spread (max - min) / median.  A contest follows (``contest_rounds`` > 0): the plans within
``contest_margin`` of the fastest median, and the search's own, run that many more interleaved rounds among
themselves, which their medians include: where plans are near-equal, whether the search's is within 5% of the
fastest is then decided on three times the rounds (a 5-round median of steps spreading 20% moves by about
5%).  Then each plan runs ``memory_steps``
steps under ``measure.peak_memory.step_peak_bytes`` on every rank: the peak is what the
allocator (CUDA) or PyTorch's profiler (CPU) saw, never a cost-model formula.  A
step's peak is its largest rank's; the plan's is the median over the steps, with
their spread (on CPU the timeline moves with the ranks' communication threads:
single steps of one plan measured up to 20% apart on a loaded machine).

The benchmark trains each model's own loss through a wrapper that returns the
loss alone (as a training loop that reads only the loss would compile it), so no
plan pays for gathering logits its prediction does not contain.

``summarize`` turns the results into the figures the issue asks for:
Spearman's rank correlation of predicted vs measured time per model x mesh,
per model and over all plans; the median and worst ``|predicted/measured - 1|``;
the worst memory error; and per model x mesh the measured time of the auto plan
over that of the fastest plan.  ``measure.fidelity_report`` prints and writes them.

A run that stops early (a rank failed, or the run passed its time: ``timeout_s`` seconds per case) keeps the
cases it finished: rank 0 writes them to a file after each case, and ``run_fidelity`` raises
``FidelityIncomplete`` holding them, which the CLI reports and writes like a whole run, marked incomplete.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import stats
from .benchmark import PIPELINE_AUTO, Benchmark, BenchModel, Variant, load_benchmark, mesh_axis_names
from .rounds import Rounds, contenders_from_rank0, machine_probe, measured_bubbles

__all__ = [
    "CALIBRATE_PASSES",
    "PlanResult",
    "CaseResult",
    "FidelityRun",
    "FidelityIncomplete",
    "loss_model",
    "plan_variants",
    "run_fidelity",
    "summarize",
]

log = logging.getLogger(__name__)

#: passes of each case's calibration under ``--calibrate`` (``calibrate.measure_rank``: each number the median over
#: them). Three, not calibrate's two: the median of two is their mean, so one pass the machine slowed moves every
#: number of the case's profile by half its slowdown; of three it is outvoted.
CALIBRATE_PASSES = 3


@dataclass(frozen=True)
class PlanResult:
    """One distinct plan of a case: what the cost model said and what the ranks measured.

    ``variants`` are the labels that planned to this same plan; ``family`` its
    classification.  ``measured_s`` is the median step over the rounds
    (``round_s``); ``peak_bytes`` the median over the measured steps
    (``peak_steps``) of the largest rank's peak in that step, ``held_bytes`` the
    bytes that rank held between steps.
    """

    variants: tuple[str, ...]
    family: str
    predicted_s: float
    predicted_compute_s: float
    predicted_comm_s: float
    predicted_bytes: int
    round_s: tuple[float, ...]
    peak_steps: tuple[int, ...]
    held_bytes: int
    predicted_bubble: float | None = None  # a pipelined plan's bubble fraction, predicted and measured
    measured_bubble: float | None = None

    @property
    def peak_bytes(self) -> int:
        return int(stats.median(self.peak_steps))

    @property
    def memory_spread(self) -> float:
        return stats.spread(self.peak_steps)

    @property
    def measured_s(self) -> float:
        return stats.median(self.round_s)

    @property
    def spread(self) -> float:
        return stats.spread(self.round_s)

    @property
    def time_error(self) -> float:
        return stats.relative_error(self.predicted_s, self.measured_s)

    @property
    def memory_error(self) -> float:
        return stats.relative_error(self.predicted_bytes, self.peak_bytes)


@dataclass(frozen=True)
class CaseResult:
    """One model on one mesh: its distinct plans, and the variants that had no plan (with the reason)."""

    model: str
    mesh: tuple[int, ...]
    plans: tuple[PlanResult, ...]
    infeasible: dict[str, str] = field(default_factory=dict)
    profile: str = ""  # the profile the case was planned with (``--calibrate``: its own, measured just before)
    probe_before_s: float | None = None  # the machine probe (``rounds.machine_probe``) just before planning
    probe_s: tuple[float, ...] = ()  # and at the start of each timed round

    @property
    def machine_slowdown(self) -> float | None:
        """How much slower the machine ran the probe while the plans were timed than when the case was planned
        (its profile calibrated): 1.0 a steady machine; 1.2 every prediction 20% short for the machine alone."""
        if self.probe_before_s is None or not self.probe_s:
            return None
        return stats.median(self.probe_s) / self.probe_before_s

    @property
    def key(self) -> str:
        return f"{self.model} {'x'.join(map(str, self.mesh))}"

    def plan_of(self, variant: str) -> PlanResult | None:
        return next((p for p in self.plans if variant in p.variants), None)


@dataclass(frozen=True)
class FidelityRun:
    """Everything one ``autopar fidelity`` run measured, and under what."""

    cases: tuple[CaseResult, ...]
    profile: str
    ranks: int
    benchmark: str
    wall_s: float
    planned: int  # the cases the run was to measure

    @property
    def complete(self) -> bool:
        return len(self.cases) >= self.planned


class FidelityIncomplete(RuntimeError):
    """The run stopped before its last case (``cause``: why); ``run`` holds the cases it finished."""

    def __init__(self, cause: Exception, run: FidelityRun) -> None:
        super().__init__(f"{cause} (finished {len(run.cases)} of {run.planned} cases)")
        self.run = run


def run_fidelity(
    *,
    profile: str,
    ranks: int,
    benchmark: Benchmark | None = None,
    timeout_s: float = 1800.0,
    calibrate_dir: str | None = None,
    calibrate_passes: int = CALIBRATE_PASSES,
) -> FidelityRun:
    """Measure ``benchmark`` (default: the fixed one) on ``ranks`` local gloo ranks, planned under ``profile``.

    ``calibrate_dir``: before each case the ranks calibrate the machine (``calibrate.calibrate_here``) and the
    case is planned with that profile (``profile`` its base), written to ``calibrate_dir/<model>-<mesh>.toml``: a
    machine whose speed drifts over the run's minutes is priced as it runs each case; ``calibrate_passes``: the
    passes of each such calibration (``CALIBRATE_PASSES``).

    ``timeout_s``: what each case may take (a case's calibration, planning and timing; also the longest a rank
    waits in one collective): the ranks are stopped once the run passes ``timeout_s`` per case.  A run stopped so,
    or by a failing rank, raises ``FidelityIncomplete`` with the cases it finished (module docstring).

    Under torchrun (``RANK``/``WORLD_SIZE`` set) this process is one rank and the
    job's world size must equal ``ranks``; rank 0 returns the run, the others None.
    """
    from .ranks import on_ranks

    bench = benchmark or load_benchmark()
    meshes = [m for m in bench.meshes if math.prod(m) == ranks]
    if not meshes:
        raise ValueError(
            f"--ranks {ranks}: no mesh of the benchmark ({[list(m) for m in bench.meshes]}) has {ranks} devices; "
            "pass --ranks equal to a mesh size"
        )
    from costmodel import load_profile

    load_profile(profile)  # an unknown profile fails here, before any rank starts
    planned = len(bench.models) * len(meshes)
    t0 = time.perf_counter()
    fd, finished = tempfile.mkstemp(prefix="autopar-fidelity-", suffix=".pickle")
    os.close(fd)
    try:
        cases = on_ranks(
            _rank_main,
            ranks,
            bench,
            profile,
            calibrate_dir,
            calibrate_passes,
            finished,
            timeout_s=timeout_s * planned,
            collective_timeout_s=timeout_s,
        )
    except Exception as e:
        done = _finished_cases(finished)
        if not done:
            raise
        run = FidelityRun(done, profile, ranks, bench.source, time.perf_counter() - t0, planned)
        raise FidelityIncomplete(e, run) from e
    finally:
        for path in (finished, finished + ".new"):  # ``.new``: rank 0 stopped while writing (``_keep_finished``)
            Path(path).unlink(missing_ok=True)
    if cases is None:  # a torchrun rank other than 0
        return None
    return FidelityRun(tuple(cases), profile, ranks, bench.source, time.perf_counter() - t0, planned)


def _finished_cases(path: str) -> tuple[CaseResult, ...]:
    """The cases rank 0 wrote to ``path`` as it finished them (``_rank_main``); none if it wrote none."""
    try:
        with open(path, "rb") as fh:
            return tuple(pickle.load(fh))
    except (OSError, EOFError, pickle.UnpicklingError):
        return ()


def _keep_finished(out: list[CaseResult], path: str) -> None:
    """Write the cases finished so far to ``path`` whole (a new file moved over the old one)."""
    with open(path + ".new", "wb") as fh:
        pickle.dump(out, fh)
    os.replace(path + ".new", path)


class _LossOnly(nn.Module):
    """The model's own loss and nothing else: no logits to gather that the plan does not price."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def loss_model(model: BenchModel, device: str) -> tuple[nn.Module, tuple]:
    """The benchmark model as the ranks train it: a module returning only the loss, and its (ids, labels)."""
    from autopar.models import load_model

    torch.manual_seed(0)
    hf, (ids,), kwargs = load_model(
        model.name, batch=model.batch, seq=model.seq, device=device, no_dropout=True, overrides=model.overrides
    )
    return _LossOnly(hf).train(), (ids, kwargs["labels"])


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"autopar fidelity: {text}", file=sys.stderr, flush=True)


def _rank_main(
    rank: int, world: int, bench: Benchmark, profile: str, calibrate_dir: str | None, passes: int, finished: str
):
    """One rank's whole benchmark (every case whose mesh has ``world`` devices); rank 0 returns the results, and
    writes those finished so far to ``finished`` after each case (``_keep_finished``)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    cases = [(m, mesh) for m in bench.models for mesh in bench.meshes if math.prod(mesh) == world]
    out = []
    for k, (model, mesh) in enumerate(cases, 1):
        t0 = time.perf_counter()
        where = f"[{k}/{len(cases)}] {model.name} on {'x'.join(map(str, mesh))}"
        priced = profile
        if calibrate_dir is not None:
            from .calibrate import calibrate_here
            from .calibration_report import write_profile

            priced = os.path.join(calibrate_dir, f"{model.name}-{'x'.join(map(str, mesh))}.toml")
            cal = calibrate_here(rank, world, profile, passes=passes)
            if cal is not None:  # rank 0, the one that plans
                write_profile(cal, priced)
                _say(rank, f"{where}: calibrated (repeats spread {cal.spread:.1%} in the median): {priced}")
        probe = machine_probe()
        before = stats.median([probe() for _ in range(5)])
        _say(rank, f"{where}: planning {len(bench.variants)} variants")
        plans, infeasible = _plans_from_rank0(rank, model, mesh, bench.variants, priced)
        _say(rank, f"[{k}/{len(cases)}] {len(plans)} distinct plans; compiling and timing")
        result, during = _measure_case(rank, model, mesh, plans, bench, probe)
        out.append(CaseResult(model.name, mesh, result, infeasible, priced, before, during))
        if rank == 0:
            _keep_finished(out, finished)
        _say(rank, f"[{k}/{len(cases)}] done in {time.perf_counter() - t0:.0f} s")
        gc.collect()
    return out if rank == 0 else None


def _plans_from_rank0(rank, model: BenchModel, mesh, variants: tuple[Variant, ...], profile: str):
    """([(variant labels, plan JSON)] of the distinct plans, {variant: why no plan}), the same on every rank."""
    import torch.distributed as dist

    box: list = [None]
    if rank == 0:
        try:
            box[0] = plan_variants(model, mesh, variants, profile)
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise RuntimeError(f"planning {model.name} on {mesh} failed on rank 0: {box[0]}") from box[0]
    return box[0]


def plan_variants(model: BenchModel, mesh, variants: tuple[Variant, ...], profile: str):
    from autopar.mesh import Mesh
    from autopar.planner import MemoryCapError, plan_from_context, prepare

    net, (ids, labels) = loss_model(model, "cpu")  # as the ranks run it: the traced graph depends on the device
    amesh = Mesh(mesh, axis_names=mesh_axis_names(mesh))
    ctx = prepare(net, amesh, example_inputs=(ids, labels), profile=profile, dtype="fp32", optimizer="adamw")
    auto = plan_from_context(ctx, compare_families=False)
    auto_bytes = auto.memory.per_device_bytes
    try:  # the least memory any plan reaches: caps are placed between it and the auto plan's
        plan_from_context(ctx, compare_families=False, mem_cap=1)
        least_bytes = 0
    except MemoryCapError as e:
        least_bytes = e.min_mem_bytes
    distinct: dict[str, tuple[list[str], str]] = {}
    infeasible: dict[str, str] = {}
    for variant in variants:
        try:
            options = variant.plan_options(model, auto_bytes, least_bytes)
            if variant.label == "auto":
                plan = auto
            elif variant.micro_batched:
                plan = _plan(net, amesh, (ids, labels), profile, options)
            else:
                plan = plan_from_context(ctx, compare_families=False, **options)
        except (MemoryCapError, ValueError) as e:
            infeasible[variant.label] = str(e).splitlines()[0]
            continue
        key = _plan_key(plan)
        distinct.setdefault(key, ([], plan.to_json()))[0].append(variant.label)
    return [(tuple(labels), text) for labels, text in distinct.values()], infeasible


def _plan(net, mesh, inputs: tuple, profile: str, options: dict):
    from autopar.planner import plan

    return plan(net, mesh, example_inputs=inputs, profile=profile, dtype="fp32", compare_families=False, **options)


def _plan_key(plan) -> str:
    """What makes two plans run alike: placements of every parameter, input and node, and the pipeline and
    micro-batches (not settings or hints)."""
    d = plan.to_dict()
    return json.dumps([d["params"], d["inputs"], d["nodes"], d.get("pipeline"), d.get("microbatches")], sort_keys=True)


def _measure_case(rank: int, model: BenchModel, mesh, plans, bench: Benchmark, probe) -> tuple[tuple, tuple]:
    """(each plan's ``PlanResult``, the machine probe's seconds at the start of each timed round)."""
    import torch.distributed as dist

    from autopar import compiled
    from autopar.mesh import Mesh
    from autopar.planner import Plan

    from .peak_memory import step_peak_bytes

    net, inputs = loss_model(model, "cpu")
    amesh = Mesh(mesh, axis_names=mesh_axis_names(mesh))
    runs = []
    for _, text in plans:
        plan = Plan.from_json(text)
        sharded = compiled.compile(net, amesh, example_inputs=inputs, plan=plan)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)
        runs.append((plan, sharded, opt))

    device = next(runs[0][1].parameters()).device  # the rank's: cuda:LOCAL_RANK under nccl

    def step(i: int) -> None:
        _, sharded, opt = runs[i]
        if sharded.plan.microbatches > 1:
            sharded.train_step(*inputs)  # the micro-batches, through the stages
        else:
            sharded(*inputs).backward()
        opt.step()
        opt.zero_grad()

    for i in range(len(runs)):
        for _ in range(bench.warmup_steps):
            step(i)
    times: list[list[float]] = [[] for _ in runs]
    busy = [0.0] * len(runs)  # this rank's pipeline stages' compute over the timed rounds
    scheduled = [0.0] * len(runs)  # and its time in the schedule's steps
    timed = Rounds(runs, step, bench.steps_per_round, device, times, busy, scheduled, probe)
    timed.run(range(len(runs)), bench.rounds)
    picked = contenders_from_rank0(rank, plans, times, bench.contest_margin)
    if bench.contest_rounds and len(picked) > 1:  # more rounds where the report's "auto over fastest" is decided
        _say(rank, f"contest: {bench.contest_rounds} more rounds of {len(picked)} plans near the fastest")
        timed.run(picked, bench.contest_rounds)
    peaks = []  # per plan: (each measured step's largest rank peak, that rank's held bytes)
    for i, (_, sharded, opt) in enumerate(runs):
        steps, held_by = [], 0
        held = [*sharded.parameters(), *(p.grad for p in sharded.parameters()), *sharded.buffers()]
        held += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]  # warm: state exists
        for _ in range(bench.memory_steps):  # the allocator timeline moves with the ranks' threads: a median
            peak = step_peak_bytes(lambda i=i: step(i), held, device)
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, (peak.peak_bytes, peak.held_bytes))
            top, held_by = max(every)
            steps.append(top)
        peaks.append((tuple(steps), held_by))
    bubbles = measured_bubbles(runs, busy, scheduled)
    out = []
    for (labels, _), (plan, _, _), t, (peak, held), bubble in zip(plans, runs, times, peaks, bubbles):
        out.append(
            PlanResult(
                tuple(labels),
                plan.family,
                plan.cost.total_s,
                plan.cost.compute_s,
                plan.cost.comm_s,
                plan.memory.per_device_bytes,
                tuple(t),
                peak,
                int(held),
                plan.pipeline.bubble_fraction if plan.pipeline is not None else None,
                bubble,
            )
        )
    return tuple(out), tuple(timed.probe_s)


def summarize(run: FidelityRun) -> dict[str, Any]:
    """The run's figures (the JSON ``autopar fidelity --json`` writes; see the module docstring)."""
    every = [p for c in run.cases for p in c.plans]
    cases: dict[str, Any] = {}
    for c in run.cases:
        auto, piped = c.plan_of("auto"), c.plan_of(PIPELINE_AUTO)
        fastest = min(p.measured_s for p in c.plans)
        cases[c.key] = {
            "spearman": _spearman(c.plans),
            "auto_over_fastest": auto.measured_s / fastest if auto is not None else None,
            "auto_is_fastest_within_5pct": auto is not None and auto.measured_s <= 1.05 * fastest,
            "pipeline_auto_over_fastest": piped.measured_s / fastest if piped is not None else None,
            "median_abs_error": stats.median([abs(p.time_error) for p in c.plans]),
            "plans": [_plan_json(p) for p in c.plans],
            "infeasible": dict(c.infeasible),
            "profile": c.profile,
            "machine_slowdown": c.machine_slowdown,
        }
    models = {}
    for name in dict.fromkeys(c.model for c in run.cases):
        mine = [p for c in run.cases if c.model == name for p in c.plans]
        models[name] = {"spearman": _spearman(mine), "plans": len(mine)}
    errors = [abs(p.time_error) for p in every]
    spreads = [p.spread for p in every]
    memory_spreads = [p.memory_spread for p in every]
    slowdowns = [c.machine_slowdown for c in run.cases if c.machine_slowdown is not None]
    return {
        "spearman": _spearman(every),
        "median_machine_slowdown": stats.median(slowdowns) if slowdowns else None,
        "median_abs_error": stats.median(errors),
        "worst_abs_error": max(errors),
        "memory_max_error": max(abs(p.memory_error) for p in every),
        "memory_median_abs_error": stats.median([abs(p.memory_error) for p in every]),
        "median_spread": stats.median(spreads),
        "worst_spread": max(spreads),
        "memory_median_spread": stats.median(memory_spreads),
        "memory_worst_spread": max(memory_spreads),
        "models": models,
        "cases": cases,
        "profile": run.profile,
        "ranks": run.ranks,
        "benchmark": run.benchmark,
        "wall_s": run.wall_s,
        "complete": run.complete,
        "cases_planned": run.planned,
    }


def _spearman(plans) -> float | None:
    value = stats.spearman([p.predicted_s for p in plans], [p.measured_s for p in plans])
    return None if math.isnan(value) else value


def _plan_json(p: PlanResult) -> dict[str, Any]:
    return {
        "variants": list(p.variants),
        "family": p.family,
        "predicted_s": p.predicted_s,
        "predicted_compute_s": p.predicted_compute_s,
        "predicted_comm_s": p.predicted_comm_s,
        "measured_s": p.measured_s,
        "round_s": list(p.round_s),
        "spread": p.spread,
        "time_error": p.time_error,
        "predicted_bytes": p.predicted_bytes,
        "peak_bytes": p.peak_bytes,
        "peak_steps": list(p.peak_steps),
        "memory_spread": p.memory_spread,
        "held_bytes": p.held_bytes,
        "memory_error": p.memory_error,
        "predicted_bubble": p.predicted_bubble,
        "measured_bubble": p.measured_bubble,
    }
