"""syncbn.functional.sync_batch_norm: the function form, and errors that every rank agrees on."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from syncbn.functional import sync_batch_norm
from workers import group_of, in_group


def functional_job(world, sizes):
    group = group_of(world)
    if not in_group(world):
        return None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 4, 3, generator=gen, dtype=torch.float64) * 3 - 2 for n in sizes]
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64)
    y = sync_batch_norm(xs[rank], rm, rv, w, None, True, 0.3, 1e-3, group)
    return {"y": y, "rm": rm, "rv": rv, "xs": xs}


def test_functional_matches_batch_norm_on_concatenation(pool):
    sizes = (3, 0, 2, 5)
    results = pool.run(functional_job, 4, sizes)
    xs = results[0]["xs"]
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64)
    ref = F.batch_norm(torch.cat(xs), rm, rv, w, None, True, 0.3, 1e-3)
    # float64: defaults rtol = atol = 1e-7, far above ~n * 2^-53 * |mean|/std ~1e-15
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), ref)
    for r in results:
        torch.testing.assert_close(r["rm"], rm)
        torch.testing.assert_close(r["rv"], rv)


def test_not_training_is_plain_batch_norm():
    x = torch.randn(5, 3, 2) + 1
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    # not training: the same call of F.batch_norm on both sides, so equal on any CPU
    torch.testing.assert_close(sync_batch_norm(x, rm, rv, training=False), F.batch_norm(x, rm, rv))


def error_job(world, sizes, tail):
    """Run a layer whose global element count may be too small; report what each rank saw."""
    group = group_of(world)
    if not in_group(world):
        return None
    import syncbn

    bn = syncbn.SyncBatchNorm(3, process_group=group)
    x = torch.randn((sizes[dist.get_rank()], 3) + tuple(tail))
    try:
        bn(x)
    except ValueError as exc:
        return ("ValueError", str(exc))
    # the pool must still be usable afterwards: one more collective in the same group
    return ("ok", None)


@pytest.mark.parametrize("sizes", [(1, 0, 0, 0), (0, 0, 0, 0), (0, 1), (1,)])
def test_too_few_values_raise_on_every_rank(pool, sizes):
    world = len(sizes)
    results = pool.run(error_job, world, sizes, ())[:world]
    for kind, message in results:
        assert kind == "ValueError" and "more than 1 value per channel" in message


def test_enough_values_split_thinly_do_not_raise(pool):
    results = pool.run(error_job, 4, (1, 0, 1, 0), ())
    assert [r[0] for r in results] == ["ok"] * 4


def test_bad_dims_raise_before_any_collective(pool):
    """Every rank raises the same shape error, so no rank is left inside a collective."""
    results = pool.run(error_job, 4, (2, 2, 2, 2), (1, 1, 1, 1))
    for kind, message in results:
        assert kind == "ValueError" and "2D to 5D" in message
    # and the group still works
    assert [r[0] for r in pool.run(error_job, 4, (2, 2, 2, 2), (2,))] == ["ok"] * 4
