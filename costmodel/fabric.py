"""How a mesh axis's collectives cross nodes: NCCL's rings and trees over a node's NICs.

A cluster node holds ``devices_per_node`` devices joined by ``intra_node`` (NVLink / NVSwitch) and
``nics_per_node`` NICs of ``B_nic`` bytes/s each way on the fabric (``inter_node``, its
``bandwidth_bytes_per_s`` is then one NIC's).  Take one group of a mesh axis whose ranks sit in several
nodes: ``k`` ranks on each of ``N`` nodes (``n = k N``), while ``g`` groups of the same axis have ranks on
each node and run the same collective at once (SPMD; ``g k`` is the node's ranks in the mesh).

Ring (NCCL's rings visit a node's ``k`` ranks in a row and cross to the next node once; it runs as many rings
as the node has NICs, each on its own): every link of a ring carries the same bytes, so a node sends through
its NICs, for each of its ``g`` groups, what one rank sends over NVLink.  The group's bus bandwidth per rank
(the ``B`` of ``costmodel.comm``'s ring formulas) is therefore::

    B = min(B_intra, nics_per_node * B_nic / g)

the node's whole fabric for one group that fills it (``g = 1``: DGX H100, 8 x 400 Gb/s, 400 GB/s), one NIC's
worth per rank when each rank of the node is in a group of its own (``g = 8``: 50 GB/s).  A ring step waits for
its slowest hop, so its latency is ``inter_node``'s per step: ``2 (n - 1) alpha_inter`` for an all-reduce.

Tree (all-reduce only, where the fabric's ``tree`` is true: NCCL's double binary tree across the nodes, a chain
inside each): the same bandwidth term (each node sends and receives the buffer once up and once down the tree),
and the latency::

    2 (ceil(log2 N) alpha_inter + (k - 1) alpha_intra)

NCCL chooses between the two per message size; the cost model takes the lower latency (the bandwidth terms
being equal).  A point-to-point send between nodes (a pipeline's stage boundary) has the ring's per-rank
bandwidth: the ``g`` groups of the pipeline axis on a node send at once; between two given ranks (a reshard's
messages, ``device_link``) a device has its share of the node's NICs, ``nics_per_node * B_nic /
devices_per_node``.

A fabric given per device (``nics_per_node`` 0, the profiles before this model) keeps its bandwidth for every
group, as before.  Measured collective fits (``LinkProfile.collectives``) still price what they cover.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol, TypeVar

import numpy as np

__all__ = ["GroupSpread", "device_link", "group_link", "group_spread"]


class Link(Protocol):
    """What this module reads of a ``costmodel.profiles.LinkProfile`` (a frozen dataclass)."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    nics_per_node: int
    tree: bool


L = TypeVar("L", bound=Link)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupSpread:
    """How one group of a mesh axis sits on the nodes: ``per_node`` ranks (``k``) on each of ``nodes`` (``N``),
    beside ``groups_per_node - 1`` other groups of the axis on the same node (``g``)."""

    per_node: int
    nodes: int
    groups_per_node: int


@functools.lru_cache(maxsize=1024)
def group_spread(mesh_shape: tuple[int, ...], axis: int | tuple[int, ...], devices_per_node: int) -> GroupSpread:
    """The spread of the groups of ``axis`` (or of several axes flattened into one group) over nodes of
    ``devices_per_node`` consecutive ranks (row-major mesh, last axis innermost; the group of rank 0 and the groups
    with a rank on its node)."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    size = math.prod(mesh_shape[a] for a in axes)
    grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    ranks = np.moveaxis(grid, axes, tuple(range(-len(axes), 0))).reshape(-1, size)
    nodes = ranks // devices_per_node
    first = nodes[0]
    per_node = int(np.bincount(first).max())
    groups_here = int((nodes == first[0]).any(axis=1).sum())
    return GroupSpread(per_node, len(set(first.tolist())), groups_here)


def group_link(intra: Link, inter: L, spread: GroupSpread) -> L:
    """The link one group spread so over nodes sees (module docstring): ``inter`` (a ``LinkProfile`` whose
    ``nics_per_node`` is set) with the ring's bus bandwidth per rank and, where ``inter.tree``, the tree's
    all-reduce latency; ``inter`` itself where the fabric is given per device."""
    if not inter.nics_per_node:
        return inter
    node_fabric = inter.nics_per_node * inter.bandwidth_bytes_per_s
    bandwidth = min(intra.bandwidth_bytes_per_s, node_fabric / spread.groups_per_node)
    tree = None
    if inter.tree:
        depth = math.ceil(math.log2(spread.nodes)) if spread.nodes > 1 else 0
        tree = 2 * (depth * inter.latency_s + (spread.per_node - 1) * intra.latency_s)
    return dataclasses.replace(
        inter,
        name=f"{inter.name} ({spread.per_node} per node on {spread.nodes} nodes)",
        bandwidth_bytes_per_s=bandwidth,
        nics_per_node=0,  # now the group's own figure
        tree=False,
        all_reduce_latency_s=tree,
    )


def device_link(inter: L, devices_per_node: int) -> L:
    """The fabric as one device sees it point to point (module docstring): its share of the node's NICs;
    ``inter`` itself where the fabric is given per device."""
    if not inter.nics_per_node:
        return inter
    share = inter.nics_per_node * inter.bandwidth_bytes_per_s / devices_per_node
    return dataclasses.replace(inter, bandwidth_bytes_per_s=share, nics_per_node=0, tree=False)
