"""How a command-line tool refuses to start: the same words and exit status for every
``syncbn`` subcommand.

- :class:`UsageError`: the command line cannot be carried out as given (an option's
  value, two options that do not go together, a model path that does not import). The
  subcommand's ``run`` catches it and prints one line, ``syncbn COMMAND: <what is wrong>``,
  on stderr, with exit status 2, as ``argparse`` does for the errors it finds itself.
- :func:`torch_missing`: a PyTorch-only subcommand run where PyTorch is not installed
  says so in one line, before it starts anything.

Imports no framework (``syncbn demo --framework keras`` and ``flax`` use it without torch).
"""

from __future__ import annotations

import sys

__all__ = ["UsageError", "torch_missing"]


class UsageError(ValueError):
    """A bad factory path, input shape or option (exit status 2)."""


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
