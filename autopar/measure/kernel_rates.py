"""What two kinds of kernels achieve against the roofline ``autopar calibrate`` fits: fused attention and the
optimizer's step.  Both run on every rank at once, timed by the caller's ``timer`` (``calibrate._slowest_median``).

* **Attention** (``attention_points``): ``scaled_dot_product_attention`` forward, and forward + backward, on
  transformer shapes (causal and not), each as flop/s on the flops ``costmodel.flops`` counts for it (torch's
  registry formulas for the efficient kernel: the full score matrix, causal masking not subtracted).
  ``Calibration`` divides their medians by the matmul rate of the dtype: ``attention_efficiency`` and
  ``attention_backward_efficiency`` (a CPU's fused kernel reaches about half a GEMM's rate at a small model's
  shapes, so pricing it as a GEMM under-priced attention 2-3x on 4 gloo ranks).
* **Optimizer** (``optimizer_rates``): torch.optim.AdamW's step, with its defaults for the device (the
  per-tensor loop on CPU, foreach on CUDA), on two sets of parameters: many small tensors (its time is mostly
  per-kernel overhead) and a transformer layer's (mostly its tensor passes).  With the cost model's count for
  AdamW (``costmodel.memory.OPTIMIZERS``: ``k`` kernels and ``p`` tensor passes per parameter), each set's
  time is ``t = n_tensors * k * o + p * bytes / b``; the two sets give the per-kernel overhead ``o`` and the
  bandwidth ``b`` (``optimizer_op_overhead_s``, ``optimizer_bandwidth_bytes_per_s``).  The step's tensors are
  a model's sizes, often within the caches, so ``b`` is not the 32 MiB copy's bandwidth (on 4 gloo ranks
  the copy's rate priced the step 50% over what it took).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry

from costmodel import optimizer_spec

__all__ = ["AttentionTimes", "attention_points", "attention_times", "optimizer_rates"]

Timer = Callable[..., float]  # timer(fn, device, trials, budget_s=...) -> seconds per call, the slowest rank's

_aten = torch.ops.aten
#: (batch, heads, sequence, head dim) of the attention timed: a small model's on CPU ranks, a large one's on GPUs
_CPU_ATTENTION = ((2, 4, 128, 64), (2, 8, 512, 64))
_GPU_ATTENTION = ((4, 32, 2048, 128), (2, 32, 4096, 128))


def attention_points(device: torch.device, dtype: torch.dtype, timer: Timer, trials: int) -> dict[str, list]:
    """``{"forward": [(label, flop/s)], "backward": [...]}``: scaled_dot_product_attention on each shape, causal
    and not."""
    shapes = _GPU_ATTENTION if device.type == "cuda" else _CPU_ATTENTION
    out: dict[str, list] = {"forward": [], "backward": []}
    for shape in shapes:
        for causal in (True, False):
            label = f"{'x'.join(map(str, shape))}{' causal' if causal else ''}"
            t = attention_times(shape, causal, device, dtype, timer, trials)
            out["forward"].append((label, t.forward_flops / t.forward_s))
            out["backward"].append((label, t.backward_flops / t.backward_s))
    return out


@dataclass(frozen=True, slots=True)
class AttentionTimes:
    """scaled_dot_product_attention on q, k, v of one shape: the flops ``costmodel.flops`` counts for its forward
    and its backward, and their seconds per call; ``backward_s`` is forward + backward less forward, at least
    ``BACKWARD_FLOOR`` of forward + backward (a difference of two noisy times never reads as free)."""

    forward_flops: int
    backward_flops: int
    forward_s: float
    backward_s: float


#: the least share of forward + backward an attention's backward is taken to be (``AttentionTimes``)
BACKWARD_FLOOR = 0.05


def attention_times(shape, causal: bool, device: torch.device, dtype: torch.dtype, timer: Timer, trials: int):
    """``AttentionTimes`` of attention on q, k, v of ``shape`` (``is_causal=causal``), timed by ``timer``."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    forward_flops = flop_registry[_aten._scaled_dot_product_efficient_attention](shape, shape, shape, out_val=None)
    backward_flops = flop_registry[_aten._scaled_dot_product_efficient_attention_backward](
        shape, shape, shape, shape, out_val=None
    )

    def forward():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad)

    forward_s = timer(forward, device, trials, budget_s=0.05)
    both_s = timer(both, device, trials, budget_s=0.1)
    return AttentionTimes(forward_flops, backward_flops, forward_s, max(both_s - forward_s, BACKWARD_FLOOR * both_s))


def _layer_shapes(d: int) -> list[tuple[int, ...]]:
    """A transformer layer's parameters at width ``d``: q, k, v, o, the MLP's two matrices, two norms, biases."""
    return [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)] + [(d,)] * 4 + [(4 * d,)]


def optimizer_rates(device: torch.device, timer: Timer, trials: int) -> dict[str, float]:
    """AdamW's per-kernel overhead and tensor-pass bandwidth on this device (module docstring), and the two
    sets' times: ``{"op_overhead_s", "bandwidth_bytes_per_s", "small_s", "layer_s"}``."""
    spec = optimizer_spec("adamw")
    d = 1024 if device.type == "cuda" else 256
    sets = {"small": [(32, 32)] * 64, "layer": _layer_shapes(d) * 2}
    seconds, counts = {}, {}
    for name, shapes in sets.items():
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        seconds[name] = timer(opt.step, device, trials, budget_s=0.1)
        counts[name] = (len(params), sum(p.numel() * p.element_size() for p in params))
    # t = n * k * o + p * bytes / b for both sets: two equations in o and 1/b
    (n1, b1), (n2, b2) = counts["small"], counts["layer"]
    t1, t2 = seconds["small"], seconds["layer"]
    det = n1 * b2 - n2 * b1
    per_kernel = (t1 * b2 - t2 * b1) / det / spec.ops_per_param
    per_byte = (n1 * t2 - n2 * t1) / det / spec.passes
    if per_byte <= 0:  # the layer's set no slower per tensor than the small one's: bandwidth not resolved
        per_byte = t2 / (spec.passes * b2)
    return {
        "op_overhead_s": max(per_kernel, 0.0),
        "bandwidth_bytes_per_s": 1.0 / per_byte,
        "small_s": t1,
        "layer_s": t2,
    }
