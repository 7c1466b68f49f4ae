"""A rank's local program cut into pipeline stages: one program per stage, and what crosses each boundary.

``split_program(program, xplan, stage_of, stages)`` takes the whole local program (``lower(...,
defer_loss=False)``, one rank's ops and moves for the whole model) and the stage of every captured op
(``planner.pipeline_planning.stage_of_nodes``), and gives one ``StageProgram`` per stage:

* which stage runs a lowered node: the stage of the captured value it stands for (``rewrite.VALUE_KEY``); a
  node standing for none (a move, a recompute call, a fused loss's pieces) runs where its first reader runs (the
  earliest stage among its readers: a move into a later stage's op runs on that stage, so what crosses a
  boundary is always a captured value), and one read by nothing but the outputs where the latest value it
  reads is made;
* what crosses the boundary after stage ``s`` (``StageProgram.carried_out``): every value made on a stage
  ``<= s``, or a batch input, that an op of a later stage reads; stage 0 takes the batch inputs, each stage
  takes what the previous one hands on, so a value read two stages later passes through the one between;
* parameters and buffers are not carried: each stage reads its own (``sources``: positions in the whole
  program's arguments); a weight two stages read (a tied embedding and head) is read by both;
* the last stage returns the loss (the training step's output); the nodes only the model's other outputs need
  (gathering the logits) are left out.

Every carried value is described by its local shape, dtype and whether it carries a gradient
(``CarriedValue``), from the captured graph and the plan's placements, so the pipeline's sends are set up
without running anything (``torch.distributed.pipelining`` would otherwise run each stage on empty tensors).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from autopar.spec import local_shape

from .program import ExecutionPlan
from .rewrite import VALUE_KEY

__all__ = ["CarriedValue", "StageProgram", "split_program"]


@dataclass(frozen=True, slots=True)
class CarriedValue:
    """A value crossing a stage boundary, as this rank holds it: the lowered node's name, its local shape and
    dtype, and whether a gradient flows back through it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def meta(self) -> torch.Tensor:
        """An empty meta tensor of this value (what ``PipelineStage`` sizes its buffers from)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta", requires_grad=self.requires_grad)


@dataclass(frozen=True)
class StageProgram:
    """One stage's program: ``module(*carried_in values, *source values)`` returns the ``carried_out`` values in
    order (the last stage: the loss).  ``sources`` are positions in the whole program's arguments; stage 0's
    ``carried_in`` are the batch inputs, in the program's order."""

    index: int
    module: fx.GraphModule
    carried_in: tuple[CarriedValue, ...]
    carried_out: tuple[CarriedValue, ...]
    sources: tuple[int, ...]


def split_program(
    program: fx.GraphModule,
    xplan: ExecutionPlan,
    stage_of: dict[str, int],
    stages: int,
    coordinate: tuple[int, ...],
    *,
    train: bool = True,
) -> list[StageProgram]:
    """The stage programs of ``program`` (module docstring); ``coordinate`` is this rank's on the plan's mesh.
    ``train=False``: the last stage returns every tensor output of the model (a tuple, in the order of the
    program's outputs), for a forward-only pipeline; outputs made on earlier stages are carried to it."""
    graph = xplan.graph
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    kinds = [n.kind for n in graph.nodes if n.kind != "op"]  # the program's arguments, in graph order
    batch_inputs = [p for p, kind in zip(placeholders, kinds) if kind == "input"]
    stage = _node_stages(program, xplan, stage_of, stages)
    output = next(n for n in program.graph.nodes if n.op == "output")
    finals = [_loss_value(program, graph)] if train else [a for a in output.args[0] if isinstance(a, fx.Node)]
    describe = _Describer(xplan, coordinate)
    out, carried = [], tuple(describe(p) for p in batch_inputs)
    for s in range(stages):
        last = s == stages - 1
        crossing = [] if last else _crossing(program, stage, s, batch_inputs, set(finals))
        carried_out = tuple(describe(n) for n in crossing)
        if last and train and stage.get(finals[0]) != s:
            loss = finals[0]
            raise AssertionError(f"stage split: the loss {loss.name} is made on stage {stage.get(loss)}, not the last")
        outputs = finals if last else crossing
        module, sources = _stage_module(program, stage, s, carried, outputs, placeholders, bare=last and train)
        out.append(StageProgram(s, module, carried, () if last else carried_out, sources))
        carried = carried_out
    return out


def _node_stages(program: fx.GraphModule, xplan: ExecutionPlan, stage_of: dict[str, int], stages: int) -> dict:
    """Lowered call node -> its stage (module docstring)."""
    graph = xplan.graph
    by_fx = {n.fx_node.name: n.name for n in graph.nodes if n.fx_node is not None and n.kind == "op"}
    for fxn in graph.gm.graph.nodes:  # a multi-output op's getitems: the op's stage
        if fxn.op == "call_function" and fxn.target is operator.getitem and fxn.args[0].name in by_fx:
            by_fx.setdefault(fxn.name, by_fx[fxn.args[0].name])
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    stage: dict[fx.Node, int] = {}
    for n in calls:
        op = by_fx.get(n.meta.get(VALUE_KEY))
        if op is not None and op in stage_of:
            stage[n] = stage_of[op]
    for n in reversed(calls):  # a node standing for no value: its earliest reader's stage
        if n not in stage:
            read_by = [stage[u] for u in n.users if u in stage]
            if read_by:
                stage[n] = min(read_by)
    for n in calls:  # read by the outputs alone: where the latest value it reads is made
        if n not in stage:
            stage[n] = max((stage[a] for a in n.all_input_nodes if a in stage), default=stages - 1)
    for n in calls:
        for a in n.all_input_nodes:
            if a in stage and stage[a] > stage[n]:
                raise AssertionError(f"stage split: {n.name} (stage {stage[n]}) reads {a.name} of stage {stage[a]}")
    return stage


def _loss_value(program: fx.GraphModule, graph) -> fx.Node:
    if graph.loss_output is None:
        raise ValueError(
            f"{graph.model_name}: a pipelined training step needs a loss, and the model returns no scalar that "
            "carries a gradient. Fix: pass the labels so the model returns its loss"
        )
    output = next(n for n in program.graph.nodes if n.op == "output")
    position = next(j for j, leaf in enumerate(graph.call.outputs) if leaf.index == graph.loss_output)
    return output.args[0][position]


def _crossing(program: fx.GraphModule, stage: dict, s: int, batch_inputs: list[fx.Node], finals: set) -> list[fx.Node]:
    """The values made on stages ``<= s`` (or batch inputs) that an op of a later stage reads, or that the last
    stage returns (``finals``), in program order."""
    inputs = set(batch_inputs)
    out = []
    for n in program.graph.nodes:
        made_here = n in inputs or (n in stage and stage[n] <= s)
        if made_here and (n in finals or any(u in stage and stage[u] > s for u in n.users)):
            out.append(n)
    return out


def _stage_module(
    program: fx.GraphModule, stage: dict, s: int, carried: tuple, outputs: list, placeholders: list, *, bare: bool
) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """Stage ``s``'s program: placeholders for the carried values, then the sources its nodes read; the stage's
    nodes that ``outputs`` need, or that nothing reads (effects: buffer updates).  It returns a tuple, or with
    ``bare`` its one output (the loss)."""
    mine = [n for n in program.graph.nodes if stage.get(n) == s]
    needed, stack = set(), [o for o in outputs if stage.get(o) == s] + [n for n in mine if not n.users]
    while stack:
        n = stack.pop()
        if n not in needed and stage.get(n) == s:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    g = fx.Graph()
    by_name = {n.name: n for n in program.graph.nodes}
    env = {by_name[c.name]: g.placeholder(c.name) for c in carried}
    sources = []
    for n in mine:
        if n in needed:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a not in env:
                    env[a] = g.placeholder(a.name)
                    sources.append(placeholders.index(a))
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[outputs[0]] if bare else tuple(env[o] for o in outputs))
    return fx.GraphModule(program, g, class_name=f"Stage{s}Program"), tuple(sources)


class _Describer:
    """``CarriedValue`` of a lowered node from the captured value it stands for and its placement."""

    def __init__(self, xplan: ExecutionPlan, coordinate: tuple[int, ...]) -> None:
        self.xplan, self.coordinate = xplan, coordinate
        graph = xplan.graph
        self.by_fx = {n.fx_node.name: n for n in graph.nodes if n.fx_node is not None}
        self.getitems = {
            n.name: (n.args[0].name, n.args[1])
            for n in graph.gm.graph.nodes
            if n.op == "call_function" and n.target is operator.getitem
        }

    def __call__(self, node: fx.Node) -> CarriedValue:
        name = node.meta.get(VALUE_KEY, node.name if node.op == "placeholder" else None)
        producer, index = self.getitems.get(name, (name, 0))
        opnode = self.by_fx.get(producer)
        if opnode is None:
            raise AssertionError(f"stage split: {node.name} crosses a stage boundary but stands for no captured value")
        meta = opnode.outputs[index]
        placement = self.xplan.output_placement(opnode.name, index)
        shape = local_shape(meta.shape, placement, self.xplan.mesh_shape, self.coordinate)
        grad = opnode.requires_grad and meta.dtype.is_floating_point
        return CarriedValue(node.name, tuple(shape), meta.dtype, grad)
