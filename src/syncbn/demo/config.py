"""The settings of ``syncbn demo``, shared by every framework's runs: :class:`DemoConfig`,
what ``--quick`` changes, and the translation between options and settings.

Imports no framework, so every runner (and a re-started process) can read it. A setting
no run can take raises :class:`~syncbn.tools.usage.UsageError`, which ``syncbn demo``
reports in one line with exit status 2, as the other subcommands do.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import List, Optional

from ..tools.output import unusable_output
from ..tools.usage import UsageError

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
            raise UsageError(f"--backend {args.backend} is a Keras backend; with "
                             f"--framework torch use one of {', '.join(TORCH_BACKENDS)}")
    elif config.framework == "flax":
        if args.backend not in (None, "jax"):
            raise UsageError(f"--framework flax runs on JAX; --backend {args.backend} does not apply")
        config.backend = "jax"
        if args.device is None:
            config.device = "auto"
    else:
        if args.backend is None:
            config.backend = "tensorflow"
        elif args.backend not in KERAS_BACKENDS:
            raise UsageError(f"--backend {args.backend} is a torch.distributed backend; "
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
    """Refuse settings no framework can run, before anything is started
    (:class:`~syncbn.tools.usage.UsageError`). What depends on the machine (a CUDA
    device, enough devices for the replicas) is checked by each framework's runner."""
    import math

    if config.image_size < 16 or config.image_size % 8:
        raise UsageError(f"--image-size must be a multiple of 8, at least 16, got {config.image_size}")
    if not 0.0 < config.lr < math.inf:  # false for NaN too
        raise UsageError(f"--lr must be a finite positive number, got {config.lr}")
    if not 0.0 < config.background_weight < math.inf:
        raise UsageError(f"--background-weight must be a finite positive number, got {config.background_weight}")
    if not 0 <= config.seed < 2**64:  # what numpy's and torch's generators take
        raise UsageError(f"--seed must be an integer from 0 to 2**64 - 1, got {config.seed}")
    if config.framework == "torch" and config.backend == "nccl" and config.device != "cuda":
        raise UsageError("--backend nccl needs --device cuda")
    problem = unusable_output(config.out)
    if problem:
        raise UsageError(problem)
