"""The Plan: what to run, serializable as versioned, deterministic JSON.

``Plan.to_dict()`` gives the schema below (``SCHEMA_VERSION``); ``Plan.to_json()``
writes it with sorted keys so the same inputs give a byte-identical file, and
``Plan.from_json()`` reads it back without re-solving.  Wall-clock timings of the
planner are kept in ``Plan.timings`` and never written, for the same reason.

Schema (placements in the printed form, one entry per mesh axis)::

    schema_version, model, mesh {shape, axis_names, ranks},
    settings {profile, dtype, optimizer, mem_cap_bytes, solver},
    params {FQN: {placements, state_placements, shape, local_shape, tied_to[, partial_grad_axes]}},
    inputs {name: {placements, shape}},
    nodes {fx name: {op, module, inputs, outputs, kernels, fallback[, partial_grad_axes][, recompute]}},
    collectives [{kind, axis, phase, bytes, node, module, tensor, reduce_op, time_s, hidden_s}],
    cost {compute_s, comm_s, total_s},
    memory {per_device_bytes, params, grads, optimizer, activations, cap_bytes},
    fallback_ops [{node, op, module}],
    family, alternatives [{family, feasible, total_s, compute_s, comm_s, per_device_bytes}]
           (an infeasible family also says whether that is ``proven`` and its ``min_per_device_bytes``),
    search {solver, optimal, objective_ps, num_nodes, num_choices,
            lower_bound_ps, gap ((plan time - bound) / plan time) when optimal is false and a bound is
            known: the search stopped once its plan was proven within ``planner.solving.PLAN_GAP`` of the
            optimum, or the problem was too wide to search exactly (``search/minibucket.py``, with
            approximate: true, why)},
    hints {params {FQN: placements}, inputs {name: placements},
           ops {fx name: {inputs {pos: placements}, outputs {index: placements}}}, replicate [patterns]}
           (only when the plan was hinted: the normalized hints, see ``autopar.planner.hints``)

``time_s`` of a collective is what it adds to the step (its exposed time) and
``hidden_s`` the part that overlaps with backward compute (parameter-gradient
reductions; ``DeviceProfile.grad_reduce_overlap``), so ``time_s + hidden_s`` is its
whole ring time.  ``phase`` is ``forward``, ``backward`` or ``optimizer`` (the
all-gather of updated parameters after a ZeRO-sharded optimizer step).
``partial_grad_axes`` (only when
not empty) names the axes where a node's backward runs on ``P(sum)`` gradients, or
where a parameter read by several ops sums its uses' partial gradients before one
reduction (``OpStrategy`` / ``SourceStrategy`` in ``strategies.base`` / ``candidates``).

``recompute`` (only when set) names the region, a repeated block such as
``model.layers.3``, that the op is recomputed with in backward instead of saving its
tensors (``lower/recompute.py`` runs it under ``torch.utils.checkpoint``); the
planner chooses it (``planner/recompute_tables.py``) and prices it: the forward run again
in the node times, the blocks' activations out of ``memory.activations`` and back in
the backward peak, and the moves and collectives the recomputation runs again in
``collectives`` with ``"recompute": true`` (phase ``forward``, as the runtime counts them).
``settings.recompute`` is what was asked (``auto``, ``none``, ``selective``, ``full``);
``search.recompute_mode`` what the plan does.

``repr(plan)`` is one line (model, mesh, family, step time, memory against the
cap); ``plan.table()`` is the full report ``autopar plan`` prints
(``autopar.planner.plan_table.render_table``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.mesh import Mesh
from autopar.placement import Placement, format_placements, parse_placements

__all__ = ["Plan", "FAMILIES", "SCHEMA_VERSION", "check_writable"]

SCHEMA_VERSION = 1
#: The plan families a plan may be forced into (``Plan.family``; ``plan(family=...)``).
FAMILIES = ("data parallel", "sharded parameters", "tensor parallel")


#: The fields ``Plan.from_dict`` needs, with the JSON type each must have (``hints`` is optional).
_FIELDS: dict[str, type] = {
    "model": str,
    "mesh": dict,
    "settings": dict,
    "params": dict,
    "inputs": dict,
    "nodes": dict,
    "collectives": list,
    "cost": dict,
    "memory": dict,
    "fallback_ops": list,
    "family": str,
    "alternatives": list,
    "search": dict,
}


@dataclass(frozen=True, repr=False)
class Plan:
    """A chosen training plan (see the module docstring for the fields)."""

    model: str
    mesh: Mesh
    settings: dict[str, Any]
    params: dict[str, dict[str, Any]]
    inputs: dict[str, dict[str, Any]]
    nodes: dict[str, dict[str, Any]]
    collectives: list[dict[str, Any]]
    cost: dict[str, float]
    memory: dict[str, int | None]
    fallback_ops: list[dict[str, str]]
    family: str
    alternatives: list[dict[str, Any]]
    search: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    hints: dict[str, Any] = field(default_factory=dict)

    # ---- convenience ------------------------------------------------------------------
    def param_placements(self, fqn: str) -> tuple[Placement, ...]:
        return parse_placements(self.params[fqn]["placements"])

    def collectives_of(
        self, *, kind: str | None = None, phase: str | None = None, module_prefix: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            c
            for c in self.collectives
            if (kind is None or c["kind"] == kind)
            and (phase is None or c["phase"] == phase)
            and (module_prefix is None or c["module"] == module_prefix or c["module"].startswith(module_prefix + "."))
        ]

    # ---- serialization ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "mesh": self.mesh.to_dict(),
            "settings": self.settings,
            "params": self.params,
            "inputs": self.inputs,
            "nodes": self.nodes,
            "collectives": self.collectives,
            "cost": self.cost,
            "memory": self.memory,
            "fallback_ops": self.fallback_ops,
            "family": self.family,
            "alternatives": self.alternatives,
            "search": self.search,
        } | ({"hints": self.hints} if self.hints else {})

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given (its folder must exist)."""
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"
        if path is not None:
            check_writable(path, "plan file")
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "plan") -> Plan:
        """The plan of ``to_dict()``; ``source`` names where ``d`` came from in errors (a file, "plan")."""
        if not isinstance(d, dict):
            raise ValueError(
                f"{source}: expected a JSON object (the dict Plan.to_dict() gives), got a {type(d).__name__}; "
                "pass a plan written by plan.to_json() or `autopar plan ... -o plan.json`"
            )
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"{source}: plan schema_version {version!r}: this autopar reads version {SCHEMA_VERSION}; "
                "re-create the plan with `autopar plan ... -o plan.json`"
            )
        missing = [k for k in _FIELDS if k not in d]
        problems = (
            [f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"] if missing else []
        )
        problems += [
            f"field {k!r} is a {type(d[k]).__name__}, expected a {_FIELDS[k].__name__}"
            for k in _FIELDS
            if k in d and not isinstance(d[k], _FIELDS[k])
        ]
        if problems:
            raise ValueError(
                f"{source}: not a complete autopar plan ({'; '.join(problems)}); re-create it with plan.to_json() "
                "or `autopar plan ... -o plan.json` and do not edit it by hand"
            )
        try:
            mesh = Mesh.from_dict(d["mesh"])
        except ValueError as e:
            raise ValueError(f"{source}: field 'mesh': {e}; re-create the plan") from None
        return cls(
            model=d["model"],
            mesh=mesh,
            settings=d["settings"],
            params=d["params"],
            inputs=d["inputs"],
            nodes=d["nodes"],
            collectives=d["collectives"],
            cost=d["cost"],
            memory=d["memory"],
            fallback_ops=d["fallback_ops"],
            family=d["family"],
            alternatives=d["alternatives"],
            search=d["search"],
            hints=d.get("hints", {}),
        )

    @classmethod
    def from_json(cls, source: str | Path) -> Plan:
        """Read a plan from a JSON file or from JSON text.

        A ``Path`` is always a file.  A ``str`` is JSON text when it starts (after
        whitespace) with ``{`` or ``[``, and a file path otherwise.  A missing file,
        text that is not JSON and JSON that is not a plan raise ``ValueError`` naming
        the file (or ``plan JSON text``) and what is wrong.
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

        cap = self.memory.get("cap_bytes")
        total = self.cost.get("total_s")
        step = "?" if total is None else f"{total * 1e3:.3f} ms"
        return (
            f"<Plan {self.model} on {self.mesh}: {self.family}; step {step}, "
            f"memory {format_bytes(self.memory.get('per_device_bytes'))} per device of cap {format_bytes(cap)}; "
            "plan.table() for the full report>"
        )

    def table(self, *, width: int = 130) -> str:
        """The full report ``autopar plan`` prints: placements, collectives, totals, families."""
        from .plan_table import render_table

        return render_table(self, width=width)


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


def placements_json(placements) -> list[str]:
    return format_placements(placements)
