"""Device profiles: what one device can compute, hold and send, read from TOML data.

A ``DeviceProfile`` is pure data loaded from ``configs/devices/<name>.toml`` (or any
TOML file of the same schema, e.g. a calibration file measured on the target
machine).  No number lives in this module: every constant sits in the TOML next to
the datasheet or measurement it comes from.  ``profiles_dir()`` finds the profiles:
``$AUTOPAR_CONFIG_DIR/devices``, else ``devices/`` of the package ``autopar.configs``
that the repository's top-level ``configs/`` installs as (``importlib.resources``).

Mesh axes map to links by rank distance (``DeviceProfile.link_for_axis``): the mesh
is row-major with the last axis innermost, so an axis whose ranks all sit inside one
node of ``devices_per_node`` consecutive ranks talks over ``intra_node`` (NVLink),
any other over ``inter_node`` (InfiniBand).
"""

from __future__ import annotations

import importlib.resources
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .fabric import device_link, group_link, group_spread
from .lending import CoreLending
from .toml_compat import tomllib

__all__ = [
    "CollectiveFit",
    "LinkProfile",
    "DeviceProfile",
    "PEAK_FLOPS_KEYS",
    "ATTENTION_SAVES",
    "axis_crosses_nodes",
    "check_devices_per_node",
    "REDUCE_SCATTER",
    "profiles_dir",
    "profile_dict",
    "available_profiles",
    "load_profile",
]

#: The collective kinds a profile may measure and the cost model prices (``comm``).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

log = logging.getLogger(__name__)

#: The dtype keys every profile's ``peak_flops`` table must have (dense, no sparsity).
PEAK_FLOPS_KEYS = ("float32", "bfloat16", "float16")
#: What scaled_dot_product_attention keeps for backward (``DeviceProfile.attention_saves``).
ATTENTION_SAVES = ("traced", "flash")
#: How a backend runs reduce-scatter (``LinkProfile.reduce_scatter``).
REDUCE_SCATTER = ("native", "all_reduce")

_CONFIG_ENV = "AUTOPAR_CONFIG_DIR"
#: The package the top-level configs/ folder installs as (pyproject.toml, [tool.setuptools.package-dir]).
_CONFIG_PACKAGE = "autopar.configs"


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """A measured collective on one link among ``group_size`` ranks.

    ``latency_s`` and ``bandwidth_bytes_per_s`` are the straight line
    ``t = latency_s + factor(n) * nbytes / bandwidth_bytes_per_s`` fitted to the
    measurements (``factor(n)`` the ring bandwidth factor of ``kind``, so the
    bandwidth reads as the bus bandwidth achieved; the latency is the whole fixed
    cost per call).  ``points`` are the measurements themselves, (nbytes, seconds)
    by size: where present, ``time_s`` follows them piece by piece (one latency and
    bandwidth per segment between measured sizes; a larger message never costs
    less), since one line rarely fits both small messages and those past the
    caches.  ``autopar calibrate`` measures both (``autopar.measure``).
    """

    kind: str
    group_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[float, float], ...] = ()

    def time_s(self, nbytes: float, factor: float) -> float:
        """Seconds for ``nbytes`` (the cost model's nbytes of ``kind``); ``factor`` the line's bandwidth factor.

        With points: at or below the smallest measured size, its time (latency-bound);
        between two sizes, the segment between them; past the largest, its last
        segment extended.  Times are taken as a running maximum over sizes.
        """
        if len(self.points) < 2:
            return self.latency_s + factor * nbytes / self.bandwidth_bytes_per_s
        xs = [x for x, _ in self.points]
        ts: list[float] = []
        for _, t in self.points:
            ts.append(max(t, ts[-1]) if ts else t)
        if nbytes <= xs[0]:
            return ts[0]
        i = next((k for k in range(1, len(xs)) if nbytes <= xs[k]), len(xs) - 1)
        slope = (ts[i] - ts[i - 1]) / (xs[i] - xs[i - 1])
        return ts[i - 1] + (nbytes - xs[i - 1]) * slope

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(
                f"collective fit {self.kind} x{self.group_size}: latency_s must be >= 0, got {self.latency_s!r}"
            )
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(
                f"collective fit {self.kind} x{self.group_size}: bandwidth_bytes_per_s must be a positive finite "
                f"number, got {self.bandwidth_bytes_per_s!r}"
            )


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """One interconnect as a ring collective sees it.

    ``bandwidth_bytes_per_s`` is the per-device unidirectional bandwidth a ring
    achieves on the link (NCCL-tests' "bus bandwidth" ceiling); ``latency_s`` is the
    per-step latency (the alpha of the alpha-beta model): a ring all-reduce on ``n``
    ranks pays it ``2(n-1)`` times.  ``source`` says where both numbers come from.
    ``reduce_scatter`` says how the backend runs a reduce-scatter: ``"native"`` (a
    ring reduce-scatter, NCCL) or ``"all_reduce"`` (emulated as an all-reduce of the
    full input plus a local slice, as autopar's runtime does on gloo:
    ``MeshGroups.native_reduce_scatter``); ``costmodel.comm`` prices it as it runs.
    A profile file sets it once, as the top-level key ``reduce_scatter``.
    ``collectives`` are measured fits per kind and group size (``CollectiveFit``,
    the table ``[<link>.collectives.<kind>]`` of a calibrated profile); where one
    covers a collective, ``costmodel.comm`` prices it from the fit instead of the
    ring estimate from ``bandwidth_bytes_per_s`` and ``latency_s``.

    A node's fabric (``inter_node``) may be given as its NICs: ``nics_per_node`` > 0 makes
    ``bandwidth_bytes_per_s`` one NIC's, shared by the node's devices, and ``tree`` says the
    collective library may run an all-reduce as a tree across the nodes (NCCL); a group of a
    mesh axis across nodes then sees the link ``costmodel.fabric.group_link`` derives
    (``DeviceProfile.link_for_axis``), whose ``all_reduce_latency_s`` is the tree's whole latency
    term where it is set.  ``nics_per_node`` 0: the bandwidth is each device's share, for every group.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str
    reduce_scatter: str = "native"
    collectives: tuple[CollectiveFit, ...] = ()
    nics_per_node: int = 0
    tree: bool = False
    all_reduce_latency_s: float | None = None

    def fits_for(self, kind: str) -> tuple[CollectiveFit, ...]:
        """The measured fits of ``kind``, by group size (empty: price it by the ring estimate)."""
        return tuple(sorted((f for f in self.collectives if f.kind == kind), key=lambda f: f.group_size))

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise ValueError(
                f"link {self.name!r}: bandwidth_bytes_per_s must be a positive finite number, "
                f"got {self.bandwidth_bytes_per_s!r}; give the per-direction bandwidth in bytes/s"
            )
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(
                f"link {self.name!r}: latency_s must be >= 0 and finite, got {self.latency_s!r}; "
                "give the per-step latency in seconds"
            )
        if isinstance(self.nics_per_node, bool) or not isinstance(self.nics_per_node, int) or self.nics_per_node < 0:
            raise ValueError(
                f"link {self.name!r}: nics_per_node must be an int >= 0 (0: the bandwidth is each device's share), "
                f"got {self.nics_per_node!r}"
            )
        if not isinstance(self.tree, bool):
            raise ValueError(f"link {self.name!r}: tree must be true or false, got {self.tree!r}")
        if self.reduce_scatter not in REDUCE_SCATTER:
            raise ValueError(
                f"link {self.name!r}: reduce_scatter must be one of {REDUCE_SCATTER} (how the backend runs it), "
                f"got {self.reduce_scatter!r}"
            )


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Peak rates, capacity and links of one device (one rank of the mesh).

    ``peak_flops`` maps "float32", "bfloat16", "float16" to dense peak flop/s;
    ``matmul_efficiency`` scales it for matmul-like ops, ``memory_efficiency`` scales
    ``mem_bandwidth_bytes_per_s`` for every op (achievable / datasheet);
    ``kernel_overhead_s`` is added once per op (launch and dispatch);
    ``forward_op_overhead_s`` / ``backward_op_overhead_s``, when a calibration
    measured them apart (a Python runtime's backward costs more per op than its
    forward), replace it for an op's forward and backward (``op_overhead_s``).
    ``view_op_overhead_s`` is what calling an op that launches no kernel (a view)
    costs: the host's dispatch, on the critical path where the host runs the ops
    one by one (CPU), hidden where it runs ahead of the device (GPU: 0).
    ``optimizer_foreach``: the optimizer's step launches its kernels for many
    parameters at once (torch.optim's foreach path, its default for CUDA tensors),
    so no per-parameter kernel overhead is charged; False (CPU tensors) charges
    ``OptimizerSpec.ops_per_param`` overheads per parameter.
    ``host_runs_ahead``: the host queues kernels and goes on (CUDA streams), so an
    op's host overhead overlaps the device's work and the op takes the longer of
    its kernel plus ``kernel_overhead_s`` (then the device's own gap between
    kernels) and the host's overhead; False (CPU: the host runs the kernel itself)
    adds them (``costmodel.compute``).
    ``grad_reduce_overlap`` is the fraction of the time of collectives that reduce
    *parameter gradients* in backward that is hidden behind backward compute (DDP
    and FSDP bucket them and overlap them with the rest of backward); collectives on
    activations and the optimizer-step all-gather are never discounted.
    ``attention_efficiency`` / ``attention_backward_efficiency``: the fused attention
    kernel's achieved rate over the matmul rate (``peak_flops`` x ``matmul_efficiency``),
    forward and backward, on the flops ``costmodel.flops`` counts for it (causal masking
    not subtracted: a kernel that skips masked blocks can exceed 1); measured by
    ``autopar calibrate``, 1.0 where not measured.  ``optimizer_bandwidth_bytes_per_s``
    and ``optimizer_op_overhead_s``: what torch.optim's step achieves per byte of its
    tensor passes and per kernel it launches, measured on its AdamW step by calibrate
    (None: ``mem_bandwidth_bytes_per_s`` x ``memory_efficiency`` and ``op_overhead_s()``).
    ``dropout_mask_bytes`` is what a training dropout keeps per element for
    backward (a bool mask in CUDA's native_dropout; the CPU path keeps a float mask).
    ``attention_saves`` is what scaled_dot_product_attention keeps for backward on
    this device: ``"flash"`` (CUDA's fused flash / memory-efficient kernels: q, k, v,
    the output and a float32 logsumexp per query row) or ``"traced"`` (what PyTorch
    runs on CPU tensors, derived by running the op: the fused CPU kernel without
    dropout, the math path, which keeps the attention matrix, with it; see
    ``autopar.cost.saved``).  ``memory_bytes`` is the device memory the datasheet
    states; the planner decides the headroom.  ``cores_per_node``: the CPU cores a node's
    CPU ranks share (0: each rank has its own device); ``core_lending``: how much of
    an idle rank's share the others really get, measured per action length
    (``costmodel.lending``; None: the core-share rule); see ``compute_speed``.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    mem_bandwidth_bytes_per_s: float
    memory_bytes: int
    devices_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile
    kernel_overhead_s: float
    matmul_efficiency: float
    memory_efficiency: float
    source: str
    grad_reduce_overlap: float = 0.0
    dropout_mask_bytes: int = 1
    attention_saves: str = "traced"
    forward_op_overhead_s: float | None = None
    backward_op_overhead_s: float | None = None
    view_op_overhead_s: float = 0.0
    optimizer_foreach: bool = False
    host_runs_ahead: bool = False
    cores_per_node: int = 0
    core_lending: CoreLending | None = None
    attention_efficiency: float = 1.0
    attention_backward_efficiency: float = 1.0
    optimizer_bandwidth_bytes_per_s: float | None = None
    optimizer_op_overhead_s: float | None = None

    def compute_speed(self, busy: int, ranks: int, action_s: float | None = None) -> float:
        """How much faster a rank computes while ``busy`` of its node's ``ranks`` ranks compute than while all of
        them do (the rate this profile's figures are for).  CPU ranks share the node's ``cores_per_node`` cores.
        The core-share rule: ``k`` computing ranks get ``min(1, cores / k)`` of a core each, so the speed is
        ``min(1, cores / busy) / min(1, cores / ranks)`` (4 ranks on 2 cores: 2 x with one or two computing,
        4/3 x with three).  Where the profile measured the lending on ``ranks`` ranks (``core_lending``,
        ``costmodel.lending``: its monotone fit) and the action's length ``action_s`` (seconds, every rank busy)
        is given, that measurement answers, capped at the rule (no rank runs faster than a whole core).  1.0 where
        each rank has its own device (``cores_per_node`` 0: GPUs)."""
        if not self.cores_per_node or busy >= ranks:
            return 1.0
        cores = self.cores_per_node
        rule = min(1.0, cores / max(busy, 1)) / min(1.0, cores / ranks)
        lending = self.core_lending
        if lending is not None and action_s is not None and lending.ranks == ranks:
            return min(lending.speed_at(busy, action_s), rule)
        return rule

    def op_overhead_s(self, *, backward: bool = False) -> float:
        """Fixed seconds per op call: the measured forward/backward overhead, else ``kernel_overhead_s``."""
        measured = self.backward_op_overhead_s if backward else self.forward_op_overhead_s
        return self.kernel_overhead_s if measured is None else measured

    def __post_init__(self) -> None:
        missing = [k for k in PEAK_FLOPS_KEYS if k not in self.peak_flops]
        if missing:
            raise ValueError(
                f"device profile {self.name!r}: peak_flops lacks {missing}; "
                f"expected keys {list(PEAK_FLOPS_KEYS)}, got {sorted(self.peak_flops)}"
            )
        for key, value in self.peak_flops.items():
            _check_positive(self.name, f"peak_flops.{key}", value)
        # copy so that the caller's dict cannot change a frozen profile behind its back
        object.__setattr__(self, "peak_flops", {k: float(v) for k, v in self.peak_flops.items()})
        _check_positive(self.name, "mem_bandwidth_bytes_per_s", self.mem_bandwidth_bytes_per_s)
        _check_positive(self.name, "memory_bytes", self.memory_bytes)
        if isinstance(self.cores_per_node, bool) or not isinstance(self.cores_per_node, int) or self.cores_per_node < 0:
            raise ValueError(
                f"device profile {self.name!r}: cores_per_node must be an int >= 0 (0: each rank has its own device), "
                f"got {self.cores_per_node!r}"
            )
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(
                f"device profile {self.name!r}: devices_per_node must be an int >= 1, got {self.devices_per_node!r}"
            )
        for key in ("attention_efficiency", "attention_backward_efficiency", "optimizer_bandwidth_bytes_per_s"):
            value = getattr(self, key)
            if value is not None:
                _check_positive(self.name, key, value)
        for key in (
            "kernel_overhead_s",
            "forward_op_overhead_s",
            "backward_op_overhead_s",
            "view_op_overhead_s",
            "optimizer_op_overhead_s",
        ):
            value = getattr(self, key)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"device profile {self.name!r}: {key} must be >= 0 seconds, got {value!r}")
        if self.attention_saves not in ATTENTION_SAVES:
            raise ValueError(
                f"device profile {self.name!r}: attention_saves must be one of {ATTENTION_SAVES}, "
                f"got {self.attention_saves!r}"
            )
        for key in ("matmul_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(
                    f"device profile {self.name!r}: {key} must lie in (0, 1] (achieved / peak), got {value!r}"
                )

    def peak_flops_for(self, dtype: torch.dtype) -> float:
        """Dense peak flop/s for ``dtype``: bf16 and fp16 use their own keys, all else float32."""
        if dtype == torch.bfloat16:
            return self.peak_flops["bfloat16"]
        if dtype == torch.float16:
            return self.peak_flops["float16"]
        return self.peak_flops["float32"]

    def link_for_axis(self, mesh_shape: tuple[int, ...], axis: int | tuple[int, ...]) -> LinkProfile:
        """The link the ranks of one mesh axis group talk over (``axis`` a tuple: the group of those axes
        flattened into one, every rank that differs from this one on those axes only).

        The mesh is row-major, last axis innermost, on nodes of ``devices_per_node``
        consecutive ranks: a group whose ranks all sit in one node talks over
        ``intra_node``; a group with ranks in two nodes crosses them (``inter_node``;
        :func:`axis_crosses_nodes`).
        ``axis`` may be negative, as in Python indexing.
        """
        shape = tuple(int(s) for s in mesh_shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape {mesh_shape!r}: expected a non-empty tuple of sizes >= 1")
        for a in (axis,) if isinstance(axis, int) else axis:
            if not -len(shape) <= a < len(shape):
                raise ValueError(
                    f"axis {a} is out of range for mesh shape {shape} ({len(shape)} axes); "
                    f"pass an axis in [0, {len(shape) - 1}]"
                )
        axes = tuple(a % len(shape) for a in ((axis,) if isinstance(axis, int) else axis))
        key = axes[0] if len(axes) == 1 else axes
        if not axis_crosses_nodes(shape, key, self.devices_per_node):
            return self.intra_node
        return group_link(self.intra_node, self.inter_node, group_spread(shape, key, self.devices_per_node))

    def with_devices_per_node(self, devices_per_node: int | None) -> DeviceProfile:
        """This profile with the job's ranks per node (a launch may use fewer devices per node than a node has);
        None keeps the profile's own figure."""
        if devices_per_node is None or devices_per_node == self.devices_per_node:
            return self
        if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise ValueError(f"devices_per_node {devices_per_node!r}: expected an int >= 1 (ranks on each node)")
        return replace(self, devices_per_node=devices_per_node)

    def link_between(self, rank_a: int, rank_b: int) -> LinkProfile:
        """The link two global ranks talk over point to point: ``intra_node`` when both sit in the same
        node of ``devices_per_node`` consecutive ranks, else ``inter_node`` as one device sees it
        (``costmodel.fabric.device_link``: its share of the node's NICs)."""
        if rank_a // self.devices_per_node == rank_b // self.devices_per_node:
            return self.intra_node
        return device_link(self.inter_node, self.devices_per_node)


def axis_crosses_nodes(mesh_shape: tuple[int, ...], axis: int | tuple[int, ...], devices_per_node: int) -> bool:
    """Whether some group of one mesh axis holds ranks of more than one node (``devices_per_node`` consecutive
    ranks each).

    The mesh is row-major, last axis innermost, its ranks ``0 .. size - 1``: each group of the axis is compared
    node by node (rank // devices_per_node), so a group that straddles a node boundary crosses even when its span
    is shorter than a node (a mesh (4, 3) on nodes of 4: the group of ranks 3, 4, 5 crosses).
    """
    axes = (axis,) if isinstance(axis, int) else tuple(axis)  # several: their groups flattened into one
    ranks = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    nodes = np.moveaxis(ranks, axes, tuple(range(-len(axes), 0))).reshape(-1, math.prod(mesh_shape[a] for a in axes))
    nodes = nodes // devices_per_node
    return bool((nodes.min(axis=-1) != nodes.max(axis=-1)).any())


def check_devices_per_node(mesh_shape: tuple[int, ...], devices_per_node: int) -> None:
    """``ValueError`` unless ``devices_per_node`` ranks per node can hold the mesh: nodes hold equal numbers of
    ranks (torchrun's ``--nproc-per-node``), so a mesh larger than one node must fill whole nodes."""
    size = math.prod(mesh_shape)
    if size > devices_per_node and size % devices_per_node:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"devices_per_node {devices_per_node}: the mesh {tuple(mesh_shape)} has {size} ranks, which nodes of "
            f"{devices_per_node} cannot hold (every node runs the same number of ranks); pass one of "
            f"{', '.join(map(str, divisors))}, or a number >= {size} when the job fits one node"
        )


def _check_positive(profile: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"device profile {profile!r}: {key} must be a positive finite number, got {value!r}")


def profiles_dir() -> Path:
    """The device profiles' folder: ``$AUTOPAR_CONFIG_DIR/devices`` if set, else ``devices/`` of ``autopar.configs``.

    ``autopar.configs`` is the repository's top-level ``configs/`` folder, which
    pyproject.toml installs under that name (an editable install reads the checkout's
    folder, a wheel its copy); it is found with ``importlib.resources``, never by a
    path relative to this file.  The other data files of that folder (models,
    benchmarks) are autopar's, found by ``autopar.models.config_dir``.

    Raises ``ImportError`` when the package is missing or is not a folder on disk.
    """
    env = os.environ.get(_CONFIG_ENV)
    if env:
        return Path(env).expanduser().resolve() / "devices"
    try:
        root = importlib.resources.files(_CONFIG_PACKAGE)
    except ModuleNotFoundError as e:
        raise ImportError(
            f"autopar's data package {_CONFIG_PACKAGE!r} (device profiles) is not installed: {e}. Reinstall autopar "
            f"(`pip install -e .` in the checkout, or `pip install .`), or set ${_CONFIG_ENV} to a folder with devices/"
        ) from e
    if not isinstance(root, Path):
        raise ImportError(
            f"autopar's data package {_CONFIG_PACKAGE!r}: expected a folder on disk, got {root!r} (a zip import?); "
            f"install autopar with pip (wheels unpack to disk), or set ${_CONFIG_ENV} to a folder with devices/"
        )
    return root / "devices"


def profile_dict(name_or_path: str) -> dict[str, Any]:
    """The raw TOML table of a device profile, by name or path (``load_profile`` validates it into a profile)."""
    path = _resolve(str(name_or_path))
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"device profile {path}: not valid TOML ({e}); fix the file's syntax") from e


def available_profiles() -> list[str]:
    """Names of the device profiles under ``profiles_dir()``, sorted."""
    devices = profiles_dir()
    if not devices.is_dir():
        return []
    return sorted(p.stem for p in devices.glob("*.toml"))


def load_profile(name_or_path: str) -> DeviceProfile:
    """Load a device profile by name (``configs/devices/<name>.toml``) or from a .toml path.

    Raises ``ValueError`` for an unknown name (listing the available ones), a missing
    file, or a file whose keys or values do not fit the schema.
    """
    path = _resolve(str(name_or_path))
    profile = _profile_from_dict(profile_dict(path), path)
    log.debug("loaded device profile %s from %s", profile.name, path)
    return profile


def _resolve(name_or_path: str) -> Path:
    looks_like_path = name_or_path.endswith(".toml") or os.sep in name_or_path or "/" in name_or_path
    if looks_like_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(f"device profile file {path} does not exist; pass an existing .toml path or a name")
        return path
    path = profiles_dir() / f"{name_or_path}.toml"
    if not path.is_file():
        raise ValueError(
            f"unknown device profile {name_or_path!r}: no {path}; available profiles: {available_profiles()}. "
            f"Pass one of those names, a path to a .toml file, or set ${_CONFIG_ENV}"
        )
    return path


_TOP_KEYS = {
    "name": str,
    "source": str,
    "devices_per_node": int,
    "memory_bytes": int,
    "mem_bandwidth_bytes_per_s": float,
    "kernel_overhead_s": float,
    "matmul_efficiency": float,
    "memory_efficiency": float,
    "peak_flops": dict,
    "intra_node": dict,
    "inter_node": dict,
}
_LINK_KEYS = {"name": str, "bandwidth_bytes_per_s": float, "latency_s": float, "source": str}


def _take(table: dict, schema: dict[str, type], where: str) -> dict[str, Any]:
    """Check a TOML table against ``schema`` (exact key set, types); ints pass as floats."""
    missing = sorted(set(schema) - set(table))
    unknown = sorted(set(table) - set(schema))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}; expected exactly {sorted(schema)}")
    out: dict[str, Any] = {}
    for key, kind in schema.items():
        value = table[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{where}: key {key!r} must be {kind.__name__}, got {type(value).__name__} {value!r}")
        out[key] = value
    return out


#: optional keys of a profile file: seconds (measured overheads) and rates (measured efficiencies, bandwidths)
_OPTIONAL_SECONDS = ("forward_op_overhead_s", "backward_op_overhead_s", "view_op_overhead_s", "optimizer_op_overhead_s")
_OPTIONAL_RATES = ("attention_efficiency", "attention_backward_efficiency", "optimizer_bandwidth_bytes_per_s")


def _profile_from_dict(data: dict, path: Path) -> DeviceProfile:
    where = f"device profile {path}"
    data = dict(data)
    overlap = data.pop("grad_reduce_overlap", 0.0)  # optional: older calibration files lack it
    mask_bytes = data.pop("dropout_mask_bytes", 1)
    attention = data.pop("attention_saves", "traced")  # optional: older files lack it
    reduce_scatter = data.pop("reduce_scatter", "native")  # optional: how the backend runs it (LinkProfile)
    overheads = {k: data.pop(k) for k in _OPTIONAL_SECONDS if k in data}
    rates = {k: data.pop(k) for k in _OPTIONAL_RATES if k in data}  # measured by calibrate: older files lack them
    switches = {k: data.pop(k, False) for k in ("optimizer_foreach", "host_runs_ahead")}
    cores = data.pop("cores_per_node", 0)  # optional: CPU ranks sharing cores (0: a device per rank)
    lending = data.pop("core_lending", None)  # optional: measured by calibrate where ranks outnumber cores
    if lending is not None and not isinstance(lending, dict):
        raise ValueError(f"{where}: core_lending must be a table (ranks, action_s, speed), got {lending!r}")
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    for key, value in {**overheads, **rates}.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if not isinstance(attention, str):
        raise ValueError(f"{where}: attention_saves must be a string {ATTENTION_SAVES}, got {attention!r}")
    if not isinstance(mask_bytes, int) or mask_bytes < 1:
        raise ValueError(f"{where}: dropout_mask_bytes must be an int >= 1, got {mask_bytes!r}")
    if not isinstance(overlap, (int, float)) or isinstance(overlap, bool) or not 0 <= overlap < 1:
        raise ValueError(f"{where}: grad_reduce_overlap must be a number in [0, 1), got {overlap!r}")
    top = _take(data, _TOP_KEYS, where)
    peak = _take(top.pop("peak_flops"), dict.fromkeys(PEAK_FLOPS_KEYS, float), f"{where} [peak_flops]")
    links = {}
    for key in ("intra_node", "inter_node"):
        table = dict(top.pop(key))
        fits = _collective_fits(table.pop("collectives", {}), f"{where} [{key}.collectives]")
        fabric = {k: table.pop(k) for k in ("nics_per_node", "tree") if k in table}  # optional: a node's NICs
        links[key] = LinkProfile(
            **_take(table, _LINK_KEYS, f"{where} [{key}]"), reduce_scatter=reduce_scatter, collectives=fits, **fabric
        )
    return DeviceProfile(
        peak_flops=peak,
        **links,
        **top,
        grad_reduce_overlap=float(overlap),
        dropout_mask_bytes=mask_bytes,
        attention_saves=attention,
        **{k: float(v) for k, v in {**overheads, **rates}.items()},
        **switches,
        cores_per_node=cores,
        core_lending=None if lending is None else CoreLending.from_table(lending, where),
    )


def _collective_fits(table: dict, where: str) -> tuple[CollectiveFit, ...]:
    """``{kind: {group_sizes, latency_s, bandwidth_bytes_per_s}}`` (arrays of one length) as CollectiveFits."""
    out = []
    for kind, entry in table.items():
        if kind not in COLLECTIVES:
            raise ValueError(f"{where}: unknown collective {kind!r}; expected one of {COLLECTIVES}")
        entry = dict(entry)
        sizes = entry.pop("sizes_bytes", None)
        seconds = entry.pop("seconds", None)
        cols = _take(entry, {"group_sizes": list, "latency_s": list, "bandwidth_bytes_per_s": list}, f"{where}.{kind}")
        if len({len(v) for v in cols.values()}) != 1:
            raise ValueError(f"{where}.{kind}: group_sizes, latency_s and bandwidth_bytes_per_s differ in length")
        if (sizes is None) != (seconds is None):
            raise ValueError(f"{where}.{kind}: sizes_bytes and seconds come together (the measured points)")
        if seconds is not None and (
            len(seconds) != len(cols["group_sizes"]) or any(len(row) != len(sizes) for row in seconds)
        ):
            raise ValueError(
                f"{where}.{kind}: seconds must hold one row per group size, each with one time per size in sizes_bytes"
            )
        for k, (n, lat, bw) in enumerate(zip(cols["group_sizes"], cols["latency_s"], cols["bandwidth_bytes_per_s"])):
            if isinstance(n, bool) or not isinstance(n, int) or n < 2:
                raise ValueError(f"{where}.{kind}: group sizes must be ints >= 2, got {n!r}")
            points = tuple(zip(map(float, sizes), map(float, seconds[k]))) if sizes is not None else ()
            out.append(CollectiveFit(kind, n, float(lat), float(bw), points))
    return tuple(out)
