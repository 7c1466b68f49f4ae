"""One plan's peak memory taken apart: the cost model's terms against what the profiler saw live at the peak.

    python -m torch.distributed.run --nproc-per-node 1 scripts/peak_composition.py gpt2 --batch 8 --seq 1024 \\
        --recompute full                                       # a GPU: one nccl rank
    python -m torch.distributed.run --nproc-per-node 1 scripts/peak_composition.py gpt2-tiny --recompute full

For finding which term of the peak model (``autopar/cost/peak.py``) is off where
``autopar fidelity`` reports a memory error: the model (trained as the fidelity benchmark
trains it, loss only, dropout off) is planned on one device with ``--recompute``,
compiled, warmed up, and one step is measured twice: its peak as ``autopar fidelity``
measures it (held bytes plus the step's rise: the CUDA allocator's on a GPU, the
profiler's timeline on CPU) and the tensors live at the peak by the profiler's category
(activation, gradient, autograd_detail: what backward allocates, temporary, ...) with the
largest of them and the op that made each.  The plan's side: parameters, gradients,
optimizer state, saved activations, the backward working set at its peak (transient) and
the phase the peak falls in.
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.measure.benchmark import BenchModel
from autopar.measure.fidelity import loss_model
from autopar.measure.memory import held_bytes, peak_composition, step_peak_bytes
from autopar.runtime import init_distributed
from autopar.units import format_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a built-in model (autopar models)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full", "auto"))
    ap.add_argument("--profile", default=None, help="device profile (default h100 on a GPU, cpu otherwise)")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    backend = init_distributed()  # torchrun's environment: one rank
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    profile = a.profile or ("h100" if device.type == "cuda" else "cpu")
    net, inputs = loss_model(BenchModel(a.model, a.batch, a.seq, {}), "cpu")
    mesh = autopar.Mesh((1,))
    plan = autopar.plan(net, mesh, example_inputs=inputs, profile=profile, recompute=a.recompute)
    sharded = autopar.compile(net, mesh, example_inputs=inputs, plan=plan)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

    def step() -> None:
        sharded(*inputs).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(a.warmup):
        step()
    held = [*sharded.parameters(), *sharded.buffers()]
    held += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    peak = step_peak_bytes(step, held, device)
    parts = peak_composition(step, device)
    m = plan.memory
    print(f"{a.model} batch {a.batch} seq {a.seq}, recompute {a.recompute}, profile {profile}, on {device}")
    print("plan (the cost model):")
    for key in ("params", "grads", "optimizer", "activations", "transient_bytes", "per_device_bytes"):
        print(f"  {key:18s} {format_bytes(m[key]):>12}")
    print(f"  peak phase         {m['peak_phase']:>12}")
    print("measured:")
    print(f"  held before step   {format_bytes(held_bytes(held)):>12}")
    print(
        f"  peak               {format_bytes(peak.peak_bytes):>12}  (plan / measured - 1: "
        f"{m['per_device_bytes'] / peak.peak_bytes - 1:+.1%})"
    )
    print(f"  the step's rise    {format_bytes(parts.rise_bytes):>12}  (profiler timeline), live at its peak:")
    for category, nbytes in parts.by_category.items():
        print(f"    {category:16s} {format_bytes(nbytes):>12}")
    print("  largest live at the peak:")
    for nbytes, category, op in parts.largest:
        print(f"    {format_bytes(nbytes):>12}  {category:16s} {op}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
