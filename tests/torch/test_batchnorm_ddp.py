"""A small convnet trained under DDP with syncbn ends where one process trained on the
concatenated batch ends. In float64, so that any real difference stands far above rounding."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from workers import group_of, in_group

WORLD, PER_RANK, STEPS = 2, 2, 5


def convnet():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.BatchNorm1d(4),
    ).double()


def batches():
    gen = torch.Generator().manual_seed(9)
    for _ in range(STEPS):
        x = torch.randn(WORLD * PER_RANK, 3, 6, 6, generator=gen, dtype=torch.float64) * 2 + 1
        y = torch.randint(0, 4, (WORLD * PER_RANK,), generator=gen)
        yield x, y


def train(model, rank=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches():
        if rank is not None:
            x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_job(broadcast_buffers):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model = syncbn.convert_sync_batchnorm(convnet(), process_group=group)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, broadcast_buffers=broadcast_buffers)  # noqa
    return train(ddp, dist.get_rank())


def test_ddp_training_equals_one_big_batch(pool):
    results = pool.run(ddp_job, True)[:WORLD]
    reference = train(convnet())
    assert any("running_var" in k for k in reference)
    for state in results:
        for key, ref in reference.items():
            got = state["module." + key]
            # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-10 leaves 100x or more
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=key)


def test_buffers_stay_identical_without_broadcast(pool):
    results = pool.run(ddp_job, False)[:WORLD]
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key
