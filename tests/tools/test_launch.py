"""The local worker pool: results in rank order, errors reported with their rank, hangs bounded."""

import os

import pytest
import torch.distributed as dist

from syncbn.tools.launch import WorkerError, WorkerPool, free_port, launched_by_torchrun


def whoami(offset):
    return dist.get_rank() + offset, dist.get_world_size()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("rank one says no")
    return "fine"


def stuck_in_collective():
    """Rank 0 skips the collective the others enter: a hang the pool must bound."""
    if dist.get_rank() != 0:
        import torch

        dist.all_reduce(torch.ones(1))
    return "done"


def test_run_returns_results_in_rank_order(pool):
    assert pool.run(whoami, 10) == [(10, 4), (11, 4), (12, 4), (13, 4)]
    assert pool.run_each(whoami, [(0,), (1,), (2,), (3,)]) == [(0, 4), (2, 4), (4, 4), (6, 4)]


def test_error_names_the_rank_and_pool_survives(pool):
    with pytest.raises(WorkerError, match="rank one says no") as info:
        pool.run(fail_on_rank_one)
    assert sorted(info.value.errors) == [1]
    assert pool.run(whoami, 0)[3] == (3, 4)


def test_hang_is_bounded():
    with WorkerPool(2, timeout=5) as small:
        with pytest.raises((TimeoutError, WorkerError)):
            small.run(stuck_in_collective, timeout=30)  # gloo's own 5 s timeout fires first


def test_helpers():
    assert 0 < free_port() < 65536
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    try:
        assert not launched_by_torchrun()
    finally:
        os.environ.update(env)
    with pytest.raises(ValueError):
        WorkerPool(0)
