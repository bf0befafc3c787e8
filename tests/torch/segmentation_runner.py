"""Run examples/segmentation.py with torchvision made importable beside a CPU-only torch.

The example itself needs nothing but a working torchvision; this wrapper (used by
tests/test_segmentation_example.py under torchrun) installs tests/torchvision_shim.py
first, then runs the example as ``__main__`` with the remaining arguments, then checks that
the process group the example destroyed was really freed (``doc_blocks.exit_unless_group_freed``).
"""

import pathlib
import runpy
import sys

import torchvision_shim

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "segmentation.py"

if __name__ == "__main__":
    torchvision_shim.install()
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    left_by_example = runpy.run_path(str(EXAMPLE), run_name="__main__")
    import doc_blocks

    doc_blocks.exit_unless_group_freed("examples/segmentation.py")
