"""A large transformer layer's kernels, timed on this device against what a profile prices them at.

    python scripts/kernel_shapes.py                      # a GPU: Llama 3 405B's layer at tp 8 and 4, vs h100
    python scripts/kernel_shapes.py --scale 32 --device cpu --dtype float32 --profile cpu   # a quick CPU check

Issue 32 asks where the datasheet profiles over-predict the TFLOP/s of large published runs (GEMM efficiency by
shape, attention kernels, ...).  This times, one by one, the kernels of one decoder layer of a Llama-shaped
model (width ``--width``, FFN ``--ffn``, ``--heads`` query heads and ``--kv-heads`` key/value heads of 128,
``--tokens`` tokens per micro-batch as one sequence) as one tensor-parallel rank of ``--tp`` runs them: every
projection's forward GEMM with its two backward GEMMs (input and weight gradients), the LM head's, and causal
fused attention forward and backward.  Each is priced by ``costmodel.compute.op_time_s`` (roofline: the
profile's ``matmul_efficiency``, its attention efficiencies, its bandwidth) and the table prints measured
TFLOP/s, predicted TFLOP/s and measured / predicted time.  The last line per tp is the layer's total (the
head apart): how much slower the layer runs than the profile prices it.  ``--scale`` divides every size, so
the script runs anywhere.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from autopar.measure.kernel_rates import attention_times
from costmodel import load_profile
from costmodel.compute import op_time_s


def _timed_s(fn, device: torch.device, trials: int) -> float:
    """Median seconds of ``fn`` over ``trials`` runs after three warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(trials):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layer_gemms(args, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of each forward GEMM one tp rank runs: ``x[m, k] @ w[k, n]``."""
    t, d, head = args.tokens, args.width, 128
    return [
        ("q_proj", t, d, args.heads * head // tp),
        ("k_proj", t, d, max(args.kv_heads // tp, 1) * head),
        ("v_proj", t, d, max(args.kv_heads // tp, 1) * head),
        ("o_proj", t, args.heads * head // tp, d),
        ("gate_proj", t, d, args.ffn // tp),
        ("up_proj", t, d, args.ffn // tp),
        ("down_proj", t, args.ffn // tp, d),
        ("lm_head", t, d, args.vocab // tp),
    ]


def _gemm_rows(name, m, k, n, profile, device, dtype, trials):
    """Rows for a GEMM's forward, input gradient and weight gradient: (label, flops, measured s, predicted s)."""
    rows = []
    size = torch.tensor([], dtype=dtype).element_size()
    for label, (a, b, c) in (("fwd", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (k, m, n))):
        x, w = torch.randn(a, b, device=device, dtype=dtype), torch.randn(b, c, device=device, dtype=dtype)
        flops = 2 * a * b * c
        seconds = _timed_s(lambda x=x, w=w: torch.mm(x, w), device, trials)
        predicted = op_time_s(flops, (a * b + b * c + a * c) * size, profile, dtype, matmul=True)
        rows.append((f"{name} {label} {a}x{b}x{c}", flops, seconds, predicted))
    return rows


def _attention_rows(args, tp, profile, device, dtype, trials):
    """Causal fused attention of one rank's heads: forward, and backward (forward + backward less forward), timed
    as ``autopar calibrate`` times it (``kernel_rates.attention_times``)."""
    shape = (1, max(args.heads // tp, 1), args.tokens, 128)
    t = attention_times(shape, True, device, dtype, lambda fn, dev, n, budget_s=None: _timed_s(fn, dev, n), trials)
    size = torch.tensor([], dtype=dtype).element_size()
    io = 4 * math.prod(shape) * size
    label = "x".join(map(str, shape))
    fwd = op_time_s(t.forward_flops, io, profile, dtype, matmul=True, attention=True)
    bwd = op_time_s(t.backward_flops, 2 * io, profile, dtype, matmul=True, attention=True, backward=True)
    return [
        (f"attention fwd {label}", t.forward_flops, t.forward_s, fwd),
        (f"attention bwd {label}", t.backward_flops, t.backward_s, bwd),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", default="8,4", help="tensor-parallel degrees, comma-separated")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--width", type=int, default=16384)
    parser.add_argument("--ffn", type=int, default=53248)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--scale", type=int, default=1, help="divide tokens, width, ffn, heads and vocab by this")
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    for key in ("tokens", "width", "ffn", "heads", "kv_heads", "vocab"):
        setattr(args, key, max(getattr(args, key) // args.scale, 1))
    profile, device, dtype = load_profile(args.profile), torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}, profile {profile.name}")
    for tp in (int(x) for x in args.tp.split(",")):
        rows = []
        for name, m, k, n in layer_gemms(args, tp):
            rows += _gemm_rows(name, m, k, n, profile, device, dtype, args.trials)
        rows += _attention_rows(args, tp, profile, device, dtype, args.trials)
        print(f"\n tp {tp}, {args.tokens} tokens per micro-batch")
        print(f"  {'kernel':<40} {'ms':>8} {'TFLOP/s':>8} {'priced':>8} {'meas/priced':>11}")
        for label, flops, seconds, predicted in rows:
            print(
                f"  {label:<40} {seconds * 1e3:8.3f} {flops / seconds / 1e12:8.3g} "
                f"{flops / predicted / 1e12:8.3g} {seconds / predicted:11.2f}"
            )
        layer = [r for r in rows if not r[0].startswith("lm_head")]
        measured, priced = sum(r[2] for r in layer), sum(r[3] for r in layer)
        flops = sum(r[1] for r in layer)
        print(
            f"  layer (head apart): {measured * 1e3:.2f} ms measured, {priced * 1e3:.2f} ms priced, "
            f"{flops / measured / 1e12:.1f} TFLOP/s, measured / priced {measured / priced:.2f}"
        )


if __name__ == "__main__":
    main()
