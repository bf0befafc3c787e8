"""DDP's per-forward buffer broadcast is not needed with syncbn: the running buffers are
identical on every rank by construction. W = 2, float64: with the broadcast off (the
``forward_sync_buffers=False`` of torch >= 2.13, or the older, now deprecated
``broadcast_buffers=False``) the buffers stay identical across ranks, equal to one
process on the concatenated batch, and no broadcast runs during training; plain torch
BN layers under the same setting drift apart (the check can fail)."""

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from syncbn.tools.traffic import record_collectives
from workers import group_of, in_group

WORLD, PER_RANK, STEPS = 2, 3, 4
HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters


def net():
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()


def batch(step):
    gen = torch.Generator().manual_seed(77 + step)
    x = torch.randn(WORLD * PER_RANK, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 3, (WORLD * PER_RANK,), generator=gen)
    return x, y


def train(model, rank=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ops = []
    for step in range(STEPS):
        x, y = batch(step)
        if rank is not None:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        opt.zero_grad()
        with record_collectives() as calls:
            F.cross_entropy(model(x), y).backward()
        # DDP broadcasts the bucket order (integers) once, at the second step; a buffer
        # broadcast carries the float64 buffers
        ops.append(sorted({c.op + ("(float)" if "double" in c.dtypes else "") for c in calls}))
        opt.step()
    module = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, ops


def ddp_job(flag, convert):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model = net()
    if convert:
        model = syncbn.convert_sync_batchnorm(model, process_group=group)
    kwargs = {} if flag is None else {flag: False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)
    deprecated = any("deprecated" in str(w.message) and issubclass(w.category, FutureWarning) for w in caught)
    state, ops = train(ddp, dist.get_rank())
    return {"state": state, "ops": ops, "deprecated": deprecated}


FLAGS = ["forward_sync_buffers", "broadcast_buffers"] if HAS_FORWARD_SYNC else ["broadcast_buffers"]


@pytest.mark.parametrize("flag", FLAGS)
def test_buffers_stay_identical_without_forward_broadcast(pool, flag):
    results = pool.run(ddp_job, flag, True)[:WORLD]
    reference, _ = train(net())
    for key, ref in reference.items():
        for r in results:
            # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-10 leaves 100x or more
            torch.testing.assert_close(r["state"][key], ref, rtol=1e-10, atol=1e-10, msg=key)
        assert torch.equal(results[0]["state"][key], results[1]["state"][key]), key
    for r in results:
        assert all("broadcast(float)" not in ops for ops in r["ops"]), r["ops"]
    if HAS_FORWARD_SYNC:  # torch 2.13 deprecates broadcast_buffers in favour of forward_sync_buffers
        assert results[0]["deprecated"] == (flag == "broadcast_buffers")


def test_default_ddp_broadcasts_buffers_every_forward(pool):
    results = pool.run(ddp_job, None, True)[:WORLD]
    assert all("broadcast(float)" in ops for ops in results[0]["ops"]), results[0]["ops"]


def test_plain_bn_buffers_drift_apart_without_broadcast(pool):
    results = pool.run(ddp_job, FLAGS[0], False)[:WORLD]
    assert not torch.equal(results[0]["state"]["1.running_mean"], results[1]["state"]["1.running_mean"])
