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
    nodes {fx name: {op, module, inputs, outputs, kernels, fallback[, partial_grad_axes]}},
    collectives [{kind, axis, phase, bytes, node, module, tensor, reduce_op, time_s}],
    cost {compute_s, comm_s, total_s},
    memory {per_device_bytes, params, grads, optimizer, activations, cap_bytes},
    fallback_ops [{node, op, module}],
    family, alternatives [{family, feasible, total_s, compute_s, comm_s, per_device_bytes}]
           (an infeasible family also says whether that is ``proven`` and its ``min_per_device_bytes``),
    search {solver, optimal, objective_ps, num_nodes, num_choices,
            and when the problem was too wide to search exactly (``search/minibucket.py``):
            approximate: true, why, lower_bound_ps, gap ((plan time - bound) / plan time)},
    hints {params {FQN: placements}, inputs {name: placements},
           ops {fx name: {inputs {pos: placements}, outputs {index: placements}}}, replicate [patterns]}
           (only when the plan was hinted: the normalized hints, see ``autopar.hints``)

``phase`` is ``forward``, ``backward`` or ``optimizer`` (the all-gather of updated
parameters after a ZeRO-sharded optimizer step).  ``partial_grad_axes`` (only when
not empty) names the axes where a node's backward runs on ``P(sum)`` gradients, or
where a parameter read by several ops sums its uses' partial gradients before one
reduction (``OpStrategy`` / ``SourceStrategy`` in ``strategies.base`` / ``candidates``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .mesh import Mesh
from .placement import Placement, format_placements, parse_placements

__all__ = ["Plan", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


@dataclass
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
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"plan schema_version {version!r}: this autopar reads version {SCHEMA_VERSION}; "
                "re-create the plan with `autopar plan ... -o plan.json`"
            )
        return cls(
            model=d["model"],
            mesh=Mesh.from_dict(d["mesh"]),
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
        """Read a plan from a JSON file path or a JSON string."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        return cls.from_dict(json.loads(text))


def placements_json(placements) -> list[str]:
    return format_placements(placements)
