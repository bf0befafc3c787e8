"""The output folder of a command-line tool (``--out`` of ``syncbn demo`` and
``syncbn bench``), checked before any work starts, so that a run of minutes does not end
in a traceback from the report writer.

Imports no framework.
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional

__all__ = ["unusable_output"]


def unusable_output(out: str, option: str = "--out") -> Optional[str]:
    """What is wrong with ``out`` as the folder a command writes to, in words that name
    ``option``, or None when it can be created and written.

    Leaves nothing behind: it makes and removes an empty folder in ``out``, or in the
    nearest existing folder above it (where ``os.makedirs`` will start), a real try
    where permission bits say nothing (root, /proc, a read-only mount). An empty ``out``
    is refused too: the check would judge the current folder, where ``os.makedirs``
    (the demo's report writer) fails after the whole run."""
    out = os.fspath(out)
    if not out:
        return f"{option} is empty; give a folder that can be created and written"
    reason = _reason(out)
    if reason is None:
        return None
    return f"{option} {out}: {reason}; give a folder that can be created and written"


def _reason(out: str) -> Optional[str]:
    path = os.path.abspath(out)
    # lexists: a dangling symbolic link is in the way of makedirs too
    if os.path.lexists(path) and not os.path.isdir(path):
        return "exists and is not a folder"
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".syncbn-", dir=parent))
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    return None
