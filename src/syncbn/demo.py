"""``syncbn demo``: small-batch segmentation trained three ways, to show that
synchronized BatchNorm across W devices of b images each *is* one batch of W x b.

This module is the command line and the settings, shared by the frameworks; it
imports none of them. The runs live in :mod:`syncbn.demo_torch` (PyTorch, the
default: DDP over gloo/NCCL processes), :mod:`syncbn.demo_keras` (Keras:
``tf.distribute.MirroredStrategy`` or, with ``--backend jax``,
``keras.distribution.DataParallel``) and :mod:`syncbn.demo_flax` (Flax linen under
``jax.pmap``), the table and files in
:mod:`syncbn.demo_report`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import List, Optional

__all__ = ["DemoConfig", "QUICK", "add_arguments", "config_from_args", "run"]

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

FRAMEWORKS = ("torch", "keras", "flax")
TORCH_BACKENDS = ("gloo", "nccl")
KERAS_BACKENDS = ("tensorflow", "jax")


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
    framework: str = "torch"
    backend: str = "gloo"
    device: str = "cpu"  # torch: cpu or cuda; keras: cpu, cuda or auto
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

# Options whose value goes straight into the DemoConfig field of the same name.
_FIELDS = (
    "world_size", "batch_per_rank", "steps", "lr", "background_weight", "image_size", "width",
    "train_size", "val_size", "eval_every", "framework", "backend", "device", "out", "seed", "progress",
)


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
    add("--framework", choices=FRAMEWORKS, default=None,
        help=f"which framework trains the three runs (default {d.framework})")
    add("--world-size", type=_positive, default=None, metavar="W",
        help=f"number of ranks (torch: worker processes spawned on this machine; ignored under "
             f"torchrun, where WORLD_SIZE decides), replicas (keras) or devices (flax) (default {d.world_size})")
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


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Defaults, then --quick's settings, then the options given explicitly."""
    config = DemoConfig()
    if args.quick:
        config = replace(config, quick=True, **QUICK)
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    config = replace(config, **given)
    if config.framework == "torch":
        if args.backend is None:
            config.backend = "nccl" if config.device == "cuda" else "gloo"
        elif args.backend not in TORCH_BACKENDS:
            raise SystemExit(f"syncbn demo: --backend {args.backend} is a Keras backend; with "
                             f"--framework torch use one of {', '.join(TORCH_BACKENDS)}")
    elif config.framework == "flax":
        if args.backend not in (None, "jax"):
            raise SystemExit(f"syncbn demo: --framework flax runs on JAX; --backend {args.backend} does not apply")
        config.backend = "jax"
        if args.device is None:
            config.device = "auto"
    else:
        if args.backend is None:
            config.backend = "tensorflow"
        elif args.backend not in KERAS_BACKENDS:
            raise SystemExit(f"syncbn demo: --backend {args.backend} is a torch.distributed backend; "
                             f"with --framework keras use one of {', '.join(KERAS_BACKENDS)}")
        if args.device is None:
            config.device = "auto"
    return config


def to_argv(config: DemoConfig) -> List[str]:
    """Command-line options that give back ``config`` (for a re-started process)."""
    argv = []
    for name in _FIELDS:
        value = getattr(config, name)
        option = "--" + name.replace("_", "-")
        if name == "progress":
            if value is not None:
                argv.append("--progress" if value else "--no-progress")
        elif not (name == "device" and value == "auto"):
            argv += [option, str(value)]
    return argv + (["--quick"] if config.quick else [])


def check(config: DemoConfig) -> None:
    """Refuse settings no framework can run, before anything is started."""
    import math

    if config.image_size < 16 or config.image_size % 8:
        raise SystemExit(f"syncbn demo: --image-size must be a multiple of 8, at least 16, got {config.image_size}")
    if config.lr <= 0 or not math.isfinite(config.lr):
        raise SystemExit(f"syncbn demo: --lr must be positive, got {config.lr}")
    if config.background_weight <= 0 or not math.isfinite(config.background_weight):
        raise SystemExit(f"syncbn demo: --background-weight must be positive, got {config.background_weight}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``syncbn demo``: the chosen framework's runs, then the report."""
    config = config_from_args(args)
    check(config)
    if config.framework == "flax":
        from . import demo_flax

        return demo_flax.run(config)
    if config.framework == "keras":
        from . import demo_keras

        return demo_keras.run(config)
    from . import demo_torch

    return demo_torch.run(config, args)
