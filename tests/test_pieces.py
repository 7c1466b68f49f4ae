"""Tensor pieces (autopar.pieces): shard_tensor / combine round trips, index sets, Partial pieces, error messages."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from autopar.pieces import combine, coordinates, dim_ranges, shard_tensor, unlayable_reason
from autopar.placement import Partial, Replicate, Shard, parse_placements, shard_piece, shard_sizes
from autopar.spec import local_shape

MESHES = [(2,), (4,), (2, 2), (2, 3)]


def _pieces(full, placements, mesh_shape, seed=None):
    return {c: shard_tensor(full, placements, mesh_shape, c, partial_seed=seed) for c in coordinates(mesh_shape)}


def _random_placements(rng: random.Random, shape, mesh_shape, *, partial: bool):
    """Placements a valid strategy could produce: blocks divide the (local) dim they split."""
    out = []
    for _ in mesh_shape:
        kinds = ["R", "S", "Sb"] + (["Psum", "Pmax"] if partial else [])
        k = rng.choice(kinds)
        d = rng.randrange(len(shape))
        if k == "R":
            out.append(Replicate())
        elif k == "S":
            out.append(Shard(d))
        elif k == "Sb":
            out.append(Shard(d, rng.choice([2, 3])))
        else:
            out.append(Partial("sum" if k == "Psum" else "max"))
    return tuple(out)


def _layable(shape, placements, mesh_shape) -> bool:
    return unlayable_reason(tuple(shape), tuple(placements), tuple(mesh_shape)) is None


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_round_trip_random_placements(mesh_shape):
    rng = random.Random(hash(mesh_shape) % 1000)
    shapes = [(12, 7), (5, 18, 3), (6,), (13, 12)]
    tried = 0
    for shape in shapes:
        full = torch.randn(shape, dtype=torch.float64)
        for _ in range(25):
            placements = _random_placements(rng, shape, mesh_shape, partial=True)
            if not _layable(shape, placements, mesh_shape):
                continue
            tried += 1
            for seed in (None, 3):
                got = combine(_pieces(full, placements, mesh_shape, seed), placements, mesh_shape, shape)
                torch.testing.assert_close(got, full, atol=1e-12, rtol=1e-12)
    assert tried >= 40


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_local_shapes_match_spec_local_shape(mesh_shape):
    """The pieces have the shapes expand_to_mesh and the rules reason with (spec.local_shape)."""
    rng = random.Random(7)
    shape = (12, 7, 18)
    full = torch.arange(12 * 7 * 18).reshape(shape)
    checked = 0
    for _ in range(60):
        placements = _random_placements(rng, shape, mesh_shape, partial=False)
        if not _layable(shape, placements, mesh_shape):
            continue
        for c in coordinates(mesh_shape):
            assert tuple(shard_tensor(full, placements, mesh_shape, c).shape) == local_shape(
                shape, placements, mesh_shape, c
            )
            checked += 1
    assert checked >= 100


def test_uneven_shard_follows_tensor_split():
    full = torch.arange(7)
    pieces = [shard_tensor(full, (Shard(0),), (4,), (r,)).tolist() for r in range(4)]
    assert pieces == [t.tolist() for t in torch.tensor_split(full, 4)] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [len(p) for p in pieces] == shard_sizes(7, 4)


def test_block_shard_owns_a_piece_of_every_block():
    full = torch.arange(12)  # q | k | v, 4 each
    assert shard_tensor(full, (Shard(0, 3),), (2,), (0,)).tolist() == [0, 1, 4, 5, 8, 9]
    assert shard_tensor(full, (Shard(0, 3),), (2,), (1,)).tolist() == [2, 3, 6, 7, 10, 11]
    # uneven inside each block: blocks of 5 on 2 ranks -> 3 + 2 per block
    full = torch.arange(15)
    assert shard_tensor(full, (Shard(0, 3),), (2,), (1,)).tolist() == [3, 4, 8, 9, 13, 14]


def test_two_axes_on_one_dim_nest_in_axis_order():
    full = torch.arange(24)
    # axis 0 block-wise (3 blocks of 8 -> 4 each), axis 1 splits the *local* 12 contiguously
    local = [shard_tensor(full, (Shard(0, 3), Shard(0)), (2, 2), c).tolist() for c in [(0, 0), (0, 1)]]
    assert local == [[0, 1, 2, 3, 8, 9], [10, 11, 16, 17, 18, 19]]
    # axis 1 block-wise on the local piece: a piece of each of q, k, v on every rank
    local = shard_tensor(full, (Shard(0, 3), Shard(0, 3)), (2, 2), (1, 1)).tolist()
    assert local == [6, 7, 14, 15, 22, 23]
    assert dim_ranges((24,), (Shard(0, 3), Shard(0, 3)), (2, 2), (1, 1)) == [[(6, 8), (14, 16), (22, 24)]]
    # plain then plain: axis 0 halves, axis 1 halves each half (uneven: 13 -> 7 | 6 -> 4,3 | 3,3)
    full = torch.arange(13)
    got = [shard_tensor(full, (Shard(0), Shard(0)), (2, 2), c).tolist() for c in coordinates((2, 2))]
    assert got == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]


def test_partial_sum_pieces():
    full = torch.randn(4, 5)
    plain = _pieces(full, (Partial("sum"),), (4,))
    assert torch.equal(plain[(0,)], full) and all(not plain[(r,)].any() for r in (1, 2, 3))
    rand = _pieces(full, (Partial("sum"),), (4,), seed=11)
    torch.testing.assert_close(sum(rand.values()), full)
    assert all((rand[(r,)] - full).abs().max() > 0.1 for r in range(4))  # really random, not a copy
    again = _pieces(full, (Partial("sum"),), (4,), seed=11)
    assert all(torch.equal(rand[c], again[c]) for c in rand)  # deterministic in the seed


def test_partial_max_pieces():
    full = torch.randn(6, 5)
    rand = _pieces(full, (Partial("max"),), (3,), seed=5)
    stacked = torch.stack(list(rand.values()))
    assert torch.equal(stacked.amax(0), full)
    assert bool((stacked <= full).all())
    owners = (stacked == full).sum(0)
    assert bool((owners == 1).all())  # exactly one rank holds each value
    assert {int(i) for i in (stacked == full).int().argmax(0).flatten()} == {0, 1, 2}


def test_partial_on_one_axis_is_identical_across_a_replicate_axis():
    full = torch.randn(4, 6)
    pieces = _pieces(full, (Partial("sum"), Replicate()), (2, 3), seed=1)
    for c0 in range(2):
        assert all(torch.equal(pieces[(c0, 0)], pieces[(c0, c1)]) for c1 in range(3))
    assert not torch.equal(pieces[(0, 0)], pieces[(1, 0)])


def test_mixed_partials_reduce_last_axis_first():
    full = torch.randn(3, 4, dtype=torch.float64)
    placements = (Partial("sum"), Partial("max"))
    pieces = _pieces(full, placements, (2, 2), seed=2)
    expect = sum(torch.maximum(pieces[(c0, 0)], pieces[(c0, 1)]) for c0 in range(2))
    torch.testing.assert_close(expect, full)
    torch.testing.assert_close(combine(pieces, placements, (2, 2), (3, 4)), full)


def test_combine_rejects_differing_replicas_with_the_difference():
    full = torch.zeros(3, 4)
    pieces = _pieces(full, (Replicate(),), (2,))
    pieces[(1,)] = pieces[(1,)].clone()
    pieces[(1,)][0, 0] = 0.25
    with pytest.raises(AssertionError, match="max abs difference 0.25"):
        combine(pieces, (Replicate(),), (2,), (3, 4))


def test_combine_rejects_wrong_piece_shape_and_missing_coordinates():
    full = torch.randn(6, 4)
    pieces = _pieces(full, (Shard(0),), (2,))
    with pytest.raises(AssertionError, match="no piece"):
        combine({(0,): pieces[(0,)]}, (Shard(0),), (2,), (6, 4))
    pieces[(1,)] = pieces[(1,)][:2]
    with pytest.raises(AssertionError, match=r"shape \(2, 4\)"):
        combine(pieces, (Shard(0),), (2,), (6, 4))


def test_bad_inputs_raise_with_the_fix():
    full = torch.arange(10)
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        shard_tensor(full, (Shard(0),), (2, 2), (0, 0))
    with pytest.raises(ValueError, match="floating dtype"):
        shard_tensor(full, (Partial("sum"),), (2,), (0,))
    with pytest.raises(ValueError, match="not a multiple of 3 blocks"):
        shard_tensor(full, (Shard(0, 3),), (2,), (0,))
    with pytest.raises(ValueError, match="not on a mesh"):
        shard_tensor(full, (Shard(0),), (2,), (2,))


def test_bool_and_int_round_trip_exactly():
    mask = torch.rand(5, 9) > 0.5
    for placements in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2):
        got = combine(_pieces(mask, placements, (2, 2)), placements, (2, 2), (5, 9))
        assert torch.equal(got, mask)


def test_scalar_tensor_round_trip():
    x = torch.tensor(3.5)
    for placements in [parse_placements(["R"]), parse_placements(["P(sum)"]), parse_placements(["P(max)"])]:
        got = combine(_pieces(x, placements, (3,), seed=4), placements, (3,), ())
        torch.testing.assert_close(got, x)


def test_a_piece_of_a_split_dim_is_the_tensor_split_rule_at_any_size():
    """``shard_piece`` (O(1), what local shapes use on meshes of thousands of devices) is piece ``index`` of
    ``shard_sizes``, which is ``torch.tensor_split``'s split, for dims smaller and larger than the parts."""
    for size in range(0, 30):
        for parts in range(1, 10):
            split = [len(p) for p in torch.arange(size).tensor_split(parts)]
            assert shard_sizes(size, parts) == split
            for index in range(parts):
                assert shard_piece(size, parts, index) == (sum(split[:index]), split[index])
    assert shard_piece(128256, 4096, 4095) == (128256 - 31, 31)  # 128256 = 31 * 4096 + 1280: the last pieces short


def _first_unlayable_coordinate(shape, placements, mesh_shape) -> str | None:
    """The reference ``unlayable_reason`` follows without walking: every coordinate's piece sizes, row-major."""
    for coord in coordinates(mesh_shape):
        for d, size in enumerate(shape):
            n = size
            for a, p in enumerate(placements):
                if not (isinstance(p, Shard) and p.dim == d):
                    continue
                if n % p.blocks:
                    return (
                        f"dim {d}: {p}: the local piece of this dim has {n} elements (global {size}), not a "
                        f"multiple of {p.blocks} blocks; use a block count that divides every rank's piece "
                        f"(mesh coordinate {coord})"
                    )
                n = shard_piece(n // p.blocks, mesh_shape[a], coord[a])[1] * p.blocks
    return None


def test_unlayable_reason_follows_piece_sizes_as_every_coordinate_would() -> None:
    """``unlayable_reason`` follows each dim's few piece sizes instead of every coordinate (thousands on a large
    mesh): the same answer, and the same first coordinate named, as the walk over every coordinate."""
    rng = random.Random(7)
    failed = 0
    for _ in range(3000):
        mesh_shape = tuple(rng.choice([1, 2, 3, 4, 5, 8]) for _ in range(rng.randint(1, 3)))
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        placements = tuple(
            rng.choice([Replicate(), Partial("sum"), Shard(rng.randrange(len(shape)), rng.choice([1, 2, 3, 4]))])
            for _ in mesh_shape
        )
        want = _first_unlayable_coordinate(shape, placements, mesh_shape)
        assert unlayable_reason(shape, placements, mesh_shape) == want, (shape, placements, mesh_shape)
        failed += want is not None
    assert 300 < failed < 2700  # both answers drawn often
