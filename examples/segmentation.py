"""Train a torchvision segmentation model with synchronized batch normalization under
torchrun and DDP, on a dataset in the Pascal VOC folder layout.

Segmentation trains on large crops, so each GPU holds only a few images and per-GPU
BatchNorm statistics are noisy; ``syncbn.convert_sync_batchnorm`` makes every BN layer
normalize over the images of all ranks together.

    torchrun --standalone --nproc-per-node 4 examples/segmentation.py \\
        --data /datasets/voc --model deeplabv3_mobilenet_v3_large --epochs 30 --out runs/voc
    # continue after an interruption, from runs/voc/last.pt:
    torchrun --standalone --nproc-per-node 4 examples/segmentation.py \\
        --data /datasets/voc --model deeplabv3_mobilenet_v3_large --epochs 30 --out runs/voc --resume

``--data`` is the folder holding ``VOCdevkit/VOC2012/{JPEGImages, SegmentationClass,
ImageSets/Segmentation/{train,val}.txt}`` (read by ``torchvision.datasets.VOCSegmentation``;
masks are palette or grayscale PNGs of class indices, 255 = ignore). Nothing is
downloaded: the model starts from random weights, or from ``--weights`` (a state dict of
the whole segmentation model, such as torchvision's published files) or
``--backbone-weights`` (a state dict of the ImageNet classifier the backbone comes from).

On CUDA (one process per GPU, NCCL) the forward pass runs under float16 autocast with a
GradScaler (``--no-amp`` turns it off); on the CPU (gloo) everything stays float32.
Without torchrun, ``python examples/segmentation.py ...`` trains in a single process.

Rank 0 prints progress and writes ``OUT/last.pt`` after every epoch (model state dict in
plain torchvision keys, optimizer, GradScaler, lr scheduler, epoch, best mIoU) and
``OUT/best.pt`` (model only) when the validation mIoU improves, both atomically. Every
epoch is seeded from (--seed, epoch, rank), so a run resumed from ``last.pt`` with the
same arguments continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn

IGNORE = 255  # the label of pixels that count neither in the loss nor in the mIoU
MEAN = (0.485, 0.456, 0.406)  # the ImageNet statistics torchvision's backbones expect
STD = (0.229, 0.224, 0.225)
MODELS = (
    "lraspp_mobilenet_v3_large",
    "deeplabv3_mobilenet_v3_large",
    "deeplabv3_resnet50",
    "deeplabv3_resnet101",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder holding VOCdevkit/VOC2012")
    parser.add_argument("--year", default="2012", help="VOC year of the folder layout (VOCdevkit/VOC<year>)")
    parser.add_argument("--model", default="deeplabv3_mobilenet_v3_large", choices=MODELS)
    parser.add_argument("--num-classes", type=int, default=21, help="classes, background included (VOC: 21)")
    parser.add_argument("--weights", help="state dict (.pth) of the whole segmentation model to start from")
    parser.add_argument("--backbone-weights", help="state dict (.pth) of the ImageNet classifier of the backbone")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--stop-after", type=int, help="end this run after this many epochs (resume later)")
    parser.add_argument("--batch-size", type=int, default=8, help="images per rank and step")
    parser.add_argument("--crop", type=int, default=480, help="side of the square training crops")
    parser.add_argument("--val-crop", type=int, default=512,
                        help="side of the validation canvas (padded with ignore, centre-cropped): "
                             "images up to this size are evaluated whole, at their own resolution")
    parser.add_argument("--scale", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"),
                        help="range of the random rescaling before the training crop")
    parser.add_argument("--lr", type=float, default=0.01, help="initial learning rate (poly schedule, power 0.9)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=4, help="data loading processes per rank")
    parser.add_argument("--out", default="runs/segmentation", help="folder for last.pt and best.pt")
    parser.add_argument("--resume", nargs="?", const="", metavar="CHECKPOINT",
                        help="continue from CHECKPOINT (default: OUT/last.pt)")
    parser.add_argument("--no-amp", action="store_true", help="no float16 autocast on CUDA")
    parser.add_argument("--print-freq", type=int, default=20, help="steps between progress lines")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "crop", "val_crop", "num_classes", "print_freq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 2 <= args.num_classes <= IGNORE:
        parser.error(f"--num-classes must be in 2..{IGNORE} (label {IGNORE} means ignore)")
    if not 0 < args.scale[0] <= args.scale[1]:
        parser.error("--scale needs 0 < MIN <= MAX")
    if args.workers < 0:
        parser.error("--workers must be 0 or more (0: load in the training process)")
    voc = os.path.join(args.data, "VOCdevkit", f"VOC{args.year}")
    if not os.path.isdir(voc):
        parser.error(f"--data {args.data}: no folder {voc} (the Pascal VOC layout: VOCdevkit/VOC{args.year}/"
                     "{JPEGImages, SegmentationClass, ImageSets/Segmentation/{train,val}.txt}; nothing is downloaded)")
    for option in ("weights", "backbone_weights"):
        path = getattr(args, option)
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{option.replace('_', '-')} {path}: no such file")
    return args


# ---- data: joint image/mask transforms ---------------------------------------------------


def to_tensors(image, mask, num_classes: int):
    """PIL image and mask -> normalized float image (3, H, W) and uint8 label map (1, H, W)."""
    import torchvision.transforms.functional as TF

    if mask.mode not in ("P", "L"):
        raise ValueError(f"masks must be palette or grayscale PNGs of class indices, got mode {mask.mode!r}")
    labels = TF.pil_to_tensor(mask)
    bad = labels[(labels >= num_classes) & (labels != IGNORE)]
    if bad.numel():
        raise ValueError(
            f"mask has labels {sorted(set(bad.tolist()))[:10]} outside 0..{num_classes - 1} and {IGNORE} "
            "(ignore): is --num-classes right?"
        )
    pixels = TF.convert_image_dtype(TF.pil_to_tensor(image.convert("RGB")), torch.float32)
    return TF.normalize(pixels, MEAN, STD), labels


def pad_to(image, labels, size: int):
    """Pad on the right and bottom to at least size x size (image with 0, the mean colour
    after normalization; labels with IGNORE, so padding never counts)."""
    import torchvision.transforms.functional as TF

    height, width = labels.shape[-2:]
    extra = [0, 0, max(size - width, 0), max(size - height, 0)]  # left, top, right, bottom
    if extra[2] or extra[3]:
        image = TF.pad(image, extra, fill=0.0)
        labels = TF.pad(labels, extra, fill=IGNORE)
    return image, labels


class TrainTransform:
    """Random rescale, pad, random crop of crop x crop, random horizontal flip. Randomness
    comes from torch's generator (seeded per epoch and rank, see ``seed_epoch``)."""

    def __init__(self, crop: int, scale, num_classes: int):
        self.crop, self.scale, self.num_classes = crop, tuple(scale), num_classes

    def __call__(self, image, mask):
        import torchvision.transforms.functional as TF
        from torchvision.transforms import InterpolationMode

        image, labels = to_tensors(image, mask, self.num_classes)
        low, high = self.scale
        factor = low + (high - low) * torch.rand(()).item()
        height, width = labels.shape[-2:]
        size = [max(1, round(height * factor)), max(1, round(width * factor))]
        image = TF.resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True)
        labels = TF.resize(labels, size, interpolation=InterpolationMode.NEAREST)
        image, labels = pad_to(image, labels, self.crop)
        height, width = labels.shape[-2:]
        top = int(torch.randint(height - self.crop + 1, ()))
        left = int(torch.randint(width - self.crop + 1, ()))
        image = TF.crop(image, top, left, self.crop, self.crop)
        labels = TF.crop(labels, top, left, self.crop, self.crop)
        if torch.rand(()) < 0.5:
            image, labels = TF.hflip(image), TF.hflip(labels)
        return image, labels[0].long()


class ValTransform:
    """Pad to at least size x size and take the centre size x size: every image of up to
    that size keeps all its pixels at its own resolution (padding is IGNORE)."""

    def __init__(self, size: int, num_classes: int):
        self.size, self.num_classes = size, num_classes

    def __call__(self, image, mask):
        import torchvision.transforms.functional as TF

        image, labels = pad_to(*to_tensors(image, mask, self.num_classes), self.size)
        return TF.center_crop(image, [self.size]), TF.center_crop(labels, [self.size])[0].long()


class ShardSampler(torch.utils.data.Sampler):
    """Indices rank, rank + W, rank + 2W, ...: every item on exactly one rank, no padding
    (``DistributedSampler`` repeats items to even out the ranks, which would count some
    validation images twice). Ranks may get one item fewer; evaluation does not
    communicate per batch, so uneven counts are fine."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


# ---- metric --------------------------------------------------------------------------------


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(num_classes, num_classes) int64 counts: row = true class, column = predicted class,
    over the pixels whose target is not IGNORE."""
    valid = target != IGNORE
    truth, guess = target[valid].long(), pred[valid].long()
    if truth.numel() and (int(truth.min()) < 0 or int(truth.max()) >= num_classes):
        raise ValueError(f"target labels must be in 0..{num_classes - 1} or {IGNORE}")
    counts = torch.bincount(truth * num_classes + guess, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def scores(confusion: torch.Tensor):
    """(mIoU, per-class IoU, pixel accuracy) from a confusion matrix. A class absent from
    both the targets and the predictions has no IoU (nan) and does not enter the mean;
    the mIoU is nan when no pixel was labelled."""
    confusion = confusion.double()
    hits = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - hits
    iou = torch.where(union > 0, hits / union.clamp(min=1), torch.full_like(hits, math.nan))
    present = ~iou.isnan()
    miou = float(iou[present].mean()) if present.any() else math.nan
    total = float(confusion.sum())
    accuracy = float(hits.sum()) / total if total else math.nan
    return miou, iou.tolist(), accuracy


# ---- model -----------------------------------------------------------------------------------


def load_state(path: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["model"] if isinstance(state, dict) and "model" in state else state


def build_model(args) -> nn.Module:
    from torchvision.models import segmentation

    kwargs = dict(weights=None, weights_backbone=None, num_classes=args.num_classes)
    if args.model.startswith("deeplabv3"):
        kwargs["aux_loss"] = False
    model = getattr(segmentation, args.model)(**kwargs)
    if args.backbone_weights:
        # the backbone holds the classifier's feature layers under the same names
        # (MobileNetV3: without the "features." level); its head is not part of it
        wanted = model.backbone.state_dict()
        given = {k.removeprefix("features."): v for k, v in load_state(args.backbone_weights).items()}
        missing = [k for k in wanted if k not in given or given[k].shape != wanted[k].shape]
        if missing:
            raise ValueError(f"--backbone-weights lacks {len(missing)} backbone tensors (or their shapes "
                             f"differ), first: {missing[:3]}")
        model.backbone.load_state_dict({k: given[k] for k in wanted})
    if args.weights:
        state = load_state(args.weights)
        head = {k: v for k, v in model.state_dict().items() if k.startswith("classifier.")}
        # a different number of classes: keep everything but the last classifier layer's shapes
        skip = [k for k, v in head.items() if k in state and state[k].shape != v.shape]
        for key in skip:
            del state[key]
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - set(skip):
            raise ValueError(f"--weights does not fit {args.model}: missing {result.missing_keys[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")
    return model


def count_batchnorms(model: nn.Module):
    plain = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    synced = sum(isinstance(m, syncbn.SyncBatchNorm) for m in model.modules())
    return plain, synced


# ---- distributed plumbing --------------------------------------------------------------------


def setup():
    """Join the process group torchrun describes, or a group of one without torchrun."""
    if "RANK" not in os.environ:
        from syncbn.tools.launch import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return device, dist.get_rank(), dist.get_world_size()


def seed_epoch(seed: int, epoch: int, rank: int) -> None:
    """Seed everything random in an epoch (crops, flips, dropout, the loader workers' seeds)
    from (seed, epoch, rank) alone, so a resumed run replays the same epochs."""
    torch.manual_seed((seed * 100_003 + epoch) * 1_009 + rank)


def save_atomically(obj, path: str) -> None:
    """Write to a temporary file, flush it to disk, then rename it over ``path``: a crash
    leaves either the old file or the new one, never a torn one."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str, rank: int):
    """Rank 0 reads the checkpoint and sends it to the others, so every rank resumes from
    the same state, and fails alike if it cannot be read."""
    box = [None]
    if rank == 0:
        try:
            box[0] = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            box[0] = f"cannot resume from {path}: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise SystemExit(box[0])
    return box[0]


# ---- training --------------------------------------------------------------------------------


def evaluate(model, loader, device, num_classes: int, amp: bool, expected: int):
    """Confusion matrix over the whole validation split, summed over ranks."""
    model.eval()  # syncbn layers in eval mode use running statistics: no communication
    confusion = torch.zeros(num_classes * num_classes + 1, dtype=torch.int64, device=device)
    with torch.no_grad():
        for images, targets in loader:
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                logits = model(images)["out"]
            confusion[:-1] += confusion_matrix(logits.argmax(1), targets, num_classes).flatten()
            confusion[-1] += images.shape[0]
    dist.all_reduce(confusion)
    seen = int(confusion[-1])
    if seen != expected:  # cannot happen with ShardSampler; a wrong mIoU must not go unnoticed
        raise RuntimeError(f"evaluated {seen} validation images, expected {expected}")
    return confusion[:-1].reshape(num_classes, num_classes).cpu()


def main(argv=None):
    args = parse_args(argv)
    from torchvision.datasets import VOCSegmentation

    device, rank, world = setup()
    amp = device.type == "cuda" and not args.no_amp

    def say(*parts):
        if rank == 0:
            print(*parts, flush=True)

    train_set = VOCSegmentation(args.data, year=args.year, image_set="train", download=False,
                                transforms=TrainTransform(args.crop, args.scale, args.num_classes))
    val_set = VOCSegmentation(args.data, year=args.year, image_set="val", download=False,
                              transforms=ValTransform(args.val_crop, args.num_classes))
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader_options = dict(batch_size=args.batch_size, num_workers=args.workers, pin_memory=device.type == "cuda")
    # drop_last: every step of every rank has a full batch (the ranks step together anyway)
    train_loader = torch.utils.data.DataLoader(train_set, sampler=train_sampler, drop_last=True, **loader_options)
    val_loader = torch.utils.data.DataLoader(val_set, sampler=ShardSampler(len(val_set), rank, world),
                                             **loader_options)
    steps = len(train_loader)
    if steps == 0:
        raise SystemExit(f"{len(train_set)} training images give no full batch of {args.batch_size} "
                         f"on each of {world} ranks: lower --batch-size")

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(args)
    before, _ = count_batchnorms(model)
    model = syncbn.convert_sync_batchnorm(model, strict=True)  # strict: raise if a BN would stay local
    _, synced = count_batchnorms(model)
    model.to(device)
    say(f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters; syncbn synchronized "
        f"{synced} of {before} BatchNorm layers across {world} rank(s)")
    say(f"device {device.type}, amp {'float16' if amp else 'off (float32)'}; {len(train_set)} train / "
        f"{len(val_set)} val images; {args.batch_size} per rank, {args.batch_size * world} per step, "
        f"{steps} steps per epoch")

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    total_steps = args.epochs * steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, 1.0 - step / total_steps) ** 0.9)  # poly, per step
    scaler = torch.amp.GradScaler(device.type, enabled=amp)

    start_epoch, best = 0, -math.inf  # best mIoU so far
    os.makedirs(args.out, exist_ok=True)
    if args.resume is not None:
        path = args.resume or os.path.join(args.out, "last.pt")
        checkpoint = load_checkpoint(path, rank)
        saved = checkpoint["args"]
        if (saved["model"], saved["num_classes"]) != (args.model, args.num_classes):
            raise SystemExit(f"{path} holds {saved['model']} with {saved['num_classes']} classes, "
                             f"not {args.model} with {args.num_classes}")
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["lr_scheduler"])
        if scaler.is_enabled() and checkpoint["scaler"]:
            scaler.load_state_dict(checkpoint["scaler"])
        start_epoch, best = checkpoint["epoch"], checkpoint["best_miou"]
        say(f"resumed from {path} after epoch {start_epoch} (best mIoU {best:.4f}, step "
            f"{scheduler.last_epoch}, lr {scheduler.get_last_lr()[0]:.6g})")
        if (saved["epochs"], saved["batch_size"]) != (args.epochs, args.batch_size) or saved["world"] != world:
            say(f"note: the run was planned with --epochs {saved['epochs']}, --batch-size "
                f"{saved['batch_size']}, {saved['world']} rank(s): the poly schedule now ends at step "
                f"{total_steps}, so this is not the uninterrupted run's continuation")

    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, start_epoch + args.stop_after)
    if start_epoch >= args.epochs:
        say(f"nothing to do: {args.out} is at epoch {start_epoch} of {args.epochs}")

    for epoch in range(start_epoch + 1, last_epoch + 1):
        seed_epoch(args.seed, epoch, rank)
        train_sampler.set_epoch(epoch)
        ddp.train()
        started, loss_sum = time.perf_counter(), torch.zeros((), device=device)
        for step, (images, targets) in enumerate(train_loader, 1):
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                loss = criterion(ddp(images)["out"].float(), targets)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # this step's
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.detach()
            if step % args.print_freq == 0 or step == steps:
                rate = step * args.batch_size * world / (time.perf_counter() - started)
                say(f"epoch {epoch}/{args.epochs} step {step}/{steps} loss {loss.item():.4f} "
                    f"lr {lr:.6g} {rate:.1f} img/s")
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (steps * world)
        confusion = evaluate(model, val_loader, device, args.num_classes, amp, len(val_set))
        miou, _, accuracy = scores(confusion)
        improved = miou > best  # nan (nothing labelled) never improves
        best = miou if improved else best
        say(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f}, val mIoU {miou:.4f}, pixel accuracy "
            f"{accuracy:.4f} over {len(val_set)} images / {int(confusion.sum())} labelled pixels, best mIoU "
            f"{best:.4f}, {time.perf_counter() - started:.1f} s")
        if rank == 0:
            state = model.state_dict()  # syncbn layers have BatchNorm2d's keys: loads into the plain model
            if improved:
                save_atomically({"model": state, "epoch": epoch, "miou": miou, "args": vars(args)},
                                os.path.join(args.out, "best.pt"))
            save_atomically(
                {"model": state, "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                 "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "best_miou": best,
                 "args": dict(vars(args), world=world)},
                os.path.join(args.out, "last.pt"))
        dist.barrier()  # the others wait until the checkpoint is complete
    say(f"done: epoch {last_epoch} of {args.epochs}, best val mIoU {best:.4f}, checkpoints in {args.out}")
    del ddp  # it holds the group: gone, destroy_process_group frees it (docs/torch.md, "Ending a job")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
