"""The report of ``autopar run``: losses per step, the check against one device, memory per rank.

``render_report(report)`` turns a ``runner.RunReport`` into the text the CLI prints
(rich tables, no colour).
"""

from __future__ import annotations

import io

from rich.markup import escape

from autopar.units import format_bytes

from .runner import ATOL, RTOL, RankResult, RunReport

__all__ = ["render_report"]


def render_report(report: RunReport, *, width: int = 140) -> str:
    """The report as rich tables: losses per step, the check, memory per rank."""
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    r0 = next(r for r in report.ranks if r.rank == 0)
    for line in _header_lines(report, r0):
        con.print(escape(line))
    con.print(_training_table(report, r0))
    if line := _throughput_line(report, r0):
        con.print(escape(line))
    if report.config.resume_dir:
        con.print(escape(f"resumed from {report.config.resume_dir} with {r0.record.first_step} steps done"))
    for path in r0.record.saved:
        con.print(escape(f"saved checkpoint {path}"))
    if report.reference is not None:
        _print_check(con, report)
    con.print(_state_table(report))
    con.print(
        "held: each distinct storage behind the local parameters (a ZeRO shard is a view of its parameter), "
        "their .grad, and every optimizer state tensor shaped like its parameter (AdamW's scalar step counters "
        f"are not model state). The plan's per-device total is {format_bytes(r0.plan_memory.per_device_bytes)}."
    )
    con.print(_activations_table(report))
    con.print(
        "measured: the distinct storages the first forward packed for backward (saved-tensor hooks in the "
        "executor; parameters excluded). The plan's figure is for the largest piece (coordinate 0)."
    )
    return buf.getvalue()


def _header_lines(report: RunReport, r0: RankResult) -> list[str]:
    """What ran: the model, mesh, ranks, batch and steps; the plan's family, nodes and recompute lines."""
    from autopar.planner import describe_plan

    cfg = report.config
    mesh = cfg.mesh()
    lines = [
        f"autopar run: {cfg.model} on mesh {dict(zip(mesh.axis_names, mesh.shape))}"
        + (f" (chosen for {cfg.devices} devices)" if cfg.devices is not None else "")
        + f", {len(report.ranks)} ranks "
        f"({report.launcher}); batch {cfg.batch}, seq {cfg.seq}, {cfg.steps} AdamW "
        f"step{'s' if cfg.steps != 1 else ''} (lr {cfg.lr:g}), "
        f"dropout {'off' if cfg.check else 'as configured'}",
        describe_plan(r0.family, cfg.family),
    ]
    return lines + [line for line in (r0.pipeline_line, r0.nodes_line, r0.recompute_line) if line]


def _throughput_line(report: RunReport, r0: RankResult) -> str:
    """Model FLOP/s per device and MFU measured (the median step after the first: the first warms up) beside the
    plan's predicted figures; '' where the plan carries none."""
    from autopar.planner import describe_throughput

    f, times = r0.throughput, sorted(r0.record.step_times_s[1:] or r0.record.step_times_s)
    if f is None or not times:
        return ""
    measured = f.at_step(times[len(times) // 2], len(report.ranks))
    return f"throughput: {describe_throughput(measured, 'measured')}; {describe_throughput(f)}"


def _training_table(report: RunReport, r0: RankResult):
    """Rank 0's loss and step time per step, beside the one-device loss when the run was checked."""
    from rich.table import Table

    ref = report.reference
    t = Table(title="training (rank 0)", title_justify="left")
    for col in ("step", "loss", *(("one-device loss", "|Δ|") if ref else ()), "step time"):
        t.add_column(col, justify="right")
    for i, loss in enumerate(r0.record.losses):
        step = r0.record.first_step + i
        cells = [str(step), f"{loss:.6f}"]
        if ref:
            cells += [f"{ref.losses[step]:.6f}", f"{abs(loss - ref.losses[step]):.2e}"]
        t.add_row(*cells, f"{r0.record.step_times_s[i] * 1e3:.1f} ms")
    return t


def _print_check(con, report: RunReport) -> None:
    """The check against one device: the largest deviation of each quantity, its notes, and the verdict."""
    from rich.table import Table

    t = Table(title=f"check against one device (rtol {RTOL:g}, atol {ATOL:g})", title_justify="left")
    for col, just in (
        ("quantity", "left"),
        ("tensors", "right"),
        ("max |Δ|", "right"),
        ("worst", "left"),
        ("within tolerance", "left"),
    ):
        t.add_column(col, justify=just)
    for d in report.deviations:
        t.add_row(escape(d.quantity), str(d.tensors), f"{d.max_abs:.2e}", escape(d.worst), "yes" if d.ok else "NO")
    con.print(t)
    for d in report.deviations:
        if d.note:
            con.print(escape(f"note ({d.quantity}): {d.note}"))
    worst = max(report.deviations, key=lambda d: d.max_abs)
    con.print(
        f"check: {'PASS' if report.passed else 'FAIL'} (largest deviation {worst.max_abs:.2e}, "
        f"{escape(worst.quantity)})"
    )


def _state_table(report: RunReport):
    """Parameters, gradients and optimizer state each rank held after the last step, beside the plan's."""
    from rich.table import Table

    t = Table(
        title=f"memory per rank after step {report.config.steps - 1}: held vs the plan's figures",
        title_justify="left",
    )
    t.add_column("rank", justify="right")
    t.add_column("coordinate", justify="right")
    for k in ("params", "grads", "optimizer", "total"):
        t.add_column(f"{k} held", justify="right")
        t.add_column("plan", justify="right")
    for r in report.ranks:
        m = r.plan_memory
        plan = [m.params_bytes, m.grads_bytes, m.optimizer_bytes]
        held = [r.held_bytes.get(k, 0) for k in ("params", "grads", "optimizer")]
        cells = [format_bytes(n) for pair in zip(held + [sum(held)], plan + [sum(plan)]) for n in pair]
        t.add_row(str(r.rank), str(r.coordinate), *cells)
    return t


def _activations_table(report: RunReport):
    """The activations each rank's first forward saved for backward, against the plan's figure."""
    from rich.table import Table

    t = Table(title="activations saved for backward: measured vs plan", title_justify="left")
    for col in ("rank", "measured", "plan", "plan error"):
        t.add_column(col, justify="right")
    for r in report.ranks:
        saved, planned = r.held_bytes.get("activations"), r.plan_memory.activations_bytes
        error = f"{(planned - saved) / saved:+.1%}" if saved else "-"
        t.add_row(str(r.rank), format_bytes(saved), format_bytes(planned), error)
    return t
