"""``autopar calibrate``: measure this machine into a device profile the cost model reads.

    autopar calibrate -o mine.toml                 # 4 local CPU ranks on gloo (what `autopar run` spawns)
    torchrun --nproc-per-node 8 -m autopar.cli calibrate -o node.toml    # GPUs: nccl, one per rank
    autopar plan MODEL --profile mine.toml ...     # plan with it

Every rank measures at the same time, as in a training job (on a CPU box with more
ranks than cores the contention is part of every number, as it is in the job):

* **matmul rates** per dtype (float32, bfloat16, float16) on GEMMs shaped like
  a transformer layer's (tokens x d x 4d, tokens x 4d x d, their weight-gradient
  transposes; d = 256, 512 on CPU ranks, 1024, 4096 on GPUs, where smaller ones are
  launch-bound), summarized by the median (``peak_flops``); each shape's ratio to
  it is printed as a residual;
* **memory bandwidth** of a large copy and a large add (read + write bytes / s;
  32 MiB tensors on CPU, 256 MiB on GPUs: past the caches);
* **fused attention and the optimizer step** against that roofline
  (``measure.kernel_rates``): ``attention_efficiency`` and
  ``attention_backward_efficiency`` (scaled_dot_product_attention's rate over the
  matmul rate), ``optimizer_op_overhead_s`` and ``optimizer_bandwidth_bytes_per_s``
  (AdamW's step on two parameter sets);
* **per-op overhead of autopar's runtime**: a small model of many tiny ops through
  ``autopar.compile`` under an all-replicated plan (no collective), forward per op
  and backward per op (``forward_op_overhead_s``, ``backward_op_overhead_s``);
  on a GPU this is the host's time per op (``host_runs_ahead``: it overlaps the
  kernels), and the base profile's ``kernel_overhead_s`` stays the device's gap
  between kernels;
* **collectives**, every kind the runtime issues (all_reduce, all_gather,
  reduce_scatter as the runtime runs it on the backend, all_to_all), for each
  group size (2, 4, ... up to the world; the world's ranks split into groups of
  consecutive ranks that run at once, as a mesh axis does), over message sizes
  from 16 KiB to 16 MiB: each the slowest rank's median over ``trials``.  Each
  (kind, group size) is fitted to the cost model's formula
  ``t = latency + factor(n) * nbytes / bandwidth`` (``measure.fit``), printed with
  its residuals, and written as the link's ``collectives`` table
  (``costmodel.comm`` uses it in place of the ring estimate);
* **core lending**, where CPU ranks outnumber the cores: how much faster a rank
  computes while only some compute, per action length (``measure.lending_ring``;
  the profile's ``[core_lending]`` table, ``costmodel.lending``).

What one machine cannot measure (an inter-node link, the device memory of a GPU
model you do not have) comes from ``base``: the profile the measured one starts
from (default ``cpu`` on gloo, ``h100``/``a100`` on CUDA by device name).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from costmodel import CoreLending

from .fit import LineFit, RateFit, fit_latency_bandwidth, fit_rate
from .kernel_rates import attention_points, optimizer_rates
from .lending_ring import LENGTHS_MS, measure_lending
from .op_overhead import runtime_op_overhead
from .stats import median_of

__all__ = [
    "Calibration",
    "calibrate",
    "compute_chunk",
    "measure_rank",
    "rank_device",
    "sync_device",
    "COLLECTIVE_KINDS",
    "MAX_SPREAD",
    "SIZES_BYTES",
]

#: The most the repeats of a point may spread, in the median over the points ((max - min) / median of each point's
#: ``trials`` timings), for ``autopar calibrate`` to write its profile without ``--force``: a calibration measured
#: while another process ran gave plans 1.3x slower than the fastest (issue 32).  4 ranks on this repository's
#: 2-core machine spread 13-15% on 2026-11-28 with nothing else running (over 3 and 5 trials): on so few cores the
#: threshold asks for --force, and fidelity is the check.
MAX_SPREAD = 0.10

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: message sizes (the cost model's nbytes of each kind, costmodel/comm.py)
SIZES_BYTES = (16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _layer_gemms(sizes) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) of a transformer layer's GEMMs for each (tokens, d): x @ W (up and down projections)
    and the weight gradient x^T @ dy."""
    return tuple(shape for tokens, d in sizes for shape in ((tokens, d, 4 * d), (tokens, 4 * d, d), (d, tokens, 4 * d)))


# CPU ranks train small models (d = 256, 512 on 512 and 2048 tokens); a GPU's rate is only reached by the
# GEMMs of the models it trains (d = 1024 .. 4096 on 4096 and 8192 tokens): smaller ones are launch-bound
_GEMMS = _layer_gemms(((512, 256), (2048, 256), (512, 512), (2048, 512)))
_GPU_GEMMS = _layer_gemms(((4096, 1024), (8192, 1024), (4096, 4096), (8192, 4096)))


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured, the fits, and the profile they make (``profile_dict``)."""

    machine: str
    backend: str
    ranks: int
    date: str
    matmul: dict[str, RateFit]
    bandwidth: RateFit
    forward_op_s: float
    backward_op_s: float
    view_op_s: float
    ops: int
    collectives: dict[str, dict[int, LineFit]]
    collective_points: dict[str, dict[int, list[tuple[int, float]]]]
    base: dict[str, Any]
    overlap: dict[str, float] | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    spreads: list[float] = field(default_factory=list)  # per point timed: (max - min) / median of its repeats
    load_before: float | None = None  # the machine's 1-minute load average before calibrate's ranks started
    cores: int = 0  # the cores this process may run on
    lending: CoreLending | None = None  # measured where CPU ranks outnumber the cores
    attention: dict[str, RateFit] | None = None  # "forward"/"backward": scaled_dot_product_attention's flop/s
    attention_dtype: str = "float32"  # the dtype attention was timed in (its matmul rate is the reference)
    optimizer: dict[str, float] | None = None  # kernel_rates.optimizer_rates
    passes: int = 1  # how many times every number was measured (its median over them is kept)

    def attention_efficiency(self, direction: str) -> float:
        """Attention's median rate in ``direction`` ("forward", "backward") over the matmul rate of its dtype."""
        return self.attention[direction].rate / self.matmul[self.attention_dtype].rate

    @property
    def spread(self) -> float:
        """The median spread of the points' repeats (0.0 with one repeat each)."""
        return statistics.median(self.spreads) if self.spreads else 0.0

    @property
    def busy(self) -> bool:
        """Whether the machine was busy when calibrate started: a load average over half its cores."""
        return self.load_before is not None and self.cores > 0 and self.load_before > self.cores / 2

    @property
    def source(self) -> str:
        return (
            f"measured by autopar calibrate on {self.machine}, {self.date}, {self.ranks} {self.backend} ranks "
            f"(torch {torch.__version__})"
        )

    def profile_dict(self, name: str) -> dict[str, Any]:
        """The device profile (TOML table) of this calibration: ``base`` with every measured key replaced."""
        prof = {k: v for k, v in self.base.items()}
        prof["name"] = name
        prof["source"] = self.source
        prof["peak_flops"] = {k: fit.rate for k, fit in self.matmul.items()}
        prof["mem_bandwidth_bytes_per_s"] = self.bandwidth.rate
        prof["matmul_efficiency"] = 1.0  # the rates are achieved ones
        prof["memory_efficiency"] = 1.0
        prof["forward_op_overhead_s"] = self.forward_op_s
        prof["backward_op_overhead_s"] = self.backward_op_s
        if self.backend != "nccl":  # a GPU's gap between queued kernels is not the host's overhead: the base's
            prof["kernel_overhead_s"] = (self.forward_op_s + self.backward_op_s) / 2
        prof["view_op_overhead_s"] = self.view_op_s
        prof["optimizer_foreach"] = self.backend == "nccl"  # torch.optim's default: foreach for CUDA tensors
        prof["host_runs_ahead"] = self.backend == "nccl"  # a CUDA stream: the host's overhead overlaps kernels
        if self.backend != "nccl":  # CPU ranks share this machine's cores (DeviceProfile.compute_speed)
            prof["cores_per_node"] = self.cores
        prof.pop("core_lending", None)  # the base's table is another machine's
        if self.attention is not None:
            prof["attention_efficiency"] = self.attention_efficiency("forward")
            prof["attention_backward_efficiency"] = self.attention_efficiency("backward")
        if self.optimizer is not None:
            prof["optimizer_op_overhead_s"] = self.optimizer["op_overhead_s"]
            prof["optimizer_bandwidth_bytes_per_s"] = self.optimizer["bandwidth_bytes_per_s"]
        if self.lending is not None:
            prof["core_lending"] = self.lending.to_table()
        if self.overlap is not None:  # the measured hidden fraction, kept in the profile's range [0, 1)
            prof["grad_reduce_overlap"] = min(max(self.overlap["hidden"], 0.0), 0.95)
        if self.collectives:
            link = dict(prof["intra_node"])
            link["name"] = f"{self.backend}-measured"
            link["source"] = self.source
            link["collectives"] = {
                kind: {
                    "group_sizes": sorted(per_size),
                    "latency_s": [per_size[n].latency_s for n in sorted(per_size)],
                    "bandwidth_bytes_per_s": [per_size[n].bandwidth_bytes_per_s for n in sorted(per_size)],
                    "sizes_bytes": [x for x, _ in self.collective_points[kind][min(per_size)]],
                    "seconds": [[t for _, t in self.collective_points[kind][n]] for n in sorted(per_size)],
                }
                for kind, per_size in self.collectives.items()
            }
            largest = max(next(iter(self.collectives.values())))
            ring = self.collectives["all_gather"][largest]
            link["latency_s"] = ring.latency_s / max(largest - 1, 1)  # the ring estimate's per-step alpha
            link["bandwidth_bytes_per_s"] = ring.bandwidth_bytes_per_s
            prof["intra_node"] = link
            if self.ranks <= prof.get("devices_per_node", self.ranks):
                prof["devices_per_node"] = max(prof.get("devices_per_node", 1), self.ranks)
        return prof


def calibrate(
    *,
    ranks: int = 4,
    base: str | None = None,
    trials: int = 3,
    timeout_s: float = 600.0,
    quick: bool = False,
    passes: int = 2,
) -> Calibration:
    """Measure this machine on ``ranks`` local CPU ranks (gloo), or as the ranks of a torchrun job.

    Under torchrun (``RANK``/``WORLD_SIZE`` set) every rank calls this and rank 0
    returns the calibration (the others None); CUDA ranks use nccl, one GPU each.
    ``quick`` measures three GEMM shapes and two message sizes only (a smoke check,
    not a profile to plan with); ``passes``: how many times the whole set is measured, each number the median
    over them (``measure_rank``).
    """
    from .ranks import on_ranks

    if ranks < 1:
        raise ValueError(f"--ranks {ranks}: expected at least 1 rank")
    if passes < 1:
        raise ValueError(f"--passes {passes}: expected at least 1 pass")
    t0, load = time.perf_counter(), os.getloadavg()[0]  # before this command's own ranks start
    raw = on_ranks(measure_rank, ranks, trials, quick, passes, timeout_s=timeout_s)
    if raw is None:  # a torchrun rank other than 0
        return None
    return _calibration(dict(raw, load_before=load), base, time.perf_counter() - t0)


def _calibration(raw: dict[str, Any], base: str | None, wall_s: float) -> Calibration:
    from costmodel import profile_dict

    backend, device = raw["backend"], raw["device"]
    base_name = base or ("cpu" if device == "cpu" else _gpu_base(raw["device_name"]))
    base_dict = profile_dict(base_name)
    if device != "cpu":
        base_dict["memory_bytes"] = raw["device_memory_bytes"]
    if backend == "gloo":
        base_dict["reduce_scatter"] = "all_reduce"
    from costmodel import bandwidth_factor

    emulated = backend != "nccl"  # the runtime all-reduces and slices for a reduce-scatter (MeshGroups)
    collectives = {
        kind: {
            n: fit_latency_bandwidth([(bandwidth_factor(kind, n, emulated) * x, t) for x, t in points])
            for n, points in per_size.items()
        }
        for kind, per_size in raw["collectives"].items()
        if per_size  # one rank: no group to measure, the base profile's links stay
    }
    return Calibration(
        machine=raw["machine"],
        backend=backend,
        ranks=raw["ranks"],
        date=datetime.date.today().isoformat(),
        matmul={k: fit_rate(v) for k, v in raw["matmul"].items()},
        bandwidth=fit_rate(raw["bandwidth"]),
        forward_op_s=raw["forward_op_s"],
        backward_op_s=raw["backward_op_s"],
        view_op_s=raw["view_op_s"] if device == "cpu" else 0.0,  # a GPU's host runs ahead of its views
        ops=raw["ops"],
        collectives=collectives,
        collective_points=raw["collectives"],
        base=base_dict,
        overlap=raw.get("overlap"),
        wall_s=wall_s,
        spreads=list(raw.get("spreads", ())),
        load_before=raw.get("load_before"),
        cores=raw.get("cores", 0),
        lending=raw.get("lending"),
        attention={k: fit_rate(v) for k, v in raw["attention"].items()},
        attention_dtype=raw["attention_dtype"],
        optimizer=raw["optimizer"],
        passes=raw.get("passes", 1),
    )


def calibrate_here(
    rank: int, world: int, base: str, trials: int = 3, quick: bool = False, passes: int = 2
) -> Calibration | None:
    """Calibrate on the ranks of the running job (every rank calls this, as ``measure_rank``; ``base``: the profile
    of what it does not measure): the calibration on rank 0, None on the others.  ``autopar fidelity --calibrate``
    runs it before each case; ``quick`` and ``passes``: as ``calibrate``'s."""
    t0, load = time.perf_counter(), os.getloadavg()[0]
    raw = measure_rank(rank, world, trials, quick, passes)
    if raw is None:
        return None
    return _calibration(dict(raw, load_before=load), base, time.perf_counter() - t0)


def _gpu_base(device_name: str) -> str:
    name = device_name.lower()
    return "h100" if "h100" in name or "h200" in name else "a100"


# ---- on every rank --------------------------------------------------------------------


def measure_rank(rank: int, world: int, trials: int, quick: bool = False, passes: int = 1) -> dict[str, Any] | None:
    """Every measurement of the module docstring on this rank; rank 0 returns them (slowest rank's times).

    The whole set is measured ``passes`` times, one pass after the other, and each number is the median over the
    passes (``stats.median_of``): on a shared machine whose speed moves from one minute to the next, two
    calibrations a minute apart priced the same plans up to 30% apart (2026-11-30), and a pass's own repeats,
    seconds apart, do not see that.  Core lending, the longest, is measured once.
    """
    import torch.distributed as dist

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = rank_device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as autopar run's ranks: they share the machine's cores
    from autopar.launch import TerminalProgress

    bar = TerminalProgress(delay_s=0.0) if rank == 0 else None
    cores = len(os.sched_getaffinity(0))
    lends = device.type == "cpu" and world > cores  # ranks share cores: measure what a waiting rank lends
    steps = passes * (len(_DTYPES) + 4 + len(COLLECTIVE_KINDS)) + lends
    done, label = 0, ""

    def tick(stage: str) -> None:
        nonlocal done
        if bar is not None:
            bar(f"calibrate{label}: {stage}", done, steps)
        done += 1

    out: dict[str, Any] = {"ranks": world, "backend": dist.get_backend(), "device": device.type, "cores": cores}
    out.update(
        machine=_machine(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    )
    _SPREADS.clear()
    if device.type == "cuda":
        out["device_memory_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    samples = []
    for k in range(passes):
        label = f" (pass {k + 1} of {passes})" if passes > 1 else ""
        samples.append(_measure_pass(world, device, trials, quick, tick))
    out.update(median_of(samples))
    out["passes"] = passes
    if lends:
        tick("core lending (a ring of waiting ranks)")
        out["lending"] = measure_lending(rank, world, *((LENGTHS_MS[::3], 2) if quick else (LENGTHS_MS, 8)))
    out["spreads"] = list(_SPREADS)
    if bar is not None:
        bar.close()
    return out if rank == 0 else None


def _measure_pass(world: int, device: torch.device, trials: int, quick: bool, tick) -> dict[str, Any]:
    """One pass of every measurement but core lending (``measure_rank``)."""
    out: dict[str, Any] = {"matmul": {}}
    for dtype in _DTYPES:
        tick(f"matmul {str(dtype).removeprefix('torch.')}")
        # float16 has no fast CPU path (about 1 GFLOP/s): its three smallest shapes say enough there
        slow = quick or (dtype == torch.float16 and device.type == "cpu")
        gemms = _GPU_GEMMS if device.type == "cuda" else _GEMMS
        shapes = gemms[:3] if slow else gemms
        out["matmul"][str(dtype).removeprefix("torch.")] = _gemm_rates(dtype, device, trials, shapes)
    tick("memory bandwidth")
    out["bandwidth"] = _bandwidth(device, trials)
    tick("attention and optimizer kernels")
    out["attention_dtype"] = "float32" if device.type == "cpu" else "bfloat16"  # what models train in there
    out["attention"] = attention_points(device, getattr(torch, out["attention_dtype"]), _slowest_median, trials)
    out["optimizer"] = optimizer_rates(device, _slowest_median, trials)
    tick("runtime overhead per op")
    out.update(runtime_op_overhead(world, device, _slowest_median, trials))
    if world > 1:
        tick("overlap of a gradient all-reduce with compute")
        out["overlap"] = _overlap(device, trials)
    out["collectives"] = {}
    sizes = [n for n in (2, 4, 8, 16, 32, 64) if n < world and world % n == 0] + ([world] if world > 1 else [])
    groups = {n: _axis_groups(n, world, device) for n in sizes}
    for kind in COLLECTIVE_KINDS:
        tick(f"{kind} on groups of {', '.join(map(str, sizes))}")
        message_sizes = (SIZES_BYTES[0], SIZES_BYTES[2]) if quick else SIZES_BYTES
        out["collectives"][kind] = {
            n: _collective_points(kind, *groups[n], n, device, trials, message_sizes) for n in sizes
        }
    return out


def rank_device() -> torch.device:
    """This rank's device: its GPU under nccl, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} per node)"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} logical CPUs"


def sync_device(device: torch.device) -> None:
    """Wait for the kernels queued on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_median(fn, device: torch.device, trials: int, *, budget_s: float = 0.15, group=None) -> float:
    """Seconds per call of ``fn`` on the slowest rank: the median of ``trials`` timed loops between barriers.

    The loop length is chosen so one loop takes about ``budget_s`` (at least one call).
    """
    import torch.distributed as dist

    fn()  # warm up: allocations, communicators, caches
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    once = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)  # nccl: on the GPU
    dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank runs the same number of calls
    reps = max(1, min(200, int(budget_s / max(float(once), 1e-7))))
    times = []
    for _ in range(trials):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync_device(device)
        t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    middle = statistics.median(times)
    _SPREADS.append((max(times) - min(times)) / middle if middle > 0 else 0.0)
    return middle


#: Each timed point's spread on this rank (``_slowest_median``), gathered by ``measure_rank``.
_SPREADS: list[float] = []


def _gemm_rates(dtype: torch.dtype, device: torch.device, trials: int, shapes) -> list[tuple[str, float]]:
    rates = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        seconds = _slowest_median(lambda a=a, b=b: a @ b, device, trials, budget_s=0.05)
        rates.append((f"{m}x{k}x{n}", 2 * m * k * n / seconds))
    return rates


def _bandwidth(device: torch.device, trials: int) -> list[tuple[str, float]]:
    numel = (8 << 20) if device.type == "cpu" else (64 << 20)  # 32 / 256 MiB per tensor: past the caches
    src, other, dst = (torch.randn(numel, device=device) for _ in range(3))
    copy_s = _slowest_median(lambda: dst.copy_(src), device, trials, budget_s=0.1)
    add_s = _slowest_median(lambda: torch.add(src, other, out=dst), device, trials, budget_s=0.1)
    return [("copy", 2 * src.nbytes / copy_s), ("add", 3 * src.nbytes / add_s)]


def _overlap(device: torch.device, trials: int) -> dict[str, float]:
    """How much of an asynchronous all-reduce hides behind compute on this machine (``grad_reduce_overlap``).

    Every rank times matmuls alone (``t_c``), a 16 MiB all-reduce of the whole world
    alone (``t_r``), and the all-reduce started asynchronously before the same
    matmuls and waited for after them (``t_both``), as the runtime's gradient buckets
    run during backward.  The hidden fraction is ``(t_c + t_r - t_both) / t_r``: near
    1 where the collective has its own engine (NCCL on GPUs), near 0 or below where
    it competes with compute for the same cores (gloo with more ranks than cores).
    """
    import torch.distributed as dist

    a = torch.randn(256, 1024, device=device)
    b = torch.randn(1024, 1024, device=device)
    buf = torch.randn(4 << 20, device=device)

    def compute():
        for _ in range(8):
            a @ b

    def reduce():
        dist.all_reduce(buf, async_op=True).wait()

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    repeats = max(trials, 5)  # the difference of three timings: more repeats than the rest
    t_c = _slowest_median(compute, device, repeats, budget_s=0.2)
    t_r = _slowest_median(reduce, device, repeats, budget_s=0.2)
    t_both = _slowest_median(both, device, repeats, budget_s=0.2)
    return {"compute_s": t_c, "reduce_s": t_r, "both_s": t_both, "hidden": (t_c + t_r - t_both) / t_r}


def _axis_groups(n: int, world: int, device: torch.device):
    """(MeshGroups, axis) whose axis groups are ``n`` consecutive ranks, all running at once (as a mesh axis)."""
    from autopar.mesh import Mesh
    from autopar.runtime import MeshGroups

    mesh = Mesh((n,)) if n == world else Mesh((world // n, n))
    groups = MeshGroups(mesh)
    if groups.device != device:
        raise AssertionError(f"calibrate: MeshGroups chose {groups.device}, the measurements run on {device}")
    return groups, mesh.ndim - 1


#: kind -> (source placement on the measured axis, destination): the transitions the runtime runs for it
_TRANSITIONS = {
    "all_reduce": ("P", "R"),
    "all_gather": ("S0", "R"),
    "reduce_scatter": ("P", "S0"),
    "all_to_all": ("S0", "S1"),
}


def _collective_points(kind: str, groups, axis: int, n: int, device: torch.device, trials: int, message_sizes):
    """(nbytes, seconds) per message size: what the collective adds to a stream of compute.

    Each collective runs through the runtime's own path (``runtime.redistribute_local``:
    the padding, copies and emulations it does), on float32 tensors of ``nbytes``
    as ``costmodel.comm`` defines them (the buffer each rank holds for an all-reduce
    and an all-to-all, the gathered output of an all-gather, the full input of a
    reduce-scatter).  It is timed as a training step issues it, between chunks of
    compute (``compute_chunk``): the time of chunk + collective, less the chunk's
    own.  Back to back, collectives settle into the scheduler's rhythm and look
    cheaper than they are in a step (gloo with more ranks than cores: a group of 2
    all-reducing 16 KiB took 0.65 ms back to back, 2.4 ms between matmuls).
    """
    from autopar.placement import Partial, Replicate, Shard
    from autopar.runtime import redistribute_local
    from autopar.spec import TensorMeta, local_shape

    make = {"P": Partial("sum"), "R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    src_p, dst_p = (make[k] for k in _TRANSITIONS[kind])
    ndim = len(groups.mesh.shape)
    src = tuple(src_p if a == axis else Replicate() for a in range(ndim))
    dst = tuple(dst_p if a == axis else Replicate() for a in range(ndim))
    chunk = compute_chunk(device)
    chunk_s = _slowest_median(chunk, device, max(trials, 5), budget_s=0.15)
    points = []
    for nbytes in message_sizes:
        cols = 256
        rows = max(n, nbytes // 4 // cols) // n * n
        if kind == "all_to_all":  # each rank's buffer is nbytes: the global tensor is n times that
            rows *= n
        meta = TensorMeta((rows, cols), torch.float32)
        x = torch.randn(local_shape(meta.shape, src, groups.mesh.shape, groups.coordinate), device=device)
        pair_s = _slowest_median(
            lambda x=x, meta=meta: (chunk(), redistribute_local(x, meta, src, dst, groups)),
            device,
            max(trials, 5),
            budget_s=0.15,
        )
        seconds = max(pair_s - chunk_s, 0.05 * pair_s)  # never below a twentieth of the pair: noise, not speed
        points.append((rows * cols * 4 // (n if kind == "all_to_all" else 1), seconds))
    return points


def compute_chunk(device: torch.device):
    """A few milliseconds of matmuls (3 of 256 x 1024 x 256): what separates two collectives in a step."""
    a = torch.randn(256, 1024, device=device)
    b = torch.randn(1024, 256, device=device)

    def chunk() -> None:
        for _ in range(3):
            a @ b

    return chunk


# ---- printing ---------------------------------------------------------------------------------
