"""The ``syncbn`` command line: a small dispatcher over subcommands.

Each subcommand lives in its own module, which provides

* ``HELP``: one line for ``syncbn --help``,
* ``add_arguments(parser)``: fills in the subcommand's ``argparse`` parser,
* ``run(args) -> int``: does the work and returns the exit status.

Only the module of the subcommand being run is imported (``syncbn --help`` imports
none of them), so a subcommand with heavy dependencies costs nothing to the others.
To add one, add a line to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from typing import Dict, List, Optional, Tuple

from ._version import __version__

__all__ = ["COMMANDS", "build_parser", "main"]

# name -> (module, one-line help); the module's HELP is used once it is imported
COMMANDS: Dict[str, Tuple[str, str]] = {
    "demo": (
        "syncbn.demo",
        "train a small segmentation net three ways (per-rank BN, syncbn, one big batch) and compare",
    ),
    "bench": (
        "syncbn.bench",
        "measure syncbn against torch, Keras and Flax batch norms: speed, communication, memory, numerics",
    ),
    "verify": (
        "syncbn.tools.verify",
        "check that syncbn on W local processes trains your model exactly like one process on the whole batch",
    ),
    "soak": (
        "syncbn.tools.soak",
        "train small converted models for many steps on W local processes and check that memory, fds and threads stay flat",
    ),
}


def _selected(argv: List[str]) -> Optional[str]:
    """The subcommand named on the command line, if any (the first non-option word)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``command``'s module is imported to fill in its options."""
    parser = argparse.ArgumentParser(
        prog="syncbn",
        description="syncbn: exact synchronized batch normalization across processes and devices.",
    )
    parser.add_argument("--version", action="version", version=f"syncbn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if name == command:
            module = import_module(module_name)
            help_text = getattr(module, "HELP", help_text)
            child = sub.add_parser(name, help=help_text)
            module.add_arguments(child)
            child.set_defaults(_run=module.run)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_selected(argv))
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("syncbn: interrupted", file=sys.stderr)
        return 130
