"""Activation recomputation at scale: predicted step time and memory with recomputation allowed and forbidden.

    python scripts/recompute_table.py                          # Llama-7B-shaped on 8 and 8x8, caps 80/40/24 GiB
    python scripts/recompute_table.py --meshes 8 --caps 80GiB 40GiB
    python scripts/recompute_table.py --depths 24 48 96        # search seconds of GPT-shaped models at depth
    python scripts/recompute_table.py --meshes --depths 24 48 96 --sweep   # ... over 31 caps, 0.25x to 1.0x

Each mesh: Llama-7B-shaped (``configs/models/llama-7b-shaped.toml``), bf16 with fp32
optimizer state (AdamW), seq 4096, global batch 8, the h100 profile, built on the meta
device.  The mesh ``8`` is one axis of 8 devices; ``8x8`` is ``dp`` across nodes by ``tp``
inside a node.  Per cap: the plan's predicted step time and per-device memory with
``recompute="auto"`` (the search may recompute, selectively or whole layers) and with
``"none"``, what the plan recomputes (how many layers whole, ``full``, and
selectively, ``sele``: each layer chooses; ``+ rest``: the rest of the graph too), and per mode the smallest
per-device memory any plan reaches (the smallest cap that has a plan: from the error of a cap no plan fits).

``--depths`` times the search (``plan_from_context`` with ``recompute="full"`` and with
``"auto"`` under caps of ``--cap-fractions`` times the full plan's memory) on GPT-shaped
models of that many layers (width 4096, seq 2048, batch 16, mesh 8x8): the time should stay
flat in depth (the chained search solves one layer and chains it).  Timings are
wall-clock on this machine; a cell shows what auto chose (none, sel, full, or mix: per layer).
"""

from __future__ import annotations

import argparse
import statistics
import time

import autopar
from autopar.launch import load_model
from autopar.units import format_bytes, parse_bytes


def _mesh(text: str) -> autopar.Mesh:
    shape = tuple(int(x) for x in text.split("x"))
    return autopar.Mesh(shape, axis_names=("dp", "tp")[-len(shape) :] if len(shape) > 1 else ("dp",))


def _smallest(ctx, recompute: str) -> int:
    """The least per-device memory of any plan (the smallest cap with a plan), from a cap none fits."""
    try:
        autopar.plan_from_context(ctx, mem_cap=1, compare_families=False, recompute=recompute)
    except autopar.MemoryCapError as e:
        return e.min_mem_bytes
    raise AssertionError("a 1-byte cap had a plan")


def _row(ctx, cap: int, recompute: str) -> str:
    try:
        p = autopar.plan_from_context(ctx, mem_cap=cap, compare_families=False, recompute=recompute)
    except autopar.MemoryCapError:
        return f"{'no plan':>10} {'':>10} {'':>16}"
    layers = p.search.recompute_layers
    parts = [f"{getattr(layers, m)} {m[:4]}" for m in ("full", "selective") if layers and getattr(layers, m)]
    parts += ["rest"] if p.search.recompute_rest else []
    recomputed = " + ".join(parts) or "-"  # layers recomputed whole, and selectively; the rest of the graph
    return f"{p.cost.total_s * 1e3:>8.1f}ms {format_bytes(p.memory.per_device_bytes):>10} {recomputed:>16}"


def table(meshes: list[str], caps: list[str], model: str, batch: int, seq: int) -> None:
    net, args, kwargs = load_model(model, batch=batch, seq=seq, device="meta")
    for text in meshes:
        t0 = time.perf_counter()
        ctx = autopar.prepare(
            net, _mesh(text), example_inputs=args, example_kwargs=kwargs, profile="h100", dtype="bf16"
        )
        print(
            f"\n{model}, batch {batch}, seq {seq}, bf16, h100, mesh {text} "
            f"(prepared in {time.perf_counter() - t0:.1f} s)"
        )
        print(f"{'cap':>8} | {'recompute allowed (auto)':^38} | {'recompute forbidden (none)':^38}")
        head = f"{'step':>10} {'memory':>10} {'layers recomputed':>16}"
        print(f"{'':>8} | {head} | {head}")
        for cap in caps:
            c = parse_bytes(cap)
            print(f"{cap:>8} | {_row(ctx, c, 'auto')} | {_row(ctx, c, 'none')}")
        print(
            f"smallest feasible cap: {format_bytes(_smallest(ctx, 'auto'))} each layer and the rest of the graph "
            f"choosing, {format_bytes(_smallest(ctx, 'full'))} recomputing whole layers, "
            f"{format_bytes(_smallest(ctx, 'selective'))} selectively, {format_bytes(_smallest(ctx, 'none'))} without"
        )


def _gpt_context(n: int):
    """A GPT-shaped model of ``n`` layers (width 4096, seq 2048, batch 16) prepared on 8x8, bf16, h100."""
    import torch
    import transformers

    config = transformers.GPT2Config(n_layer=n, n_embd=4096, n_head=32, n_positions=2048, vocab_size=50257)
    with torch.device("meta"):
        net = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(16, 2048, dtype=torch.long, device="meta")
    return autopar.prepare(
        net, _mesh("8x8"), example_inputs=(ids,), example_kwargs={"labels": ids}, profile="h100", dtype="bf16"
    )


def sweep(layers: list[int], fractions: list[float]) -> None:
    """Per depth: the seconds of ``recompute="auto"`` over every cap (fractions of the full plan's memory), the
    slowest cap, and how many searches stopped within the planner's gap rather than proving the optimum."""
    print(f"\n{'layers':>6} {'caps':>5} {'median s':>9} {'max s':>7} {'at':>7} {'within gap':>11}")
    for n in layers:
        ctx = _gpt_context(n)
        full = autopar.plan_from_context(ctx, compare_families=False, recompute="full").memory.per_device_bytes
        seconds, gapped = [], 0
        for f in fractions:
            t0 = time.perf_counter()
            p = autopar.plan_from_context(ctx, compare_families=False, recompute="auto", mem_cap=int(f * full))
            seconds.append(time.perf_counter() - t0)
            gapped += not p.search.optimal
        worst = max(range(len(seconds)), key=seconds.__getitem__)
        print(
            f"{n:>6} {len(seconds):>5} {statistics.median(seconds):>9.2f} {seconds[worst]:>7.2f} "
            f"{format(fractions[worst], 'g') + 'x':>7} {gapped:>11}"
        )


def depths(layers: list[int], fractions: list[float]) -> None:
    head = " ".join(f"{'auto ' + format(f, 'g') + 'x':>10}" for f in fractions)
    print(f"\n{'layers':>6} {'full s':>8} {head}  (auto: caps x the full plan's memory)")
    for n in layers:
        ctx = _gpt_context(n)
        t0 = time.perf_counter()
        full = autopar.plan_from_context(ctx, compare_families=False, recompute="full")
        cells = [f"{time.perf_counter() - t0:>8.2f}"]
        for f in fractions:
            t1 = time.perf_counter()
            p = autopar.plan_from_context(
                ctx, compare_families=False, recompute="auto", mem_cap=int(f * full.memory.per_device_bytes)
            )
            mode = {"none": "none", "selective": "sel", "full": "full", "per layer": "mix"}[p.search.recompute_mode]
            cells.append(f"{time.perf_counter() - t1:>5.2f} {mode:>4}")
        print(f"{n:>6} {' '.join(cells)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--meshes", nargs="*", default=["8", "8x8"])
    ap.add_argument("--caps", nargs="*", default=["80GiB", "40GiB", "24GiB"])
    ap.add_argument("--model", default="llama-7b-shaped")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--depths", nargs="*", type=int, default=[])
    ap.add_argument("--cap-fractions", nargs="*", type=float, default=[1.0, 0.6, 0.4, 0.3])
    ap.add_argument("--sweep", action="store_true", help="with --depths: every cap from 0.25x to 1.0x by 0.025")
    a = ap.parse_args()
    if a.meshes:
        table(a.meshes, a.caps, a.model, a.batch, a.seq)
    if a.depths and a.sweep:
        sweep(a.depths, [round(0.25 + 0.025 * i, 3) for i in range(31)])
    elif a.depths:
        depths(a.depths, a.cap_fractions)


if __name__ == "__main__":
    main()
