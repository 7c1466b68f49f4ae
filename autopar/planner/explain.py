"""Why the search chose this plan: its cost terms against the best plan of each other family.

``render_explanation(plan)`` is what ``autopar plan --explain`` prints: a table of
the step time split by what it is spent on (``Plan.cost.terms``: the ops'
forward and backward, the optimizer step, each collective kind per phase at its
exposed time), for the chosen plan and the best feasible plan of each family under
the same cap, then one line per family naming the terms that differ most, in
milliseconds, and the peak memory of each; a ``pipeline="auto"`` plan adds every
candidate it was chosen among (``Plan.candidates``: no pipeline, each axis, micro-batch
count and schedule) with its step and memory.  Plans read from JSON written before
the terms existed explain nothing (they say so).
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from autopar.units import format_bytes

from .plan_table import describe_candidate, describe_model_flops, describe_output_gather, describe_throughput
from .schema import Plan

__all__ = ["render_explanation", "deciding_terms"]


def deciding_terms(chosen: dict[str, float], other: dict[str, float], top: int = 3) -> list[tuple[str, float]]:
    """(term, other - chosen seconds) of the ``top`` terms that differ most, largest first."""
    keys = set(chosen) | set(other)
    diffs = [(k, other.get(k, 0.0) - chosen.get(k, 0.0)) for k in keys]
    diffs = [(k, d) for k, d in diffs if abs(d) > 1e-12]
    return sorted(diffs, key=lambda kd: -abs(kd[1]))[:top]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _candidates_table(plan: Plan) -> Table:
    """The micro-batched candidates ``pipeline="auto"`` priced (``Plan.candidates``), fastest first."""
    table = Table(title="candidates priced (pipeline='auto'), fastest first", title_justify="left")
    for name, justify in (("candidate", "left"), ("step", "right"), ("vs chosen", "right"), ("memory", "right")):
        table.add_column(name, justify=justify)
    chosen = describe_candidate(plan)
    for c in plan.candidates:
        if c.at_least_s is not None:  # a bound proved it slower: not searched to its plan
            ratio = c.at_least_s / plan.cost.total_s
            table.add_row(c.what, f">= {_ms(c.at_least_s)}", f">= {ratio:.2f}x (bound)", "")
            continue
        if c.note:  # not priced (a schedule another dominates)
            table.add_row(c.what, "-", c.note, "")
            continue
        if c.step_s is None:
            table.add_row(c.what, "does not fit", "", f"needs {format_bytes(c.memory_bytes)}")
            continue
        ratio = c.step_s / plan.cost.total_s
        versus = "chosen" if c.what == chosen else f"{ratio:.2f}x"
        table.add_row(c.what, _ms(c.step_s), versus, format_bytes(c.memory_bytes))
    return table


def render_explanation(plan: Plan, *, width: int = 130) -> str:
    """The explanation text of ``plan`` (see the module docstring)."""
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    terms = plan.cost.terms
    if not terms:
        con.print("explain: this plan carries no cost terms (written by an older autopar); plan it again")
        return buf.getvalue()
    others = [a for a in plan.alternatives if a.feasible and a.terms]
    table = Table(title="what the step time is spent on (exposed time)", title_justify="left")
    table.add_column("term")
    table.add_column(f"chosen ({plan.family})", justify="right")
    for a in others:
        table.add_column(a.family, justify="right")
    keys = sorted(
        set(terms).union(*(a.terms for a in others)),
        key=lambda k: -max([terms.get(k, 0.0)] + [a.terms.get(k, 0.0) for a in others]),
    )
    for k in keys:
        table.add_row(k, _ms(terms.get(k, 0.0)), *(_ms(a.terms.get(k, 0.0)) for a in others))
    table.add_row("step", _ms(plan.cost.total_s), *(_ms(a.total_s) for a in others), style="bold")
    table.add_row(
        "peak memory / device",
        format_bytes(plan.memory.per_device_bytes),
        *(format_bytes(a.per_device_bytes) for a in others),
    )
    if (f := plan.throughput) is not None:  # the same model FLOPs over each plan's step
        steps = (plan.cost.total_s, *(a.total_s for a in others))
        table.add_row("MFU", *(f"{f.at_step(t, plan.mesh.size).mfu:.1%}" for t in steps))
    con.print(table)
    if f is not None:
        con.print(f"model FLOPs / step: {describe_model_flops(f)}; {describe_throughput(f)}")
    if note := describe_output_gather(plan):
        con.print(note)
    if len(plan.candidates) > 1:
        con.print(_candidates_table(plan))
    if not plan.alternatives:
        con.print("no family comparison was made (--no-compare): plan without it to see what decided")
    for a in plan.alternatives:
        if not a.feasible:
            con.print(
                f"- {a.family}: no plan fits the cap"
                if a.min_per_device_bytes
                else f"- {a.family}: no plan in this family"
            )
            continue
        if not a.terms:
            continue
        delta = a.total_s - plan.cost.total_s
        if abs(delta) < 1e-12:
            con.print(f"- {a.family}: as fast as the chosen plan (the same plan, or a tie)")
            continue
        parts = []
        for k, d in deciding_terms(terms, a.terms):
            parts.append(f"{'+' if d > 0 else '-'}{_ms(abs(d))} of {k}")
        con.print(
            f"- vs {a.family} ({'+' if delta > 0 else '-'}{_ms(abs(delta))} per step): it would spend "
            + ", ".join(parts)
        )
    return buf.getvalue()
