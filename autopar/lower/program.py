"""What a lowered program is built from and run with: the plan resolved per node, and the per-call state.

``ExecutionPlan.from_plan`` resolves a ``Plan`` against the captured graph: each
op node's input and output placements and the axes its backward runs on partial
gradients (``NodeExec``), each source's placement and gradient target, and where
a parameter's uses' gradients are summed; ``lower`` builds the program from it.

What changes between calls lives in one ``RunState`` the steps share: the
``CollectiveCounter`` (every move records its collectives there), the step number
(for RNG seeds), the module's mode, and the instrumentation (``trace``, and
``SavedBytes``, what one forward keeps for backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.capture import OpGraph
from autopar.placement import Placement, Replicate, parse_placements
from autopar.transitions import input_grad_placements, output_grad_placements, partial_on, producer_grad_placement

__all__ = ["ExecutionPlan", "NodeExec", "RunState", "SavedBytes"]


@dataclass(frozen=True)
class NodeExec:
    """What one op node needs at run time (placements parsed from the plan)."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]
    kernels: tuple[str | None, ...]
    split: tuple[bool, ...]
    partial_grad: tuple[bool, ...] = ()  # axes where backward runs on P(sum) gradients
    recompute: str | None = None  # the recompute region (block) the op belongs to, or None (its tensors saved)

    def input_grad(self, pos: int) -> tuple[Placement, ...]:
        """The gradient placement this op's backward hands back for input ``pos``."""
        return input_grad_placements(self.inputs[pos], self.split, self.partial_grad)


@dataclass(frozen=True)
class ExecutionPlan:
    """The plan resolved against one captured graph: placements of every value by fx node name."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    nodes: dict[str, NodeExec]
    sources: dict[str, tuple[tuple[Placement, ...], tuple[Placement, ...]]]  # fx name -> (placement, grad target)
    # param fx name -> where its uses' gradients are summed, when not its state placement (partial_grad_axes)
    accumulate: dict[str, tuple[Placement, ...]] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, graph: OpGraph, plan) -> ExecutionPlan:
        mesh_shape = tuple(plan.mesh.shape)
        nodes: dict[str, NodeExec] = {}
        missing = []
        for n in graph.nodes:
            if n.kind != "op":
                continue
            entry = plan.nodes.get(n.name)
            if entry is None or entry.op != str(n.target):
                missing.append(f"{n.name} ({n.target})")
                continue
            ins = tuple(parse_placements(p) for p in entry.inputs)
            outs = tuple(parse_placements(p) for p in entry.outputs)
            split = tuple(any(not isinstance(p[a], Replicate) for p in ins + outs) for a in range(len(mesh_shape)))
            flags = _axis_flags(plan, entry, f"node {n.name}")
            if any(f and sp for f, sp in zip(flags, split)):
                raise ValueError(
                    f"node {n.name}: partial_grad_axes {list(entry.partial_grad_axes)} include an axis the op "
                    "splits; partial gradients are only exact where every rank of the axis repeats the op"
                )
            region = entry.recompute
            if region is not None and not isinstance(region, str):
                raise ValueError(
                    f"node {n.name}: recompute must name the region (block) the op is recomputed with, got "
                    f'{region!r}; e.g. "model.layers.3", or leave it out to save the op\'s tensors'
                )
            nodes[n.name] = NodeExec(ins, outs, tuple(entry.kernels), split, flags, region)
        if missing:
            raise ValueError(
                f"the plan does not match the model {graph.model_name}: {len(missing)} graph nodes are not in it "
                f"(first: {', '.join(missing[:3])}); re-plan this model with the same example input shapes"
            )
        sources, accumulate = {}, {}
        for n in graph.nodes:
            if n.kind == "param":
                if n.fqn not in plan.params:
                    raise ValueError(f"the plan has no placement for parameter {n.fqn}; re-plan this model")
                p = plan.params[n.fqn]
                # (placement, state placement): gradients go to the state (ZeRO-1/2 when they differ)
                sources[n.name] = (parse_placements(p.placements), parse_placements(p.state_placements))
                flags = _axis_flags(plan, p, f"parameter {n.fqn}")
                if any(flags):
                    accumulate[n.name] = partial_on(sources[n.name][1], flags)
            elif n.kind in ("input", "buffer"):
                pl = parse_placements(plan.inputs[n.fqn or n.name].placements)
                sources[n.name] = (pl, tuple(producer_grad_placement(p) for p in pl))
        return cls(graph, mesh_shape, nodes, sources, accumulate)

    def output_placement(self, name: str, index: int) -> tuple[Placement, ...]:
        if name in self.nodes:
            return self.nodes[name].outputs[index]
        return self.sources[name][0]

    def grad_target(self, name: str, index: int) -> tuple[Placement, ...]:
        """Where the gradients of ``name``'s output ``index`` are summed (what each consumer edge delivers)."""
        if name in self.nodes:
            return output_grad_placements(self.nodes[name].outputs[index], self.nodes[name].partial_grad)
        return self.accumulate.get(name, self.sources[name][1])


def _axis_flags(plan, entry, what: str) -> tuple[bool, ...]:
    """``entry.partial_grad_axes`` (axis names) as one flag per mesh axis."""
    names = list(plan.mesh.axis_names)
    given = entry.partial_grad_axes
    unknown = [a for a in given if a not in names]
    if unknown:
        raise ValueError(f"{what}: partial_grad_axes {unknown} are not axes of the plan's mesh {names}")
    return tuple(a in given for a in names) if given else ()


class SavedBytes:
    """What one forward packed for backward, measured by the executor's saved-tensor hook.

    ``add`` is called with every tensor an op saves for backward.  Parameters (a
    rank's local shards, the all-gathered copies the executor makes and views of
    either) are model state, not activations, and are not counted.  Every other
    saved tensor counts once per *storage*, at the storage's size: a saved view
    keeps its whole base alive, and two ops saving the same tensor (or views of
    one) hold one copy, as autograd does.  Only sizes are kept, never the tensors.
    ``by_op`` (storage bytes first recorded by each op node) helps find where a
    prediction is off.
    """

    def __init__(self, params) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._params = {StorageWeakRef(p.untyped_storage()) for p in params}
        self._gathered: list = []
        self._storages: dict = {}
        self.by_op: dict[str, int] = {}

    def add_parameter(self, t: torch.Tensor) -> None:
        """Mark ``t`` (a parameter's copy made by a transition) as model state for the rest of the forward."""
        self._gathered.append(self._ref(t.untyped_storage()))

    def add(self, t: torch.Tensor, op: str = "") -> None:
        ref = self._ref(t.untyped_storage())
        if ref in self._params or ref in self._storages or any(g == ref and not g.expired() for g in self._gathered):
            return
        self._storages[ref] = t.untyped_storage().nbytes()
        self.by_op[op] = self.by_op.get(op, 0) + self._storages[ref]

    @property
    def total_bytes(self) -> int:
        """Bytes of the distinct storages saved (parameters excluded)."""
        return sum(self._storages.values())


@dataclass
class RunState:
    """What may change between calls of a lowered graph; its steps read it (``ShardedModule`` sets it per call).

    ``counter``: a ``CollectiveCounter`` every move records in (or None);
    ``step``: the call number, part of every random op's seed; ``training``: the
    module's mode (False: ``EVAL_FORMS`` ops run their eval form); ``trace``: when a
    dict, op node name -> this rank's local outputs; ``saved``: when given, the
    bytes ops save for backward are measured there.  ``trace`` and ``saved`` are
    only honoured by a graph lowered with ``instrument=True``.
    """

    counter: Any = None
    step: int = 0
    training: bool = True
    trace: dict[str, list[torch.Tensor]] | None = None
    saved: SavedBytes | None = None
