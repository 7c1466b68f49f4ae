"""The peak memory one rank's training step really takes, as the allocator reports it.

``step_peak_bytes(step, held, device)`` runs ``step()`` once and returns a
``MemoryPeak``: the bytes held before the step (``held``: the distinct storages
of the tensors that live across steps, parameters, gradients kept between steps,
optimizer state and buffers) plus the largest rise of allocated bytes during the
step.

* CUDA: the rise of ``torch.cuda.max_memory_allocated`` (after
  ``reset_peak_memory_stats``) above ``torch.cuda.memory_allocated`` as the step
  began: the caching allocator's own count, of this step only (other tensors on
  the device, such as another plan's compiled model, are not this rank's step).
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

__all__ = ["MemoryPeak", "PeakComposition", "held_bytes", "peak_composition", "step_peak_bytes"]


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
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return MemoryPeak(base, base + int(torch.cuda.max_memory_allocated(device)) - before)
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


@dataclass(frozen=True, slots=True)
class PeakComposition:
    """What one step holds at its peak, of what it allocated itself (the profiler's memory timeline).

    ``rise_bytes``: the peak of the running sum of the step's allocations and frees;
    ``by_category``: those live at that moment by the profiler's category (activation,
    gradient, temporary, autograd_detail, optimizer_state, parameter, input, or unknown);
    ``largest``: the largest of them as (bytes, category, the op that allocated it).  Both
    are empty where the profiler cannot attribute the tensors (a step with in-place
    collectives on inputs it recorded: torch's data-flow analysis refuses it), the rise
    still measured."""

    rise_bytes: int
    by_category: dict[str, int]
    largest: tuple[tuple[int, str, str], ...]


def peak_composition(step: Callable[[], object], device: torch.device, top: int = 12) -> PeakComposition:
    """Run ``step()`` once under the profiler (CPU, and CUDA on a GPU) and take apart the peak on ``device``.

    For finding which term of the cost model's peak (``autopar.cost.peak``) is off where
    ``autopar fidelity``'s measured peak and the plan's differ; it uses the profiler's own
    tensor categories, not the cost model.  Where a process group is up, ``step`` is taken to be collective (every
    rank calls this together): a rank whose profile must be taken again without shapes makes every rank step again,
    so that none waits in a step the others do not run."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for shapes in (True, False):  # the categories need the shapes, whose data flow some collectives break
        with _quiet_native_output(), profile(activities=activities, profile_memory=True, record_shapes=shapes) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        try:
            mem, refused = MemoryProfile(prof.profiler.kineto_results), False
        except AssertionError:  # "version mismatch": an in-place collective on a recorded input
            if not shapes:
                raise
            refused = True
        if not _any_rank(refused):  # every rank steps again if one must: the step is collective
            break
    made_by = {
        key: node._event.name
        for node in mem._data_flow_graph.flow_nodes
        for key, edge in node._edges.items()
        if edge.is_allocation
    }
    live: dict = {}  # key -> (bytes, version)
    level = peak = 0
    at_peak: dict = {}
    for _, action, (key, version), size in mem.timeline:
        if key.device != device and not (key.device.type == device.type == "cpu"):
            continue
        if action == Action.CREATE:
            live[key], level = (size, version), level + size
        elif action == Action.DESTROY:
            live.pop(key, None)
            level -= size
        elif action == Action.INCREMENT_VERSION and key in live:
            live[key] = (live[key][0], version)
        if level > peak:
            peak, at_peak = level, dict(live)
    by_category: dict[str, int] = {}
    rows = []
    if not shapes:  # without the shapes the live set is not attributed (nor whole): the rise only
        return PeakComposition(peak, {}, ())
    for key, (size, version) in at_peak.items():
        category = mem._categories.get(key, version)
        name = category.name.lower() if category is not None else "unknown"
        by_category[name] = by_category.get(name, 0) + size
        rows.append((size, name, made_by.get(key, "?")))
    rows.sort(reverse=True)
    return PeakComposition(peak, dict(sorted(by_category.items(), key=lambda kv: -kv[1])), tuple(rows[:top]))


def _any_rank(flag: bool) -> bool:
    """``flag`` or'd over the world's ranks where a process group is up (the ranks step together), else ``flag``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, flag)
    return any(every)


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
