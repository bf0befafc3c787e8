"""PreciseBN: replace the running statistics of every BatchNorm layer by the true
population statistics of its inputs, pooled over many batches and all ranks.

The running buffers a BatchNorm layer keeps during training are an exponential moving
average of per-batch statistics, taken while the weights kept moving; with small
batches, or after the last learning-rate drop, they can be far from the statistics the
layer actually sees at the end of training ("Rethinking 'Batch' in BatchNorm", Wu and
Johnson, 2021, section 3). :func:`precise_bn` recomputes them, with the weights frozen:

    mean_c = sum of x over every element of channel c, every batch, every rank / N_c
    var_c  = sum of (x - mean_c)^2 over the same elements / (N_c - 1)

with exact element counts N_c (uneven batches, and ranks with different batch sizes,
weigh each element alike). The variance is written unbiased, as ``torch.nn`` batch norm
writes ``running_var`` (its running buffer holds the EMA of per-batch unbiased
variances, and eval mode divides by ``sqrt(running_var + eps)``); with N_c in the
thousands the difference from the biased value is below 1e-3 relative anyway.

How the layers run during the passes. The inputs of layer k depend on how the layers
before it normalize. As in the usual PreciseBN (and as in training), every layer being
recomputed runs in training mode, so it normalizes with the statistics of the current
batch (synchronized across its process group for syncbn layers), and its input is
recorded before it normalizes; its running buffers are not touched during the passes.
The statistics are therefore those of the activations the network produces in
training, which is what the running averages estimate too. (Normalizing the earlier
layers with their new population statistics instead would take one pass over the data
per layer.)

Per layer and batch, a forward pre-hook turns the input into the ``[n, n*m, M2 + n*m^2]``
float64 sums of :mod:`syncbn.torch.stats` (stable local moments), summed over batches on each
rank; one all-reduce at the end carries the sums of every layer at once.
"""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any, Callable, Iterable, List, Optional

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import distributed, stats

__all__ = ["precise_bn"]


def _default_forward(model: nn.Module, batch: Any):
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return model(batch[0])  # (inputs, targets, ...) as most data loaders yield
    raise TypeError(
        f"precise_bn: cannot feed a batch of type {type(batch).__name__} to the model; "
        "pass forward=lambda model, batch: model(...)"
    )


def _targets(model: nn.Module) -> List[tuple]:
    """The BN layers to recompute: every one with running buffers; with the model in
    training mode, only those in training mode (an eval-mode layer is a frozen one)."""
    layers = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.running_mean is not None and m.running_var is not None
    ]
    if model.training:
        layers = [(name, m) for name, m in layers if m.training]
    return layers


class _Recorder:
    """Float64 sums ``[n, sum x, sum x^2]`` (as stats.pack_moments) of each layer's inputs."""

    def __init__(self, layers):
        self.sums: List[Optional[torch.Tensor]] = [None] * len(layers)
        self.handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, (_, m) in enumerate(layers)]

    def _hook(self, index: int):
        def record(module, args, kwargs):
            # a batch norm's one input, given by position or as ``input=`` (torch's name)
            x = (args[0] if args else kwargs["input"]).detach()
            packed = stats.pack_moments(x, stats.accumulate_dtype(x.device))
            total = self.sums[index]
            self.sums[index] = packed if total is None else total.add_(packed.to(total.device))

        return record

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _agree_on_next(has_batch: bool, group, device) -> Optional[List[int]]:
    """Every rank learns which ranks hold a next batch (one small all-gather)."""
    flag = torch.tensor([1 if has_batch else 0], dtype=torch.int64, device=device)
    return [int(v) for v in distributed.all_gather(flag, group).flatten().tolist()]


def precise_bn(
    model: nn.Module,
    batches: Iterable,
    num_batches: int = 200,
    *,
    forward: Optional[Callable[[nn.Module, Any], Any]] = None,
    process_group=None,
    progress: bool = True,
) -> int:
    """Set the running mean and variance of the model's BatchNorm layers to the
    population statistics of their inputs over ``num_batches`` batches on every rank.

    Works for :class:`syncbn.SyncBatchNorm`, :class:`syncbn.SyncBatchNormAct` and the
    ``torch.nn`` batch norms alike (any ``_BatchNorm`` with running buffers), in one
    process or across the ranks of ``process_group`` (the default group when None),
    which all pool their statistics, so every rank ends with the same buffers.

    Which layers: all of them when the model is in eval mode; when the model is in
    training mode, those in training mode (a BN layer left in eval mode inside a training
    model is frozen: it keeps its buffers and normalizes with them during the passes).
    The layers recomputed run in training mode during the passes (see the module docs);
    other modules keep their mode, so call ``model.eval()`` first to run dropout and the
    like as at inference. Afterwards the weights are untouched and every module's
    ``training`` flag, each layer's ``momentum``, ``track_running_stats`` and
    ``num_batches_tracked`` are what they were. The passes run under ``torch.no_grad()``.
    Other modules run in their own mode, so in a training-mode model one that keeps state
    of its own moves it as in a training step (an ``InstanceNorm`` with
    ``track_running_stats``, spectral norm's power iteration), as in fvcore's PreciseBN; in
    an eval-mode model only the BatchNorm buffers change.

    Args:
        model: the model (not a ``torch.compile`` wrapper; a DDP wrapper is fine).
        batches: an iterable of batches, already on the model's device; it is read
            ``num_batches`` times at most.
        num_batches: how many batches each rank runs.
        forward: ``forward(model, batch)`` runs one batch; default ``model(batch)`` for a
            tensor and ``model(batch[0])`` for a tuple or list.
        process_group: the ranks to pool over; all of them must call this together.
        progress: show a tqdm progress bar on global rank 0 (when tqdm is installed).

    Returns the number of batches used. Every rank runs the same number of batches:
    before each batch the ranks tell each other whether they have one. If the batches
    run out on some ranks but not on others, every rank raises the same ``ValueError``
    (and the buffers are left as they were); if they run out on all ranks together
    before ``num_batches``, the batches seen are used, with a warning.
    """
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f"precise_bn: num_batches must be a positive int, got {num_batches!r}")
    forward = forward or _default_forward
    layers = _targets(model)
    if not layers:
        warnings.warn("precise_bn: the model has no BatchNorm layer with running statistics to recompute")
        return 0
    device = layers[0][1].running_mean.device
    world = distributed.group_size(process_group)

    modes = {m: m.training for m in model.modules()}
    saved = [
        (
            m.momentum,
            m.track_running_stats,
            m.running_mean.clone(),
            m.running_var.clone(),
            None if m.num_batches_tracked is None else m.num_batches_tracked.clone(),
        )
        for _, m in layers
    ]
    recorder = _Recorder(layers)
    bar = None
    if progress and distributed.group_rank() == 0:
        try:
            from tqdm.auto import tqdm

            total = num_batches
            if hasattr(batches, "__len__"):  # a list or a DataLoader: show what will really run
                total = min(total, len(batches))
            bar = tqdm(total=total, desc="precise_bn", unit="batch")
        except ImportError:
            pass
    done = 0
    finished = False
    try:
        for _, m in layers:
            m.train()
            m.track_running_stats = False  # normalize with batch statistics, keep the buffers
        # train() also switched the modules a layer holds (timm's drop and act): they keep
        # their own mode, as every other module does (a dropout stays off in an eval model)
        targets = {m for _, m in layers}
        for _, m in layers:
            for inner in m.modules():
                if inner not in targets:
                    inner.training = modes[inner]
        iterator = iter(batches)
        with torch.no_grad():
            while done < num_batches:
                try:
                    batch = next(iterator)
                    has_batch = True
                except StopIteration:
                    batch, has_batch = None, False
                if world > 1:
                    flags = _agree_on_next(has_batch, process_group, device)
                    if 0 < sum(flags) < world:
                        empty = [r for r, f in enumerate(flags) if not f]
                        full = [r for r, f in enumerate(flags) if f]
                        raise ValueError(
                            f"precise_bn: the batches ran out on rank(s) {empty} after {done} "
                            f"batch(es) while rank(s) {full} have more; every rank must provide "
                            f"the same number of batches (num_batches={num_batches})"
                        )
                    has_batch = bool(flags[0])
                if not has_batch:
                    break
                forward(model, batch)
                done += 1
                if bar is not None:
                    bar.update(1)
        if done == 0:
            raise ValueError("precise_bn: the batches iterable is empty")
        if done < num_batches:
            warnings.warn(
                f"precise_bn: the batches ran out after {done} of num_batches={num_batches}; "
                f"the statistics are those of {done} batch(es)"
            )
        _write_population_stats(layers, recorder.sums, saved, process_group, device, world)
        finished = True
    finally:
        recorder.remove()
        if bar is not None:
            bar.close()
        for (_, m), (momentum, track, mean, var, count) in zip(layers, saved):
            m.momentum = momentum
            m.track_running_stats = track
            if count is not None:
                m.num_batches_tracked.copy_(count)
            if not finished:  # leave the buffers as they were
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
        for m, mode in modes.items():
            m.training = mode
    return done


@torch.no_grad()
def _write_population_stats(layers, sums, saved, group, device, world) -> None:
    """Pool the sums of every layer over the ranks (one all-reduce) and write the buffers."""
    dtype = stats.accumulate_dtype(device)
    packs = [
        torch.zeros(2 * m.running_mean.numel() + 1, dtype=dtype, device=device) if s is None else s.to(device)
        for (_, m), s in zip(layers, sums)
    ]
    flat = torch.cat(packs)
    if world > 1:
        flat = distributed.all_reduce_sum(flat, group)
    offsets = [0]
    for pack in packs:
        offsets.append(offsets[-1] + pack.numel())
    counts = flat[offsets[:-1]].tolist()  # the element count of each layer: one host read
    skipped = []
    for i, ((name, m), (_, _, mean0, var0, _)) in enumerate(zip(layers, saved)):
        packed = flat[offsets[i] : offsets[i + 1]]
        if counts[i] <= 1:  # never reached (or one value per channel): nothing to estimate
            skipped.append(name or type(m).__name__)
            m.running_mean.copy_(mean0)
            m.running_var.copy_(var0)
            continue
        # the channels of its buffers: a lazy layer loaded from a state_dict keeps num_features 0
        total, mean, var = stats.merge_moments(packed, m.running_mean.numel())
        m.running_mean.copy_(mean.to(m.running_mean.dtype))
        m.running_var.copy_((var * (total / (total - 1))).to(m.running_var.dtype))
    if skipped:
        warnings.warn(
            "precise_bn: these BatchNorm layers saw at most one value per channel in all "
            f"the batches and keep their running statistics: {', '.join(skipped)}"
        )


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`precise_bn`.

    The function and its module share the name ``precise_bn``, and importing the module
    ``syncbn.precise_bn`` makes the package attribute ``syncbn.precise_bn`` the module,
    whatever was there before. Making the module callable means ``syncbn.precise_bn(...)``
    runs the function however the name was reached.
    """

    def __call__(self, *args, **kwargs):
        return precise_bn(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
