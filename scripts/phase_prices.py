"""One training step on one device, phase by phase, against the cost model's price of each phase.

    python scripts/phase_prices.py gpt2 --batch 8 --seq 1024 --profile gpu.toml             # a GPU
    python scripts/phase_prices.py gpt2-tiny --batch 4 --seq 64 --profile cpu --device cpu  # anywhere

Where ``autopar fidelity`` finds every plan on one device predicted fast by about the same fraction (the H200 run of
2026-11-30: GPT-2 small -8%, BERT-base -15%), this says which phase carries it.  The model (a built-in name, dropout
off, the loss in the model as the fidelity harness trains it) is priced on a one-device mesh, where every op has one
placement: per op, its forward (``Coster.forward_time_s``) and its backward (``Coster.node_time_s`` less the
forward), by family (GEMMs, fused attention, the rest), and the AdamW step of every parameter
(``Coster.optimizer_step_s``).  The same step is then run eagerly on ``--device`` (forward; backward; AdamW step and
``zero_grad``), the device synchronized between phases, and each phase's median over ``--steps`` steps after
``--warmup`` is printed beside its price.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.utils._pytree import tree_map

import autopar
from autopar.models import load_model
from autopar.planner import prepare
from autopar.strategies import SourceStrategy
from costmodel.flops import is_matmul_like, op_family


def priced_phases(name: str, batch: int, seq: int | None, profile: str) -> dict[str, float]:
    """Seconds the cost model prices for each phase: ``forward <family>``, ``backward <family>``, ``optimizer``."""
    model, args, kwargs = load_model(name, batch=batch, seq=seq, no_dropout=True)
    ctx = prepare(model, autopar.Mesh((1,)), example_inputs=args, example_kwargs=kwargs, profile=profile)
    out: dict[str, float] = defaultdict(float)
    for node in ctx.graph.nodes:
        strategies = ctx.cand.strategies[node.index]
        if node.kind == "param":
            out["optimizer"] += min(ctx.coster.optimizer_step_s(node, s) for s in strategies)
        if node.kind != "op":
            continue
        s = min(strategies, key=lambda s: ctx.coster.node_time_s(node, s))
        if isinstance(s, SourceStrategy):
            continue
        family = "attention" if op_family(node.call) == "sdpa" else "GEMM" if is_matmul_like(node.call) else "other"
        forward = ctx.coster.forward_time_s(node, s)
        out[f"forward {family}"] += forward
        out[f"backward {family}"] += ctx.coster.node_time_s(node, s) - forward
    return dict(out)


def measured_phases(name: str, batch: int, seq: int | None, device: str, warmup: int, steps: int) -> dict[str, float]:
    """Median seconds of each phase of an eager training step on ``device``: forward, backward, optimizer."""
    model, args, kwargs = load_model(name, batch=batch, seq=seq, device=device, no_dropout=True)
    args, kwargs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    model.train()
    opt = torch.optim.AdamW(model.parameters())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = defaultdict(list)
    for step in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        out = model(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        t3 = time.perf_counter()
        if step >= warmup:
            for phase, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
                times[phase].append(seconds)
    return {phase: statistics.median(values) for phase, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--profile", default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    priced = priced_phases(args.model, args.batch, args.seq, args.profile)
    measured = measured_phases(args.model, args.batch, args.seq, args.device, args.warmup, args.steps)
    print(f"{args.model} batch {args.batch} seq {args.seq} on {args.device}, profile {args.profile}")
    print(f"  {'phase':<22} {'priced ms':>10} {'measured ms':>12} {'meas/priced':>12}")
    for phase in ("forward", "backward", "optimizer"):
        parts = {k: v for k, v in priced.items() if k.split()[0] == phase}
        total = sum(parts.values())
        print(f"  {phase:<22} {total * 1e3:10.2f} {measured[phase] * 1e3:12.2f} {measured[phase] / total:12.2f}")
        if len(parts) > 1:
            for key, value in sorted(parts.items()):
                print(f"    {key:<20} {value * 1e3:10.2f}")
    step_priced, step_measured = sum(priced.values()), sum(measured.values())
    print(f"  {'step':<22} {step_priced * 1e3:10.2f} {step_measured * 1e3:12.2f} {step_measured / step_priced:12.2f}")


if __name__ == "__main__":
    main()
