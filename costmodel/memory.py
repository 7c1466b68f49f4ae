"""Per-device memory of training: model state (params, grads, optimizer state) and activations.

Model state follows the ZeRO paper's accounting (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC'20, section 3.1):
mixed-precision Adam holds 2 bytes of bf16/fp16 parameter, 2 bytes of gradient and
12 bytes of optimizer state (fp32 master copy, momentum, variance) per parameter.

The parameter and its gradient/optimizer state may be sharded differently (ZeRO-1/2/3
on a data-parallel axis), so ``model_state_bytes`` takes two local element counts:
``param_numel_local`` (under the parameter's placement) and ``state_numel_local``
(under the placement of its gradient and optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TrainingPrecision",
    "OptimizerSpec",
    "ModelStateBytes",
    "precision",
    "optimizer_spec",
    "model_state_bytes",
    "activation_bytes",
    "PRECISIONS",
    "OPTIMIZERS",
]


@dataclass(frozen=True, slots=True)
class TrainingPrecision:
    """Dtypes of training: what parameters, gradients and compute use.

    ``master_weights``: the optimizer keeps a float32 copy of every parameter it
    updates (mixed precision), counted with the optimizer state.
    ``optimizer_state_dtype``: the dtype of the optimizer's state tensors when the
    precision fixes it (torch.optim keeps them like the parameter: bf16 for bf16
    parameters); None: the optimizer's own (``OptimizerSpec.state_dtype``).
    """

    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    compute_dtype: torch.dtype
    master_weights: bool
    optimizer_state_dtype: torch.dtype | None = None


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """An optimizer's state and step: ``states_per_param`` tensors of ``state_dtype`` per parameter.

    The step, as ``torch.optim``'s per-tensor implementation runs it (the default on
    CPU tensors), is ``ops_per_param`` elementwise kernels per parameter that
    together read and write ``passes`` tensors the size of the parameter's state
    shard (``cost.coster`` prices it as memory traffic plus one per-op overhead each).
    """

    name: str
    states_per_param: int
    state_dtype: torch.dtype
    passes: int = 0
    ops_per_param: int = 0
    temporaries: int = 0  # state-shard-sized temporaries alive at once during the step (autopar.cost.peak)


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Bytes one device holds for parameters, gradients and optimizer state (incl. master copy)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


PRECISIONS: dict[str, TrainingPrecision] = {
    "fp32": TrainingPrecision("fp32", torch.float32, torch.float32, torch.float32, master_weights=False),
    "bf16": TrainingPrecision("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, master_weights=True),
    # a model whose parameters are bf16, trained by a torch.optim optimizer as it is: no float32
    # copy, and the optimizer's state tensors are bf16 like the parameters (zeros_like(p))
    "bf16-pure": TrainingPrecision(
        "bf16-pure",
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        master_weights=False,
        optimizer_state_dtype=torch.bfloat16,
    ),
}

# Adam(W) keeps exp_avg and exp_avg_sq (Kingma & Ba 2015; torch.optim.AdamW);
# SGD with momentum keeps momentum_buffer (torch.optim.SGD); both in float32.
# Steps, counted from torch.optim's per-tensor paths (torch/optim/adam.py _single_tensor_adam,
# torch/optim/sgd.py _single_tensor_sgd), tensor passes as (reads + writes):
#   AdamW: p.mul_(1 - lr*wd) 2, m.lerp_(g) 3, v.mul_(b2) 2, v.addcmul_(g, g) 3, v.sqrt() 2,
#          / bias_correction 2, .add_(eps) 2, p.addcdiv_(m, denom) 4: 8 kernels, 20 passes;
#   Adam (no weight decay): the same without p.mul_: 7 kernels, 18 passes;
#   SGD: p.add_(g) 3: 1 kernel; with momentum buf.mul_(m) 2, buf.add_(g) 3, p.add_(buf) 3: 3 kernels, 8 passes.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    # (the temporaries: sqrt(v) and its quotient by the bias correction, alive together for a moment)
    "adamw": OptimizerSpec("adamw", 2, torch.float32, passes=20, ops_per_param=8, temporaries=2),
    "adam": OptimizerSpec("adam", 2, torch.float32, passes=18, ops_per_param=7, temporaries=2),
    "sgd": OptimizerSpec("sgd", 0, torch.float32, passes=3, ops_per_param=1),
    "sgd_momentum": OptimizerSpec("sgd_momentum", 1, torch.float32, passes=8, ops_per_param=3),
    "none": OptimizerSpec("none", 0, torch.float32),
}

_MASTER_DTYPE = torch.float32


def precision(name: str) -> TrainingPrecision:
    """The training precision called ``name`` ("fp32", "bf16" (mixed, float32 master weights) or "bf16-pure")."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"unknown training precision {name!r}; expected one of {sorted(PRECISIONS)}") from None


def optimizer_spec(name: str) -> OptimizerSpec:
    """The optimizer called ``name`` ("adamw", "adam", "sgd", "sgd_momentum", "none")."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}") from None


def model_state_bytes(
    param_numel_local: int, state_numel_local: int, precision: TrainingPrecision, optimizer: OptimizerSpec
) -> ModelStateBytes:
    """Bytes of one parameter's model state on one device.

    params = param_numel_local * itemsize(param_dtype);
    grads = state_numel_local * itemsize(grad_dtype);
    optimizer = state_numel_local * (states_per_param * itemsize(state_dtype)
                                     + itemsize(float32) if master_weights).
    """
    for label, value in (("param_numel_local", param_numel_local), ("state_numel_local", state_numel_local)):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(f"model_state_bytes: {label} must be an int >= 0, got {value!r}")
    master = _MASTER_DTYPE.itemsize if precision.master_weights else 0
    state_dtype = precision.optimizer_state_dtype or optimizer.state_dtype
    per_state = optimizer.states_per_param * state_dtype.itemsize + master
    return ModelStateBytes(
        params=int(param_numel_local) * precision.param_dtype.itemsize,
        grads=int(state_numel_local) * precision.grad_dtype.itemsize,
        optimizer=int(state_numel_local) * per_state,
    )


def activation_bytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of a saved activation of ``numel`` elements of ``dtype``."""
    return int(numel) * dtype.itemsize
