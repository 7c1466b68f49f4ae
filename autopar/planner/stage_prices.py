"""What a pipeline's stages cost: a stage-mesh plan's prices summed per layer, and the split they choose.

``chain_prices`` reads the search's own charge of every node (``Plan.node_costs``: its time and bytes with the
moves into it; summed they are the plan's objective and searched memory) and sums it per position of the chain
of layers (``pipeline_planning.chain_layers``), as ``pipeline_planning.stage_of_nodes`` runs the ops:

* an op of layer ``k`` is layer ``k``'s; any other op goes where the stages would run it with one layer per stage:
  on the first stage (the *prelude*: embeddings, masks, rotary tables), on the last (the *postlude*: final norm,
  head, loss), or with the layer it follows or first feeds;
* an op's time is its forward and backward for one micro-batch, split ``1 : 2`` between them (the usual ratio of
  a matmul's backward to its forward; with proportional stages only their sum sets the step, ``search.stages``);
  its bytes are what it saves for backward, held once per micro-batch in flight;
* a parameter's bytes (its state) and time (its optimizer step, once per step) go to the first layer reading it,
  and to each end (prelude, postlude) reading it: a weight two stages read is held by both (a tied embedding);
* a cut after layer ``k`` costs the time to send the values made up to it that a later op reads (this rank's
  pieces under the plan's placements) over the pipeline axis's link, and their gradients back; the sends run
  while the stages compute (``search.stages``: each link one more machine of the flow shop) where the host runs
  ahead of its device; where it is the device (CPU ranks) a transfer starts once its receiver is free
  (``cost.schedule_run`` with ``Transfer.when_receiver_free``), and the split's step is simulated so.

A rank's memory is its stages' model state plus the most its actions hold beyond it, followed over the rank's order
of actions (``_rank_peak``)::

    before a backward of stage j = activations saved by the forwards not yet backward + gradients born so far
                                   + W_j (the largest backward working set of j's ops, ``cost.StepPeak``)
    after any action             = activations saved + gradients born so far
    end of the step              = every gradient + max(the largest bucket's flat copy, T_optimizer)

each forward's activations held until its backward, each stage's gradients born in its first backward (a step
starts without them: ``zero_grad`` freed them); at the end the runtime reduces the step's gradients bucket by
bucket (``runtime.buckets.GradBuckets.reduce_held``: a bucket's flat copy beside every gradient, at most
``grad_bucket_bytes``), then the optimizer's temporaries on the rank's largest gradient.  The split itself is
searched under the additive bound (state plus every micro-batch in flight).

``priced_stages`` then splits the layers: for GPipe and 1F1B by ``search.stages.split_stages`` (uneven where that
pays, every stage under the cap with its micro-batches in flight), for interleaved schedules evenly into ``p v``
stages priced by ``cost.pipeline.step_time``'s list schedule; and adds the slowest rank's optimizer steps.  Where
the ranks share a node's cores and outnumber them (a CPU profile's ``cores_per_node``), a rank idle in the bubble
lends its share to the ranks computing: the split's step is then ``cost.schedule_run``'s simulation, each stage's
compute (``compute_s``, its ops' own time) going ``DeviceProfile.compute_speed`` times faster while fewer ranks
compute, its moves not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autopar.capture import OpGraph
from autopar.cost import BACKWARD_TO_FORWARD, Transfer, in_flight, rank_orders, schedule_run
from autopar.placement import parse_placements
from autopar.search import EndOfStep, NoSplitFits, SharedState, StageCosts, split_stages, step_of_split
from autopar.spec import local_shape
from autopar.units import format_bytes
from costmodel import LinkProfile, model_state_bytes, optimizer_spec, p2p_time_s, precision

from .plan_parts import StagePart
from .problem_tables import PS_PER_S
from .schema import Plan
from .stage_assignment import chain_slots

__all__ = ["ChainPrices", "PricedPipeline", "Speed", "chain_prices", "priced_stages"]

#: ``speed(k, w)``: how much faster a stage computes an action of ``w`` seconds (at full load) while ``k`` pipeline
#: ranks compute (``priced_stages``).
Speed = Callable[[int, float], float]


@dataclass(frozen=True, slots=True)
class ChainPrices:
    """Per position of the chain: the layers' costs, the prelude's and the postlude's (``search.stages``' form),
    each position's optimizer step (``step_s``: the layers', then the prelude's and the postlude's), the
    seconds to send what crosses each cut (``cuts[k]``: after layer k) and, per position as ``step_s``, the part
    of its forward and backward that is its ops' compute (``compute_s``; the rest, moves between its ops) and the
    part of its state that is its parameters' gradients (``grad_bytes``: born in the step's first backward), and
    what the step's end holds beside them (``end``); ``shared``: the parameters several positions hold (a tied
    embedding), held once by a stage that runs two of them (``search.SharedState``)."""

    layers: StageCosts
    prelude: StageCosts
    postlude: StageCosts
    step_s: tuple[float, ...]
    cuts: tuple[float, ...]
    compute_s: tuple[float, ...] = ()
    grad_bytes: tuple[int, ...] = ()
    end: EndOfStep = EndOfStep()
    shared: tuple[SharedState, ...] = ()


@dataclass(frozen=True, slots=True)
class PricedPipeline:
    """A split and its price: the stages, the step (the schedule's time plus the slowest rank's optimizer step),
    the part of it that is the schedule's bubble, the optimizer step, and the fullest rank's memory: its model
    state and, at its peak, the activations of its micro-batches in flight less the gradients not yet born then
    (``activation_bytes``; ``_rank_peak``)."""

    stages: tuple[StagePart, ...]
    step_s: float
    bubble_s: float
    optimizer_s: float
    state_bytes: int
    activation_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes


def chain_prices(graph: OpGraph, plan: Plan, layers: list, link: LinkProfile, m: int = 1) -> ChainPrices:
    """The chain's prices from ``plan`` (searched on the stage mesh for one micro-batch of ``graph``, of a step
    of ``m``: a parameter's charge, its optimizer step and once-per-step reductions, is ``1 / m`` of them,
    ``cost.coster``; module docstring); ``layers``: ``chain_layers(graph)``; ``link``: the pipeline axis's."""
    n = len(layers)
    position, slot_of = chain_slots(graph, layers)
    consumers = graph.consumers()
    prelude, postlude = n, n + 1  # the ends' slots after the layers'
    time, step, compute = [0.0] * (n + 2), [0.0] * (n + 2), [0.0] * (n + 2)
    saved, state, grads = [0] * (n + 2), [0] * (n + 2), [0] * (n + 2)
    work, flat, largest = [0] * (n + 2), [0] * (n + 2), [0] * (n + 2)
    shared: list[SharedState] = []

    for node in graph.nodes:
        t_ps, nbytes, own_ps, moment = plan.node_costs.get(node.name, (0, 0, 0, 0))
        if node.kind == "op":
            time[slot_of[node.index]] += t_ps / PS_PER_S
            compute[slot_of[node.index]] += own_ps / PS_PER_S
            saved[slot_of[node.index]] += nbytes
            work[slot_of[node.index]] = max(work[slot_of[node.index]], moment)
        elif node.kind == "param":
            readers = {slot_of[v] for v, _, _ in consumers.get(node.index, ()) if v in position}
            layers_reading = [s for s in readers if s < n]
            holders = {s for s in readers if s >= n} | ({min(layers_reading)} if layers_reading else set())
            grad = _grad_bytes(node, plan)
            if len(holders) > 1:
                layer_slots = tuple(sorted(s for s in holders if s < n))
                ends = (prelude in holders, postlude in holders)
                shared.append(SharedState(nbytes, grad, moment, t_ps * m / PS_PER_S, layer_slots, *ends))
            for s in holders:
                state[s] += nbytes
                grads[s] += grad
                step[s] += t_ps * m / PS_PER_S
                flat[s] += moment
                largest[s] = max(largest[s], grad)

    def costs(slots: range | list[int]) -> StageCosts:
        f = [time[s] / (1 + BACKWARD_TO_FORWARD) for s in slots]
        b = [x * BACKWARD_TO_FORWARD for x in f]
        moments = ([work[s] for s in slots], [flat[s] for s in slots], [largest[s] for s in slots])
        return StageCosts(f, b, [state[s] for s in slots], [saved[s] for s in slots], *moments)

    cuts = tuple(p2p_time_s(b, link) for b in _cut_bytes(graph, plan, position, n))
    settings = plan.settings
    end = EndOfStep(settings.grad_bucket_bytes or 0, optimizer_spec(settings.optimizer).temporaries)
    return ChainPrices(
        costs(range(n)),
        costs([prelude]),
        costs([postlude]),
        tuple(step),
        cuts,
        tuple(compute),
        tuple(grads),
        end,
        tuple(shared),
    )


def _grad_bytes(node, plan: Plan) -> int:
    """The bytes of parameter ``node``'s gradient on a rank of ``plan`` (its state placements' piece)."""
    placed = plan.params.get(node.fqn)
    if placed is None:
        return 0
    meta, mesh_shape = node.outputs[0], plan.mesh.shape
    numel = math.prod(local_shape(meta.shape, parse_placements(placed.placements), mesh_shape))
    state_numel = math.prod(local_shape(meta.shape, parse_placements(placed.state_placements), mesh_shape))
    settings = plan.settings
    return model_state_bytes(numel, state_numel, precision(settings.dtype), optimizer_spec(settings.optimizer)).grads


def _cut_bytes(graph: OpGraph, plan: Plan, position: dict[int, int], n: int) -> list[int]:
    """Bytes of this rank's pieces of the values crossing each cut (after layer k, k < n - 1)."""
    mesh_shape, coord = plan.mesh.shape, (0,) * plan.mesh.ndim
    crossing = [0] * max(n - 1, 0)
    last_read: dict[tuple[int, int], int] = {}
    for node in graph.nodes:
        if node.kind == "op":
            for ref in node.inputs:
                last_read[ref] = max(last_read.get(ref, -1), position[node.index])
    for (u, o), last in last_read.items():
        node = graph.nodes[u]
        if node.kind not in ("op", "input"):
            continue  # weights and buffers are each stage's own
        first = position.get(u, 0)
        if node.kind == "op":
            placement = plan.nodes[node.name].outputs[o]
        else:
            placement = next(v.placements for k, v in plan.inputs.items() if k == node.fqn)
        meta = node.outputs[o]
        nbytes = math.prod(local_shape(meta.shape, placement, mesh_shape, coord)) * meta.itemsize
        for k in range(first, min(last, n - 1)):
            crossing[k] += nbytes
    return crossing


def flow_shop_priced(v: int, speed: Speed | None, recv_when_free: bool) -> bool:
    """Whether ``priced_stages`` prices a split by the flow shop's formula (one stage per rank, ranks on devices of
    their own, receives posted ahead: ``search.stages``) rather than simulating its schedule (``cost.schedule_run``);
    ``pipeline_planning.step_at_least`` bounds each run by the same rule."""
    return v == 1 and speed is None and not recv_when_free


def priced_stages(
    prices: ChainPrices,
    schedule: str,
    m: int,
    p: int,
    v: int,
    cap: int | None,
    speed: Speed | None = None,
    recv_when_free: bool = False,
) -> PricedPipeline:
    """The split of the chain into ``p v`` stages and its price (module docstring). ``speed(k, w)``: how much faster
    a stage computes an action of ``w`` seconds while ``k`` of the ``p`` pipeline ranks compute (ranks sharing
    cores, ``DeviceProfile.compute_speed``); where given, the split's step is simulated so (``cost.schedule_run``),
    each stage's compute sped up and its moves (collectives inside the stage) not. ``recv_when_free``: each transfer
    starts only once its receiver is free (``cost.schedule_run``; a host that does not run ahead of its device), the
    step then simulated too."""
    n = prices.layers.count
    held = [in_flight(schedule, p, m, r, v) for r in range(p)]
    ends = (prices.prelude, prices.postlude)
    if v == 1:
        split = split_stages(prices.layers, held, m, cap, ends, prices.cuts, prices.end, prices.shared)
    else:
        bounds = [0]
        for j in range(p * v):
            bounds.append(bounds[-1] + n // (p * v) + (1 if j < n % (p * v) else 0))
        split = step_of_split(prices.layers, bounds, [1] * (p * v), m, ends, prices.cuts, prices.end, prices.shared)
    per_stage = [f + b for f, b in zip(split.forward_s, split.backward_s, strict=True)]
    if flow_shop_priced(v, speed, recv_when_free):  # the flow shop's exact step, each link a machine
        schedule_s, busy_s = split.step_s, m * sum(per_stage) / p
    else:
        sends = max(split.sends, default=0.0)  # the simulation's one transfer time: the slowest link's
        shares = [_compute_share(prices, split.bounds[j], split.bounds[j + 1], j, p * v) for j in range(p * v)]
        run = schedule_run(
            schedule,
            list(split.forward_s),
            list(split.backward_s),
            m,
            v=v,
            transfer=Transfer(sends, when_receiver_free=recv_when_free),
            speed=speed,
            compute_share=shares,
        )
        schedule_s, busy_s = run.step_s, sum(run.busy_s) / p
    optimizer, state, acts = [0.0] * p, [0] * p, [0] * p
    runs = [_stage_run(prices, split.bounds[j], split.bounds[j + 1], j, p * v) for j in range(p * v)]
    for j, run in enumerate(runs):
        optimizer[j % p] += run.step_s
        state[j % p] += run.state_bytes
    orders = rank_orders(schedule, p, m, v)
    for r in range(p):
        mine = runs[r::p]
        grads = sum(run.grad_bytes for run in mine)
        end = grads + prices.end.bytes(sum(run.flat_bytes for run in mine), max(run.largest_grad_bytes for run in mine))
        acts[r] = max(_rank_peak(orders[r], runs), end) - grads  # its gradients: in the state
    fullest = max(range(p), key=lambda r: state[r] + acts[r])
    memory = [state[r] + acts[r] for r in range(p)]
    if cap is not None and memory[fullest] > cap:  # the split was searched under the additive bound
        split_of = (
            f"the even split of {n} layers into {p * v} interleaved stages ({v} per rank)"
            if v > 1
            else f"the split of {n} layers into {p} stages"
        )
        raise NoSplitFits(
            f"{split_of} needs {format_bytes(memory[fullest])} on its fullest rank at its peak (its state, "
            f"{held[fullest]} stage-micro-batches of activations in flight and its backward's working set), over "
            f"the cap of {format_bytes(cap)}; raise the cap, use more stages, or 1f1b (fewer micro-batches in "
            "flight)",
            memory[fullest],
        )
    stages = tuple(
        StagePart(split.bounds[j], split.bounds[j + 1], "", per_stage[j], memory[j % p]) for j in range(p * v)
    )
    bubble = max(schedule_s - busy_s, 0.0)
    return PricedPipeline(stages, schedule_s + max(optimizer), bubble, max(optimizer), state[fullest], acts[fullest])


def _compute_share(prices: ChainPrices, a: int, b: int, j: int, stages: int) -> float:
    """The part of stage ``j``'s forward and backward (layers ``[a, b)``, the ends on the first and last stage)
    that is its ops' compute (``ChainPrices.compute_s``); 1.0 where the prices do not say."""
    if not prices.compute_s:
        return 1.0
    n, layers = prices.layers.count, prices.layers
    slots = [*range(a, b), *([n] if j == 0 else []), *([n + 1] if j == stages - 1 else [])]
    ends = {n: prices.prelude, n + 1: prices.postlude}
    total = sum(
        layers.forward_s[k] + layers.backward_s[k] if k < n else ends[k].forward_s[0] + ends[k].backward_s[0]
        for k in slots
    )
    return min(sum(prices.compute_s[k] for k in slots) / total, 1.0) if total > 0 else 1.0


@dataclass(frozen=True, slots=True)
class _StageRun:
    """A stage's optimizer seconds, state bytes (of which ``grad_bytes`` its gradients), the activations one
    micro-batch saves in it, and what it holds for a moment (``search.StageCosts``' last three figures: the
    largest over its positions, its bucketed gradients summed)."""

    step_s: float
    state_bytes: int
    act_bytes: int
    grad_bytes: int
    work_bytes: int = 0
    flat_bytes: int = 0
    largest_grad_bytes: int = 0


def _stage_run(prices: ChainPrices, a: int, b: int, j: int, stages: int) -> _StageRun:
    """Stage ``j`` on layers ``[a, b)``: the first stage with the prelude, the last with the postlude."""
    n, layers = prices.layers.count, prices.layers
    first, last = j == 0, j == stages - 1
    ends = [end for end, here in ((prices.prelude, first), (prices.postlude, last)) if here]
    step = sum(prices.step_s[a:b]) + first * prices.step_s[n] + last * prices.step_s[n + 1]
    grads = prices.grad_bytes or (0,) * (n + 2)  # none given: no gradient bytes per position
    grad = sum(grads[a:b]) + first * grads[n] + last * grads[n + 1]

    def total(name: str) -> int:
        return sum(layers.at(name, k) for k in range(a, b)) + sum(end.at(name, 0) for end in ends)

    def largest(name: str) -> int:
        return max([layers.at(name, k) for k in range(a, b)] + [end.at(name, 0) for end in ends])

    state, acts, flat = total("state_bytes"), total("act_bytes"), total("flat_bytes")
    for one in prices.shared:  # a parameter two of its positions read, held once
        extra = one.copies(a, b, first, last)
        step, state, grad = step - extra * one.step_s, state - extra * one.state_bytes, grad - extra * one.grad_bytes
        flat -= extra * one.flat_bytes
    return _StageRun(step, state, acts, grad, largest("work_bytes"), flat, largest("largest_grad_bytes"))


def _rank_peak(order: list, runs: list[_StageRun]) -> int:
    """The most a rank holds beyond its parameters and optimizer state over its actions ``order`` (stage ``j``:
    ``runs[j]``), the module docstring's walk: each forward of stage ``j`` saves ``act_bytes`` until its backward,
    which first holds its working set (``work_bytes``) beside them; stage ``j``'s gradients (``grad_bytes``) are
    born in its first backward and stay (a step starts with none).  Taken at the boundaries between actions.
    1F1B on a rank that runs a forward after its first backward holds its ``w`` micro-batches in flight beside
    every gradient (``w A + G + W``); GPipe, or 1F1B with ``m <= w``, peaks at ``max(m A, (m - 1) A + G) + W``
    (the step's end, ``G + E``, is the caller's: ``search.EndOfStep``)."""
    held = born = top = 0
    seen: set[int] = set()
    for act in order:
        run = runs[act.stage]
        if act.kind == "F":
            held += run.act_bytes
        else:
            top = max(top, held + born + run.work_bytes)
            held -= run.act_bytes
            if act.stage not in seen:
                seen.add(act.stage)
                born += run.grad_bytes
        top = max(top, held + born)
    return top
