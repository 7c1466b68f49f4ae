"""The peak memory one rank's training step really takes, as the allocator reports it.

``step_peak_bytes(step, held, device)`` runs ``step()`` once and returns a
``MemoryPeak``: the bytes held before the step (``held``: the distinct storages
of the tensors that live across steps, parameters, gradients kept between steps,
optimizer state and buffers) plus the largest rise of allocated bytes during the
step.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``
  (the caching allocator's own count; ``held`` is then only reported, the peak
  already includes it).
* CPU: PyTorch's profiler with ``profile_memory=True`` records every allocation
  and free of the CPU allocator during the step; its memory timeline
  (``torch.profiler._memory_profiler.MemoryProfile``, what
  ``profile.export_memory_timeline`` draws) gives the rise as the maximum of the
  running sum.  Frees of tensors allocated before the step are not in that
  timeline, so the rise never goes below what the step itself allocated.

Neither uses the cost model: these are the figures ``autopar fidelity`` compares
the plan's memory with.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["MemoryPeak", "held_bytes", "step_peak_bytes"]


@dataclass(frozen=True, slots=True)
class MemoryPeak:
    """Bytes on one rank: held before a step, and the peak while it ran (held included)."""

    held_bytes: int
    peak_bytes: int


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view and its base count once; None skipped)."""
    storages: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def step_peak_bytes(
    step: Callable[[], object], held: Iterable[torch.Tensor | None], device: torch.device
) -> MemoryPeak:
    """Run ``step()`` once on this rank and measure its peak (see the module docstring)."""
    base = held_bytes(held)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return MemoryPeak(base, int(torch.cuda.max_memory_allocated(device)))
    return MemoryPeak(base, base + _cpu_rise_bytes(step))


def _cpu_rise_bytes(step: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with _quiet_native_output(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    level = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action == Action.CREATE:
            level += size
        elif action == Action.DESTROY:
            level -= size
        peak = max(peak, level)
    return peak


@contextlib.contextmanager
def _quiet_native_output():
    """The profiler's native code logs its start and stop on the process's stdout/stderr: keep them out."""
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
