"""Probe autopar on Hugging Face architectures and odd sizes it has not been tuned on.

For each architecture (a tiny random-weight config: odd vocabulary, head counts and
widths the mesh does not divide, batch 3) and each mesh shape, plan with no memory
cap and with a tight one, and print one line: plan ok / the ops that fell back to
replicate / the error.  Nothing is downloaded; an architecture this transformers lacks
is reported as an error that names the missing class.  ``--numerics`` trains instead:
3 AdamW steps on gloo ranks against one device, one line per family with the worst
deviation in units of the tolerance (rtol 1e-4, atol 1e-5; <= 1 passes).

    python3 scripts/probe_models.py [--arch mistral,opt] [--mesh 2,4,2x2,3] [--profile h100]
    python3 scripts/probe_models.py --numerics --arch t5 --mesh 2,3 --families auto,"data parallel" \
        [--batch 4] [--set hidden_size=40,num_attention_heads=5]

The architectures are those of ``configs/models/tiny_hf.toml`` (also built-in CLI
models: ``autopar plan t5-tiny``).  ``--set`` overrides config keyword arguments of
every architecture probed (ints, floats, true/false, none).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _archs() -> list[str]:
    from autopar.models import tiny_hf_archs

    return list(tiny_hf_archs())


@dataclass(frozen=True, slots=True)
class Size:
    """The example batch and sequence, config keyword arguments over the table's, and whether the
    user inputs are pinned to ``S(0)`` on mesh axis 0 (a batch split the search would not choose,
    uneven ones included)."""

    batch: int = 3
    seq: int = 12
    overrides: tuple[tuple[str, Any], ...] = ()
    split_batch: bool = False


def build(name: str, size: Size = Size(), *, device: str = "cpu"):
    """(model, args, kwargs) of the tiny random-weight ``name`` (configs/models/tiny_hf.toml), dropout off."""
    from autopar.models import TINY_SUFFIX, load_model

    model, args, kwargs = load_model(
        name + TINY_SUFFIX,
        batch=size.batch,
        seq=size.seq,
        device=device,
        no_dropout=True,
        overrides=dict(size.overrides),
    )
    model.train()
    return model, args, kwargs


def parse_overrides(text: str) -> tuple[tuple[str, Any], ...]:
    """``"hidden_size=40,rope_theta=1e4,sliding_window=none"`` -> ((key, value), ...)."""
    out = []
    for item in filter(None, text.split(",")):
        key, _, raw = item.partition("=")
        value = tomllib.loads(f"v = {raw}")["v"] if raw.lower() != "none" else None
        out.append((key.strip(), value))
    return tuple(out)


def probe(name: str, mesh_shape: tuple[int, ...], profile: str, size: Size = Size()) -> dict:
    import autopar
    from autopar.planner.driver import MemoryCapError, plan_from_context, prepare

    model, args, kwargs = build(name, size, device="meta")
    mesh = autopar.Mesh(mesh_shape)
    t0 = time.perf_counter()
    ctx = prepare(model, mesh, example_inputs=args, example_kwargs=kwargs, profile=profile)
    plan = plan_from_context(ctx, compare_families=False)
    fb = collections.Counter(f.op for f in plan.fallback_ops)
    mem = plan.memory.per_device_bytes
    tight = int(mem * 0.7)
    try:
        capped = plan_from_context(ctx, mem_cap=tight, compare_families=False)
        cap_result = f"cap ok ({capped.family}, {capped.memory.per_device_bytes / mem:.2f}x)"
        if capped.memory.per_device_bytes > tight:
            cap_result = f"CAP EXCEEDED {capped.memory.per_device_bytes} > {tight}"
    except MemoryCapError as e:
        cap_result = f"cap infeasible ({str(e).splitlines()[0][:80]})"
    return {"family": plan.family, "fallback": dict(fb), "cap": cap_result, "s": time.perf_counter() - t0}


STEPS = 3
ADAMW = {"lr": 1e-3, "eps": 1e-6}  # as tests/test_execution.py
CHEAP_COMM = str(Path(__file__).resolve().parents[1] / "tests" / "profiles" / "cheap_comm.toml")


def train(model, call, args, kwargs) -> tuple:
    """(losses, step-0 logits, step-0 grads, params after STEPS AdamW steps) of a model callable."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, logits0, grads0 = [], None, None
    for step in range(STEPS):
        loss, logits = call(*args, **kwargs)[:2]  # a compiled model returns every output (T5: 3)
        loss.backward()
        if step == 0:
            logits0 = logits.detach()
            grads0 = (
                model.full_grads()
                if hasattr(model, "full_grads")
                else {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
            )
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = (
        model.full_state_dict()
        if hasattr(model, "full_state_dict")
        else {k: v.detach().clone() for k, v in model.state_dict().items()}
    )
    return losses, logits0, grads0, params


def reference(name: str, size: Size) -> tuple:
    model, args, kwargs = build(name, size)

    def call(*a, **k):
        o = model(*a, **k)
        return o.loss, o.logits

    return train(model, call, args, kwargs)


def rank_fn(rank: int, world: int, name: str, mesh_shape: tuple, family: str | None, size: Size):
    """On one gloo rank: compile ``name`` under ``family`` (None: auto) and train; returns (plan family, train())."""
    import autopar

    model, args, kwargs = build(name, size)
    mesh = autopar.Mesh(mesh_shape)
    batch_split = ["S(0)"] + ["R"] * (len(mesh_shape) - 1)
    pinned = {"input_ids": batch_split, "labels": batch_split} if getattr(size, "split_batch", False) else None
    sharded = autopar.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        family=family,
        profile=CHEAP_COMM,
        input_placements=pinned,
    )
    return sharded.plan.family, train(sharded, sharded, args, kwargs)


def worst_deviation(ref: tuple, got: tuple) -> tuple[float, str]:
    """The largest |got - ref| / (atol + rtol |ref|) over losses, logits, grads and params (<= 1: passes)."""
    rtol, atol = 1e-4, 1e-5
    worst, where = 0.0, ""
    pairs = [(f"loss{i}", a, b) for i, (a, b) in enumerate(zip(got[0], ref[0]))] + [("logits", got[1], ref[1])]
    pairs += [(f"grad {k}", got[2].get(k), v) for k, v in ref[2].items()]
    pairs += [(f"param {k}", got[3].get(k), v) for k, v in ref[3].items()]
    for what, a, b in pairs:
        if a is None or a.shape != b.shape:
            return float("inf"), f"{what}: missing or shape {None if a is None else tuple(a.shape)}"
        r = float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0
        if r > worst:
            worst, where = r, what
    return worst, where


def numerics(name: str, mesh_shape: tuple[int, ...], families: list, size: Size = Size()) -> None:
    from autopar.runtime.spawn import RankSettings, spawn_ranks

    ref = reference(name, size)
    for family in families:
        split = " split" if size.split_batch else ""
        key = f"{name} {'x'.join(map(str, mesh_shape))} {family or 'auto'} b{size.batch}{split}"
        t0 = time.perf_counter()
        try:
            results, _ = spawn_ranks(
                rank_fn, math.prod(mesh_shape), name, mesh_shape, family, size, settings=RankSettings(timeout_s=600)
            )
            devs = [(worst_deviation(ref, res), label) for label, res in results]
            (dev, where), label = max(devs, key=lambda x: x[0][0])
            verdict = "PASS" if dev <= 1.0 else "FAIL"
            line = f"{verdict} ({label}) worst {dev:.3g} at {where}"
        except Exception as e:  # noqa: BLE001 - a probe reports every failure
            detail = "\n    ".join(str(e).strip().splitlines()[-30:])  # the ranks' tracebacks end the message
            line = f"ERROR {type(e).__name__}:\n    {detail}"
        print(f"{key:44s} {line} [{time.perf_counter() - t0:.0f}s]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default=",".join(_archs()))
    ap.add_argument("--mesh", default="2,4,2x2,3")
    ap.add_argument("--profile", default="tests/profiles/cheap_comm.toml")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--numerics", action="store_true", help="train on gloo ranks vs one device instead")
    ap.add_argument("--families", default="auto,tensor parallel")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--seq", type=int, default=12)
    ap.add_argument("--set", default="", help="config overrides, e.g. hidden_size=40,num_attention_heads=5")
    ap.add_argument("--split-batch", action="store_true", help="pin the inputs to S(0) on mesh axis 0")
    ns = ap.parse_args()
    size = Size(ns.batch, ns.seq, parse_overrides(ns.set), ns.split_batch)
    if ns.numerics:
        fams = [None if f == "auto" else f for f in ns.families.split(",")]
        for name in ns.arch.split(","):
            for m in ns.mesh.split(","):
                numerics(name, tuple(int(x) for x in m.split("x")), fams, size)
        return
    meshes = [tuple(int(x) for x in m.split("x")) for m in ns.mesh.split(",")]
    results = {}
    for name in ns.arch.split(","):
        for mesh_shape in meshes:
            key = f"{name} {'x'.join(map(str, mesh_shape))}"
            try:
                r = probe(name, mesh_shape, ns.profile, size)
                line = f"ok {r['family']}; fallback {r['fallback'] or 'none'}; {r['cap']}; {r['s']:.1f}s"
            except Exception as e:  # noqa: BLE001 - a probe reports every failure
                tb = traceback.format_exc().strip().splitlines()
                r = {"error": f"{type(e).__name__}: {e}"[:300], "where": tb[-3:]}
                line = f"ERROR {type(e).__name__}: {str(e)[:200]} @ {tb[-3].strip() if len(tb) > 2 else ''}"
            results[key] = r
            print(f"{key:24s} {line}", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
