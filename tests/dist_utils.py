"""Run a function on N ranks in CPU processes with the gloo backend, for tests.

``run_ranks(fn, world_size, *args)`` returns the per-rank results of
``fn(rank, world_size, *args)``, with a 60 s collective timeout.  The ranks are
those of one ``autopar.runtime.spawn.RankPool`` per world size, kept for the
whole test session: every call gets a fresh gloo process group, but not a fresh
interpreter (which costs seconds of torch and transformers imports per rank).
``init=False`` (code that must see no process group) spawns fresh processes with
``spawn_ranks``, the launcher ``autopar run`` uses.  ``fn`` must be a
module-level function of a module on ``sys.path``.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rank_pool import RankPool

from autopar.runtime.spawn import RankError, RankSettings, free_port, spawn_ranks

# A test profile with cheap collectives (tests/profiles/cheap_comm.toml): plans made with it
# partition even the tiny test models, so the multi-rank tests exercise real sharded plans.
PARTITIONING_PROFILE = str(Path(__file__).parent / "profiles" / "cheap_comm.toml")

__all__ = ["run_ranks", "RankError", "free_port"]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, init: bool = True) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own gloo rank process."""
    if not init:
        return spawn_ranks(fn, world_size, *args, settings=RankSettings(timeout_s=timeout_s, init=False))[0]
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size].run(fn, *args, timeout_s=timeout_s)[0]


_POOLS: dict[int, RankPool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
