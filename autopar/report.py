"""The plan table: what the planner chose, what it costs, and why it won.

Rows are grouped so a 48-layer model reads like a 2-layer one: parameter and
module names have their block index replaced by ``*`` (``transformer.h.*.mlp.c_fc``),
and a group whose members all agree is one row.  Collectives are counted *per
block* (per instance of the group).

A hinted plan (semi-auto mode) has a ``given`` column: ``hint`` where a hint fixed
the parameter's placement, ``search`` where the search chose it; the family
comparison is then of the unhinted families, so it shows what the hints cost.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from .plan_types import Plan
from .units import format_bytes

__all__ = ["render_table", "group_name"]

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def group_name(name: str) -> str:
    """``transformer.h.11.mlp.c_fc.weight`` -> ``transformer.h.*.mlp.c_fc.weight``."""
    return _INDEX.sub(".*", name)


def _block_of(name: str) -> str | None:
    m = _INDEX.search(name)
    return name[: m.end()] if m else None


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


def _optimality(search: dict) -> str:
    if search.get("approximate") and search["optimal"]:
        return "approximate search, its plan proven fastest by its lower bound"
    if search.get("approximate"):
        return f"approximate search, within {100 * search['gap']:.2f}% of its lower bound"
    return "optimal" if search["optimal"] else "not proven optimal"


def render_table(plan: Plan, *, width: int = 130) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    s = plan.settings
    con.print(
        f"autopar plan: {plan.model} on mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, "
        f"profile {s['profile']}, {s['dtype']}, {s['optimizer']}, cap {format_bytes(s.get('mem_cap_bytes'))}, "
        f"solver {s['solver']} ({_optimality(plan.search)})"
    )
    con.print(f"plan: {plan.family}")
    if plan.hints:
        h = plan.hints
        ops = sum(len(e["inputs"]) + len(e["outputs"]) for e in h.get("ops", {}).values())
        regions = f", regions kept replicated: {', '.join(h['replicate'])}" if h.get("replicate") else ""
        con.print(
            f"hints: {len(h.get('params', {}))} parameters, {len(h.get('inputs', {}))} inputs and {ops} op "
            f"tensors given{regions}; the search chose the rest"
        )
    con.print(_params_table(plan))
    con.print(_collectives_table(plan))
    con.print(_totals_table(plan))
    if plan.alternatives:
        con.print(_families_table(plan))
    if plan.fallback_ops:
        ops = defaultdict(int)
        for f in plan.fallback_ops:
            ops[f["op"]] += 1
        con.print("fallback ops (replicated, no rule): " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    else:
        con.print("fallback ops: none")
    return buf.getvalue()


def _params_table(plan: Plan) -> Table:
    t = Table(title="parameters (per group)", title_justify="left")
    hinted = plan.hints.get("params", {})
    for col in ("parameter", "count", "shape", "placements", "state", "local shape") + (("given",) if hinted else ()):
        t.add_column(col)
    groups: dict[str, list] = defaultdict(list)
    for fqn, p in plan.params.items():
        groups[group_name(fqn)].append((p, "hint" if fqn in hinted else "search"))
    for name, members in groups.items():
        keys = [
            (tuple(p["placements"]), tuple(p["state_placements"]), tuple(p["local_shape"]), given)
            for p, given in members
        ]
        for pl, st, loc, given in sorted(set(keys)):
            row = [
                name,
                str(keys.count((pl, st, loc, given))),
                str(tuple(members[0][0]["shape"])),
                ",".join(pl),
                "same" if st == pl else ",".join(st),
                str(loc),
            ]
            t.add_row(*row, *((given,) if hinted else ()))
    return t


def _collectives_table(plan: Plan) -> Table:
    t = Table(title="collectives (per block instance for repeated modules)", title_justify="left")
    for col in ("module", "kind", "axis", "phase", "per block", "bytes each", "time per block"):
        t.add_column(col)
    agg: dict[tuple, list] = defaultdict(list)
    for c in plan.collectives:
        agg[(group_name(c["module"]) or "<top>", c["kind"], c["axis"], c["phase"])].append(c)
    for (mod, kind, axis, phase), items in sorted(agg.items()):
        blocks = {(_block_of(c["module"]) or "") for c in items}
        per = len(items) / max(1, len(blocks))
        sizes = sorted({c["bytes"] for c in items})
        size = format_bytes(sizes[0]) if len(sizes) == 1 else f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}"
        t.add_row(mod, kind, axis, phase, f"{per:g}", size, _ms(sum(c["time_s"] for c in items) / max(1, len(blocks))))
    return t


def _totals_table(plan: Plan) -> Table:
    t = Table(title="totals per device", title_justify="left")
    t.add_column("quantity")
    t.add_column("value")
    c, m = plan.cost, plan.memory
    t.add_row("step time", f"{_ms(c['total_s'])} = compute {_ms(c['compute_s'])} + communication {_ms(c['comm_s'])}")
    t.add_row("memory", f"{format_bytes(m['per_device_bytes'])} of cap {format_bytes(m.get('cap_bytes'))}")
    for k in ("params", "grads", "optimizer", "activations"):
        t.add_row(f"  {k}", format_bytes(m[k]))
    return t


def _families_table(plan: Plan) -> Table:
    without = " (without the hints)" if plan.hints else ""
    t = Table(title=f"why this plan: best plan of each family under the same cap{without}", title_justify="left")
    for col in ("family", "step time", "compute", "communication", "memory / device", "fits cap"):
        t.add_column(col)
    t.add_row(
        f"chosen ({plan.family})",
        _ms(plan.cost["total_s"]),
        _ms(plan.cost["compute_s"]),
        _ms(plan.cost["comm_s"]),
        format_bytes(plan.memory["per_device_bytes"]),
        "yes",
    )
    for a in plan.alternatives:
        if a["feasible"]:
            t.add_row(
                a["family"],
                _ms(a["total_s"]),
                _ms(a["compute_s"]),
                _ms(a["comm_s"]),
                format_bytes(a["per_device_bytes"]),
                "yes",
            )
        else:
            t.add_row(
                a["family"],
                "-",
                "-",
                "-",
                f">= {format_bytes(a['min_per_device_bytes'])}" if a.get("min_per_device_bytes") else "no plan",
                "no",
            )
    return t
