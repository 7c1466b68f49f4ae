"""The steps a lowered program calls: moves (``MoveStep``) and ops that need more than their aten call (``OpStep``).

An ``OpStep`` runs an op's local kernel, re-seeds the RNG around a random op,
re-gathers the all-gathered parameters an op saved for backward (FSDP), runs the
op's eval form in eval mode, and in the instrumented program records what the op
outputs and saves (``RunState.trace``, ``SavedBytes``).

Randomness (dropout): a random op re-seeds the RNG from (seed, step, node, this
rank's coordinates on the axes where the op's output is *sharded*), so ranks
that hold the same (replicated) values draw the same mask and ranks holding
different shards draw their own parts — Megatron's and Paddle's local/global
seed policy.  The RNG state around the op is restored afterwards.

Train and eval mode: the graph is traced in train mode.  When the compiled module
is in eval mode (``RunState.training`` False, from ``ShardedModule.eval()``), the
ops whose behaviour ``nn.Module.eval()`` switches in the aten graph run their
eval form: dropout (``aten.dropout``, ``aten.native_dropout``: ``train=False``)
and attention dropout (``scaled_dot_product_attention``: ``dropout_p=0``)
feature and alpha dropout, batch and instance norm with running statistics (which
they then normalize with, not the batch's) (``EVAL_FORMS``); an op whose only
effect is a buffer update (``num_batches_tracked.add_(1)``, result unused) is
skipped, as a module in eval mode updates no running statistics.  Python
branches on ``self.training`` inside the model were decided when it was traced
(train mode) and stay so.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.runtime import Move, from_state_shard

from .fused_loss import FusedLoss, decomposed_values
from .program import RunState, SavedBytes

__all__ = ["EVAL_FORMS", "MoveStep", "OpOptions", "OpStep", "TraceDecomposed"]

aten = torch.ops.aten
# op -> (argument, the value eval mode gives it): what nn.Module.eval() changes in a train-mode graph
# (batch and instance norm: only with running statistics; without, eval mode normalizes by the batch too)
EVAL_FORMS = {
    aten.dropout.default: ("train", False),
    aten.native_dropout.default: ("train", False),
    aten.feature_dropout.default: ("train", False),
    aten.alpha_dropout.default: ("train", False),
    aten.feature_alpha_dropout.default: ("train", False),
    aten.scaled_dot_product_attention.default: ("dropout_p", 0.0),
    aten.batch_norm.default: ("training", False),
    aten.native_batch_norm.default: ("training", False),
    aten._native_batch_norm_legit.default: ("training", False),
    aten.instance_norm.default: ("use_input_stats", False),
}


def _eval_form(target, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``target``'s arguments with its ``EVAL_FORMS`` entry applied (positional or keyword, as given)."""
    name, value = EVAL_FORMS[target]
    names = [a.name for a in target._schema.arguments]
    at = names.index(name)
    if at < len(args):
        return (*args[:at], value, *args[at + 1 :]), kwargs
    return args, {**kwargs, name: value}


@contextlib.contextmanager
def _regather_saved(gathered: tuple, counter, record: SavedBytes | None = None, op: str = ""):
    """FSDP: an op that saves an all-gathered parameter keeps only a handle; backward gathers it again.

    ``gathered`` lists (full tensor, (local shard, Move)).  A saved tensor that
    shares storage with a gathered parameter is packed as the recipe to rebuild it
    (the shard and the view's size/stride/offset); unpacking issues the plan's
    backward all-gather (the Move's forward steps, recorded as ``"backward"``).
    Every other saved tensor is kept as is and, when ``record`` is given, measured
    there (``SavedBytes``).  With nothing gathered and no record this is a no-op.
    """
    if not gathered and record is None:
        yield
        return
    # autograd keeps the pack hook alive with every tensor it saved (until backward): it must not hold the
    # gathered tensors themselves, or every gathered parameter lives until backward; their storages' addresses
    # identify them while the op runs
    by_storage = {full.untyped_storage().data_ptr(): recipe for full, recipe in gathered}
    del gathered

    def pack(t: torch.Tensor):
        recipe = by_storage.get(t.untyped_storage().data_ptr())
        if recipe is not None:
            return ("regather", recipe, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.requires_grad)
        if record is not None:
            record.add(t, op)
        return t

    def unpack(packed):
        if not (isinstance(packed, tuple) and packed and packed[0] == "regather"):
            return packed
        _, (local, move), size, stride, offset, _ = packed
        return move.local(local.detach(), counter, phase="backward").as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Step:
    """A callable the lowered graph calls; ``__name__`` is what ``gm.code`` shows."""

    def __init__(self, name: str, state: RunState) -> None:
        self.__name__ = self.__qualname__ = name
        self.state = state


class MoveStep(_Step):
    """One edge's ``Move`` (or a ZeRO read, ``shard`` given) in the lowered graph.

    Records in ``state.counter`` unless ``counted`` is false; a moved parameter
    (``param``) is marked as model state in ``state.saved`` when measuring.
    """

    def __init__(self, name: str, state: RunState, move: Move, *, shard=None, param=False, counted=True) -> None:
        super().__init__(name, state)
        self.move, self.shard, self.param, self.counted = move, shard, param, counted

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        counter = self.state.counter if self.counted else None
        if self.shard is None:
            out = self.move(x, counter)
        else:  # read the ZeRO buffer; the gradient goes to the state shard
            out = from_state_shard(self.shard, x, self.move, counter)
        if self.param and self.state.saved is not None:
            self.state.saved.add_parameter(out)  # a moved copy of a parameter is model state too
        return out


@dataclass(frozen=True, slots=True)
class OpOptions:
    """What an ``OpStep`` does besides calling its op; the defaults do nothing more.

    ``regather``: the ``Move`` of each all-gathered parameter the op reads, gathered
    again in backward instead of kept (FSDP).  ``seed_key``: (seed, node index, sharded
    coordinates) of a random op; the RNG seed also takes ``state.step``.
    ``rng_devices``: the devices whose RNG a random op forks (none: the CPU generator
    only).  ``instrument``: record the op's outputs (``state.trace``) and, with
    ``measure``, what it saves for backward (``SavedBytes``; not inside a recompute
    region, where the checkpoint keeps what is saved).  ``eval_target``: the aten op
    whose ``EVAL_FORMS`` entry applies when ``state.training`` is False (then no RNG is
    forked: the eval form draws nothing).  ``eval_skips``: the op only writes a model
    buffer (its result is unused), and in eval mode is not run (its first argument, the
    buffer it writes, is returned).
    """

    regather: tuple[Move, ...] = ()
    seed_key: tuple | None = None
    rng_devices: tuple = ()
    instrument: bool = False
    measure: bool = True
    eval_target: Any = None
    eval_skips: bool = False


class OpStep(_Step):
    """One op that needs more than its aten call: a kernel, an RNG seed, FSDP re-gather or instrumentation.

    Called as ``step(*args, **kwargs)``, or ``step(pairs, *args, **kwargs)`` with
    ``options.regather`` moves, ``pairs`` holding each gathered parameter's (full,
    local piece) in the same order.  What else it does: ``OpOptions``.
    """

    def __init__(self, name: str, state: RunState, fn, options: OpOptions | None = None) -> None:
        super().__init__(name, state)
        opts = options or OpOptions()
        self.fn, self.regather, self.seed_key = fn, tuple(opts.regather), opts.seed_key
        self.instrument = opts.instrument
        self.measure = opts.instrument and opts.measure  # record what the op saves (not inside a recompute region)
        self.rng_devices = list(opts.rng_devices)
        self.eval_target, self.eval_skips = opts.eval_target, opts.eval_skips

    def seed(self, step: int) -> int:
        seed, index, coords = self.seed_key
        return zlib.crc32(repr((seed, step, index, coords)).encode()) & 0x7FFFFFFF

    def __call__(self, *args, **kwargs):
        state = self.state
        gathered = ()
        if self.regather:
            gathered = tuple((full, (local, move)) for (full, local), move in zip(args[0], self.regather))
            args = args[1:]
        with _regather_saved(gathered, state.counter, state.saved if self.measure else None, self.__name__):
            if self.eval_skips and not state.training:
                out = args[0]
            elif self.eval_target is not None and not state.training:
                args, kwargs = _eval_form(self.eval_target, args, kwargs)
                out = self.fn(*args, **kwargs)
            elif self.seed_key is None:
                out = self.fn(*args, **kwargs)
            else:
                with torch.random.fork_rng(devices=self.rng_devices):
                    if self.rng_devices:
                        torch.manual_seed(self.seed(state.step))
                    else:  # CPU ranks: only the CPU generator (torch.manual_seed also queues lazy device seeding)
                        torch.default_generator.manual_seed(self.seed(state.step))
                    out = self.fn(*args, **kwargs)
        if self.instrument and state.trace is not None:
            state.trace[self.__name__] = [
                t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            ]
        return out


class TraceDecomposed(_Step):
    """Instrumented program only: records what a fused cross-entropy's unfused nodes would output (``state.trace``)."""

    def __init__(self, name: str, state: RunState, group: FusedLoss) -> None:
        super().__init__(name, state)
        self.group = group

    def __call__(self, x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> None:
        if self.state.trace is not None:
            self.state.trace.update(decomposed_values(self.group, x, index, valid))
