"""``cost.moves.MoveSteps`` answers every move exactly as ``runtime.nesting_steps`` does.

The coster prices moves from one scaled reference per form (``autopar/cost/moves.py``);
the runtime runs ``nesting_steps``'s list.  Here both answer the same moves: every
pair of placements of tensors of even, uneven and zero-sized shapes (and block-wise
shards on dims the blocks do and do not divide) on one-, two- and three-axis meshes,
with the steps compared field by field.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from autopar.cost.moves import MoveSteps
from autopar.placement import Partial, Replicate, Shard
from autopar.runtime import nesting_steps
from autopar.spec import TensorMeta


def _placements(rank: int, axes: int, rng: random.Random, count: int, blocks: int) -> list[tuple]:
    choices = [Replicate(), Partial("sum"), Partial("max")] + [Shard(d) for d in range(rank)]
    if blocks > 1:
        choices += [Shard(d, blocks) for d in range(rank)]
    every = list(itertools.product(choices, repeat=axes))
    return every if len(every) <= count else rng.sample(every, count)


def _truth(meta, src, dst, mesh):
    steps, conflict = nesting_steps(meta, src, dst, mesh)
    return None if conflict is not None else steps


CASES = [
    # mesh, shapes (one rank each), block count offered to shards
    ((4,), [(8, 12), (7, 5), (0, 4)], 1),
    ((2, 2), [(8, 6, 12), (3, 5, 7), (2, 4, 50257)], 1),
    ((2, 3), [(12, 18), (6, 9, 5)], 3),
    ((2, 1, 2), [(4, 6, 5), (3, 8)], 2),  # an axis of size 1: no step runs on it
    ((2, 2, 2), [(8, 64, 384), (8, 4, 64, 32), (512, 50257), (6, 10)], 3),
    ((4, 8, 8), [(64, 32, 2048, 128), (50257, 4096)], 3),
]


@pytest.mark.parametrize("mesh,shapes,blocks", CASES, ids=[str(c[0]) for c in CASES])
def test_scaled_steps_equal_the_runtimes(mesh, shapes, blocks):
    rng = random.Random(len(mesh) * 7 + blocks)
    moves = MoveSteps(mesh)
    compared = forbidden = uneven = 0
    for shape in shapes:
        for dtype in (torch.bfloat16, torch.int64):
            meta = TensorMeta(shape, dtype)
            placements = _placements(len(shape), len(mesh), rng, 28, blocks)
            for src, dst in itertools.product(placements, repeat=2):
                want = _truth(meta, src, dst, mesh)
                got = moves.steps(meta, src, dst)
                assert got == want, (mesh, shape, src, dst)
                collectives = moves.collectives(meta, src, dst, pair=("key", src, dst))
                assert collectives == (None if want is None else [(t.kind, t.bytes, t.axis) for t in want if t.kind])
                compared += 1
                forbidden += want is None
                uneven += any(s % 2 for s in shape)
    # the comparison covered uneven moves and, where axes nest, moves the runtime refuses
    assert compared > 100 and uneven > 0 and (forbidden > 0 or len(mesh) == 1)


def test_forms_are_shared_by_renamed_dims():
    """Moves that differ only in which dims they shard share one reference move."""
    moves = MoveSteps((2, 2))
    meta = TensorMeta((8, 8, 8), torch.float32)
    for d, e in itertools.permutations(range(3), 2):
        moves.steps(meta, (Shard(d), Replicate()), (Replicate(), Shard(e)))
    assert len(moves._forms) == 1 and len(moves._moves) == 6
