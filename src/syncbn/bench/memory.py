"""Memory: bytes saved for backward per BN + activation block, and the peak resident
memory of one training step of the demo network.

Both run in the torch peer's worker processes, on the ranks of a process group of two
(so syncbn's synchronized path is the one measured), with an allocator that returns
every large block to the system when it is freed (see ``torch_peer``):

- saved bytes: the tensors autograd keeps between forward and backward
  (:func:`syncbn.tools.memory.saved_bytes`: each storage once, whole; the block's own
  parameters and buffers left out), for a block
  BN -> LeakyReLU(0.01) on an input of (batch, C, size, size), float32: plain torch,
  syncbn, and the fused ``syncbn.SyncBatchNormAct`` (which needs an invertible
  activation, hence LeakyReLU rather than ReLU);
- peak memory: the rise of the resident set (``VmHWM`` after the step minus ``VmRSS``
  before it, the high-water mark reset through ``/proc/self/clear_refs``) over one
  forward, loss, backward and SGD step, started with no gradients allocated, of :class:`syncbn.demo.torch_models.TinyUNet` with
  LeakyReLU activations, after a warm-up step, on rank 0; the variants are measured in
  turn, twice, and the second round is reported. Linux only; elsewhere the figure is
  reported as not available. Beside it, the peak of the bytes allocated during a step
  (:func:`syncbn.tools.memory.peak_memory`, from the profiler's allocation events), which
  does not depend on the allocator. Both in the standard layout (NCHW) and in
  channels-last (model and input converted), since the convolutions' own scratch
  memory, which no BN layer can touch, differs between the two.

Beside the three networks, a lower bound for any layer that keeps only its output: the
fused network with every ``SyncBatchNormAct`` replaced by a stand-in that computes the
same forward output, keeps exactly that output for backward and allocates nothing in
backward but the input gradient (a copy of the incoming one: the values are not real
gradients, only the memory is). The gap between the fused network and this bound is
what the fused layer itself costs at the peak; the rest belongs to the network (the
concatenations, the loss, the convolutions' inputs and scratch).

The fused rows are measured when ``syncbn.SyncBatchNormAct`` and
``syncbn.fuse_batchnorm_act`` can be imported, and reported as not available with the
reason otherwise.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["block_rows", "peak_step_rows"]


LEAKY_SLOPE = 0.01  # the fused layer takes invertible activations: LeakyReLU(0.01) here


def block_rows(spec: dict, group=None) -> list:
    """Saved bytes per BN + LeakyReLU block, plain, synchronized and fused; run on every
    rank of ``group`` (the layers communicate)."""
    import torch
    import torch.nn as nn

    from ..torch.batchnorm import SyncBatchNorm
    from ..tools.memory import saved_bytes

    c, n, s = spec["channels"], spec["batch"], spec["size"]
    input_bytes = n * c * s * s * 4
    leaky = lambda inplace=False: nn.LeakyReLU(LEAKY_SLOPE, inplace=inplace)  # noqa: E731
    blocks = {
        "torch.nn.BatchNorm2d + LeakyReLU": lambda: nn.Sequential(nn.BatchNorm2d(c), leaky()),
        "torch.nn.BatchNorm2d + LeakyReLU(inplace=True)": lambda: nn.Sequential(nn.BatchNorm2d(c), leaky(True)),
        "syncbn.SyncBatchNorm + LeakyReLU": lambda: nn.Sequential(SyncBatchNorm(c, process_group=group), leaky()),
        "syncbn.SyncBatchNormAct(leaky_relu), fused": None,
    }
    try:
        from ..torch.batchnorm_act import SyncBatchNormAct

        blocks["syncbn.SyncBatchNormAct(leaky_relu), fused"] = lambda: SyncBatchNormAct(
            c, "leaky_relu", LEAKY_SLOPE, process_group=group)
        reason = None
    except ImportError as exc:
        reason = f"syncbn.SyncBatchNormAct is not available: {exc}"
    rows = []
    for name, build in blocks.items():
        if build is None:
            rows.append({"block": name, "available": False, "reason": reason, "input_bytes": input_bytes})
            continue
        block = build()
        x = (torch.randn(n, c, s, s) + 1).requires_grad_()
        nbytes = saved_bytes(lambda: block(x), ignore=[block])  # activations only, not weights or buffers
        rows.append({"block": name, "saved_bytes": nbytes, "input_bytes": input_bytes, "available": True,
                     "ratio_to_input": nbytes / input_bytes})
    return rows


# --------------------------------------------------------------------------- peak RSS


def _status_kib() -> Optional[dict]:
    try:
        with open("/proc/self/status") as fh:
            values = {}
            for line in fh:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    key, value = line.split(":")
                    values[key] = int(value.split()[0])
            return values if len(values) == 2 else None
    except OSError:
        return None


def _reset_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


OUTPUT_ONLY = "lower bound: blocks that keep only their output (stand-in, no real gradients)"

_STAND_IN = []  # [the stand-in's autograd Function], built at first use (torch imported lazily)


def _stand_in_function():
    if not _STAND_IN:
        import torch
        import torch.nn.functional as F

        class KeepOutputOnly(torch.autograd.Function):
            """BN (batch statistics) + leaky_relu forward, written over its input; saves
            only the output; backward allocates one tensor, the input gradient, and
            nothing else."""

            @staticmethod
            def forward(ctx, x, weight, bias, slope):
                # in place over the input, as the fused layer runs after a convolution
                # (the stand-in only ever replaces a fused layer, which sits right after one)
                empty = x.new_empty(0)
                torch.ops.aten.native_batch_norm.out(x, weight, bias, None, None, True, 0.0, 1e-5,
                                                     out=x, save_mean=empty, save_invstd=empty.clone())
                F.leaky_relu_(x, slope)
                ctx.mark_dirty(x)
                ctx.save_for_backward(x)
                return x

            @staticmethod
            def backward(ctx, dy):
                ctx.saved_tensors  # noqa: B018 (unpacked as a real backward would)
                return dy.clone(), None, None, None

        _STAND_IN.append(KeepOutputOnly)
    return _STAND_IN[0]


def _output_only(model):
    """``model`` with every ``SyncBatchNormAct`` replaced by the output-only stand-in."""
    import torch.nn as nn

    function = _stand_in_function()

    class OutputOnly(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.weight, self.bias, self.slope = block.weight, block.bias, block.activation_param

        def forward(self, x):
            return function.apply(x, self.weight, self.bias, self.slope)

    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__ == "SyncBatchNormAct":
                setattr(parent, name, OutputOnly(child))
    return model


def _demo_models(spec: dict, group):
    """name -> (builder or None, reason when not available). The demo network with its
    activations made LeakyReLU(0.01) (the fused layer needs an invertible one)."""
    import torch.nn as nn

    from ..torch.conversion import convert_sync_batchnorm
    from ..demo.torch_models import build_segmentation_model

    def plain():
        model = build_segmentation_model(0, width=spec.get("model_width", 16), activation="relu")
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, nn.ReLU):
                    setattr(parent, name, nn.LeakyReLU(LEAKY_SLOPE, inplace=True))
        return model

    def converted():
        return convert_sync_batchnorm(plain(), process_group=group)

    models = {"torch.nn.BatchNorm2d + LeakyReLU (as built)": (plain, None),
              "syncbn.SyncBatchNorm + LeakyReLU (convert_sync_batchnorm)": (converted, None)}
    name = "syncbn.SyncBatchNormAct, fused (+ fuse_batchnorm_act)"
    try:
        from ..torch.conversion import fuse_batchnorm_act

        def fused():
            return fuse_batchnorm_act(converted(), process_group=group)

        models[name] = (fused, None)
        models[OUTPUT_ONLY] = (lambda: _output_only(fused()), None)
    except ImportError as exc:
        models[name] = (None, f"syncbn.fuse_batchnorm_act is not available: {exc}")
        models[OUTPUT_ONLY] = (None, models[name][1])
    return models


LAYOUTS = ("contiguous", "channels_last")


def _count_fused(model) -> int:
    """BN + activation pairs replaced (by the fused layer, or by the stand-in)."""
    return sum(type(m).__name__ in ("SyncBatchNormAct", "OutputOnly") for m in model.modules())


def peak_step_rows(spec: dict, group=None) -> Optional[list]:
    """Peak memory of a demo-network training step, per layout and variant; run on every
    rank of ``group``, rows returned on rank 0."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..tools.memory import peak_memory

    rank = dist.get_rank(group) if dist.is_initialized() else 0
    n, s = spec["model_batch"], spec["model_size"]
    rows = {}
    for round_ in range(spec.get("rounds", 2)):  # the variants in turn, twice: the last round is reported
        for layout in spec.get("layouts", LAYOUTS):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            for name, (build, reason) in _demo_models(spec, group).items():
                key = (layout, name)
                if build is None:
                    rows[key] = {"model": name, "layout": layout, "available": False, "reason": reason}
                    continue
                try:
                    model = build().to(memory_format=fmt)
                except Exception as exc:
                    rows[key] = {"model": name, "layout": layout, "available": False,
                                 "reason": f"could not build: {exc!r}"}
                    continue
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                gen = torch.Generator().manual_seed(rank)
                x = torch.randn(n, 1, s, s, generator=gen).contiguous(memory_format=fmt)
                target = torch.randint(0, 11, (n, s, s), generator=gen)

                def step():
                    loss = F.cross_entropy(model(x), target)
                    loss.backward()
                    opt.step()

                step()  # warm-up: optimizer state, allocator, autograd caches
                # the step starts from parameters and optimizer state alone (no gradients)
                opt.zero_grad(set_to_none=True)
                if _status_kib() is None or not _reset_high_water():
                    rows[key] = {"model": name, "layout": layout, "available": False,
                                 "reason": "needs Linux /proc/self/status and clear_refs"}
                    continue
                before = _status_kib()
                step()
                after = _status_kib()
                rise = (after["VmHWM"] - before["VmRSS"]) * 1024
                opt.zero_grad(set_to_none=True)
                allocated = peak_memory(step)  # a third step, under the profiler's allocation events
                previous = rows.get(key, {}).get("rounds", [])
                rows[key] = {"model": name, "layout": layout, "available": True, "batch": n, "size": s,
                             "peak_rise_bytes": rise, "peak_rss_bytes": after["VmHWM"] * 1024,
                             "rounds": previous + [rise], "peak_allocated_bytes": allocated,
                             "fused_layers": _count_fused(model)}
                del model, opt, step
    return list(rows.values()) if rank == 0 else None
