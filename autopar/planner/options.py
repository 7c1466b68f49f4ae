"""The planning options: one frozen value per concern, and the one table of the keywords that build them.

``PLAN_KEYWORDS`` is the single source of the planning keywords: ``autopar.plan``, ``prepare``,
``plan_from_context`` and ``compile`` each take every one of them as an explicit keyword-only
parameter of the table's name and default (users read them in an editor;
``tests/test_options.py`` compares the signatures with the table), and ``autopar plan`` takes
the table's flag for each, with the same default.  Each entry point builds the options objects
once, at its top (``PlanOptions.from_keywords``, ``HintOptions.from_keywords``), and the
planner's internals take the objects:

* ``PlanOptions``, what to plan for: what the costs are priced with (``concern == "price"``:
  profile, precision, optimizer, gradient buckets, ranks per node; fixed when the model is
  prepared) and how the search runs (``"search"``: the cap, solver, recomputation, family,
  state sharding, time budget);
* ``HintOptions``, what the user fixed (``"hints"``; the forms in ``autopar.planner.hints``).

Three defaults are left to the model and the job, filled in by ``PlanOptions.resolved`` where
the model is prepared:

* ``profile=None``: the device the training steps run on, as the tools that price plans do
  (meta-pytorch/autoparallel and DeepSpeed's autotuner measure the accelerator they run on).
  Inside a process group (``compile`` always) its device: a CUDA GPU by name (``device_profile``:
  H100/H200 ``h100``, others ``a100``), gloo CPU ranks ``cpu``.  Outside one, the model's device
  when it is a GPU; a model on ``meta`` or the CPU is not on its accelerator yet, so it is
  planned ahead for the common one, ``h100``.
* ``dtype=None``: the precision of the model's parameters (``training_precision``).
* ``devices_per_node=None``: torchrun's ``LOCAL_WORLD_SIZE`` when the job spans nodes, else the
  profile's node (``autopar.runtime.ranks_per_node``).

``plan_from_context`` starts from the options its context was prepared with: a keyword left at
its default keeps the context's value (``PlanOptions.updated_by``), and a priced one given
anew prices the captured graph again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from autopar.cost import SCHEDULES
from autopar.runtime import DEFAULT_BUCKET_BYTES, ranks_per_node
from autopar.units import parse_bytes
from costmodel import load_profile, optimizer_spec, precision

from .recompute_tables import RECOMPUTE_OPTIONS
from .schema import FAMILIES

__all__ = [
    "HintOptions",
    "Keyword",
    "OptionError",
    "PLAN_KEYWORDS",
    "PlanOptions",
    "SEARCH_BUDGET_S",
    "SCHEDULES",
    "SOLVERS",
    "device_profile",
    "job_profile",
    "training_precision",
]

log = logging.getLogger(__name__)

#: The default wall-clock budget of a plan's search (``plan(search_budget_s=...)``): past it the planner returns
#: the fastest plan it has met with the bound it proved.  Measured over ``scripts/sweep_search.py``'s 50
#: configurations the slowest search took 16 s, so the budget is a guard for shapes nobody has tried, not a
#: setting that changes ordinary plans.
SEARCH_BUDGET_S = 30.0
#: The searches a plan can be solved with: exact dynamic programming, or the CP-SAT model (the tests' referee).
SOLVERS = ("dp", "ilp")


@dataclass(frozen=True, slots=True)
class Keyword:
    """One planning keyword: its name and default, a one-line doc, the concern it belongs to (``"price"``,
    ``"search"``: a ``PlanOptions`` field; ``"hints"``: a ``HintOptions`` field) and the ``autopar plan`` flag
    that sets it (None: the API only), which puts its value in ``args.<name>`` (``--hints``: a file of hints)."""

    name: str
    default: Any
    doc: str
    concern: str
    flag: str | None = None


_KEYWORDS = (
    Keyword(
        "mem_cap",
        None,
        "per-device memory cap: bytes or a string with units ('40GiB'); None: no cap",
        "search",
        "--mem-cap",
    ),
    Keyword(
        "profile",
        None,
        "device profile: a name in configs/devices or a .toml path; None: the job's device",
        "price",
        "--profile",
    ),
    Keyword(
        "dtype",
        None,
        "training precision: 'fp32', 'bf16' (mixed) or 'bf16-pure'; None: the parameters'",
        "price",
        "--dtype",
    ),
    Keyword(
        "optimizer",
        "adamw",
        "the optimizer whose state the plan's memory counts (costmodel.OPTIMIZERS)",
        "price",
        "--optimizer",
    ),
    Keyword(
        "grad_bucket_bytes",
        DEFAULT_BUCKET_BYTES,
        "the runtime's data-parallel gradient bucket; None or 0: none",
        "price",
        "--grad-bucket-bytes",
    ),
    Keyword(
        "devices_per_node",
        None,
        "the job's ranks per node; None: torchrun's across nodes, else the profile's",
        "price",
        "--devices-per-node",
    ),
    Keyword("solver", "dp", "'dp' (exact dynamic programming) or 'ilp' (CP-SAT)", "search", "--solver"),
    Keyword(
        "recompute", "auto", "what backward recomputes: 'auto', 'none', 'selective' or 'full'", "search", "--recompute"
    ),
    Keyword("family", None, "force one plan family (FAMILIES); None: any plan", "search", "--family"),
    Keyword(
        "allow_state_sharding",
        True,
        "gradients and optimizer state may be sharded beyond their parameter (ZeRO-1/2)",
        "search",
        "--no-state-sharding",
    ),
    Keyword(
        "search_budget_s",
        SEARCH_BUDGET_S,
        "the search's wall-clock budget in seconds; None: no budget",
        "search",
        "--search-budget",
    ),
    Keyword(
        "pipeline",
        "none",
        "the mesh axis that carries a pipeline of stages: an axis name, 'auto' (the search chooses) or 'none'",
        "search",
        "--pipeline",
    ),
    Keyword(
        "microbatches",
        "auto",
        "micro-batches per step, the batch split evenly: an int, or 'auto'",
        "search",
        "--microbatches",
    ),
    Keyword(
        "schedule", "auto", "the pipeline schedule: " + ", ".join(SCHEDULES) + ", or 'auto'", "search", "--schedule"
    ),
    Keyword(
        "virtual_stages",
        "auto",
        "stages per rank of the interleaved schedule: an int >= 2, or 'auto' (2, 4, 8, ...)",
        "search",
        "--virtual-stages",
    ),
    Keyword(
        "hints",
        None,
        "pattern -> placements, 'replicate', 'recompute' or a matmul strategy (planner.hints)",
        "hints",
        "--hints",
    ),
    Keyword("input_placements", None, "placements of the graph inputs, by name or position", "hints"),
    Keyword("output_placements", None, "placements of the graph outputs, by position", "hints"),
    Keyword(
        "strict", False, "a hint pattern that matches nothing raises instead of warning", "hints", "--strict-hints"
    ),
)
#: The planning keywords, by name, in the order the entry points list them.
PLAN_KEYWORDS: dict[str, Keyword] = {k.name: k for k in _KEYWORDS}


def _default(name: str) -> Any:
    return PLAN_KEYWORDS[name].default


class OptionError(ValueError):
    """A planning option with a value it cannot take: names the option, the value given, what was expected, the fix.

    ``option``, ``value`` and ``problem`` let the CLI say it in its flags' words."""

    def __init__(self, option: str, value: Any, problem: str, fix: str = "") -> None:
        self.option, self.value, self.problem = option, value, problem
        super().__init__(f"{option} {value!r}: {problem}" + (f". Fix: {fix}" if fix else ""))


def _one_of(option: str, value: Any, choices, fix: str) -> None:
    if value not in choices:
        raise OptionError(option, value, f"expected one of {tuple(choices)}", fix)


def _whole(option: str, value: Any, least: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{option} {value!r}: expected an int >= {least}, got a {type(value).__name__}. Fix: {fix}")
    if value < least:
        raise OptionError(option, value, f"expected an int >= {least}", fix)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """What to plan for: the ``"price"`` and ``"search"`` rows of ``PLAN_KEYWORDS`` (their docs there), checked
    here.  ``mem_cap`` is kept in bytes (a string with units is read once, here); ``profile``, ``dtype`` and
    ``devices_per_node`` may be None until ``resolved`` fills them in for a model (the module docstring)."""

    mem_cap: int | str | None = _default("mem_cap")  # bytes once checked
    profile: str | None = _default("profile")
    dtype: str | None = _default("dtype")
    optimizer: str = _default("optimizer")
    grad_bucket_bytes: int | None = _default("grad_bucket_bytes")
    devices_per_node: int | None = _default("devices_per_node")
    solver: str = _default("solver")
    recompute: str = _default("recompute")
    family: str | None = _default("family")
    allow_state_sharding: bool = _default("allow_state_sharding")
    search_budget_s: float | None = _default("search_budget_s")
    pipeline: str = _default("pipeline")
    microbatches: int | str = _default("microbatches")
    schedule: str = _default("schedule")
    virtual_stages: int | str = _default("virtual_stages")

    def __post_init__(self) -> None:
        if self.mem_cap is not None:
            try:
                object.__setattr__(self, "mem_cap", parse_bytes(self.mem_cap))
            except TypeError as e:
                raise TypeError(f"mem_cap {self.mem_cap!r}: {e}") from None
            except ValueError as e:
                raise OptionError(
                    "mem_cap", self.mem_cap, str(e), "pass bytes (an int) or a size like '40GiB', or None for no cap"
                ) from None
        self._check_priced()
        _one_of("solver", self.solver, SOLVERS, "pass 'dp' (dynamic programming) or 'ilp' (CP-SAT)")
        _one_of(
            "recompute", self.recompute, RECOMPUTE_OPTIONS, "pass one of those; 'auto' lets the search choose per layer"
        )
        if self.family is not None:
            _one_of("family", self.family, FAMILIES, "pass one of those names, or None to let the search choose")
        if not isinstance(self.allow_state_sharding, bool):
            raise TypeError(f"allow_state_sharding {self.allow_state_sharding!r}: expected True or False")
        budget = self.search_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise OptionError(
                "search_budget_s",
                budget,
                "expected a positive number of seconds",
                "pass seconds > 0, or None for no budget",
            )
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        if not isinstance(self.pipeline, str) or not self.pipeline:
            raise TypeError(f"pipeline {self.pipeline!r}: expected a mesh axis name (str), 'auto' or 'none'")
        if self.microbatches != "auto":
            _whole("microbatches", self.microbatches, 1, "pass how many micro-batches the batch splits into, or 'auto'")
        _one_of("schedule", self.schedule, (*SCHEDULES, "auto"), "pass one of those pipeline schedules")
        if self.virtual_stages != "auto":
            _whole("virtual_stages", self.virtual_stages, 2, "pass the stages per rank of an interleaved pipeline")
            if self.schedule not in ("interleaved", "auto"):
                raise OptionError(
                    "virtual_stages",
                    self.virtual_stages,
                    f"only the interleaved schedule runs several stages per rank, and schedule is {self.schedule!r}",
                    "pass schedule='interleaved' (or 'auto'), or virtual_stages='auto'",
                )

    @property
    def micro_batched(self) -> bool:
        """Whether the step runs the batch in micro-batches: through a pipeline, or accumulated."""
        return self.pipeline != "none" or self.microbatches not in (1, "auto")

    def _check_priced(self) -> None:
        if self.profile is not None:
            if isinstance(self.profile, os.PathLike):
                object.__setattr__(self, "profile", os.fspath(self.profile))
            if not isinstance(self.profile, str):
                raise TypeError(f"profile {self.profile!r}: expected a profile name or a .toml path (str)")
            try:
                load_profile(self.profile)
            except ValueError as e:
                raise OptionError("profile", self.profile, str(e)) from None
        for name, read, fix in (
            ("dtype", precision, "pass one of those, or None for the precision of the model's parameters"),
            ("optimizer", optimizer_spec, "pass one of those: the optimizer whose state the plan's memory counts"),
        ):
            value = getattr(self, name)
            if value is not None:
                try:
                    read(value)
                except ValueError as e:
                    raise OptionError(name, value, str(e), fix) from None
        if self.grad_bucket_bytes is not None:
            _whole("grad_bucket_bytes", self.grad_bucket_bytes, 0, "pass bytes per bucket, or None or 0 for no buckets")
        if self.devices_per_node is not None:
            _whole(
                "devices_per_node",
                self.devices_per_node,
                1,
                "pass the ranks each node runs (torchrun --nproc-per-node), or None",
            )

    @classmethod
    def from_keywords(cls, values: Mapping[str, Any]) -> PlanOptions:
        """The options of an entry point's keyword arguments (its ``locals()``: one per table row, more ignored)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def resolved(self, model: torch.nn.Module) -> PlanOptions:
        """These options with what None leaves to the model and the job filled in (the module docstring)."""
        return replace(
            self,
            profile=self.profile if self.profile is not None else job_profile(model),
            dtype=self.dtype if self.dtype is not None else training_precision(model),
            devices_per_node=self.devices_per_node if self.devices_per_node is not None else ranks_per_node(),
        )

    def updated_by(self, given: PlanOptions) -> PlanOptions:
        """These options with each field of ``given`` that is not at the table's default (``plan_from_context``
        keeps its context's options where its keywords are left at their defaults)."""
        changed = {f.name: getattr(given, f.name) for f in fields(self) if getattr(given, f.name) != _default(f.name)}
        return replace(self, **changed) if changed else self

    def priced(self) -> tuple:
        """The fields the costs are priced with (the ``"price"`` rows): a context serves the searches whose
        options have the same."""
        return tuple(getattr(self, k.name) for k in _KEYWORDS if k.concern == "price")

    def settings(self) -> dict[str, Any]:
        """The priced fields as the plan records them (``Plan.settings``; ``devices_per_node`` only when set)."""
        out = {
            "profile": self.profile,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "grad_bucket_bytes": self.grad_bucket_bytes,
        }
        if self.devices_per_node is not None:
            out["devices_per_node"] = self.devices_per_node
        return out


@dataclass(frozen=True, slots=True)
class HintOptions:
    """What the user fixed: the ``"hints"`` rows of ``PLAN_KEYWORDS`` (``autopar.planner.hints`` checks the
    forms against the graph: here only that ``hints`` is a mapping and ``strict`` a bool)."""

    hints: Mapping[str, Any] | None = _default("hints")
    input_placements: Any = _default("input_placements")
    output_placements: Any = _default("output_placements")
    strict: bool = _default("strict")

    def __post_init__(self) -> None:
        if self.hints is not None and not isinstance(self.hints, Mapping):
            raise TypeError(
                f"hints {type(self.hints).__name__}: expected a mapping of pattern -> value. "
                'Fix: pass e.g. {"*.mlp.c_fc.weight": ["R", "S(1)"], "transformer.h.0": "replicate"}'
            )
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict {self.strict!r}: expected True or False")

    @classmethod
    def from_keywords(cls, values: Mapping[str, Any]) -> HintOptions:
        """The hint options of an entry point's keyword arguments (as ``PlanOptions.from_keywords``)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @property
    def given(self) -> bool:
        """Whether any hint is given (``strict`` alone fixes nothing)."""
        return not (self.hints is None and self.input_placements is None and self.output_placements is None)


def device_profile(device: torch.device | None) -> str:
    """The profile of the device the steps run on: a CUDA GPU by name (H100/H200: ``h100``, others ``a100``),
    the CPU ``cpu``; None (not known: planned ahead) or ``meta``: ``h100``."""
    if device is None or device.type == "meta":
        return "h100"
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return "h100" if "h100" in name or "h200" in name else "a100"


def job_profile(model: torch.nn.Module) -> str:
    """``profile=None``'s profile: the process group's device, else the model's when it is a GPU (module
    docstring)."""
    if dist.is_available() and dist.is_initialized():
        nccl = "nccl" in str(dist.get_backend())
        return device_profile(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    device = next((t.device for t in model.parameters()), None)
    return device_profile(device if device is not None and device.type == "cuda" else None)


def training_precision(model: torch.nn.Module) -> str:
    """The ``costmodel.PRECISIONS`` name of training ``model`` as it is, from its floating parameters' dtypes.

    All float32 (or none): "fp32"; all bfloat16: "bf16-pure".  Any other mix is
    priced as "fp32" (the larger figures), with a warning naming the dtypes.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        return "bf16-pure"
    if dtypes - {torch.float32}:
        log.warning(
            "%s has %s parameters: the plan prices fp32 training (pass dtype=... to choose)",
            type(model).__name__,
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
        )
    return "fp32"
