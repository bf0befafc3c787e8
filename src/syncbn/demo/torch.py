"""``syncbn demo --framework torch`` (the default): small-batch segmentation trained
three ways, to show that synchronized BatchNorm across W ranks of b images each *is*
one batch of W x b.

The three runs start from the same weights (one seed) and see the same global
batches in the same order:

1. ``per_rank_bn``: the plain model under DistributedDataParallel. Every BatchNorm
   normalizes with the statistics of its own rank's b images (what users get today).
2. ``syncbn``: the same, after one call to :func:`syncbn.convert_sync_batchnorm`.
3. ``big_batch``: one process, no DDP, fed the concatenation of the W ranks'
   batches in rank order (the reference one would like to afford).

Why runs 2 and 3 should agree to float32 rounding: rank r's loss is the mean over
its b images of each image's mean pixel cross-entropy, DDP averages the W ranks'
gradients, so the objective is the mean over all W x b images, exactly the big batch's
loss (each image is weighted alike whatever its pixel count, which is why the loss is
a per-image mean). Synchronized BatchNorm makes the forward and the backward of every
BN layer those of the concatenated batch, and plain SGD with momentum (no weight
decay, no adaptive denominators) adds nothing that would amplify rounding. Only the
summation order differs.

By default W worker processes are spawned on this machine (gloo on 127.0.0.1, CPU).
Under ``torchrun`` the given processes are used instead and nothing is spawned, so
the same code runs on several GPUs (``--backend nccl --device cuda``, one rank per
GPU, ``cuda:LOCAL_RANK``) and several machines. The reference run is computed by
rank 0 alone after the two DDP runs (it regenerates the global batches from the seed,
so this works across machines too); the other ranks are done by then and exit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import report as report_
from .config import DemoConfig
from .report import RunRecord
from .digits import NUM_CLASSES, make_split
from .. import torch as sbn  # before any process group: see _run_torchrun
from ..tools.launch import WorkerPool, launched_by_torchrun
from .torch_models import build_segmentation_model, count_batchnorm

__all__ = ["run", "run_title", "train_on_rank", "per_image_loss"]


def run_title(name: str, global_batch: int) -> str:
    """How the tables, plots and progress bars call each run."""
    return {
        "per_rank_bn": "per-rank BN under DDP",
        "syncbn": "syncbn under DDP",
        "big_batch": f"one process, batch {global_batch}",
    }[name]


def _check(config: DemoConfig) -> None:
    """What this machine must have for the settings (exit status 1 when it lacks it; the
    settings themselves were checked by :func:`syncbn.demo.config.check`)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("syncbn demo: --device cuda given but torch sees no CUDA device")


def run(config: DemoConfig, args: argparse.Namespace) -> int:
    """Spawn workers (or join torchrun's), train, report."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world and int(os.environ["RANK"]) == 0:
            print(f"syncbn demo: --world-size {args.world_size} ignored, torchrun started "
                  f"{report_.counted(world, 'rank')}",
                  file=sys.stderr)
        config.world_size = world
        _check(config)
        return _run_torchrun(config)
    _check(config)
    if config.backend == "nccl" and config.world_size > torch.cuda.device_count():
        raise SystemExit(
            f"syncbn demo: {config.world_size} nccl ranks need as many GPUs, torch sees "
            f"{torch.cuda.device_count()} (gloo can share GPUs between ranks)"
        )
    return _run_spawned(config)


def _run_spawned(config: DemoConfig) -> int:
    start = time.perf_counter()
    workers = report_.counted(config.world_size, "worker process", "worker processes")
    print(f"syncbn demo: starting {workers} ({config.backend}, {config.device})", flush=True)
    with WorkerPool(config.world_size, backend=config.backend, timeout=_COLLECTIVE_TIMEOUT_S) as pool:
        results = pool.run(train_on_rank, config, "spawned", timeout=_job_timeout(config))
    report = results[0]
    report["elapsed_s"] = time.perf_counter() - start
    report_.write_report(report, config.out)
    return 0


def _run_torchrun(config: DemoConfig) -> int:
    start = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(config.backend, timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    try:
        ctx, data, records = _distributed_runs(config, "torchrun")
        # Every rank leaves the group at the same point; rank 0 then computes the reference
        # alone. destroy_process_group frees the group here, since nothing holds it any
        # more (the DDP models are gone, and syncbn.torch, imported with this module,
        # imported torch.distributed.nn before the group existed): gloo's threads end now,
        # not in interpreter shutdown, where on torch 2.13 they can abort a rank ("terminate
        # called without an active exception", seen in CI; docs/torch.md, "Ending a job").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report = _reference_and_summary(config, "torchrun", ctx, data, records) if ctx.main else None
    if report is not None:
        report["elapsed_s"] = time.perf_counter() - start
        report_.write_report(report, config.out)
    return 0


# A collective that waits this long means a rank is gone or stuck: fail instead of hanging.
_COLLECTIVE_TIMEOUT_S = 300


def _job_timeout(config: DemoConfig) -> float:
    """Generous wall-clock limit for the whole training job on the spawned workers."""
    pixels = config.global_batch * config.image_size**2 * (config.width / 16) ** 2
    return 600 + 3 * config.steps * (1 + pixels / 8192)


# ------------------------------------------------------------------ training, every rank


@dataclass
class _Context:
    rank: int
    world: int
    device: torch.device
    main: bool
    progress: bool


@dataclass
class _Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    batches: torch.Tensor  # (steps, global batch) indices into the training set


def per_image_loss(logits: torch.Tensor, masks: torch.Tensor, class_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean pixel cross-entropy of each image (pixels of class c weighted by
    ``class_weight[c]``), shape (N,). The training loss is the mean of this over the
    local batch, so DDP's gradient average over ranks equals the gradient of the mean
    over the concatenated batch exactly, whatever the pixel counts of each class."""
    pixels = F.cross_entropy(logits, masks, weight=class_weight, reduction="none")
    return pixels.flatten(1).mean(1)


@torch.no_grad()
def confusion_matrix(model: nn.Module, images: torch.Tensor, masks: torch.Tensor, batch: int = 128) -> np.ndarray:
    """(11, 11) pixel counts, rows the true class, columns the predicted one (eval mode)."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.int64, device=images.device)
    for start in range(0, len(images), batch):
        pred = model(images[start : start + batch]).argmax(1)
        pairs = masks[start : start + batch] * NUM_CLASSES + pred
        counts += torch.bincount(pairs.flatten(), minlength=NUM_CLASSES * NUM_CLASSES)
    model.train(was_training)
    return counts.view(NUM_CLASSES, NUM_CLASSES).cpu().numpy()


def _rank_device(config: DemoConfig, rank: int, launcher: str) -> torch.device:
    """cpu, or this rank's GPU: cuda:LOCAL_RANK under torchrun; when spawned, cuda:rank
    (cuda:rank % GPUs with gloo, which lets ranks share a GPU; nccl cannot)."""
    if config.device != "cuda":
        return torch.device("cpu")
    if launcher == "torchrun":
        index = int(os.environ.get("LOCAL_RANK", 0))
    else:
        index = rank % torch.cuda.device_count()
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"rank {rank} wants cuda:{index}, torch sees {torch.cuda.device_count()} GPU(s)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _load_data(config: DemoConfig, device: torch.device) -> _Data:
    common = dict(seed=config.seed, size=config.image_size)
    train = make_split("train", config.train_size, **common)
    val = make_split("val", config.val_size, **common)
    batches = report_.global_batches(config.train_size, config.steps, config.global_batch, config.seed)
    return _Data(
        torch.from_numpy(train.images).to(device),
        torch.from_numpy(train.masks).to(device),
        torch.from_numpy(val.images).to(device),
        torch.from_numpy(val.masks).to(device),
        torch.from_numpy(batches).to(device),
    )


def _new_model(config: DemoConfig, device: torch.device) -> nn.Module:
    return build_segmentation_model(config.seed, width=config.width).to(device)


def _params(model: nn.Module) -> Dict[str, np.ndarray]:
    return {k: v.detach().to("cpu", copy=True).numpy() for k, v in model.named_parameters()}


def _train(run_name: str, position: int, model: nn.Module, config: DemoConfig, data: _Data, ctx: _Context):
    """Train ``model`` for ``config.steps`` steps; returns rank 0's :class:`~syncbn.demo.report.RunRecord`.

    A DDP model trains on this rank's slice of each global batch (slice r of W, in rank
    order), a plain one on the whole global batch.
    """
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    net = model.module if ddp else model
    b = config.batch_per_rank
    rows = slice(ctx.rank * b, (ctx.rank + 1) * b) if ddp else slice(None)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    class_weight = torch.ones(NUM_CLASSES, device=ctx.device)
    class_weight[0] = config.background_weight
    eval_steps = set(config.eval_steps())
    record = RunRecord(run_title(run_name, config.global_batch))
    bar = report_.progress_bar(config.steps, position, record.title, ctx.progress) if ctx.main else None
    model.train()

    def evaluate(step: int) -> None:
        record.miou[step] = float(np.nanmean(report_.class_iou(confusion_matrix(net, data.val_x, data.val_y))))
        record.snapshots[step] = _params(net)

    start = time.perf_counter()
    if ctx.main and 0 in eval_steps:
        evaluate(0)
    for step in range(1, config.steps + 1):
        index = data.batches[step - 1, rows]
        loss = per_image_loss(model(data.train_x[index]), data.train_y[index], class_weight).mean()
        for group in optimizer.param_groups:
            group["lr"] = report_.learning_rate(config.lr, config.steps, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        shown = loss.detach().clone()
        if ddp:  # the global batch's loss: the mean of the ranks' losses
            dist.all_reduce(shown)
            shown /= ctx.world
        if ctx.main:
            record.losses.append(shown.item())
            if step in eval_steps:
                evaluate(step)
            bar.set_postfix_str(report_.bar_text(record), refresh=False)
            bar.update(1)
    if not ctx.main:
        return None
    record.seconds = time.perf_counter() - start
    bar.close()
    confusion = confusion_matrix(net, data.val_x, data.val_y)
    record.class_iou = [float(v) for v in report_.class_iou(confusion)]
    record.buffers = {k: v.detach().to("cpu", copy=True).numpy() for k, v in net.named_buffers() if "running" in k}
    with torch.no_grad():
        net.eval()
        record.predictions = net(data.val_x[: config.samples]).argmax(1).cpu().numpy().astype(np.uint8)
        net.train()
    if not ctx.progress:
        print(report_.run_done_line(position, record, config.steps), flush=True)
    return record


def train_on_rank(config: DemoConfig, launcher: str) -> Optional[dict]:
    """The whole demo as seen by one rank of the default process group.

    Runs 1 and 2 (DDP) on every rank, then run 3 on rank 0 alone. Returns the report
    (a plain dict, see :func:`syncbn.demo.report.write_report`) on rank 0 and None elsewhere.
    """
    ctx, data, records = _distributed_runs(config, launcher)
    if not ctx.main:
        return None  # nothing more to do here: rank 0 computes the reference alone
    return _reference_and_summary(config, launcher, ctx, data, records)


def _distributed_runs(config: DemoConfig, launcher: str):
    """Runs 1 and 2 (DDP, every rank): returns this rank's context, data and records."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != config.world_size:
        raise RuntimeError(f"process group has {world} ranks, the config says {config.world_size}")
    device = _rank_device(config, rank, launcher)
    progress = sys.stderr.isatty() if config.progress is None else config.progress
    ctx = _Context(rank, world, device, rank == 0, progress and rank == 0)
    if ctx.main:
        print(f"syncbn demo: {report_.batch_words(config, 'rank')} "
              f"(global batch {config.global_batch}), {report_.counted(config.steps, 'step')}, "
              f"{config.image_size}x{config.image_size} canvases, {config.device}/{config.backend}, "
              f"{launcher}", flush=True)
    data = _load_data(config, device)
    device_ids = [device.index] if device.type == "cuda" else None

    records: Dict[str, RunRecord] = {}
    # 1. what users get today: each rank's BatchNorm sees its own b images
    model = nn.parallel.DistributedDataParallel(_new_model(config, device), device_ids=device_ids)
    records["per_rank_bn"] = _train("per_rank_bn", 1, model, config, data, ctx)
    # 2. the only change: the BatchNorm layers become synchronized
    model = nn.parallel.DistributedDataParallel(
        sbn.convert_sync_batchnorm(_new_model(config, device)), device_ids=device_ids
    )
    records["syncbn"] = _train("syncbn", 2, model, config, data, ctx)
    del model
    return ctx, data, records


def _reference_and_summary(config: DemoConfig, launcher: str, ctx: _Context, data: _Data,
                           records: Dict[str, RunRecord]) -> dict:
    """Run 3 on rank 0 alone (no process group needed) and the report of all three."""
    device = ctx.device
    # 3. the reference: one process, the W batches concatenated in rank order, no DDP
    solo = _Context(0, 1, device, True, ctx.progress)
    records["big_batch"] = _train("big_batch", 3, _new_model(config, device), config, data, solo)
    sample_x = data.val_x[: config.samples].cpu().numpy()
    sample_y = data.val_y[: config.samples].cpu().numpy()
    return _summarize(config, launcher, records, sample_x, sample_y)


def _summarize(config, launcher, records, sample_x, sample_y) -> dict:
    probe = build_segmentation_model(config.seed, width=config.width)
    setup = (f"{report_.batch_words(config, 'rank')} = global batch {config.global_batch}, "
             f"{report_.counted(config.steps, 'step')}, torch DDP {config.device}/{config.backend} ({launcher})")
    meta = {
        "framework": "torch",
        "torch_version": torch.__version__,
        "model": {
            "name": type(probe).__name__,
            "batchnorm_layers": count_batchnorm(probe),
            "parameters": sum(p.numel() for p in probe.parameters()),
        },
        "loss": "mean over the images of each image's mean pixel cross-entropy "
                f"(background pixels weighted {config.background_weight}, digit pixels 1)",
        "optimizer": f"SGD(lr={config.lr} cosine-decayed to 0 over {report_.counted(config.steps, 'step')}, "
                     f"momentum={config.momentum}, weight_decay=0)",
    }
    samples = {"images": sample_x, "truth": sample_y}
    return report_.summarize(config, setup, launcher, records, samples, meta)
