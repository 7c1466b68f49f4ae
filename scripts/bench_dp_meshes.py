"""One data-parallel plan on two meshes of the same ranks, timed in the same rounds: (N,) against (2, N / 2).

    python scripts/bench_dp_meshes.py bert-bench                  # 4 gloo ranks, 10 interleaved rounds
    python scripts/bench_dp_meshes.py gpt2-bench llama-bench --iters 16

Issue 32 asks that a data-parallel plan on a (2, 2) mesh run within 10% of the same plan on (4,) where the
flattened group is cheaper (one all-reduce over both axes, ``Plan.flat_grad_axes``).  ``autopar fidelity`` shows
both meshes, but in separate cases, each calibrated and timed minutes apart on a machine whose speed drifts by
more than the difference.  Here both compiled modules live in the same processes: after ``--warmup`` steps of each,
``--iters`` rounds each run one step of both (the order alternating), between barriers, so background load hits
both alike.  A step is forward (the model's own loss), backward, ``AdamW.step()`` and ``zero_grad()``.

Models are the zoo's (``autopar.models.load_model``: the fidelity benchmarks' names, e.g. ``gpt2-bench``,
``llama-bench``, ``bert-bench``, ``t5-tiny``), random weights, dropout off, at ``--batch`` x ``--seq``.  Printed per
model: each mesh's plan (family, flattened axes, the collectives by kind, axis and phase), the median step and
rank 0's median forward / backward / optimizer wall times, and the ratio of the medians ((2, N / 2) over (N,):
above 1.0 the 2-D mesh is slower).  Printing only: no assertions.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="zoo model names (autopar.models.load_model)")
    p.add_argument("--ranks", type=int, default=4, help="CPU gloo ranks, even, at least 4 (default 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each mesh")
    p.add_argument("--iters", type=int, default=10, help="timed rounds (each runs both meshes once)")
    p.add_argument("--profile", default="cpu", help="device profile the plans are made with (default cpu)")
    return p


def _describe(plan) -> str:
    kinds = collections.Counter((c.kind, c.axis, c.phase) for c in plan.collectives)
    listed = ", ".join(f"{n} {kind} on {axis} ({phase})" for (kind, axis, phase), n in sorted(kinds.items()))
    flat = ", ".join("+".join(axes) for axes in plan.flat_grad_axes) or "none"
    return f"{plan.family}; flattened: {flat}; {listed or 'no collectives'}"


def _step(module, args, kwargs, opt) -> list[float]:
    """Forward, backward and optimizer wall seconds of one training step."""
    marks = [time.perf_counter()]
    out = module(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    opt.step()
    opt.zero_grad()
    marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


def _one_model(name: str, a, rank: int, world: int) -> None:
    import autopar
    from autopar.models import load_model

    model, args, kwargs = load_model(name, batch=a.batch, seq=a.seq, device="cpu", no_dropout=True)
    meshes = {
        f"({world},)": autopar.Mesh((world,), axis_names=("dp",)),
        f"(2, {world // 2})": autopar.Mesh((2, world // 2), axis_names=("dp", "tp")),
    }
    runs = {}
    for label, mesh in meshes.items():
        compiled = autopar.compile(
            copy.deepcopy(model),
            mesh,
            example_inputs=args,
            example_kwargs=kwargs,
            family="data parallel",
            profile=a.profile,
        )
        runs[label] = (compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-4))
    for compiled, opt in runs.values():
        for _ in range(a.warmup):
            _step(compiled, args, kwargs, opt)
    times: dict[str, list[float]] = {k: [] for k in runs}
    phases: dict[str, list[list[float]]] = {k: [] for k in runs}
    for it in range(a.iters):
        for label in list(runs)[:: 1 if it % 2 == 0 else -1]:
            compiled, opt = runs[label]
            dist.barrier()
            start = time.perf_counter()
            phases[label].append(_step(compiled, args, kwargs, opt))
            dist.barrier()
            times[label].append(time.perf_counter() - start)
    if rank != 0:
        return
    print(f"{name}: batch {a.batch} x seq {a.seq}, {world} gloo ranks, {a.iters} interleaved rounds", flush=True)
    for label, (compiled, _) in runs.items():
        med = statistics.median(times[label]) * 1e3
        fwd, bwd, opt_s = (statistics.median(p[i] for p in phases[label]) * 1e3 for i in range(3))
        print(f"  {label:>8}: {med:7.1f} ms (forward {fwd:.1f}, backward {bwd:.1f}, optimizer {opt_s:.1f})", flush=True)
        print(f"            {_describe(compiled.plan)}", flush=True)
    one, two = (statistics.median(v) for v in times.values())
    print(f"  ratio (2, {world // 2}) / ({world},): {two / one:.3f}", flush=True)


def _rank(rank: int, world: int, port: int, a) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    try:
        for name in a.models:
            _one_model(name, a, rank, world)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.ranks < 4 or a.ranks % 2:
        print(
            f"bench_dp_meshes: --ranks must be even and >= 4 (a (2, ranks / 2) mesh), got {a.ranks}",
            file=sys.stderr,
        )
        return 2
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(a.ranks, port, a), nprocs=a.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
