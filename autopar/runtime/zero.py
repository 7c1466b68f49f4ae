"""ZeRO-1/2 at run time: a parameter whose gradient and optimizer state are sharded beyond its placement.

A plan may keep a parameter at placement ``pl`` (say ``R`` on ``dp``) and its
*state* — gradient and optimizer state — at ``st`` (``S(0)`` on ``dp``).  On each
rank ``StateShards`` then holds:

- the **buffer**: the parameter's piece under ``pl``, what forward reads;
- the **shard**: the ``nn.Parameter`` under the original name, the piece under
  ``st``, and a *view into the buffer*: ``st``'s piece lies inside ``pl``'s one as
  one index range per dim when ``st`` only adds shards, on axes ``pl``
  replicates, of dims no other axis shards (``shard_view``; other pairs are
  refused with the reason: the step's all-gather could not run on the nested
  layout anyway, so the planner never picks them).  The optimizer sees only the
  shard, so its state (AdamW's ``exp_avg``/``exp_avg_sq``) is ``st``-sized, and
  its in-place update writes this rank's part of the buffer.

Bytes held per parameter are therefore buffer (``pl``) + gradient (``st``) +
optimizer state (``st``): the plan's ``params``/``grads``/``optimizer`` figures
(``ShardedModule.model_state_bytes`` counts the shard's storage once, as the buffer).

Gradients: forward reads the buffer through ``from_state_shard`` (given the
edge's ``redistribute.Move``), whose backward moves the consumer's gradient to
``st`` (e.g. ``P(sum) -> S(0)``, the plan's reduce-scatter) and hands it to the
shard.

The step's all-gather (``st -> pl``, the plan's ``"optimizer"``-phase entries)
rebuilds the rest of the buffer.  It runs right after any ``torch.optim``
optimizer step whose parameter groups hold one of the shards (a global
optimizer step post-hook, ``ShardedModule`` installs it), so one training step
issues exactly the plan's list; as a fallback for updates made outside an
optimizer (``load_state_dict``, a manual ``no_grad`` edit) ``sync`` also runs at
the start of every forward and gathers each shard whose version counter moved.
Every rank must update the same shards (the same optimizer calls), as with any
collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from autopar.pieces import dim_index, shard_tensor
from autopar.placement import Placement, Shard
from autopar.spec import TensorMeta

from .counter import CollectiveCounter
from .groups import MeshGroups
from .redistribute import Move, nesting_conflict, redistribute_local

__all__ = ["StateShards", "from_state_shard"]

log = logging.getLogger(__name__)


def _fmt(placements) -> str:
    return ",".join(map(str, placements))


def _dim_positions(size: int, d: int, pl, st, mesh_shape, coord) -> tuple[int, int] | None:
    """(start, length) of ``st``'s indices on dim ``d`` inside ``pl``'s local piece, or None if not one range."""

    def idx(placements) -> torch.Tensor:
        entries = [
            (p, mesh_shape[a], coord[a]) for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d
        ]
        return dim_index(size, entries) if entries else torch.arange(size)

    have, want = idx(pl), idx(st)
    where = torch.full((size,), -1, dtype=torch.long)
    where[have] = torch.arange(have.numel())
    pos = where[want]
    if want.numel() == 0:
        return (0, 0)
    start = int(pos[0])
    if start < 0 or not torch.equal(pos, torch.arange(start, start + want.numel())):
        return None
    return start, want.numel()


def shard_view(buffer: torch.Tensor, shape, pl, st, mesh_shape, coord) -> torch.Tensor | None:
    """The piece under ``st`` as a view of ``buffer`` (the piece under ``pl``), or None when it is not a view."""
    view = buffer
    for d, size in enumerate(shape):
        rng = _dim_positions(size, d, pl, st, mesh_shape, coord)
        if rng is None:
            return None
        if rng != (0, buffer.shape[d]):
            view = view.narrow(d, *rng)
    return view


@dataclass
class _Entry:
    fqn: str
    meta: TensorMeta
    placement: tuple[Placement, ...]
    state: tuple[Placement, ...]
    buffer: torch.Tensor
    shard: nn.Parameter
    version: int


class _FromStateShard(torch.autograd.Function):
    """Forward: the buffer moved ``src -> dst``; backward: the gradient moved ``grad_src -> grad_dst`` to the shard."""

    @staticmethod
    def forward(ctx, shard, buffer, move: Move, counter):  # noqa: D102
        ctx.move, ctx.counter = move, counter
        return move.forward_value(buffer, counter)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):  # noqa: D102
        if ctx.move.moves_grad:
            grad = ctx.move.local_grad(grad, ctx.counter)
        return grad, None, None, None


def from_state_shard(
    shard: torch.Tensor, buffer: torch.Tensor, move: Move, counter: CollectiveCounter | None = None
) -> torch.Tensor:
    """A ZeRO parameter read by one op: ``buffer`` (piece under ``move.src``) moved to ``move.dst``.

    ``move.grad_dst`` is the state placement: backward moves the op's gradient there
    and accumulates it into ``shard``.  Without autograd this is ``move.local``.
    """
    if not (torch.is_grad_enabled() and shard.requires_grad):
        return move.local(buffer, counter) if move.moves_value else buffer
    return _FromStateShard.apply(shard, buffer, move, counter)


class StateShards:
    """This rank's ZeRO-1/2 parameters: buffer + shard per parameter, and the step's all-gather (``sync``)."""

    def __init__(self, groups: MeshGroups) -> None:
        self._groups = groups
        self._entries: dict[str, _Entry] = {}  # planning node name -> entry

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(
        self,
        name: str,
        fqn: str,
        full: torch.Tensor,
        placement: tuple[Placement, ...],
        state: tuple[Placement, ...],
        param: nn.Parameter | None = None,
    ) -> nn.Parameter:
        """Register a parameter from its global value ``full``; return its shard ``nn.Parameter``.

        ``param`` given: that Parameter object is re-pointed at the shard (``.data``),
        so an optimizer built before a lazy compile keeps working.
        """
        mesh_shape, coord = self._groups.mesh.shape, self._groups.coordinate
        meta = TensorMeta(tuple(full.shape), full.dtype)
        conflict = nesting_conflict(meta, state, placement, mesh_shape)
        if conflict is not None:
            raise ValueError(
                f"parameter {fqn}: the plan keeps it at ({_fmt(placement)}) and its state at ({_fmt(state)}), "
                f"but the step's all-gather between them cannot run on the nested layout: {conflict}. "
                "Fix: edit the plan so the state only adds shards of a dim no other axis shards"
            )
        full = full.detach()
        buffer = shard_tensor(full, placement, mesh_shape, coord).clone().to(self._groups.device)
        view = shard_view(buffer, meta.shape, placement, state, mesh_shape, coord)
        if view is None:
            raise ValueError(
                f"parameter {fqn}: its state piece under ({_fmt(state)}) is not a range of its piece under "
                f"({_fmt(placement)}) at mesh coordinate {coord}, so the optimizer's shard cannot alias the "
                "parameter. Fix: edit the plan so the state only adds shards, on axes the placement replicates, "
                "of dims no other axis shards"
            )
        if param is None:
            param = nn.Parameter(view, requires_grad=full.requires_grad)
        else:
            param.data = view
        self._entries[name] = _Entry(fqn, meta, tuple(placement), tuple(state), buffer, param, param._version)
        return param

    def drop(self, name: str) -> None:
        """Forget parameter ``name`` (a pipelined plan's weight another stage holds): no buffer, no all-gather."""
        self._entries.pop(name, None)

    # ---- views --------------------------------------------------------------------------
    def buffers(self) -> dict[str, torch.Tensor]:
        """Planning node name -> buffer (the parameter's piece under its placement)."""
        return {n: e.buffer for n, e in self._entries.items()}

    def shards(self) -> dict[str, nn.Parameter]:
        """Planning node name -> shard (the ``nn.Parameter`` the optimizer updates)."""
        return {n: e.shard for n, e in self._entries.items()}

    def buffer(self, fqn: str) -> torch.Tensor:
        """The buffer of parameter ``fqn`` (what forward reads)."""
        return next(e.buffer for e in self._entries.values() if e.fqn == fqn)

    def holds(self, params) -> bool:
        """Whether any of ``params`` is one of the shards."""
        mine = {id(e.shard) for e in self._entries.values()}
        return any(id(p) in mine for p in params)

    # ---- the step's all-gather ----------------------------------------------------------
    def sync(self, counter: CollectiveCounter | None = None, *, force: bool = False) -> int:
        """All-gather every shard updated since the last sync (``force``: every shard) into its buffer; return how many.

        Records the plan's ``"optimizer"`` collectives.  Collective: every rank must
        call it with the same shards updated (``force`` after a checkpoint load,
        which may leave a rank's empty shard untouched).
        """
        done = 0
        with torch.no_grad():
            for e in self._entries.values():
                if e.shard._version == e.version and not force:
                    continue
                full = redistribute_local(
                    e.shard.detach(), e.meta, e.state, e.placement, self._groups, phase="optimizer", counter=counter
                )
                if full.untyped_storage().data_ptr() != e.buffer.untyped_storage().data_ptr():
                    e.buffer.copy_(full)
                e.version = e.shard._version
                done += 1
        return done
