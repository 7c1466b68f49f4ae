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
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="zoo model names (autopar.models.load_model)")
    p.add_argument("--ranks", type=int, default=4, help="CPU gloo ranks, even, at least 4 (default 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each mesh")
    p.add_argument("--iters", type=int, default=10, help="timed rounds (each runs both meshes once)")
    p.add_argument("--profile", default="cpu", help="device profile the plans are made with (default cpu)")
    p.add_argument("--timeout", type=float, default=3600.0, help="stop the ranks after this many seconds")
    return p


def _describe(plan) -> str:
    kinds = collections.Counter((c.kind, c.axis, c.phase) for c in plan.collectives)
    listed = ", ".join(f"{n} {kind} on {axis} ({phase})" for (kind, axis, phase), n in sorted(kinds.items()))
    flat = ", ".join("+".join(axes) for axes in plan.flat_grad_axes) or "none"
    return f"{plan.family}; flattened: {flat}; {listed or 'no collectives'}"


def _step(module, args, kwargs, opt) -> list[float]:
    """Forward, backward and optimizer wall seconds of one training step."""
    from autopar.measure.step_phases import timed_step

    return [wall for wall, _ in timed_step(module, args, kwargs, opt)[1]]


def _one_model(name: str, a, rank: int, world: int) -> list[str]:
    """Rank ``rank``'s share of one model's measurement; rank 0 returns the report's lines (the others none)."""
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
        return []
    lines = [f"{name}: batch {a.batch} x seq {a.seq}, {world} gloo ranks, {a.iters} interleaved rounds"]
    for label, (compiled, _) in runs.items():
        med = statistics.median(times[label]) * 1e3
        fwd, bwd, opt_s = (statistics.median(p[i] for p in phases[label]) * 1e3 for i in range(3))
        lines.append(f"  {label:>8}: {med:7.1f} ms (forward {fwd:.1f}, backward {bwd:.1f}, optimizer {opt_s:.1f})")
        lines.append(f"            {_describe(compiled.plan)}")
    one, two = (statistics.median(v) for v in times.values())
    lines.append(f"  ratio (2, {world // 2}) / ({world},): {two / one:.3f}")
    return lines


def _rank(rank: int, world: int, a) -> list[str]:
    """Every model's measurement on this rank (``runtime.spawn_ranks`` has set gloo up); rank 0's report lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    lines: list[str] = []
    for name in a.models:
        lines += _one_model(name, a, rank, world)
    return lines


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.ranks < 4 or a.ranks % 2:
        print(
            f"bench_dp_meshes: --ranks must be even and >= 4 (a (2, ranks / 2) mesh), got {a.ranks}",
            file=sys.stderr,
        )
        return 2
    from autopar.runtime import RankSettings, spawn_ranks

    settings = RankSettings(timeout_s=a.timeout, collective_timeout_s=600.0)  # ranks share the cores: one thread each
    (lines, *_), _ = spawn_ranks(_rank, a.ranks, a, settings=settings)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
