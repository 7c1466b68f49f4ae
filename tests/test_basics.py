"""Value types: placements, meshes, byte sizes, transitions."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, Partial, Replicate, Shard, parse_placement, parse_placements
from autopar.pieces import dim_ranges
from autopar.spec import TensorMeta, local_shape
from autopar.transitions import consumer_grad_placement, producer_grad_placement, transitions
from autopar.units import format_bytes, parse_bytes


def test_placements_print_and_parse_round_trip():
    for p, text in [
        (Shard(0), "S(0)"),
        (Shard(1, 3), "S(1)[3]"),
        (Replicate(), "R"),
        (Partial(), "P(sum)"),
        (Partial("max"), "P(max)"),
    ]:
        assert str(p) == text
        assert parse_placement(text) == p
    assert parse_placements("R,S(1)") == (Replicate(), Shard(1))
    with pytest.raises(ValueError, match="expected 'R', 'S\\(d\\)'"):
        parse_placement("Shard0")


def test_mesh_validation_and_groups():
    mesh = Mesh((2, 4), axis_names=("dp", "tp"))
    assert mesh.size == 8 and mesh.axis_index("tp") == 1
    assert mesh.axis_groups("tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.axis_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="axis 'pp' does not exist"):
        mesh.axis_index("pp")
    with pytest.raises(ValueError, match="3 names but shape \\(2, 4\\) has 2 axes"):
        Mesh((2, 4), axis_names=("dp", "tp", "pp"))
    with pytest.raises(ValueError, match="expected 2 distinct global ranks >= 0"):
        Mesh((2,), ranks=(0, 0))
    with pytest.raises(ValueError, match="expected 2 distinct global ranks >= 0"):
        Mesh((2,), ranks=(-1, 0))
    sub = Mesh((2,), ranks=(2, 3))  # a sub-mesh of a world of 4 (autopar.reshard)
    assert sub.coordinate(3) == (1,) and not sub.is_world(4) and Mesh((2, 2)).is_world(4)
    # non-contiguous rank layouts
    m2 = Mesh((2, 2), axis_names=("a", "b"), ranks=(0, 2, 1, 3))
    assert m2.axis_groups("b") == [[0, 2], [1, 3]]


def test_uneven_and_block_shards_follow_tensor_split():
    assert local_shape((50257, 768), (Shard(0),), (4,)) == (12565, 768)
    assert local_shape((50257, 768), (Shard(0),), (4,), (3,)) == (12564, 768)
    # two axes on one dim: axis 0 first, then axis 1 splits each piece
    assert dim_ranges((10,), (Shard(0), Shard(0)), (2, 2), (1, 0)) == [[(5, 8)]]
    # blocks: rank 1 of 4 holds piece 1 of each of the 3 blocks of 2304
    assert dim_ranges((768, 2304), (Shard(1, 3),), (4,), (1,))[1] == [(192, 384), (960, 1152), (1728, 1920)]
    assert local_shape((768, 2304), (Shard(1, 3),), (4,)) == (768, 576)


def test_byte_sizes():
    assert parse_bytes("1500000000") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes("40GB") == 40 * 10**9
    with pytest.raises(ValueError, match="e.g. 1500000000, 512MiB"):
        parse_bytes("lots")
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_transitions_and_their_conjugates():
    meta = TensorMeta((8, 16), torch.float32)  # 512 bytes
    mesh = (2, 4)
    [ar] = transitions(meta, (Replicate(), Partial()), (Replicate(), Replicate()), mesh)
    assert (ar.kind, ar.axis, ar.bytes) == ("all_reduce", 1, 512)
    [ag] = transitions(meta, (Shard(0), Replicate()), (Replicate(), Replicate()), mesh)
    assert (ag.kind, ag.axis, ag.bytes) == ("all_gather", 0, 512)
    [rs] = transitions(meta, (Shard(0), Partial()), (Shard(0), Shard(1)), mesh)
    assert (rs.kind, rs.axis, rs.bytes) == ("reduce_scatter", 1, 256)  # full buffer under dp's shard
    [a2a] = transitions(meta, (Replicate(), Shard(0)), (Replicate(), Shard(1)), mesh)
    assert (a2a.kind, a2a.bytes) == ("all_to_all", 128)
    assert transitions(meta, (Replicate(), Replicate()), (Shard(0), Partial()), mesh) == []
    # Megatron's f: a replicated input read by a split computation returns a partial gradient
    assert consumer_grad_placement(Replicate(), True) == Partial()
    assert consumer_grad_placement(Replicate(), False) == Replicate()
    assert producer_grad_placement(Partial()) == Replicate()
