"""Measure this machine as ``configs/devices/cpu.toml`` describes it: CPU gloo ranks of one thread.

    python scripts/calibrate_cpu.py            # < 1 min; prints fitted values and TOML lines to paste
    python scripts/calibrate_cpu.py --ranks 4 2

What it measures, with ``--ranks`` processes of ``torch.set_num_threads(1)`` on gloo
over loopback, exactly as ``scripts/bench_step.py`` runs them (so when there are
more ranks than cores, the contention is part of every number, as it is there):

* collectives: all_reduce, all_gather, reduce_scatter and all_to_all over a range
  of sizes, each timed on every rank between barriers, the slowest rank's mean over
  the repeats, the median of ``--trials``.  ``reduce_scatter`` is timed as autopar's
  runtime issues it on gloo (``runtime/redistribute.py``: all-reduce + local slice,
  ``MeshGroups.native_reduce_scatter`` is False off nccl).  The per-step latency
  ``alpha`` and bandwidth ``B`` are fitted to the ring form of
  ``costmodel/comm.py`` plus the one ``kernel_overhead_s`` that
  ``autopar/costing.py`` adds per collective::

      t = kernel_overhead_s + steps*(n-1)*alpha + factor*(n-1)/n * nbytes / B

  over all_reduce, all_gather and all_to_all, separately per rank count (least
  squares on relative error; the TOML takes the largest count, bench_step's: with
  more ranks than cores each ring step waits for a descheduled peer, so the
  "link" depends on the rank count); reduce_scatter is printed beside the fit, not
  fitted: gloo runs it as a whole all-reduce, which the profile's
  ``reduce_scatter = "all_reduce"`` key prices (costmodel/comm.py).
* compute, on every rank at once (what each rank gets when all of them compute):
  fp32, bf16 and fp16 matmul flop/s on model-shaped GEMMs, memory bandwidth of a large
  copy, eager per-op dispatch (a one-element add), and the per-op cost of autopar's
  runtime on a small MLP whose ops are all too small for their flops or bytes to
  matter: its ``ShardedModule`` forward (the lowered local graph; no collective) per op, and
  its eager backward per op (autograd runs the sharded backward the same way).
  ``kernel_overhead_s`` is their mean: the cost model charges it once for an op's
  forward and once for its backward, and once per collective.

Printing only.  Paste the TOML lines into ``configs/devices/cpu.toml`` (or a
calibration file passed as ``profile=``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

# kind -> (bandwidth factor in units of (n-1)/n, latency steps in units of (n-1)): costmodel/comm.py
RING = {"all_reduce": (2, 2), "all_gather": (1, 1), "reduce_scatter": (1, 1), "all_to_all": (1, 1)}
FITTED = ("all_reduce", "all_gather", "all_to_all")
SIZES_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 2], help="rank counts to measure (default 4 2)")
    p.add_argument("--trials", type=int, default=3, help="repeats of each measurement; the median is kept")
    return p


def _time(fn, reps: int) -> float:
    """Seconds per call of ``fn`` on the slowest rank: barrier, ``reps`` calls, barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _median(fn, reps: int, trials: int) -> float:
    fn()  # warm up (allocations, gloo buffers)
    return statistics.median(_time(fn, reps) for _ in range(trials))


def _collectives(n: int, trials: int) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in RING}
    for nbytes in SIZES_BYTES:
        numel = nbytes // 4
        reps = 20 if nbytes <= (64 << 10) else 5
        full = torch.randn(numel)
        piece = torch.randn(numel // n)
        parts = [torch.empty(numel // n) for _ in range(n)]
        recv = torch.empty(numel)
        me = dist.get_rank()

        def reduce_scatter(full=full, numel=numel, me=me):
            buf = full.clone()  # the runtime reduces a copy of the partial sums
            dist.all_reduce(buf)
            return buf[me * (numel // n) : (me + 1) * (numel // n)].clone()

        fns = {
            "all_reduce": lambda full=full: dist.all_reduce(full),
            "all_gather": lambda parts=parts, piece=piece: dist.all_gather(parts, piece),
            "reduce_scatter": reduce_scatter,
            "all_to_all": lambda recv=recv, full=full: dist.all_to_all_single(recv, full),
        }
        for kind, fn in fns.items():
            out[kind].append((nbytes, _median(fn, reps, trials)))
    return out


class _Tiny(nn.Module):
    """Many small ops and an output left batch-split: the forward is per-op overhead, no collective."""

    def __init__(self, width: int = 16, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.nn.functional.gelu(b(x))
        return x


def _runtime_overhead(n: int, trials: int) -> dict[str, float]:
    """Per-op seconds of a tiny model: autopar's forward, eager forward, eager backward.

    The ShardedModule forward of a data-parallel plan whose output stays batch-split
    issues no collective, so its time over the op count is the runtime's per-node
    cost (the lowered local graph's dispatch).  Backward runs through
    autograd as eager backward does, so the eager model's backward stands for it
    (the sharded backward would add the gradient all-reduce, which is priced apart).
    """
    import autopar

    torch.manual_seed(0)
    model = _Tiny()
    x = torch.randn(4 * n, 16)
    sharded = autopar.compile(
        _Tiny(), autopar.Mesh((n,), axis_names=("x",)), example_inputs=(x,), family="data parallel"
    )
    sharded(x)  # plan and build outside the timing
    ops = sum(1 for node in sharded._xplan.graph.nodes if node.fx_node is not None and node.kind == "op")
    fwd_sharded = _median(lambda: sharded(x), 20, trials)
    fwd_eager = _median(lambda: model(x), 20, trials)
    total_eager = _median(lambda: model(x).sum().backward(), 20, trials)
    return {
        "tiny_ops": ops,
        "runtime_fwd_op_s": fwd_sharded / ops,
        "eager_fwd_op_s": fwd_eager / ops,
        "eager_bwd_op_s": max(total_eager - fwd_eager, 0.0) / ops,
    }


def _compute(trials: int) -> dict[str, float]:
    res: dict[str, float] = {}
    # GEMMs shaped like bench_step's per-rank work (tokens x hidden x ffn / vocab) and a square one
    shapes = ((256, 256, 688), (256, 688, 256), (256, 256, 2048), (512, 512, 512))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rates = []
        for m, k, nn_ in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, nn_, dtype=dtype)
            rates.append(2 * m * k * nn_ / _median(lambda a=a, b=b: a @ b, 5, trials))
        res[f"matmul_{dtype}".replace("torch.", "")] = statistics.median(rates)
    src, dst = torch.randn(8 << 20), torch.empty(8 << 20)  # 32 MiB each: past the caches
    res["copy_bytes_per_s"] = 2 * src.nbytes / _median(lambda: dst.copy_(src), 5, trials)
    one = torch.ones(1)
    res["eager_op_s"] = _median(lambda: torch.add(one, one), 2000, trials)
    return res


def _rank(rank: int, n: int, port: int, trials: int, queue) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)  # as scripts/bench_step.py: the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n, timeout=timedelta(seconds=120)
    )
    try:
        coll = _collectives(n, trials)
        comp = _compute(trials)
        comp.update(_runtime_overhead(n, trials))
        # what the cost model charges per op call: the mean of an autopar forward and an eager backward
        comp["runtime_op_s"] = (comp["runtime_fwd_op_s"] + comp["eager_bwd_op_s"]) / 2
        if rank == 0:
            queue.put((n, coll, comp))
    finally:
        dist.destroy_process_group()


def _fit(n: int, coll: dict, overhead_s: float) -> tuple[float, float]:
    """(alpha, bandwidth): least squares on relative error of the ring form over ``n`` ranks' kinds and sizes."""
    rows, rhs = [], []
    for kind in FITTED:
        factor, steps = RING[kind]
        for nbytes, t in coll[kind]:
            rows.append([steps * (n - 1) / t, factor * (n - 1) / n * nbytes / t])
            rhs.append((t - overhead_s) / t)
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(rhs, dtype=torch.float64)).solution
    alpha, inv_bw = float(sol[0]), float(sol[1])
    if alpha < 0 or inv_bw <= 0:
        raise AssertionError(f"ring fit gave alpha={alpha!r}, 1/B={inv_bw!r}: measurements too noisy, rerun")
    return alpha, 1.0 / inv_bw


def _model_s(kind: str, nbytes: int, n: int, alpha: float, bw: float, overhead_s: float) -> float:
    factor, steps = RING[kind]
    return overhead_s + steps * (n - 1) * alpha + factor * (n - 1) / n * nbytes / bw


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} logical CPUs"


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    t_start = time.perf_counter()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    results: dict[int, dict] = {}
    compute: dict[int, dict] = {}
    for n in a.ranks:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(n, port, a.trials, queue), nprocs=n, join=True)
        got_n, coll, comp = queue.get()
        results[got_n], compute[got_n] = coll, comp

    machine, date = _machine(), datetime.date.today().isoformat()
    ref = max(compute)  # the largest rank count: bench_step's default and the most contended
    c = compute[ref]
    overhead_s = c["runtime_op_s"]
    fits = {n: _fit(n, coll, compute[n]["runtime_op_s"]) for n, coll in results.items()}
    alpha, bw = fits[ref]
    print(f"machine: {machine}; torch {torch.__version__}; {date}; ranks {a.ranks}, 1 thread each, gloo")
    print(f"runtime {time.perf_counter() - t_start:.0f} s\n")
    print("collectives (slowest rank, median of trials) vs the fitted ring form:")
    print(f"  {'kind':<15}{'ranks':>6}{'bytes':>10}{'measured':>12}{'model':>12}{'ratio':>7}")
    for n, coll in results.items():
        for kind, rows in coll.items():
            for nbytes, t in rows:
                m = _model_s(kind, nbytes, n, *fits[n], compute[n]["runtime_op_s"])
                print(f"  {kind:<15}{n:>6}{nbytes:>10}{t * 1e6:>10.0f}us{m * 1e6:>10.0f}us{t / m:>7.2f}")
    print("\ncompute per rank (all ranks computing at once):")
    for n, comp in compute.items():
        print(
            f"  {n} ranks: matmul GFLOP/s fp32 {comp['matmul_float32'] / 1e9:.1f}, bf16"
            f" {comp['matmul_bfloat16'] / 1e9:.1f}, fp16 {comp['matmul_float16'] / 1e9:.1f};"
            f" copy {comp['copy_bytes_per_s'] / 1e9:.2f} GB/s,"
            f" eager op {comp['eager_op_s'] * 1e6:.1f} us,"
            f" per op: autopar forward {comp['runtime_fwd_op_s'] * 1e6:.1f} us, eager forward"
            f" {comp['eager_fwd_op_s'] * 1e6:.1f} us, eager backward {comp['eager_bwd_op_s'] * 1e6:.1f} us"
            f" ({comp['tiny_ops']} ops) -> kernel_overhead_s {comp['runtime_op_s'] * 1e6:.1f} us"
        )
    print()
    for n, (al, b) in fits.items():
        print(f"fit on {n} ranks: alpha {al * 1e6:.1f} us per ring step, bandwidth {b / 1e9:.3f} GB/s per rank")
    print(f"(the TOML takes the {ref}-rank fit: contention makes the link a function of the rank count)\n")
    cite = f"measured by scripts/calibrate_cpu.py on {machine}, {date}, {ref} ranks"
    print("# ---- TOML lines for configs/devices/cpu.toml ----")
    print(f"# {cite}")
    print(f"mem_bandwidth_bytes_per_s = {c['copy_bytes_per_s']:.3g}")
    print(f"kernel_overhead_s = {overhead_s:.3g}")
    print("[peak_flops]")
    print(f"float32 = {c['matmul_float32']:.3g}")
    print(f"bfloat16 = {c['matmul_bfloat16']:.3g}")
    print(f"float16 = {c['matmul_float16']:.3g}")
    print("[intra_node] / [inter_node]")
    print(f"bandwidth_bytes_per_s = {bw:.3g}")
    print(f"latency_s = {alpha:.3g}")
    print(f'source = "{cite}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
