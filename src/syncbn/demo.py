"""``syncbn demo``: small-batch segmentation trained three ways, to show that
synchronized BatchNorm across W ranks of b images each *is* one batch of W x b.

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
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import __version__
from .digits import CLASS_NAMES, NUM_CLASSES, make_split
from .launch import WorkerPool, launched_by_torchrun
from .models import build_segmentation_model, count_batchnorm

__all__ = ["DemoConfig", "add_arguments", "run", "run_title", "train_on_rank", "write_report"]

HELP = "train a small segmentation net three ways (per-rank BN, syncbn, one big batch) and compare"

DESCRIPTION = """\
Small-batch semantic segmentation on digit canvases built from scikit-learn's bundled
digits (nothing is downloaded), trained three ways from the same initial weights and
the same global data order:

  1. per-rank BatchNorm under DDP   (each rank normalizes with its own batch)
  2. syncbn under DDP               (syncbn.convert_sync_batchnorm, one extra line)
  3. one process, one big batch     (the W ranks' batches concatenated in rank order)

Runs 2 and 3 should end with the same parameters up to float32 rounding; run 1 drifts
away. The command prints a table and writes results.json, curves.png (training loss,
validation mIoU and distance to the big batch over the steps) and samples.png
(validation images, true masks and each run's predicted masks) to --out.

By default it spawns --world-size local worker processes (gloo on 127.0.0.1, CPU).
Under torchrun it uses the processes torchrun started and spawns nothing:

  torchrun --standalone --nproc-per-node 2 -m syncbn demo --quick
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 -m syncbn demo --backend nccl --device cuda
"""

RUNS = ("per_rank_bn", "syncbn", "big_batch")


def run_title(name: str, global_batch: int) -> str:
    """How the tables, plots and progress bars call each run."""
    return {
        "per_rank_bn": "per-rank BN under DDP",
        "syncbn": "syncbn under DDP",
        "big_batch": f"one process, batch {global_batch}",
    }[name]


DIFF_BAR = 1e-3
DIFF_DEFINITION = (
    "max over parameter tensors p of ||p_run - p_big_batch||_2 / ||p_big_batch||_2 "
    "(computed in float64 from the float32 parameters)"
)
MIOU_DEFINITION = (
    "mean over the 11 classes (background and digits 0-9) of TP / (TP + FP + FN), counted "
    "over every pixel of the validation set; a class absent from both truth and prediction "
    "is left out of the mean"
)


@dataclass
class DemoConfig:
    """Everything that defines a demo run. Identical on every rank."""

    world_size: int = 4
    batch_per_rank: int = 2
    steps: int = 300
    lr: float = 0.05
    momentum: float = 0.9
    background_weight: float = 0.3
    image_size: int = 32
    width: int = 16
    train_size: int = 2000
    val_size: int = 160
    eval_every: int = 30
    samples: int = 4
    seed: int = 0
    backend: str = "gloo"
    device: str = "cpu"
    out: str = "syncbn-out/demo"
    progress: Optional[bool] = None  # None: only when stderr is a terminal
    quick: bool = False

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_per_rank

    def eval_steps(self) -> List[int]:
        """Steps (counted after the optimizer update) at which the runs are evaluated."""
        steps = set(range(0, self.steps + 1, self.eval_every)) | {self.steps}
        return sorted(steps)


# Settings --quick changes (an option given explicitly on the command line still wins).
QUICK = {"steps": 24, "train_size": 256, "val_size": 64, "eval_every": 8, "samples": 3}


# ----------------------------------------------------------------------------- CLI


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``syncbn demo`` options (every default is that of :class:`DemoConfig`)."""
    d = DemoConfig()
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--world-size", type=_positive, default=None, metavar="W",
        help=f"number of worker processes (ranks) to spawn on this machine (default {d.world_size}); "
             "ignored under torchrun, where WORLD_SIZE decides")
    add("--batch-per-rank", type=_positive, default=None, metavar="B",
        help=f"images per rank and step (default {d.batch_per_rank}); the big-batch run gets W x B")
    add("--steps", type=_positive, default=None,
        help=f"optimizer steps of each run (default {d.steps}; --quick: {QUICK['steps']})")
    add("--lr", type=float, default=None,
        help=f"peak SGD learning rate, cosine-decayed to 0 over the steps (default {d.lr}; "
             f"momentum {d.momentum}, no weight decay)")
    add("--background-weight", type=float, default=None, metavar="W",
        help=f"weight of background pixels in the cross-entropy, digits weigh 1 (default {d.background_weight})")
    add("--image-size", type=int, default=None, metavar="S",
        help=f"side of the square canvases in pixels, a multiple of 8, at least 16 (default {d.image_size})")
    add("--width", type=_positive, default=None,
        help=f"channels of the network's first stage, doubled at each level (default {d.width})")
    add("--train-size", type=_positive, default=None, metavar="N",
        help=f"training canvases (default {d.train_size}; --quick: {QUICK['train_size']})")
    add("--val-size", type=_positive, default=None, metavar="N",
        help=f"validation canvases for the mIoU (default {d.val_size}; --quick: {QUICK['val_size']})")
    add("--eval-every", type=_positive, default=None, metavar="K",
        help=f"evaluate and compare the runs every K steps (default {d.eval_every}; "
             f"--quick: {QUICK['eval_every']})")
    add("--backend", choices=("gloo", "nccl"), default=None,
        help="torch.distributed backend (default: nccl with --device cuda, else gloo)")
    add("--device", choices=("cpu", "cuda"), default=None,
        help="where each rank trains (default cpu); with cuda each rank uses cuda:LOCAL_RANK "
             "under torchrun, cuda:RANK when spawned (gloo may share GPUs: cuda:RANK %% GPUs)")
    add("--out", default=None, metavar="DIR",
        help=f"output folder for results.json, curves.png, samples.png (default {d.out})")
    add("--seed", type=int, default=None,
        help=f"seed of the initial weights, the dataset and the data order (default {d.seed})")
    add("--quick", action="store_true",
        help="a short run for tests and a first look: "
             + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="show a progress bar per run on rank 0 (default: only when stderr is a terminal)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Defaults, then --quick's settings, then the options given explicitly."""
    config = DemoConfig()
    if args.quick:
        config = replace(config, quick=True, **QUICK)
    given = {
        name: getattr(args, name)
        for name in (
            "world_size", "batch_per_rank", "steps", "lr", "background_weight", "image_size", "width",
            "train_size",
            "val_size", "eval_every", "backend", "device", "out", "seed", "progress",
        )
        if getattr(args, name, None) is not None
    }
    config = replace(config, **given)
    if args.backend is None:
        config.backend = "nccl" if config.device == "cuda" else "gloo"
    return config


def _check(config: DemoConfig) -> None:
    if config.backend == "nccl" and config.device != "cuda":
        raise SystemExit("syncbn demo: --backend nccl needs --device cuda")
    if config.image_size < 16 or config.image_size % 8:
        raise SystemExit(f"syncbn demo: --image-size must be a multiple of 8, at least 16, got {config.image_size}")
    if config.lr <= 0 or not math.isfinite(config.lr):
        raise SystemExit(f"syncbn demo: --lr must be positive, got {config.lr}")
    if config.background_weight <= 0 or not math.isfinite(config.background_weight):
        raise SystemExit(f"syncbn demo: --background-weight must be positive, got {config.background_weight}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("syncbn demo: --device cuda given but torch sees no CUDA device")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``syncbn demo``: spawn workers (or join torchrun's), train, report."""
    config = config_from_args(args)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world and int(os.environ["RANK"]) == 0:
            print(f"syncbn demo: --world-size {args.world_size} ignored, torchrun started {world} ranks",
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
    print(f"syncbn demo: starting {config.world_size} worker processes ({config.backend}, {config.device})",
          flush=True)
    with WorkerPool(config.world_size, backend=config.backend, timeout=_COLLECTIVE_TIMEOUT_S) as pool:
        results = pool.run(train_on_rank, config, "spawned", timeout=_job_timeout(config))
    report = results[0]
    report["elapsed_s"] = time.perf_counter() - start
    write_report(report, config.out)
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
        # Every rank leaves the group at the same point: a rank that tore its gloo pairs
        # down while rank 0 still read from them was seen to abort ("terminate called
        # without an active exception"). Rank 0 then computes the reference alone.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report = _reference_and_summary(config, "torchrun", ctx, data, records) if ctx.main else None
    if report is not None:
        report["elapsed_s"] = time.perf_counter() - start
        write_report(report, config.out)
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


@dataclass
class _Record:
    """What rank 0 keeps of one run."""

    losses: List[float] = field(default_factory=list)
    miou: Dict[int, float] = field(default_factory=dict)
    snapshots: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    class_iou: List[float] = field(default_factory=list)
    predictions: Optional[np.ndarray] = None
    seconds: float = 0.0


def global_batches(train_size: int, steps: int, global_batch: int, seed: int) -> np.ndarray:
    """(steps, global_batch) training indices: shuffled epochs without replacement, from
    the seed alone, so every rank and the reference run derive the same order."""
    rng = np.random.default_rng([seed, 3])
    needed = steps * global_batch
    epochs = [rng.permutation(train_size) for _ in range(-(-needed // train_size))]
    return np.concatenate(epochs)[:needed].reshape(steps, global_batch)


def per_image_loss(logits: torch.Tensor, masks: torch.Tensor, class_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean pixel cross-entropy of each image (pixels of class c weighted by
    ``class_weight[c]``), shape (N,). The training loss is the mean of this over the
    local batch, so DDP's gradient average over ranks equals the gradient of the mean
    over the concatenated batch exactly, whatever the pixel counts of each class."""
    pixels = F.cross_entropy(logits, masks, weight=class_weight, reduction="none")
    return pixels.flatten(1).mean(1)


def learning_rate(config: DemoConfig, step: int) -> float:
    """Cosine decay from ``config.lr`` at step 1 towards 0 after the last step."""
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / config.steps))


@torch.no_grad()
def confusion_matrix(model: nn.Module, images: torch.Tensor, masks: torch.Tensor, batch: int = 128) -> torch.Tensor:
    """(11, 11) pixel counts, rows the true class, columns the predicted one (eval mode)."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(NUM_CLASSES * NUM_CLASSES, dtype=torch.int64, device=images.device)
    for start in range(0, len(images), batch):
        pred = model(images[start : start + batch]).argmax(1)
        pairs = masks[start : start + batch] * NUM_CLASSES + pred
        counts += torch.bincount(pairs.flatten(), minlength=NUM_CLASSES * NUM_CLASSES)
    model.train(was_training)
    return counts.view(NUM_CLASSES, NUM_CLASSES).cpu()


def class_iou(confusion: torch.Tensor) -> np.ndarray:
    """IoU of each class (NaN for a class absent from both truth and prediction)."""
    c = confusion.double().numpy()
    tp = np.diag(c)
    union = c.sum(0) + c.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, tp / union, np.nan)


def relative_difference(params: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]):
    """(largest ||a - b|| / ||b|| over the tensors, the name of that tensor)."""
    worst, name = 0.0, ""
    for key, ref in reference.items():
        ref64 = ref.double()
        diff = torch.linalg.vector_norm(params[key].double() - ref64).item()
        scale = torch.linalg.vector_norm(ref64).item()
        value = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if value > worst or not name:
            worst, name = value, key
    return worst, name


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
    batches = global_batches(config.train_size, config.steps, config.global_batch, config.seed)
    return _Data(
        torch.from_numpy(train.images).to(device),
        torch.from_numpy(train.masks).to(device),
        torch.from_numpy(val.images).to(device),
        torch.from_numpy(val.masks).to(device),
        torch.from_numpy(batches).to(device),
    )


def _new_model(config: DemoConfig, device: torch.device) -> nn.Module:
    return build_segmentation_model(config.seed, width=config.width).to(device)


def _params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.named_parameters()}


def _bar(config: DemoConfig, ctx: _Context, position: int, title: str):
    from tqdm.auto import tqdm

    # a terminal that reports a size of 0 x 0 (some ptys) would hide the bar: fall back
    columns, lines = shutil.get_terminal_size((100, 24))
    return tqdm(
        total=config.steps,
        desc=f"[{position}/3] {title}",
        unit="step",
        disable=not ctx.progress,
        ncols=min(columns, 140),
        nrows=max(lines, 4),
        file=sys.stderr,
        bar_format="{desc}: step {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
    )


def _train(run_name: str, position: int, model: nn.Module, config: DemoConfig, data: _Data, ctx: _Context):
    """Train ``model`` for ``config.steps`` steps; returns rank 0's :class:`_Record`.

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
    record = _Record()
    title = run_title(run_name, config.global_batch)
    bar = _bar(config, ctx, position, title) if ctx.main else None
    model.train()

    def evaluate(step: int) -> None:
        record.miou[step] = float(np.nanmean(class_iou(confusion_matrix(net, data.val_x, data.val_y))))
        record.snapshots[step] = _params(net)

    start = time.perf_counter()
    if ctx.main and 0 in eval_steps:
        evaluate(0)
    for step in range(1, config.steps + 1):
        index = data.batches[step - 1, rows]
        loss = per_image_loss(model(data.train_x[index]), data.train_y[index], class_weight).mean()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
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
            text = f"loss {record.losses[-1]:.4f}"
            if record.miou:
                text += f", val mIoU {record.miou[max(record.miou)]:.3f}"
            bar.set_postfix_str(text, refresh=False)
            bar.update(1)
    if not ctx.main:
        return None
    record.seconds = time.perf_counter() - start
    bar.close()
    confusion = confusion_matrix(net, data.val_x, data.val_y)
    record.class_iou = [float(v) for v in class_iou(confusion)]
    record.buffers = {k: v.detach().to("cpu", copy=True) for k, v in net.named_buffers() if "running" in k}
    with torch.no_grad():
        net.eval()
        record.predictions = net(data.val_x[: config.samples]).argmax(1).cpu().numpy().astype(np.uint8)
        net.train()
    if not ctx.progress:
        print(f"[{position}/3] {title}: {config.steps} steps in {record.seconds:.1f} s, "
              f"final loss {record.losses[-1]:.4f}, val mIoU {record.miou[config.steps]:.3f}", flush=True)
    return record


def train_on_rank(config: DemoConfig, launcher: str) -> Optional[dict]:
    """The whole demo as seen by one rank of the default process group.

    Runs 1 and 2 (DDP) on every rank, then run 3 on rank 0 alone. Returns the report
    (a plain dict, see :func:`write_report`) on rank 0 and None elsewhere.
    """
    ctx, data, records = _distributed_runs(config, launcher)
    if not ctx.main:
        return None  # nothing more to do here: rank 0 computes the reference alone
    return _reference_and_summary(config, launcher, ctx, data, records)


def _distributed_runs(config: DemoConfig, launcher: str):
    """Runs 1 and 2 (DDP, every rank): returns this rank's context, data and records."""
    import syncbn

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != config.world_size:
        raise RuntimeError(f"process group has {world} ranks, the config says {config.world_size}")
    device = _rank_device(config, rank, launcher)
    progress = sys.stderr.isatty() if config.progress is None else config.progress
    ctx = _Context(rank, world, device, rank == 0, progress and rank == 0)
    if ctx.main:
        print(f"syncbn demo: {world} ranks x {config.batch_per_rank} images "
              f"(global batch {config.global_batch}), {config.steps} steps, "
              f"{config.image_size}x{config.image_size} canvases, {config.device}/{config.backend}, "
              f"{launcher}", flush=True)
    data = _load_data(config, device)
    device_ids = [device.index] if device.type == "cuda" else None

    records: Dict[str, _Record] = {}
    # 1. what users get today: each rank's BatchNorm sees its own b images
    model = nn.parallel.DistributedDataParallel(_new_model(config, device), device_ids=device_ids)
    records["per_rank_bn"] = _train("per_rank_bn", 1, model, config, data, ctx)
    # 2. the only change: the BatchNorm layers become synchronized
    model = nn.parallel.DistributedDataParallel(
        syncbn.convert_sync_batchnorm(_new_model(config, device)), device_ids=device_ids
    )
    records["syncbn"] = _train("syncbn", 2, model, config, data, ctx)
    del model
    return ctx, data, records


def _reference_and_summary(config: DemoConfig, launcher: str, ctx: _Context, data: _Data,
                           records: Dict[str, _Record]) -> dict:
    """Run 3 on rank 0 alone (no process group needed) and the report of all three."""
    device = ctx.device
    # 3. the reference: one process, the W batches concatenated in rank order, no DDP
    solo = _Context(0, 1, device, True, ctx.progress)
    records["big_batch"] = _train("big_batch", 3, _new_model(config, device), config, data, solo)
    sample_x = data.val_x[: config.samples].cpu().numpy()
    sample_y = data.val_y[: config.samples].cpu().numpy()
    return _summarize(config, launcher, records, sample_x, sample_y)


def _summarize(config, launcher, records, sample_x, sample_y) -> dict:
    ref = records["big_batch"]
    final = config.steps
    runs = {}
    for name in RUNS:
        rec = records[name]
        entry = {
            "title": run_title(name, config.global_batch),
            "final_loss": rec.losses[-1],
            "final_val_miou": rec.miou[final],
            "seconds": rec.seconds,
            "loss_curve": rec.losses,
            "val_miou_curve": [[s, rec.miou[s]] for s in sorted(rec.miou)],
            "val_class_iou": dict(zip(CLASS_NAMES, rec.class_iou)),
        }
        if name != "big_batch":
            diffs = {s: relative_difference(rec.snapshots[s], ref.snapshots[s]) for s in sorted(rec.snapshots)}
            entry["param_rel_diff_vs_big_batch"] = diffs[final][0]
            entry["param_rel_diff_worst_tensor"] = diffs[final][1]
            entry["param_rel_diff_curve"] = [[s, d[0]] for s, d in diffs.items()]
            entry["buffer_rel_diff_vs_big_batch"] = relative_difference(rec.buffers, ref.buffers)[0]
        runs[name] = entry
    sync_diff = runs["syncbn"]["param_rel_diff_vs_big_batch"]
    per_rank_diff = runs["per_rank_bn"]["param_rel_diff_vs_big_batch"]
    probe = build_segmentation_model(config.seed, width=config.width)
    return {
        "command": "syncbn demo",
        "syncbn_version": __version__,
        "torch_version": torch.__version__,
        "launcher": launcher,
        "config": {k: v for k, v in asdict(config).items() if k != "progress"},
        "global_batch": config.global_batch,
        "model": {
            "name": type(probe).__name__,
            "batchnorm_layers": count_batchnorm(probe),
            "parameters": sum(p.numel() for p in probe.parameters()),
        },
        "loss": "mean over the images of each image's mean pixel cross-entropy "
                f"(background pixels weighted {config.background_weight}, digit pixels 1)",
        "optimizer": f"SGD(lr={config.lr} cosine-decayed to 0 over {config.steps} steps, "
                     f"momentum={config.momentum}, weight_decay=0)",
        "param_rel_diff_definition": DIFF_DEFINITION,
        "miou_definition": MIOU_DEFINITION,
        "runs": runs,
        "syncbn_vs_big_batch": sync_diff,
        "per_rank_bn_vs_big_batch": per_rank_diff,
        "bar": DIFF_BAR,
        "syncbn_matches_big_batch": bool(sync_diff < DIFF_BAR),
        "per_rank_bn_further_away": bool(per_rank_diff > sync_diff),
        "_samples": {"images": sample_x, "truth": sample_y,
                     "predictions": {name: records[name].predictions for name in RUNS}},
    }


# ----------------------------------------------------------------------------- report


def write_report(report: dict, out: str) -> None:
    """Write results.json, curves.png and samples.png to ``out`` and print the table."""
    os.makedirs(out, exist_ok=True)
    samples = report.pop("_samples")
    paths = {
        "results": os.path.join(out, "results.json"),
        "curves": os.path.join(out, "curves.png"),
        "samples": os.path.join(out, "samples.png"),
    }
    report["files"] = paths
    with open(paths["results"], "w") as fh:
        json.dump(report, fh, indent=2, allow_nan=False, default=_json_default)
        fh.write("\n")
    _plot_curves(report, paths["curves"])
    _plot_samples(report, samples, paths["samples"])
    print(format_table(report), flush=True)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def format_table(report: dict) -> str:
    cfg = report["config"]
    runs = report["runs"]
    head = (f"{'run':<28}{'final loss':>12}{'val mIoU':>10}{'param diff vs big batch':>26}{'time':>9}")
    lines = [
        "",
        f"syncbn demo: {cfg['world_size']} ranks x {cfg['batch_per_rank']} images = global batch "
        f"{report['global_batch']}, {cfg['steps']} steps, {cfg['device']}/{cfg['backend']} "
        f"({report['launcher']}), {report['model']['batchnorm_layers']} BatchNorm layers",
        "",
        head,
        "-" * len(head),
    ]
    for i, name in enumerate(RUNS, 1):
        r = runs[name]
        title = r["title"]
        diff = f"{r['param_rel_diff_vs_big_batch']:.2e}" if name != "big_batch" else "(reference)"
        lines.append(f"{i} {title:<26}{r['final_loss']:>12.6f}{r['final_val_miou']:>10.4f}{diff:>26}"
                     f"{r['seconds']:>8.1f}s")
    sync, per_rank = report["syncbn_vs_big_batch"], report["per_rank_bn_vs_big_batch"]
    lines += [
        "",
        "param diff: " + DIFF_DEFINITION + ", after the last step.",
        "val mIoU: over the 11 classes (background + 10 digits) on "
        f"{cfg['val_size']} validation canvases.",
    ]
    if report["syncbn_matches_big_batch"]:
        verdict = f"syncbn matches the big batch: {sync:.1e} < {report['bar']:.0e}"
    else:
        verdict = f"WARNING: syncbn is {sync:.1e} away from the big batch, above the {report['bar']:.0e} bar"
    if sync > 0:
        verdict += f"; per-rank BN is {per_rank / sync:.0f}x further away ({per_rank:.1e})."
    else:
        verdict += f"; per-rank BN is {per_rank:.1e} away."
    lines.append(verdict)
    files = report.get("files", {})
    if files:
        lines.append("wrote " + ", ".join(files.values()))
    if "elapsed_s" in report:
        lines.append(f"total time {report['elapsed_s']:.1f} s")
    return "\n".join(lines)


_COLORS = {"per_rank_bn": "tab:red", "syncbn": "tab:blue", "big_batch": "black"}
_STYLES = {"per_rank_bn": "-", "syncbn": "-", "big_batch": (0, (4, 3))}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values: List[float], window: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if window <= 1 or len(values) < window:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


def _plot_curves(report: dict, path: str) -> None:
    plt = _pyplot()
    runs = report["runs"]
    steps = report["config"]["steps"]
    window = max(1, steps // 20)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), constrained_layout=True)
    ax = axes[0]
    for name in RUNS:
        losses = runs[name]["loss_curve"]
        x = np.arange(1, len(losses) + 1)
        ax.plot(x, losses, color=_COLORS[name], alpha=0.15, linewidth=0.8)
        ax.plot(x, _smooth(losses, window), color=_COLORS[name], linestyle=_STYLES[name], linewidth=1.8,
                label=runs[name]["title"])
    smoothed = f"; faint: raw, bold: mean of {window} steps" if window > 1 else ""
    ax.set(title=f"training loss of the global batch{smoothed}", xlabel="step", ylabel="loss")
    ax.legend()
    ax = axes[1]
    for name in RUNS:
        curve = np.array(runs[name]["val_miou_curve"])
        ax.plot(curve[:, 0], curve[:, 1], color=_COLORS[name], linestyle=_STYLES[name], marker="o",
                markersize=4, label=runs[name]["title"])
    ax.set(title="validation mIoU (11 classes)", xlabel="step", ylabel="mIoU", ylim=(0, 1))
    ax.legend()
    ax = axes[2]
    for name in RUNS[:2]:
        curve = np.array([p for p in runs[name]["param_rel_diff_curve"] if p[1] > 0])
        if len(curve):
            ax.plot(curve[:, 0], curve[:, 1], color=_COLORS[name], marker="o", markersize=4,
                    label=runs[name]["title"])
    ax.axhline(report["bar"], color="gray", linestyle=":", label=f"bar {report['bar']:.0e}")
    ax.set_yscale("log")
    ax.set(title="parameter difference vs the big batch\nmax over tensors of ||p - p_ref|| / ||p_ref||",
           xlabel="step", ylabel="relative difference")
    ax.legend()
    cfg = report["config"]
    fig.suptitle(f"syncbn demo: {cfg['world_size']} ranks x {cfg['batch_per_rank']} images vs one batch of "
                 f"{report['global_batch']}, digits segmentation {cfg['image_size']}x{cfg['image_size']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _class_colormap():
    from matplotlib.colors import ListedColormap

    plt = _pyplot()
    colors = [(0.0, 0.0, 0.0, 1.0)] + [plt.get_cmap("tab10")(i) for i in range(10)]
    return ListedColormap(colors), colors


def _plot_samples(report: dict, samples: dict, path: str) -> None:
    from matplotlib.patches import Patch

    plt = _pyplot()
    cmap, colors = _class_colormap()
    images, truth = samples["images"], samples["truth"]
    columns = [("input", None), ("truth", truth)] + [
        (report["runs"][name]["title"].replace(" under DDP", "\nunder DDP").replace(", batch", ",\nbatch"),
         samples["predictions"][name])
        for name in RUNS
    ]
    n = len(images)
    fig, axes = plt.subplots(n, len(columns), figsize=(2.1 * len(columns), 2.1 * n + 0.9), squeeze=False)
    for row in range(n):
        for col, (title, masks) in enumerate(columns):
            ax = axes[row, col]
            if masks is None:
                ax.imshow(images[row, 0], cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            else:
                ax.imshow(masks[row], cmap=cmap, vmin=-0.5, vmax=NUM_CLASSES - 0.5, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(title, fontsize=9)
    handles = [Patch(color=colors[c], label=CLASS_NAMES[c]) for c in range(NUM_CLASSES)]
    fig.legend(handles=handles, loc="lower center", ncol=NUM_CLASSES, fontsize=8, frameon=False,
               handlelength=1.2, columnspacing=0.8)
    fig.suptitle("validation canvases: true masks and each run's prediction after the last step", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
