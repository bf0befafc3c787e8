"""A gloo worker pool whose processes run Triton's kernels in its interpreter
(``TRITON_INTERPRET=1`` in their environment, read when Triton is first imported), for the
tests of the kernels on CPU tensors. This process's environment is left as it was."""

import os

from syncbn.tools.launch import WorkerPool


def interpreting_pool(size: int, timeout: int = 120) -> WorkerPool:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return WorkerPool(size, backend="gloo", timeout=timeout)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
