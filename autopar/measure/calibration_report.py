"""What ``autopar calibrate`` prints and writes: the measurements, their fits and residuals, the noise of the
repeats (``render_calibration``), and the profile TOML (``write_profile``)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .calibrate import Calibration

__all__ = ["noise_line", "render_calibration", "write_profile"]


def render_calibration(cal: Calibration) -> str:
    """The measurements, the fits and their residuals, as text."""
    lines = [
        f"autopar calibrate: {cal.machine}; {cal.ranks} {cal.backend} ranks; torch {torch.__version__}; "
        f"{cal.date}; {cal.wall_s:.0f} s"
        + (f"; each number the median of {cal.passes} passes" if cal.passes > 1 else ""),
        "",
        "matmul rate per dtype (median over transformer-shaped GEMMs; residual = shape / median - 1):",
    ]
    for dtype, fit in cal.matmul.items():
        worst = max(fit.residuals, key=abs)
        lines.append(
            f"  {dtype:<9} {fit.rate / 1e9:9.1f} GFLOP/s   residuals {min(fit.residuals):+.0%} .. "
            f"{max(fit.residuals):+.0%} (worst {worst:+.0%})"
        )
    lines.append(
        f"memory bandwidth: {cal.bandwidth.rate / 1e9:.2f} GB/s (copy {cal.bandwidth.samples[0][1] / 1e9:.2f}, "
        f"add {cal.bandwidth.samples[1][1] / 1e9:.2f})"
    )
    if cal.attention is not None:
        reference = cal.matmul[cal.attention_dtype].rate
        shapes = ", ".join(f"{label} {rate / reference:.2f}" for label, rate in cal.attention["forward"].samples)
        lines.append(
            f"fused attention ({cal.attention_dtype}) over the matmul rate: forward "
            f"{cal.attention_efficiency('forward'):.2f}, backward {cal.attention_efficiency('backward'):.2f} "
            f"(forward per shape: {shapes})"
        )
    if cal.optimizer is not None:
        o = cal.optimizer
        lines.append(
            f"optimizer step (AdamW): {o['op_overhead_s'] * 1e6:.1f} us per kernel, "
            f"{o['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s over its tensor passes "
            f"(small tensors {o['small_s'] * 1e3:.2f} ms, a layer's {o['layer_s'] * 1e3:.2f} ms)"
        )
    lines.append(
        f"runtime overhead per op ({cal.ops} ops, no collective): forward {cal.forward_op_s * 1e6:.1f} us, "
        f"backward {cal.backward_op_s * 1e6:.1f} us; a view (no kernel) {cal.view_op_s * 1e6:.1f} us"
    )
    if cal.overlap is not None:
        o = cal.overlap
        lines.append(
            f"overlap: a 16 MiB all-reduce {o['reduce_s'] * 1e3:.1f} ms, matmuls {o['compute_s'] * 1e3:.1f} ms, "
            f"both at once {o['both_s'] * 1e3:.1f} ms: {o['hidden']:+.0%} of the all-reduce hidden "
            f"(grad_reduce_overlap {min(max(o['hidden'], 0.0), 0.95):.2f})"
        )
    if cal.collectives:
        lines += ["", "collectives: t = latency + factor * nbytes / bandwidth per group size (slowest rank):"]
        lines.append(
            f"  {'kind':<15}{'group':>6}{'latency':>12}{'bandwidth':>14}   measured ms (residual of the line) per size"
        )
        for kind, per_size in cal.collectives.items():
            for n, fit in sorted(per_size.items()):
                cells = " ".join(
                    f"{t * 1e3:.2f} ({r:+.0%})" for (_, t), r in zip(cal.collective_points[kind][n], fit.residuals)
                )
                lines.append(
                    f"  {kind:<15}{n:>6}{fit.latency_s * 1e6:>10.0f}us{fit.bandwidth_bytes_per_s / 1e9:>10.3f}GB/s"
                    f"   {cells}"
                )
        lines.append(
            "  (the profile keeps the measured points: the cost model follows them between sizes, the line beyond)"
        )
    else:
        lines.append("collectives: one rank, nothing to measure (links come from the base profile)")
    lines += ["", noise_line(cal)]
    return "\n".join(lines) + "\n"


def noise_line(cal: Calibration) -> str:
    """How much the repeats of each point spread, and whether the machine was busy when calibrate started."""
    if not cal.spreads:
        return "noise: not measured"
    worst = max(cal.spreads)
    load = "" if cal.load_before is None else f"; load average {cal.load_before:.1f} on {cal.cores} cores before"
    busy = " (busy: another process ran in the minute before)" if cal.busy else ""
    return (
        f"noise: the repeats of {len(cal.spreads)} points spread (max - min) / median by {cal.spread:.1%} in the "
        f"median, {worst:.1%} at worst{load}{busy}"
    )


def write_profile(cal: Calibration, path: str, name: str | None = None) -> None:
    """Write the calibrated profile as TOML (``costmodel.load_profile`` and ``--profile`` read it)."""
    import tomli_w

    name = name or os.path.splitext(os.path.basename(path))[0]
    header = (
        f"# Device profile {name!r}, {cal.source}: `autopar calibrate` prints how each number was measured.\n"
        "# Rates are achieved ones (efficiencies 1.0); keys not measured come from the base profile.\n"
    )
    text = header + tomli_w.dumps(cal.profile_dict(name))
    if path == "-":
        sys.stdout.write(text)
        return
    with open(path, "w") as f:
        f.write(text)
