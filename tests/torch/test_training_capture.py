"""Capturing a training-mode synchronized call: ``torch.jit.trace``, ``torch.export.export``
(strict or not), the ``torch.func`` transforms (grad, vmap, jacrev) and forward-mode AD.

Across ranks none of them can keep what the layer does (a trace cannot hold the
all-reduce and would fix the Python-side values of the call as constants; the transforms
cannot run syncbn's autograd Functions), so each raises an error naming the layer and
the fix, on every rank alike, before any collective and before the momentum count moves;
after it the same model trains on, equal to one process on the concatenated batch. In
one process SyncBatchNorm is torch's batch norm, and traces and transforms as torch's
does. W = 2 on the session's gloo pool, float64, per-rank means 6 apart (a layer that
normalized each rank's batch alone would be far off the reference)."""

import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from syncbn.torch.functional import sync_batch_norm
from workers import group_of, in_group

WORLD, PER_RANK = 2, 3
TOL = dict(rtol=1e-10, atol=1e-10)  # float64 through a few layers: rounding ~1e-14; NaN fails


class FunctionalBN(nn.BatchNorm2d):
    """A batch norm whose forward is ``syncbn.torch.functional.sync_batch_norm`` on ``group``
    (not a layer syncbn converts: it is built as it is)."""

    group = None

    def forward(self, x):
        return sync_batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                               self.momentum, self.eps, self.group)


class Net(nn.Module):
    """conv-BN-ReLU, conv-BN(momentum=None)-LeakyReLU, a head; ``functional`` puts
    :class:`FunctionalBN` in place of the second batch norm."""

    def __init__(self, functional=False, group=None):
        super().__init__()
        torch.manual_seed(11)
        second = FunctionalBN(4) if functional else nn.BatchNorm2d(4, momentum=None)
        second.group = group
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1), second, nn.LeakyReLU(0.1),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.double()

    def forward(self, x):
        return self.head(self.body(x))


def skewed(rank):
    """Rank ``rank``'s batch and output gradient: means 6 apart, stds 1 and 2."""
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(PER_RANK, 3, 5, 5, generator=gen, dtype=torch.float64) * (1 + rank) + 6 * rank - 3
    return x, torch.randn(PER_RANK, 3, generator=gen, dtype=torch.float64)


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(form, group):
    """The converted model of ``form`` on ``group``, the layer the refusal names and the
    one-process reference model (same parameters, torch's layers)."""
    if form == "functional":  # the first batch norm frozen (it is torch's, normalizing each rank alone)
        model, reference = Net(functional=True, group=group), Net(functional=True)
        model.body[1].eval()
        reference.body[1].eval()
        return model, "sync_batch_norm", reference
    model, reference = syncbn.convert_sync_batchnorm(Net(), process_group=group), Net()
    if form == "SyncBatchNormAct":  # the first batch norm frozen, so that the fused one is reached first
        model = syncbn.fuse_batchnorm_act(model)
        assert isinstance(model.body[4], syncbn.SyncBatchNormAct)
        model.body[1].eval()
        reference.body[1].eval()
        return model, "SyncBatchNormAct 'body.4'", reference
    return model, "SyncBatchNorm 'body.1'", reference


def capture(how, model, x):
    if how == "trace":
        return torch.jit.trace(model, (x,))
    if how in ("export", "export-strict"):
        return torch.export.export(model, (x,), strict=how == "export-strict")
    if how == "grad":
        return torch.func.grad(lambda x: model(x).square().sum())(x)
    if how == "vmap":
        return torch.func.vmap(model)(x.unsqueeze(0).expand(2, *x.shape))
    if how == "jacrev":
        return torch.func.jacrev(model)(x)
    if how == "forward_ad":
        from torch.autograd import forward_ad

        with forward_ad.dual_level():
            return forward_ad.unpack_dual(model(forward_ad.make_dual(x, torch.ones_like(x)))).tangent
    raise AssertionError(how)


def refused_job(how, form):
    """Capture the training model (refused), then one eager training step."""
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model, _, _ = build(form, group)
    x, dy = skewed(dist.get_rank())
    before = state(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.trace's deprecation, the tracer's own
            capture(how, model, x)
        refused = f"{how}: not refused"
    except RuntimeError as exc:
        refused = str(exc)
    untouched = all(torch.equal(before[k], v) for k, v in state(model).items())
    x = x.requires_grad_()
    model(x).backward(dy)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for g in grads.values():  # the sum over ranks: one process's on the concatenated batch
        dist.all_reduce(g, group=group)
    return {"refused": refused, "untouched": untouched, "dx": x.grad, "grads": grads, "state": state(model)}


# torch 2.13 exports syncbn's autograd Function as its forward alone. The exported forward
# does synchronize (each layer its all-reduce, the second one nested in a
# wrap_with_set_grad_enabled subgraph, so a count of the top-level graph's nodes finds one)
# and matches eager, but its outputs carry no gradient through the layers: a backward pass
# through exported.module() raises, or, where the loss also reaches the input another way
# (a residual; strict export), runs with no backward all-reduce, wrong input gradients and
# no parameter gradients. So the export raises, naming the fix.
EXPORT_REFUSAL = "torch.export.export cannot capture this layer in training mode"
WHAT = {"trace": "torch.jit.trace cannot record this layer in training mode",
        "export": EXPORT_REFUSAL, "export-strict": EXPORT_REFUSAL,
        "grad": "torch.func transforms", "vmap": "torch.func transforms", "jacrev": "torch.func transforms",
        "forward_ad": "forward-mode AD"}
FIX = {"trace": "model.eval()", "export": "model.eval()", "export-strict": "model.eval()", "grad": "torch.autograd",
       "vmap": "torch.autograd", "jacrev": "torch.autograd", "forward_ad": "model.eval()"}
CASES = [("trace", "SyncBatchNorm"), ("trace", "SyncBatchNormAct"), ("trace", "functional"),
         ("export", "SyncBatchNorm"), ("export-strict", "SyncBatchNorm"), ("export", "SyncBatchNormAct"),
         ("export", "functional")] + [(how, form) for how in ("grad", "vmap", "jacrev")
                                      for form in ("SyncBatchNorm", "SyncBatchNormAct", "functional")] + [
             ("forward_ad", "SyncBatchNorm"), ("forward_ad", "SyncBatchNormAct"), ("forward_ad", "functional")]
# torch 2.4 (no torch.compiler.is_exporting): a training-mode batch norm exported in one
# process, torch's BatchNorm2d too, fails its backward pass (tried on 2.4.1, strict or not)
exported_bn_trains = pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"),
    reason="torch < 2.5: an exported training-mode batch norm, torch's BatchNorm2d too, fails its backward "
           "('modified by an inplace operation')")
# torch 2.4 has no torch.compiler.is_exporting: the layer sees non-strict export (through
# is_compiling, see syncbn.torch.distributed.exporting), not strict export's dynamo pass, which
# refuses the layer's eager call (torch.compiler.disable before torch 2.11) with its own error
STRICT_EXPORT_UNSEEN = not hasattr(torch.compiler, "is_exporting")


@pytest.mark.parametrize("how,form", CASES, ids=[f"{how}-{form}" for how, form in CASES])
def test_training_capture_across_ranks_names_the_fix_and_the_ranks_go_on(pool, how, form):
    results = pool.run(refused_job, how, form)[:WORLD]
    _, layer, model = build(form, None)
    parts = [skewed(rank) for rank in range(WORLD)]
    x = torch.cat([p[0] for p in parts]).requires_grad_()
    model(x).backward(torch.cat([p[1] for p in parts]))
    ref = state(model)
    for rank, got in enumerate(results):
        message = got["refused"]
        if how == "export-strict" and STRICT_EXPORT_UNSEEN:  # dynamo refuses the layer's eager call
            assert "torch._dynamo.disable()" in message and "_synchronized" in message, message
        else:  # strict export: dynamo's Unsupported error (a RuntimeError) carries our message inside
            where = message.find(f"{layer}: {WHAT[how]}")
            assert where == 0 or (how == "export-strict" and where > 0), message
            assert FIX[how] in message and "syncbn.revert_sync_batchnorm(model)" in message, message
        # alike on every rank (dynamo's error names the function with its address in the process)
        assert re.sub(" at 0x[0-9a-f]+", "", message) == re.sub(" at 0x[0-9a-f]+", "", results[0]["refused"])
        assert got["untouched"]  # nothing moved: not the running buffers, not num_batches_tracked
        torch.testing.assert_close(got["dx"], x.grad[rank * PER_RANK:(rank + 1) * PER_RANK], **TOL)
        for key, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][key], p.grad, **TOL, msg=key)
        assert got["state"].keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(got["state"][key], value, **TOL, msg=key)


# ---- one process: SyncBatchNorm is torch's batch norm, under a trace and torch.func alike ----


def one_batch():
    x, dy = skewed(1)
    return x, dy.view(PER_RANK, 3, 1, 1).expand(PER_RANK, 3, 5, 5).contiguous()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("fused", [False, True], ids=["SyncBatchNorm", "SyncBatchNormAct"])
def test_one_process_training_trace_is_torchs(fused, momentum):
    """Traced in training and called three times, the layer gives torch's traced
    BatchNorm2d (+ LeakyReLU, traced with it) outputs, gradients and buffers, bit for bit:
    exact with a float momentum; with momentum=None both traces keep the first call's
    factor (torch's tracer warns), alike. (From the second call TorchScript's executor
    differentiates the traced BatchNorm2d + LeakyReLU graph itself: its input gradients
    differ from eager's by ~1e-9 in float64, so the activation is traced with the batch
    norm rather than applied after the trace.)"""
    def make(ours):
        torch.manual_seed(3)
        if ours:
            layer = syncbn.SyncBatchNormAct(3, "leaky_relu", 0.1, momentum=momentum) if fused else \
                syncbn.SyncBatchNorm(3, momentum=momentum)
        else:
            layer = nn.BatchNorm2d(3, momentum=momentum)
        layer = layer.double()
        with torch.no_grad():
            layer.weight.uniform_(0.5, 2)
            layer.bias.uniform_(-1, 1)
        if fused and not ours:
            return nn.Sequential(layer, nn.LeakyReLU(0.1))
        return layer

    results = []
    for ours in (True, False):
        layer = make(ours)
        x, dy = one_batch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(layer, (x,), check_trace=False)
        steps = []
        norm = layer[0] if isinstance(layer, nn.Sequential) else layer
        for step in range(3):
            x = (x.detach() * 1.5 - step).requires_grad_()
            y = traced(x)
            layer.zero_grad()
            y.backward(dy)
            steps.append([y, x.grad, norm.weight.grad, norm.bias.grad, *state(norm).values()])
        results.append(steps)
    for step, (got, want) in enumerate(zip(*results)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.isfinite(a.double()).all()
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"call {step + 1}, value {i}")



_ACTIVATIONS = {"leaky_relu": lambda: nn.LeakyReLU(0.1), "elu": lambda: nn.ELU(0.1), "identity": nn.Identity}


@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_process_training_trace_of_the_fused_layer_is_batchnorm_and_activation(activation, dtype):
    """Traced in training in one process, SyncBatchNormAct records BatchNorm + the
    activation (torch's ops), as SyncBatchNorm records torch's batch norm: called on
    another batch size, and after a channel's weight became 0, the trace gives what the
    traced BatchNorm2d + activation give, bit for bit (the same ops). It recorded its own
    path with the tracing call's choices as constants: the general path (ELU, float16)
    failed in the TorchScript interpreter on another batch size, and the local kernels'
    path gave NaN input gradients once a weight was 0 (a channel it had not chosen to keep)."""
    results = []
    for ours in (True, False):
        torch.manual_seed(5)
        if ours:
            layer = syncbn.SyncBatchNormAct(3, activation, 0.1).to(dtype)
        else:
            layer = nn.Sequential(nn.BatchNorm2d(3), _ACTIVATIONS[activation]()).to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.trace's deprecation
            traced = torch.jit.trace(layer, (torch.randn(4, 3, 5, 5).to(dtype),), check_trace=False)
        norm = layer if ours else layer[0]
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([0.0, 1.5, -2.0]))
            norm.bias.copy_(torch.tensor([1.0, 0.5, -0.5]))
        steps = []
        for step in range(3):  # TorchScript's executor optimizes the graph from the second call
            x = (torch.randn(6 + step, 3, 5, 5) * 3 + 1).to(dtype).requires_grad_()
            y = traced(x)
            layer.zero_grad()
            y.backward(torch.randn(y.shape).to(dtype))
            steps.append([y, x.grad, norm.weight.grad, norm.bias.grad, *state(norm).values()])
        results.append(steps)
    for step, (got, want) in enumerate(zip(*results)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.isfinite(a).all(), (step, i)
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"call {step + 1}, value {i}")


def transformed(layer, how, x):
    if how == "grad":
        return torch.func.grad(lambda x: (layer(x).square() * x).sum())(x)
    if how == "vmap":
        return torch.func.vmap(layer)(torch.stack([x, x * 2 - 1]))
    return torch.func.jacrev(layer)(x[:2])


@pytest.mark.parametrize("how", ["grad", "vmap", "jacrev"])
def test_one_process_torch_func_is_torchs(how):
    """Without a group SyncBatchNorm runs torch's batch norm, so torch.func takes it as it
    takes BatchNorm2d: with track_running_stats=False (torch.func's batch-norm recipe) the
    same values bit for bit, with running statistics the same error. SyncBatchNormAct runs
    its own Function in training, whatever the world size: refused, naming the fix."""
    x, _ = one_batch()
    ours, theirs = syncbn.SyncBatchNorm(3).double(), nn.BatchNorm2d(3).double()
    with torch.no_grad():
        for layer in (ours, theirs):
            layer.weight.copy_(torch.tensor([0.5, 1.5, 2.0]))
            layer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    errors = []
    for layer in (ours, theirs):
        try:
            transformed(layer, how, x)
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    assert errors[0] == errors[1] and errors[0] is not None  # torch's: running buffers under a transform
    for layer in (ours, theirs):
        torch.func.replace_all_batch_norm_modules_(layer)
    got, want = transformed(ours, how, x), transformed(theirs, how, x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # SyncBatchNormAct's own Function cannot run under a transform: in one process it then
    # takes BatchNorm2d + LeakyReLU's ops, which torch.func takes as it takes them
    act, plain = syncbn.SyncBatchNormAct(3, "leaky_relu", 0.1).double(), nn.BatchNorm2d(3).double()
    act.load_state_dict(plain.state_dict())
    for layer in (act, plain):
        torch.func.replace_all_batch_norm_modules_(layer)
    got = transformed(act, how, x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, transformed(nn.Sequential(plain, nn.LeakyReLU(0.1)), how, x), rtol=0, atol=0)


@exported_bn_trains
def test_one_process_training_export_is_torchs():
    """Without a group SyncBatchNorm is F.batch_norm, which exports with its backward (the
    same forward and gradients as torch's layer); SyncBatchNormAct, whose own autograd
    Function an export would keep as its forward alone, takes BatchNorm2d + LeakyReLU's
    ops under an export, backward included. (SyncBatchNormAct raised.)"""
    x, _ = skewed(1)
    for fused in (False, True):
        ours = syncbn.SyncBatchNormAct(3, "leaky_relu", 0.1).double() if fused else syncbn.SyncBatchNorm(3).double()
        theirs = nn.BatchNorm2d(3).double()
        with torch.no_grad():
            theirs.weight.copy_(torch.tensor([0.5, -1.5, 2.0]))
            theirs.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        ours.load_state_dict(theirs.state_dict())
        exported = torch.export.export(ours, (x,)).module()
        results = []
        for layer in (exported, nn.Sequential(theirs, nn.LeakyReLU(0.1)) if fused else theirs):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(torch.ones_like(x) + x)
            results.append([y, xi.grad, *(p.grad for p in layer.parameters())])
        assert len(results[0]) == len(results[1]) == 4
        for got, want in zip(*results):
            assert got is not None and torch.isfinite(got).all()
            torch.testing.assert_close(got, want, **TOL)
