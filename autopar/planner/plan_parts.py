"""The parts of a ``Plan``: small immutable values with named fields, and their JSON.

A plan is what to run (``ParamPlacement``, ``InputPlacement``, ``NodePlacement`` per graph
value, placements as ``autopar.placement`` values), what it costs (``PlanCost``,
``PlanMemory``, one ``Collective`` per collective of the step), how it was found
(``SearchStats``, ``FamilyAlternative`` per plan family compared, ``RecomputeTrial`` per
recompute mode searched) and what it was made for (``PlanSettings``, ``PlanHints``).
Times are in seconds (``_s``) or picoseconds (``_ps``, the search's integer unit), sizes
in bytes (``_bytes``).

The JSON of a part is its fields by name (``to_json_value``; placements printed, ``S(0)``),
a field whose default is "nothing" (``None``, ``False``, empty) left out while it holds
it; ``from_json_value`` reads it back against the field types, naming the field
(``memory.per_device_bytes``) of any value of the wrong type.  ``autopar.planner.schema``
versions the whole.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple

from autopar.placement import Partial, Placement, Replicate, Shard, parse_placement

__all__ = [
    "Candidate",
    "Collective",
    "FallbackOp",
    "FamilyAlternative",
    "InputPlacement",
    "MeshCandidate",
    "NodeCharge",
    "NodePlacement",
    "OpHints",
    "ParamPlacement",
    "PlanCost",
    "PlanHints",
    "PlanMemory",
    "PipelinePlan",
    "PlanSettings",
    "PlanThroughput",
    "Placements",
    "StagePart",
    "RecomputeLayers",
    "RecomputeTrial",
    "SearchStats",
    "from_json_value",
    "hints_of",
    "to_json_value",
]

#: One placement per mesh axis (``(Shard(0), Replicate())``, printed ``S(0),R``).
Placements = tuple[Placement, ...]


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """What the plan was made for: the device profile, precision, optimizer, gradient bucket, cap and search."""

    profile: str
    dtype: str
    optimizer: str
    grad_bucket_bytes: int | None  # the runtime's gradient bucket (None: none)
    mem_cap_bytes: int | None  # None: no cap
    solver: str = "dp"
    recompute: str = "auto"  # what was asked (``RECOMPUTE_OPTIONS``); ``SearchStats.recompute_mode``: what it does
    devices_per_node: int | None = None  # None: the profile's node


@dataclass(frozen=True, slots=True)
class ParamPlacement:
    """A parameter's storage: its placement, the placement of its gradient and optimizer state (ZeRO where they
    differ), its shape and this rank's (coordinate 0's) piece of it.  ``partial_grad_axes``: the axes where its
    uses' partial gradients are summed before one reduction (``SourceStrategy`` in ``strategies.candidates``)."""

    placements: Placements
    state_placements: Placements
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    tied_to: tuple[str, ...]  # the other names of a tied parameter
    partial_grad_axes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class InputPlacement:
    """A graph input or buffer: its placement and shape; ``path`` is how the call names an input
    (``batch['ids']``, ``rest[0]``)."""

    placements: Placements
    shape: tuple[int, ...]
    kind: str = "input"  # or "buffer"
    path: str | None = None


@dataclass(frozen=True, slots=True)
class NodePlacement:
    """An op node: the placements it reads and writes, the kernel per mesh axis (None: the op itself), whether
    it fell back to running replicated (no rule), the axes where its backward runs on ``P(sum)`` gradients, and
    the region (a repeated block, ``model.layers.3``) it is recomputed with in backward."""

    op: str
    module: str
    inputs: tuple[Placements, ...]
    outputs: tuple[Placements, ...]
    kernels: tuple[str | None, ...]
    fallback: bool
    partial_grad_axes: tuple[str, ...] = ()
    recompute: str | None = None


@dataclass(frozen=True, slots=True)
class FallbackOp:
    """An op with no sharding rule, run replicated."""

    node: str
    op: str
    module: str


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of the step.  ``time_s`` is what it adds to the step (its exposed time) and ``hidden_s``
    the part that overlaps backward compute (parameter-gradient reductions), so ``time_s + hidden_s`` is its
    whole ring time.  ``phase``: ``forward``, ``backward`` or ``optimizer`` (the all-gather of updated parameters
    after a ZeRO-sharded step).  ``recompute``: a forward collective of a recomputed block run again in
    backward; ``output``: a model output gathered whole onto every rank."""

    kind: str
    axis: str
    phase: str
    bytes: int
    node: str
    module: str
    tensor: str
    reduce_op: str
    time_s: float
    hidden_s: float = 0.0
    recompute: bool = False
    output: bool = False


@dataclass(frozen=True, slots=True)
class PlanCost:
    """The step time: compute (ops and the optimizer step) plus exposed communication; ``terms`` splits it by
    what it is spent on (``ops (forward + backward)``, ``optimizer step``, ``all_gather (forward)``, ...)."""

    compute_s: float
    comm_s: float
    total_s: float
    terms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanMemory:
    """Memory per device: the step's peak (``per_device_bytes``, reached in ``peak_phase`` with
    ``transient_bytes`` of buffers alive then, ``autopar.cost.peak``), the state and saved activations it holds,
    and the additive bound the search kept under the cap (``search_bytes``)."""

    per_device_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    cap_bytes: int | None
    search_bytes: int | None = None
    transient_bytes: int | None = None
    peak_phase: str | None = None


@dataclass(frozen=True, slots=True)
class PlanThroughput:
    """The step's model FLOPs (``cost.model_flops``: ``6 x parameters x tokens + attention``) and what the
    predicted step makes of them: model FLOP/s per device and MFU, their share of ``peak_flops`` (the device's
    dense peak for the compute dtype).  ``with_recompute_flops``: plus the forwards recomputation runs again
    (what the hardware does, HFU; not model FLOPs)."""

    model_flops: float
    with_recompute_flops: float
    parameters: int
    tokens: int
    attention_flops: float
    peak_flops: float
    flops_per_device_s: float
    mfu: float

    def at_step(self, step_s: float, devices: int) -> PlanThroughput:
        """These model FLOPs over a step of ``step_s`` seconds on ``devices`` devices (a measured step, another
        plan's): the FLOP/s per device and the MFU that step makes of them."""
        per_device = self.model_flops / step_s / devices if step_s > 0 else 0.0
        return dataclasses.replace(self, flops_per_device_s=per_device, mfu=per_device / self.peak_flops)


class NodeCharge(NamedTuple):
    """What the search charged one graph node (``Plan.node_costs``, ``planner.assemble.node_costs``): ``ps`` its
    time with the moves into it, ``nbytes`` its memory with theirs, and ``own_ps`` the node's own part of ``ps``
    (an op's forward and backward, a parameter's optimizer step: compute, no moves), and ``transient_bytes`` what
    it holds for a moment beyond ``nbytes`` (an op, its backward's working set; a parameter, its gradient's bytes
    in the buckets' flat copy: ``planner.assemble.Breakdown.transient_at``)."""

    ps: int
    nbytes: int
    own_ps: int
    transient_bytes: int = 0


@dataclass(frozen=True, slots=True)
class StagePart:
    """One stage of a pipelined plan: the layers it runs (positions ``[first_layer, stop_layer)`` in the model's
    chain of layers, ``planner.pipeline_planning.chain_layers``, named in ``layers``; the first stage also runs
    the ops before the first layer, the last those after the last), its forward and backward time for one
    micro-batch and the memory of its rank (state plus the activations of the micro-batches it holds)."""

    first_layer: int
    stop_layer: int
    layers: str = ""
    time_s: float = 0.0
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One micro-batched candidate a ``pipeline="auto"`` plan was chosen among (``planner.pipeline_choice``):
    what it is (``no pipeline``, ``pipeline pp, 1f1b, 8 micro-batches``), its step (None: it did not fit the
    cap, or was not searched to its plan) and its memory per device (where it did not fit: the least it needs;
    None: not searched to a plan).  ``at_least_s``: a candidate not searched to its plan because a bound proved
    its step at least this, slower than a candidate already priced; ``note``: why a candidate was not priced at all
    (a GPipe run 1F1B dominates, ``pipeline_planning.dominated_runs``)."""

    what: str
    step_s: float | None
    memory_bytes: int | None
    at_least_s: float | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class MeshCandidate:
    """One logical mesh a plan for a device count was chosen among (``planner.mesh_choice``): its shape and
    axis names; its plan's step, memory per device, model FLOP/s per device and MFU, and the plan in a few words
    (step None: it did not fit, memory then the least it needs; or its search stopped at ``at_least_s``, a bound
    slower than a mesh already planned); ``note``: why it lost, or ``chosen``; ``planning_s``: the seconds planning
    it took, ``new_captures``: the captures of the model it made (0: every micro-batch size it needed had been
    captured for a mesh planned before)."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    step_s: float | None
    memory_bytes: int | None
    at_least_s: float | None = None
    flops_per_device_s: float | None = None
    mfu: float | None = None
    plan: str = ""
    note: str = ""
    planning_s: float = 0.0
    new_captures: int = 0


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The pipeline of a plan: the mesh axis it runs along, the schedule (``autopar.cost.pipeline``), the stages
    in pipeline order (stage ``j`` runs on the axis coordinate ``j mod p``: ``virtual`` stages per rank), and the
    predicted bubble: the fraction of the step a rank idles (the micro-batches are ``Plan.microbatches``)."""

    axis: str
    schedule: str
    stages: tuple[StagePart, ...]
    virtual: int = 1
    bubble_fraction: float = 0.0


@dataclass(frozen=True, slots=True)
class FamilyAlternative:
    """The fastest plan of one family (``FAMILIES``) under the same cap, or why it has none: the least memory
    its plans reach (``proven`` False where an approximate search found it) or ``why`` it has no plan at all."""

    family: str
    feasible: bool
    total_s: float | None
    compute_s: float | None
    comm_s: float | None
    per_device_bytes: int | None
    terms: dict[str, float] = field(default_factory=dict)
    proven: bool | None = None
    min_per_device_bytes: int | None = None
    why: str | None = None

    @classmethod
    def fitting(cls, family: str, cost: PlanCost, memory: PlanMemory) -> FamilyAlternative:
        return cls(family, True, cost.total_s, cost.compute_s, cost.comm_s, memory.per_device_bytes, cost.terms)

    @classmethod
    def no_plan(
        cls, family: str, *, min_per_device_bytes: int | None = None, proven: bool = True, why: str | None = None
    ) -> FamilyAlternative:
        return cls(family, False, None, None, None, None, {}, proven, min_per_device_bytes, why)


@dataclass(frozen=True, slots=True)
class RecomputeTrial:
    """One recompute mode searched under the cap: its plan's step and memory (``feasible``), the least memory
    its plans reach (not ``feasible``), or, not searched (``feasible`` None), the bound that proved it slower
    (``at_least_s``) or why it was ``skipped``."""

    recompute: str  # the mode: none, selective, full, per layer
    feasible: bool | None
    total_s: float | None = None
    per_device_bytes: int | None = None
    min_per_device_bytes: int | None = None
    at_least_s: float | None = None
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class RecomputeLayers:
    """How many repeated layers recompute nothing, selectively, or whole."""

    none: int = 0
    selective: int = 0
    full: int = 0


@dataclass(frozen=True, slots=True)
class SearchStats:
    """How the plan was found.  ``objective_ps``: the step time the search minimized.  ``gap`` (with
    ``lower_bound_ps``): how far from the optimum the plan is proven, when the search stopped once within
    ``planner.solving.PLAN_GAP`` or was too wide to search exactly (``approximate``, ``why``:
    ``search/minibucket.py``).  ``peak_searches``: the searches the step's peak needed (> 1: the peak held the
    plan back; ``peak_lower_ps`` bounds every plan under the cap).  ``budget_hit``: the search stopped at its
    ``budget_s``.  ``kept_family_plan``: a forced family's plan was faster and kept.  ``recompute_mode`` (one
    mode or ``per layer``), ``recompute_layers``, ``recompute_rest`` (regions outside the layers) and
    ``recompute_modes`` (each mode searched) say what backward recomputes."""

    solver: str
    optimal: bool
    objective_ps: int
    objective_s: float
    num_nodes: int
    num_choices: int
    approximate: bool = False
    why: str | None = None
    lower_bound_ps: int | None = None
    gap: float | None = None
    peak_searches: int = 1
    peak_lower_ps: int | None = None
    budget_hit: bool = False
    budget_s: float | None = None
    kept_family_plan: bool = False
    recompute_mode: str | None = None
    recompute_layers: RecomputeLayers | None = None
    recompute_rest: tuple[str, ...] = ()
    recompute_modes: tuple[RecomputeTrial, ...] = ()

    @property
    def least_objective_ps(self) -> int | None:
        """The least objective of any plan under the search's bound: the plan's own where the search was exact,
        else the lower bound it proved (None: none proved)."""
        return self.objective_ps if self.optimal else self.lower_bound_ps


@dataclass(frozen=True, slots=True)
class OpHints:
    """The placements hints fixed for one op's inputs and outputs, by position."""

    inputs: dict[int, Placements] = field(default_factory=dict)
    outputs: dict[int, Placements] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanHints:
    """The hints a plan was made under, normalized (``autopar.planner.hints``): placements per parameter, input
    and op, the module patterns kept replicated and the blocks recompute hints name."""

    params: dict[str, Placements] = field(default_factory=dict)
    inputs: dict[str, Placements] = field(default_factory=dict)
    ops: dict[str, OpHints] = field(default_factory=dict)
    replicate: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()


def hints_of(record: typing.Mapping[str, Any]) -> PlanHints | None:
    """The ``PlanHints`` of a resolved-hints record (``ResolvedHints.record``, the JSON form); None when empty."""
    return from_json_value(PlanHints, dict(record), "hints") if record else None


# ---- JSON ------------------------------------------------------------------------------------------------------
_PLACEMENT_TYPES = (Shard, Replicate, Partial)


def to_json_value(value: Any) -> Any:
    """``value`` as JSON data: a part as its fields by name (those holding a "nothing" default left out), a
    placement printed, tuples as lists."""
    if isinstance(value, _PLACEMENT_TYPES):
        return str(value)
    if is_dataclass(value):
        return {f.name: to_json_value(v) for f in fields(value) if not _left_out(f, v := getattr(value, f.name))}
    if isinstance(value, (tuple, list)):
        return [to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    return value


def _left_out(f, value: Any) -> bool:
    """Whether field ``f`` holding ``value`` is left out of the JSON: it holds its default, and that is "nothing"."""
    if f.default_factory is not MISSING:
        return not value
    return (f.default is None or f.default is False or f.default == ()) and value == f.default


def from_json_value(tp: Any, value: Any, where: str, *, strict: bool = True) -> Any:
    """``value`` (JSON data) read as type ``tp``; ``where`` names it in errors (``memory.per_device_bytes``).
    ``strict=False`` ignores keys no field has (a plan of an older version may carry some)."""
    try:
        return _decoder(tp, strict)(value)
    except _Wrong as e:
        raise ValueError(f"{where}{''.join(reversed(e.path))}: {e}") from None


class _Wrong(Exception):
    """A value of the wrong shape; ``path`` gathers the keys above it, innermost first, as it unwinds."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.path: list[str] = []


@functools.cache
def _decoder(tp: Any, strict: bool) -> Callable[[Any], Any]:
    """The function that reads JSON data as ``tp`` (made once per type: plans hold thousands of parts)."""
    if tp == Placement:
        return _placement
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        read = _decoder(inner, strict)
        return lambda v: None if v is None else read(v)
    if origin is tuple:
        return _tuple_decoder(_decoder(typing.get_args(tp)[0], strict))
    if origin is dict:
        key_type, item = typing.get_args(tp)
        return _dict_decoder(key_type, _decoder(item, strict))
    if is_dataclass(tp):
        return _part_decoder(tp, strict)
    return functools.partial(_scalar, tp)


def _placement(value: Any) -> Placement:
    if not isinstance(value, str):
        raise _Wrong(_expected("a placement string ('R', 'S(0)', 'P(sum)')", value))
    try:
        return parse_placement(value)
    except ValueError as e:
        raise _Wrong(str(e)) from None


def _tuple_decoder(read: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    def tuple_of(value: Any) -> tuple:
        if not isinstance(value, list):
            raise _Wrong(_expected("a list", value))
        out = []
        for i, v in enumerate(value):
            try:
                out.append(read(v))
            except _Wrong as e:
                e.path.append(f"[{i}]")
                raise
        return tuple(out)

    return tuple_of


def _dict_decoder(key_type: type, read: Callable[[Any], Any]) -> Callable[[Any], dict]:
    def dict_of(value: Any) -> dict:
        if not isinstance(value, dict):
            raise _Wrong(_expected("an object", value))
        out = {}
        for k, v in value.items():
            try:
                out[_key(key_type, k)] = read(v)
            except _Wrong as e:
                e.path.append(f".{k}")
                raise
        return out

    return dict_of


def _part_decoder(cls: type, strict: bool) -> Callable[[Any], Any]:
    reads = {k: _decoder(t, strict) for k, t in typing.get_type_hints(cls).items()}
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]

    def part(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _Wrong(_expected("an object", value))
        unknown = sorted(set(value) - set(reads))
        if unknown and strict:
            raise _Wrong(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
        missing = [k for k in required if k not in value]
        if missing:
            raise _Wrong(f"missing key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        out = {}
        for k, v in value.items():
            if k in reads:
                try:
                    out[k] = reads[k](v)
                except _Wrong as e:
                    e.path.append(f".{k}")
                    raise
        return cls(**out)

    return part


_SCALARS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _scalar(tp: Any, value: Any) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise _Wrong(_expected(_SCALARS.get(tp, f"a {getattr(tp, '__name__', tp)}"), value))


def _key(key_type: type, key: str) -> Any:
    if key_type is int:
        try:
            return int(key)
        except ValueError:
            raise _Wrong(f"key {key!r} is not a position (an integer)") from None
    return key


def _expected(what: str, value: Any) -> str:
    return f"expected {what}, got {type(value).__name__} {value!r:.60}"
