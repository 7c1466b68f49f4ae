"""``autopar.compile``: a plan turned into an ordinary ``nn.Module`` on each rank.

    sharded = autopar.compile(model, mesh, example_inputs=(ids,))   # inside a process group
    loss = sharded(ids, labels=labels)          # default: the same global batch on every rank
    loss.backward(); opt.step()                 # any torch optimizer over sharded.parameters()

The module holds this rank's shards as ``nn.Parameter``s under the original
names (``named_parameters()`` yields ``transformer.h.0.attn.c_attn.weight`` etc.),
runs the captured graph lowered to this rank's local ops with the plan's moves
inserted (``executor.lower``; printable as ``sharded.local_graph.code``) and
returns full tensors: the loss as planned (the plan makes it replicated), other
outputs gathered (outside the plan's collective list, which covers the training
step).

Gradient clipping: ``sharded.clip_grad_norm_(max_norm)`` clips by the full gradient's
norm (``runtime/clip.py``); ``torch.nn.utils.clip_grad_norm_`` over the local shards
would not.

Instrumentation, off by default because it costs a hook per op:
``sharded.trace = {}`` records each op's local outputs (op node name -> tensors)
and ``sharded.measure_saved = True`` makes every forward measure what it saves
for backward (``sharded.saved_bytes``, an ``executor.SavedBytes``); either runs
the instrumented variant of the local graph.

Input modes: ``input_mode="global"`` (default) — every rank passes the same global
batch and keeps its planned piece; ``input_mode="local"`` — each rank passes only
its own piece (e.g. its data-parallel slice from a DistributedSampler), which must
have the local shape the plan gives it (``sharded.local_input_shapes``).

Where the shards come from: ``model`` with real weights on every rank (each keeps
its piece); a meta-device ``model`` plus a full ``state_dict``; or
``weights_from_rank0=True``, where rank 0 alone holds real weights and sends each
parameter to the others.

ZeRO-1/2: where the plan shards a parameter's gradient and optimizer state beyond
its placement, the ``nn.Parameter`` is the state shard (a view into the piece
forward reads) and the optimizer step's all-gather runs right after
``opt.step()`` (``runtime/zero.py``).  ``model_state_bytes(opt)`` gives the bytes
held, to compare with ``plan.memory``.

Train and eval mode: the module starts in the mode ``model`` was in; ``sharded.eval()``
turns dropout off and makes batch and instance norm use their running statistics
(their ops run their eval form, ``executor.EVAL_FORMS``), and ``sharded.train()``
undoes both, as on the model itself.  The graph is traced in train
mode, so Python branches on ``self.training`` inside the model keep their
train-mode choice in both.

Lazy compile: ``example_inputs=None`` plans on the first call (see ``compile``).
Bad input fails before any collective where it can: a plan for another mesh,
model, input shapes or traced graph (``_load_plan``, ``_check_plan_inputs``, ``_check_plan_graph``), ranks that
disagree on the input shapes at compile time; world size != mesh size and a
missing process group fail in ``MeshGroups``.  Inputs of other shapes than the
compiled ones raise in ``forward`` on the ranks that pass them; when not every
rank does, those ranks shut the mesh's process groups down (``MeshGroups.fail``),
so the others, already waiting in a collective, raise the same reason at once
instead of at the process group's timeout; the module must then be compiled
again.

The loss: its last collective (and the sums and scalings after it) is started
without waiting (``runtime/deferred.py``): ``forward`` returns a ``PendingLoss``
that waits on first read (``float(loss)``, ``loss.item()``, ``loss.detach()``),
and ``loss.backward()`` does not wait for it, so a data-parallel step has no
synchronization in forward, like DDP's.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.capture import OpGraph, capture
from autopar.layout import shard_tensor
from autopar.lower import ExecutionPlan, RunState, SavedBytes, lower
from autopar.mesh import Mesh
from autopar.placement import Replicate
from autopar.planner import Plan
from autopar.runtime import DEFAULT_BUCKET_BYTES, GradBuckets, StateShards, bucketable, wait_pending
from autopar.spec import TensorMeta, local_shape
from costmodel import optimizer_spec, precision

__all__ = ["compile", "ShardedModule", "NotCompiledError"]

log = logging.getLogger(__name__)


def default_profile(groups) -> str:
    dev = getattr(groups, "device", torch.device("cpu"))
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    return "h100" if "h100" in name or "h200" in name else "a100"


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, value)


class ShardedModule(nn.Module):
    """One rank's part of a compiled model (see the module docstring)."""

    def __init__(
        self,
        groups,
        *,
        build: Callable[[tuple, dict], tuple[OpGraph, Plan]],
        input_mode: str,
        full_params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        seed: int,
        state_keys: list[str],
        grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__()
        if input_mode not in ("global", "local"):
            raise ValueError(f"input_mode {input_mode!r}: expected 'global' (same batch everywhere) or 'local'")
        self.mesh = groups.mesh
        self.input_mode = input_mode
        self._groups = groups
        self._build = build  # (args, kwargs) -> (graph, plan); None once compiled
        self._plan: Plan | None = None
        self._graph: OpGraph | None = None
        self._xplan: ExecutionPlan | None = None
        self._local_input_shapes: dict[str, tuple[int, ...]] = {}
        self._zero = StateShards(groups)  # ZeRO-1/2 parameters (runtime/zero.py)
        self._bucket_bytes = grad_bucket_bytes
        self._buckets: GradBuckets | None = None  # data-parallel gradient buckets (runtime/buckets.py)
        self.collective_counter = None  # set a runtime.CollectiveCounter to record every collective issued
        self.trace = None  # set a dict to record each op's local outputs (op node name -> tensors)
        self.measure_saved = False  # True: every forward measures what it saves for backward (saved_bytes)
        self.saved_bytes = None  # after a forward with measure_saved: executor.SavedBytes
        self._state = RunState()  # what the lowered graph's steps read per call
        self._programs: dict[bool, torch.fx.GraphModule] = {}  # instrumented? -> lowered graph (executor.lower)
        self._sources: list[tuple[Any, torch.Tensor | None]] = []  # per graph argument: (input node, None) or value
        self._bucket_params: dict[str, torch.Tensor] = {}
        self._bucket_slots: list[tuple[int, str]] = []  # (argument index, param node name) of bucketed params
        self._seed = seed
        self._step = 0
        self._coord = tuple(groups.coordinate)
        # until compiled: the full parameters under their names, so an optimizer can be built before a lazy
        # compile; compiling re-points each Parameter object at this rank's piece (``.data``)
        self._full_params: dict[str, torch.Tensor] | None = dict(full_params)
        for fqn, full in full_params.items():
            _set_param(self, fqn, nn.Parameter(full.detach(), requires_grad=full.requires_grad))
        self._buffers_full = {k: v.to(groups.device) for k, v in buffers.items()}
        # buffer fqn -> (this rank's piece forward reads and updates, its placement, the full shape)
        self._buffer_pieces: dict[str, tuple[torch.Tensor, tuple, tuple[int, ...]]] = {}
        self._state_keys = list(state_keys)

    def _compile(self, args: tuple, kwargs: dict) -> None:
        """Capture (and plan, unless given a plan) for these inputs; shard the parameters."""
        graph, plan = self._build(args, kwargs)
        xplan = ExecutionPlan.from_plan(graph, plan)
        params = dict(self.named_parameters())
        for node in graph.params():
            placement, state = xplan.sources[node.name]
            full, param = self._full_params[node.fqn], params[node.fqn]
            if state == placement:
                param.data = (
                    shard_tensor(full.detach(), placement, self.mesh.shape, self._coord).clone().to(self._groups.device)
                )
            else:
                self._zero.add(node.name, node.fqn, full, placement, state, param=param)
        self._graph, self._xplan, self._plan = graph, xplan, plan
        # parameter FQN -> (its node, the placement it and its gradient live at: the state placement)
        self._param_state = {n.fqn: (n, xplan.sources[n.name][1]) for n in graph.params()}
        self._input_nodes = {n.fqn: n for n in graph.nodes if n.kind == "input"}
        self._local_input_shapes = {
            n.fqn: local_shape(n.outputs[0].shape, xplan.sources[n.name][0], self.mesh.shape, self._coord)
            for n in self._input_nodes.values()
        }
        bucketed = bucketable(xplan, exclude=set(self._zero.shards())) if self._bucket_bytes else {}
        sizes = {n.name: params[n.fqn].numel() * params[n.fqn].element_size() for n in graph.params()}
        self._buckets = GradBuckets(self._groups, bucketed, sizes, self._bucket_bytes) if bucketed else None
        self._sources = self._static_sources(params)
        self._programs = {False: self._lower(instrument=False)}
        self._build = self._full_params = None
        if self._zero:
            _sync_after_optimizer_steps(self)

    def _compiled(self, what: str) -> None:
        if self._build is not None:
            raise NotCompiledError(
                f"sharded.{what}: this module has not been compiled yet: autopar.compile got no example inputs, "
                "so it plans on its first call; call it once with a batch (every rank, same shapes), or pass "
                "example_inputs= to autopar.compile"
            )

    @property
    def plan(self) -> Plan:
        """The Plan this module runs (NotCompiledError before the first call of a lazily compiled module)."""
        self._compiled("plan")
        return self._plan

    @property
    def local_input_shapes(self) -> dict[str, tuple[int, ...]]:
        """Input name -> the local shape this rank's piece has (what ``input_mode='local'`` expects)."""
        self._compiled("local_input_shapes")
        return self._local_input_shapes

    @property
    def local_graph(self) -> torch.fx.GraphModule:
        """This rank's lowered program (``executor.lower``): ``print(sharded.local_graph.code)`` shows it.

        Local aten ops with the plan's moves (``move_<op>_<input>``), kernels and
        random ops (``OpStep``) inserted; one argument per parameter, buffer and
        input piece, in graph order.
        """
        self._compiled("local_graph")
        return self._programs[False]

    def _lower(self, *, instrument: bool) -> torch.fx.GraphModule:
        return lower(
            self._xplan,
            self._groups,
            self._state,
            seed=self._seed,
            state_shards=self._zero.shards(),
            buckets=self._buckets,
            instrument=instrument,
        )

    def _static_sources(self, params: dict[str, nn.Parameter]) -> list[tuple[Any, torch.Tensor | None]]:
        """Per argument of the lowered graph: (input node, None), or (None, the value every call passes)."""
        zero_buffers = self._zero.buffers()
        out: list[tuple[Any, torch.Tensor | None]] = []
        self._bucket_params, self._bucket_slots = {}, []
        for n in self._graph.nodes:
            if n.kind == "param":
                out.append((None, zero_buffers[n.name] if n.name in zero_buffers else params[n.fqn]))
                if self._buckets is not None and n.name in self._buckets:
                    self._bucket_params[n.name] = params[n.fqn]
                    self._bucket_slots.append((len(out) - 1, n.name))
            elif n.kind == "buffer":
                full = self._buffers_full.get(n.fqn)
                if full is None:  # a constant export lifted out of forward: not a model buffer
                    full = self._graph.constants[n.fqn].to(self._groups.device)
                placement = self._xplan.sources[n.name][0]
                piece = shard_tensor(full, placement, self.mesh.shape, self._coord)
                if n.fqn in self._buffers_full:  # what forward updates in place (running statistics) lives here
                    self._buffer_pieces[n.fqn] = (piece, placement, n.outputs[0].shape)
                out.append((None, piece))
            elif n.kind == "input":
                out.append((n, None))
        return out

    # ---- running ----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._build is not None:
            self._compile(args, kwargs)
        self._groups.check_alive("sharded(...)")
        wait_pending()  # the previous call's loss collective, if nobody read the loss (runtime/deferred.py)
        counter = self.collective_counter
        try:
            given = self._graph.call.match(args, kwargs, self._expected_input)
            values = [
                value if node is None else self._local_input(node, given[node.fqn]) for node, value in self._sources
            ]
        except (ValueError, TypeError) as e:  # before any collective: peers may be waiting in one
            if self._groups.fail(f"{type(e).__name__}: {e}"):
                raise type(e)(
                    f"{e}\nThe other ranks did not all fail this call, so this rank shut the mesh's process groups "
                    "down: ranks waiting in a collective fail at once instead of at the collective timeout. "
                    "Compile again to continue."
                ) from e
            raise
        if self._buckets is not None:
            self._buckets.begin(self._bucket_params, counter)
            for i, name in self._bucket_slots:
                values[i] = self._buckets.wrap(name, values[i])
        instrument = self.trace is not None or self.measure_saved
        self.saved_bytes = SavedBytes(self.parameters()) if self.measure_saved else None
        st = self._state
        st.counter, st.step, st.trace, st.saved = counter, self._step, self.trace, self.saved_bytes
        st.training = self.training
        self._step += 1
        if instrument not in self._programs:
            self._programs[instrument] = self._lower(instrument=instrument)
        with self._groups.collectives("forward"):
            self._zero.sync(counter)  # shards updated outside an optimizer step (see runtime/zero.py)
            flat = self._programs[instrument](*values)
        return self._graph.call.unflatten_outputs(flat)

    def _expected_input(self, name: str) -> tuple[tuple[int, ...], torch.dtype, str]:
        """(shape, dtype, the fix when the shape differs) of graph input ``name`` as this rank must be passed it."""
        node = self._input_nodes[name]
        if self.input_mode == "local":
            placement = ",".join(map(str, self._xplan.sources[node.name][0]))
            return (
                self._local_input_shapes[name],
                node.outputs[0].dtype,
                f"under input_mode='local' each rank passes its piece (placement {placement} of the global "
                f"{node.outputs[0].shape}); pass this rank's own slice, or use input_mode='global'",
            )
        return (
            node.outputs[0].shape,
            node.outputs[0].dtype,
            "compile again with example inputs of the new shape (or pad/trim the batch to the compiled one)",
        )

    def _local_input(self, node, value: torch.Tensor) -> torch.Tensor:
        """This rank's piece of input ``node`` from the tensor the call passed (shape and dtype already checked)."""
        value = value.to(self._groups.device)
        if self.input_mode == "local":
            return value
        return shard_tensor(value, self._xplan.sources[node.name][0], self.mesh.shape, self._coord)

    # ---- full views -------------------------------------------------------------------
    def _full(self, local: torch.Tensor, fqn: str) -> torch.Tensor:
        """The full value of parameter ``fqn`` (or its gradient) from this rank's ``local`` piece."""
        if self._build is not None:  # not compiled yet: parameters (and gradients) are still full
            return local.detach().clone()
        node, placement = self._param_state[fqn]
        return self._gathered(local, placement, node.outputs[0].shape)

    def _gathered(self, local: torch.Tensor, placement, shape: tuple[int, ...]) -> torch.Tensor:
        """The full tensor of ``shape`` whose piece under ``placement`` this rank holds as ``local``."""
        from autopar.runtime import redistribute_local

        meta = TensorMeta(shape, local.dtype)
        return redistribute_local(local.detach(), meta, placement, self._replicated, self._groups)

    @property
    def _replicated(self) -> tuple[Replicate, ...]:
        return tuple(Replicate() for _ in self.mesh.shape)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` over the full gradients (``runtime/clip.py``); call on every rank.

        Returns the norm the unpartitioned model's gradients have (the same on every
        rank) and scales every local gradient by ``min(1, max_norm / (norm + 1e-6))``.
        Use this, not ``torch.nn.utils.clip_grad_norm_(sharded.parameters())``, which
        sees only this rank's pieces.
        """
        from autopar.runtime import clip_grad_norm_

        grads = [
            (p.grad, self._replicated if self._build is not None else self._param_state[fqn][1])
            for fqn, p in self.named_parameters()
        ]
        return clip_grad_norm_(grads, self._groups, max_norm, norm_type, error_if_nonfinite)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{original FQN: full tensor}, tied aliases and buffers included (like model.state_dict())."""
        out = {fqn: self._full(p, fqn) for fqn, p in self.named_parameters()}
        for alias, canon in self._graph.tied.items():
            out[alias] = out[canon]
        for k, v in self._buffers_full.items():
            if k not in self._state_keys:  # non-persistent: not in a state dict
                continue
            # the piece forward reads holds its updates (running statistics)
            out[k] = self._gathered(*self._buffer_pieces[k]) if k in self._buffer_pieces else v.clone()
        return {k: out[k] for k in self._state_keys}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """{original FQN: full gradient} (None where no gradient was computed)."""
        return {fqn: None if p.grad is None else self._full(p.grad, fqn) for fqn, p in self.named_parameters()}

    def model_state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and ``optimizer``'s state: to compare with ``plan.memory``.

        ``params`` counts each distinct storage behind the parameters once, at its
        size: a ZeRO shard is a view of its parameter's buffer, so it is the buffer
        (the piece under the parameter's placement) that counts, as the plan does.
        ``optimizer`` counts per-element state (tensors shaped like their parameter),
        not scalar counters such as AdamW's ``step``.
        """
        params = list(self.parameters())
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        state = optimizer.state if optimizer is not None else {}
        return {
            "params": sum(storages.values()),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": sum(
                v.numel() * v.element_size()
                for p in params
                for v in state.get(p, {}).values()
                if torch.is_tensor(v) and v.shape == p.shape
            ),
        }


class NotCompiledError(RuntimeError):
    """A lazily compiled ``ShardedModule`` was asked for its plan before its first call."""


def _sync_after_optimizer_steps(module: ShardedModule) -> None:
    """After every optimizer step that updates one of ``module``'s ZeRO shards, all-gather them (runtime/zero.py).

    A global ``torch.optim`` step post-hook, so any torch optimizer works without
    being registered; it holds the module weakly and is removed with it.
    """
    ref = weakref.ref(module)

    def hook(optimizer, args, kwargs) -> None:
        mod = ref()
        if mod is not None and mod._zero.holds(p for group in optimizer.param_groups for p in group["params"]):
            mod._zero.sync(mod.collective_counter)

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(hook)
    weakref.finalize(module, handle.remove)


def compile(
    model: nn.Module,
    mesh: Mesh,
    *,
    example_inputs=None,
    example_kwargs: dict | None = None,
    mem_cap: int | str | None = None,
    profile: str | None = None,
    plan: Plan | str | Path | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    weights_from_rank0: bool = False,
    input_mode: str = "global",
    seed: int = 0,
    family: str | None = None,
    allow_state_sharding: bool = True,
    grad_bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    hints: dict | None = None,
    input_placements=None,
    output_placements=None,
    strict: bool = False,
    dtype: str | None = None,
    optimizer: str = "adamw",
) -> ShardedModule:
    """Plan (or load ``plan``) and build this rank's ``ShardedModule``.

    Must be called on every rank inside an initialized default process group whose
    world size equals ``mesh.size``; ``mesh`` is an ``autopar.Mesh`` or a torch
    ``DeviceMesh`` (``Mesh.from_device_mesh``).  ``family`` forces the search into one family
    (``"data parallel"``, ``"sharded parameters"``, ``"tensor parallel"``);
    ``allow_state_sharding=False`` keeps every gradient and optimizer state with its
    parameter (no ZeRO-1/2; see ``runtime/zero.py`` for how ZeRO plans run).
    ``grad_bucket_bytes``: data-parallel gradient all-reduces are issued per bucket
    of about that many bytes, overlapped with backward (``runtime/buckets.py``);
    ``None`` or 0 issues the plan's per-edge all-reduces one by one.

    ``example_inputs=None`` (and no ``example_kwargs``) compiles lazily: the module
    captures and plans on its first call, with that call's inputs (every rank must
    call with the same shapes; this is checked), and later calls must keep those
    shapes.  Until then ``parameters()`` are the full parameters, so an optimizer
    can be built first: compiling re-points the same Parameter objects at this
    rank's pieces; ``.plan`` raises ``NotCompiledError``.  Lazy compilation needs
    ``input_mode="global"`` (local pieces do not say the global shapes).

    ``hints``, ``input_placements``, ``output_placements``, ``strict``: semi-auto
    mode, passed to the planner as in ``autopar.plan`` (ignored with ``plan=``).

    ``dtype``: the training precision the plan prices (``costmodel.PRECISIONS``);
    None: the one the model's parameters are in (``training_precision``): float32
    parameters "fp32", bfloat16 ones "bf16-pure" (bf16 compute, gradients and
    optimizer state, as torch.optim keeps them).  ``optimizer``: the one whose
    state the plan's memory counts (``costmodel.OPTIMIZERS``: "adamw", "adam",
    "sgd", "sgd_momentum", "none"); any torch optimizer runs whatever it says.

    A ``plan=`` is checked against the model (mesh, parameter names and shapes,
    input shapes) before anything runs, on every rank alike.
    """
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime import MeshGroups

    if isinstance(mesh, DeviceMesh):  # torch's, as DTensor users hold one
        mesh = Mesh.from_device_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh {mesh!r}: expected an autopar.Mesh (e.g. autopar.Mesh((2, 2), axis_names=('dp', 'tp'))) "
            "or a torch DeviceMesh"
        )
    lazy = example_inputs is None and example_kwargs is None
    if lazy and input_mode == "local":
        raise ValueError(
            "autopar.compile(example_inputs=None, input_mode='local'): a lazy compile plans from the first call's "
            "inputs, which in local mode are only this rank's pieces; pass example_inputs= with the global "
            "shapes, or use input_mode='global'"
        )
    plan_obj = None if plan is None else _load_plan(plan, mesh, model)
    if plan is None:
        dtype = dtype or training_precision(model)
        precision(dtype), optimizer_spec(optimizer)  # unknown names fail here, on every rank alike
    groups = MeshGroups(mesh)
    full_params = _full_parameters(model, state_dict, weights_from_rank0)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def build(args: tuple, kwargs: dict) -> tuple[OpGraph, Plan]:
        _check_same_inputs_on_every_rank(args, kwargs)
        if plan_obj is None:
            found, graph = _plan_on_rank0(
                model,
                mesh,
                args,
                kwargs,
                groups,
                mem_cap=mem_cap,
                profile=profile,
                family=family,
                allow_state_sharding=allow_state_sharding,
                dtype=dtype,
                optimizer=optimizer,
                grad_bucket_bytes=grad_bucket_bytes,
                hint_options={
                    "hints": hints,
                    "input_placements": input_placements,
                    "output_placements": output_placements,
                    "strict": strict,
                },
            )
        else:
            found, graph = plan_obj, capture(model, args, kwargs)
            _check_plan_inputs(found, graph)
            _check_plan_graph(found, graph, model)
        return graph, found

    sharded = ShardedModule(
        groups,
        build=build,
        input_mode=input_mode,
        full_params=full_params,
        buffers=buffers,
        seed=seed,
        state_keys=list(model.state_dict().keys()),
        grad_bucket_bytes=grad_bucket_bytes,
    )
    sharded.train(model.training)  # the mode the model was in; dropout follows sharded.train() / .eval()
    if not lazy:
        args = (
            tuple(example_inputs)
            if isinstance(example_inputs, (tuple, list))
            else (() if example_inputs is None else (example_inputs,))
        )
        sharded._compile(args, dict(example_kwargs or {}))
    return sharded


def training_precision(model: nn.Module) -> str:
    """The ``costmodel.PRECISIONS`` name of training ``model`` as it is, from its floating parameters' dtypes.

    All float32 (or none): "fp32"; all bfloat16: "bf16-pure".  Any other mix is
    priced as "fp32" (the larger figures), with a warning naming the dtypes.
    """
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        return "bf16-pure"
    if dtypes - {torch.float32}:
        log.warning(
            "%s has %s parameters: the plan prices fp32 training (pass compile(dtype=...) to choose)",
            type(model).__name__,
            ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)),
        )
    return "fp32"


def _plan_on_rank0(
    model,
    mesh,
    args,
    kwargs,
    groups,
    *,
    mem_cap,
    profile,
    family,
    allow_state_sharding=True,
    hint_options=None,
    dtype="fp32",
    optimizer="adamw",
    grad_bucket_bytes=DEFAULT_BUCKET_BYTES,
) -> tuple[Plan, OpGraph]:
    """Rank 0 searches, every rank gets its plan (broadcast as JSON) and captures the graph itself.

    One search instead of one per rank, and every rank runs the very same plan.
    The others only trace the model (cheap) to execute it.
    """
    from autopar.planner import plan_from_context, prepare

    box: list = [None]
    graph = None
    if dist.get_rank() == 0:
        try:
            ctx = prepare(
                model,
                mesh,
                example_inputs=args,
                example_kwargs=kwargs,
                profile=profile or default_profile(groups),
                dtype=dtype,
                optimizer=optimizer,
                grad_bucket_bytes=grad_bucket_bytes,
                **(hint_options or {}),
            )
            graph = ctx.graph
            box[0] = plan_from_context(
                ctx, mem_cap=mem_cap, compare_families=False, allow_state_sharding=allow_state_sharding, family=family
            ).to_json()
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            box[0] = e
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise ValueError(f"planning failed on rank 0: {box[0]}") from box[0]
    if graph is None:
        graph = capture(model, args, kwargs)
    return Plan.from_json(box[0]), graph


def _full_parameters(model: nn.Module, state_dict, weights_from_rank0: bool) -> dict[str, Any]:
    params = dict(model.named_parameters())
    if state_dict is not None:
        _check_state_dict(state_dict, params)
        return {k: state_dict[k].detach().requires_grad_(p.requires_grad) for k, p in params.items()}
    if any(p.is_meta for p in params.values()) and not weights_from_rank0:
        raise ValueError(
            "the model is on the meta device: pass state_dict= with the full weights, or "
            "weights_from_rank0=True with real weights on rank 0"
        )
    if weights_from_rank0:
        out = {}
        for k, p in params.items():
            t = p.detach().clone() if dist.get_rank() == 0 else torch.empty(p.shape, dtype=p.dtype)
            dist.broadcast(t, src=0)
            out[k] = t.requires_grad_(p.requires_grad)
        return out
    return params


def _check_state_dict(state_dict, params: dict[str, nn.Parameter]) -> None:
    """Every parameter of the model is in ``state_dict`` as a tensor of its shape and dtype (before anything runs)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict={type(state_dict).__name__}: expected a mapping of parameter names to tensors, "
            "e.g. model.state_dict() of the full model"
        )
    bad = [f"{k}: missing" for k in params if k not in state_dict]
    for k, p in params.items():
        value = state_dict.get(k)
        if k not in state_dict:
            continue
        if not isinstance(value, torch.Tensor):
            bad.append(f"{k}: a {type(value).__name__}, expected a tensor of shape {tuple(p.shape)}")
        elif tuple(value.shape) != tuple(p.shape) or value.dtype != p.dtype:
            bad.append(
                f"{k}: shape {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}, the model's parameter "
                f"is {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
            )
        elif value.is_meta:
            bad.append(f"{k}: on the meta device (no values); expected the weights")
    if bad:
        raise ValueError(
            f"state_dict does not fit the model: {len(bad)} parameters differ:{_bullets(bad)}\n"
            "Fix: pass the full (unsharded) state dict of this model, e.g. model.state_dict() of the model built "
            "with real weights, converted to the model's dtype"
        )


def _bullets(items: list[str], limit: int = 5) -> str:
    more = f"\n  - ... and {len(items) - limit} more" if len(items) > limit else ""
    return "".join(f"\n  - {m}" for m in items[:limit]) + more


def _shape_differences(got: dict, planned: dict, where: str) -> list[str]:
    """One line per name whose shape differs between ``got`` (``where``: "in the model", "given") and the plan."""
    bad = [
        f"{name}: shape {shape} {where}, {planned[name]} in the plan"
        if name in planned
        else f"{name}: {where} {shape}, not in the plan"
        for name, shape in got.items()
        if planned.get(name) != shape
    ]
    return bad + [f"{name}: in the plan {shape}, not {where}" for name, shape in planned.items() if name not in got]


def _load_plan(plan, mesh: Mesh, model: nn.Module) -> Plan:
    """``plan`` as a Plan, checked against the mesh and the model's parameter names and shapes."""
    if isinstance(plan, Plan):
        found = plan
    elif isinstance(plan, (str, Path)):
        found = Plan.from_json(plan)
    else:
        raise TypeError(f"plan={type(plan).__name__}: expected an autopar Plan or the path of a plan JSON file")
    if tuple(found.mesh.shape) != tuple(mesh.shape):
        raise ValueError(
            f"the plan is for mesh {found.mesh} (shape {tuple(found.mesh.shape)}) but compile got {mesh} (shape "
            f"{tuple(mesh.shape)}); pass autopar.Mesh({tuple(found.mesh.shape)}, axis_names="
            f"{tuple(found.mesh.axis_names)}) or re-plan for this mesh"
        )
    planned: dict[str, tuple[int, ...]] = {}
    for fqn, entry in found.params.items():
        for name in (fqn, *entry.get("tied_to", ())):
            planned[name] = tuple(entry["shape"])
    held = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if bad := _shape_differences(held, planned, "in the model"):
        raise ValueError(
            f"the plan (for {found.model}) does not match the model {type(model).__name__}: {len(bad)} parameters "
            f"differ:{_bullets(bad)}\nFix: pass the plan made for this model (autopar plan ... -o plan.json), "
            "or leave plan= out to let compile plan it"
        )
    return found


def _check_plan_inputs(plan: Plan, graph: OpGraph) -> None:
    """The inputs the plan was made for have the shapes of the inputs compile got."""
    got = {n.fqn: tuple(n.outputs[0].shape) for n in graph.nodes if n.kind == "input"}
    planned = {k: tuple(v["shape"]) for k, v in plan.inputs.items() if v.get("kind") == "input"}
    if bad := _shape_differences(got, planned, "given"):
        raise ValueError(
            f"the inputs do not match the plan's (for {plan.model}):{_bullets(bad)}\nFix: pass inputs of the "
            "shapes the plan was made for, or re-plan with these inputs"
        )


def _check_plan_graph(plan: Plan, graph: OpGraph, model: nn.Module) -> None:
    """The plan's op nodes are the ops of the graph this rank traced (same names, same aten ops).

    torch.export traces the kernels the model's tensors run, so a plan made on
    another device (``meta``, CUDA) or another library version can describe another
    graph: HF attention's ``.contiguous()`` of a transposed output is a copy on one
    device and a no-op on another.
    """
    traced = {n.name: str(n.target) for n in graph.nodes if n.kind == "op"}
    planned = {name: entry["op"] for name, entry in plan.nodes.items()}
    bad = [f"{name}: {op} in the plan, not in the traced graph" for name, op in planned.items() if name not in traced]
    bad += [f"{name}: {op} in the traced graph, not in the plan" for name, op in traced.items() if name not in planned]
    bad += [
        f"{name}: {op} in the plan, {traced[name]} in the traced graph"
        for name, op in planned.items()
        if name in traced and traced[name] != op
    ]
    if bad:
        raise ValueError(
            f"the plan (for {plan.model}) describes another graph than {type(model).__name__} traces here: "
            f"{len(bad)} ops differ:{_bullets(bad)}\ntorch.export records the ops the model's tensors run, which "
            "can differ between devices (a plan made on the meta device or a GPU, used on CPU) and library "
            "versions.\nFix: plan on the device and versions you run on (the same dtype and example inputs), "
            "or leave plan= out to let compile plan it"
        )


def _input_signature(args: tuple, kwargs: dict) -> list[str]:
    flat = torch.utils._pytree.tree_flatten((args, kwargs))[0]
    return [f"{tuple(t.shape)} {t.dtype}".replace("torch.", "") if torch.is_tensor(t) else repr(t) for t in flat]


def _check_same_inputs_on_every_rank(args: tuple, kwargs: dict) -> None:
    """Every rank compiles with inputs of the same shapes (else their graphs differ and collectives would hang)."""
    mine = _input_signature(args, kwargs)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, sig in enumerate(every) if sig != every[0]]
    if differ:
        raise ValueError(
            "autopar.compile: the ranks got inputs of different shapes:"
            + _bullets([f"rank {r}: {', '.join(every[r])}" for r in [0, *differ]], limit=4)
            + "\nFix: every rank passes the same global batch (input_mode='global'); for per-rank data "
            "compile with example_inputs of the global shapes and input_mode='local'"
        )
