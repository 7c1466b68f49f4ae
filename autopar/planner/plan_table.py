"""The plan table: what the planner chose, what it costs, and why it won.

Rows are grouped so a 48-layer model reads like a 2-layer one: parameter and
module names have their block index replaced by ``*`` (``transformer.h.*.mlp.c_fc``),
and a group whose members all agree is one row.  Collectives are counted *per
block* (per instance of the group), and their time is split into the part the step
waits for (``exposed``, the plan's ``time_s``) and the part hidden behind backward
compute (``overlapped``, ``hidden_s``), so a large gradient reduce-scatter that costs
little is explained by the row itself.

A hinted plan (semi-auto mode) has a ``given`` column: ``hint`` where a hint fixed
the parameter's placement, ``search`` where the search chose it; the family
comparison is then of the unhinted families, so it shows what the hints cost.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from autopar.units import format_bytes, format_flops

if TYPE_CHECKING:
    from .plan_parts import Collective, PlanThroughput, SearchStats

#: An ``autopar.planner.Plan`` (``schema.py``).  Not imported, not even for annotations: ``schema``
#: imports this module for ``Plan.table()``, and modules do not import each other in a circle.
Plan = Any

__all__ = [
    "render_table",
    "group_name",
    "describe_plan",
    "describe_candidate",
    "describe_model_flops",
    "describe_schedule",
    "describe_throughput",
]

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def group_name(name: str) -> str:
    """``transformer.h.11.mlp.c_fc.weight`` -> ``transformer.h.*.mlp.c_fc.weight``."""
    return _INDEX.sub(".*", name)


def _block_of(name: str) -> str | None:
    m = _INDEX.search(name)
    return name[: m.end()] if m else None


#: What each family of ``autopar.planner.FAMILIES`` requires of a plan forced into it.
_FAMILY_RULES = {
    "data parallel": "parameters, gradients and optimizer state whole on every rank",
    "sharded parameters": "parameters stored sharded and gathered before use",
    "tensor parallel": "weight matrices stored and read sharded",
}


def describe_plan(label: str, forced: str | None = None) -> str:
    """The ``plan:`` line: what the plan does (``Plan.family``) and, for a forced family, what that family
    required, so a forced ``data parallel`` whose fastest plan splits nothing does not read as a wrong plan."""
    does = "replicated (every rank runs the whole step; no computation is split)" if label == "replicated" else label
    if forced is None:
        return f"plan: {does}"
    rule = _FAMILY_RULES.get(forced)
    if label == "replicated":
        return (
            f"plan: {forced} family, forced" + (f" ({rule})" if rule else "") + "; its fastest plan splits no "
            "computation: every rank runs the whole step (each split costs more than it saves here)"
        )
    return f"plan: {label} (forced family {forced}" + (f": {rule})" if rule else ")")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


def _optimality(search: SearchStats) -> str:
    if search.approximate and search.optimal:
        return "approximate search, its plan proven fastest by its lower bound"
    if search.approximate:
        return f"approximate search, within {100 * search.gap:.2f}% of its lower bound"
    if search.budget_hit:
        if search.gap is not None:
            proven = f"within {100 * search.gap:.3f}% of the optimum (proven by its lower bound)"
        else:
            proven = "optimal under its memory bound" if search.optimal else "not proven optimal"
        return (
            f"{proven}; the search stopped at its time budget ({search.budget_s:g} s): "
            "a larger search_budget_s may find a faster plan"
        )
    if not search.optimal and search.gap is not None:  # stopped once proven close (planner.solving.PLAN_GAP)
        return f"within {100 * search.gap:.3f}% of the optimum (proven by its lower bound)"
    return "optimal" if search.optimal else "not proven optimal"


def describe_recompute(plan: Plan) -> str:
    """The ``recompute:`` line: what backward recomputes (``planner.recompute_tables``: blocks, or selective
    regions)."""
    rest = plan.search.recompute_rest
    regions = sorted({e.recompute for e in plan.nodes.values() if e.recompute} - set(rest), key=_natural)
    asked = plan.settings.recompute
    compared = _recompute_compared(plan)
    also = f", and outside the layers {' and '.join(rest)}" if rest else ""
    if not regions and not rest:
        return f"recompute: none (recompute={asked}){compared}"
    shown = ", ".join(regions) if len(regions) <= 4 else f"{regions[0]} .. {regions[-1]}"
    layers = plan.search.recompute_layers
    if plan.search.recompute_mode == "per layer" and layers:
        return (
            f"recompute: per layer, {layers.full} whole, {layers.selective} selectively, {layers.none} "
            f"not ({len(regions)} regions: {shown}){also}: forward run again in backward, only their inputs kept "
            f"(recompute={asked}){compared}"
        )
    what = "selective regions" if plan.search.recompute_mode == "selective" else "blocks"
    return (
        f"recompute: {len(regions)} {what} ({shown}){also}: forward run again in backward, only their inputs "
        f"kept (recompute={asked}){compared}"
    )


def _recompute_compared(plan: Plan) -> str:
    """``; searched under the cap: none ..., selective ..., full ...`` when ``recompute="auto"`` searched them
    (a mode whose lower bound was above the plan met already: ``at least ...``)."""
    modes = plan.search.recompute_modes
    if not modes:
        return ""
    parts = []
    for m in modes:
        if m.feasible is None and m.at_least_s is None:
            parts.append(f"{m.recompute} not searched ({m.skipped})")
        elif m.feasible is None:
            parts.append(f"{m.recompute} at least {m.at_least_s * 1e3:.3f} ms (bound)")
        elif m.feasible:
            parts.append(f"{m.recompute} {m.total_s * 1e3:.3f} ms, {format_bytes(m.per_device_bytes)}")
        else:
            parts.append(f"{m.recompute} no plan (least {format_bytes(m.min_per_device_bytes)})")
    return "; searched under the cap: " + "; ".join(parts)


def _natural(name: str) -> list:
    """Sort key that orders ``layers.10`` after ``layers.9``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


#: the share of the step a gather of the model's outputs must take for the table to point it out
OUTPUT_GATHER_SHARE = 0.1


def describe_candidate(plan: Plan) -> str:
    """What a micro-batched candidate of ``pipeline="auto"`` is (``Candidate.what``): ``no pipeline``, ``no
    pipeline, 4 accumulated micro-batches`` or ``a pipeline along 'pp', 1f1b, 8 micro-batches``
    (``describe_schedule``)."""
    if plan.pipeline is None:
        return "no pipeline" + (f", {plan.microbatches} accumulated micro-batches" if plan.microbatches > 1 else "")
    pipe = plan.pipeline
    return f"a pipeline along {pipe.axis!r}, {describe_schedule(pipe.schedule, plan.microbatches, pipe.virtual)}"


def describe_schedule(schedule: str, m: int, v: int) -> str:
    """``1f1b, 8 micro-batches`` or ``interleaved (4 stages per rank), 16 micro-batches``."""
    return schedule + (f" ({v} stages per rank)" if v > 1 else "") + f", {m} micro-batches"


def describe_output_gather(plan: Plan) -> str:
    """A note when gathering the model's outputs whole onto every rank takes a large share of the step
    (``OUTPUT_GATHER_SHARE``), with the ways out; '' otherwise.  The module returns its outputs full on every
    rank unless told otherwise: a model returning logits for a loss computed outside gathers them all."""
    gathers = [c for c in plan.collectives if c.output]
    spent = sum(c.time_s for c in gathers)
    step = plan.cost.total_s
    if not gathers or spent < OUTPUT_GATHER_SHARE * step:
        return ""
    what = ", ".join(dict.fromkeys(c.module or c.tensor for c in gathers))
    return (
        f"note: gathering the model's outputs onto every rank ({what}: "
        f"{format_bytes(sum(c.bytes for c in gathers))} moved) takes {_ms(spent)} of the {_ms(step)} step "
        f"({spent / step:.0%}); return the loss from the model (pass labels) so that only it is gathered, or keep "
        "the output sharded with output_placements= (autopar.plan / autopar.compile)"
    )


def describe_nodes(plan: Plan) -> str:
    """Which mesh axes span nodes (their collectives priced on the inter-node link), or '' on one node."""
    from costmodel import axis_crosses_nodes, load_profile

    s = plan.settings
    try:
        profile = load_profile(s.profile).with_devices_per_node(s.devices_per_node)
    except ValueError:  # a profile file of another machine: nothing to read the links from
        return ""
    shape, names = plan.mesh.shape, plan.mesh.axis_names
    crossing = [n for a, n in enumerate(names) if axis_crosses_nodes(shape, a, profile.devices_per_node)]
    if not crossing:
        return ""
    within = [n for n in names if n not in crossing]
    return (
        f"nodes of {profile.devices_per_node} rank(s): axis {', '.join(crossing)} crosses nodes "
        f"({profile.inter_node.name} link)"
        + (f", {', '.join(within)} stays within a node ({profile.intra_node.name})" if within else "")
    )


def render_table(plan: Plan, *, width: int = 130) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    s = plan.settings
    con.print(
        f"autopar plan: {plan.model} on mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))}, "
        f"profile {s.profile}, {s.dtype}, {s.optimizer}, cap {format_bytes(s.mem_cap_bytes)}, "
        f"solver {s.solver} ({_optimality(plan.search)})"
    )
    con.print(describe_plan(plan.family))
    if nodes := describe_nodes(plan):
        con.print(nodes)
    con.print(describe_recompute(plan))
    if (h := plan.hints) is not None:
        ops = sum(len(e.inputs) + len(e.outputs) for e in h.ops.values())
        regions = f", regions kept replicated: {', '.join(h.replicate)}" if h.replicate else ""
        con.print(
            f"hints: {len(h.params)} parameters, {len(h.inputs)} inputs and {ops} op "
            f"tensors given{regions}; the search chose the rest"
        )
    if plan.pipeline is not None:
        con.print(describe_pipeline(plan))
        con.print(_stages_table(plan))
    elif plan.microbatches > 1:
        con.print(describe_pipeline(plan))
    con.print(_params_table(plan))
    con.print(_collectives_table(plan))
    con.print(_totals_table(plan))
    if note := describe_output_gather(plan):
        con.print(note)
    if plan.alternatives:
        con.print(_families_table(plan))
    if plan.meshes:
        con.print(_meshes_table(plan))
    if plan.fallback_ops:
        ops = defaultdict(int)
        for f in plan.fallback_ops:
            ops[f.op] += 1
        con.print("fallback ops (replicated, no rule): " + ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())))
    else:
        con.print("fallback ops: none")
    return buf.getvalue()


#: the meshes ``_meshes_table`` lists (``Plan.meshes`` keeps every one)
TOP_MESHES = 5


def _meshes_table(plan: Plan) -> Table:
    """The top meshes of a plan made for a device count (``planner.mesh_choice``), fastest first."""
    shown = plan.meshes[:TOP_MESHES]
    more = len(plan.meshes) - len(shown)
    title = f"meshes of {plan.mesh.size} devices, fastest first" + (f" ({more} more not shown)" if more else "")
    t = Table(title=title, title_justify="left")
    for col in ("mesh", "step", "memory", "TFLOP/s per device", "MFU", "plan", "why"):
        t.add_column(col)
    for c in shown:
        mesh = ", ".join(f"{n}={k}" for n, k in zip(c.axis_names, c.shape))
        step = _ms(c.step_s) if c.step_s is not None else f">= {_ms(c.at_least_s)}" if c.at_least_s else "-"
        tflops = f"{c.flops_per_device_s / 1e12:.1f}" if c.flops_per_device_s is not None else "-"
        mfu = f"{c.mfu:.1%}" if c.mfu is not None else "-"
        memory = format_bytes(c.memory_bytes) if c.memory_bytes is not None else "-"
        t.add_row(mesh, step, memory, tflops, mfu, c.plan.split(" (")[0], c.note)
    return t


def _params_table(plan: Plan) -> Table:
    t = Table(title="parameters (per group)", title_justify="left")
    hinted = plan.hints.params if plan.hints is not None else {}
    for col in ("parameter", "count", "shape", "placements", "state", "local shape") + (("given",) if hinted else ()):
        t.add_column(col)
    groups: dict[str, list] = defaultdict(list)
    for fqn, p in plan.params.items():
        groups[group_name(fqn)].append((p, "hint" if fqn in hinted else "search"))
    for name, members in groups.items():
        keys = [
            (tuple(map(str, p.placements)), tuple(map(str, p.state_placements)), p.local_shape, given)
            for p, given in members
        ]
        for pl, st, loc, given in sorted(set(keys)):
            row = [
                name,
                str(keys.count((pl, st, loc, given))),
                str(members[0][0].shape),
                ",".join(pl),
                "same" if st == pl else ",".join(st),
                str(loc),
            ]
            t.add_row(*row, *((given,) if hinted else ()))
    return t


def _collective_module(c: Collective, param_of: dict[str, str]) -> str:
    """The module a collective belongs to; a parameter's own collectives (its optimizer-step all-gather, its
    summed gradient's reduction) are issued by the parameter node, which has no module: use the parameter's."""
    if c.module:
        return c.module
    fqn = param_of.get(c.tensor)
    return fqn.rpartition(".")[0] if fqn else ""


def _count(per_block: dict[str, int]) -> str:
    """Collectives per block instance: one number when every instance has as many, else the exceptions."""
    counts = sorted(per_block.values())
    common = max(set(counts), key=counts.count)
    odd = sorted((b, n) for b, n in per_block.items() if n != common)
    if not odd:
        return str(common)
    if len(odd) <= 2:
        return f"{common}; " + ", ".join(f"{n} in {b or '<top>'}" for b, n in odd)
    return f"{counts[0]}-{counts[-1]}"


def _collectives_table(plan: Plan) -> Table:
    t = Table(
        title="collectives (count and time per instance of a repeated block `*`, else per step)",
        title_justify="left",
        caption="exposed: time a collective adds to the step; overlapped: the rest of its time, hidden behind "
        "backward compute (parameter-gradient reductions run during the rest of backward)",
        caption_justify="left",
    )
    for col in ("module", "kind", "axis", "phase", "count", "bytes each", "exposed", "overlapped"):
        t.add_column(col)
    param_of = {f"p_{fqn.replace('.', '_')}": fqn for fqn in plan.params} | {fqn: fqn for fqn in plan.params}
    agg: dict[tuple, list] = defaultdict(list)
    for c in plan.collectives:
        module = _collective_module(c, param_of)
        agg[(group_name(module) or "<top>", c.kind, c.axis, c.phase)].append((module, c))
    for (mod, kind, axis, phase), items in sorted(agg.items()):
        per_block: dict[str, int] = defaultdict(int)
        for module, _ in items:
            per_block[_block_of(module) or ""] += 1
        blocks = len(per_block)
        sizes = sorted({c.bytes for _, c in items})
        size = format_bytes(sizes[0]) if len(sizes) == 1 else f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}"
        exposed = sum(c.time_s for _, c in items) / blocks
        hidden = sum(c.hidden_s for _, c in items) / blocks
        t.add_row(mod, kind, axis, phase, _count(per_block), size, _ms(exposed), _ms(hidden) if hidden > 0 else "-")
    return t


def describe_pipeline(plan: Plan, *, table_below: bool = True) -> str:
    """One line: the pipeline's axis and stages, the micro-batches, the schedule and the bubble; without a pipeline
    the accumulated micro-batches ('' for one); ``table_below``: it says the stage table follows."""
    pipe = plan.pipeline
    if pipe is None:
        if plan.microbatches == 1:
            return ""
        return f"micro-batches: {plan.microbatches} per step, accumulated (one micro-batch's activations at a time)"
    p = plan.mesh.shape[plan.mesh.axis_names.index(pipe.axis)]
    per_rank = f", {pipe.virtual} per rank" if pipe.virtual > 1 else ""
    return (
        f"pipeline: {len(pipe.stages)} stages along axis {pipe.axis!r} ({p} ranks{per_rank}), "
        f"{plan.microbatches} micro-batches, schedule {pipe.schedule}, bubble {pipe.bubble_fraction:.1%} of the step"
        + ("; each stage sharded over the other axes as below" if table_below else "")
    )


def _stages_table(plan: Plan) -> Table:
    pipe = plan.pipeline
    p = plan.mesh.shape[plan.mesh.axis_names.index(pipe.axis)]
    t = Table(title="pipeline stages (time: forward + backward of one micro-batch)", title_justify="left")
    for col in ("stage", "rank", "layers", "sharding", "time", "memory"):
        t.add_column(col)
    cap = plan.memory.cap_bytes
    for j, stage in enumerate(pipe.stages):
        memory = format_bytes(stage.memory_bytes) + (f" of {format_bytes(cap)}" if cap is not None else "")
        sharding = plan.family.split(" (")[0]
        t.add_row(str(j), f"{pipe.axis}={j % p}", stage.layers, sharding, _ms(stage.time_s), memory)
    return t


def _totals_table(plan: Plan) -> Table:
    t = Table(title="totals per device", title_justify="left")
    t.add_column("quantity")
    t.add_column("value")
    c, m = plan.cost, plan.memory
    if plan.pipeline is not None:
        stages, bubble = c.terms.get("pipeline stages (forward + backward)", 0.0), c.terms.get("pipeline bubble", 0.0)
        parts = f"stages {_ms(stages)} + bubble {_ms(bubble)} + optimizer step {_ms(c.terms.get('optimizer step'))}"
        t.add_row("step time", f"{_ms(c.total_s)} = {parts}")
    else:
        t.add_row("step time", f"{_ms(c.total_s)} = compute {_ms(c.compute_s)} + communication {_ms(c.comm_s)}")
    t.add_row("memory", f"{format_bytes(m.per_device_bytes)} of cap {format_bytes(m.cap_bytes)}")
    t.add_row("  params", format_bytes(m.params_bytes))
    t.add_row("  grads", format_bytes(m.grads_bytes))
    t.add_row("  optimizer", format_bytes(m.optimizer_bytes))
    t.add_row("  activations", format_bytes(m.activations_bytes))
    if (f := plan.throughput) is not None:
        t.add_row("model FLOPs / step", describe_model_flops(f))
        t.add_row("throughput", describe_throughput(f))
    return t


def describe_model_flops(f: PlanThroughput) -> str:
    """``7.04 TFLOP = 6 x 124M parameters x 8,192 tokens + attention 928 GFLOP (recomputation adds ...)``."""
    extra = f.with_recompute_flops - f.model_flops
    again = f" (recomputation runs {format_flops(extra)} more)" if extra > 0 else ""
    return (
        f"{format_flops(f.model_flops)} = 6 x {f.parameters:,} parameters x {f.tokens:,} tokens + attention "
        f"{format_flops(f.attention_flops)}{again}"
    )


def describe_throughput(f: PlanThroughput, step: str = "predicted") -> str:
    """``312 TFLOP/s per device (predicted), MFU 31.6% of 989 TFLOP/s``."""
    return (
        f"{format_flops(f.flops_per_device_s, '/s')} per device ({step}), MFU {f.mfu:.1%} of "
        f"{format_flops(f.peak_flops, '/s')}"
    )


def _families_table(plan: Plan) -> Table:
    without = " (without the hints)" if plan.hints is not None else ""
    t = Table(title=f"why this plan: best plan of each family under the same cap{without}", title_justify="left")
    for col in ("family", "step time", "compute", "communication", "memory / device", "fits cap"):
        t.add_column(col)
    t.add_row(
        f"chosen ({plan.family})",
        _ms(plan.cost.total_s),
        _ms(plan.cost.compute_s),
        _ms(plan.cost.comm_s),
        format_bytes(plan.memory.per_device_bytes),
        "yes",
    )
    for a in plan.alternatives:
        if a.feasible:
            t.add_row(
                a.family,
                _ms(a.total_s),
                _ms(a.compute_s),
                _ms(a.comm_s),
                format_bytes(a.per_device_bytes),
                "yes",
            )
        else:
            t.add_row(
                a.family + (f" (no plan: {a.why})" if a.why else ""),
                "-",
                "-",
                "-",
                f">= {format_bytes(a.min_per_device_bytes)}" if a.min_per_device_bytes else "no plan",
                "no",
            )
    return t
