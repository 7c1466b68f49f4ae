"""What ``pipeline="auto"`` chooses, and how long it takes to choose, on GPT-shaped models at scale.

    python scripts/bench_pipeline_choice.py                   # the three cases below
    python scripts/bench_pipeline_choice.py --case deep       # one of them (deep: see its note)

Cases (GPT-2 code at width 4096, 32 heads, vocab 50257, built on the meta device with its labels so the loss is
in the graph; bf16 with fp32 AdamW state, 80 GiB per device):

* ``slow-fabric``: 32 layers, batch 32 x 2048, on a 4 x 8 mesh (``node`` x ``gpu``, 8 devices per node) with the
  h100 profile whose inter-node link is made 20 x (22.5 GB/s) and 50 x (9 GB/s) slower than its NVLink (450
  GB/s): where the data-parallel gradient all-reduce over the nodes outruns backward, a pipeline runs over
  ``node`` (one activation per stage boundary on the slow link instead of every gradient), the stages sharded
  inside the node;
* ``one-node``: GPT-2 small (12 layers, width 768) on 8 devices of one node, h100: no pipeline;
* ``deep``: 96 layers on a 4 x 8 x 8 mesh (``pp`` x ``dp`` x ``tp``), h100 profile: every candidate (no pipeline,
  each axis x micro-batch counts x schedules) searched.  Not run by default (2.5 minutes, most of it the
  strategies of three axes).  Measured 2026-11-27 on 2 cores: 18-19 s of search (the chained search without a
  pipeline, exact since the block budget of ``search/chain_tables.py``, about 11 s of it; before, 71-88 s of an
  approximate flat search whose plan was 3.8x slower: 2.70 s against 0.711 s), 82-88 s of strategies, 137-142 s
  in all; the issue asks for 10 s of search (the open part of issue 31).

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
            f"slow-fabric-{slower}x": dict(
                model=gpt_shaped(32, 4096, 32, batch=32, seq=2048),
                mesh=autopar.Mesh((4, 8), axis_names=("node", "gpu")),
                profile=slow_fabric_profile(folder, slower),
            )
            for slower in (20, 50)
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
    print(f"  family      {plan.family}; step {plan.cost.total_s:.4g} s; without a pipeline {flat_text}")
    print(
        f"  work        {int(t.get('candidates', 1))} candidates; capture {t.get('capture_s', 0):.2f} s, strategies "
        f"{t.get('strategies_s', 0):.2f} s, search {t.get('search_s', 0):.2f} s; wall {wall:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("slow-fabric-20x", "slow-fabric-50x", "one-node", "deep"), action="append")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        table = cases(folder)
        for name in opts.case or [k for k in table if k != "deep"]:
            one(name, table[name])


if __name__ == "__main__":
    main()
