"""Run a function on N ranks in CPU processes with the gloo backend, for tests.

``run_ranks(fn, world_size, *args)`` is ``autopar.runtime.spawn.spawn_ranks``
(the launcher ``autopar run`` uses) returning just the per-rank results, with a
60 s collective timeout.  ``fn`` must be a module-level function of a module on
``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from autopar.runtime.spawn import RankError, free_port, spawn_ranks

# A test profile with cheap collectives (tests/profiles/cheap_comm.toml): plans made with it
# partition even the tiny test models, so the multi-rank tests exercise real sharded plans.
PARTITIONING_PROFILE = str(Path(__file__).parent / "profiles" / "cheap_comm.toml")

__all__ = ["run_ranks", "RankError", "free_port"]


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, init: bool = True) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own gloo rank process."""
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, init=init)[0]
