"""One plan's peak memory taken apart: the cost model's terms against what the profiler saw live at the peak.

    python -m torch.distributed.run --nproc-per-node 1 scripts/peak_composition.py gpt2 --batch 8 --seq 1024 \\
        --recompute full                                       # a GPU: one nccl rank
    python -m torch.distributed.run --nproc-per-node 1 scripts/peak_composition.py gpt2-tiny --recompute full
    python -m torch.distributed.run --nproc-per-node 4 scripts/peak_composition.py t5-tiny --mesh 4 \
        --benchmark configs/benchmarks/fidelity_unseen.toml --variant "family:sharded parameters"
    python -m torch.distributed.run --nproc-per-node 4 scripts/peak_composition.py bert-bench --mesh 2x2 \
        --benchmark configs/benchmarks/fidelity.toml --variant pipeline:tp/gpipe/m8 \
        --profile docs/measurements/cpu4-2026-12-02-shared-groups-profiles/bert-bench-2x2.toml

For finding which term of the peak model (``autopar/cost/peak.py``) is off where
``autopar fidelity`` reports a memory error: the model (trained as the fidelity benchmark
trains it, loss only, dropout off; with ``--benchmark``, at that file's batch, sequence and
config of the model) is planned on ``--mesh`` (one rank per device; the plan of a fidelity
``--variant``, e.g. ``cap:0.1`` or ``family:tensor parallel``, else ``--recompute``),
compiled, warmed up, and one step is measured twice: its peak as ``autopar fidelity``
measures it (held bytes plus the step's rise: the CUDA allocator's on a GPU, the
profiler's timeline on CPU) and the tensors live at the peak by the profiler's category
(activation, gradient, autograd_detail: what backward allocates, temporary, ...) with the
largest of them and the op that made each.  The plan's side: parameters, gradients,
optimizer state, saved activations, the backward working set at its peak (transient) and
the phase the peak falls in.  Every rank measures; the rank with the largest peak (the one
``autopar fidelity`` compares) is printed.
"""

from __future__ import annotations

import argparse

import torch

import autopar
from autopar.measure.benchmark import BenchModel, Variant, load_benchmark, mesh_axis_names
from autopar.measure.fidelity import loss_model
from autopar.measure.peak_memory import held_bytes, peak_composition, step_peak_bytes
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
    ap.add_argument("--mesh", default="1", help="mesh shape, e.g. 4 or 2x2 (as many torchrun processes)")
    ap.add_argument("--benchmark", default=None, help="a fidelity benchmark file: its batch, seq and config")
    ap.add_argument("--variant", default=None, help="a fidelity variant (cap:0.1, family:..., ...): its plan")
    a = ap.parse_args()
    backend = init_distributed()  # torchrun's environment: one process per device of the mesh
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    profile = a.profile or ("h100" if device.type == "cuda" else "cpu")
    model = BenchModel(a.model, a.batch, a.seq, {})
    if a.benchmark:
        model = next((m for m in load_benchmark(a.benchmark).models if m.name == a.model), None)
        if model is None:
            raise SystemExit(f"{a.model} is not a model of {a.benchmark}")
    net, inputs, mesh, ctx = prepared(model, a.mesh, profile)
    plan = _variant_plan(ctx, model, a.variant, net, inputs, profile) if a.variant else None
    plan = plan or autopar.plan_from_context(ctx, compare_families=False, recompute=a.recompute)
    sharded = autopar.compile(net, mesh, example_inputs=inputs, plan=plan)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

    def step() -> None:  # as autopar fidelity steps it
        if sharded.plan.microbatches > 1:
            sharded.train_step(*inputs)  # the micro-batches, through the stages
        else:
            sharded(*inputs).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(a.warmup):
        step()
    held = [*sharded.parameters(), *sharded.buffers()]
    held += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    peak = step_peak_bytes(step, held, device)
    parts = peak_composition(step, device)
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (peak.peak_bytes, torch.distributed.get_rank()))
    if max(every)[1] != torch.distributed.get_rank():
        torch.distributed.destroy_process_group()
        return
    m = plan.memory
    how = f"variant {a.variant}" if a.variant else f"recompute {a.recompute}"
    print(f"{model.name} batch {model.batch} seq {model.seq} on mesh {a.mesh}, {how}, profile {profile}")
    print(f"family: {plan.family}; rank {max(every)[1]} (the largest peak; on {device})")
    print("plan (the cost model):")
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes"):
        print(f"  {key:18s} {format_bytes(getattr(m, key)):>12}")
    print(f"  per_device_bytes   {format_bytes(m.per_device_bytes):>12}")
    if m.peak_phase is not None:
        print(f"  peak phase         {m.peak_phase:>12}")
    if plan.pipeline is not None:  # each stage's rank: its state plus its micro-batches in flight
        for j, stage in enumerate(plan.pipeline.stages):
            print(
                f"  stage {j} ({stage.layers or f'layers {stage.first_layer}-{stage.stop_layer - 1}'}): "
                f"{format_bytes(stage.memory_bytes)}"
            )
    print("measured:")
    print(f"  held before step   {format_bytes(held_bytes(held)):>12}")
    print(
        f"  peak               {format_bytes(peak.peak_bytes):>12}  (plan / measured - 1: "
        f"{m.per_device_bytes / peak.peak_bytes - 1:+.1%})"
    )
    print(f"  the step's rise    {format_bytes(parts.rise_bytes):>12}  (profiler timeline), live at its peak:")
    if not parts.by_category:
        print("    (not attributed: the profiler refuses this step's data flow, its collectives work in place)")
    for category, nbytes in parts.by_category.items():
        print(f"    {category:16s} {format_bytes(nbytes):>12}")
    print("  largest live at the peak:")
    for nbytes, category, op in parts.largest:
        print(f"    {format_bytes(nbytes):>12}  {category:16s} {op}")
    torch.distributed.destroy_process_group()


def prepared(model: BenchModel, mesh_text: str, profile: str):
    """``model`` as the fidelity benchmark trains it (its loss only), the mesh ``mesh_text`` names (``4``, ``2x2``;
    axes named as the benchmark names them) and the planning context on it: (net, inputs, mesh, context)."""
    net, inputs = loss_model(model, "cpu")
    shape = tuple(int(x) for x in mesh_text.split("x"))
    mesh = autopar.Mesh(shape, axis_names=mesh_axis_names(shape))
    ctx = autopar.prepare(net, mesh, example_inputs=inputs, profile=profile, dtype="fp32", optimizer="adamw")
    return net, inputs, mesh, ctx


def _variant_plan(ctx, model: BenchModel, label: str, net, inputs: tuple, profile: str):
    """The plan ``autopar fidelity`` measures for ``label`` (caps placed as it places them; a pipeline or
    accumulation variant planned by ``autopar.plan``, as the harness plans it)."""
    variant = Variant(label)
    variant.validate("--variant")
    auto = autopar.plan_from_context(ctx, compare_families=False)
    try:
        autopar.plan_from_context(ctx, compare_families=False, mem_cap=1)
        least = 0
    except autopar.MemoryCapError as e:
        least = e.min_mem_bytes
    options = variant.plan_options(model, auto.memory.per_device_bytes, least)
    if variant.micro_batched:
        return autopar.plan(
            net, ctx.mesh, example_inputs=inputs, profile=profile, dtype="fp32", compare_families=False, **options
        )
    return autopar.plan_from_context(ctx, compare_families=False, **options) if options else auto


if __name__ == "__main__":
    main()
