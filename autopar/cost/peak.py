"""The peak memory of one training step on one device, followed through backward.

The search bounds memory by a sum of node and edge terms (parameters, gradients,
optimizer state and saved activations all at once).  A step never holds all of
them at once: during backward each op's saved activations die as its gradients
are computed, while parameter gradients are born and stay; the optimizer's
temporaries come after both.  ``peak_memory`` walks backward in reverse
topological order (the order autograd runs it) and takes the larger of::

    during backward, at op v = params + optimizer state
                               + activations kept for the backward of v and of every op before v
                               + gradients of the parameters whose last reader comes after v
                               + T(v)
    end of backward          = params + optimizer state + gradients + the largest gradient bucket
    optimizer step           = params + optimizer state + gradients + T_optimizer

``T(v)``, op v's backward working set, is the gradient of its outputs and of its
float inputs on this rank's pieces, and the larger of two: for a parameter it reads
gathered (FSDP), the gathered copy its backward gathers again (the unreduced
full-size gradient is that input gradient), freed when its backward ends; the
buffers of the largest gradient move out of it (the runtime's redistribution
copies: ``_MOVE_BUFFERS``), which runs after it; a gradient the runtime's buckets
reduce has no move of its own: the bucket's flat copy is made when its last gradient
arrives (at most ``grad_bucket_bytes``; the last bucket as backward ends, with every
gradient born: the end-of-backward term).  At the last op of a recomputed
region, also the region's outputs its recomputation makes again (``remade_at``).  A
parameter's gradient (its state shard) is counted from the
backward of its last reader in forward order.  ``T_optimizer`` is the optimizer's
temporaries on the largest state shard (``OptimizerSpec.temporaries``: AdamW's
``sqrt(v)`` and its quotient).  The planner keeps the search's additive bound and
checks this peak against the cap afterwards (``planner``: the cap is tightened and
the search run again when the peak exceeds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.strategies import SourceStrategy
from autopar.transitions import transitions

__all__ = ["BackwardMemory", "StepPeak", "peak_memory"]


@dataclass(frozen=True)
class BackwardMemory:
    """What one plan's step holds and frees, as the walk of :func:`peak_memory` reads it.

    ``mem``: the plan's ``params``, ``grads``, ``optimizer`` and ``activations`` bytes.
    ``freed_at``: node -> the activation bytes its backward frees (its own saved tensors
    and those kept on its input edges).  ``reborn_at``: the last op of a recomputed block
    -> the activations its recomputation makes again when backward reaches it (then freed
    op by op, as ``freed_at`` says); ``remade_at``: that op -> the block's outputs, which
    the recomputation makes again too and drops once it ends (a transient of that op's
    backward: the whole region runs again, ``lower/recompute.py``).  ``recomputed``: the
    ops of those regions, whose backward reads the parameters the recomputation gathered
    (in ``reborn_at``) instead of gathering them again.  ``bucket_bytes``: the largest flat
    copy of the gradient buckets (``runtime/buckets.py``), made when a bucket's last
    gradient arrives: the last, as backward ends, beside every gradient."""

    mem: dict[str, int]
    freed_at: dict[int, int]
    reborn_at: dict[int, int] = field(default_factory=dict)
    remade_at: dict[int, int] = field(default_factory=dict)
    recomputed: frozenset[int] = frozenset()
    bucket_bytes: int = 0


@dataclass(frozen=True, slots=True)
class StepPeak:
    """The peak of one step (``peak_memory``): ``per_device_bytes`` at its worst moment, of which
    ``transient_bytes`` the working set then, ``peak_phase`` (``"backward"`` or ``"optimizer step"``), and per op
    the bytes its backward holds briefly beyond the walk's activations and gradients (``transient_at``: node
    index -> ``T(v)`` plus what a recomputed region makes again there; a pipeline's stages take their own peaks
    from them, ``planner.stage_prices``)."""

    per_device_bytes: int
    transient_bytes: int
    peak_phase: str
    transient_at: dict[int, int] = field(default_factory=dict)


def peak_memory(ctx, strat: list, step: BackwardMemory) -> StepPeak:
    """The peak of the plan whose strategies are ``strat`` and whose step holds and frees what ``step`` says
    (the module docstring's walk)."""
    mem, freed_at, reborn_at, remade_at = step.mem, step.freed_at, step.reborn_at, step.remade_at
    recomputed, bucket_bytes = step.recomputed, step.bucket_bytes
    coster, graph = ctx.coster, ctx.graph
    static = mem["params"] + mem["optimizer"]
    grad_of = {n.index: coster.param_state_bytes(n, strat[n.index]).grads for n in graph.params()}
    alive, grads, worst, worst_t = mem["activations"], 0, 0, 0
    transient_at: dict[int, int] = {}
    for v in reversed(graph.nodes):
        reborn = reborn_at.get(v.index, 0)
        alive += reborn
        if v.kind != "op" or not v.requires_grad:
            continue
        for u, _ in v.inputs:  # the last reader of a parameter in forward starts its gradient
            grads += grad_of.pop(u, 0)
        t = _working_set(coster, graph, strat, v, v.index not in recomputed) + remade_at.get(v.index, 0)
        transient_at[v.index] = t + reborn
        if static + alive + grads + t > worst:
            worst, worst_t = static + alive + grads + t, t
        alive -= freed_at.get(v.index, 0)
    if static + mem["grads"] + bucket_bytes > worst:  # the last bucket's flat copy, as backward ends
        worst, worst_t = static + mem["grads"] + bucket_bytes, bucket_bytes
    t_optimizer = _optimizer_transient(ctx, strat)
    step = static + mem["grads"] + t_optimizer
    if worst >= step:
        return StepPeak(worst, worst_t, "backward", transient_at)
    return StepPeak(step, t_optimizer, "optimizer step", transient_at)


#: buffers a gradient move holds besides its input, per collective step, in units of the step's bytes
#: (runtime/redistribute.py: an all-reduce works on a copy; an all-gather fills a list of padded pieces, then
#: concatenates them; an all-to-all selects chunks, stacks them into a send buffer and receives into another)
_MOVE_BUFFERS = {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 2, "all_to_all": 3}


def _working_set(coster, graph, strat: list, v, regathers: bool = True) -> int:
    """``T(v)``: op v's output gradients and the input gradients it makes, with the larger of the parameters
    its backward gathers again (FSDP; not a recomputed op, ``regathers`` False: it kept what the recomputation
    gathered) and the buffers of the largest gradient move out of it.  The moves run after v's backward, when
    the gathered copies are gone; its output gradients may live on (a residual's gradient is shared by both
    branches), so they are counted with either.
    """
    s = strat[v.index]
    out_grads = sum(coster.local_bytes(meta, s.outputs[o]) for o, meta in enumerate(v.outputs) if meta.is_float)
    in_grads = gathered = 0
    moving = 0  # the largest gradient move out of v's backward: its buffers, one move at a time
    for pos, (u, o) in enumerate(v.inputs):
        producer = graph.nodes[u]
        meta = producer.outputs[o]
        if not (producer.requires_grad and meta.is_float):
            continue
        in_grads += coster.local_bytes(meta, s.inputs[pos])  # its gradient, in the placement v read it
        if (
            regathers
            and producer.kind == "param"
            and strat[u].placement != s.inputs[pos]
            and pos in coster.saved_inputs(v)
        ):
            gathered += coster.local_bytes(meta, s.inputs[pos])  # FSDP: gathered again for this backward
        target = strat[u].output_grad(o)
        if s.input_grad(pos) != target and not coster.bucketed_grad_bytes(producer, meta, s.input_grad(pos), target):
            steps = transitions(coster.compute_meta(meta), s.input_grad(pos), target, coster.mesh_shape)
            moving = max([moving] + [t.bytes * _MOVE_BUFFERS.get(t.kind, 0) for t in steps if t.kind])
    return out_grads + in_grads + max(gathered, moving)


def _optimizer_transient(ctx, strat: list) -> int:
    coster = ctx.coster
    temporaries = coster.settings.optimizer.temporaries
    if not temporaries:
        return 0
    shards = [
        coster.param_state_bytes(n, strat[n.index]).grads
        for n in ctx.graph.params()
        if isinstance(strat[n.index], SourceStrategy)
    ]
    return temporaries * max(shards, default=0)
