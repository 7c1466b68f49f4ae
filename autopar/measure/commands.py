"""The ``autopar calibrate`` and ``autopar fidelity`` subcommands (``autopar.cli`` adds them).

    autopar calibrate [-o FILE.toml] [--ranks 4] [--base cpu] [--trials 3] [--passes 2] [--force] [--max-spread 0.10]
    autopar fidelity [--profile cpu|FILE.toml] [--ranks 4] [--json FILE] [--models a,b] [--mesh 2x2] [--rounds 5]
        [--contest-rounds 10] [--timeout 1800] [--calibrate DIR [--calibrate-passes 3]]

``calibrate`` prints the measurements, the fits and their residuals and the noise of
the repeats, and writes the profile (``-o``), unless the repeats spread more than
``--max-spread`` (``calibrate.MAX_SPREAD``) and ``--force`` is not given (exit 1);
``fidelity`` prints predicted vs measured per plan and the summary
and writes the figures as JSON (``--json``); a run that stops early (``--timeout`` per case, or a failing rank)
prints and writes the cases it finished, marked incomplete, and exits 1.  Exit code 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .fidelity import CALIBRATE_PASSES

__all__ = ["add_parsers", "cmd_calibrate", "cmd_fidelity"]


def add_parsers(sub, *, positive_int, mesh_shape) -> None:
    """The two subparsers, on ``sub`` (argparse subparsers) with the main CLI's argument types."""
    from autopar.cli_types import positive_float, whole_number

    c = sub.add_parser("calibrate", help="measure this machine into a device profile (--profile FILE.toml)")
    c.add_argument("-o", "--output", default=None, metavar="FILE", help="write the profile TOML here ('-': stdout)")
    c.add_argument("--ranks", type=positive_int, default=4, help="local CPU ranks to measure with (default 4)")
    c.add_argument(
        "--base",
        default=None,
        metavar="PROFILE",
        help="profile whose unmeasured keys (inter-node link, ...) the result keeps (default cpu; h100/a100 on GPUs)",
    )
    c.add_argument("--name", default=None, help="the profile's name (default: the output file's stem)")
    c.add_argument("--trials", type=positive_int, default=3, help="repeats per measurement; the median is kept")
    c.add_argument(
        "--passes",
        type=positive_int,
        default=2,
        help="measure everything this many times, one pass after another; each number's median is kept (default 2)",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="write the profile even when its repeats spread more than --max-spread (a busy machine)",
    )
    c.add_argument(
        "--max-spread",
        type=float,
        default=None,
        metavar="FRACTION",
        help="the most the repeats may spread in the median over points, (max - min) / median (default 0.10)",
    )
    c.add_argument("--timeout", type=float, default=600.0, help="stop the ranks after this many seconds")
    f = sub.add_parser("fidelity", help="predicted vs measured step time and memory of a fixed benchmark of plans")
    f.add_argument("--profile", default="cpu", metavar="PROFILE", help="profile the plans are made with (default cpu)")
    f.add_argument("--ranks", type=positive_int, default=4, help="local CPU ranks (default 4)")
    f.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON to FILE")
    f.add_argument("--benchmark", default=None, metavar="FILE", help="benchmark TOML (default the fixed one)")
    f.add_argument("--models", default=None, help="comma-separated subset of the benchmark's models")
    f.add_argument("--mesh", type=mesh_shape, default=None, help="only this mesh of the benchmark, e.g. 2x2")
    f.add_argument("--rounds", type=positive_int, default=None, help="timed rounds (default: the benchmark's)")
    f.add_argument(
        "--contest-rounds",
        type=whole_number,
        default=None,
        help="more rounds for the plans near the fastest and the search's own; 0: none (default: the benchmark's)",
    )
    f.add_argument(
        "--timeout",
        type=positive_float,
        default=1800.0,
        help="seconds each case may take (default 1800): the run stops after cases x this, and keeps the cases "
        "it finished",
    )
    f.add_argument(
        "--calibrate",
        default=None,
        metavar="DIR",
        help="calibrate the machine before each case and plan that case with it (--profile: its base), writing "
        "DIR/<model>-<mesh>.toml",
    )
    f.add_argument(
        "--calibrate-passes",
        type=positive_int,
        default=CALIBRATE_PASSES,
        help=f"with --calibrate: the passes of each case's calibration, each number their median (default "
        f"{CALIBRATE_PASSES}: one pass slowed by the machine is outvoted)",
    )


def _writable(path: str | None, flag: str) -> None:
    if path is None or path == "-":
        return
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path!r}: folder '{folder}' does not exist; create it or pass another path")


def _run(measure) -> tuple[Any, int | None]:
    """(``measure()``, None), or (None, exit code 2) after printing a bad-input error."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return measure(), None
    except ValueError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return None, 2


def cmd_calibrate(args) -> int:
    from .calibrate import MAX_SPREAD, calibrate
    from .calibration_report import render_calibration, write_profile

    def measure():
        _writable(args.output, "-o")
        if args.base is not None:
            from costmodel import load_profile

            load_profile(args.base)
        return calibrate(
            ranks=args.ranks, base=args.base, trials=args.trials, timeout_s=args.timeout, passes=args.passes
        )

    cal, code = _run(measure)
    if cal is None:  # bad input, or a torchrun rank other than 0
        return code or 0
    sys.stdout.write(render_calibration(cal))
    limit = MAX_SPREAD if args.max_spread is None else args.max_spread
    if args.output and cal.spread > limit and not args.force:
        print(
            f"autopar: error: the repeats spread {cal.spread:.1%} in the median (more than {limit:.0%}): the "
            f"machine was {'busy' if cal.busy else 'noisy'} and a profile measured so misprices plans; {args.output} "
            "was not written. Fix: calibrate on a quiet machine (nothing else running), or pass --force to write "
            "it anyway (and check it with autopar fidelity)",
            file=sys.stderr,
        )
        return 1
    if args.output:
        write_profile(cal, args.output, name=args.name)
        if args.output != "-":
            print(f"wrote {args.output}: autopar plan MODEL --profile {args.output}", file=sys.stderr)
    return 0


def cmd_fidelity(args) -> int:
    from .benchmark import load_benchmark
    from .fidelity import FidelityIncomplete, run_fidelity

    def measure():
        _writable(args.json, "--json")
        bench = load_benchmark(args.benchmark)
        models = [m.strip() for m in args.models.split(",")] if args.models else None
        bench = bench.only(models, [args.mesh] if args.mesh else None)
        if args.rounds is not None:
            bench = replace(bench, rounds=args.rounds)
        if args.contest_rounds is not None:
            bench = replace(bench, contest_rounds=args.contest_rounds)
        if args.calibrate is not None and not Path(args.calibrate).expanduser().is_dir():
            raise ValueError(f"--calibrate {args.calibrate!r}: not a folder; create it or pass another")
        return run_fidelity(
            profile=args.profile,
            ranks=args.ranks,
            benchmark=bench,
            timeout_s=args.timeout,
            calibrate_dir=args.calibrate,
            calibrate_passes=args.calibrate_passes,
        )

    try:
        run, code = _run(measure)
    except FidelityIncomplete as e:  # the finished cases, reported and written as a run, marked incomplete
        _report_fidelity(e.run, args.json)
        print(f"autopar: error: the run stopped early: {e}", file=sys.stderr)
        return 1
    if run is None:  # bad input, or a torchrun rank other than 0
        return code or 0
    _report_fidelity(run, args.json)
    return 0


def _report_fidelity(run, json_path: str | None) -> None:
    """Print ``run``'s report and write its figures to ``json_path`` (None: not written)."""
    from .fidelity import summarize
    from .fidelity_report import render_fidelity

    sys.stdout.write(render_fidelity(run))
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(summarize(run), fh, indent=1, sort_keys=True)
