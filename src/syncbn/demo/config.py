"""The settings of ``syncbn demo``, shared by every framework's runs: :class:`DemoConfig`,
what ``--quick`` changes, and the translation between options and settings.

Imports no framework, so every runner (and a re-started process) can read it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import List, Optional

__all__ = ["DemoConfig", "QUICK", "FRAMEWORKS", "check", "config_from_args", "to_argv"]

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
    problem = _unwritable(config.out)
    if problem:
        raise SystemExit(f"syncbn demo: --out {config.out}: {problem}; the report is written there after "
                         "training, so give a folder that can be created and written")


def _unwritable(out: str) -> Optional[str]:
    """Why the folder ``out`` could not be created or written, or None. Leaves nothing
    behind: it makes and removes an empty folder in ``out``, or in the nearest existing
    folder above it (where ``os.makedirs`` will start), a real try where permission bits
    say nothing (root, /proc, a read-only mount)."""
    import os
    import tempfile

    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".syncbn-demo-", dir=parent))
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    return None
