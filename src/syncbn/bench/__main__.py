"""``python -m syncbn.bench``: the same as ``syncbn bench``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
