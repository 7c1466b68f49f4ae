"""Llama 3 405B at the configurations the Llama 3 paper published (Table 4), priced by autopar (issue 32 part 5).

Prints, per row: the published TFLOP/s per GPU and BF16 MFU, autopar's prediction for the same configuration
forced (mesh dp x pp x tp, the pipeline on pp, the loss in the graph), its schedule, micro-batches and bubble,
and the planning time and peak RSS of this process.  The model is built on the meta device from its config
(126 layers, width 16,384, FFN 53,248, 128 heads, 8 KV heads, vocabulary 128,256, sequence 8,192); the batch is
16M tokens (2,048 sequences); H100 80GB, 8 per node, bf16.

    python scripts/llama3_anchors.py            # both rows (several minutes each on a 2-core machine)
    python scripts/llama3_anchors.py --gpus 8192
    python scripts/llama3_anchors.py --gpus 8192 --free --layers 16   # autopar's choice of mesh (see below)

Measured 2026-11-28 (this 2-core machine): 8,192 GPUs 384 TFLOP/s predicted (0.89x of 430; interleaved, 4 stages
per rank, 32 micro-batches, bubble 10%), planned in 104 s; 16,384 GPUs 337 (0.84x of 400; 16 micro-batches, bubble
22%), 88 s; peak RSS 2.24 GiB.  Measured 2026-11-30: 8,192 GPUs 387 TFLOP/s (0.90x; interleaved, 4 stages per rank,
32 micro-batches, bubble 12%), planned in 164 s, peak RSS 2.37 GiB.  Measured 2026-11-30 (stop 58: static captures
of a large graph's micro-batches, peak checks shared, no bisection past the search budget): 8,192 GPUs 384 TFLOP/s
(0.89x), planned in 94 s; 16,384 GPUs 347 (0.87x; interleaved, 4 stages per rank, 16 micro-batches, bubble 20%),
96 s; peak RSS 2.03 GiB.  Measured 2026-12-01 (stop 63: walks that cannot win stop, ``stage_fitting``): the same
predictions, planned in 53 and 57 s, peak RSS 2.03 GiB.

``--free`` plans the same model for the device count instead (``plan(devices=N, pipeline="auto")``: autopar chooses
the mesh) and prints its choice, then every mesh with its step (or why it lost), the seconds planning it took and the
captures it made.  At 8,192 GPUs that is not yet done in minutes (2026-11-30, afternoon: all 79 meshes in 35 minutes,
peak RSS 2.95 GiB; it chose 8 x 256 x 4, pipelined on the 8, step 13.71 s against the forced configuration's
14.07 s; ``docs/measurements/llama3-anchors-2026-11-30-free.md``).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import autopar

#: (GPUs, TP, CP, PP, DP, TFLOP/s per GPU, BF16 MFU): Llama 3 paper, Table 4
ROWS = [(8192, 8, 1, 16, 64, 430, 0.43), (16384, 8, 1, 16, 128, 400, 0.41)]
SEQUENCES = 2048  # 16M tokens per batch at sequence 8,192


def llama3_405b(layers: int = 126) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_attention_heads=128,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def forced(gpus: int, tp: int, pp: int, dp: int, layers: int, budget: float = 30.0) -> tuple[autopar.Plan, float]:
    model = llama3_405b(layers)
    ids = torch.zeros(SEQUENCES, 8192, dtype=torch.long, device="meta")
    mesh = autopar.Mesh((dp, pp, tp), axis_names=("dp", "pp", "tp"))
    start = time.perf_counter()
    plan = autopar.plan(
        model, mesh, example_inputs=(ids,), example_kwargs={"labels": ids}, profile="h100", dtype="bf16",
        mem_cap="80GB", devices_per_node=8, pipeline="pp", compare_families=False, search_budget_s=budget,
    )  # fmt: skip
    return plan, time.perf_counter() - start


def free(gpus: int, layers: int, budget: float = 30.0) -> tuple[autopar.Plan, float]:
    model = llama3_405b(layers)
    ids = torch.zeros(SEQUENCES, 8192, dtype=torch.long, device="meta")
    start = time.perf_counter()
    plan = autopar.plan(
        model, devices=gpus, example_inputs=(ids,), example_kwargs={"labels": ids}, profile="h100", dtype="bf16",
        mem_cap="80GB", devices_per_node=8, pipeline="auto", compare_families=False, search_budget_s=budget,
    )  # fmt: skip
    return plan, time.perf_counter() - start


def print_free(gpus: int, tflops: float, plan: autopar.Plan, took: float) -> None:
    f, pipe = plan.throughput, plan.pipeline
    mesh = " x ".join(f"{n} {k}" for n, k in zip(plan.mesh.axis_names, plan.mesh.shape))
    how = f"{pipe.schedule}, {pipe.virtual} per rank, m {plan.microbatches}" if pipe else "no pipeline"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{gpus} GPUs, autopar's choice: {mesh} ({how}); {f.flops_per_device_s / 1e12:.0f} TFLOP/s per GPU "
        f"({f.flops_per_device_s / 1e12 / tflops:.2f}x of the published {tflops}), step {plan.cost.total_s:.2f} s; "
        f"planned in {took:.0f} s, peak RSS {rss:.2f} GiB"
    )
    for c in plan.meshes:
        step = f"{c.step_s:.2f} s" if c.step_s is not None else f">= {c.at_least_s:.2f} s" if c.at_least_s else "-"
        shape = "x".join(map(str, c.shape))
        print(f"  {shape:>14}: {step:>11}, planned in {c.planning_s:6.1f} s, {c.new_captures} new captures; {c.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, choices=[r[0] for r in ROWS], help="one row (default: both)")
    parser.add_argument("--layers", type=int, default=126, help="layers (default 126, the model's)")
    parser.add_argument(
        "--search-budget", type=float, default=30.0, help="the plan's search budget in seconds (default 30, autopar's)"
    )
    parser.add_argument("--free", action="store_true", help="autopar's choice of mesh for the device count")
    args = parser.parse_args()
    for gpus, tp, _cp, pp, dp, tflops, mfu in ROWS:
        if args.gpus not in (None, gpus):
            continue
        if args.free:
            print_free(gpus, tflops, *free(gpus, args.layers, args.search_budget))
            continue
        try:
            plan, took = forced(gpus, tp, pp, dp, args.layers, args.search_budget)
        except autopar.MemoryCapError as e:
            print(f"{gpus} GPUs (dp {dp} x pp {pp} x tp {tp}): no plan fits: {e.problem}")
            continue
        f, pipe = plan.throughput, plan.pipeline
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"{gpus} GPUs (dp {dp} x pp {pp} x tp {tp}): published {tflops} TFLOP/s per GPU, MFU {mfu:.0%}; "
            f"predicted {f.flops_per_device_s / 1e12:.0f} TFLOP/s ({f.flops_per_device_s / 1e12 / tflops:.2f}x), "
            f"MFU {f.mfu:.1%}; step {plan.cost.total_s:.2f} s, {pipe.schedule}, {pipe.virtual} stage(s) per rank, "
            f"{plan.microbatches} micro-batches, "
            f"bubble {pipe.bubble_fraction:.0%}; {plan.family}; planned in {took:.0f} s, peak RSS {rss:.2f} GiB"
        )
        for j, stage in enumerate(pipe.stages):
            print(f"  stage {j}: {stage.layers}: {stage.time_s * 1e3:.1f} ms, {stage.memory_bytes / 2**30:.1f} GiB")
        print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.cost.terms.items()))


if __name__ == "__main__":
    main()
