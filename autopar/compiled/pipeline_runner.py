"""A pipelined plan's training step on one rank, run by ``torch.distributed.pipelining``'s schedules.

``PipelineRunner`` wraps this rank's stage programs (``lower.split_program``: stage ``j`` runs on the pipeline
axis coordinate ``j mod p``) as ``PipelineStage``s over the pipeline axis's process group, with every value that
crosses a boundary described up front (``CarriedValue``), and drives them with the plan's schedule
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``).  One ``step``:

* the batch inputs go in as ``m`` micro-batches (this rank's pieces of each, stacked: the schedule splits dim 0);
* the loss: the last stage's program returns micro-batch ``i``'s loss ``l_i``, and the schedule's loss function
  scales it by ``w_i`` (``LossWeights``) before its backward, so the gradients are those of ``sum_i w_i l_i``,
  which is the whole batch's loss as one device computes it: for a loss ``a / d`` whose denominator ``d`` is made
  from the inputs alone (a mean over the tokens whose label is not ignored), ``l_i = a_i / d_i`` and ``w_i = d_i /
  sum_j d_j``, so ``sum_i w_i l_i = sum_i a_i / sum_j d_j`` however the ignored tokens fall; for any other loss
  ``w_i = 1 / m`` (a mean over equal micro-batches).  The schedule does not scale again (``scale_grads=False``);
* a parameter two ranks' stages read (a tied embedding and head) gets its gradient summed after the schedule
  between the ranks holding it (a process group of those ranks per line of the pipeline axis);
* the loss is summed over the pipeline axis, so every rank returns it, not only the last stage's.

``busy_s`` adds up the time this rank's stages spend in their chunks' forward and backward (the schedule's own
sends and waits outside them), ``schedule_s`` the time of the schedule's steps (not the loss's sum, the gradient
reductions after it, nor the optimizer): ``1 - busy / schedule`` is the rank's measured bubble, as
``cost.pipeline`` prices it (``autopar fidelity``).
"""

from __future__ import annotations

import logging
import operator
import time

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar.capture import OpGraph
from autopar.lower import StageProgram
from autopar.runtime import hold_until_exit, shared_groups

__all__ = ["LossWeights", "PipelineRunner", "from_owner", "stage_owners", "train_step_only"]

log = logging.getLogger(__name__)


class _StageModule(nn.Module):
    """One stage program as the ``nn.Module`` a ``PipelineStage`` runs: ``forward(*carried)`` reads this rank's
    parameters and buffers from ``sources()`` (the whole program's argument list of the step).  ``collected``
    (a forward-only pipeline's last stage): each micro-batch's outputs are appended to it."""

    def __init__(self, program: StageProgram, sources, collected: list | None = None) -> None:
        super().__init__()
        self.program, self.sources, self.collected = program, sources, collected
        self.first = program.index == 0

    def forward(self, *carried):
        if self.first:  # the schedule hands micro-batch chunks of the stacked inputs: (1, *piece)
            carried = tuple(t.squeeze(0) for t in carried)
        values = self.sources()
        out = self.program.module(*carried, *(values[i] for i in self.program.sources))
        if self.collected is not None:
            self.collected.append(tuple(t.detach() for t in out))
        # sends need contiguous tensors (a carried value may be a transposed view)
        return out.contiguous() if torch.is_tensor(out) else tuple(t.contiguous() for t in out)


class PipelineRunner:
    """This rank's stages of a pipelined plan and the schedule that runs them (module docstring).

    ``outputs=None``: a training pipeline (the last stage returns the loss); else a forward-only one whose last
    stage returns the model's tensor outputs, ``outputs`` being meta tensors of one micro-batch's."""

    def __init__(
        self,
        programs: list[StageProgram],
        groups,
        axis: int,
        schedule: str,
        microbatches: int,
        sources,
        *,
        outputs: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        from torch.distributed import pipelining

        self.groups, self.axis = groups, axis
        p = groups.mesh.shape[axis]
        rank = groups.coordinate[axis]
        if tuple(groups.axis_order(axis)) != tuple(range(p)):
            raise ValueError(
                f"pipeline axis {groups.mesh.axis_names[axis]!r}: its ranks are not in mesh order on this mesh "
                f"({groups.mesh}); use a mesh whose ranks ascend along the pipeline axis"
            )
        self.group = groups.axis_group(axis)
        self.count = len(programs)
        mine = [prog for prog in programs if prog.index % p == rank]
        self.first, self.last = mine[0].index == 0, mine[-1].index == self.count - 1
        self.inputs = programs[0].carried_in
        device = getattr(groups, "device", torch.device("cpu"))
        self.outputs, self.collected = outputs, [] if outputs is not None else None
        self.stages = [self._stage(prog, sources, device, pipelining) for prog in mine]
        kinds = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}
        loss_fn = _weighted if outputs is None else None
        common = dict(n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
        if schedule == "interleaved":
            self.schedule = pipelining.ScheduleInterleaved1F1B(self.stages, **common)
        else:
            self.schedule = kinds[schedule](self.stages[0], **common)
        # the shared weights' groups (a forward-only pipeline has no gradients to sum)
        self.shared = self._shared_groups(programs, p, device) if outputs is None else []
        self.busy_s = 0.0  # time this rank's stages spent in forward and backward (the rest of a step: the bubble)
        self.schedule_s = 0.0  # time this rank spent in the schedule's steps (busy, its sends and its waits)
        hold_until_exit(self)  # its stages, schedule and groups dropped while the interpreter is whole
        for stage in self.stages:
            _time_into(self, stage, "forward_one_chunk")
            _time_into(self, stage, "backward_one_chunk")

    def _stage(self, prog: StageProgram, sources, device, pipelining):
        last = prog.index == self.count - 1
        module = _StageModule(prog, sources, self.collected if last else None)
        if prog.index == 0:
            ins = tuple(torch.empty((1, *c.shape), dtype=c.dtype, device="meta") for c in prog.carried_in)
        else:
            ins = tuple(c.meta() for c in prog.carried_in)
        if last:
            outs = self.outputs if self.outputs is not None else (torch.empty((), device="meta", requires_grad=True),)
        else:
            outs = tuple(c.meta() for c in prog.carried_out)
        return pipelining.PipelineStage(
            module,
            prog.index,
            self.count,
            device,
            input_args=ins,
            output_args=outs,
            input_grads=tuple(t if t.requires_grad else None for t in ins),
            output_grads=tuple(t if t.requires_grad else None for t in outs),
            group=self.group,
        )

    def step(self, micro_inputs: list[list[torch.Tensor]], weights: torch.Tensor) -> torch.Tensor:
        """One training step over the micro-batches (``micro_inputs[i]``: this rank's pieces of micro-batch
        ``i``'s batch inputs, in stage 0's order); the gradients are left in the parameters' ``.grad`` and the
        whole batch's loss is returned on every rank."""
        losses: list[torch.Tensor] = []
        args = self._first_stage_args(micro_inputs)
        kwargs = {"target": weights, "losses": losses} if self.last else {}
        began = time.perf_counter()
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.schedule_s += time.perf_counter() - began
        device = weights.device
        total = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros((), device=device)
        dist.all_reduce(total, group=self.group)
        return total

    def _first_stage_args(self, micro_inputs: list[list[torch.Tensor]]) -> tuple:
        """What the schedule's ``step`` takes on the rank of stage 0: each batch input's micro-batch pieces stacked
        (the schedule splits dim 0 back into them); nothing elsewhere."""
        if not self.first:
            return ()
        return tuple(torch.stack([mb[k] for mb in micro_inputs]) for k in range(len(self.inputs)))

    def forward_only(self, micro_inputs: list[list[torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
        """Each micro-batch's outputs of the last stage (on the rank that runs it; ``[]`` elsewhere)."""
        args = self._first_stage_args(micro_inputs)
        self.collected.clear()
        with torch.no_grad():
            self.schedule.eval(*args, return_outputs=False)
        out = list(self.collected)
        self.collected.clear()
        return out

    def gather_outputs(
        self, per_micro: list[tuple[torch.Tensor, ...]], weights: torch.Tensor, metas: list, loss: int | None
    ) -> list[torch.Tensor]:
        """The whole batch's tensor outputs on every rank, from ``forward_only``'s micro-batch outputs on the last
        stage's rank: an output whose dim 0 is the micro-batch's is concatenated along it, the loss (position
        ``loss``) summed with the weights ``w_i``, any other averaged; then sent over the pipeline axis.
        ``metas``: the ``TensorMeta`` of each output of one micro-batch (collective over the axis)."""
        m, batch = len(weights), self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else None
        out = []
        for k, meta in enumerate(metas):
            batched = k != loss and len(meta.shape) > 0 and meta.shape[0] == batch
            shape = (meta.shape[0] * m, *meta.shape[1:]) if batched else tuple(meta.shape)
            if per_micro:
                values = [mb[k] for mb in per_micro]
                if k == loss:
                    value = sum(w * v for w, v in zip(weights.to(values[0].dtype), values))
                elif batched:
                    value = torch.cat(values)
                else:
                    value = torch.stack(values).mean(0) if values[0].is_floating_point() else values[-1]
                value = value.contiguous()
            else:
                value = torch.empty(shape, dtype=meta.dtype, device=weights.device)
            dist.broadcast(value, group=self.group, group_src=(self.count - 1) % self.group.size())
            out.append(value)
        return out

    def _shared_groups(self, programs: list[StageProgram], p: int, device: torch.device) -> list[tuple[int, object]]:
        """(argument position, process group) of each parameter stages on two or more pipeline ranks read, this
        rank among them: the group of its line's ranks holding it (Megatron's embedding group).  Every rank
        asks for every line's group, in the same order (``runtime.shared_groups``: collective over the world)."""
        lines = self.groups.mesh.axis_groups(self.axis)
        sources = _shared_sources(programs, p)
        sets = [[[line[h] for h in holders] for line in lines] for _, holders in sources]
        made = shared_groups(sets, device)
        return [(position, group) for (position, _), group in zip(sources, made) if group is not None]

    def release(self) -> None:
        """Drop the stages, the schedule and the groups (``runtime.at_exit``: at interpreter exit, so that gloo's
        objects are destroyed while the interpreter is whole; the runner runs nothing after)."""
        self.stages, self.schedule, self.shared, self.group = [], None, [], None

    def sum_shared_grads(self, params: list[torch.Tensor | None]) -> None:
        """Sum between the ranks holding it the gradient of each parameter stages on two or more pipeline ranks
        read (``params``: the parameter at each whole-program argument position, None for the others); a
        holder whose stages left it no gradient adds zeros."""
        for position, group in self.shared:
            param = params[position]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=group)
            if param.grad is None:
                param.grad = grad


def stage_owners(programs: list[StageProgram], p: int, fqns: list[str | None]) -> dict[str, tuple[int, ...]]:
    """Parameter FQN -> the pipeline coordinates whose stages read it (``fqns``: the parameter at each argument
    position of the whole program, None for the other arguments)."""
    owners: dict[str, set[int]] = {}
    for prog in programs:
        for position in prog.sources:
            if fqns[position] is not None:
                owners.setdefault(fqns[position], set()).add(prog.index % p)
    return {fqn: tuple(sorted(r)) for fqn, r in owners.items()}


def from_owner(value: torch.Tensor | None, shape: tuple[int, ...], dtype, owner: int, group) -> torch.Tensor | None:
    """The full tensor the pipeline coordinate ``owner`` holds as ``value`` (None there: None everywhere), sent
    to every rank of the pipeline axis's ``group`` (collective over it)."""
    device = value.device if value is not None else torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    held = torch.tensor([value is not None], dtype=torch.uint8, device=device)
    dist.broadcast(held, group=group, group_src=owner)
    if not held.item():
        return None
    out = value.detach().clone().to(device) if value is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out, group=group, group_src=owner)
    return out


class _TrainStepOnly(torch.autograd.Function):
    """Identity whose backward raises: the outputs of a forward-only pipeline have no backward to run."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            "this output comes from sharded(...) on a pipelined plan, a forward-only pipeline (the stages keep "
            "nothing for backward): train with loss = sharded.train_step(*args, **kwargs), which runs forward "
            "and backward over the micro-batches and leaves the gradients in .grad"
        )


def train_step_only(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a float output of a forward-only pipeline) with a backward that names ``train_step``."""
    return _TrainStepOnly.apply(t.detach().requires_grad_()) if t.is_floating_point() else t


def _time_into(runner: PipelineRunner, stage, method: str) -> None:
    """Wrap ``stage.method`` (a chunk's forward or backward) so its wall time adds to ``runner.busy_s``."""
    inner = getattr(stage, method)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            runner.busy_s += time.perf_counter() - t0

    setattr(stage, method, timed)


def _weighted(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: micro-batch ``i``'s loss times its weight (``target`` chunk ``i``)."""
    return output * weight.reshape(())


def _shared_sources(programs: list[StageProgram], p: int) -> list[tuple[int, tuple[int, ...]]]:
    """(argument position, the pipeline coordinates reading it) of each argument stages on two or more pipeline
    ranks read, in order (the same on every rank)."""
    ranks: dict[int, set[int]] = {}
    for prog in programs:
        for position in prog.sources:
            ranks.setdefault(position, set()).add(prog.index % p)
    return sorted((k, tuple(sorted(r))) for k, r in ranks.items() if len(r) > 1)


class LossWeights:
    """``w_i`` of each micro-batch of one graph's step (module docstring): ``LossWeights(graph)(micro_calls)``,
    ``micro_calls[i]``: graph input name -> micro-batch ``i``'s tensor (whole, not this rank's piece).  The program
    of the loss's denominator is cut from the graph once, when this is built (``ShardedModule`` builds it at its
    first micro-batched step; cut every step, it took 3 ms of a 51 ms step of GPT-2 tiny on one CPU rank)."""

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self._denominator = _denominator_program(graph)

    def __call__(self, micro_calls: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        m = len(micro_calls)
        if self._denominator is None:
            return torch.full((m,), 1.0 / m, dtype=torch.float64)
        program, names = self._denominator
        d = torch.stack(
            [program(*(call[n] for n in names)).detach().to(torch.float64).reshape(()) for call in micro_calls]
        )
        total = d.sum()
        if not total > 0:
            raise ValueError(
                f"{self.graph.model_name}: the loss divides by {float(total)} over the whole batch (every label "
                "ignored?); pass a batch with at least one counted label"
            )
        return d / total


def _denominator_program(graph: OpGraph) -> tuple[fx.GraphModule, list[str]] | None:
    """The ops that make the loss's denominator from the batch inputs alone, as a program over those inputs (and
    their names), or None when the loss is no ``div`` by such a value."""
    node_index, _ = graph.outputs[graph.loss_output]
    loss = graph.nodes[node_index].fx_node
    if loss is None or loss.target is not torch.ops.aten.div.Tensor or not isinstance(loss.args[1], fx.Node):
        return None
    inputs = {n.fx_node: n.fqn for n in graph.nodes if n.kind == "input" and n.fx_node is not None}
    ancestors, stack = set(), [loss.args[1]]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        if n.op == "placeholder" and n not in inputs:  # a parameter or buffer: not the batch's alone
            return None
        if n.op not in ("placeholder", "call_function") or (n.op == "call_function" and _random(n)):
            return None
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = []
    for n in graph.gm.graph.nodes:
        if n in ancestors:
            if n.op == "placeholder":
                env[n] = g.placeholder(n.name)
                names.append(inputs[n])
            else:
                env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[loss.args[1]])
    return fx.GraphModule(graph.gm, g), names


def _random(node: fx.Node) -> bool:
    return node.target is not operator.getitem and "rand" in str(node.target) or "dropout" in str(node.target)
