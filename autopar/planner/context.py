"""A prepared model: what the planner computes before any search, and how it changes batch or prices.

``PlanningContext`` holds the captured graph, its candidates, their prices and the
repeated blocks: everything a search reads and none changes, so one capture serves
many caps (``plan_from_context``) and, with ``prepare(..., reuse_batch=True)``, many
batch sizes (``rebatch``, ``ctx.at_batch``).  ``prepare_context`` builds one from a
model; ``repriced`` prices its graph again under other options; ``hinted_context``
adds the candidates new hints need.  The searches are the driver's (``driver.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from autopar.capture import (
    BatchTemplate,
    Blocks,
    OpGraph,
    capture,
    capture_template,
    find_blocks,
    specialize,
    static_template,
)
from autopar.cost import Coster, TrainingSettings
from autopar.mesh import Mesh
from autopar.strategies import CandidateGraph, SourceStrategy, build_candidates
from costmodel import check_devices_per_node, load_profile, optimizer_spec, precision

from .heap import no_full_collections
from .hints import ResolvedHints, resolve_hints
from .options import HintOptions, PlanOptions
from .problem_tables import ProblemTables, build_tables

__all__ = ["PlanningContext", "graph_context", "hinted_context", "prepare_context", "rebatch", "repriced"]

log = logging.getLogger(__name__)


@dataclass
class PlanningContext:
    """Everything computed before the search, reusable across caps and batch sizes (plan reuse).

    ``plan_from_context(ctx, mem_cap=...)`` searches it under any cap;
    ``ctx.at_batch(b)`` (``rebatch``) gives the context of the same model at another
    batch size, re-using the capture when ``prepare(..., reuse_batch=True)`` made one.
    ``options``: what ``prepare`` was asked, the defaults left to the model filled in
    (``PlanOptions.resolved``); the searches start from them.
    """

    graph: OpGraph
    mesh: Mesh
    cand: CandidateGraph
    coster: Coster
    tables: ProblemTables
    options: PlanOptions
    timings: dict[str, float]
    hints: ResolvedHints | None = None  # the hints given to prepare (autopar.shard calls always)
    blocks: Blocks | None = None  # repeated layers: the search solves one and chains them (search.chain)
    template: BatchTemplate | None = None  # the capture at_batch re-uses (autopar.capture.batch)
    hint_options: HintOptions = field(default_factory=HintOptions)  # prepare's, resolved again at another batch
    recaptured: str | None = None  # why at_batch captured the model again instead of re-using the capture
    recompute: dict[int, str] = field(default_factory=dict)  # op node -> recomputed block (planner.recompute_tables)
    #: the times the search's memory row counts each saved activation byte (``problem_tables.weighted``): a
    #: pipeline's stage plan bounded by ``stage_fitting``, whose ranks hold several micro-batches in flight
    activation_weight: int = 1

    @property
    def settings(self) -> dict[str, Any]:
        """What the costs were priced with, as the plan records it (``PlanOptions.settings``)."""
        return self.options.settings()

    def at_batch(self, batch: int) -> PlanningContext:
        """This context at another global batch size (see ``rebatch``)."""
        return rebatch(self, batch)


def check_no_pipeline(options: PlanOptions, what: str) -> None:
    """A context is captured at the whole batch for one mesh: a pipelined plan (captured at the micro-batch,
    each stage over the mesh without the pipeline axis) is made by ``plan`` / ``compile`` instead."""
    if options.micro_batched:
        raise ValueError(
            f"{what}(pipeline={options.pipeline!r}, microbatches={options.microbatches}): a prepared context plans "
            "the whole batch on the whole mesh; a pipelined plan is captured at the micro-batch and searched per "
            "stage. Fix: call autopar.plan(...) or autopar.compile(...) with those keywords"
        )


def prepare_context(
    model: torch.nn.Module,
    mesh: Mesh,
    example_inputs,
    example_kwargs: dict | None,
    options: PlanOptions,
    hint_options: HintOptions,
    *,
    reuse_batch: bool = False,
) -> PlanningContext:
    """``prepare`` on the options objects (``compile`` and ``plan`` call it with theirs)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh {mesh!r}: expected an autopar.Mesh, e.g. autopar.Mesh((2, 4), axis_names=('dp', 'tp'))")
    check_no_pipeline(options, "prepare")
    options = options.resolved(model)
    if options.devices_per_node is not None:
        check_devices_per_node(mesh.shape, options.devices_per_node)  # before the capture
    timings: dict[str, float] = {}
    with no_full_collections():
        t0 = time.perf_counter()
        if reuse_batch:
            template = capture_template(model, example_inputs, example_kwargs)
            timings["capture_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            graph, _ = specialize(template, template.batch)
            timings["specialize_s"] = time.perf_counter() - t1
        else:
            graph = capture(model, example_inputs, example_kwargs)
            template = static_template(model, example_inputs, example_kwargs)
            timings["capture_s"] = time.perf_counter() - t0
        return _price(graph, mesh, options, hint_options, timings, template)


def rebatch(ctx: PlanningContext, batch: int) -> PlanningContext:
    """The context of ``ctx``'s model, mesh, options and hints at global batch ``batch``.

    With a symbolic capture (``prepare(..., reuse_batch=True)``) the graph is
    specialized to ``batch`` in O(nodes) (``autopar.capture.batch``) into the graph a
    static capture at that batch gives, so the plan JSON is that of a fresh ``plan``
    (``tests/test_rebatch.py``); ``timings`` says ``capture_s`` 0 and ``specialize_s``.
    Otherwise, or when the symbolic graph does not hold at ``batch`` (batch 1, a
    check in the model's code), the model is captured again and ``ctx.recaptured``
    says why.  Strategies, prices and blocks are always rebuilt: they depend on the
    shapes.  ``ctx`` itself stays valid.
    """
    if ctx.template is None:
        raise ValueError(
            f"this context of {ctx.graph.model_name} keeps no model to re-plan at batch {batch}; "
            "build it with autopar.planner.prepare(..., reuse_batch=True)"
        )
    timings: dict[str, float] = {}
    with no_full_collections():
        t0 = time.perf_counter()
        graph, why = specialize(ctx.template, batch)
        took = time.perf_counter() - t0
        timings["capture_s"], timings["specialize_s"] = (took, 0.0) if why is not None else (0.0, took)
        out = _price(graph, ctx.mesh, ctx.options, ctx.hint_options, timings, ctx.template)
    out.recaptured = why
    return out


def graph_context(
    graph: OpGraph,
    mesh: Mesh,
    job_mesh: Mesh,
    axis: int | None,
    options: PlanOptions,
    hint_options: HintOptions,
    microbatches: int = 1,
) -> PlanningContext:
    """The context of a captured ``graph`` on ``mesh``: ``job_mesh`` itself (``axis`` None), or the mesh of the
    stages of a pipeline along axis ``axis`` of ``job_mesh``, each of its axes priced on the link it has in
    ``job_mesh`` (a stage's data-parallel axis crossing nodes stays on the inter-node link though the stage mesh
    alone would fit in a node).  ``options``: resolved (``PlanOptions.resolved``).  ``microbatches``: of the
    step ``graph`` (captured at one micro-batch) is a part of, priced per micro-batch
    (``TrainingSettings.microbatches``)."""
    links = None
    if axis is not None and job_mesh.ndim > 1:
        profile = _profile(options)
        links = tuple(profile.link_for_axis(job_mesh.shape, k) for k in range(job_mesh.ndim) if k != axis)
    with no_full_collections():
        return _price(graph, mesh, options, hint_options, {"capture_s": 0.0}, None, links, microbatches)


def _profile(options: PlanOptions):
    return load_profile(options.profile).with_devices_per_node(options.devices_per_node)


def _price(
    graph: OpGraph,
    mesh: Mesh,
    options: PlanOptions,
    hint_options: HintOptions,
    timings: dict,
    template,
    axis_links: tuple | None = None,
    microbatches: int = 1,
) -> PlanningContext:
    """Candidates, hints, cost tables and blocks of a captured graph, priced with ``options`` (resolved) and
    ``axis_links``, ``microbatches`` (``TrainingSettings``)."""
    t1 = time.perf_counter()
    training = TrainingSettings(
        _profile(options),
        precision(options.dtype),
        optimizer_spec(options.optimizer),
        options.grad_bucket_bytes,
        axis_links,
        microbatches,
    )
    cand = build_candidates(graph, mesh.shape)
    resolved = _resolve(graph, mesh, hint_options)
    cand = _with_sources(cand, resolved.missing_sources(cand))
    coster = Coster(cand, training)
    tables = build_tables(cand, coster)
    tables.problem(None)  # the SearchProblem, checked once: each cap and re-plan shares it
    timings["strategies_s"] = time.perf_counter() - t1
    blocks = graph.derived("blocks", lambda: find_blocks(graph))
    return PlanningContext(
        graph, mesh, cand, coster, tables, options, timings, resolved, blocks, template, hint_options
    )


def _resolve(graph: OpGraph, mesh: Mesh, hint_options: HintOptions) -> ResolvedHints:
    return resolve_hints(
        graph,
        mesh,
        hint_options.hints,
        input_placements=hint_options.input_placements,
        output_placements=hint_options.output_placements,
        strict=hint_options.strict,
    )


def _with_sources(cand: CandidateGraph, extra: dict[int, tuple]) -> CandidateGraph:
    """The candidates plus, per source node, one more placement (stored with its state)."""
    if not extra:
        return cand
    strategies = list(cand.strategies)
    for i, placement in extra.items():
        strategies[i] = strategies[i] + [SourceStrategy(placement, placement)]
    return CandidateGraph(cand.graph, cand.mesh_shape, strategies)


def repriced(ctx: PlanningContext, options: PlanOptions) -> PlanningContext:
    """``ctx``'s captured graph priced with ``options`` (their priced fields differ from the context's)."""
    log.info("pricing %s again for %s", ctx.graph.model_name, options.settings())
    if options.devices_per_node is not None:
        check_devices_per_node(ctx.mesh.shape, options.devices_per_node)
    timings = {"capture_s": 0.0}
    with no_full_collections():
        out = _price(ctx.graph, ctx.mesh, options, ctx.hint_options, timings, ctx.template)
    return out


def hinted_context(ctx: PlanningContext, hint_options: HintOptions | None):
    """(context, resolved hints): the context's own hints, or new ones with any candidates they add."""
    if hint_options is None or not hint_options.given:
        resolved = ctx.hints or resolve_hints(ctx.graph, ctx.mesh)
        return ctx, resolved
    resolved = _resolve(ctx.graph, ctx.mesh, hint_options)
    extra = resolved.missing_sources(ctx.cand)
    if extra:  # a fresh context: the caller's one stays valid for unhinted plans
        cand = _with_sources(ctx.cand, extra)
        coster = Coster(cand, ctx.coster.settings)
        ctx = replace(ctx, cand=cand, coster=coster, tables=build_tables(cand, coster), hints=resolved)
    return ctx, resolved
