"""Activation recomputation in the lowered program: a region's local ops outlined into one checkpointed call.

A plan may mark op nodes with a recompute region (``nodes[name].recompute``, the
name of the block they belong to).  Lowering emits those ops as usual, then
``outline_regions`` moves each region's lowered nodes (its ops, the moves into them,
their kernels) into a sub-program called through ``RecomputeStep``:

* in training (grad enabled) the sub-program runs under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: forward keeps only the
  region's inputs, and backward runs the region's forward again (its collectives
  included, so a tensor-parallel block recomputed repeats its forward all-reduces)
  before its backward;
* the recomputation replays exactly what the first forward computed: random ops
  seed themselves from ``RunState.step`` (``steps.OpStep``), and ``RecomputeStep``
  sets the step back to the one of the forward that saved the region, whatever ran
  in between; the global RNG state is restored around it too;
* the whole region runs again (checkpoint's early stop, which ends the recomputation
  once the last tensor backward needs is made again, is off): the plan prices and
  lists every op and collective of the block again, and the ranks run exactly those;
* without grad (eval, ``torch.no_grad``) the sub-program simply runs;
* measured (``ShardedModule.measure_saved``), the region counts its inputs, which the
  checkpoint keeps until backward; its ops record nothing (what they save inside the
  checkpoint is dropped, and their own saved-tensor hooks would keep it instead).

A region must be convex in the lowered order (nothing outside it both reads a
value it makes and feeds a later op of it): a repeated block is.  ``outline_regions``
refuses one that is not, naming it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .program import RunState

__all__ = ["RecomputeStep", "outline_regions"]


class RecomputeStep:
    """One recompute region of the lowered program: runs its sub-program, checkpointed in training."""

    def __init__(self, name: str, program: fx.GraphModule, state: RunState) -> None:
        self.name, self.program, self.state = name, program, state
        self.__name__ = f"recompute_{name}"

    def __repr__(self) -> str:
        return f"RecomputeStep({self.name!r})"

    def __call__(self, *inputs):
        if not torch.is_grad_enabled():
            return self.program(*inputs)
        if self.state.saved is not None:  # measured: the checkpoint keeps the region's inputs until backward
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    self.state.saved.add(t, self.name)
        with set_checkpoint_early_stop(False):  # the whole region runs again, as the plan prices it
            return checkpoint(self._replay, self.state.step, *inputs, use_reentrant=False, preserve_rng_state=True)

    def _replay(self, step: int, *inputs):
        """The region at the RNG step of the forward that saved it (the recomputation runs in backward)."""
        current, self.state.step = self.state.step, step
        try:
            return self.program(*inputs)
        finally:
            self.state.step = current


def outline_regions(g: fx.Graph, regions: dict[str, Sequence[fx.Node]], root: torch.nn.Module, state: RunState):
    """Replace each region's nodes of ``g`` (in graph order) by one ``RecomputeStep`` call, in place.

    ``root`` owns the attributes the region's ``get_attr`` nodes read (the captured
    module).  Raises ValueError for a region that is not convex in ``g``.
    """
    # positions in the lowered order, taken once: outlining a region inserts and erases only around it, and the
    # nodes later regions compare are all of the original program
    order = {n: i for i, n in enumerate(g.nodes)}
    for name, nodes in regions.items():
        if nodes:
            _outline(g, name, list(nodes), order, root, state)


def _outline(g: fx.Graph, name: str, nodes: list[fx.Node], order: dict, root: torch.nn.Module, state: RunState) -> None:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    last = max(nodes, key=order.__getitem__)
    early = [u.name for o in outputs for u in o.users if u not in inside and order[u] < order[last]]
    if early:
        raise ValueError(
            f"recompute region {name!r} is not convex in the lowered program: {early[:3]} read its values "
            "before its last op; recompute whole blocks (the plan's repeated layers) only"
        )
    sub = fx.Graph()
    env = {a: sub.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    step = RecomputeStep(name, fx.GraphModule(root, sub, class_name="RecomputeRegion"), state)
    with g.inserting_after(last):
        call = g.call_function(step, tuple(inputs))
    anchor = call
    for i, o in enumerate(outputs):
        with g.inserting_after(anchor):
            anchor = g.call_function(operator.getitem, (call, i))
        anchor.meta.update(o.meta)  # what the output stands for (rewrite.VALUE_KEY)
        o.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inside)
    for n in reversed(nodes):
        g.erase_node(n)
