"""What every framework's ``syncbn demo`` shares: the data order, the learning-rate
schedule, the measures (mIoU, distance to the big batch), the progress bars, and the
report (the table, results.json, curves.png, samples.png).

A framework's demo trains the three runs named in :data:`RUNS`, fills one
:class:`RunRecord` per run with plain numpy values, and hands them to
:func:`summarize` and :func:`write_report`. Nothing here imports torch, TensorFlow,
Keras or JAX, so the PyTorch demo runs without TensorFlow and the Keras demo without
torch.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .._version import __version__
from .config import to_argv
from .digits import CLASS_NAMES, NUM_CLASSES, make_split

__all__ = [
    "RUNS",
    "DIFF_BAR",
    "RunRecord",
    "global_batches",
    "learning_rate",
    "confusion_counts",
    "class_iou",
    "relative_difference",
    "progress_bar",
    "ChannelsLastData",
    "train_loop",
    "summarize",
    "write_report",
    "format_table",
    "counted",
    "batch_words",
]

RUNS = ("per_rank_bn", "syncbn", "big_batch")


def counted(n: int, noun: str, plural: Optional[str] = None) -> str:
    """``n`` and ``noun``, plural (``plural``, else ``noun`` + s) unless ``n`` is 1:
    "1 rank", "2 ranks", "1 worker process"."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def batch_words(config, unit: str) -> str:
    """The demo's batch in words, "2 ranks x 8 images", ``unit`` being what a framework's
    demo calls a rank ("rank", "replica", "device"); counted, so 1 is "1 rank x 1 image"."""
    return f"{counted(config.world_size, unit)} x {counted(config.batch_per_rank, 'image')}"


DIFF_BAR = 1e-3
# per-rank BN must end at least this many times further from the big batch than syncbn
SEPARATION_BAR = 100.0
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
class RunRecord:
    """What the main process keeps of one run (numpy arrays, keyed by parameter name)."""

    title: str
    losses: List[float] = field(default_factory=list)
    miou: Dict[int, float] = field(default_factory=dict)
    snapshots: Dict[int, Dict[str, np.ndarray]] = field(default_factory=dict)
    buffers: Dict[str, np.ndarray] = field(default_factory=dict)
    class_iou: List[float] = field(default_factory=list)
    predictions: Optional[np.ndarray] = None
    seconds: float = 0.0


# ----------------------------------------------------------------------------- pieces


def global_batches(train_size: int, steps: int, global_batch: int, seed: int) -> np.ndarray:
    """(steps, global_batch) training indices: shuffled epochs without replacement, from
    the seed alone, so every rank and the reference run derive the same order."""
    rng = np.random.default_rng([seed, 3])
    needed = steps * global_batch
    epochs = [rng.permutation(train_size) for _ in range(-(-needed // train_size))]
    return np.concatenate(epochs)[:needed].reshape(steps, global_batch)


def learning_rate(peak: float, steps: int, step: int) -> float:
    """Cosine decay from ``peak`` at step 1 towards 0 after step ``steps``."""
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / steps))


def confusion_counts(truth: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """(11, 11) pixel counts, rows the true class, columns the predicted one."""
    pairs = np.asarray(truth, np.int64).ravel() * NUM_CLASSES + np.asarray(predicted, np.int64).ravel()
    return np.bincount(pairs, minlength=NUM_CLASSES * NUM_CLASSES).reshape(NUM_CLASSES, NUM_CLASSES)


def class_iou(confusion: np.ndarray) -> np.ndarray:
    """IoU of each class (NaN for a class absent from both truth and prediction)."""
    c = np.asarray(confusion, dtype=np.float64)
    tp = np.diag(c)
    union = c.sum(0) + c.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, tp / union, np.nan)


def relative_difference(params: Dict[str, np.ndarray], reference: Dict[str, np.ndarray]):
    """(largest ||a - b|| / ||b|| over the tensors, the name of that tensor), in float64.

    A NaN or inf anywhere gives inf: a broken run never looks close."""
    worst, name = 0.0, ""
    for key, ref in reference.items():
        ref64 = np.asarray(ref, dtype=np.float64)
        diff = float(np.linalg.norm((np.asarray(params[key], dtype=np.float64) - ref64).ravel()))
        scale = float(np.linalg.norm(ref64.ravel()))
        if not (math.isfinite(diff) and math.isfinite(scale)):
            value = math.inf
        else:
            value = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if value > worst or not name:
            worst, name = value, key
    return worst, name


def progress_bar(steps: int, position: int, title: str, enabled: bool):
    """A tqdm bar on stderr for one run (a disabled one when ``enabled`` is false)."""
    from tqdm.auto import tqdm

    # a terminal that reports a size of 0 x 0 (some ptys) would hide the bar: fall back
    columns, lines = shutil.get_terminal_size((100, 24))
    return tqdm(
        total=steps,
        desc=f"[{position}/3] {title}",
        unit="step",
        disable=not enabled,
        ncols=min(columns, 140),
        nrows=max(lines, 4),
        file=sys.stderr,
        bar_format="{desc}: step {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
    )


def bar_text(record: RunRecord) -> str:
    """The progress bar's postfix: the last loss and the last validation mIoU."""
    text = f"loss {record.losses[-1]:.4f}"
    if record.miou:
        text += f", val mIoU {record.miou[max(record.miou)]:.3f}"
    return text


def run_done_line(position: int, record: RunRecord, steps: int) -> str:
    """The line printed after a run when there is no progress bar."""
    return (f"[{position}/3] {record.title}: {counted(steps, 'step')} in {record.seconds:.1f} s, "
            f"final loss {record.losses[-1]:.4f}, val mIoU {record.miou[steps]:.3f}")


class ChannelsLastData:
    """The demo's data for the channels-last frameworks (Keras, Flax): training and
    validation canvases NHWC float32, masks int32 (validation as made), the global batch
    order and the class weights of the loss."""

    def __init__(self, config):
        common = dict(seed=config.seed, size=config.image_size)
        train = make_split("train", config.train_size, **common)
        val = make_split("val", config.val_size, **common)
        self.train_x = np.ascontiguousarray(train.images.transpose(0, 2, 3, 1))  # NHWC
        self.train_y = train.masks.astype(np.int32)
        self.val_images = val.images  # NCHW, for the samples plot
        self.val_x = np.ascontiguousarray(val.images.transpose(0, 2, 3, 1))
        self.val_y = val.masks
        self.batches = global_batches(config.train_size, config.steps, config.global_batch, config.seed)
        weight = np.ones(NUM_CLASSES, np.float32)
        weight[0] = config.background_weight
        self.class_weight = weight


def in_chunks(classes, images: np.ndarray, chunk: int = 64) -> np.ndarray:
    """``classes(batch)`` (predicted classes of one batch, any array type) over ``images``
    ``chunk`` at a time, concatenated as one NumPy array: the validation set need not fit
    one call's memory."""
    return np.concatenate([np.asarray(classes(images[i : i + chunk])) for i in range(0, len(images), chunk)])


def train_loop(position: int, title: str, step_fn, predict, params, buffers, config,
               data: ChannelsLastData, progress: bool) -> RunRecord:
    """One run of a single-process demo (Keras, Flax): ``step_fn(step, x, y)`` trains on
    one global batch and returns its loss as a float; ``predict(images)`` gives the
    classes (N, H, W) in inference mode; ``params()`` and ``buffers()`` the current
    trainable parameters and running statistics as ``{name: float32 array}``. The run
    is evaluated at ``config.eval_steps()``."""
    record = RunRecord(title)
    eval_steps = set(config.eval_steps())
    bar = progress_bar(config.steps, position, title, progress)

    def evaluate(step: int) -> None:
        confusion = confusion_counts(data.val_y, predict(data.val_x))
        record.miou[step] = float(np.nanmean(class_iou(confusion)))
        record.snapshots[step] = params()

    start = time.perf_counter()
    if 0 in eval_steps:
        evaluate(0)
    for step in range(1, config.steps + 1):
        index = data.batches[step - 1]
        record.losses.append(step_fn(step, data.train_x[index], data.train_y[index]))
        if step in eval_steps:
            evaluate(step)
        bar.set_postfix_str(bar_text(record), refresh=False)
        bar.update(1)
    record.seconds = time.perf_counter() - start
    bar.close()
    confusion = confusion_counts(data.val_y, predict(data.val_x))
    record.class_iou = [float(v) for v in class_iou(confusion)]
    record.buffers = buffers()
    record.predictions = predict(data.val_x[: config.samples]).astype(np.uint8)
    if not progress:
        print(run_done_line(position, record, config.steps), flush=True)
    return record


# ----------------------------------------------------------------------------- report


def summarize(config, setup: str, launcher: str, records: Dict[str, RunRecord], samples: dict,
              meta: dict) -> dict:
    """The report of the three runs (a plain dict; see :func:`write_report`).

    ``config``: the demo's dataclass config; ``setup``: one line saying how the runs
    were distributed (the table's heading); ``samples``: ``images`` (n, 1, S, S) and
    ``truth`` (n, S, S) numpy arrays; ``meta``: framework-specific entries (versions,
    model, loss, optimizer) merged into the report.
    """
    ref = records["big_batch"]
    final = config.steps
    runs = {}
    for name in RUNS:
        rec = records[name]
        entry = {
            "title": rec.title,
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
    report = {
        # the options that repeat this run (every setting spelled out) and when it ended, so a
        # results.json left in --out says which run wrote it
        "command": "syncbn demo " + " ".join(shlex.quote(a) for a in to_argv(config)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "syncbn_version": __version__,
        "launcher": launcher,
        "setup": setup,
        "config": {k: v for k, v in asdict(config).items() if k != "progress"},
        "global_batch": config.global_batch,
    }
    report.update(meta)
    report.update({
        "param_rel_diff_definition": DIFF_DEFINITION,
        "miou_definition": MIOU_DEFINITION,
        "runs": runs,
        "syncbn_vs_big_batch": sync_diff,
        "per_rank_bn_vs_big_batch": per_rank_diff,
        "bar": DIFF_BAR,
        "separation_bar": SEPARATION_BAR,
        "syncbn_matches_big_batch": bool(sync_diff < DIFF_BAR),
        # with one rank, per-rank BN normalizes the whole global batch, as the big batch does:
        # its distance is rounding like syncbn's, and no separation can exist (None: null)
        "per_rank_bn_further_away": (bool(per_rank_diff >= SEPARATION_BAR * sync_diff)
                                     if config.world_size > 1 else None),
        "_samples": {"images": samples["images"], "truth": samples["truth"],
                     "predictions": {name: records[name].predictions for name in RUNS}},
    })
    return report


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
        json.dump(_json_safe(report), fh, indent=2, allow_nan=False, default=_json_default)
        fh.write("\n")
    _plot_curves(report, paths["curves"])
    _plot_samples(report, samples, paths["samples"])
    print(format_table(report), flush=True)


def _json_safe(value):
    """``value`` with every float that is not finite as None (``null`` in JSON): a class
    absent from a small validation set has a NaN IoU, a diverged run a NaN loss and an
    infinite distance to the big batch, and strict JSON has no word for either."""
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _json_default(value):
    if isinstance(value, np.integer):  # numpy floats were made Python floats by _json_safe
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def format_table(report: dict) -> str:
    cfg = report["config"]
    runs = report["runs"]
    width = max(28, 2 + max(len(r["title"]) for r in runs.values()) + 2)
    head = f"{'run':<{width}}{'final loss':>12}{'val mIoU':>10}{'param diff vs big batch':>26}{'time':>9}"
    lines = [
        "",
        f"syncbn demo: {report['setup']}, {report['model']['batchnorm_layers']} BatchNorm layers",
        "",
        head,
        "-" * len(head),
    ]
    for i, name in enumerate(RUNS, 1):
        r = runs[name]
        diff = f"{r['param_rel_diff_vs_big_batch']:.2e}" if name != "big_batch" else "(reference)"
        lines.append(f"{i} {r['title']:<{width - 2}}{r['final_loss']:>12.6f}{r['final_val_miou']:>10.4f}"
                     f"{diff:>26}{r['seconds']:>8.1f}s")
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
    first = runs["per_rank_bn"]["title"].split(",")[0].replace(" under DDP", "")  # "per-rank BN"
    if report["per_rank_bn_further_away"] is None:  # one rank: nothing to separate
        unit = first.split("-")[-1].split()[0]  # "rank", "replica", "device"
        verdict += (f"; with one {unit}, {first} normalizes the whole global batch too ({per_rank:.1e} away), "
                    f"so the runs cannot separate: the {report['separation_bar']:.0f}x bar needs 2 or more "
                    f"{unit}s (--world-size)")
    elif sync > 0:
        verdict += f"; {first} is {per_rank / sync:.0f}x further away ({per_rank:.1e})"
    else:
        verdict += f"; {first} is {per_rank:.1e} away"
    if report["per_rank_bn_further_away"] is False:
        verdict += f", WARNING: less than the {report['separation_bar']:.0f}x bar"
    lines.append(verdict + ".")
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
    fig.suptitle(f"syncbn demo: {report['setup']}; digits segmentation {cfg['image_size']}x{cfg['image_size']}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _class_colormap():
    from matplotlib.colors import ListedColormap

    plt = _pyplot()
    colors = [(0.0, 0.0, 0.0, 1.0)] + [plt.get_cmap("tab10")(i) for i in range(10)]
    return ListedColormap(colors), colors


def _column_title(title: str) -> str:
    """A run's title on two lines, broken at its first ', ' or ' under '."""
    for sep in (", ", " under "):
        head, found, tail = title.partition(sep)
        if found:
            return head + ("," if sep == ", " else "") + "\n" + (tail if sep == ", " else "under " + tail)
    return title


def _plot_samples(report: dict, samples: dict, path: str) -> None:
    from matplotlib.patches import Patch

    plt = _pyplot()
    cmap, colors = _class_colormap()
    images, truth = samples["images"], samples["truth"]
    columns = [("input", None), ("truth", truth)] + [
        (_column_title(report["runs"][name]["title"]), samples["predictions"][name]) for name in RUNS
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
