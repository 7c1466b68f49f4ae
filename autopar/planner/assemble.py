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
overlapped with backward compute).  ``breakdown`` walks the graph once (``_StepWalk``, one method
per thing a node holds or sends) and returns a ``Breakdown``; ``assemble_plan`` adds the placements.
``classify`` names what the chosen plan does (``Plan.family``: tensor / sequence / data parallel,
sharded parameters or state).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from autopar.cost import BACKWARD_SHARE, BackwardMemory, peak_memory
from autopar.placement import Replicate, Shard
from autopar.spec import local_shape
from autopar.transitions import AxisTransition, transitions

from .bucket_prices import BucketedReduction, buckets_as_filled
from .families import batch_size
from .kept import keeping
from .plan_parts import (
    Collective,
    FallbackOp,
    FamilyAlternative,
    InputPlacement,
    NodeCharge,
    NodePlacement,
    ParamPlacement,
    PlanCost,
    PlanMemory,
    PlanSettings,
    SearchStats,
)
from .problem_tables import PS_PER_S
from .schema import Plan

__all__ = ["Breakdown", "assemble_plan", "breakdown", "classify", "node_costs"]


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Cost, memory and collectives of one choice, and the strategy each graph node took (``memory.cap_bytes``
    is None: the cap is the plan's, not the choice's).  ``transient_at``: node index -> the bytes it holds for a
    moment beyond what the search charged it: an op, its backward's working set (``cost.StepPeak.transient_at``);
    a parameter, its gradient's bytes in the buckets' flat copy (``runtime.buckets``; 0: not bucketed).
    ``flat_grad_axes``: the axis sets whose gradient buckets reduce over one flattened group (``Plan``'s field).
    ``reductions``: which of ``collectives`` reduce a parameter's gradient in a bucket, and ``bucketed`` each such
    parameter's gradient bytes there (``bucket_prices``)."""

    cost: PlanCost
    memory: PlanMemory
    collectives: tuple[Collective, ...]
    strategies: tuple
    transient_at: dict[int, int] = field(default_factory=dict)
    flat_grad_axes: tuple[tuple[str, ...], ...] = ()
    reductions: tuple[BucketedReduction, ...] = ()
    bucketed: dict[int, int] = field(default_factory=dict)


def breakdown(ctx, choice: list[int]) -> Breakdown:
    """Cost, memory and collectives of a choice (one strategy index per graph node)."""
    walk = _StepWalk(ctx, choice)
    for node in ctx.graph.nodes:
        if node.kind == "param":
            walk.param(node)
            continue
        region = walk.saved_activations(node)
        if node.kind != "op":
            continue
        walk.op_collectives(node, region)
        saves = walk.coster.saved_inputs(node)
        for pos in range(len(node.inputs)):
            walk.input_moves(node, pos, region, pos in saves)
            walk.input_memory(node, pos, region, pos in saves)
            walk.input_grads(node, pos)
    walk.output_gathers()
    return walk.result()


def node_costs(ctx, choice: list[int], parts: Breakdown) -> dict[str, NodeCharge]:
    """Graph node name -> the time (picoseconds) and bytes the search's objective and additive memory charge it
    under ``choice``: its own (``own_ps``; a parameter: its state and optimizer step, once per step; an op: its
    forward and backward and what it saves) plus every edge into it (its inputs' moves and their gradients; an
    edge into an output sink: its producer's).  Summed over the nodes they are the choice's objective and
    memory.  ``parts``: the choice's ``breakdown``, whose ``transient_at`` each charge carries."""
    tables, graph = ctx.tables, ctx.graph
    n = len(graph.nodes)
    own = [int(tables.node_time_ps[i][choice[i]]) for i in range(n)]
    time = list(own)
    mem = [int(tables.node_mem[i][choice[i]]) for i in range(n)]
    for (u, v), t, m in zip(tables.edge_keys, tables.edge_time_ps, tables.edge_mem, strict=True):
        owner, b = (v, choice[v]) if v < n else (u, 0)
        time[owner] += int(t[choice[u], b])
        mem[owner] += int(m[choice[u], b])
    moment = parts.transient_at
    return {graph.nodes[i].name: NodeCharge(time[i], mem[i], own[i], moment.get(i, 0)) for i in range(n)}


def _bump(where: dict, key, nbytes: int) -> None:
    where[key] = where.get(key, 0) + nbytes


class _StepWalk:
    """What ``breakdown`` gathers walking the graph: each collective, listed and priced; compute and
    communication time; the state and activations held, and where backward frees or makes them again
    (``autopar.cost.peak``'s ``BackwardMemory``)."""

    def __init__(self, ctx, choice: list[int]) -> None:
        self.ctx, self.choice = ctx, choice
        self.graph, self.coster, self.mesh_shape = ctx.graph, ctx.coster, ctx.mesh.shape
        self.strategies = tuple(ctx.cand.strategies[n.index][choice[n.index]] for n in ctx.graph.nodes)
        self.collectives: list[Collective] = []
        self.compute_s = self.comm_s = 0.0
        self.held = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}  # BackwardMemory's parts
        self.freed_at: dict[int, int] = {}  # node index -> activation bytes its backward frees (autopar.cost.peak)
        self.regions = ctx.recompute  # op node -> its recompute region (planner.recompute_tables)
        self.reborn: dict[str, int] = {}  # region -> the activations its recomputation makes again in backward
        self.flat: set[tuple[str, ...]] = set()  # axis sets whose gradient buckets reduce over one flattened group
        self.remade: dict[str, int] = {}  # region -> its outputs, made again by the recomputation, dropped after
        self.keep = keeping(ctx, self.regions) if self.regions else None  # who pays what checkpoints keep
        self.consumers = ctx.graph.consumers() if self.regions else {}
        self.bucketed: dict[int, int] = {}  # parameter -> its gradient bytes the runtime's buckets reduce
        self.reductions: list[BucketedReduction] = []  # which collectives reduce a gradient in a bucket

    def node_time_s(self, node) -> float:
        return int(self.ctx.tables.node_time_ps[node.index][self.choice[node.index]]) / PS_PER_S

    def add(self, move, phase: str, node, tensor: str, exposed=1.0, whole=None, again=False, out=False) -> None:
        """List ``move`` (an ``AxisTransition``) as a collective of ``node``: ``exposed`` of its ``whole`` time
        adds to the step; ``again``: run again by a recomputation; ``out``: gathers a model output."""
        whole = self.coster.comm_time_s(move.kind, move.bytes, move.axis) if whole is None else whole
        t = whole * exposed
        if isinstance(move.axis, tuple):  # a gradient bucket's all-reduce over the axes' flattened group
            self.flat.add(tuple(self.ctx.mesh.axis_names[a] for a in move.axis))
        self.comm_s += t
        self.collectives.append(
            Collective(
                kind=move.kind,
                axis=self.ctx.mesh.axis_label(move.axis),
                phase=phase,
                bytes=int(move.bytes),
                node=node.name,
                module=node.module,
                tensor=tensor,
                reduce_op=move.reduce_op,
                time_s=t,
                hidden_s=whole - t,  # overlapped with backward compute (grad_exposed)
                recompute=again,
                output=out,
            )
        )

    def param(self, n) -> None:
        """A parameter: its state, the optimizer step's all-gathers, the one reduction of its summed gradients."""
        s, coster = self.strategies[n.index], self.coster
        state = coster.param_state_bytes(n, s)
        self.held["params"] += state.params
        self.held["grads"] += state.grads
        self.held["optimizer"] += state.optimizer
        step = coster.step_collectives(n, s)
        self.compute_s += self.node_time_s(n) - sum(coster.step_collective_s(k, b, a) for a, k, b in step)
        for axis, kind, nbytes in step:
            move = AxisTransition(axis, kind, nbytes)
            self.add(move, "optimizer", n, n.fqn, whole=coster.step_collective_s(kind, nbytes, axis))
        summed = coster.accumulated_steps(n, s)
        if s.accumulated_grad is not None:  # the summed partial gradients, reduced once (maybe in a bucket)
            self.bucketed[n.index] = coster.bucketed_grad_bytes(n, n.outputs[0], *s.accumulated_grad)
        self.compute_s -= sum(whole * exposed for _, whole, exposed in summed)
        for t, whole, exposed in summed:  # the summed partial gradients of all uses, reduced once
            self.add(t, "backward", n, n.name, exposed, whole)
            if self.bucketed.get(n.index):
                self.reductions.append(BucketedReduction(len(self.collectives) - 1, n.index, t.axis))

    def saved_activations(self, n) -> str | None:
        """What a node keeps for backward and when backward frees it; its recompute region (None: saved)."""
        s = self.strategies[n.index]
        node_act = int(self.ctx.tables.node_mem[n.index][self.choice[n.index]])  # activation_bytes, tabled
        self.held["activations"] += node_act  # a recomputed op: what its block's checkpoint keeps of it
        region = self.regions.get(n.index)
        if region is None:
            _bump(self.freed_at, n.index, node_act)
            return None
        again = self.coster.activation_bytes(n, s)  # what it keeps for backward, made again by the recomputation
        _bump(self.reborn, region, again)
        outside = self.regions.get
        _bump(
            self.remade,
            region,
            sum(
                self.coster.local_bytes(meta, s.outputs[o])
                for o, meta in enumerate(n.outputs)
                if any(outside(c) != region for c, _, out in self.consumers[n.index] if out == o)
            ),
        )
        _bump(self.freed_at, n.index, again)
        if node_act:  # outputs it still pays: read outside its region, freed with their first reader
            _bump(self.freed_at, self.keep.release.get(n.index, n.index), node_act)
        return region

    def op_collectives(self, n, region: str | None) -> None:
        """The collectives an op issues itself (twice in a recomputed region's forward); the rest is compute."""
        s = self.strategies[n.index]
        op_comm = 0.0
        for axis, comms in enumerate(s.comm):
            for c in comms:
                move = AxisTransition(axis, c.kind, c.bytes, c.reduce_op)
                op_comm += self.coster.comm_time_s(c.kind, c.bytes, axis)
                self.add(move, c.phase, n, n.name)
                if region is not None and c.phase == "forward":
                    op_comm += self.coster.comm_time_s(c.kind, c.bytes, axis)
                    self.add(move, c.phase, n, n.name, again=True)
        self.compute_s += self.node_time_s(n) - op_comm

    def _edge(self, n, pos: int):
        """(producer, its output index, the placement it makes, the placement ``n`` reads) of input ``pos``."""
        u, o = n.inputs[pos]
        return self.graph.nodes[u], o, self.strategies[u].outputs[o], self.strategies[n.index].inputs[pos]

    def input_moves(self, n, pos: int, region: str | None, saved: bool) -> None:
        """The forward moves of input ``pos`` into the placement ``n`` reads (again where it is recomputed)."""
        producer, o, src, dst = self._edge(n, pos)
        if src == dst:
            return
        for t in transitions(self.coster.compute_meta(producer.outputs[o]), src, dst, self.mesh_shape):
            self.add(t, "forward", n, producer.name)
            if region is not None:  # the recomputation moves it again (a parameter too: nothing to re-gather)
                self.add(t, "forward", n, producer.name, again=True)
            elif producer.kind == "param" and saved:  # FSDP: the op kept a handle; gathered again
                self.add(t, "backward", n, producer.name)

    def input_memory(self, n, pos: int, region: str | None, saved: bool) -> None:
        """What ``n`` keeps of input ``pos`` for its backward, and when it is freed or made again."""
        producer, o, src, dst = self._edge(n, pos)
        u = n.inputs[pos][0]
        s, coster = self.strategies[n.index], self.coster
        moved_grad = s.input_grad(pos) != self.strategies[u].output_grad(o)
        edge_act = coster.edge_saved_bytes(producer, o, n, pos, src, dst, moved_grad)
        if region is None:
            if self.keep is not None and src == dst and coster.storage_root((u, o)) in self.keep.shared:
                edge_act = 0  # paid once by the node that made it (planner.kept)
            self.held["activations"] += edge_act
            _bump(self.freed_at, n.index, edge_act)  # kept for n's backward
            return
        # what n keeps of this input is made again by the recomputation
        if self.regions.get(u) != region and src == dst and not moved_grad:
            edge_act = 0  # the checkpoint's own input, read as it is: one storage, paid as kept
        if producer.kind == "param" and src != dst and saved:
            # FSDP: the recomputed op keeps the parameter the recomputation gathered (lower/rewrite.py: no
            # re-gather for recomputed ops) until its backward
            edge_act = coster.local_bytes(producer.outputs[o], dst)
        _bump(self.reborn, region, edge_act)
        _bump(self.freed_at, n.index, edge_act)
        if (n.index, pos) in self.keep.payers:  # the checkpoint keeps what u made until the region's backward ends
            kept = coster.storage_bytes((u, o), src)
            self.held["activations"] += kept
            _bump(self.freed_at, self.keep.first[region], kept)

    def input_grads(self, n, pos: int) -> None:
        """The backward moves of input ``pos``'s gradient to where its producer sums it (a parameter's: to its
        bucket)."""
        producer, o, _, _ = self._edge(n, pos)
        u = n.inputs[pos][0]
        if not (producer.requires_grad and n.requires_grad and producer.outputs[o].is_float):
            return
        g, target = self.strategies[n.index].input_grad(pos), self.strategies[u].output_grad(o)
        grad_bytes = 0
        if producer.kind == "param":  # its uses' gradients are summed into the bucket once
            grad_bytes = self.coster.bucketed_grad_bytes(producer, producer.outputs[o], g, target)
            self.bucketed[u] = max(self.bucketed.get(u, 0), grad_bytes)
        if g != target:  # as the runtime reduces it (a data-parallel all-reduce in a bucket)
            for t, whole, exposed in self.coster.grad_move_steps(producer, producer.outputs[o], g, target):
                self.add(t, "backward", n, producer.name, exposed, whole)
                if grad_bytes:
                    self.reductions.append(BucketedReduction(len(self.collectives) - 1, u, t.axis))

    def output_gathers(self) -> None:
        """The model's outputs gathered whole onto every rank (what the module returns)."""
        full = tuple(Replicate() for _ in self.mesh_shape)
        for u, o in self.ctx.tables.sinks:
            producer = self.graph.nodes[u]
            meta = self.coster.compute_meta(producer.outputs[o])
            for t in transitions(meta, self.strategies[u].outputs[o], full, self.mesh_shape):
                self.add(t, "forward", producer, producer.name, out=True)

    def result(self) -> Breakdown:
        held, coster = self.held, self.coster
        backward = BackwardMemory(
            held,
            self.freed_at,
            reborn_at=_reborn_at(self.ctx, self.reborn),
            remade_at=_reborn_at(self.ctx, self.remade),
            recomputed=frozenset(self.regions),
            bucket_bytes=min(coster.settings.grad_bucket_bytes or 0, sum(self.bucketed.values())),
        )
        peak = peak_memory(self.ctx, self.strategies, backward)
        memory = PlanMemory(
            per_device_bytes=peak.per_device_bytes,
            params_bytes=held["params"],
            grads_bytes=held["grads"],
            optimizer_bytes=held["optimizer"],
            activations_bytes=held["activations"],
            cap_bytes=None,
            search_bytes=sum(held.values()),  # the additive bound the search kept under the cap
            transient_bytes=peak.transient_bytes,
            peak_phase=peak.peak_phase,
        )
        terms = _terms(coster, self.graph, self.strategies, self.compute_s, self.collectives)
        cost = PlanCost(self.compute_s, self.comm_s, self.compute_s + self.comm_s, terms)
        moment = {**peak.transient_at, **self.bucketed}
        flat = tuple(sorted(self.flat))
        reductions, bucketed = tuple(self.reductions), dict(self.bucketed)
        return Breakdown(cost, memory, tuple(self.collectives), self.strategies, moment, flat, reductions, bucketed)


def _reborn_at(ctx, reborn: dict[str, int]) -> dict[int, int]:
    """Node -> the activations a recomputed region makes again when backward reaches it (its last op)."""
    last: dict[str, int] = {}
    for i, region in ctx.recompute.items():
        last[region] = max(last.get(region, -1), i)
    return {i: reborn.get(region, 0) for region, i in last.items()}


def _terms(coster, graph, strat, compute_s: float, collectives: list[Collective]) -> dict[str, float]:
    """The step time by what it is spent on: ops (forward and backward), the optimizer step, and each
    collective kind per phase at its exposed time (what ``autopar plan --explain`` compares)."""
    optimizer_s = sum(coster.optimizer_step_s(n, strat[n.index]) for n in graph.params())
    terms = {"ops (forward + backward)": compute_s - optimizer_s, "optimizer step": optimizer_s}
    for c in collectives:
        key = f"{c.kind} ({c.phase})"
        terms[key] = terms.get(key, 0.0) + c.time_s
    return terms


#: the term of a plan's step that its overlapped gradient reductions add past backward (``overlap_bounded``)
PAST_BACKWARD = "gradient reductions past backward"


def overlap_bounded(cost: PlanCost, collectives: tuple[Collective, ...]) -> PlanCost:
    """``cost`` with the gradient reductions' overlap bounded by the backward compute it hides behind.

    The search prices each overlapped reduction at ``1 - grad_reduce_overlap`` of its time (additive, per
    node); but all of them together can hide behind no more than backward's compute, ``BACKWARD_SHARE`` of the
    ops' time.  What they would hide past that is exposed: a term of its own, ``max(0, sum hidden_s -
    BACKWARD_SHARE t_ops)``, added after the search (the search's objective does not see it: a plan whose
    reductions outrun backward, a data-parallel plan on a slow link, is priced true here and in the choice
    between pipelines, ``pipeline_choice``, not yet inside the search)."""
    hidden = sum(c.hidden_s for c in collectives)
    past = hidden - BACKWARD_SHARE * cost.terms.get("ops (forward + backward)", 0.0)
    if past <= 0:
        return cost
    return PlanCost(cost.compute_s, cost.comm_s + past, cost.total_s + past, {**cost.terms, PAST_BACKWARD: past})


def _as_run(ctx, b: Breakdown) -> tuple[tuple[Collective, ...], PlanCost]:
    """The step's collectives and cost with what is priced after the search: the gradient buckets as the runtime
    fills them (``bucket_prices``), then the reductions' overlap bounded by backward (``overlap_bounded``)."""
    collectives, added = buckets_as_filled(ctx, b.collectives, b.reductions, b.bucketed)
    cost = b.cost
    if added > 0:  # the reductions' terms as they run (the search's objective is the step less ``added``)
        terms = _terms(ctx.coster, ctx.graph, b.strategies, cost.compute_s, collectives)
        cost = PlanCost(cost.compute_s, cost.comm_s + added, cost.total_s + added, terms)
    return collectives, overlap_bounded(cost, collectives)


def assemble_plan(
    ctx,
    choice: list[int],
    sol,
    settings: PlanSettings,
    alternatives: tuple[FamilyAlternative, ...] = (),
    parts: Breakdown | None = None,
) -> Plan:
    """The ``Plan`` of ``choice`` (``parts``: its ``breakdown`` when the caller has it already)."""
    b = parts if parts is not None else breakdown(ctx, choice)
    collectives, cost = _as_run(ctx, b)
    params, inputs, nodes = _placements(ctx, b.strategies)
    fallback = tuple(FallbackOp(name, e.op, e.module) for name, e in nodes.items() if e.fallback)
    return Plan(
        model=ctx.graph.model_name,
        mesh=ctx.mesh,
        settings=settings,
        params=params,
        inputs=inputs,
        nodes=nodes,
        collectives=collectives,
        cost=cost,
        memory=replace(b.memory, cap_bytes=settings.mem_cap_bytes),
        fallback_ops=fallback,
        family=classify(ctx, choice),
        alternatives=tuple(alternatives),
        search=_search_stats(ctx, sol),
        flat_grad_axes=b.flat_grad_axes,
    )


def _placements(ctx, strat) -> tuple[dict, dict, dict]:
    """(params, inputs, nodes) of the plan: each graph value's placements under the strategies ``strat``."""
    graph, mesh_shape = ctx.graph, ctx.mesh.shape
    params: dict[str, ParamPlacement] = {}
    inputs: dict[str, InputPlacement] = {}
    nodes: dict[str, NodePlacement] = {}
    aliases: dict[str, list[str]] = {}
    for alias, canon in graph.tied.items():
        aliases.setdefault(canon, []).append(alias)
    for n in graph.nodes:
        s = strat[n.index]
        if n.kind == "param":
            params[n.fqn] = ParamPlacement(
                placements=tuple(s.placement),
                state_placements=tuple(s.state),
                shape=tuple(n.outputs[0].shape),
                local_shape=tuple(local_shape(n.outputs[0].shape, s.placement, mesh_shape)),
                tied_to=tuple(sorted(aliases.get(n.fqn, []))),
                # uses' gradients summed as P(sum) on these axes, then reduced once
                partial_grad_axes=_axis_names(ctx, s.partial_grad),
            )
        elif n.kind in ("input", "buffer"):
            call = graph.call if n.kind == "input" else None  # how the call names it: batch['ids'], rest[0]
            inputs[n.fqn or n.name] = InputPlacement(
                placements=tuple(s.placement),
                shape=tuple(n.outputs[0].shape),
                kind=n.kind,
                path=call.input_paths.get(n.fqn, n.fqn) if call is not None else None,
            )
        else:
            nodes[n.name] = NodePlacement(
                op=str(n.target),
                module=n.module,
                inputs=tuple(tuple(p) for p in s.inputs),
                outputs=tuple(tuple(p) for p in s.outputs),
                kernels=tuple(s.kernels),
                fallback=bool(s.fallback),
                partial_grad_axes=_axis_names(ctx, s.partial_grad),  # backward on P(sum) gradients (OpStrategy)
                recompute=ctx.recompute.get(n.index),  # recomputed in backward with its block (lower/recompute.py)
            )
    return params, inputs, nodes


def _axis_names(ctx, flags) -> tuple[str, ...]:
    return tuple(ctx.mesh.axis_names[a] for a, f in enumerate(flags) if f)


def _search_stats(ctx, sol) -> SearchStats:
    approximate = bool(sol.stats.get("approximate"))  # past the width budget (search/minibucket.py): a bound
    gapped = "gap" in sol.stats  # approximate, or stopped once proven within planner.solving.PLAN_GAP
    return SearchStats(
        solver=sol.solver,
        optimal=bool(sol.optimal),
        objective_ps=int(sol.time),
        objective_s=sol.time / PS_PER_S,
        num_nodes=len(ctx.tables.names),
        num_choices=int(sum(len(t) for t in ctx.tables.node_time_ps)),
        approximate=approximate,
        why=str(sol.stats.get("why", "")) if approximate else None,
        lower_bound_ps=int(sol.stats.get("lower_bound", 0)) if gapped else None,
        gap=float(sol.stats["gap"]) if gapped else None,
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
    batch = batch_size(ctx.graph)
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
