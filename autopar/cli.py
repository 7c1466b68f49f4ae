"""The ``autopar`` command line: a thin shell over the Python API.

    autopar plan MODEL --mesh 2x4 --axis-names dp,tp --mem-cap 40GiB --profile h100 \\
        --batch 8 --seq 1024 --dtype bf16 --format table|json [-o FILE] [--solver dp|ilp] [--timings]
    autopar models          # the built-in model names

``--batch`` is the global batch.  ``--timings`` prints, as the last line on
stderr, one JSON object {"capture_s", "strategies_s", "search_s", "total_s",
"peak_rss_bytes"}.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time

from .mesh import Mesh
from .units import parse_bytes

__all__ = ["main"]


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: expected sizes joined by 'x', e.g. 8 or 2x4") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: every axis size must be >= 1")
    return shape


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Auto-partition PyTorch models over a device mesh.")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="plan a model and print the chosen strategies")
    pl.add_argument(
        "model", help="built-in name (see `autopar models`), path/to/file.py:factory or package.module:factory"
    )
    pl.add_argument("--mesh", type=_mesh_shape, default=(4,), help="mesh shape, e.g. 8 or 2x4 (default 4)")
    pl.add_argument("--axis-names", default=None, help="comma-separated axis names, e.g. dp,tp")
    pl.add_argument("--mem-cap", type=_bytes_arg, default=None, help="per-device memory cap: bytes or 40GiB, 512MiB")
    pl.add_argument("--profile", default="h100", help="device profile from configs/devices (default h100)")
    pl.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    pl.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    pl.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="training precision")
    pl.add_argument("--optimizer", default="adamw", help="adamw | adam | sgd | sgd_momentum | none")
    pl.add_argument("--solver", default="dp", choices=("dp", "ilp"), help="exact DP (default) or the CP-SAT model")
    pl.add_argument("--format", default="table", choices=("table", "json"))
    pl.add_argument("-o", "--output", default=None, help="write the plan JSON to this file")
    pl.add_argument("--no-compare", action="store_true", help="skip the per-family comparison solves")
    pl.add_argument("--timings", action="store_true", help="print timings as JSON, last line on stderr")
    sub.add_parser("models", help="list the built-in models")
    return p


def _cmd_plan(args) -> int:
    from .models import load_model
    from .planner import MemoryCapError, plan
    from .report import render_table

    t0 = time.perf_counter()
    names = (
        tuple(args.axis_names.split(","))
        if args.axis_names
        else (("dp",) if len(args.mesh) == 1 else tuple(f"axis{i}" for i in range(len(args.mesh))))
    )
    try:
        mesh = Mesh(args.mesh, axis_names=names)
        model, margs, mkwargs = load_model(args.model, batch=args.batch, seq=args.seq)
        result = plan(
            model,
            mesh,
            example_inputs=margs,
            example_kwargs=mkwargs,
            mem_cap=args.mem_cap,
            profile=args.profile,
            dtype=args.dtype,
            optimizer=args.optimizer,
            solver=args.solver,
            compare_families=not args.no_compare,
        )
    except (MemoryCapError, ValueError, TypeError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    if args.output:
        result.to_json(args.output)
    if args.format == "json":
        sys.stdout.write(result.to_json())
    else:
        sys.stdout.write(render_table(result))
    if args.timings:
        t = dict(result.timings)
        t["total_s"] = time.perf_counter() - t0
        t["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        keys = ("capture_s", "strategies_s", "search_s", "total_s", "peak_rss_bytes")
        print(json.dumps({k: t.get(k) for k in keys}), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "models":
        from .models import builtin_models, model_config

        for name in builtin_models():
            print(f"{name:18s} {model_config(name).get('description', '')}")
        return 0
    return _cmd_plan(args)


if __name__ == "__main__":
    sys.exit(main())
