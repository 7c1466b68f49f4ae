"""Run a measurement on every rank: local CPU processes (gloo), or the ranks of the torchrun job this is.

``on_ranks(fn, ranks, *args)`` returns rank 0's ``fn(rank, world, *args)``; under
torchrun (``RANK``/``WORLD_SIZE`` set) this process is one rank (nccl with one GPU
each where CUDA is there, else gloo: ``runtime.init_distributed``) and the other
ranks get None.  ``calibrate`` and ``fidelity`` both start their ranks here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["on_ranks", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def on_ranks(fn: Callable, ranks: int, *args: Any, timeout_s: float, collective_timeout_s: float | None = None) -> Any:
    """Rank 0's result of ``fn(rank, world, *args)`` on ``ranks`` ranks (None on the other torchrun ranks).

    Local ranks are stopped after ``timeout_s`` seconds; one collective waits at most ``collective_timeout_s``
    (None: ``timeout_s``)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != ranks:
            raise ValueError(
                f"--ranks {ranks}, but this torchrun job has WORLD_SIZE={world}; pass --ranks {world} or launch "
                f"{ranks} processes"
            )
        from autopar.runtime import init_distributed

        init_distributed()
        return fn(int(os.environ["RANK"]), world, *args)
    from autopar.runtime import RankSettings, spawn_ranks

    settings = RankSettings(timeout_s=timeout_s, collective_timeout_s=collective_timeout_s or timeout_s)
    results, _ = spawn_ranks(fn, ranks, *args, settings=settings)
    return results[0]
