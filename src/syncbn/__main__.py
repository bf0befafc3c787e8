"""``python -m syncbn``: the ``syncbn`` command line (see :mod:`syncbn.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":  # spawned worker processes import this module too
    sys.exit(main())
