"""Turn a solved choice into a Plan: placements, collectives, cost and memory breakdown.

The breakdown reads each chosen node's time and memory from the ``ProblemTables`` the
search optimized (shared by equal layers, so nothing is priced again) and splits them
with the ``Coster``: the collectives an op or an optimizer step issues are priced one by
one to list them, and the rest of the node's time is compute.  The plan's totals are
the objective the search minimized (node times to the picosecond, as the search had
them).  Compute is op time and optimizer-step time;
communication is every transition, op-issued collective and ZeRO step all-gather,
with parameter-gradient reductions counted at their exposed time (``time_s`` of a
collective is what it adds to the step, ``hidden_s`` the rest of its ring time,
overlapped with backward compute).  ``classify`` names what the chosen plan does
(``Plan.family``: tensor / sequence / data parallel, sharded parameters or state).
"""

from __future__ import annotations

import re
from typing import Any

from autopar.cost import BackwardMemory, peak_memory
from autopar.placement import Replicate, Shard, format_placements
from autopar.spec import local_shape
from autopar.transitions import transitions

from .kept import keeping
from .problem_tables import PS_PER_S
from .schema import Plan

__all__ = ["assemble_plan", "breakdown", "classify"]


def _reborn_at(ctx, reborn: dict[str, int]) -> dict[int, int]:
    """Node -> the activations a recomputed region makes again when backward reaches it (its last op)."""
    last: dict[str, int] = {}
    for i, region in ctx.recompute.items():
        last[region] = max(last.get(region, -1), i)
    return {i: reborn.get(region, 0) for region, i in last.items()}


def _fmt(pl, memo: dict | None = None) -> list[str]:
    """``format_placements``, memoized per placement tuple when given a dict (plans repeat few)."""
    if memo is None:
        return format_placements(pl)
    if pl not in memo:
        memo[pl] = format_placements(pl)
    return list(memo[pl])


def _axis_names(ctx, flags) -> list[str]:
    return [ctx.mesh.axis_names[a] for a, f in enumerate(flags) if f]


def breakdown(ctx, choice: list[int]) -> dict[str, Any]:
    """Cost, memory and collectives of a choice (one strategy index per graph node)."""
    graph, cand, coster, tables = ctx.graph, ctx.cand, ctx.coster, ctx.tables
    axis_names = ctx.mesh.axis_names
    mesh_shape = ctx.mesh.shape
    strat = [cand.strategies[n.index][choice[n.index]] for n in graph.nodes]
    collectives: list[dict[str, Any]] = []
    compute_s = comm_s = 0.0
    mem = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}
    freed_at: dict[int, int] = {}  # node index -> activation bytes its backward frees (autopar.cost.peak)
    regions = ctx.recompute  # op node -> its recompute region (planner.recompute_tables)
    reborn: dict[str, int] = {}  # region -> the activations its recomputation makes again in backward
    remade: dict[str, int] = {}  # region -> its outputs, made again by the recomputation and dropped after it
    keep = keeping(ctx, regions) if regions else None  # who pays what the checkpoints keep (planner.kept)
    consumers = graph.consumers() if regions else {}
    bucketed: dict[int, int] = {}  # parameter -> its gradient bytes the runtime's buckets reduce

    def add(kind, axis, phase, nbytes, node, tensor, reduce_op="sum", exposed=1.0, whole=None, again=False, out=False):
        nonlocal comm_s
        whole = coster.comm_time_s(kind, nbytes, axis) if whole is None else whole
        t = whole * exposed
        comm_s += t
        entry = {
            "kind": kind,
            "axis": axis_names[axis],
            "phase": phase,
            "bytes": int(nbytes),
            "node": node.name,
            "module": node.module,
            "tensor": tensor,
            "reduce_op": reduce_op,
            "time_s": t,
            "hidden_s": whole - t,  # overlapped with backward compute (grad_exposed)
        }
        if again:  # a forward collective of a recomputed block, run again in backward
            entry["recompute"] = True
        if out:  # a model output gathered whole onto every rank (what the module returns)
            entry["output"] = True
        collectives.append(entry)

    for n in graph.nodes:
        s = strat[n.index]
        if n.kind == "param":
            st = coster.param_state_bytes(n, s)
            mem["params"] += st.params
            mem["grads"] += st.grads
            mem["optimizer"] += st.optimizer
            step = coster.step_collectives(n, s)
            node_s = int(tables.node_time_ps[n.index][choice[n.index]]) / PS_PER_S
            compute_s += node_s - sum(coster.comm_time_s(k, b, a) for a, k, b in step)
            for axis, kind, nbytes in step:
                add(kind, axis, "optimizer", nbytes, n, n.fqn)
            acc = coster.accumulated_steps(n, s)
            if s.accumulated_grad is not None:  # the summed partial gradients, reduced once (maybe in a bucket)
                bucketed[n.index] = coster.bucketed_grad_bytes(n, n.outputs[0], *s.accumulated_grad)
            compute_s -= sum(whole for _, whole in acc) * coster.grad_exposed(n)
            for t, whole in acc:  # the summed partial gradients of all uses, reduced once
                add(t.kind, t.axis, "backward", t.bytes, n, n.name, t.reduce_op, coster.grad_exposed(n), whole)
            continue
        node_act = int(tables.node_mem[n.index][choice[n.index]])  # activation_bytes, tabled
        mem["activations"] += node_act  # a recomputed op: what its block's checkpoint keeps of it (planner.recompute_tables)
        region = regions.get(n.index)
        if region is not None:  # what it keeps for its backward is made again by the recomputation
            again = coster.activation_bytes(n, s)
            reborn[region] = reborn.get(region, 0) + again
            remade[region] = remade.get(region, 0) + sum(
                coster.local_bytes(meta, s.outputs[o])
                for o, meta in enumerate(n.outputs)
                if any(regions.get(c) != region for c, _, out in consumers[n.index] if out == o)
            )
            freed_at[n.index] = freed_at.get(n.index, 0) + again
            if node_act:  # outputs it still pays: read outside its region, freed with their first reader
                frees = keep.release.get(n.index, n.index)
                freed_at[frees] = freed_at.get(frees, 0) + node_act
        else:
            freed_at[n.index] = freed_at.get(n.index, 0) + node_act
        if n.kind != "op":
            continue
        op_comm = 0.0
        for axis, comms in enumerate(s.comm):
            for c in comms:
                op_comm += coster.comm_time_s(c.kind, c.bytes, axis)
                add(c.kind, axis, c.phase, c.bytes, n, n.name, c.reduce_op)
                if region is not None and c.phase == "forward":
                    op_comm += coster.comm_time_s(c.kind, c.bytes, axis)
                    add(c.kind, axis, c.phase, c.bytes, n, n.name, c.reduce_op, again=True)
        compute_s += int(tables.node_time_ps[n.index][choice[n.index]]) / PS_PER_S - op_comm
        saves = coster.saved_inputs(n)
        for pos, (u, o) in enumerate(n.inputs):
            un, su = graph.nodes[u], strat[u]
            meta = coster.compute_meta(un.outputs[o])
            src, dst = su.outputs[o], s.inputs[pos]
            fwd = transitions(meta, src, dst, mesh_shape) if src != dst else []
            for t in fwd:
                add(t.kind, t.axis, "forward", t.bytes, n, un.name, t.reduce_op)
                if region is not None:  # the recomputation moves it again (a parameter too: nothing to re-gather)
                    add(t.kind, t.axis, "forward", t.bytes, n, un.name, t.reduce_op, again=True)
                elif un.kind == "param" and pos in saves:  # FSDP: the op kept a handle; gathered again
                    add(t.kind, t.axis, "backward", t.bytes, n, un.name, t.reduce_op)
            g, target = s.input_grad(pos), su.output_grad(o)
            edge_act = coster.edge_saved_bytes(un, o, n, pos, src, dst, g != target)
            if region is not None:  # what n keeps of this input is made again by the recomputation
                if regions.get(u) != region and src == dst and g == target:
                    edge_act = 0  # the checkpoint's own input, read as it is: one storage, paid as kept
                if un.kind == "param" and src != dst and pos in saves:
                    # FSDP: the recomputed op keeps the parameter the recomputation gathered (lower/rewrite.py:
                    # no re-gather for recomputed ops) until its backward
                    edge_act = coster.local_bytes(un.outputs[o], dst)
                reborn[region] += edge_act
                freed_at[n.index] = freed_at.get(n.index, 0) + edge_act
                if (n.index, pos) in keep.payers:  # the checkpoint keeps what u made until the region's backward ends
                    kept = coster.storage_bytes((u, o), src)
                    mem["activations"] += kept
                    first = keep.first[region]
                    freed_at[first] = freed_at.get(first, 0) + kept
            else:
                if keep is not None and src == dst and coster.storage_root((u, o)) in keep.shared:
                    edge_act = 0  # paid once by the node that made it (planner.kept)
                mem["activations"] += edge_act
                freed_at[n.index] = freed_at.get(n.index, 0) + edge_act  # kept for n's backward
            if un.requires_grad and n.requires_grad and un.outputs[o].is_float:
                if un.kind == "param":  # its uses' gradients are summed into the bucket once
                    bucketed[u] = max(bucketed.get(u, 0), coster.bucketed_grad_bytes(un, un.outputs[o], g, target))
                if g != target:  # as the runtime reduces it (a data-parallel all-reduce in a bucket)
                    for t, whole in coster.grad_move_steps(un, un.outputs[o], g, target):
                        exposed = coster.grad_exposed(un)
                        add(t.kind, t.axis, "backward", t.bytes, n, un.name, t.reduce_op, exposed, whole)
    for u, o in ctx.tables.sinks:
        un = graph.nodes[u]
        full = tuple(Replicate() for _ in mesh_shape)
        for t in transitions(coster.compute_meta(un.outputs[o]), strat[u].outputs[o], full, mesh_shape):
            add(t.kind, t.axis, "forward", t.bytes, un, un.name, t.reduce_op, out=True)
    search_bytes = sum(mem.values())  # the additive bound the search kept under the cap
    return {
        "cost": {
            "compute_s": compute_s,
            "comm_s": comm_s,
            "total_s": compute_s + comm_s,
            "terms": _terms(coster, graph, strat, compute_s, collectives),
        },
        "memory": dict(
            mem,
            search_bytes=search_bytes,
            **peak_memory(
                ctx,
                strat,
                BackwardMemory(
                    mem,
                    freed_at,
                    reborn_at=_reborn_at(ctx, reborn),
                    remade_at=_reborn_at(ctx, remade),
                    recomputed=frozenset(regions),
                    bucket_bytes=min(coster.settings.grad_bucket_bytes or 0, sum(bucketed.values())),
                ),
            ),
        ),
        "collectives": collectives,
        "strategies": strat,
    }


def _terms(coster, graph, strat, compute_s: float, collectives: list[dict]) -> dict[str, float]:
    """The step time by what it is spent on: ops (forward and backward), the optimizer step, and each
    collective kind per phase at its exposed time (what ``autopar plan --explain`` compares)."""
    optimizer_s = sum(coster.optimizer_step_s(n, strat[n.index]) for n in graph.params())
    terms = {"ops (forward + backward)": compute_s - optimizer_s, "optimizer step": optimizer_s}
    for c in collectives:
        key = f"{c['kind']} ({c['phase']})"
        terms[key] = terms.get(key, 0.0) + c["time_s"]
    return terms


def assemble_plan(
    ctx, choice: list[int], sol, settings: dict[str, Any], alternatives: list[dict[str, Any]], parts=None
) -> Plan:
    """The ``Plan`` of ``choice`` (``parts``: its ``breakdown`` when the caller has it already)."""
    graph = ctx.graph
    b = parts if parts is not None else breakdown(ctx, choice)
    strat = b["strategies"]
    mesh_shape = ctx.mesh.shape
    params, inputs, nodes, fallback = {}, {}, {}, []
    shown: dict = {}  # placement tuple -> its strings
    aliases: dict[str, list[str]] = {}
    for alias, canon in graph.tied.items():
        aliases.setdefault(canon, []).append(alias)
    for n in graph.nodes:
        s = strat[n.index]
        if n.kind == "param":
            params[n.fqn] = {
                "placements": _fmt(s.placement, shown),
                "state_placements": _fmt(s.state, shown),
                "shape": list(n.outputs[0].shape),
                "local_shape": list(local_shape(n.outputs[0].shape, s.placement, mesh_shape)),
                "tied_to": sorted(aliases.get(n.fqn, [])),
            }
            if any(s.partial_grad):  # uses' gradients summed as P(sum) on these axes, then reduced once
                params[n.fqn]["partial_grad_axes"] = _axis_names(ctx, s.partial_grad)
        elif n.kind in ("input", "buffer"):
            inputs[n.fqn or n.name] = {
                "kind": n.kind,
                "placements": _fmt(s.placement, shown),
                "shape": list(n.outputs[0].shape),
            }
            if n.kind == "input" and graph.call is not None:  # how the call names it: batch['ids'], rest[0]
                inputs[n.fqn]["path"] = graph.call.input_paths.get(n.fqn, n.fqn)
        else:
            op = str(n.target)
            nodes[n.name] = {
                "op": op,
                "module": n.module,
                "inputs": [_fmt(p, shown) for p in s.inputs],
                "outputs": [_fmt(p, shown) for p in s.outputs],
                "kernels": [k for k in s.kernels],
                "fallback": bool(s.fallback),
            }
            if any(s.partial_grad):  # backward runs on P(sum) gradients on these axes (OpStrategy)
                nodes[n.name]["partial_grad_axes"] = _axis_names(ctx, s.partial_grad)
            if n.index in ctx.recompute:  # recomputed in backward with its block (lower/recompute.py)
                nodes[n.name]["recompute"] = ctx.recompute[n.index]
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
    if sol.stats.get("approximate"):  # past the width budget (search/minibucket.py): a bound, not a proof
        search.update(approximate=True, why=str(sol.stats.get("why", "")))
    if "gap" in sol.stats:  # approximate, or stopped once proven within planner.solving.PLAN_GAP of the optimum
        search.update(lower_bound_ps=int(sol.stats.get("lower_bound", 0)), gap=float(sol.stats["gap"]))
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


_FEATURES = ("tensor parallel", "sequence parallel", "data parallel", "sharded parameters", "sharded optimizer state")


def classify(ctx, choice: list[int]) -> str:
    """Name what a chosen plan does to most of the model, and where it does more, e.g. ``data parallel + sharded
    optimizer state (also tensor parallel on transformer.wte.weight, transformer.wpe.weight: 32% of the
    parameter bytes)``.  Each parameter shows the features below; a feature its parameters hold at least half
    the parameter bytes of names the plan, the others are listed after it with the parameters they are on:

    * ``tensor parallel``: the parameter is read sharded by its consumer;
    * ``data parallel``: an op that reads it replicated is split on an axis along the batch
      (``_splits_batch``), so its gradient is reduced across the axis;
    * ``sequence parallel``: such an op is split along another dim, the sequence or the tokens of a batch too
      small to split (Megatron's sequence parallelism: norms and biases on token-split activations between
      tensor-parallel matmuls);
    * ``sharded parameters``: it is stored sharded and gathered before use;
    * ``sharded optimizer state``: its gradient/optimizer state is sharded beyond its placement;
    * ``replicated``: no feature holds half the bytes (every rank runs that part whole).
    """
    on = _features_by_parameter(ctx, choice)
    nodes = ctx.graph.nodes
    size = {u: nodes[u].outputs[0].numel * nodes[u].outputs[0].dtype.itemsize for u in on}
    total = sum(size.values()) or 1
    share = {f: sum(size[u] for u, fs in on.items() if f in fs) / total for f in _FEATURES}
    major = [f for f in _FEATURES if share[f] >= 0.5]
    minor = [f for f in _FEATURES if 0 < share[f] < 0.5]
    label = " + ".join(major) or "replicated"
    if minor:
        also = [f"{f} on {_names([u for u, fs in on.items() if f in fs], nodes)}: {share[f]:.0%}" for f in minor]
        label += f" (also {'; '.join(also)} of the parameter bytes)"
    return label


def _features_by_parameter(ctx, choice: list[int]) -> dict[int, set[str]]:
    """Parameter node -> the features of :func:`classify` the plan gives it."""
    strategies, nodes = ctx.cand.strategies, ctx.graph.nodes
    batch = _batch_size(ctx.graph)
    on: dict[int, set[str]] = {n.index: set() for n in nodes if n.kind == "param"}
    for node in nodes:
        s = strategies[node.index][choice[node.index]]
        if node.kind == "param" and s.state != s.placement:
            on[node.index].add("sharded optimizer state")
        if node.kind != "op":
            continue
        for pos, (u, _) in enumerate(node.inputs):
            if nodes[u].kind != "param":
                continue
            stored, read = strategies[u][choice[u]].placement, s.inputs[pos]
            if any(isinstance(p, Shard) for p in read):
                on[u].add("tensor parallel")
            if any(isinstance(a, Shard) and a != b for a, b in zip(stored, read)):
                on[u].add("sharded parameters")
            for axis, (p, split) in enumerate(zip(read, s.split)):
                if isinstance(p, Replicate) and split:
                    on[u].add("data parallel" if _splits_batch(ctx, node, s, axis, batch) else "sequence parallel")
    return on


def _names(params: list[int], nodes) -> str:
    """The parameters' names, a layer index as ``*`` (``transformer.h.*.mlp.c_fc.weight``), the first three."""
    names = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", nodes[u].fqn or nodes[u].name) for u in params))
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _batch_size(graph) -> int | None:
    """Dim 0 of the graph's tensor inputs (the most common one when they differ); None without inputs."""
    sizes = [n.outputs[0].shape[0] for n in graph.nodes if n.kind == "input" and n.outputs and n.outputs[0].ndim]
    return max(set(sizes), key=sizes.count) if sizes else None


def _splits_batch(ctx, node, strategy, axis: int, batch: int | None) -> bool:
    """Whether ``axis`` splits ``node``'s work along the batch: one of its activations is split on dim 0 whose
    size is a multiple of a batch of at least the axis size ((B, S, H) or flattened (B * S, H) rows: whole
    samples per rank).  Without graph inputs every split counts as a batch split."""
    if batch is None:
        return True
    if batch < ctx.mesh.shape[axis]:
        return False
    nodes = ctx.graph.nodes
    tensors = list(zip(strategy.outputs, node.outputs)) + [
        (strategy.inputs[pos], nodes[u].outputs[o])
        for pos, (u, o) in enumerate(node.inputs)
        if nodes[u].kind != "param"
    ]
    for placement, meta in tensors:
        p = placement[axis]
        if isinstance(p, Shard) and p.dim == 0 and meta.ndim and meta.shape[0] % batch == 0:
            return True
    return False
