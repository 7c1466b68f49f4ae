"""Collective communication time: the alpha-beta model of bandwidth-optimal ring collectives.

For a group of ``n`` ranks on a link of per-device unidirectional bandwidth ``B``
and per-step latency ``alpha`` (``LinkProfile``), a collective on ``nbytes`` costs::

    all_reduce       2(n-1)/n * nbytes / B  +  2(n-1) * alpha    nbytes: the buffer each rank holds
    all_gather        (n-1)/n * nbytes / B  +   (n-1) * alpha    nbytes: the gathered (full) output
    reduce_scatter    (n-1)/n * nbytes / B  +   (n-1) * alpha    nbytes: the full (unscattered) input
    all_to_all        (n-1)/n * nbytes / B  +   (n-1) * alpha    nbytes: each rank's buffer

The bandwidth factors are NCCL's bus-bandwidth factors (nccl-tests,
``doc/PERFORMANCE.md``, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
a ring all-reduce is a reduce-scatter then an all-gather, each moving ``(n-1)/n``
of the buffer through every rank's link.  The step counts are the ring's: ``n-1``
steps per phase.  ``OpComm.bytes`` in ``autopar.strategies.base`` uses the same
``nbytes`` definitions.

Measured collectives: where the link carries a fit of ``kind`` (``LinkProfile.collectives``,
written by ``autopar calibrate``), the collective costs what the measurements say
(``CollectiveFit.time_s``: piecewise ``latency + factor * nbytes / bandwidth`` between
the measured sizes, ``factor`` the ring bandwidth factor above, ``bandwidth_factor``).
A group size between two measured ones interpolates the two times linearly; outside
the measured range the nearest line fit is scaled as the ring scales (latency by
the step count, the factor by ``(n-1)/n``).

Point-to-point sends (a reshard between sub-meshes, ``autopar.reshard``): one message of
``nbytes`` from rank ``a`` to rank ``b`` costs ``alpha + nbytes / B`` on the link between
them (``DeviceProfile.link_between``).  A rank's sends go out one after another, and its
receives come in one after another, while sending and receiving overlap (full-duplex
links), so a set of transfers takes ``max over ranks r of max(sum of r's sends, sum of
r's receives)`` (``transfers_time_s``); a rank's message to itself is a local copy, free.

Across nodes: a group of a mesh axis whose ranks sit in several nodes sees the link
``costmodel.fabric.group_link`` derives from the node's NICs (``DeviceProfile.link_for_axis``):
the ring's bus bandwidth of the node's fabric shared by the groups on it and, where the fabric
runs trees (NCCL), an all-reduce's latency the lesser of the ring's and the tree's.

Emulated reduce-scatter: on a link whose backend has none
(``LinkProfile.reduce_scatter == "all_reduce"``, e.g. the ``cpu`` profile: gloo,
where autopar's runtime all-reduces the full input and keeps its slice), a
reduce-scatter is priced as the all-reduce of its ``nbytes`` that actually runs
(twice the bandwidth term and the latency steps; the local slice is not charged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .profiles import COLLECTIVES, DeviceProfile, LinkProfile

__all__ = [
    "COLLECTIVES",
    "bandwidth_factor",
    "collective_time_s",
    "collective_time_on_axis_s",
    "p2p_time_s",
    "transfers_time_s",
]


# kind -> (bandwidth factor numerator in units of (n-1)/n, latency steps in units of (n-1))
_RING_FACTORS = {
    "all_reduce": (2, 2),
    "all_gather": (1, 1),
    "reduce_scatter": (1, 1),
    "all_to_all": (1, 1),
}


def bandwidth_factor(kind: str, group_size: int, emulated_reduce_scatter: bool = False) -> float:
    """The ring bandwidth factor of ``kind`` among ``group_size`` ranks: 2(n-1)/n for an all-reduce (and an
    emulated reduce-scatter, which runs one), (n-1)/n otherwise."""
    if kind == "reduce_scatter" and emulated_reduce_scatter:
        kind = "all_reduce"
    n = group_size
    return _RING_FACTORS[kind][0] * (n - 1) / n


def _fitted_time_s(fits: tuple, kind: str, nbytes: float, n: int, emulated: bool) -> float:
    """Seconds from the measured fits of one kind (sorted by group size; see the module docstring)."""
    below = [f for f in fits if f.group_size <= n]
    above = [f for f in fits if f.group_size >= n]
    if below and above:
        lo, hi = below[-1], above[0]
        t_lo = lo.time_s(nbytes, bandwidth_factor(kind, lo.group_size, emulated))
        if hi.group_size == lo.group_size:
            return t_lo
        t_hi = hi.time_s(nbytes, bandwidth_factor(kind, hi.group_size, emulated))
        w = (n - lo.group_size) / (hi.group_size - lo.group_size)
        return (1 - w) * t_lo + w * t_hi
    near = below[-1] if below else above[0]  # outside the measured sizes: the ring's scaling of the line fit
    latency = near.latency_s * (n - 1) / (near.group_size - 1)
    return latency + bandwidth_factor(kind, n, emulated) * nbytes / near.bandwidth_bytes_per_s


def collective_time_s(kind: str, nbytes: float, group_size: int, link: LinkProfile) -> float:
    """Seconds one ring collective of ``kind`` on ``nbytes`` takes among ``group_size`` ranks.

    ``nbytes`` follows the module docstring's definitions; a reduce-scatter on a link
    that emulates it costs the all-reduce it runs.  A group of one rank, or
    zero bytes, costs 0.0 (no collective is issued).  Raises ``ValueError`` for an
    unknown ``kind``, a negative ``nbytes`` or a ``group_size`` below 1.
    """
    if kind not in _RING_FACTORS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVES}")
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"{kind}: nbytes must be a finite number >= 0, got {nbytes!r}")
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"{kind}: group_size must be an int >= 1, got {group_size!r}")
    n = int(group_size)
    if n == 1 or nbytes == 0:
        return 0.0
    fits = link.fits_for(kind)
    if fits:
        return _fitted_time_s(fits, kind, nbytes, n, link.reduce_scatter == "all_reduce")
    if kind == "reduce_scatter" and link.reduce_scatter == "all_reduce":
        kind = "all_reduce"  # emulated: the full input all-reduced, this rank's slice kept
    bw_factor, steps = _RING_FACTORS[kind]
    bandwidth_s = bw_factor * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s
    latency_s = steps * (n - 1) * link.latency_s
    if kind == "all_reduce" and link.all_reduce_latency_s is not None:  # a tree across nodes (costmodel.fabric)
        latency_s = min(latency_s, link.all_reduce_latency_s)
    return bandwidth_s + latency_s


def p2p_time_s(nbytes: float, link: LinkProfile) -> float:
    """Seconds one point-to-point message of ``nbytes`` takes on ``link`` (0.0 for no bytes)."""
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"send: nbytes must be a finite number >= 0, got {nbytes!r}")
    return 0.0 if nbytes == 0 else link.latency_s + nbytes / link.bandwidth_bytes_per_s


def transfers_time_s(transfers: Iterable[tuple[int, int, int]], profile: DeviceProfile) -> float:
    """Seconds a set of ``(src rank, dst rank, nbytes)`` messages takes (module docstring: the busiest rank's
    sends or receives, whichever is longer); messages a rank sends itself are free."""
    sends: dict[int, float] = {}
    recvs: dict[int, float] = {}
    for a, b, nbytes in transfers:
        if a == b:
            continue
        t = p2p_time_s(nbytes, profile.link_between(a, b))
        sends[a] = sends.get(a, 0.0) + t
        recvs[b] = recvs.get(b, 0.0) + t
    return max([*sends.values(), *recvs.values()], default=0.0)


def collective_time_on_axis_s(
    kind: str, nbytes: float, *, mesh_shape: tuple[int, ...], axis: int, profile: DeviceProfile
) -> float:
    """``collective_time_s`` over mesh axis ``axis``: group size and link from the mesh."""
    link = profile.link_for_axis(mesh_shape, axis)
    return collective_time_s(kind, nbytes, mesh_shape[axis], link)
