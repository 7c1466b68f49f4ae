"""costmodel: what an op, a collective and a training state cost on a device.

* ``profiles``: ``DeviceProfile``/``LinkProfile`` loaded from ``configs/devices/*.toml``;
  which link a mesh axis uses.
* ``flops``: flops and memory traffic of one ``OpCall`` on local shapes.
* ``compute``: roofline time of an op.
* ``comm``: ring-collective time (alpha-beta, NCCL bus-bandwidth factors) and point-to-point sends.
* ``memory``: bytes of parameters, gradients, optimizer state and activations.

Pure functions of data: no process group, no device, no real tensors.
"""

from __future__ import annotations

from .comm import (
    COLLECTIVES,
    bandwidth_factor,
    collective_time_on_axis_s,
    collective_time_s,
    p2p_time_s,
    transfers_time_s,
)
from .compute import call_time_s, op_time_s
from .flops import (
    backward_bytes_moved,
    backward_flops,
    bytes_moved,
    compute_dtype,
    forward_flops,
    is_matmul_like,
    op_family,
)
from .lending import CoreLending
from .memory import (
    OPTIMIZERS,
    ModelStateBytes,
    OptimizerSpec,
    TrainingPrecision,
    activation_bytes,
    model_state_bytes,
    optimizer_spec,
    precision,
)
from .profiles import (
    ATTENTION_SAVES,
    CollectiveFit,
    DeviceProfile,
    LinkProfile,
    available_profiles,
    axis_crosses_nodes,
    check_devices_per_node,
    load_profile,
    profile_dict,
    profiles_dir,
)

__all__ = [
    "CollectiveFit",
    "CoreLending",
    "LinkProfile",
    "DeviceProfile",
    "load_profile",
    "available_profiles",
    "axis_crosses_nodes",
    "check_devices_per_node",
    "profile_dict",
    "profiles_dir",
    "forward_flops",
    "backward_flops",
    "bytes_moved",
    "backward_bytes_moved",
    "is_matmul_like",
    "op_family",
    "compute_dtype",
    "op_time_s",
    "call_time_s",
    "COLLECTIVES",
    "collective_time_s",
    "collective_time_on_axis_s",
    "p2p_time_s",
    "transfers_time_s",
    "TrainingPrecision",
    "OptimizerSpec",
    "ModelStateBytes",
    "precision",
    "optimizer_spec",
    "model_state_bytes",
    "activation_bytes",
    "ATTENTION_SAVES",
    "OPTIMIZERS",
    "bandwidth_factor",
]
