"""``autopar run``: train a compiled model on local ranks and check it against one device.

    autopar run gpt2-tiny --mesh 2x2 --axis-names dp,tp --steps 3 --check

``run(config)`` is the whole command; ``report.render_report`` turns its result into text.

* **Where it runs.** With no torchrun environment, ``run`` spawns ``mesh.size`` CPU
  processes (spawn context, gloo on 127.0.0.1 with a free port), each with a
  collective timeout, and stops them all at ``config.timeout_s`` or as soon as one
  fails, so it never hangs; results come back as files (``torch.save``).  Under
  torchrun (``RANK`` and ``WORLD_SIZE`` set) this process *is* one rank
  (``runtime.init_distributed``), and rank 0 gathers the others' results.
* **Checkpoints** (``resume.py``): ``save_dir`` writes ``step-<n>`` checkpoints,
  ``resume_dir`` continues from one on any mesh; the check then compares with the
  uninterrupted one-device run from the resumed step on.
* **What a rank does** (``train_rank``): build the model (``build_model``: seeded
  random weights, dropout off under ``check``), ``autopar.compile`` it, train
  ``steps`` AdamW steps on the same global batch, and record the loss and time of
  each step and the bytes it holds after the last step: its local parameter
  shards, their ``.grad`` and every tensor in the optimizer state (AdamW's step
  counters included), beside the plan's ``memory`` figures.
* **The check** (``reference_run``, ``compare``): the same model trained on one
  device.  The loss of every step on every rank, the other outputs (the logits)
  and every gradient of its first step, and every parameter after the last step must pass
  ``torch.isclose`` with ``RTOL``/``ATOL`` (the tolerances of tests/test_execution.py).
  Each quantity reports its largest absolute deviation and the worst tensor.

Errors: bad input raises ``ValueError``; a rank that fails or outlives the deadline
raises ``LaunchError`` carrying that rank's traceback.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.planner import FAMILIES, Plan, PlanMemory, PlanThroughput
from autopar.runtime import RankError, RankSettings, ranks_per_node, spawn_ranks

from .one_device_check import ATOL, RTOL, Deviation, compare
from .resume import resolve_checkpoint, resume, save_if_due, saved_step

__all__ = [
    "RunConfig",
    "RankResult",
    "TrainRecord",
    "Deviation",
    "RunReport",
    "LaunchError",
    "run",
    "train_rank",
    "reference_run",
    "build_model",
    "plan_once",
    "compare",
    "RTOL",
    "ATOL",
]

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A rank failed or hung; the message carries the first failing rank's traceback."""


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What ``autopar run`` trains, where, and how long (see the module docstring)."""

    model: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None
    steps: int = 3
    check: bool = False
    batch: int = 4
    seq: int = 32
    family: str | None = None
    recompute: str = "auto"  # what backward recomputes: auto | none | selective | full (planner.recompute_tables)
    lr: float = 1e-3
    seed: int = 0
    timeout_s: float = 600.0
    save_dir: str | None = None  # write checkpoints DIR/step-<n> (resume.py)
    save_every: int = 0  # and after every n-th step (0: after the last only)
    resume_dir: str | None = None  # continue from this checkpoint (or the latest step-<n> in it)
    pipeline: str = "none"  # the mesh axis that carries a pipeline (planner.pipeline_planning)
    microbatches: int | str = "auto"  # micro-batches per step (through the pipeline, or accumulated)
    schedule: str = "auto"  # the pipeline schedule
    virtual_stages: int | str = "auto"  # stages per rank of the interleaved schedule
    devices: int | None = None  # plan for this many devices: the mesh is the plan's choice (mesh_shape: (devices,))

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("steps", "batch", "seq") if getattr(self, k) < 1]
        if bad:
            raise ValueError(f"autopar run: {', '.join(bad)}: expected >= 1; pass e.g. --steps 3 --batch 4 --seq 32")
        if not self.lr > 0:
            raise ValueError(f"autopar run: lr={self.lr}: expected a positive learning rate, e.g. --lr 1e-3")
        if not self.timeout_s > 0:
            raise ValueError(f"autopar run: timeout_s={self.timeout_s}: expected a positive number of seconds")
        if self.save_every < 0 or (self.save_every and not self.save_dir):
            raise ValueError(
                f"autopar run: save_every={self.save_every}: expected 0, or a positive step count with a save "
                "directory, e.g. --save ckpt --save-every 100"
            )
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"autopar run: family {self.family!r}: expected None (auto) or one of {FAMILIES}")
        self.mesh()  # validates the shape and the axis names

    def mesh(self) -> Mesh:
        return Mesh(self.mesh_shape, axis_names=self.axis_names)  # no names: Mesh's axis0, axis1, ... as everywhere

    def on_mesh_of(self, plan: Plan) -> RunConfig:
        """This run on the mesh ``plan`` chose (``devices``: the mesh is the plan's); itself otherwise."""
        if self.devices is None:
            return self
        return replace(self, mesh_shape=plan.mesh.shape, axis_names=plan.mesh.axis_names)


@dataclass(frozen=True, slots=True)
class TrainRecord:
    """What a training run produced: per-step losses, step-0 outputs and grads, final params.

    The tensors are full (unsharded) and only kept where they are compared: on the
    reference and on rank 0 under ``check``; elsewhere they are empty.
    """

    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    outputs: tuple[torch.Tensor, ...] = ()
    output_names: tuple[str, ...] = ()
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    first_step: int = 0  # the step it started from (a resumed run: the checkpoint's); losses[i] is step first_step + i
    saved: tuple[str, ...] = ()  # the checkpoints it wrote


@dataclass(frozen=True, slots=True)
class RankResult:
    """One rank's run: its training record, the memory it held and the plan's figures."""

    rank: int
    coordinate: tuple[int, ...]
    family: str
    record: TrainRecord
    held_bytes: dict[str, int]
    plan_memory: PlanMemory
    recompute_line: str = ""  # the plan's "recompute:" line (planner.plan_table.describe_recompute)
    nodes_line: str = ""  # which mesh axes span nodes (planner.plan_table.describe_nodes), '' on one node
    pipeline_line: str = ""  # the plan's "pipeline:" line (planner.plan_table.describe_pipeline), '' without one
    throughput: PlanThroughput | None = None  # the plan's model FLOPs and predicted MFU (Plan.throughput)


@dataclass(frozen=True, slots=True)
class RunReport:
    """Everything ``report.render_report`` prints; ``passed`` is None without ``check``."""

    config: RunConfig
    launcher: str
    ranks: tuple[RankResult, ...]
    reference: TrainRecord | None
    deviations: tuple[Deviation, ...]

    @property
    def passed(self) -> bool | None:
        return None if self.reference is None else all(d.ok for d in self.deviations)


# ---- one training run -------------------------------------------------------------------
def build_model(config: RunConfig, device: torch.device | str = "cpu"):
    """(model, args, kwargs): seeded random weights, in train mode, dropout off under ``check``.

    ``device="meta"`` builds the same model without weights (for planning).
    """
    from autopar.models import load_model

    device = torch.device(device)
    torch.manual_seed(config.seed)  # factories draw their weights from the global generator too
    build_on = "meta" if device.type == "meta" else "cpu"
    model, args, kwargs = load_model(config.model, batch=config.batch, seq=config.seq, device=build_on)
    if config.check:
        _disable_dropout(model)
    model.train()
    if device.type not in ("cpu", "meta"):
        model = model.to(device)
        args, kwargs = pytree.tree_map(lambda v: v.to(device) if torch.is_tensor(v) else v, (args, kwargs))
    return model, args, kwargs


def _disable_dropout(model: nn.Module) -> None:
    # dropout masks differ by design between one device and a sharded run, so the check needs p=0;
    # HF attention reads its probability from the config or a float attribute, not a Dropout module
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def _flat(out) -> list[tuple[str, Any]]:
    """A model's tensor outputs as (path, value), flattened as torch.export flattens them (pytree).

    The compiled module returns the model's own structure, so both sides flatten alike.
    """
    from autopar.capture import register_dataclasses

    register_dataclasses(out)  # the plain model's dataclass outputs flatten as capture registers them
    leaves = pytree.tree_flatten_with_path(out)[0]
    return [(_output_name(path), v) for path, v in leaves if torch.is_tensor(v)]


def _output_name(path: tuple) -> str:
    """``logits`` for a field of a dict or ModelOutput, ``output[1]`` for a tuple's element, ``output`` alone."""
    if path and isinstance(path[0], pytree.MappingKey):
        return str(path[0].key) + pytree.keystr(path[1:])
    return "output" + pytree.keystr(path)


def _loss_index(flat: list[tuple[str, Any]], where: str) -> int:
    # the same rule as capture's loss_output: the first float scalar that carries a gradient
    for i, (_, v) in enumerate(flat):
        if v.numel() == 1 and v.is_floating_point() and v.requires_grad:
            return i
    raise ValueError(
        f"{where}: the model returns no scalar loss (outputs {[k for k, _ in flat]}); autopar run trains the "
        "model's own loss: make the factory pass labels (built-in models do) or return a loss"
    )


def _train(module: nn.Module, args, kwargs, config: RunConfig, *, keep: bool, where: str, record_step: int = 0):
    """(TrainRecord, held bytes after the last step) of AdamW steps of ``module`` up to ``config.steps``.

    A sharded ``module`` resumes from ``config.resume_dir`` and saves to ``config.save_dir``
    (``resume.py``), and records its first step's outputs and gradients; the one-device
    reference trains from step 0 and records those of ``record_step`` (the step a
    resumed run starts from).  ``module.full_grads``/``full_state_dict`` (a
    ShardedModule) are collective, so every rank calls them; only ``keep`` ones hold
    on to the result.
    """
    sharded = hasattr(module, "full_grads")
    opt = torch.optim.AdamW(module.parameters(), lr=config.lr)
    first = resume(config, module, opt) if sharded else 0
    if first >= config.steps:
        raise ValueError(
            f"{where}: the checkpoint in {config.resume_dir} has done {first} steps and --steps is {config.steps}; "
            f"pass --steps larger than {first} to train on"
        )
    record_step = first if sharded else record_step
    losses, times, outputs, names, grads, held, written = [], [], (), (), {}, {}, []
    saved = None  # what the first forward saved for backward (lower.SavedBytes; every step saves the same)
    stepped = sharded and module.plan.microbatches > 1  # micro-batches: sharded.train_step runs forward + backward
    for step in range(first, config.steps):
        if sharded and not stepped:  # measured on the first step only: the instrumented graph costs a hook per op
            module.measure_saved = step == first
        t0 = time.perf_counter()
        flat, loss = _forward_backward(module, args, kwargs, stepped, where, outputs=step == record_step)
        if sharded and step == first and not stepped:
            saved = module.saved_bytes
        dt = time.perf_counter() - t0
        if step == record_step and config.check:
            if not _accumulated(config):  # accumulated micro-batches: sharded(...) takes one, not the batch
                outputs = tuple(v.detach().cpu() for _, v in flat)
                names = tuple(k for k, _ in flat)
            if sharded:
                grads = module.full_grads()
            else:
                grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in module.named_parameters()}
        t0 = time.perf_counter()
        opt.step()
        times.append(dt + time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if step == config.steps - 1 and sharded:
            held = module.model_state_bytes(opt)
            if saved is not None:  # measured by the executor's saved-tensor hook
                held["activations"] = saved.total_bytes
        opt.zero_grad()
        if sharded:
            written.append(save_if_due(config, module, opt, step + 1))
    params = {}
    if config.check:
        params = (
            module.full_state_dict() if sharded else {k: v.detach().clone() for k, v in module.state_dict().items()}
        )
    if not keep:
        outputs, grads, params = (), {}, {}
    cpu = {k: None if v is None else v.cpu() for k, v in grads.items()}
    record = TrainRecord(
        tuple(losses),
        tuple(times),
        outputs,
        names,
        cpu,
        {k: v.cpu() for k, v in params.items()},
        first_step=first,
        saved=tuple(p for p in written if p),
    )
    return record, held


def _accumulated(config: RunConfig) -> bool:
    return config.microbatches not in (1, "auto") and config.pipeline == "none"


def _forward_backward(module, args, kwargs, stepped: bool, where: str, *, outputs: bool):
    """(the named outputs other than the loss, the loss) of one training step's forward and backward.

    ``stepped``: the module's ``train_step`` (micro-batches); the outputs, when asked for, from a forward-only
    call before it (a pipelined plan's forward runs the whole batch through the stages)."""
    if stepped:
        flat = []
        if outputs and module.plan.pipeline is not None:
            flat = _flat(module(*args, **kwargs))
            flat = [kv for i, kv in enumerate(flat) if i != _loss_index(flat, where)]
        return flat, module.train_step(*args, **kwargs)
    flat = _flat(module(*args, **kwargs))
    loss_at = _loss_index(flat, where)
    loss = flat[loss_at][1]
    loss.backward()
    return [kv for i, kv in enumerate(flat) if i != loss_at], loss


def plan_once(config: RunConfig, *, profile: str = "cpu") -> Plan:
    """The plan ``autopar.compile`` would make on every rank, made once (on a CPU model, as the ranks run it).

    Same settings as ``compile``'s own search (fp32, ZeRO state sharding allowed, ``family``),
    so the ranks only capture and shard.  Planning once also keeps the search's
    memory in one process instead of one copy per rank.  The model is built on the
    CPU, not the meta device: torch.export traces the kernels the tensors run, and
    some graphs differ between the two (``compiled.checks.check_plan_graph``).
    """
    from autopar.planner import plan

    model, args, kwargs = build_model(config, "cpu")
    where = {"devices": config.devices} if config.devices is not None else {"mesh": config.mesh()}
    return plan(
        model,
        **where,
        example_inputs=args,
        example_kwargs=kwargs,
        profile=profile,
        dtype="fp32",
        devices_per_node=ranks_per_node(),  # under torchrun across nodes: the axes that cross them use that link
        family=config.family,
        recompute=config.recompute,
        pipeline=config.pipeline,  # micro-batched plans are captured at the micro-batch (plan's own path)
        microbatches=config.microbatches,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        compare_families=False,
    )


def train_rank(config: RunConfig, plan: Plan | None = None) -> RankResult:
    """This rank's run, inside an initialized default process group of ``mesh.size`` ranks.

    ``plan=None`` lets ``autopar.compile`` plan on this rank.
    """
    from autopar import compiled

    mesh = config.mesh()
    rank = dist.get_rank()
    model, args, kwargs = build_model(config)
    sharded = compiled.compile(
        model,
        mesh,
        example_inputs=args,
        example_kwargs=kwargs,
        family=config.family,
        seed=config.seed,
        plan=plan,
        recompute=config.recompute,
    )
    del model
    where = f"autopar run {config.model}, rank {rank}"
    record, held = _train(sharded, args, kwargs, config, keep=rank == 0, where=where)
    from autopar.planner import describe_nodes, describe_pipeline, describe_recompute

    plan = sharded.plan
    coord = tuple(mesh.coordinate(rank))
    lines = describe_recompute(plan), describe_nodes(plan), describe_pipeline(plan, table_below=False)
    return RankResult(rank, coord, plan.family, record, held, plan.memory, *lines, throughput=plan.throughput)


def reference_run(config: RunConfig, device: torch.device | str = "cpu") -> TrainRecord:
    """The same model, weights, batch and optimizer on one device, every step from 0 (uninterrupted).

    Under ``resume_dir`` it records the outputs and gradients of the step the
    checkpoint resumes from, which the distributed run's first step is compared with.
    """
    start = saved_step(resolve_checkpoint(config.resume_dir)) if config.resume_dir else 0
    model, args, kwargs = build_model(config, device)
    record, _ = _train(model, args, kwargs, config, keep=True, where=f"autopar run {config.model}", record_step=start)
    return record


# ---- launching ----------------------------------------------------------------------------
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rank_entry(rank: int, world: int, config: RunConfig, plan: Plan) -> RankResult:
    """What one spawned rank runs (gloo is already initialized by the spawner)."""
    return train_rank(config, plan)


def _spawn(config: RunConfig, plan: Plan, *, while_waiting=None) -> tuple[tuple[RankResult, ...], Any]:
    """Run ``train_rank`` on ``mesh.size`` spawned gloo ranks; ``while_waiting()`` runs in the parent meanwhile."""
    world = config.mesh().size
    threads = max(1, (os.cpu_count() or 1) // world)
    log.info("spawning %d gloo ranks (%d threads each)", world, threads)
    try:
        results, extra = spawn_ranks(
            _rank_entry,
            world,
            config,
            plan,
            settings=RankSettings(
                timeout_s=config.timeout_s,
                collective_timeout_s=config.timeout_s,
                threads=threads,
                env={"TRANSFORMERS_VERBOSITY": "error"},
            ),
            while_waiting=while_waiting,
        )
    except RankError as e:
        hint = " Pass a larger --timeout if the model is just slow." if "still running" in str(e) else ""
        raise LaunchError(f"{e}{hint}") from None
    return tuple(results), extra


def _profile(device: torch.device) -> str:
    from types import SimpleNamespace

    from autopar.compiled import default_profile

    return default_profile(SimpleNamespace(device=device))  # what compile picks for this rank's device


def _deterministic_gpu_kernels() -> None:
    """``--check`` on GPUs: deterministic kernels for the ranks and the one-device reference alike.

    Some CUDA kernels sum in a run-dependent order (memory-efficient attention's
    backward, cuBLAS with a split workspace, atomics in index/scatter backward), so two
    runs of one model differ in the last bits; AdamW turns such a difference in a
    gradient near its ``eps`` into an lr-sized step, and the check would report
    rounding as a deviation.  Must run before the first cuBLAS call of the process.
    """
    if not torch.cuda.is_available():
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op with no such kernel warns, not fails


def _as_torchrun_rank(config: RunConfig) -> tuple[tuple[RankResult, ...] | None, torch.device, RunConfig]:
    from autopar.runtime import init_distributed

    mesh = config.mesh()
    world = int(os.environ["WORLD_SIZE"])
    if world != mesh.size:
        dims = " * ".join(f"{n}({s})" for n, s in zip(mesh.axis_names, mesh.shape))
        raise ValueError(
            f"autopar run under torchrun: WORLD_SIZE={world} but mesh {dims} = {mesh.size}; "
            f"launch torchrun --nproc-per-node {mesh.size} or pass a --mesh of {world} devices"
        )
    if config.check:
        _deterministic_gpu_kernels()
    backend = init_distributed(timeout=timedelta(seconds=config.timeout_s))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if "nccl" in backend else torch.device("cpu")
    try:
        rank = dist.get_rank()
        # rank 0 plans and sends the plan, or its error, so that a bad input fails every rank at once
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = plan_once(config, profile=_profile(device))
            except (ValueError, TypeError) as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        config = config.on_mesh_of(box[0])
        result = train_rank(config, box[0])
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    return (tuple(gathered) if rank == 0 else None), device, config


def run(config: RunConfig) -> RunReport | None:
    """Train on ``mesh.size`` ranks (spawned, or this torchrun rank) and compare with one device under ``check``.

    Returns the report where it is complete: in the spawning parent, or on torchrun
    rank 0; other torchrun ranks get None.
    """
    if _under_torchrun():
        ranks, device, config = _as_torchrun_rank(config)
        if ranks is None:
            return None
        reference = reference_run(config, device) if config.check else None
        launcher = f"torchrun, nccl on {device}" if device.type == "cuda" else "torchrun, gloo"
    else:
        plan = plan_once(config)  # gloo ranks: compile's own choice of profile is "cpu"
        config = config.on_mesh_of(plan)
        # the parent is idle while the ranks capture and train: it runs the reference meanwhile
        waiting = (lambda: reference_run(config)) if config.check else None
        ranks, reference = _spawn(config, plan, while_waiting=waiting)
        launcher = "spawned local CPU processes, gloo"
    deviations = tuple(compare(ranks, reference)) if reference is not None else ()
    return RunReport(config, launcher, ranks, reference, deviations)
