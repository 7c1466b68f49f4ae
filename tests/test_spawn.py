"""The rank launchers: ``RankPool`` (the tests' ranks) keeps ``spawn_ranks``'s contract across runs."""

from __future__ import annotations

import time

import pytest
import torch

from autopar.runtime.spawn import RankError


def _sum_of_ranks(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t), torch.rand(()).item()


def _fail_on_rank_one(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one refuses")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def test_pool_reruns_from_a_fresh_state_and_a_failing_rank_stops_the_run_fast():
    from rank_pool import RankPool  # here, not at the top: the killed-parent script imports this module

    pool = RankPool(2)
    try:
        first = pool.run(_sum_of_ranks)[0]
        second = pool.run(_sum_of_ranks)[0]
        assert [r[0] for r in first] == [1.0, 1.0]
        assert first == second  # each run starts from the ranks' initial random state
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"(?s)rank 1 failed.*rank one refuses"):
            pool.run(_fail_on_rank_one, timeout_s=120.0)
        assert time.monotonic() - t0 < 30.0  # not the 60 s collective timeout rank 0 is stuck in
        assert [r[0] for r in pool.run(_sum_of_ranks)[0]] == [1.0, 1.0]  # new ranks after the failure
    finally:
        pool.close()


def _report_pid_and_wait(rank, world, folder):
    import os
    from pathlib import Path

    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)


_KILLED_PARENT = """
import sys
from autopar.runtime.spawn import RankSettings, spawn_ranks
from tests.test_spawn import _report_pid_and_wait
spawn_ranks(_report_pid_and_wait, 2, sys.argv[1], settings=RankSettings(timeout_s=300.0))
"""


def test_ranks_die_with_a_parent_killed_by_a_signal(tmp_path):
    """A parent stopped by SIGKILL (a CI timeout, ``kill -9``) runs no cleanup: its ranks must not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT, str(tmp_path)], cwd=root)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    finally:
        parent.kill()
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # a zombie (dead, not yet reaped by init) counts as gone
        stat = Path(f"/proc/{pid}/stat")
        return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived their killed parent"


def _where_and_env(rank, world):
    import os

    return os.getcwd(), os.environ.get("AUTOPAR_TEST_SPAWN"), os.environ["RANK"]


def test_ranks_start_in_the_callers_directory_and_environment_as_they_are_at_the_call(tmp_path, monkeypatch):
    """The ranks are forked from a server started at the first call (``_rank_context``): a later call's working
    directory and environment must still be the caller's at that call, as a spawned rank's are."""
    from autopar.runtime.spawn import spawn_ranks

    first, _ = spawn_ranks(_where_and_env, 2)
    assert [r[1] for r in first] == [None, None]
    monkeypatch.setenv("AUTOPAR_TEST_SPAWN", "set after the server started")
    monkeypatch.chdir(tmp_path)
    later, _ = spawn_ranks(_where_and_env, 2)
    assert later == [(str(tmp_path), "set after the server started", str(r)) for r in range(2)]
