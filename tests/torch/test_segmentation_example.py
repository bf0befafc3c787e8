"""The example ``examples/segmentation.py``: 2 CPU ranks under torchrun on a tiny VOC-layout
folder made here; its mIoU arithmetic and validation sharding on their own.

The end-to-end runs (about 7 s each on an idle machine) are shared by the tests below:
3 epochs with a stop after 2, the resumed 3rd epoch, and 3 epochs without a stop.
"""

import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import doc_blocks

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent.parent / "examples" / "segmentation.py"
MODEL = "lraspp_mobilenet_v3_large"
CLASSES = 4
VAL_IMAGES = 5  # odd: 2 ranks cannot split it evenly

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")


def load_example():
    spec = importlib.util.spec_from_file_location("segmentation_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


# ---- the metric and the validation split, on their own ----------------------------------------


def test_confusion_and_miou_by_hand():
    target = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 1]])
    pred = torch.tensor([[0, 1, 1, 1], [2, 0, 2, 3]])
    confusion = example.confusion_matrix(pred, target, 4)
    # rows: true class; columns: predicted. The 255 pixel counts nowhere.
    expected = [[1, 1, 0, 0], [0, 2, 0, 1], [1, 0, 1, 0], [0, 0, 0, 0]]
    assert confusion.tolist() == expected
    miou, iou, accuracy = example.scores(confusion)
    # IoU = hits / (row + column - hits): class 0: 1/(2+2-1), 1: 2/(3+3-2), 2: 1/(2+1-1);
    # class 3 is never true but predicted once: 0/(0+1-0) = 0, and it counts
    assert iou == pytest.approx([1 / 3, 1 / 2, 1 / 2, 0.0], rel=1e-15, abs=0)
    assert miou == pytest.approx((1 / 3 + 1 / 2 + 1 / 2 + 0) / 4, rel=1e-15, abs=0)
    assert accuracy == pytest.approx(4 / 7, rel=1e-15, abs=0)
    # a class neither true nor predicted has no IoU and stays out of the mean: the first two
    # columns give class 0: 1/(2+2-1), class 1 (predicted, never true): 0, class 2: 1/(2+1-1)
    miou, iou, _ = example.scores(example.confusion_matrix(pred[:, :2], target[:, :2], 4))
    assert math.isnan(iou[3]) and miou == pytest.approx((1 / 3 + 0 + 1 / 2) / 3, rel=1e-15, abs=0)
    assert math.isnan(example.scores(torch.zeros(3, 3, dtype=torch.int64))[0])
    with pytest.raises(ValueError, match="target labels must be in 0..3 or 255"):
        example.confusion_matrix(pred, torch.full_like(target, 4), 4)


def test_a_missing_data_folder_or_weights_file_is_named_before_training(tmp_path, capsys):
    """A --data folder without the VOC layout reached torchvision's "Dataset not found or
    corrupted. You can use download=True", on every rank after the model was built, advice
    this script (which downloads nothing) cannot take; a missing --weights file reached
    torch.load. Both are argument errors naming the path."""
    with pytest.raises(SystemExit) as stop:
        example.parse_args(["--data", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path}: no folder {tmp_path / 'VOCdevkit' / 'VOC2012'}" in err, err
    (tmp_path / "VOCdevkit" / "VOC2012").mkdir(parents=True)
    assert example.parse_args(["--data", str(tmp_path)]).data == str(tmp_path)
    with pytest.raises(SystemExit):
        example.parse_args(["--data", str(tmp_path), "--weights", str(tmp_path / "nope.pth")])
    assert f"--weights {tmp_path / 'nope.pth'}: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse_args(["--data", str(tmp_path), "--workers", "-1"])
    assert "--workers must be 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("length, world", [(5, 2), (7, 3), (1, 2), (4, 4)])
def test_validation_shards_count_every_image_once(length, world):
    shards = [list(example.ShardSampler(length, rank, world)) for rank in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(length))
    assert [len(example.ShardSampler(length, rank, world)) for rank in range(world)] == [len(s) for s in shards]


# ---- end to end under torchrun ------------------------------------------------------------------


def make_voc(root: Path, rng) -> int:
    """6 train and VAL_IMAGES val images (48 x 64 JPEGs) with palette PNG masks of CLASSES
    classes and about 5 % ignored pixels; returns the number of labelled val pixels."""
    voc = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / sub).mkdir(parents=True)
    from PIL import Image

    palette = rng.integers(0, 256, 768).astype(np.uint8).tolist()
    labelled = 0
    for split, count in (("train", 6), ("val", VAL_IMAGES)):
        names = [f"{split}{i}" for i in range(count)]
        for name in names:
            mask = np.zeros((48, 64), np.uint8)
            for label in range(1, CLASSES):
                top, left = rng.integers(0, 36), rng.integers(0, 52)
                mask[top:top + rng.integers(8, 24), left:left + rng.integers(8, 32)] = label
            mask[rng.random(mask.shape) < 0.05] = 255
            colours = rng.integers(0, 256, (256, 3))
            image = np.clip(colours[mask] + rng.integers(-30, 30, (48, 64, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(image).save(voc / "JPEGImages" / f"{name}.jpg")
            png = Image.fromarray(mask, mode="P")
            png.putpalette(palette)
            png.save(voc / "SegmentationClass" / f"{name}.png")
            if split == "val":
                labelled += int((mask != 255).sum())
        (voc / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(names) + "\n")
    return labelled


# runs the example with torchvision importable beside a CPU-only torch, then checks that the
# process group the example destroyed was really freed (doc_blocks.exit_unless_group_freed)
RUNNER = doc_blocks.torchrun_wrapper("""import torchvision_shim
torchvision_shim.install()""")


def train(data: Path, out: Path, *extra: str) -> str:
    runner = out.parent / "_ended.py"
    runner.write_text(RUNNER)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), str(HERE), str(HERE.parent)]),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(runner), str(EXAMPLE), "--data", str(data), "--out", str(out), "--model", MODEL,
           "--num-classes", str(CLASSES), "--batch-size", "1", "--crop", "32", "--val-crop", "64",
           "--workers", "0", "--print-freq", "1", "--lr", "0.05", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(out.parent))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("segmentation")
    labelled = make_voc(root / "voc", np.random.default_rng(0))
    split, straight = root / "split", root / "straight"
    first = train(root / "voc", split, "--epochs", "3", "--stop-after", "2")
    shutil.copy(split / "last.pt", root / "after_two.pt")
    resumed = train(root / "voc", split, "--epochs", "3", "--resume")
    whole = train(root / "voc", straight, "--epochs", "3")
    return dict(root=root, labelled=labelled, first=first, resumed=resumed, whole=whole)


def epoch_lines(text):
    return re.findall(r"^epoch (\d+)/3: .*val mIoU (\S+), .* over (\d+) images / (\d+) labelled pixels", text, re.M)


def plain_model():
    from torchvision.models import segmentation

    return getattr(segmentation, MODEL)(weights=None, weights_backbone=None, num_classes=CLASSES)


def test_two_ranks_train_and_report_miou_per_epoch(runs):
    bns = sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain_model().modules())
    assert bns > 0 and f"syncbn synchronized {bns} of {bns} BatchNorm layers across 2 rank(s)" in runs["first"]
    assert "device cpu, amp off (float32)" in runs["first"]
    lines = epoch_lines(runs["first"])
    assert [line[0] for line in lines] == ["1", "2"]
    for _, miou, images, pixels in lines:
        assert 0.0 <= float(miou) <= 1.0  # nan fails too
        # every val image exactly once, all its pixels: no sampler padding, no cropping
        assert (int(images), int(pixels)) == (VAL_IMAGES, runs["labelled"])


def test_checkpoint_loads_into_the_plain_torchvision_model(runs):
    root = runs["root"]
    for path in (root / "after_two.pt", root / "split" / "best.pt"):
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values only
        model = plain_model()
        assert list(checkpoint["model"]) == list(model.state_dict())
        model.load_state_dict(checkpoint["model"])
    checkpoint = torch.load(root / "after_two.pt", map_location="cpu", weights_only=True)
    assert checkpoint["epoch"] == 2 and checkpoint["lr_scheduler"]["last_epoch"] == 2 * 3  # 3 steps an epoch
    assert set(checkpoint) >= {"optimizer", "scaler", "best_miou"}


def test_resume_runs_only_the_third_epoch_and_matches_the_uninterrupted_run(runs):
    resumed, whole = runs["resumed"], runs["whole"]
    assert "after epoch 2" in resumed and "note:" not in resumed
    assert [line[0] for line in epoch_lines(resumed)] == ["3"]
    assert not re.search(r"^epoch [12]/", resumed, re.M)
    # the third epoch's progress lines (loss, lr) and result are the uninterrupted run's
    def third(text):
        return [re.sub(r"[\d.]+ (img/)?s$", "", line) for line in text.splitlines() if line.startswith("epoch 3/")]

    assert third(resumed) == third(whole) and len(third(whole)) == 4
    a = torch.load(runs["root"] / "split" / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(runs["root"] / "straight" / "last.pt", map_location="cpu", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3 and a["best_miou"] == b["best_miou"]
    for key, value in b["model"].items():
        assert torch.equal(a["model"][key], value), key
    for index, state in b["optimizer"]["state"].items():
        assert torch.equal(a["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
    assert a["lr_scheduler"] == b["lr_scheduler"]
