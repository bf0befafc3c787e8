"""``syncbn demo``: small-batch segmentation trained three ways, to show that
synchronized BatchNorm across W devices of b images each *is* one batch of W x b.

This module is the command line; the settings, shared by the frameworks, are in
:mod:`syncbn.demo.config`. It imports no framework. The runs live in :mod:`syncbn.demo.torch` (PyTorch, the
default: DDP over gloo/NCCL processes), :mod:`syncbn.demo.keras` (Keras:
``tf.distribute.MirroredStrategy`` or, with ``--backend jax``,
``keras.distribution.DataParallel``) and :mod:`syncbn.demo.flax` (Flax linen under
``jax.pmap``), the table and files in
:mod:`syncbn.demo.report`.
"""

from __future__ import annotations

import argparse
import sys

from ..tools.usage import UsageError, packages_missing, positive_int
from .config import FRAMEWORKS, KERAS_BACKENDS, QUICK, TORCH_BACKENDS, DemoConfig, check, config_from_args, to_argv

__all__ = ["DemoConfig", "QUICK", "HELP", "add_arguments", "config_from_args", "run", "to_argv"]

HELP = "train a small segmentation net three ways (per-rank BN, syncbn, one big batch) and compare"

DESCRIPTION = """\
Small-batch semantic segmentation on digit canvases built from scikit-learn's bundled
digits (nothing is downloaded), trained three ways from the same initial weights and
the same global data order:

  1. per-rank BatchNorm        (each rank / replica normalizes with its own batch)
  2. syncbn                    (one extra line: the model converted)
  3. one process, one big batch (the W batches concatenated in rank order)

Runs 2 and 3 should end with the same parameters up to float32 rounding; run 1 drifts
away. The command prints a table and writes results.json, curves.png (training loss,
validation mIoU and distance to the big batch over the steps) and samples.png
(validation images, true masks and each run's predicted masks) to --out.

--framework torch (the default): DDP over --world-size local worker processes (gloo on
127.0.0.1, CPU), or over the processes torchrun started (nothing is spawned):

  torchrun --standalone --nproc-per-node 2 -m syncbn demo --quick
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint HOST:29500 -m syncbn demo --backend nccl --device cuda

--framework keras: the same network written in Keras, in one process, with
syncbn.keras.convert(model):
  --backend tensorflow (default)  tf.distribute.MirroredStrategy over W replicas: the
                                  local GPUs when there are at least W (or with --device
                                  cuda), else W logical CPU devices;
  --backend jax                   keras.distribution.DataParallel over W host devices.

--framework flax: the same network written in Flax linen, in one process, under jax.pmap
over W host CPU devices (W GPUs with --device cuda); run 2 is traced inside
with syncbn.flax.convert(axis_name="batch"). Needs JAX and Flax only.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``syncbn demo`` options (every default is that of :class:`DemoConfig`)."""
    d = DemoConfig()
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--framework", choices=FRAMEWORKS, default=None,
        help=f"which framework trains the three runs (default {d.framework})")
    add("--world-size", type=positive_int, default=None, metavar="W",
        help=f"number of ranks (torch: worker processes spawned on this machine; ignored under "
             f"torchrun, where WORLD_SIZE decides), replicas (keras) or devices (flax) (default {d.world_size})")
    add("--batch-per-rank", type=positive_int, default=None, metavar="B",
        help=f"images per rank and step (default {d.batch_per_rank}); the big-batch run gets W x B")
    add("--steps", type=positive_int, default=None,
        help=f"optimizer steps of each run (default {d.steps}; --quick: {QUICK['steps']})")
    add("--lr", type=float, default=None,
        help=f"peak SGD learning rate, cosine-decayed to 0 over the steps (default {d.lr}; "
             f"momentum {d.momentum}, no weight decay)")
    add("--background-weight", type=float, default=None, metavar="W",
        help=f"weight of background pixels in the cross-entropy, digits weigh 1 (default {d.background_weight})")
    add("--image-size", type=int, default=None, metavar="S",
        help=f"side of the square canvases in pixels, a multiple of 8, at least 16 (default {d.image_size})")
    add("--width", type=positive_int, default=None,
        help=f"channels of the network's first stage, doubled at each level (default {d.width})")
    add("--train-size", type=positive_int, default=None, metavar="N",
        help=f"training canvases (default {d.train_size}; --quick: {QUICK['train_size']})")
    add("--val-size", type=positive_int, default=None, metavar="N",
        help=f"validation canvases for the mIoU (default {d.val_size}; --quick: {QUICK['val_size']})")
    add("--eval-every", type=positive_int, default=None, metavar="K",
        help=f"evaluate and compare the runs every K steps (default {d.eval_every}; "
             f"--quick: {QUICK['eval_every']})")
    add("--backend", choices=TORCH_BACKENDS + KERAS_BACKENDS, default=None,
        help="torch: the torch.distributed backend, gloo or nccl (default: nccl with --device cuda, "
             "else gloo); keras: the Keras backend, tensorflow or jax (default tensorflow); flax: jax only")
    add("--device", choices=("cpu", "cuda"), default=None,
        help="torch: where each rank trains (default cpu); with cuda each rank uses cuda:LOCAL_RANK "
             "under torchrun, cuda:RANK when spawned (gloo may share GPUs: cuda:RANK %% GPUs). "
             "keras: cpu (W logical CPU devices) or cuda (W local GPUs); default: the GPUs when "
             "TensorFlow sees at least W, else cpu. flax: cpu (W host devices, the default) or cuda (W GPUs)")
    add("--out", default=None, metavar="DIR",
        help=f"output folder for results.json, curves.png, samples.png (default {d.out})")
    add("--seed", type=int, default=None,
        help=f"seed of the initial weights, the dataset and the data order (default {d.seed})")
    add("--quick", action="store_true",
        help="a short run for tests and a first look: "
             + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="show a progress bar per run (default: only when stderr is a terminal)")


def _needed_packages(config: DemoConfig) -> list:
    """The top-level modules the demo's runs import for ``config``: the framework (Keras
    with its backend's package), then scikit-learn (the digits), matplotlib (the plots)
    and tqdm (the progress bars)."""
    framework = {"torch": ["torch"], "flax": ["jax", "flax"],
                 "keras": ["keras", "jax" if config.backend == "jax" else "tensorflow"]}[config.framework]
    return framework + ["sklearn", "matplotlib", "tqdm"]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``syncbn demo``: the chosen framework's runs, then the report.

    A setting no run can take ends here, before any framework is imported, with one
    line on stderr and exit status 2 (a usage error, as in ``syncbn verify``, ``bench``
    and ``soak``); so does a package the runs need that is not installed. What this
    machine lacks for the settings (no CUDA device, fewer devices than replicas) ends
    the framework's run with exit status 1: the same command line is right on another
    machine."""
    try:
        config = config_from_args(args)
        check(config)
    except UsageError as exc:
        print(f"syncbn demo: {exc}", file=sys.stderr)
        return 2
    if packages_missing("demo", _needed_packages(config)):
        return 2
    if config.framework == "flax":
        from . import flax as demo_flax

        return demo_flax.run(config)
    if config.framework == "keras":
        from . import keras as demo_keras

        return demo_keras.run(config)
    from . import torch as demo_torch

    return demo_torch.run(config, args)
