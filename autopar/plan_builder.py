"""Turn a solved choice into a Plan: placements, collectives, cost and memory breakdown.

The breakdown re-prices the chosen strategies with the same ``Coster`` the search
used (in float seconds, before the picosecond rounding), so the plan's totals are
the objective the search minimized.  Compute is op time and optimizer-step time;
communication is every transition, op-issued collective and ZeRO step all-gather,
with parameter-gradient reductions counted at their exposed time (``time_s`` of a
collective is what it adds to the step).
"""

from __future__ import annotations

from typing import Any

from .candidates import SourceStrategy
from .placement import Replicate, format_placements
from .plan_types import Plan
from .problem_builder import PS_PER_S
from .spec import local_shape
from .transitions import consumer_grad_placement, producer_grad_placement, transitions

__all__ = ["assemble_plan", "breakdown"]


def _fmt(pl) -> list[str]:
    return format_placements(pl)


def breakdown(ctx, choice: list[int]) -> dict[str, Any]:
    """Cost, memory and collectives of a choice (one strategy index per graph node)."""
    graph, cand, coster = ctx.graph, ctx.cand, ctx.coster
    axis_names = ctx.mesh.axis_names
    mesh_shape = ctx.mesh.shape
    strat = [cand.strategies[n.index][choice[n.index]] for n in graph.nodes]
    collectives: list[dict[str, Any]] = []
    compute_s = comm_s = 0.0
    mem = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}

    def add(kind, axis, phase, nbytes, node, tensor, reduce_op="sum", exposed=1.0):
        nonlocal comm_s
        t = coster.comm_time_s(kind, nbytes, axis) * exposed
        comm_s += t
        collectives.append(
            {
                "kind": kind,
                "axis": axis_names[axis],
                "phase": phase,
                "bytes": int(nbytes),
                "node": node.name,
                "module": node.module,
                "tensor": tensor,
                "reduce_op": reduce_op,
                "time_s": t,
            }
        )

    for n in graph.nodes:
        s = strat[n.index]
        if n.kind == "param":
            st = coster.param_state_bytes(n, s)
            mem["params"] += st.params
            mem["grads"] += st.grads
            mem["optimizer"] += st.optimizer
            step = coster.step_collectives(n, s)
            compute_s += coster.node_time_s(n, s) - sum(coster.comm_time_s(k, b, a) for a, k, b in step)
            for axis, kind, nbytes in step:
                add(kind, axis, "optimizer", nbytes, n, n.fqn)
            continue
        mem["activations"] += coster.activation_bytes(n, s)
        if n.kind != "op":
            continue
        op_comm = 0.0
        for axis, comms in enumerate(s.comm):
            for c in comms:
                op_comm += coster.comm_time_s(c.kind, c.bytes, axis)
                add(c.kind, axis, c.phase, c.bytes, n, n.name, c.reduce_op)
        compute_s += coster.node_time_s(n, s) - op_comm
        saves = coster.saved_inputs(n)
        for pos, (u, o) in enumerate(n.inputs):
            un, su = graph.nodes[u], strat[u]
            meta = coster.compute_meta(un.outputs[o])
            src, dst = su.outputs[o], s.inputs[pos]
            fwd = transitions(meta, src, dst, mesh_shape) if src != dst else []
            for t in fwd:
                add(t.kind, t.axis, "forward", t.bytes, n, un.name, t.reduce_op)
                if un.kind == "param" and pos in saves:  # FSDP: the op kept a handle; gathered again
                    add(t.kind, t.axis, "backward", t.bytes, n, un.name, t.reduce_op)
            g = tuple(consumer_grad_placement(p, sp) for p, sp in zip(dst, s.split))
            target = su.state if isinstance(su, SourceStrategy) else tuple(producer_grad_placement(p) for p in src)
            mem["activations"] += coster.edge_saved_bytes(un, o, n, pos, src, dst, g != target)
            if un.requires_grad and n.requires_grad and un.outputs[o].is_float:
                if g != target:
                    for t in transitions(meta, g, target, mesh_shape):
                        add(t.kind, t.axis, "backward", t.bytes, n, un.name, t.reduce_op, coster.grad_exposed(un))
    for u, o in ctx.tables.sinks:
        un = graph.nodes[u]
        full = tuple(Replicate() for _ in mesh_shape)
        for t in transitions(coster.compute_meta(un.outputs[o]), strat[u].outputs[o], full, mesh_shape):
            add(t.kind, t.axis, "forward", t.bytes, un, un.name, t.reduce_op)
    per_device = sum(mem.values())
    return {
        "cost": {"compute_s": compute_s, "comm_s": comm_s, "total_s": compute_s + comm_s},
        "memory": dict(mem, per_device_bytes=per_device),
        "collectives": collectives,
        "strategies": strat,
    }


def assemble_plan(ctx, choice: list[int], sol, settings: dict[str, Any], alternatives: list[dict[str, Any]]) -> Plan:
    from .planner import classify

    graph = ctx.graph
    b = breakdown(ctx, choice)
    strat = b["strategies"]
    mesh_shape = ctx.mesh.shape
    params, inputs, nodes, fallback = {}, {}, {}, []
    aliases: dict[str, list[str]] = {}
    for alias, canon in graph.tied.items():
        aliases.setdefault(canon, []).append(alias)
    for n in graph.nodes:
        s = strat[n.index]
        if n.kind == "param":
            params[n.fqn] = {
                "placements": _fmt(s.placement),
                "state_placements": _fmt(s.state),
                "shape": list(n.outputs[0].shape),
                "local_shape": list(local_shape(n.outputs[0].shape, s.placement, mesh_shape)),
                "tied_to": sorted(aliases.get(n.fqn, [])),
            }
        elif n.kind in ("input", "buffer"):
            inputs[n.fqn or n.name] = {
                "kind": n.kind,
                "placements": _fmt(s.placement),
                "shape": list(n.outputs[0].shape),
            }
        else:
            op = str(n.target)
            nodes[n.name] = {
                "op": op,
                "module": n.module,
                "inputs": [_fmt(p) for p in s.inputs],
                "outputs": [_fmt(p) for p in s.outputs],
                "kernels": [k for k in s.kernels],
                "fallback": bool(s.fallback),
            }
            if s.fallback:
                fallback.append({"node": n.name, "op": op, "module": n.module})
    cap = settings.get("mem_cap_bytes")
    memory = dict(b["memory"], cap_bytes=cap)
    search = {
        "solver": sol.solver,
        "optimal": bool(sol.optimal),
        "objective_ps": int(sol.time),
        "objective_s": sol.time / PS_PER_S,
        "num_nodes": len(ctx.tables.names),
        "num_choices": int(sum(len(t) for t in ctx.tables.node_time_ps)),
    }
    return Plan(
        model=graph.model_name,
        mesh=ctx.mesh,
        settings=settings,
        params=params,
        inputs=inputs,
        nodes=nodes,
        collectives=b["collectives"],
        cost=b["cost"],
        memory=memory,
        fallback_ops=fallback,
        family=classify(ctx, choice),
        alternatives=alternatives,
        search=search,
    )
