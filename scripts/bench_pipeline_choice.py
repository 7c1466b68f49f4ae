"""What ``pipeline="auto"`` chooses, and how long it takes to choose, on GPT-shaped models at scale.

    python scripts/bench_pipeline_choice.py                   # the three cases below
    python scripts/bench_pipeline_choice.py --case deep       # one of them (deep: see its note)

Cases (GPT-2 code at width 4096, 32 heads, vocab 50257, built on the meta device with its labels so the loss is
in the graph; bf16 with fp32 AdamW state, 80 GiB per device):

* ``slow-fabric-<F>x-b<B>``: 32 layers, batch ``B`` x 2048 (B = 16, 32, 64), on a 4 x 8 mesh (``node`` x
  ``gpu``, 8 devices per node) with the h100 profile whose inter-node link (one NIC per GPU) is made ``F`` = 20
  x (22.5 GB/s) and 50 x (9 GB/s) slower than its NVLink (450 GB/s; the h100's own NDR is 9 x).  Without a
  pipeline, every plan syncs the model's gradients (13 GB in bf16) over the 4 nodes: reduced inside the node
  first, each GPU's NIC carries an eighth, ``2 (4 - 1) / 4 x 13 GB / 8 / 22.5 GB/s`` = 0.11 s at 20 x, hidden
  behind backward where backward is longer.  Backward grows with the batch and the sync does not, so the
  choice turns on the batch: where the sync outruns backward, a pipeline runs over ``node`` (one activation
  per stage boundary on the slow link instead of every gradient), the stages sharded inside the node;
  measured 2026-11-28 (this machine): at 20 x, batch 16 pipelines (interleaved, m = 16, the stages sequence-
  and tensor-parallel inside the node: 0.188 s against 0.206 s without), batch 32 and 64 do not (data parallel,
  0.267 s and 0.425 s); at 50 x, batch 16 and 32 pipeline (0.196 s against 0.373 s; 0.384 s against 0.434 s),
  batch 64 does not (0.492 s);
* ``one-node``: GPT-2 small (12 layers, width 768) on 8 devices of one node, h100: no pipeline;
* ``deep``: 96 layers on a 4 x 8 x 8 mesh (``pp`` x ``dp`` x ``tp``), h100 profile: every candidate (no pipeline,
  each axis x micro-batch counts x schedules) searched.  Not run by default (about a minute, most of it the
  strategies of three axes).  Measured 2026-11-29 on 2 cores: 7.75 and 8.08 s of search (two runs; 18.3 s the
  morning before), 36-38 s of strategies, 58-62 s in all; the issue asks for 10 s of search.

Columns: the choice (axis, schedule, micro-batches, the stage split), its step, the no-pipeline plan's step,
candidates priced, and the seconds of capture, strategies (candidates and cost tables) and search summed over
every candidate (``Plan.timings``), and the wall-clock total.  Run on an idle machine.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch
import transformers

import autopar
from autopar.planner import MemoryCapError

H100 = pathlib.Path(autopar.__file__).resolve().parents[1] / "configs" / "devices" / "h100.toml"


def gpt_shaped(layers: int, width: int, heads: int, batch: int, seq: int):
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257, n_positions=seq, use_cache=False
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def slow_fabric_profile(folder: str, slower: float = 20.0) -> str:
    """The h100 profile with its inter-node bandwidth ``slower`` times under its intra-node one."""
    text = H100.read_text()
    head, inter = text.split("[inter_node]")
    lines = [
        f"bandwidth_bytes_per_s = {450e9 / slower:.6g}" if line.startswith("bandwidth_bytes_per_s") else line
        for line in inter.splitlines()
    ]
    path = pathlib.Path(folder) / f"h100-slow-fabric-{slower:g}.toml"
    path.write_text(head.replace('name = "h100"', f'name = "h100-x{slower:g}"') + "[inter_node]" + "\n".join(lines))
    return str(path)


def cases(folder: str) -> dict[str, dict]:
    return {
        **{
            f"slow-fabric-{slower}x-b{batch}": dict(
                model=gpt_shaped(32, 4096, 32, batch=batch, seq=2048),
                mesh=autopar.Mesh((4, 8), axis_names=("node", "gpu")),
                profile=slow_fabric_profile(folder, slower),
            )
            for slower in (20, 50)
            for batch in (16, 32, 64)
        },
        "one-node": dict(
            model=gpt_shaped(12, 768, 12, batch=32, seq=1024),
            mesh=autopar.Mesh((8,), axis_names=("dp",)),
            profile="h100",
        ),
        "deep": dict(
            model=gpt_shaped(96, 4096, 32, batch=64, seq=2048),
            mesh=autopar.Mesh((4, 8, 8), axis_names=("pp", "dp", "tp")),
            profile="h100",
        ),
    }


def one(name: str, case: dict) -> None:
    model, args, kwargs = case["model"]
    common = dict(
        example_inputs=args,
        example_kwargs=kwargs,
        profile=case["profile"],
        dtype="bf16",
        mem_cap="80GiB",
        compare_families=False,
    )
    start = time.perf_counter()
    plan = autopar.plan(model, case["mesh"], pipeline="auto", **common)
    wall = time.perf_counter() - start
    try:
        flat = autopar.plan(model, case["mesh"], pipeline="none", **common).cost.total_s
        flat_text = f"{flat:.4g} s"
    except MemoryCapError as e:
        flat_text = f"does not fit ({e.problem.splitlines()[0][:60]})"
    t = plan.timings
    if plan.pipeline is None:
        chose = "no pipeline" + (f", {plan.microbatches} accumulated" if plan.microbatches > 1 else "")
    else:
        pipe = plan.pipeline
        split = " | ".join(str(st.stop_layer - st.first_layer) for st in pipe.stages)
        chose = f"pipeline over {pipe.axis}: {pipe.schedule}, m={plan.microbatches}, layers per stage {split}"
    print(f"{name}: {case['mesh']}")
    print(f"  chose       {chose}")
    axes = sorted({c.axis for c in plan.collectives}) or ["none"]
    print(f"  family      {plan.family}; collectives on {', '.join(axes)}")
    print(f"  step        {plan.cost.total_s:.4g} s; without a pipeline {flat_text}")
    print(
        f"  work        {int(t.get('candidates', 1))} candidates; capture {t.get('capture_s', 0):.2f} s, strategies "
        f"{t.get('strategies_s', 0):.2f} s, search {t.get('search_s', 0):.2f} s; wall {wall:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as folder:
        table = cases(folder)
        ap.add_argument("--case", choices=tuple(table), action="append")
        opts = ap.parse_args()
        for name in opts.case or [k for k in table if k != "deep"]:
            one(name, table[name])


if __name__ == "__main__":
    main()
