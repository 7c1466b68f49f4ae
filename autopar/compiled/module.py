"""``ShardedModule``: one rank's compiled model, an ``nn.Module`` running the plan's local program.

The module holds this rank's shards as ``nn.Parameter``s under the original
names (``named_parameters()`` yields ``transformer.h.0.attn.c_attn.weight`` etc.),
runs the captured graph lowered to this rank's local ops with the plan's moves
inserted (``autopar.lower``; printable as ``sharded.local_graph.code``) and
returns full tensors: the loss as planned (the plan makes it replicated), other
outputs gathered (outside the plan's collective list, which covers the training
step).

Gradient clipping: ``sharded.clip_grad_norm_(max_norm)`` clips by the full gradient's
norm (``runtime/clip.py``); ``torch.nn.utils.clip_grad_norm_`` over the local shards
would not.

Instrumentation, off by default because it costs a hook per op:
``sharded.trace = {}`` records each op's local outputs (op node name -> tensors)
and ``sharded.measure_saved = True`` makes every forward measure what it saves
for backward (``sharded.saved_bytes``, an ``lower.SavedBytes``); either runs
the instrumented variant of the local graph.

Input modes: ``input_mode="global"`` (default) — every rank passes the same global
batch and keeps its planned piece; ``input_mode="local"`` — each rank passes only
its own piece (e.g. its data-parallel slice from a DistributedSampler), which must
have the local shape the plan gives it (``sharded.local_input_shapes``).

ZeRO-1/2: where the plan shards a parameter's gradient and optimizer state beyond
its placement, the ``nn.Parameter`` is the state shard (a view into the piece
forward reads) and the optimizer step's all-gather runs right after
``opt.step()`` (``runtime/zero.py``).  ``model_state_bytes(opt)`` gives the bytes
held, to compare with ``plan.memory``.

Train and eval mode: the module starts in the mode ``model`` was in; ``sharded.eval()``
turns dropout off and makes batch and instance norm use their running statistics
(their ops run their eval form, ``EVAL_FORMS`` in ``lower/steps.py``), and ``sharded.train()``
undoes both, as on the model itself.  The graph is traced in train
mode, so Python branches on ``self.training`` inside the model keep their
train-mode choice in both.

Inputs of other shapes than the compiled ones raise in ``forward`` on the ranks
that pass them; when not every rank does, those ranks shut the mesh's process
groups down (``MeshGroups.fail``), so the others, already waiting in a collective,
raise the same reason at once instead of at the process group's timeout; the
module must then be compiled again.

The loss: its last collective (and the sums and scalings after it) is started
without waiting (``runtime/deferred.py``): ``forward`` returns a ``PendingLoss``
that waits on first read (``float(loss)``, ``loss.item()``, ``loss.detach()``),
and ``loss.backward()`` does not wait for it, so a data-parallel step has no
synchronization in forward, like DDP's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from autopar.capture import OpGraph
from autopar.lower import ExecutionPlan, RunState, SavedBytes, lower
from autopar.pieces import shard_tensor
from autopar.placement import Placement, Replicate
from autopar.planner import Plan
from autopar.runtime import DEFAULT_BUCKET_BYTES, GradBuckets, StateShards, bucketable, wait_pending
from autopar.spec import TensorMeta, local_shape

from .micro_steps import MicroBatchSteps
from .pipeline_runner import PipelineRunner, from_owner

__all__ = ["ShardedModule", "NotCompiledError", "LocalState"]


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, value)


class ShardedModule(MicroBatchSteps, nn.Module):
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
        self._holding = False  # in a train_step of micro-batches: the buckets reduce once after it (micro_steps)
        self.collective_counter = None  # set a runtime.CollectiveCounter to record every collective issued
        self.trace = None  # set a dict to record each op's local outputs (op node name -> tensors)
        self.measure_saved = False  # True: every forward measures what it saves for backward (saved_bytes)
        self.saved_bytes = None  # after a forward with measure_saved: lower.SavedBytes
        self._state = RunState()  # what the lowered graph's steps read per call
        self._programs: dict[bool, torch.fx.GraphModule] = {}  # instrumented? -> lowered graph (autopar.lower)
        self._sources: list[tuple[Any, torch.Tensor | None]] = []  # per graph argument: (input node, None) or value
        self._bucket_params: dict[str, torch.Tensor] = {}
        self._bucket_slots: list[tuple[int, str]] = []  # (argument index, param node name) of bucketed params
        self._seed = seed
        self._runner: PipelineRunner | None = None  # a pipelined plan's stages and schedule
        self._eval_runner: PipelineRunner | None = None  # its forward-only pipeline (sharded(...)), built on first use
        self._values: list | None = None  # during a pipelined step: the program's argument values
        self._arg_params: list = []
        self._owners: dict[str, int] = {}  # pipelined: parameter FQN -> the first pipeline coordinate holding it
        self._holders: dict[str, tuple[int, ...]] = {}  # pipelined: parameter FQN -> every coordinate holding it
        self._pipeline_axis = -1
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
        pipelined = plan.pipeline is not None
        bucketed = bucketable(xplan, exclude=set(self._zero.shards())) if self._bucket_bytes else {}
        sizes = {n.name: params[n.fqn].numel() * params[n.fqn].element_size() for n in graph.params()}
        flat = frozenset(tuple(sorted(self.mesh.axis_index(a) for a in axes)) for axes in plan.flat_grad_axes)
        self._groups.add_flat_groups(sorted(flat))  # collective: the plan's sets, alike on every rank
        self._buckets = GradBuckets(self._groups, bucketed, sizes, self._bucket_bytes, flat=flat) if bucketed else None
        self._sources = self._static_sources(params)
        if pipelined:
            self._runner = self._pipeline_runner(train=True)
        else:
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
    def coordinate(self) -> tuple[int, ...]:
        """This rank's coordinate on ``self.mesh``."""
        return self._coord

    @property
    def local_input_shapes(self) -> dict[str, tuple[int, ...]]:
        """Input name -> the local shape this rank's piece has (what ``input_mode='local'`` expects)."""
        self._compiled("local_input_shapes")
        return self._local_input_shapes

    @property
    def local_graph(self) -> torch.fx.GraphModule:
        """This rank's lowered program (``autopar.lower``): ``print(sharded.local_graph.code)`` shows it.

        Local aten ops with the plan's moves (``move_<op>_<input>``), kernels and
        random ops (``OpStep``) inserted; one argument per parameter, buffer and
        input piece, in graph order.
        """
        self._compiled("local_graph")
        return self._programs[False]

    def _lower(self, *, instrument: bool, defer_loss: bool = True) -> torch.fx.GraphModule:
        return lower(
            self._xplan,
            self._groups,
            self._state,
            seed=self._seed,
            state_shards=self._zero.shards(),
            buckets=self._buckets,
            instrument=instrument,
            defer_loss=defer_loss,
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
        if self._plan.pipeline is not None:
            return self._pipeline_forward(args, kwargs)
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
        if self._buckets is not None and not self._holding:  # a step of micro-batches reduces once (train_step)
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
        owner = self._owners.get(fqn)
        if owner is None:
            return self._gathered(local, placement, node.outputs[0].shape)
        axis = self.mesh.axis_index(self._plan.pipeline.axis)  # a pipelined plan: its stage's ranks hold it
        mine = self._coord[axis] == owner and local is not None
        full = self._gathered(local, placement, node.outputs[0].shape) if mine else None
        return from_owner(full, node.outputs[0].shape, node.outputs[0].dtype, owner, self._groups.axis_group(axis))

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
        from autopar.runtime import clip_grad_norm_, replication

        grads = []
        for fqn, p in self.named_parameters():
            placement = self._replicated if self._build is not None else self._param_state[fqn][1]
            if fqn in self._holders:  # a pipelined plan: held by its stages' ranks only, not the whole axis
                p_size = self.mesh.shape[self._pipeline_axis]
                grads.append(
                    (p.grad, placement, replication(placement, self.mesh.shape) // p_size * len(self._holders[fqn]))
                )
            else:
                grads.append((p.grad, placement))
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

    def local_state(self) -> dict[str, LocalState]:
        """This rank's piece of every state-dict entry, tied aliases left out (``tied_aliases``).

        Parameters are given at their state placement: the ``nn.Parameter`` the
        optimizer updates (under ZeRO the state shard, a view into the piece forward
        reads), so a parameter's optimizer state has the same layout.  Buffers forward
        reads are its pieces (they hold running-statistics updates); others are whole.
        The tensors are the live ones: writing into them (a checkpoint load) changes
        the module; call ``after_load()`` once every rank has written.
        """
        self._compiled("local_state")
        params = dict(self.named_parameters())
        out: dict[str, LocalState] = {}
        for key in self._state_keys:
            if key in self._graph.tied:
                continue
            if key in params:
                p = params[key]
                node_state = self._param_state.get(key)
                if node_state is None:  # a parameter no op reads: every rank keeps it whole
                    out[key] = LocalState(p.detach(), self._replicated, tuple(p.shape))
                else:
                    node, placement = node_state
                    held = key not in self._owners or self._coord[self._pipeline_axis] in self._holders[key]
                    out[key] = LocalState(p.detach(), tuple(placement), tuple(node.outputs[0].shape), held)
            elif key in self._buffer_pieces:
                piece, placement, shape = self._buffer_pieces[key]
                out[key] = LocalState(piece, tuple(placement), tuple(shape))
            else:
                full = self._buffers_full[key]
                out[key] = LocalState(full, self._replicated, tuple(full.shape))
        return out

    @property
    def tied_aliases(self) -> dict[str, str]:
        """Alias FQN -> canonical FQN of one parameter (GPT-2: ``lm_head.weight`` -> ``transformer.wte.weight``)."""
        self._compiled("tied_aliases")
        return {a: c for a, c in self._graph.tied.items() if a in self._state_keys}

    def after_load(self) -> None:
        """Make the module consistent after ``local_state()``'s tensors were written (collective: every rank).

        Re-gathers every ZeRO parameter's buffer from its state shard, the step's
        all-gather (``runtime/zero.py``), whether or not this rank's shard changed.
        """
        self._compiled("after_load")
        self._zero.sync(self.collective_counter, force=True)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """{original FQN: full gradient} (None where no gradient was computed)."""
        if self._owners:  # pipelined: each from its stage's ranks, None there is None everywhere
            return {fqn: self._full(p.grad, fqn) for fqn, p in self.named_parameters()}
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


class LocalState(NamedTuple):
    """One state-dict entry on this rank: its piece (``local``) under ``placements`` of a ``shape`` tensor;
    ``held=False``: none (a pipelined plan's weight of another stage: ``local`` is empty)."""

    local: torch.Tensor
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    held: bool = True


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
