"""The rank launchers: ``RankPool`` (the tests' ranks) keeps ``spawn_ranks``'s contract across runs."""

from __future__ import annotations

import time

import pytest
import torch

from autopar.runtime.spawn import RankError, RankPool


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
