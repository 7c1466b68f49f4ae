"""The fidelity benchmark as data: which models, meshes and plan variants ``autopar fidelity`` measures.

``load_benchmark(path=None)`` reads ``configs/benchmarks/fidelity.toml`` (or a file
of the same schema) into a frozen ``Benchmark``; ``Variant.plan_options`` turns one
plan variant into the keywords of ``autopar.plan_from_context``.  The file's
header documents the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.cost import SCHEDULES
from autopar.models import config_dir, tomllib
from autopar.planner import FAMILIES

__all__ = ["BenchModel", "Variant", "Benchmark", "load_benchmark", "mesh_axis_names"]


@dataclass(frozen=True, slots=True)
class BenchModel:
    """A built-in model (``autopar.models``) at one global batch and sequence, and its poor hint."""

    name: str
    batch: int
    seq: int
    poor_hint: dict[str, Any]
    overrides: dict[str, Any] | None = None  # config keyword arguments (a tiny architecture at benchmark size)


@dataclass(frozen=True, slots=True)
class Variant:
    """One way to plan: ``auto``, ``family:<name>``, ``no state sharding``, ``cap:<fraction>``, ``poor hint``,
    ``recompute:<none|selective|full>`` (activation recomputation forced in every layer),
    ``pipeline:<axis>/<schedule>/m<N>`` (a pipeline forced on that mesh axis, N micro-batches),
    ``pipeline:auto`` (the search's plan with ``pipeline="auto"``: a pipeline where it is priced faster), or
    ``microbatches:<N>`` (no pipeline, N micro-batches accumulated per step)."""

    label: str

    @property
    def pipeline(self) -> dict[str, Any] | None:
        """The ``pipeline``, ``schedule`` and ``microbatches`` keywords of a pipeline variant, else None."""
        if not _pipeline_label(self.label):
            return None
        axis, schedule, m = self.label.removeprefix("pipeline:").split("/")
        return {"pipeline": axis, "schedule": schedule, "microbatches": int(m.removeprefix("m"))}

    @property
    def micro_batched(self) -> bool:
        """Whether this variant may plan micro-batches (a pipeline, or accumulation): planned by ``autopar.plan``,
        which captures the model at the micro-batch, not on a context prepared for the whole batch."""
        return self.label == PIPELINE_AUTO or self.pipeline is not None or self.microbatches is not None

    @property
    def microbatches(self) -> int | None:
        """N of an accumulation variant (``microbatches:<N>``), else None."""
        return int(self.label.removeprefix("microbatches:")) if _accumulation_label(self.label) else None

    @property
    def cap_fraction(self) -> float | None:
        """Where this variant's cap lies between the least memory any plan needs (0) and the auto plan's (1)."""
        return float(self.label.removeprefix("cap:")) if self.label.startswith("cap:") else None

    def plan_options(self, model: BenchModel, auto_bytes: float, least_bytes: float = 0.0) -> dict[str, Any]:
        """Keywords of ``plan_from_context`` for this variant.

        ``auto_bytes``: the auto plan's per-device peak; ``least_bytes``: the least any
        plan reaches (a cap between the two always has a plan, and binds).
        """
        if self.label == "auto":
            return {}
        if self.label.startswith("family:"):
            return {"family": self.label.removeprefix("family:")}
        if self.label == "no state sharding":
            return {"allow_state_sharding": False}
        if self.cap_fraction is not None:
            return {"mem_cap": int(least_bytes + self.cap_fraction * (auto_bytes - least_bytes))}
        if self.label == "poor hint":
            return {"hints": dict(model.poor_hint)}
        if self.label == PIPELINE_AUTO:
            return {"pipeline": "auto"}
        if self.label.startswith("recompute:"):
            return {"recompute": self.label.removeprefix("recompute:")}
        if self.pipeline is not None:
            return dict(self.pipeline)
        if self.microbatches is not None:
            return {"pipeline": "none", "microbatches": self.microbatches}
        raise AssertionError(f"variant {self.label!r} passed validation but has no options")

    def validate(self, where: str) -> None:
        ok = (
            self.label in ("auto", "no state sharding", "poor hint", PIPELINE_AUTO)
            or (self.label.startswith("family:") and self.label.removeprefix("family:") in FAMILIES)
            or (self.label.startswith("cap:") and _fraction(self.label.removeprefix("cap:")))
            or (self.label.startswith("recompute:") and self.label.removeprefix("recompute:") in _FORCED_RECOMPUTE)
            or _pipeline_label(self.label)
            or _accumulation_label(self.label)
        )
        if not ok:
            raise ValueError(
                f"{where}: variant {self.label!r} is not one of 'auto', 'family:<{' | '.join(FAMILIES)}>', "
                "'no state sharding', 'cap:<fraction in [0, 1]>', 'poor hint', "
                f"'recompute:<{' | '.join(_FORCED_RECOMPUTE)}>', 'pipeline:<axis>/<{' | '.join(SCHEDULES)}>/m<N>', "
                "'pipeline:auto', "
                "'microbatches:<N>'; "
                "fix the variants list"
            )


_FORCED_RECOMPUTE = ("none", "selective", "full")
#: The variant planned as ``auto`` with ``pipeline="auto"`` (``fidelity`` reports it against the fastest).
PIPELINE_AUTO = "pipeline:auto"


def _pipeline_label(label: str) -> bool:
    parts = label.removeprefix("pipeline:").split("/") if label.startswith("pipeline:") else []
    return len(parts) == 3 and parts[1] in SCHEDULES and parts[2].startswith("m") and parts[2][1:].isdigit()


def _accumulation_label(label: str) -> bool:
    count = label.removeprefix("microbatches:")
    return label.startswith("microbatches:") and count.isdigit() and int(count) >= 1


def _fraction(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return 0 <= value <= 1


@dataclass(frozen=True, slots=True)
class Benchmark:
    """Models x meshes x variants, and how each plan is timed (see configs/benchmarks/fidelity.toml)."""

    models: tuple[BenchModel, ...]
    meshes: tuple[tuple[int, ...], ...]
    variants: tuple[Variant, ...]
    warmup_steps: int
    rounds: int
    steps_per_round: int
    source: str
    memory_steps: int = 3  # steps whose peak memory is measured per plan (the median is the plan's)
    contest_rounds: int = 0  # more rounds for the plans near the fastest and the search's own (measure.fidelity)
    contest_margin: float = 0.25  # "near": a median within this fraction of the fastest's

    def only(self, models: list[str] | None = None, meshes: list[tuple[int, ...]] | None = None) -> Benchmark:
        """The benchmark restricted to some of its models and meshes (a quick check of one case)."""
        from dataclasses import replace

        picked = tuple(m for m in self.models if not models or m.name in models)
        unknown = sorted(set(models or ()) - {m.name for m in self.models})
        if unknown:
            raise ValueError(
                f"--models {unknown}: not in the benchmark ({self.source}); its models are "
                f"{[m.name for m in self.models]}"
            )
        return replace(self, models=picked, meshes=tuple(meshes) if meshes else self.meshes)


def mesh_axis_names(shape: tuple[int, ...]) -> tuple[str, ...]:
    """The benchmark's axis names: ("tp",) for a 1-D mesh, ("dp", "tp") for 2-D, ("pp", "dp", "tp")..."""
    names = ("dp", "tp") if len(shape) == 2 else ("tp",) if len(shape) == 1 else None
    return names or tuple(f"axis{i}" for i in range(len(shape)))


def load_benchmark(path: str | Path | None = None) -> Benchmark:
    """The benchmark of ``path`` (default ``configs/benchmarks/fidelity.toml``); ValueError naming a bad key."""
    file = Path(path) if path is not None else config_dir() / "benchmarks" / "fidelity.toml"
    if not file.is_file():
        raise ValueError(f"fidelity benchmark {file}: no such file; pass a TOML file of the schema of fidelity.toml")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"fidelity benchmark {file}: not valid TOML ({e}); fix the file's syntax") from e
    where = f"fidelity benchmark {file}"
    try:
        models = tuple(
            BenchModel(
                str(m["name"]),
                int(m["batch"]),
                int(m["seq"]),
                dict(m.get("poor_hint", {})),
                dict(m["overrides"]) if "overrides" in m else None,
            )
            for m in data["models"]
        )
        meshes = tuple(tuple(int(s) for s in shape) for shape in data["meshes"])
        variants = tuple(Variant(str(v)) for v in data["variants"])
        bench = Benchmark(
            models,
            meshes,
            variants,
            int(data.get("warmup_steps", 2)),
            int(data.get("rounds", 5)),
            int(data.get("steps_per_round", 2)),
            str(file),
            int(data.get("memory_steps", 3)),
            int(data.get("contest_rounds", 0)),
            float(data.get("contest_margin", 0.25)),
        )
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e}; see the header of configs/benchmarks/fidelity.toml") from None
    for v in variants:
        v.validate(where)
    if "auto" not in {v.label for v in variants}:
        raise ValueError(f"{where}: the variants must include 'auto' (the plan every other is compared with)")
    if (
        any(m.batch < 1 or m.seq < 1 for m in models)
        or min(bench.rounds, bench.steps_per_round, bench.memory_steps) < 1
        or bench.contest_rounds < 0
        or bench.contest_margin < 0
    ):
        raise ValueError(
            f"{where}: batch, seq, rounds, steps_per_round and memory_steps must be >= 1, contest_rounds and "
            "contest_margin >= 0"
        )
    return bench
