"""The Plan: what to run, serializable as versioned, deterministic JSON.

``Plan.to_dict()`` gives the schema below (``SCHEMA_VERSION``); ``Plan.to_json()``
writes it with sorted keys so the same inputs give a byte-identical file, and
``Plan.from_json()`` reads it back without re-solving, in this version or the one
before it.  Wall-clock timings of the planner are kept in ``Plan.timings`` and never
written, for the same reason.

The fields are the typed values of ``planner.plan_parts``, and their JSON is their fields
by name (placements printed, one entry per mesh axis; a field holding a "nothing"
default left out)::

    schema_version, model, mesh {shape, axis_names, ranks},
    settings PlanSettings, params {FQN: ParamPlacement}, inputs {name: InputPlacement},
    nodes {fx name: NodePlacement}, collectives [Collective], cost PlanCost, memory PlanMemory,
    fallback_ops [FallbackOp], family, alternatives [FamilyAlternative], search SearchStats,
    hints PlanHints (only when the plan was hinted: the normalized hints, see ``autopar.planner.hints``),
    pipeline PipelinePlan (only when the plan pipelines: ``autopar.planner.pipeline_planning``),
    microbatches (only when the step runs the batch as several micro-batches)

Version 1 (read by ``from_dict``) named the memory parts without their unit
(``params``, ``grads``, ``optimizer``, ``activations``); version 2 names them
``params_bytes`` ... as the other sizes are named.

``recompute`` of a node (only when set) names the region, a repeated block such as
``model.layers.3``, that the op is recomputed with in backward instead of saving its
tensors (``lower/recompute.py`` runs it under ``torch.utils.checkpoint``); the
planner chooses it (``planner/recompute_tables.py``) and prices it: the forward run again
in the node times, the blocks' activations out of ``memory.activations_bytes`` and back in
the backward peak, and the moves and collectives the recomputation runs again in
``collectives`` with ``recompute`` true (phase ``forward``, as the runtime counts them).
``settings.recompute`` is what was asked (``auto``, ``none``, ``selective``, ``full``);
``search.recompute_mode`` what the plan does.

``repr(plan)`` is one line (model, mesh, family, step time, memory against the
cap); ``plan.table()`` is the full report ``autopar plan`` prints
(``autopar.planner.plan_table.render_table``).
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autopar.mesh import Mesh

from .plan_parts import (
    Candidate,
    Collective,
    FallbackOp,
    FamilyAlternative,
    InputPlacement,
    MeshCandidate,
    NodeCharge,
    NodePlacement,
    ParamPlacement,
    PipelinePlan,
    PlanCost,
    PlanHints,
    PlanMemory,
    PlanSettings,
    PlanThroughput,
    SearchStats,
    from_json_value,
    to_json_value,
)
from .plan_table import render_table

__all__ = ["Plan", "FAMILIES", "SCHEMA_VERSION", "check_writable"]

SCHEMA_VERSION = 2
#: The plan families a plan may be forced into (``Plan.family``; ``plan(family=...)``).
FAMILIES = ("data parallel", "sharded parameters", "tensor parallel")
#: The fields written only when they differ from their default (a plan without hints, pipeline or micro-batches
#: reads as before).
_WHEN_SET = {"hints": None, "pipeline": None, "microbatches": 1, "throughput": None, "meshes": ()} | {
    "flat_grad_axes": ()
}
#: What a plan knows of how it was made, kept in memory only.
_NOT_WRITTEN = ("timings", "node_costs", "candidates")
#: Version 1's memory keys, by the name version 2 gives them.
_V1_MEMORY = {"params_bytes": "params", "grads_bytes": "grads", "optimizer_bytes": "optimizer"} | {
    "activations_bytes": "activations"
}


@dataclass(frozen=True, slots=True, repr=False)
class Plan:
    """A chosen training plan (see the module docstring and ``planner.plan_parts`` for the fields)."""

    model: str
    mesh: Mesh
    settings: PlanSettings
    params: dict[str, ParamPlacement]
    inputs: dict[str, InputPlacement]
    nodes: dict[str, NodePlacement]
    collectives: tuple[Collective, ...]
    cost: PlanCost
    memory: PlanMemory
    fallback_ops: tuple[FallbackOp, ...]
    family: str
    alternatives: tuple[FamilyAlternative, ...]
    search: SearchStats
    timings: dict[str, float] = field(default_factory=dict)  # stage -> wall-clock seconds; never written
    hints: PlanHints | None = None
    pipeline: PipelinePlan | None = None
    microbatches: int = 1
    throughput: PlanThroughput | None = None  # model FLOPs and MFU of the predicted step (planner.throughput)
    # planned for a device count: every logical mesh tried, fastest first (planner.mesh_choice)
    meshes: tuple[MeshCandidate, ...] = ()
    # the axis sets whose gradient buckets are all-reduced by one collective over their groups flattened into one
    # (the search's choice, cost.Coster.flattens; runtime.buckets runs it); others reduce once per axis
    flat_grad_axes: tuple[tuple[str, ...], ...] = ()
    # node name -> what the search charged it (planner.assemble.node_costs); never written, not compared
    node_costs: dict[str, NodeCharge] = field(default_factory=dict, compare=False, repr=False)
    # pipeline="auto": every candidate priced, fastest first (planner.pipeline_choice); never written, not compared
    candidates: tuple[Candidate, ...] = field(default=(), compare=False, repr=False)

    # ---- serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "mesh": self.mesh.to_dict()}
        for f in fields(self):
            if f.name not in ("mesh", *_NOT_WRITTEN, *_WHEN_SET):
                out[f.name] = to_json_value(getattr(self, f.name))
        for name, default in _WHEN_SET.items():  # only when set
            if getattr(self, name) != default:
                out[name] = to_json_value(getattr(self, name))
        return out

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given (its folder must exist)."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"
        if path is not None:
            check_writable(path, "plan file")
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "plan") -> Plan:
        """The plan of ``to_dict()`` (this version's or the one before); ``source`` names where ``d`` came from
        in errors (a file, "plan")."""
        if not isinstance(d, dict):
            raise ValueError(
                f"{source}: expected a JSON object (the dict Plan.to_dict() gives), got a {type(d).__name__}; "
                "pass a plan written by plan.to_json() or `autopar plan ... -o plan.json`"
            )
        version = d.get("schema_version")
        if version not in (SCHEMA_VERSION - 1, SCHEMA_VERSION):
            raise ValueError(
                f"{source}: plan schema_version {version!r}: this autopar reads versions {SCHEMA_VERSION - 1} and "
                f"{SCHEMA_VERSION}; re-create the plan with `autopar plan ... -o plan.json`"
            )
        types = typing.get_type_hints(cls)
        required = [f.name for f in fields(cls) if f.name not in (*_NOT_WRITTEN, *_WHEN_SET)]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(
                f"{source}: not a complete autopar plan (missing field{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(repr, missing))}); re-create it with plan.to_json() or `autopar plan ... -o "
                "plan.json` and do not edit it by hand"
            )
        if version == SCHEMA_VERSION - 1:
            d = _from_v1(d, source)
        try:
            mesh = Mesh.from_dict(d["mesh"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{source}: field 'mesh': {e}; re-create the plan") from None
        strict = version == SCHEMA_VERSION  # an older plan may carry keys no longer written
        try:
            named = [k for k in (*required, *_WHEN_SET) if k in d and k != "mesh"]
            parts = {k: from_json_value(types[k], d[k], k, strict=strict) for k in named}
        except ValueError as e:
            raise ValueError(
                f"{source}: not an autopar plan of version {version} (field {e}); re-create it with "
                "plan.to_json() or `autopar plan ... -o plan.json` and do not edit it by hand"
            ) from None
        return cls(mesh=mesh, **parts)

    @classmethod
    def from_json(cls, source: str | Path) -> Plan:
        """Read a plan from a JSON file or from JSON text.

        A ``Path`` is always a file.  A ``str`` is JSON text when it starts (after
        whitespace) with ``{`` or ``[``, and a file path otherwise.  A missing file,
        text that is not JSON and JSON that is not a plan raise ``ValueError`` naming
        the file (or ``plan JSON text``) and what is wrong.  Plans of this version and
        of the one before it are read (``SCHEMA_VERSION``).
        """
        if not isinstance(source, (str, Path)):
            raise TypeError(
                f"Plan.from_json({type(source).__name__}): expected a file path or JSON text; "
                "for a dict use Plan.from_dict"
            )
        if isinstance(source, str) and source.lstrip()[:1] in ("{", "["):
            where, text = "plan JSON text", source
        else:
            path = Path(source)
            where = f"plan file {str(source)!r}"
            if not path.is_file():
                why = "is a folder" if path.is_dir() else "does not exist"
                raise ValueError(
                    f"{where} {why}; pass the path of a plan JSON file (plan.to_json(path), "
                    "`autopar plan ... -o plan.json`) or the JSON text itself"
                )
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                raise ValueError(f"{where} is not a text file; pass a plan JSON file") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                "re-create it with plan.to_json() or `autopar plan ... -o plan.json`"
            ) from None
        return cls.from_dict(data, source=where)

    # ---- printing ---------------------------------------------------------------------
    def __repr__(self) -> str:
        from autopar.units import format_bytes

        m = self.memory
        return (
            f"<Plan {self.model} on {self.mesh}: {self.family}; step {self.cost.total_s * 1e3:.3f} ms, "
            f"memory {format_bytes(m.per_device_bytes)} per device of cap {format_bytes(m.cap_bytes)}; "
            "plan.table() for the full report>"
        )

    def table(self, *, width: int = 130) -> str:
        """The full report ``autopar plan`` prints: placements, collectives, totals, families."""
        return render_table(self, width=width)


def _from_v1(d: dict[str, Any], source: str) -> dict[str, Any]:
    """A version-1 plan dict in version 2's names (the memory parts with their unit)."""
    memory = d["memory"]
    if not isinstance(memory, dict):
        raise ValueError(f"{source}: field 'memory' is a {type(memory).__name__}, expected an object; re-create it")
    renamed = {new: memory[old] for new, old in _V1_MEMORY.items() if old in memory}
    kept = {k: v for k, v in memory.items() if k not in _V1_MEMORY.values()}
    return dict(d, memory=kept | renamed)


def check_writable(path: str | Path, what: str) -> None:
    """Raise ``ValueError`` unless ``path`` can be written as a file: its folder exists and it is no folder."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a folder; pass a file path, e.g. {Path(path) / 'plan.json'}")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{what} {str(path)!r}: folder {str(folder)!r} does not exist; create it or pass another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{what} {str(path)!r}: folder {str(folder)!r} is not writable; pass another path")
