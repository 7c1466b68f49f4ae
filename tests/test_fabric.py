"""Collectives across nodes priced as NCCL runs them over a node's NICs (``costmodel/fabric.py``): each figure
against the formula written here."""

from __future__ import annotations

import dataclasses
import math

import pytest

import costmodel as cm
from costmodel.fabric import group_spread

S = 3 * 2**28  # bytes of the buffer
NVLINK_BW, NIC_BW = 450e9, 50e9  # h100.toml: NVLink4 each way; one ConnectX-7 NDR NIC (400 Gb/s)
A_INTRA, A_INTER = 1e-6, 10e-6  # per-step latencies of the two links


@pytest.fixture(scope="module")
def h100():
    return cm.load_profile("h100")


def _ring(kind: str, n: int, bandwidth: float) -> float:
    factor, steps = {"all_reduce": (2, 2), "all_gather": (1, 1), "reduce_scatter": (1, 1)}[kind]
    return factor * (n - 1) / n * S / bandwidth + steps * (n - 1) * A_INTER


def test_the_h100_profile_gives_a_dgx_h100_node_its_nics(h100):
    assert (h100.inter_node.nics_per_node, h100.inter_node.tree) == (8, True)
    assert h100.inter_node.bandwidth_bytes_per_s == NIC_BW
    assert cm.load_profile("a100").inter_node.nics_per_node == 8


@pytest.mark.parametrize(
    "shape, axis, spread",
    [
        ((16,), 0, (8, 2, 1)),  # one group fills both nodes
        ((8, 8), 0, (1, 8, 8)),  # dp across 8 nodes, each node's 8 ranks in 8 groups
        ((64, 16, 8), 0, (1, 64, 8)),  # Llama 3's dp: stride 128
        ((64, 16, 8), 1, (1, 16, 8)),  # its pp: stride 8
        ((2, 4, 4), 0, (1, 2, 8)),
        ((4, 16), 1, (8, 2, 1)),  # a 16-rank inner axis: two nodes, one group on each pair
    ],
)
def test_a_group_spread_over_nodes(shape, axis, spread):
    got = group_spread(shape, axis, 8)
    assert (got.per_node, got.nodes, got.groups_per_node) == spread


def test_a_group_filling_its_nodes_gets_every_nic_and_the_tree(h100):
    """16 ranks on 2 nodes: the ring's bus bandwidth is the node's 8 NICs (400 GB/s, under NVLink's 450); the
    all-reduce's latency the tree's 2 (log2(2) a_inter + 7 a_intra) = 34 us, under the ring's 2 x 15 x 10 us."""
    node = min(NVLINK_BW, 8 * NIC_BW)
    tree = 2 * (1 * A_INTER + 7 * A_INTRA)
    want = 2 * 15 / 16 * S / node + min(2 * 15 * A_INTER, tree)
    got = cm.collective_time_on_axis_s("all_reduce", S, mesh_shape=(16,), axis=0, profile=h100)
    assert got == pytest.approx(want, rel=1e-12)
    assert tree == pytest.approx(34e-6)
    # all-gather and reduce-scatter run rings only
    for kind in ("all_gather", "reduce_scatter"):
        got = cm.collective_time_on_axis_s(kind, S, mesh_shape=(16,), axis=0, profile=h100)
        assert got == pytest.approx(_ring(kind, 16, node), rel=1e-12)


def test_groups_sharing_a_node_share_its_nics(h100):
    """(64, 16, 8): the data-parallel groups each hold one rank of a node, 8 groups per node: each gets one
    NIC (400 GB/s / 8); the all-reduce's tree over 64 nodes, 2 x 6 x 10 us, beats the ring's 2 x 63 steps."""
    shape = (64, 16, 8)
    want = 2 * 63 / 64 * S / NIC_BW + min(2 * 63 * A_INTER, 2 * math.ceil(math.log2(64)) * A_INTER)
    got = cm.collective_time_on_axis_s("all_reduce", S, mesh_shape=shape, axis=0, profile=h100)
    assert got == pytest.approx(want, rel=1e-12)
    # the pipeline axis's point-to-point sends: one NIC each too
    assert cm.p2p_time_s(S, h100.link_for_axis(shape, 1)) == pytest.approx(A_INTER + S / NIC_BW, rel=1e-12)


def test_a_node_with_fewer_nics_than_devices_divides_them(h100):
    """4 NICs for 8 GPUs: 8 groups of one rank per node get half a NIC each; one group filling the node, all 4."""
    fabric = dataclasses.replace(h100.inter_node, nics_per_node=4)
    node = dataclasses.replace(h100, inter_node=fabric)
    across = cm.collective_time_on_axis_s("all_gather", S, mesh_shape=(4, 8), axis=0, profile=node)
    assert across == pytest.approx(_ring("all_gather", 4, 4 * NIC_BW / 8), rel=1e-12)
    filling = cm.collective_time_on_axis_s("all_gather", S, mesh_shape=(32,), axis=0, profile=node)
    assert filling == pytest.approx(_ring("all_gather", 32, 4 * NIC_BW), rel=1e-12)
    # point to point between two nodes: each device's share of the NICs
    assert node.link_between(0, 8).bandwidth_bytes_per_s == pytest.approx(4 * NIC_BW / 8)


def test_a_fabric_given_per_device_keeps_its_figure(h100):
    """``nics_per_node`` 0 (every profile before the fabric model, the cpu profile): the link as written."""
    legacy = dataclasses.replace(h100, inter_node=dataclasses.replace(h100.inter_node, nics_per_node=0, tree=False))
    assert legacy.link_for_axis((16,), 0) is legacy.inter_node
    got = cm.collective_time_on_axis_s("all_reduce", S, mesh_shape=(16,), axis=0, profile=legacy)
    assert got == pytest.approx(_ring("all_reduce", 16, NIC_BW), rel=1e-12)


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("nics_per_node = 8", "nics_per_node = -1", "nics_per_node must be an int >= 0"),
        ("nics_per_node = 8", "nics_per_node = 2.5", "nics_per_node must be an int >= 0"),
        ("tree = true", 'tree = "yes"', "tree must be true or false"),
    ],
)
def test_bad_fabric_keys_name_the_problem(tmp_path, old, new, message):
    from autopar.models import config_dir

    text = (config_dir() / "devices" / "h100.toml").read_text()
    assert old in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(old, new))
    with pytest.raises(ValueError, match=message):
        cm.load_profile(str(bad))
