"""Compute time of one op on one device: the roofline model.

An op's kernel takes the longer of its math time and its memory time.  Where the
host runs the kernel itself (CPU), the host's per-op overhead (dispatch) adds to
it.  Where the host queues kernels on a stream and runs ahead (GPUs:
``host_runs_ahead``), the host's overhead overlaps the kernels queued before, and
the device pays only its own gap between kernels (``kernel_overhead_s``, the
launch latency): the op takes the longer of the device's and the host's time::

    kernel_s = max(flops / (peak_flops(dtype) * eff), bytes / (mem_bw * memory_efficiency))
    time_s   = kernel_s + host_s                              (host_runs_ahead false)
             = max(kernel_s + kernel_overhead_s, host_s)      (host_runs_ahead true)

with ``host_s`` the profile's measured forward / backward overhead of the runtime
(``op_overhead_s``), or ``kernel_overhead_s`` where none was measured, and ``eff``
``matmul_efficiency`` for matmul-like ops (times the profile's measured
``attention_efficiency`` / ``attention_backward_efficiency`` for fused attention,
whose kernels reach another rate than a GEMM's), 1 for the rest.

All rates come from a ``DeviceProfile`` (``configs/devices/*.toml``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import flops as _flops
from .profiles import DeviceProfile

__all__ = ["op_time_s", "call_time_s"]


def op_time_s(
    flops: float,
    bytes_moved: float,
    profile: DeviceProfile,
    dtype: torch.dtype,
    *,
    matmul: bool,
    backward: bool = False,
    attention: bool = False,
) -> float:
    """Roofline seconds of one op: math or memory bound, with the host's per-op overhead
    (``op_overhead_s``: ``kernel_overhead_s``, or the measured forward or ``backward`` overhead of
    a calibrated profile) added, or overlapped where the host runs ahead of the device (module
    docstring).  ``attention``: a fused attention kernel (its measured efficiency applies).

    An op with no flops and no bytes (a view) launches no kernel, but a runtime
    that dispatches ops one by one on the host still pays for calling it:
    ``view_op_overhead_s`` (measured on CPU; 0 where the host runs ahead of the
    device, as on GPUs).  Raises ``ValueError`` for negative or non-finite counts.
    """
    for label, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"op_time_s: {label} must be a finite number >= 0, got {value!r}")
    if flops == 0 and bytes_moved == 0:
        return profile.view_op_overhead_s
    efficiency = profile.matmul_efficiency if matmul else 1.0
    if attention:
        efficiency *= profile.attention_backward_efficiency if backward else profile.attention_efficiency
    math_s = flops / (profile.peak_flops_for(dtype) * efficiency)
    memory_s = bytes_moved / (profile.mem_bandwidth_bytes_per_s * profile.memory_efficiency)
    kernel_s, host_s = max(math_s, memory_s), profile.op_overhead_s(backward=backward)
    if profile.host_runs_ahead:
        return max(kernel_s + profile.kernel_overhead_s, host_s)
    return kernel_s + host_s


def call_time_s(call: Any, profile: DeviceProfile, *, backward: bool = False) -> float:
    """Roofline seconds of an ``OpCall``'s forward (or backward) on its local shapes.

    Combines ``costmodel.flops`` counts with ``op_time_s``; the dtype is the op's
    ``compute_dtype``.
    """
    if backward:
        n_flops, n_bytes = _flops.backward_flops(call), _flops.backward_bytes_moved(call)
    else:
        n_flops, n_bytes = _flops.forward_flops(call), _flops.bytes_moved(call)
    dtype = _flops.compute_dtype(call)
    attention = _flops.op_family(call) == "sdpa"
    return op_time_s(
        n_flops, n_bytes, profile, dtype, matmul=_flops.is_matmul_like(call), backward=backward, attention=attention
    )
