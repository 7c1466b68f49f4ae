"""Printing ``autopar fidelity``'s figures: a table of predicted vs measured per plan, then the summary.

``render_fidelity(run)`` is the text the CLI prints; the JSON it writes is
``fidelity.summarize(run)``.  How to read it is in the README ("Calibrating for
your cluster").
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from autopar.units import format_bytes

from .fidelity import FidelityRun, summarize

__all__ = ["render_fidelity"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render_fidelity(run: FidelityRun, *, width: int = 150) -> str:
    """The per-plan table and the summary lines of one run."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    figures = summarize(run)
    stopped = "" if run.complete else f" (INCOMPLETE: the run stopped early; {run.planned} cases were planned)"
    con.print(
        f"autopar fidelity: {len(run.cases)} cases on {run.ranks} ranks, profile {run.profile}, "
        f"benchmark {run.benchmark}, {run.wall_s:.0f} s{stopped}"
    )
    table = Table(title="predicted vs measured step time and peak memory per plan (memory: the largest rank)")
    for col in ("model x mesh", "variants", "family", "predicted", "measured", "spread", "time err"):
        table.add_column(col, justify="right" if col in ("predicted", "measured", "spread", "time err") else "left")
    for col in ("pred. memory", "peak memory", "mem err", "bubble pred/meas"):
        table.add_column(col, justify="right")
    for case in run.cases:
        fastest = min(p.measured_s for p in case.plans)
        for p in sorted(case.plans, key=lambda p: p.measured_s):
            mark = " (fastest)" if p.measured_s == fastest else ""
            table.add_row(
                case.key,
                ", ".join(p.variants) + mark,
                p.family,
                f"{p.predicted_s * 1e3:.0f} ms",
                f"{p.measured_s * 1e3:.0f} ms",
                f"{p.spread * 100:.0f}%",
                _pct(p.time_error),
                format_bytes(p.predicted_bytes),
                format_bytes(p.peak_bytes),
                _pct(p.memory_error),
                "-" if p.predicted_bubble is None else f"{_num(p.predicted_bubble)}/{_num(p.measured_bubble)}",
            )
        for variant, why in case.infeasible.items():
            table.add_row(case.key, variant, f"no plan: {why[:60]}", "", "", "", "", "", "", "", "", style="dim")
    con.print(table)
    cases = Table(title="per model x mesh")
    piped = any(c.get("pipeline_auto_over_fastest") is not None for c in figures["cases"].values())
    columns = ["model x mesh", "spearman", "median |time err|", "auto / fastest measured", "auto within 5%"]
    columns.append("machine: timing / planning")
    for col in columns + (["pipeline:auto / fastest"] if piped else []):
        cases.add_column(col)
    for key, c in figures["cases"].items():
        row = [
            key,
            _num(c["spearman"]),
            f"{c['median_abs_error'] * 100:.0f}%",
            _num(c["auto_over_fastest"], 3),
            "yes" if c["auto_is_fastest_within_5pct"] else "NO",
            _num(c.get("machine_slowdown")),
        ]
        cases.add_row(*row, *([_num(c.get("pipeline_auto_over_fastest"), 3)] if piped else []))
    con.print(cases)
    per_model = ", ".join(f"{m} {_num(v['spearman'])}" for m, v in figures["models"].items())
    con.print(f"spearman over all plans {_num(figures['spearman'])}; per model: {per_model}")
    con.print(
        f"|predicted/measured - 1| of step time: median {figures['median_abs_error'] * 100:.0f}%, worst "
        f"{figures['worst_abs_error'] * 100:.0f}%; of peak memory: median "
        f"{figures['memory_median_abs_error'] * 100:.0f}%, worst {figures['memory_max_error'] * 100:.0f}%"
    )
    con.print(
        f"spread of repeated measurements (max - min over rounds / median): median "
        f"{figures['median_spread'] * 100:.0f}%, worst {figures['worst_spread'] * 100:.0f}% of step time; "
        f"median {figures['memory_median_spread'] * 100:.0f}%, worst {figures['memory_worst_spread'] * 100:.0f}% "
        "of peak memory (over the measured steps)"
    )
    if figures.get("median_machine_slowdown") is not None:
        con.print(
            f"machine probe (3 matmuls on every rank) while timing / before planning: median "
            f"{figures['median_machine_slowdown']:.2f} over the cases (above 1: the machine ran slower than when "
            "the cases were calibrated and planned)"
        )
    return buf.getvalue()
