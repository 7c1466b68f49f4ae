"""autopar's compiled training step on one rank against the same module's eager step (the peer: plain PyTorch).

    torchrun --nproc-per-node 1 scripts/compiled_vs_eager.py gpt2 --batch 8 --seq 1024 --microbatches 4 \\
        --profile gpu.toml                                              # one GPU (nccl)
    torchrun --nproc-per-node 1 scripts/compiled_vs_eager.py gpt2-tiny --batch 8 --seq 128 --microbatches 4

On a one-device mesh a plan shards nothing, so its step should cost what eager PyTorch's does: what it takes more is
autopar's runtime (the lowered program, its gradient buckets, the micro-batch loop).  The model (a built-in name,
dropout off, returning its loss as the fidelity harness trains it) is planned on ``Mesh((1,))`` (with
``--microbatches`` accumulated micro-batches), compiled, and timed in interleaved rounds against the module eagerly
over the same chunks (each chunk's loss over ``m``, then ``backward``; AdamW and ``zero_grad`` in both).  Prints the
medians, their ratio and the plan's predicted step.  The batch is given on the CPU, as the fidelity harness gives
it; the eager module gets it on its device once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import autopar
from autopar.measure.benchmark import BenchModel
from autopar.measure.fidelity import loss_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda:0" if cuda else "cpu"
    try:
        bench = BenchModel(name=args.model, batch=args.batch, seq=args.seq, poor_hint={})
        net, inputs = loss_model(bench, "cpu")
        mesh, m = autopar.Mesh((1,), axis_names=("dp",)), args.microbatches
        extra = {"microbatches": m} if m > 1 else {}
        plan = autopar.plan(net, mesh, example_inputs=inputs, profile=args.profile, **extra)
        sharded = autopar.compile(net, mesh, example_inputs=inputs, plan=plan)
        eager, _ = loss_model(bench, device)
        on_device = tuple(x.to(device) for x in inputs)
        opts = [torch.optim.AdamW(mod.parameters(), lr=1e-4) for mod in (sharded, eager)]

        def compiled_step() -> None:
            sharded.train_step(*inputs) if m > 1 else sharded(*inputs).backward()
            opts[0].step()
            opts[0].zero_grad()

        def eager_step() -> None:
            for ids, labels in zip(*(x.chunk(m) for x in on_device)):
                (eager(ids, labels) / m).backward()
            opts[1].step()
            opts[1].zero_grad()

        times = _interleaved([compiled_step, eager_step], args.rounds, cuda)
        ours, peer = (statistics.median(t) for t in times)
        print(
            f"{args.model} batch {args.batch} seq {args.seq}, {m} micro-batch(es) on {device}: compiled "
            f"{ours * 1e3:.1f} ms, eager {peer * 1e3:.1f} ms, compiled / eager {ours / peer:.3f}; predicted "
            f"{plan.cost.total_s * 1e3:.1f} ms"
        )
    finally:
        dist.destroy_process_group()


def _interleaved(steps: list, rounds: int, cuda: bool) -> list[list[float]]:
    """Seconds per step of each of ``steps``, two steps a round each, rounds interleaved, after two warm-ups."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step in steps * 2:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for step, out in zip(steps, times):
            sync()
            t0 = time.perf_counter()
            step()
            step()
            sync()
            out.append((time.perf_counter() - t0) / 2)
    return times


if __name__ == "__main__":
    main()
