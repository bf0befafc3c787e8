"""How a command-line tool refuses to start: the same words and exit status for every
``syncbn`` subcommand.

- :class:`UsageError`: the command line cannot be carried out as given (an option's
  value, two options that do not go together, a model path that does not import). The
  subcommand's ``run`` catches it and prints one line, ``syncbn COMMAND: <what is wrong>``,
  on stderr, with exit status 2, as ``argparse`` does for the errors it finds itself.
- :func:`torch_missing`: a PyTorch-only subcommand run where PyTorch is not installed
  says so in one line, before it starts anything.
- :func:`packages_missing`: the same for the packages a run needs (``syncbn demo``:
  its framework, scikit-learn, matplotlib, tqdm), found without importing them.
- :func:`positive_int`: the ``argparse`` type of a count option (sizes, steps, repeats).
- :func:`positive_float`: the ``argparse`` type of an option that must be a finite
  number above 0 (seconds, learning rates, weights).

Imports no framework (``syncbn demo --framework keras`` and ``flax`` use it without torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from typing import Sequence

__all__ = ["UsageError", "packages_missing", "positive_float", "positive_int", "torch_missing"]

# the import name -> the name pip installs it by, where they differ
_PIP_NAMES = {"sklearn": "scikit-learn"}


class UsageError(ValueError):
    """A bad factory path, input shape or option (exit status 2)."""


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of 1 or more (argparse names the option and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An ``argparse`` type: a finite number above 0; 0, negative numbers, NaN and
    infinity are refused (argparse names the option and exits 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}") from None
    if not 0.0 < value < math.inf:  # false for NaN too
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text}")
    return value


def torch_missing(command: str) -> bool:
    """Whether PyTorch cannot be imported; if so, says on stderr that ``syncbn COMMAND``
    needs it and how to install it (the caller then exits with status 2)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        print(f"syncbn {command}: needs PyTorch ({exc}); install it, e.g. pip install \"syncbn[torch]\"",
              file=sys.stderr)
        return True
    return False


def packages_missing(command: str, modules: Sequence[str]) -> bool:
    """Whether any of the top-level ``modules`` is not installed; if so, says on stderr
    in one line which ``syncbn COMMAND`` needs and the ``pip install`` that adds them
    (the caller then exits with status 2, as for :func:`torch_missing`). The modules are
    looked up, not imported: importing Keras before its backend is chosen would fix it."""
    absent = [_PIP_NAMES.get(name, name) for name in modules if importlib.util.find_spec(name) is None]
    if absent:
        print(f"syncbn {command}: needs {', '.join(absent)}, not installed; install "
              f"{'it' if len(absent) == 1 else 'them'}, e.g. pip install {' '.join(absent)}", file=sys.stderr)
        return True
    return False
