"""Run a function on N local CPU ranks (gloo), one process each; never hangs.

``spawn_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn
context) with torchrun-like environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), initializes gloo on 127.0.0.1 with a free port, calls
``fn(rank, world_size, *args)`` in each and returns the per-rank results in rank
order.  Results travel as files (``torch.save``), so large tensors never block a
pipe.  If any rank raises, the others are stopped and ``RankError`` carries that
rank's traceback; ranks that outlive ``timeout_s`` are stopped and reported.

``fn`` must be importable by the children (a module-level function of a module
on ``sys.path``; the children get the parent's ``sys.path``, working directory and
environment as they are at the call).  ``autopar run`` and the multi-rank tests both
launch through here (the tests keep their ranks between runs in ``tests/rank_pool.py``,
built on the same task and result handling).  ``RankSettings`` holds how the ranks
run: time limits, threads, environment.

Start-up (``_rank_context``).  Where the platform has it the ranks are forked from
multiprocessing's fork server, started once per parent process with the modules the
parent has imported of autopar, costmodel and the Hugging Face model code already
imported (``_preloaded``): a rank then starts without importing torch and
transformers itself, seconds of CPU per rank on cores the ranks share (``autopar run
gpt2-tiny --mesh 2x2 --check`` on 2 cores: 27 s -> 18 s).  Not a plain fork: the
parent has run torch ops (OpenMP and intra-op thread pools), which a forked child
must not inherit; the server has only imported.  Elsewhere (Windows) the ranks are
spawned as fresh interpreters.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["spawn_ranks", "RankSettings", "RankError", "free_port"]


@dataclass(frozen=True, slots=True)
class RankSettings:
    """How spawned ranks run.

    ``timeout_s``: the whole run's limit (ranks still running after it are stopped and
    reported); ``collective_timeout_s``: gloo's limit on one collective; ``init=False``
    skips ``init_process_group`` (for code that must see no default group, or
    initializes it from the environment itself); ``threads``: torch threads per rank;
    ``env``: environment variables set in every rank.
    """

    timeout_s: float = 120.0
    collective_timeout_s: float = 60.0
    init: bool = True
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)


class RankError(RuntimeError):
    """A rank failed or hung; the message carries the child's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Task(NamedTuple):
    """One run as every rank receives it."""

    fn: Callable
    port: int  # of the run's gloo store
    out_dir: str  # where each rank leaves its result (rank{r}.pt) or traceback (rank{r}.err)
    args: tuple
    init: bool  # initialize the default process group around ``fn``
    collective_timeout_s: float


def _run_task(task: _Task, rank: int, world_size: int) -> bool:
    """One rank's share of a run: gloo up (``init``), ``fn``, its result or traceback to ``out_dir``, gloo down.

    True if ``fn`` returned.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(task.port),
    )
    out = Path(task.out_dir)
    try:
        if task.init:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{task.port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=task.collective_timeout_s),
            )
        result = task.fn(rank, world_size, *task.args)
        if dist.is_available() and dist.is_initialized():
            # rank 0 hosts the store: none leaves while another still sets up a group's connections through it
            # (gloo connects a group on its first collective; a rank done early once closed it under two others)
            dist.barrier()
        torch.save(result, out / f"rank{rank}.pt.tmp")
        os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
        return True
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        return False
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent(parent: int) -> None:
    """End this rank when the process that started it (pid ``parent``) dies.

    Without it, a parent stopped by a signal it does not handle (``kill``, a CI
    timeout) leaves its ranks running, stuck in a collective or holding the cores.
    A spawned rank asks the kernel (Linux ``PR_SET_PDEATHSIG``).  A rank the fork
    server forked is the server's child, and the server outlives the parent while
    any of its children hold its pipe: a thread waits on multiprocessing's sentinel
    of the parent (a pipe the parent holds open) and ends the rank at its EOF.
    Elsewhere the parent's ``_stop`` is the only guard.
    """
    import sys

    if os.getppid() != parent:  # forked by the fork server (or the parent is gone already)
        _watch_parent(parent)
        return
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took hold
        os._exit(1)


def _watch_parent(parent: int) -> None:
    """A daemon thread that ends this rank (``os._exit(1)``) once the parent's sentinel reads EOF; at once when
    the parent is gone already."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait

    started_by = multiprocessing.parent_process()
    if started_by is None or started_by.pid != parent or not started_by.is_alive():
        os._exit(1)

    def watch() -> None:
        wait([started_by.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="autopar-parent-watch", daemon=True).start()


def _child(task: _Task, rank: int, world_size: int, threads: int, parent: int, environ: dict[str, str]) -> None:
    """A ``spawn_ranks`` rank: one run, then exit (1 if ``fn`` raised).  ``environ``: the rank's whole environment
    (a rank of the fork server starts with the server's, not the caller's at the call)."""
    _die_with_parent(parent)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)  # the ranks share this machine's cores
    code = 0 if _run_task(task, rank, world_size) else 1
    _exit_now(code)


def _exit_now(code: int) -> None:
    """End this rank with ``os._exit`` once its result (or traceback) is written and its groups are gone.

    What a normal exit runs first still runs, in its order: multiprocessing's finalizers, the
    join of threads ``fn`` left (``multiprocessing.process.BaseProcess._bootstrap``), then the
    atexit handlers (``runtime.at_exit.release`` among them).  What is skipped is the
    interpreter's teardown of every module of torch, transformers and autopar: a second or
    more of CPU per rank, on cores the other ranks share (4 ranks of ``autopar run``: about 8
    of 48 CPU seconds).
    """
    import atexit
    import sys
    import threading
    from multiprocessing import util

    util._exit_function()
    threading._shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_context():
    """The multiprocessing context the ranks start in: the fork server's where the platform has one (module
    docstring, Start-up), else spawn.  The server's preload is set before it first starts (later calls leave a
    running server as it is: a rank imports what the server lacks)."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_preloaded())
    return ctx


def _preloaded() -> list[str]:
    """The modules the fork server imports before it forks a rank: torch.distributed, and those of autopar,
    costmodel and transformers' model code (``transformers.models.*``: the model classes ``fn`` builds) the
    parent has imported, so the ranks find them imported."""
    import sys

    ours = ("autopar.", "costmodel", "transformers.models.")
    return ["torch.distributed", *sorted(name for name in list(sys.modules) if name.startswith(ours))]


def _wait(ranks: int, deadline: float, poll: Callable[[], dict[int, bool]]) -> tuple[list[int], list[int]]:
    """(failed ranks, unfinished ranks) once every rank ended, one failed, or ``deadline`` passed.

    ``poll()`` names the ranks that ended since it was last called: True for a
    rank whose function returned, False for one that failed.
    """
    ended: dict[int, bool] = {}
    while True:
        ended.update(poll())
        failed = sorted(r for r, ok in ended.items() if not ok)
        if failed or len(ended) == ranks or time.monotonic() >= deadline:
            return failed, [r for r in range(ranks) if r not in ended]
        time.sleep(0.02)


def _exited(procs: list) -> dict[int, bool]:
    """{rank: exited 0} of the processes that have exited."""
    return {r: p.exitcode == 0 for r, p in enumerate(procs) if p.exitcode is not None}


def _stop(procs: list) -> None:
    """Terminate (then kill) every process of ``procs`` still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _results(tmp: str, fn: Callable, world_size: int, timeout_s: float, failed: list[int], hung: list[int], exitcode):
    """The per-rank results saved in ``tmp``; else ``RankError`` naming the rank that failed first or the hung ones."""
    errors = {
        r: (Path(tmp) / f"rank{r}.err").read_text() for r in range(world_size) if (Path(tmp) / f"rank{r}.err").exists()
    }
    name = getattr(fn, "__name__", "fn")
    if failed or errors:
        # the rank that failed first is the cause; its peers often fail after it (a collective with a dead peer)
        first = min(errors, key=lambda r: ((Path(tmp) / f"rank{r}.err").stat().st_mtime_ns, r)) if errors else failed[0]
        code = exitcode(first)
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
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def spawn_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    settings: RankSettings = RankSettings(),
    while_waiting: Callable[[], Any] | None = None,
) -> tuple[list[Any], Any]:
    """(per-rank results, ``while_waiting()``'s result): ``fn`` run on ``world_size`` gloo ranks.

    ``settings`` says how the ranks run (``RankSettings``).  ``while_waiting`` runs
    in the parent while the ranks work (e.g. a single-device reference run).
    """
    timeout_s = settings.timeout_s
    ctx = _rank_context()
    port = free_port()
    extra = None
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    _Task(fn, port, tmp, args, settings.init, settings.collective_timeout_s),
                    r,
                    world_size,
                    settings.threads,
                    os.getpid(),
                    {**settings.env, **os.environ},  # RankSettings.env where the caller's has no such variable
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        failed: list[int] = []
        hung: list[int] = []  # reported only when no rank failed (``_results``)
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            if while_waiting is not None:
                extra = while_waiting()
            failed, hung = _wait(world_size, deadline, lambda: _exited(procs))
        finally:
            _stop(procs)
        return _results(tmp, fn, world_size, timeout_s, failed, hung, lambda r: procs[r].exitcode), extra
