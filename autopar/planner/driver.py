"""The planner's driver, ``autopar.plan``: capture -> candidates -> costs -> search -> Plan.

Needs no process group and no real weights (meta-device models plan).  Besides
the best plan under the cap, the planner solves the same problem restricted to
each *family* (``families``) so the report can show why the winner won.
User hints (``hints=``, ``input_placements=``, ``output_placements=``, and
``autopar.shard`` calls in the model) are one more restriction (``autopar.planner.hints``):
hinted nodes keep only the strategies that match, the search places the rest.

The entry points ``plan``, ``prepare`` and ``plan_from_context`` (and ``autopar.compile``)
take the same planning keywords (``options.PLAN_KEYWORDS``), build the options objects
once at their top and hand them down: ``prepare_context`` and ``search_context`` are
the same two steps on ``PlanOptions`` and ``HintOptions``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from autopar.capture import attach_loss
from autopar.mesh import Mesh

from .context import PlanningContext, prepare_context, rebatch
from .context_search import search_context
from .errors import MemoryCapError
from .mesh_choice import plan_on
from .options import HintOptions, PlanOptions
from .schema import FAMILIES, Plan
from .throughput import with_throughput

__all__ = [
    "FAMILIES",
    "MemoryCapError",
    "PlanningContext",
    "plan",
    "plan_from_context",
    "prepare",
    "prepare_context",
    "rebatch",
    "search_context",
]

log = logging.getLogger(__name__)


def prepare(
    model: torch.nn.Module,
    mesh: Mesh,
    *,
    example_inputs=(),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    example_target=None,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    grad_bucket_bytes: int | None = 25 * 2**20,
    devices_per_node: int | None = None,
    solver: str = "dp",
    recompute: str = "auto",
    family: str | None = None,
    allow_state_sharding: bool = True,
    search_budget_s: float | None = 30.0,
    pipeline: str = "none",
    microbatches: int | str = "auto",
    schedule: str = "auto",
    virtual_stages: int | str = "auto",
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    reuse_batch: bool = False,
) -> PlanningContext:
    """Capture the model and price every candidate (the part of planning independent of the cap).

    The planning keywords are ``plan``'s (``autopar.planner.PLAN_KEYWORDS``); the context keeps
    them as ``ctx.options``, so that ``plan_from_context(ctx)`` searches with them.  The priced
    ones (profile, dtype, optimizer, grad_bucket_bytes, devices_per_node) price the candidates here.

    The hints (``autopar.planner.hints``) are checked here and kept in the context; a hinted
    placement no candidate has (a parameter stored in a layout no consumer reads)
    is added as a candidate, so the search can keep it.

    ``reuse_batch=True`` captures with a symbolic batch (dim 0 of every tensor input,
    example batch >= 2; slower than a static capture: 1.3x measured at 12 GPT layers,
    about 2.5x at 96 on a loaded machine) so that
    ``ctx.at_batch(b)`` re-plans at another batch without tracing the model again
    (``autopar.capture.batch``).  Without it, ``at_batch`` captures the model again.
    ``loss_fn`` / ``example_target``: as in ``plan``.
    """
    options, hint_options = PlanOptions.from_keywords(locals()), HintOptions.from_keywords(locals())
    model, example_kwargs = attach_loss(model, loss_fn, example_kwargs, example_target)
    return prepare_context(model, mesh, example_inputs, example_kwargs, options, hint_options, reuse_batch=reuse_batch)


def plan(
    model: torch.nn.Module,
    mesh: Mesh | None = None,
    *,
    devices: int | None = None,
    example_inputs=(),
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    example_target=None,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    grad_bucket_bytes: int | None = 25 * 2**20,
    devices_per_node: int | None = None,
    solver: str = "dp",
    recompute: str = "auto",
    family: str | None = None,
    allow_state_sharding: bool = True,
    search_budget_s: float | None = 30.0,
    pipeline: str = "none",
    microbatches: int | str = "auto",
    schedule: str = "auto",
    virtual_stages: int | str = "auto",
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    compare_families: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> Plan:
    """The fastest training plan of ``model`` on ``mesh`` that fits ``mem_cap`` per device; or, given
    ``devices=N`` instead of a mesh, on the fastest logical mesh of ``N`` devices (``planner.mesh_choice``:
    the factorizations of ``N``, placed on nodes of ``devices_per_node``; ``mem_cap`` None is then the
    profile's device memory; ``Plan.meshes`` ranks every mesh tried).

    ``example_inputs``/``example_kwargs`` are passed to ``model`` (meta tensors are
    fine).  A model that does not return its loss is given one with ``loss_fn=fn`` and
    ``example_target=t``: the plan is of ``fn(model(...), t)``, traced into the graph
    (``capture.with_loss``; the target is the call's ``target=`` keyword).  Raises
    ``MemoryCapError`` when no plan fits, naming the smallest reachable memory.
    The planning keywords (``autopar.planner.PLAN_KEYWORDS``: the same in ``prepare``,
    ``plan_from_context`` and ``autopar.compile``, checked by ``PlanOptions``):

    - ``mem_cap``: bytes or a string with units (``"40GiB"``); None: no cap.
    - ``profile``: a device profile (``configs/devices``: ``"h100"``, ``"a100"``, ``"cpu"``) or a
      .toml path; None: the device the steps run on (a process group's device, else the
      model's GPU; a model on meta or the CPU: ``"h100"``; ``autopar.planner.options``).
    - ``dtype``: ``"fp32"``, ``"bf16"`` (mixed, float32 master weights) or ``"bf16-pure"``;
      None: the model's parameters' (float32: fp32, bfloat16: bf16-pure).
    - ``optimizer``: whose state the memory counts (``costmodel.OPTIMIZERS``).
    - ``grad_bucket_bytes``: the runtime's data-parallel gradient bucket
      (``compile(grad_bucket_bytes=)``; None or 0: none), priced as it runs
      (``Coster.grad_move_steps``).
    - ``devices_per_node``: the job's ranks per node when it uses fewer devices per node
      than the profile's node has, so axes spanning nodes are priced on the inter-node link
      (``DeviceProfile.link_for_axis``); None: torchrun's across nodes, else the profile's.
    - ``solver``: ``"dp"`` (exact dynamic programming) or ``"ilp"`` (CP-SAT).
    - ``recompute``: ``"auto"`` (recompute in backward where that makes the fastest plan
      that fits the cap, each layer its own choice), ``"none"``, ``"selective"`` (each
      repeated block's attention core and activations) or ``"full"`` (whole blocks).
    - ``family`` (one of ``FAMILIES``): a forced data-parallel, sharded-parameter or
      tensor-parallel plan; None: any.
    - ``allow_state_sharding=False`` keeps every parameter's gradient and optimizer state
      with the parameter (no ZeRO-1/2), for runtimes that do not shard state.
    - ``search_budget_s`` (None: no budget): past it the searches stop with the best plan
      they have met and the bound they proved (``search.budget_hit``, ``gap``).
    - Semi-auto mode (``autopar.planner.hints``): ``hints`` maps parameter-FQN patterns to
      placements (``{"*.mlp.c_fc.weight": ["R", "S(1)"]}``), module patterns to
      ``"replicate"``, ``"recompute"`` or a MindSpore-style matmul strategy
      (``((2, 1), (1, 4))``); ``input_placements``/``output_placements`` fix graph inputs
      and outputs.  Hinted tensors keep their placements; the search chooses the rest.  A
      pattern matching nothing warns (``strict=True``: raises).

    ``compare_families``: also search the best plan of each family for the report
    (``Plan.alternatives``).  ``progress(stage, done, total)`` is called as planning goes
    (``autopar.launch.progress`` draws it).
    """
    options, hint_options = PlanOptions.from_keywords(locals()), HintOptions.from_keywords(locals())
    model, example_kwargs = attach_loss(model, loss_fn, example_kwargs, example_target)
    if progress is not None:
        progress("capture + strategies", 0, 1)
    found = plan_on(
        model,
        _mesh_or_devices(mesh, devices),
        example_inputs,
        example_kwargs,
        options,
        hint_options,
        compare_families=compare_families,
        progress=progress,
    )
    return found[0]


def _mesh_or_devices(mesh: Mesh | None, devices: int | None) -> Mesh | int:
    """The mesh, or the device count, a plan is asked for: exactly one of them (ValueError with the fix)."""
    if (mesh is None) == (devices is None):
        raise ValueError(
            "autopar.plan: pass either mesh= (an autopar.Mesh: the plan is made on it) or devices= (a device "
            f"count: the plan chooses the mesh), not {'both' if mesh is not None else 'neither'}"
        )
    return mesh if mesh is not None else devices


def plan_from_context(
    ctx: PlanningContext,
    *,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    grad_bucket_bytes: int | None = 25 * 2**20,
    devices_per_node: int | None = None,
    solver: str = "dp",
    recompute: str = "auto",
    family: str | None = None,
    allow_state_sharding: bool = True,
    search_budget_s: float | None = 30.0,
    pipeline: str = "none",
    microbatches: int | str = "auto",
    schedule: str = "auto",
    virtual_stages: int | str = "auto",
    hints: dict[str, Any] | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    compare_families: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> Plan:
    """Search a prepared context (re-planning with another cap reuses the context).

    The planning keywords are ``plan``'s.  The search starts from the options ``prepare`` was
    given (``ctx.options``): a keyword left at its default keeps the context's value, one given
    replaces it (``PlanOptions.updated_by``); a priced one (profile, dtype, optimizer,
    grad_bucket_bytes, devices_per_node) prices the captured graph again (no new capture).
    ``hints``/``input_placements``/``output_placements``/``strict`` replace the hints given
    to ``prepare`` when any of the first three is given; else those hold.

    ``recompute="auto"``, under a cap, lets each layer choose among saved, selective and whole in
    one chained search; where the layers do not chain, or the step's peak held that plan back by
    more than 2^-8 of the step, it also searches each mode for every layer alike and keeps the
    fastest plan (``search.recompute_modes``; ``planner.recompute_modes``).  Past
    ``search_budget_s`` the peak loop keeps the fastest plan that fits so far, and the
    recomputation modes not yet searched are not.
    """
    given, hint_options = PlanOptions.from_keywords(locals()), HintOptions.from_keywords(locals())
    hinted = hint_options if hint_options.given else None
    plan = search_context(ctx, given, hinted, compare_families=compare_families, progress=progress)
    return with_throughput(plan, ctx.graph)
