"""Run a function on N ranks in CPU processes with the gloo backend, for tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (spawn
context), initializes gloo on 127.0.0.1 with a free port and a 60 s collective
timeout, calls ``fn(rank, world_size, *args)`` on each, and returns the per-rank
return values (rank order).  Results travel as files (``torch.save``), so large
tensors never block a pipe.  If any rank raises, the others are stopped and
``RankError`` carries that rank's traceback; if the ranks outlive ``timeout_s``
they are stopped and ``RankError`` says which ranks hung.  It never hangs.

``fn`` must be importable by the children: a module-level function of a module on
``sys.path`` (spawn copies the parent's ``sys.path``).  Children see torchrun-like
environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankError", "free_port"]


class RankError(RuntimeError):
    """A rank failed or hung; the message carries the child's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, out_dir: str, args: tuple, init: bool) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # N ranks share a few cores
    out = Path(out_dir)
    try:
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=60),
            )
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt.tmp")
        os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, init: bool = True) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run in its own gloo rank process.

    ``init=False`` skips ``init_process_group`` (to test code that must see no
    default group, or that initializes it itself from the environment).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as tmp:
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, tmp, args, init), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed: list[int] = []
        try:
            while time.monotonic() < deadline:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or all(p.exitcode == 0 for p in procs):
                    break
                time.sleep(0.02)
        finally:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        errors = {
            r: (Path(tmp) / f"rank{r}.err").read_text()
            for r in range(world_size)
            if (Path(tmp) / f"rank{r}.err").exists()
        }
        if failed or errors:
            first = min(errors) if errors else failed[0]
            detail = errors.get(first, f"exit code {procs[first].exitcode} and no traceback")
            raise RankError(
                f"{fn.__name__} on {world_size} ranks: rank {first} failed "
                f"(failed ranks {sorted(set(failed) | set(errors))}):\n{detail}"
            )
        if hung:
            raise RankError(
                f"{fn.__name__} on {world_size} ranks: ranks {hung} still running after {timeout_s:.0f} s "
                "(a collective that not every rank issued?); stopped them"
            )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
