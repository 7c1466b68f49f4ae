"""One training step timed phase by phase: what ``scripts/bench_step.py --phases`` and
``scripts/bench_dp_meshes.py`` print (forward, backward, the optimizer's step with ``zero_grad``)."""

from __future__ import annotations

import time

import torch

__all__ = ["PHASES", "timed_step"]

#: the phases ``timed_step`` times, in order
PHASES = ("forward", "backward", "optimizer")


def timed_step(module, args: tuple, kwargs: dict, opt) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    """Run one training step of ``module(*args, **kwargs)``: its loss (the output, or a ``ModelOutput``'s
    ``.loss``) and, per phase of ``PHASES``, (wall seconds, this process's CPU seconds)."""
    marks = [(time.perf_counter(), time.process_time())]
    out = module(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    marks.append((time.perf_counter(), time.process_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.process_time()))
    opt.step()
    opt.zero_grad()
    marks.append((time.perf_counter(), time.process_time()))
    return loss, [(t1 - t0, c1 - c0) for (t0, c0), (t1, c1) in zip(marks, marks[1:])]
