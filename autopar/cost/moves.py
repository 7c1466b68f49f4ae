"""The runtime's step list of a move, for many tensors at once: one reference move per form, scaled.

The coster prices every pair of placements of every tensor an edge carries: on a
three-axis mesh that is about 700 000 moves for a 4-layer GPT-2, each of which
``runtime.nesting_steps`` answers by walking ``transitions`` and the nested-layout
check.  Those answers depend on the tensor only through its shape, and for most
shapes only through its byte count:

    a move ``src -> dst`` of a tensor whose every dim ``d`` is a multiple of
    ``need[d]``, the product of the sizes of the axes that shard ``d`` in ``src`` or
    ``dst`` and of the least common multiple of those shards' block counts, splits
    evenly at every step (every placement on the way holds only shards of ``src``
    and ``dst``), so each step's local bytes are the tensor's bytes over ``D``, the
    product of the sizes of the axes that shard it when the step runs, and the
    nested layout holds every placement on the way.

Nor do the answers depend on which dims are which: renaming the tensor's dims in
``src`` and ``dst`` alike renames them in every step.  ``MoveSteps`` therefore puts
each (src, dst) in a *form*, its sharded dims renamed 0, 1, ... in order of first
appearance, asks ``nesting_steps`` once per form on a reference tensor of dims
``need``, records each step's divisor ``D = reference bytes / step bytes`` (an exact
integer), and answers a tensor that splits evenly with ``bytes // D`` per step.  A
tensor that does not is answered from its dims (``MoveSteps``), unless the move has
block-wise shards: those go to ``nesting_steps`` itself.  The answer is the same
steps either way (``tests/test_moves.py`` holds the two to equality).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autopar.placement import Placement, Replicate, Shard, parse_placements
from autopar.runtime import nesting_steps
from autopar.spec import TensorMeta
from autopar.transitions import AxisTransition

__all__ = ["MoveSteps"]


@dataclass(frozen=True, slots=True)
class _Move:
    """One (src, dst) in the tensor's own dims: which dims must split evenly, and its steps scaled."""

    dims: tuple[int, ...]  # the tensor dims the move shards
    need: tuple[int, ...]  # what each of ``dims`` must be a multiple of for the scaled steps to hold
    blocked: bool  # a block-wise shard in src or dst: only a shape of multiples of ``need`` scales
    #: per step: (axis, kind, divisor of the tensor's bytes (0: a local step), the divisor of each of ``dims``
    #: (None: block-wise shards, which only the even split scales), reduce op, src, dst); None: the runtime
    #: cannot run the move on the nested layout
    steps: tuple[tuple, ...] | None


class MoveSteps:
    """``nesting_steps(meta, src, dst, mesh_shape)``'s steps (None where the runtime cannot run the move), from
    one reference move per form; ``src``, ``dst``: tuples of placements.

    A move without block-wise shards scales to any shape: a dim ``n`` split by axes of
    sizes ``a``, ``b`` in turn keeps ``ceil(ceil(n / a) / b) = ceil(n / (a b))`` elements
    on coordinate 0 (the largest piece, which ``local_shape`` measures), so a step's
    bytes are the item size times, per dim, ``ceil(n / D_d)``, ``D_d`` the product of the
    sizes of the axes sharding ``d`` when the step runs; and without blocks the nested
    layout holds every shape (``pieces.unlayable_reason``).
    """

    def __init__(self, mesh_shape: tuple[int, ...]) -> None:
        self.mesh_shape = tuple(mesh_shape)
        self._moves: dict = {}  # (src, dst), or the caller's key for them -> _Move
        self._forms: dict[tuple, tuple] = {}  # form's (src, dst) -> (need, steps in the form's dims)

    def steps(
        self, meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], pair=None
    ) -> tuple[AxisTransition, ...] | None:
        """Every step (local ones included), as ``nesting_steps`` lists them.  ``pair``: a key naming
        (src, dst) one to one, cheaper to hash than the placements (the coster's small ints); default both."""
        move = self._move(src, dst, pair)
        nbytes = self._sizer(meta, move)
        if nbytes is None:
            all_steps, conflict = nesting_steps(meta, src, dst, self.mesh_shape)
            return None if conflict is not None else all_steps
        if move.steps is None:
            return None
        return tuple(
            AxisTransition(a, k, nbytes(d, per_dim) if k else 0, op, s, t) for a, k, d, per_dim, op, s, t in move.steps
        )

    def collectives(
        self, meta: TensorMeta, src: tuple[Placement, ...], dst: tuple[Placement, ...], pair=None
    ) -> list[tuple[str, int, int]] | None:
        """(kind, bytes, axis) of each collective step, in order (the coster's hot path: no step objects)."""
        move = self._move(src, dst, pair)
        nbytes = self._sizer(meta, move)
        if nbytes is None:
            all_steps, conflict = nesting_steps(meta, src, dst, self.mesh_shape)
            return None if conflict is not None else [(t.kind, t.bytes, t.axis) for t in all_steps if t.kind]
        if move.steps is None:
            return None
        return [(k, nbytes(d, per_dim), a) for a, k, d, per_dim, _, _, _ in move.steps if k is not None]

    @staticmethod
    def _sizer(meta: TensorMeta, move: _Move):
        """``f(divisor, dim divisors)``: a step's bytes for ``meta``; None: only ``nesting_steps`` knows them."""
        shape = meta.shape
        for d, n in zip(move.dims, move.need):
            if shape[d] % n:
                break
        else:
            total = meta.nbytes
            return lambda divisor, _: total // divisor
        if move.blocked:
            return None  # block-wise shards on an uneven dim
        item = meta.itemsize
        rest = math.prod(n for d, n in enumerate(shape) if d not in move.dims)
        sizes = [shape[d] for d in move.dims]

        def uneven(_, per_dim) -> int:
            out = item * rest
            for n, k in zip(sizes, per_dim):
                out *= -(-n // k)
            return out

        return uneven

    def _move(self, src, dst, pair) -> _Move:
        key = (src, dst) if pair is None else pair
        move = self._moves.get(key)
        if move is None:
            move = self._moves[key] = self._renamed(tuple(parse_placements(src)), tuple(parse_placements(dst)))
        return move

    def _renamed(self, src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> _Move:
        """The move's form (dims renamed in order of first appearance), priced once, in the move's own dims."""
        dims: list[int] = []
        for p in src + dst:
            if isinstance(p, Shard) and p.dim not in dims:
                dims.append(p.dim)
        to_form = {d: i for i, d in enumerate(dims)}

        def rename(p: Placement, names: dict[int, int]) -> Placement:
            return Shard(names[p.dim], p.blocks) if isinstance(p, Shard) else p

        form = (tuple(rename(p, to_form) for p in src), tuple(rename(p, to_form) for p in dst))
        priced = self._forms.get(form)
        if priced is None:
            priced = self._forms[form] = self._reference(*form, rank=len(dims))
        need, steps = priced
        if steps is not None:
            back = dict(enumerate(dims))
            steps = tuple((a, k, d, dd, op, rename(s, back), rename(t, back)) for a, k, d, dd, op, s, t in steps)
        return _Move(tuple(dims), need, _block_wise(src + dst), steps)

    def _reference(self, src: tuple[Placement, ...], dst: tuple[Placement, ...], rank: int) -> tuple:
        """(need, steps with their divisors) of a form, from ``nesting_steps`` on a tensor of dims ``need``."""
        need = [1] * rank
        for size, ps in zip(self.mesh_shape, zip(src, dst)):
            for d in {p.dim for p in ps if isinstance(p, Shard)}:
                need[d] *= size
        blocks = [1] * rank
        for p in src + dst:
            if isinstance(p, Shard):
                blocks[p.dim] = math.lcm(blocks[p.dim], p.blocks)
        need = tuple(n * b for n, b in zip(need, blocks))
        ref = TensorMeta(need, torch.uint8)
        all_steps, conflict = nesting_steps(ref, src, dst, self.mesh_shape)
        if conflict is not None:
            return need, None
        blocked = _block_wise(src + dst)
        total = ref.nbytes
        forms = []
        current = list(src)
        for t in all_steps:
            divisor, per_dim = 0, None
            if t.kind is not None:
                divisor, rest = divmod(total, t.bytes)
                assert rest == 0, f"reference move {src} -> {dst}: step bytes {t.bytes} do not divide {total}"
                if not blocked:  # the placement the step's bytes are measured on (transitions.step)
                    held = list(current)
                    if t.kind != "all_to_all" and isinstance(held[t.axis], Shard):
                        held[t.axis] = Replicate()
                    per_dim = tuple(
                        math.prod(n for n, p in zip(self.mesh_shape, held) if isinstance(p, Shard) and p.dim == d)
                        for d in range(rank)
                    )
                    assert math.prod(per_dim) == divisor, f"reference move {src} -> {dst}: step {t} mismeasured"
            forms.append((t.axis, t.kind, divisor, per_dim, t.reduce_op, t.src, t.dst))
            current[t.axis] = t.dst
        return need, tuple(forms)


def _block_wise(placements: tuple[Placement, ...]) -> bool:
    """Whether any of ``placements`` shards block-wise (``Shard(d, blocks > 1)``)."""
    return any(isinstance(p, Shard) and p.blocks > 1 for p in placements)
