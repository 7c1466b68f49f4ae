"""The tests' ranks: ``RankPool`` keeps ``world_size`` gloo rank processes alive between runs.

``RankPool(world_size).run(fn, *args)`` has ``autopar.runtime.spawn_ranks``'s contract
(default init, results in rank order, ``RankError`` with the failing rank's
traceback, never hangs) without a fresh interpreter per run: a test suite would
otherwise pay seconds of imports (torch, transformers) per rank and run.  It reuses
``autopar.runtime.spawn``'s task and result handling, so the two cannot drift.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from autopar.runtime.spawn import _die_with_parent, _results, _run_task, _stop, _Task, _wait, free_port

__all__ = ["RankPool"]


def _pool_worker(rank: int, world_size: int, tasks, finished, threads: int, parent: int) -> None:
    """A ``RankPool`` rank: runs the tasks it is sent, one after another, each from the state it started in."""
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    rng = torch.random.get_rng_state()
    environ = dict(os.environ)
    while (task := tasks.get()) is not None:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)  # each task starts from a fresh process's random state
        os.environ.clear()
        os.environ.update(environ)
        ok = _run_task(task, rank, world_size)
        finished.put((rank, ok))
        if not ok:
            return  # its peers may be stuck in a collective: the pool is stopped and started afresh


class RankPool:
    """``world_size`` gloo rank processes kept alive between runs: ``spawn_ranks`` without the start-up per run.

    ``run(fn, *args)`` has ``spawn_ranks``'s contract (default init, results in
    rank order, ``RankError`` with the failing rank's traceback, never hangs).  Each
    run initializes a fresh default process group on a new port and destroys it
    afterwards, and starts from the process's initial random state and
    environment; module-level state a run leaves in imported modules persists.  A
    run that fails or times out stops every rank; the next run starts new ones.
    Meant for test suites, where a fresh interpreter per run costs seconds of
    imports (torch, transformers) per rank.
    """

    def __init__(self, world_size: int, *, threads: int = 1) -> None:
        self.world_size, self.threads = world_size, threads
        self._procs: list = []
        self._tasks: list = []
        self._finished = None

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._finished = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, self.world_size, self._tasks[r], self._finished, self.threads, os.getpid()),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _ended(self) -> dict[int, bool]:
        """{rank: its function returned} of the ranks that reported since the last call; a dead rank failed."""
        import queue

        ended: dict[int, bool] = {}
        while True:
            try:
                rank, ok = self._finished.get_nowait()
            except queue.Empty:
                break
            ended[rank] = ok
        return ended | {r: False for r, p in enumerate(self._procs) if not p.is_alive() and r not in ended}

    def run(
        self,
        fn: Callable,
        *args: Any,
        timeout_s: float = 120.0,
        collective_timeout_s: float = 60.0,
        while_waiting: Callable[[], Any] | None = None,
    ) -> tuple[list[Any], Any]:
        """(per-rank results, ``while_waiting()``'s result) of ``fn(rank, world_size, *args)`` on the pool's ranks."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        extra = None
        with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as tmp:
            port = free_port()
            for q in self._tasks:
                q.put(_Task(fn, port, tmp, args, True, collective_timeout_s))
            deadline = time.monotonic() + timeout_s
            if while_waiting is not None:
                extra = while_waiting()
            failed, hung = _wait(self.world_size, deadline, self._ended)
            procs = self._procs
            if failed or hung:
                self.close()
            return _results(tmp, fn, self.world_size, timeout_s, failed, hung, lambda r: procs[r].exitcode), extra

    def close(self) -> None:
        """Stop the ranks (idle ones exit, busy ones are terminated)."""
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=2)
        _stop(self._procs)
        self._procs, self._tasks, self._finished = [], [], None
