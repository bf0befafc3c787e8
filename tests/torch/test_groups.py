"""sync_groups: W = 4 split into two groups of 2; each group's statistics are those of its
own concatenated batch only (float64 oracle), and bad sizes fail alike on every rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import syncbn

GROUP, CHANNELS, STEPS = 2, 3, 2
SIZES = (3, 2, 4, 1)  # local batch of each of the 4 ranks: uneven on purpose


def draw(rank, step):
    """Rank ``rank``'s input and output gradient at ``step``; the two groups get data
    centred far apart, so mixing them up could not go unnoticed."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    block = rank // GROUP
    x = torch.randn(SIZES[rank], CHANNELS, 4, 3, generator=gen, dtype=torch.float64) * (1 + block) + 5 * block - 2
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    return x, dy


def weights():
    gen = torch.Generator().manual_seed(7)
    return torch.rand(CHANNELS, generator=gen, dtype=torch.float64) + 0.5, torch.randn(
        CHANNELS, generator=gen, dtype=torch.float64
    )


def group_job():
    group = syncbn.sync_groups(GROUP)
    again = syncbn.sync_groups(GROUP)
    rank = dist.get_rank()
    bn = syncbn.SyncBatchNorm(CHANNELS, process_group=group).double()
    w, b = weights()
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    steps = []
    for step in range(STEPS):
        x, dy = draw(rank, step)
        x.requires_grad_()
        y = bn(x)
        y.backward(dy)
        steps.append({"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad.clone(), "db": bn.bias.grad.clone()})
        bn.weight.grad = bn.bias.grad = None
    return {
        "same_group_again": again is group,
        "group_ranks": dist.get_process_group_ranks(group),
        "steps": steps,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
    }


def oracle(members):
    """Plain float64 batch norm on the concatenation of ``members``' batches."""
    w, b = weights()
    running_mean, running_var = torch.zeros(CHANNELS, dtype=torch.float64), torch.ones(CHANNELS, dtype=torch.float64)
    steps = []
    for step in range(STEPS):
        xs, dys = zip(*(draw(r, step) for r in members))
        x = torch.cat(xs).requires_grad_()
        ww, bb = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = F.batch_norm(x, running_mean, running_var, ww, bb, True, 0.1, 1e-5)
        y.backward(torch.cat(dys))
        steps.append({"y": y.detach(), "dx": x.grad, "dw": ww.grad, "db": bb.grad})
    return steps, running_mean, running_var


def test_two_groups_of_two_each_match_their_own_oracle(pool):
    results = pool.run(group_job)
    # float64 against the float64 oracle of each block: ~n * 2^-53 * |mean|/std ~1e-14; bound 1e-10
    tol = dict(rtol=1e-10, atol=1e-10)
    means = []
    for block in range(4 // GROUP):
        members = list(range(block * GROUP, (block + 1) * GROUP))
        ref_steps, ref_mean, ref_var = oracle(members)
        got = [results[r] for r in members]
        for g in got:
            assert g["group_ranks"] == members
            assert g["same_group_again"]
            torch.testing.assert_close(g["running_mean"], ref_mean, **tol)
            torch.testing.assert_close(g["running_var"], ref_var, **tol)
            assert torch.equal(g["running_var"], got[0]["running_var"])
        for step, ref in enumerate(ref_steps):
            torch.testing.assert_close(torch.cat([g["steps"][step]["y"] for g in got]), ref["y"], **tol)
            torch.testing.assert_close(torch.cat([g["steps"][step]["dx"] for g in got]), ref["dx"], **tol)
            torch.testing.assert_close(sum(g["steps"][step]["dw"] for g in got), ref["dw"], **tol)
            torch.testing.assert_close(sum(g["steps"][step]["db"] for g in got), ref["db"], **tol)
        means.append(ref_mean)
    # the two groups really saw different statistics
    assert (means[0] - means[1]).abs().min() > 0.1


def deepcopy_job():
    """A model synchronized over this rank's block, fused and plain layers both, and its
    deep copy (what an EMA copy, timm's ``ModelEmaV3``, makes): the copy holds its own
    tensors and the very same group, and a training step of each computes alike."""
    import copy

    import torch.nn as nn

    group = syncbn.sync_groups(GROUP)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(CHANNELS, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1), nn.BatchNorm2d(4)).double()
    model = syncbn.fuse_batchnorm_act(syncbn.convert_sync_batchnorm(model, process_group=group))
    twin = copy.deepcopy(model)
    layers = [m for m in twin.modules() if isinstance(m, (syncbn.SyncBatchNorm, syncbn.SyncBatchNormAct))]
    x, _ = draw(dist.get_rank(), 0)
    y, y_twin = model(x), twin(x)
    return {
        "kinds": sorted(type(m).__name__ for m in layers),
        "same_group": [m.process_group is group for m in layers],
        "own_tensors": not {t.data_ptr() for t in model.state_dict().values()}
        & {t.data_ptr() for t in twin.state_dict().values()},
        "placeholder_follows": twin[2]._syncbn_fused_into is twin[1],
        "equal": torch.equal(y, y_twin) and all(torch.equal(a, b) for a, b in
                                                 zip(model.state_dict().values(), twin.state_dict().values())),
    }


def test_a_model_on_a_sync_group_deep_copies_with_its_group(pool):
    """copy.deepcopy of a model converted with process_group=sync_groups(...) raised
    "cannot pickle 'ProcessGroup' object" (a process group cannot be copied)."""
    for result in pool.run(deepcopy_job):
        assert result == {"kinds": ["SyncBatchNorm", "SyncBatchNormAct"], "same_group": [True, True],
                          "own_tensors": True, "placeholder_follows": True, "equal": True}, result


def bad_size_job(size):
    try:
        syncbn.sync_groups(size)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("size", [3, 0, -2, 8])
def test_bad_group_size_fails_alike_on_every_rank(pool, size):
    messages = pool.run(bad_size_job, size)
    assert messages[0] is not None and messages[0].startswith("ValueError")
    assert len(set(messages)) == 1, messages
    # the pool is still usable: no rank was left inside a collective
    assert pool.run(dist.get_world_size) == [4] * 4


def whole_world_job():
    return syncbn.sync_groups(4) is None, syncbn.sync_groups(1) is not None


def test_whole_world_is_the_default_group_and_singletons_work(pool):
    assert pool.run(whole_world_job) == [(True, True)] * 4


def test_single_process():
    assert syncbn.sync_groups(1) is None
    with pytest.raises(RuntimeError, match="not initialized"):
        syncbn.sync_groups(2)
    with pytest.raises(TypeError):
        syncbn.sync_groups(2.0)


# ---- sizes that do not divide the world, and a world made anew (issue #20) -----------


def not_a_divisor_job(size):
    """Call sync_groups with a size that does not divide the world, with every way of
    creating a group or communicating replaced by a recorder that refuses: our own
    error must come first, before any collective."""
    import torch.distributed as tdist

    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"{name} called")

        return call

    names = ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "barrier", "all_reduce",
             "all_gather", "all_gather_object", "broadcast", "broadcast_object_list")
    saved = {name: getattr(tdist, name) for name in names}
    try:
        for name in names:
            setattr(tdist, name, refuse(name))
        try:
            syncbn.sync_groups(size)
        except Exception as exc:  # noqa: BLE001 - report what came out
            return type(exc).__name__, str(exc), calls
        return None, None, calls
    finally:
        for name, fn in saved.items():
            setattr(tdist, name, fn)


@pytest.mark.parametrize("size", [3, 8])
def test_size_that_does_not_divide_the_world_raises_our_error_before_any_collective(pool, size):
    results = pool.run(not_a_divisor_job, size)
    for kind, message, calls in results:
        assert calls == []
        assert kind == "ValueError"
        assert f"the world size 4 is not a multiple of group_size {size}" in message
    assert len(set(r[1] for r in results)) == 1
    assert pool.run(dist.get_world_size) == [4] * 4


def remade_world_job(port):
    """sync_groups before and after the default group is destroyed and created again:
    the second call must make groups of the new world, not hand back the old ones, and
    the first groups are freed once torch lets go of them."""
    import datetime
    import gc
    import weakref

    import torch.distributed as tdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    first = syncbn.sync_groups(1)
    first_ranks = tdist.get_process_group_ranks(first)
    first_alive = weakref.ref(first)
    del first
    # every rank done with the groups before any destroys them: new_group's own barrier lets
    # rank 0 go on while another rank still reads the store that rank 0 serves, and the
    # world, now really freed, takes that store with it
    tdist.barrier()
    tdist.destroy_process_group()
    gc.collect()
    # syncbn's cache must not keep the group (nor its gloo threads) alive past its end
    first_freed = first_alive() is None
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    second = syncbn.sync_groups(1)
    again = syncbn.sync_groups(1)
    # the new group works: a synchronized layer trains on it (its own batch only)
    bn = syncbn.SyncBatchNorm(2, process_group=second).double()
    x = torch.arange(8.0, dtype=torch.float64).view(4, 2) * (rank + 1)
    y = bn(x)
    expected = F.batch_norm(x, None, None, training=True)
    return {
        "first_ranks": first_ranks,
        "second_ranks": tdist.get_process_group_ranks(second),
        "first_freed": first_freed,
        "new_group": first_freed and second is not first_alive(),
        "cached_again": again is second,
        "output_ok": bool(torch.allclose(y, expected, rtol=1e-12, atol=1e-12)),
    }


def test_sync_groups_after_the_default_group_is_made_anew():
    """A pool of its own: the job destroys and re-creates the default group."""
    from syncbn.tools.launch import WorkerPool, free_port

    with WorkerPool(2, backend="gloo", timeout=60) as own:
        results = own.run(remade_world_job, free_port())
    for rank, r in enumerate(results):
        assert r["first_ranks"] == [rank] and r["second_ranks"] == [rank]
        assert r["first_freed"] and r["new_group"] and r["cached_again"] and r["output_ok"], r


def destroyed_group_job():
    """sync_groups(2), that group destroyed on every rank, then sync_groups(2) again."""
    import torch.distributed as tdist

    first = syncbn.sync_groups(2)
    tdist.barrier()
    tdist.destroy_process_group(first)
    second = syncbn.sync_groups(2)
    total = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(total, group=second)  # the new group works: its block's ranks summed
    return {"new": second is not first, "ranks": tdist.get_process_group_ranks(second),
            "sum": total.item(), "again": syncbn.sync_groups(2) is second}


def test_a_destroyed_group_is_made_anew(pool):
    for rank, r in enumerate(pool.run(destroyed_group_job)):
        block = [rank - rank % 2, rank - rank % 2 + 1]
        assert r == {"new": True, "ranks": block, "sum": float(sum(block)), "again": True}
