"""Seconds per op of autopar's own runtime, forward and backward, and of a view that launches no kernel:
what ``autopar calibrate`` writes as ``forward_op_overhead_s``, ``backward_op_overhead_s`` and
``view_op_overhead_s``.  A small model of many tiny ops (``_ManyOps``: their flops and bytes negligible) runs
through ``autopar.compile`` under an all-replicated plan (no collective) on every rank at once, timed by the
caller's ``timer`` (``calibrate._slowest_median``).
"""

from __future__ import annotations

import torch
from torch import nn

from .kernel_rates import Timer

__all__ = ["runtime_op_overhead"]


class _ManyOps(nn.Module):
    """Many ops too small for their flops or bytes to matter: its time is per-op overhead."""

    def __init__(self, width: int = 16, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.nn.functional.gelu(block(x))
        return x.sum()


def runtime_op_overhead(world: int, device: torch.device, timer: Timer, trials: int) -> dict[str, float]:
    """Forward and backward seconds per op of autopar's runtime on a plan without collectives."""
    from autopar import compiled
    from autopar.mesh import Mesh

    torch.manual_seed(0)
    x = torch.randn(8, 16, device=device)
    mesh = Mesh((world,), axis_names=("x",))
    model = _ManyOps().to(device)
    sharded = compiled.compile(
        model, mesh, example_inputs=(x,), hints={"*": ["R"]}, input_placements={"x": ["R"]}, profile="cpu"
    )
    ops = sum(1 for n in sharded.plan.nodes)
    forward_s = timer(lambda: sharded(x), device, trials, budget_s=0.1)
    views = torch.randn(8, 16, 4, device=device)

    def view_chain():  # 8 ops that launch no kernel, as a lowered graph calls them
        y = torch.ops.aten.view.default(views, [8, 64])
        y = torch.ops.aten.transpose.int(y, 0, 1)
        y = torch.ops.aten.unsqueeze.default(y, 0)
        y = torch.ops.aten.squeeze.dim(y, 0)
        y = torch.ops.aten.t.default(y)
        y = torch.ops.aten.view.default(y, [8, 16, 4])
        y = torch.ops.aten.permute.default(y, [2, 0, 1])
        return torch.ops.aten.expand.default(y, [4, 8, 16])

    view_s = timer(view_chain, device, trials, budget_s=0.05) / 8

    def step():
        sharded(x).backward()

    step_s = timer(step, device, trials, budget_s=0.1)
    return {
        "ops": ops,
        "forward_op_s": forward_s / ops,
        "backward_op_s": max(step_s - forward_s, 0.0) / ops,
        "view_op_s": view_s,
    }
