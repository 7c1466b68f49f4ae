"""The peak memory of one training step on one device, phase by phase.

The search bounds memory by a sum of node and edge terms (parameters, gradients,
optimizer state and saved activations all at once).  A step never holds all of
them at once: gradients are born during backward as the activations they need
die, and the optimizer's temporaries come after both.  What the ranks really
reach (``autopar fidelity`` measures it) is the larger of two moments::

    backward start  = params + optimizer state + activations + T_backward
    optimizer step  = params + optimizer state + gradients   + T_optimizer

``T_backward`` is the working set of the op whose backward needs most at once:
the gradient of its outputs and of its float inputs on this rank's pieces, and,
for a parameter it reads gathered (FSDP), the gathered copy its backward gathers
again (the unreduced full-size gradient is that input gradient).  ``T_optimizer``
is the optimizer's temporaries on the largest state shard
(``OptimizerSpec.temporaries``: AdamW's ``sqrt(v)`` and its quotient).  The
planner keeps the search's additive bound and checks this peak against the cap
afterwards (``planner``: the cap is tightened and the search run again when the
peak exceeds it).
"""

from __future__ import annotations

from typing import Any

from .candidates import SourceStrategy

__all__ = ["peak_memory"]


def peak_memory(ctx, strat: list, mem: dict[str, int]) -> dict[str, Any]:
    """``{"per_device_bytes", "transient_bytes", "peak_phase"}`` of the plan whose strategies are ``strat``.

    ``mem`` holds the plan's ``params``, ``grads``, ``optimizer`` and ``activations`` bytes.
    """
    t_backward = _backward_transient(ctx, strat)
    t_optimizer = _optimizer_transient(ctx, strat)
    backward = mem["params"] + mem["optimizer"] + mem["activations"] + t_backward
    step = mem["params"] + mem["optimizer"] + mem["grads"] + t_optimizer
    if backward >= step:
        return {"per_device_bytes": backward, "transient_bytes": t_backward, "peak_phase": "backward"}
    return {"per_device_bytes": step, "transient_bytes": t_optimizer, "peak_phase": "optimizer step"}


def _backward_transient(ctx, strat: list) -> int:
    coster, graph = ctx.coster, ctx.graph
    worst = 0
    for v in graph.nodes:
        if v.kind != "op" or not v.requires_grad:
            continue
        s = strat[v.index]
        need = sum(coster.local_bytes(meta, s.outputs[o]) for o, meta in enumerate(v.outputs) if meta.is_float)
        for pos, (u, o) in enumerate(v.inputs):
            producer = graph.nodes[u]
            meta = producer.outputs[o]
            if not (producer.requires_grad and meta.is_float):
                continue
            need += coster.local_bytes(meta, s.inputs[pos])  # its gradient, in the placement v read it
            if producer.kind == "param" and strat[u].placement != s.inputs[pos] and pos in coster.saved_inputs(v):
                need += coster.local_bytes(meta, s.inputs[pos])  # FSDP: gathered again for this backward
        worst = max(worst, need)
    return worst


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
    largest = max(shards, default=0)
    return temporaries * largest
