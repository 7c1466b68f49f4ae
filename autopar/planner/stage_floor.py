"""The least stage objective an interleaved run's fitting plans can have: a bound that prunes a run before its walk.

An interleaved run splits the layers evenly (``stage_prices.priced_stages``), so which stage runs each op is known
before any stage plan is: stage ``j`` of ``p v``, on rank ``j mod p`` (``stage_assignment.chain_slots``: a layer's
ops on its layer's stage, the prelude on the first, the postlude on the last).  A rank's need (``stage_prices``) is
its parameters' and optimizer state ``P_r`` (its state less its gradients) plus the most its actions hold, which is
at least what it holds at any one moment; at its fullest moment by count (``cost.stage_counts``) it holds ``n_j``
micro-batches of each of its stages' activations ``A_j`` (what one micro-batch saves in stage ``j``'s ops: the
searched bytes of the ops and of the moves into them).  Each parameter an op reads is held by at least one rank.  So
every stage plan whose split fits the cap on all ``p`` ranks has::

    sum_params P_i + sum_j n_j A_j  <=  sum_r need_r  <=  p cap

The left side is a memory row of the stage plan weighted node by node (``problem_tables.reweighted``): each op's
bytes times its stage's count, each parameter's state less its gradient once, nothing else (inputs and output sinks
hold nothing a rank counts).  The least objective under ``p cap`` in that row bounds every fitting plan's objective
from below, and ``search.weighted_chain.lagrange_floor`` bounds that least (a Lagrange dual over the chain, each
block weighted by its stage's count); ``pipeline_planning.step_at_least_of`` of it bounds the run's step.

How it differs from the walk's weighted searches (``stage_fitting``): those weigh every layer alike, by the fullest
rank's count, under a bound scaled from one split's need, so their proofs hold for their own bound only; this row
counts each stage as its rank holds it (the last stage one micro-batch, the first up to ``2 p - 1``) and its budget
holds for every plan that fits.  Measured on Llama 3 405B at (4, 128, 32) of 16,384 H100s (``docs/measurements/
llama3-anchors-2026-11-30-free.md``): every interleaved run's floor was above the fastest step of the meshes before.

Weights: each stage's count rounded down to one of at most three (the last stage's, the one before it, the least
of the others: a smaller weight only loosens the row), so a context's runs share a few block tables.  The floor
covers every plan the run's walk can meet (each layer saved, selective or whole, the rest recomputed with the first:
``ModeSearch.per_layer_choices``) where those are every mode's plans too (``ModeSearch.covers_every_mode``); else
there is none (``StageFloors.of`` gives None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.cost import stage_counts
from autopar.search import WeightedChain, lagrange_floor

from .context import PlanningContext, hinted_context
from .problem_tables import ProblemTables, read_only, reweighted, to_problem
from .recompute_modes import ModeSearch
from .recompute_tables import recomputed_tables
from .stage_assignment import chain_layers, chain_slots, even_stages

__all__ = ["StageFloors", "kept_weights"]


def kept_weights(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Each stage's count rounded down to one of at most three: the last stage's, the one before it, and the least
    of the others (module docstring)."""
    kept = set(counts) if len(counts) < 3 else {counts[-1], counts[-2], min(counts[:-2])}
    return tuple(max(k for k in kept if k <= c) for c in counts)


@dataclass
class StageFloors:
    """The floors of one stage context's interleaved runs (module docstring): its tables per recomputation variant
    (``variants``: the blocks' first, ``block_variants`` of them, then the rest's), each parameter's state less its
    gradient (``state``), each op's slot in the chain, and the weighted chain their runs share."""

    ctx: PlanningContext
    variants: tuple[ProblemTables, ...]
    block_variants: int
    state: dict[int, np.ndarray]
    slots: dict[int, int]
    layers: int
    chain: WeightedChain
    _weights: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, ctx: PlanningContext) -> StageFloors | None:
        """``ctx``'s floors (a pipeline's stage context, its hints none); None where the walk's plans are not all
        among the choices the floor covers (module docstring)."""
        hinted_ctx, resolved = hinted_context(ctx, None)
        modes = ModeSearch(ctx, hinted_ctx, resolved, replace(ctx.options, mem_cap=1), None)
        if not modes.covers_every_mode():
            return None
        choices = modes.per_layer_choices()
        blocks = choices.per_layer or (choices.regions,)
        variants = tuple(recomputed_tables(hinted_ctx, r) for r in (*blocks, *choices.per_rest))
        layers = chain_layers(ctx.graph)
        chain = WeightedChain([list(b) for b in hinted_ctx.blocks.nodes])
        slots = chain_slots(ctx.graph, layers)[1]
        return cls(ctx, variants, len(blocks), _state_less_grads(ctx), slots, len(layers), chain)

    def floor_ps(self, p: int, m: int, v: int, cap: int, lam_ref: float, enough: float | None = None) -> int:
        """A lower bound (ps) on the stage objective of every plan whose even split into ``p v`` interleaved stages
        over ``m`` micro-batches fits ``cap`` on every rank; ``lam_ref``: the scale of the Lagrange slope (ps per
        byte); ``enough``: the bound may stop once past it.  ``ChainError`` where the weighted tables do not chain."""
        weights = kept_weights(stage_counts("interleaved", p, m, v))
        stage = _stage_of_slot(self.layers, p * v)
        op_weight = {i: weights[stage[k]] for i, k in self.slots.items()}
        rest_key = (p * v, weights)  # the rest's row: the split and its weights
        blocks = self.chain.nodes
        order = [min(op_weight[i] for i in b if i in op_weight) for b in blocks[1:]]
        rest = self._rest_weights(op_weight, blocks)
        self.chain.add_rest(rest_key, [self._problem(rest, t) for t in self.variants])
        for w in set(order):
            self.chain.add_block(w, [self._problem(self._uniform(w), t) for t in self.variants[: self.block_variants]])
        value = lagrange_floor(self.chain, rest_key, order, p * cap, lam_ref, enough)
        return math.floor(value) if math.isfinite(value) else 2**62

    def _rest_weights(self, op_weight: dict[int, int], blocks: list[list[int]]) -> list[int]:
        """The rest's row: each op at its stage's weight, those of blocks ``1 ..`` at 1 (their own rows weigh them),
        everything else but the parameters (their state less gradients replaces theirs) at 0."""
        inside = {i for b in blocks[1:] for i in b}
        return [1 if i in inside else op_weight.get(i, 0) for i in range(len(self.variants[0].names))]

    def _uniform(self, w: int) -> list[int]:
        """Every op at ``w``, everything else at 0 (a block's row; its parameters' state replaces theirs)."""
        nodes = self.ctx.graph.nodes
        return [w if i < len(nodes) and nodes[i].kind == "op" else 0 for i in range(len(self.variants[0].names))]

    def _problem(self, weights: list[int], tables: ProblemTables):
        key = (id(tables), tuple(weights))
        if key not in self._weights:
            self._weights[key] = to_problem(reweighted(tables, weights, self.state), None)[0]
        return self._weights[key]


def _stage_of_slot(layers: int, stages: int) -> dict[int, int]:
    """Slot (``chain_slots``: a layer ``k < n``, the prelude ``n``, the postlude ``n + 1``) -> its stage of the even
    split into ``stages``."""
    out = {k: j for j, (first, stop) in enumerate(even_stages(layers, stages)) for k in range(first, stop)}
    out[layers], out[layers + 1] = 0, stages - 1
    return out


def _state_less_grads(ctx: PlanningContext) -> dict[int, np.ndarray]:
    """Per parameter node an op reads: its state's bytes less its gradient's, per strategy (``Coster``'s
    ``param_state_bytes``); per parameter no op reads: zeros (no rank holds it)."""
    coster, consumers, out, made = ctx.coster, ctx.graph.consumers(), {}, {}
    for node in ctx.graph.nodes:
        if node.kind != "param":
            continue
        read = any(ctx.graph.nodes[v].kind == "op" for v, _, _ in consumers.get(node.index, ()))
        strategies = ctx.cand.strategies[node.index]
        key = (id(strategies), node.outputs[0], read)  # equal parameters (the layers') share one array
        if key not in made:
            held = [coster.param_state_bytes(node, s) for s in strategies] if read else []
            made[key] = read_only(np.array([b.total - b.grads for b in held] or [0] * len(strategies), np.int64))
        out[node.index] = made[key]
    return out
