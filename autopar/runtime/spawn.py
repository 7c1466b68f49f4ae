"""Run a function on N local CPU ranks (gloo), one process each; never hangs.

``spawn_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn
context) with torchrun-like environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), initializes gloo on 127.0.0.1 with a free port, calls
``fn(rank, world_size, *args)`` in each and returns the per-rank results in rank
order.  Results travel as files (``torch.save``), so large tensors never block a
pipe.  If any rank raises, the others are stopped and ``RankError`` carries that
rank's traceback; ranks that outlive ``timeout_s`` are stopped and reported.

``fn`` must be importable by the children (a module-level function of a module
on ``sys.path``; spawn copies the parent's ``sys.path``).  ``autopar run`` and
the multi-rank tests both launch through here.
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

__all__ = ["spawn_ranks", "RankError", "free_port"]


class RankError(RuntimeError):
    """A rank failed or hung; the message carries the child's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable,
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple,
    init: bool,
    collective_timeout_s: float,
    threads: int,
    env: dict[str, str],
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    for key, value in env.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(threads)  # the ranks share this machine's cores
    out = Path(out_dir)
    try:
        if init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout_s),
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


def spawn_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    init: bool = True,
    collective_timeout_s: float = 60.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
    while_waiting: Callable[[], Any] | None = None,
) -> tuple[list[Any], Any]:
    """(per-rank results, ``while_waiting()``'s result): ``fn`` run on ``world_size`` gloo ranks.

    ``init=False`` skips ``init_process_group`` (for code that must see no default
    group, or initializes it from the environment itself).  ``while_waiting`` runs
    in the parent while the ranks work (e.g. a single-device reference run).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    extra = None
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, port, tmp, args, init, collective_timeout_s, threads, dict(env or {})),
                daemon=True,
            )
            for r in range(world_size)
        ]
        failed: list[int] = []
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            if while_waiting is not None:
                extra = while_waiting()
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
        name = getattr(fn, "__name__", "fn")
        if failed or errors:
            first = min(errors) if errors else failed[0]
            code = procs[first].exitcode
            killed = f"killed by signal {-code}" + (" (SIGKILL: often the out-of-memory killer)" if code == -9 else "")
            detail = errors.get(first, killed if code is not None and code < 0 else f"exit code {code}, no traceback")
            raise RankError(
                f"{name} on {world_size} ranks: rank {first} failed "
                f"(failed ranks {sorted(set(failed) | set(errors))}):\n{detail}"
            )
        if hung:
            raise RankError(
                f"{name} on {world_size} ranks: ranks {hung} still running after {timeout_s:.0f} s "
                "(a collective that not every rank issued?); stopped them"
            )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)], extra
