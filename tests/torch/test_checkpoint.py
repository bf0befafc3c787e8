"""Activation checkpointing (syncbn.checkpoint): the forward recomputed during backward normalizes as the first
one did and does not move the running statistics again. W = 2, float64: training with and
without checkpointing ends with the same parameters, gradients and buffers, and both
ranks issue the same sequence of collectives."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from syncbn import checkpoint

import syncbn
from syncbn.tools.traffic import record_collectives
from workers import group_of, in_group

WORLD, PER_RANK, STEPS = 2, 3, 4


class Block(nn.Module):
    def __init__(self, cin, cout, momentum=0.1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout, momentum=momentum)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    """Two blocks, the second with a cumulative-average BN (momentum None), which would
    show a doubled ``num_batches_tracked`` at once."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt  # None, or use_reentrant for syncbn.checkpoint
        self.block1 = Block(3, 4)
        self.block2 = Block(4, 4, momentum=None)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in (self.block1, self.block2):
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt)
        return self.head(x.mean(dim=(2, 3)))


def make(ckpt, group):
    torch.manual_seed(0)
    return syncbn.convert_sync_batchnorm(Net(ckpt), process_group=group).double()


def data(step, rank):
    gen = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(PER_RANK, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 1
    dy = torch.randn(PER_RANK, 2, generator=gen, dtype=torch.float64)
    return x, dy


def train_job(ckpt):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    model = make(ckpt, group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    collectives = []
    for step in range(STEPS):
        x, dy = data(step, rank)
        # the input needs no gradient: with use_reentrant=True the block's gradients
        # would then be dropped, so let the input carry one in every variant alike
        x.requires_grad_()
        opt.zero_grad()
        with record_collectives() as calls:
            model(x).backward(dy)
        collectives.append([(c.op, c.shapes) for c in calls])
        for p in model.parameters():  # the data-parallel average of the local gradients
            dist.all_reduce(p.grad, group=group)
            p.grad /= WORLD
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return {"state": state, "grads": grads, "collectives": collectives}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_training_equals_plain_training(pool, use_reentrant):
    plain = pool.run(train_job, None)[:WORLD]
    ckpt = pool.run(train_job, use_reentrant)[:WORLD]
    for rank in range(WORLD):
        for key, ref in plain[rank]["state"].items():
            # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-12 leaves 100x or more
            torch.testing.assert_close(ckpt[rank]["state"][key], ref, rtol=1e-12, atol=1e-12, msg=key)
        for key, ref in plain[rank]["grads"].items():
            torch.testing.assert_close(ckpt[rank]["grads"][key], ref, rtol=1e-12, atol=1e-12, msg=key)
    assert int(ckpt[0]["state"]["block2.bn.num_batches_tracked"]) == STEPS
    for key, value in ckpt[0]["state"].items():
        assert torch.equal(value, ckpt[1]["state"][key]), key
    # the same collectives, in the same order, on both ranks
    assert ckpt[0]["collectives"] == ckpt[1]["collectives"]
    # per step and layer: one all-reduce forward, one backward, and one more forward when
    # the layer's forward is recomputed (2 layers)
    assert [len(c) for c in plain[0]["collectives"]] == [4] * STEPS
    assert [len(c) for c in ckpt[0]["collectives"]] == [6] * STEPS


def test_single_process_checkpoint_updates_once():
    """Without torch.distributed the layer is plain batch norm, and still counts once."""
    torch.manual_seed(0)
    plain = syncbn.convert_sync_batchnorm(Net(None)).double()
    torch.manual_seed(0)
    ckpt = syncbn.convert_sync_batchnorm(Net(False)).double()
    for step in range(STEPS):
        x, dy = data(step, 0)
        for model in (plain, ckpt):
            model(x.clone().requires_grad_()).backward(dy)
    for key, ref in plain.state_dict().items():
        # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-12 leaves 100x or more
        torch.testing.assert_close(ckpt.state_dict()[key], ref, rtol=1e-12, atol=1e-12, msg=key)
    for (key, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=key)


def test_recomputation_as_context_fn_survives_a_second_backward():
    """The docs' ``context_fn`` for torch's own non-reentrant checkpoint: a second
    ``backward`` of a retained graph recomputes again and enters the same recompute
    context again (a generator-based context manager failed there with an
    AttributeError); every recomputation is marked, so the buffers move once."""
    import contextlib

    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from syncbn.torch.recompute import recomputation

    def context_fn():
        return contextlib.nullcontext(), recomputation()

    torch.manual_seed(0)
    plain = syncbn.convert_sync_batchnorm(Block(3, 4, momentum=None)).double()
    torch.manual_seed(0)
    ckpt = syncbn.convert_sync_batchnorm(Block(3, 4, momentum=None)).double()
    x, _ = data(0, 0)
    out = plain(x.clone().requires_grad_()).sum()
    out.backward(retain_graph=True)
    out.backward()
    out = torch_checkpoint(ckpt, x.clone().requires_grad_(), use_reentrant=False, context_fn=context_fn).sum()
    out.backward(retain_graph=True)
    out.backward()  # recomputes a second time
    assert int(ckpt.bn.num_batches_tracked) == 1
    for key, ref in plain.state_dict().items():
        # float64, one layer and one batch: rounding ~1e-15; bound 1e-12 leaves 100x or more
        torch.testing.assert_close(ckpt.state_dict()[key], ref, rtol=1e-12, atol=1e-12, msg=key)
    for (key, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=key)


# ---- the function form: syncbn.functional.sync_batch_norm under checkpointing ---------
# The modules above hand the kernels copies of their buffers on their own; the function
# must do the same for the buffers a caller passes in (issue #20, item 1).


def functional_steps(ckpt, group=None, rank=0, world=1, momentum=0.3):
    """Three training steps of the function on caller-held buffers, checkpointed
    (``ckpt`` = use_reentrant) or not; returns the buffers, outputs and gradients."""
    from syncbn.torch.functional import sync_batch_norm

    rm = torch.zeros(4, dtype=torch.float64)
    rv = torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2.0, 4, dtype=torch.float64).requires_grad_()
    b = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64).requires_grad_()

    def fn(x):
        return sync_batch_norm(x, rm, rv, w, b, True, momentum, 1e-5, group)

    out = {"y": [], "dx": []}
    for step in range(3):
        gen = torch.Generator().manual_seed(50 * step + rank)
        x = (torch.randn(3 + rank, 4, 5, generator=gen, dtype=torch.float64) * 2 + 3).requires_grad_()
        dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        y = fn(x) if ckpt is None else checkpoint(fn, x, use_reentrant=ckpt)
        y.backward(dy)
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
    out.update(rm=rm, rv=rv, dw=w.grad, db=b.grad)
    return out


def functional_job(ckpt):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    return functional_steps(ckpt, group, dist.get_rank(), WORLD)


def assert_same_run(got, ref):
    for key in ("rm", "rv", "dw", "db"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-12, atol=1e-12, msg=key)
    for key in ("y", "dx"):
        for a, b in zip(got[key], ref[key]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_functional_under_checkpoint_updates_buffers_once(pool, use_reentrant):
    plain = pool.run(functional_job, None)[:WORLD]
    ckpt = pool.run(functional_job, use_reentrant)[:WORLD]
    for rank in range(WORLD):
        assert_same_run(ckpt[rank], plain[rank])
    # and the buffers did move (three steps of momentum 0.3): not a vacuous comparison
    assert not torch.equal(plain[0]["rm"], torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_functional_under_checkpoint_single_process(use_reentrant):
    assert_same_run(functional_steps(use_reentrant), functional_steps(None))
