"""A gloo worker pool whose processes run Triton's kernels in its interpreter
(``TRITON_INTERPRET=1`` in their environment, read when Triton is first imported), for the
tests of the kernels on CPU tensors. This process's environment is left as it was.

A job that fails on one rank while the others wait for it shuts a pool down; this one
then starts anew for the next job, so a module's later tests still run."""

import os

from syncbn.tools.launch import WorkerPool


def _start(size: int, timeout: float) -> WorkerPool:
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return WorkerPool(size, backend="gloo", timeout=timeout)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


class InterpretingPool:
    """``run`` and ``run_each`` as :class:`WorkerPool`'s, on a pool restarted when the last
    one was shut down."""

    def __init__(self, size: int, timeout: float):
        self.world_size = size
        self.timeout = timeout
        self.pool = _start(size, timeout)

    def _live(self) -> WorkerPool:
        if not self.pool.alive:
            self.pool = _start(self.world_size, self.timeout)
        return self.pool

    def run(self, fn, *args, **kwargs):
        return self._live().run(fn, *args, **kwargs)

    def run_each(self, fn, per_rank_args, **kwargs):
        return self._live().run_each(fn, per_rank_args, **kwargs)

    def close(self) -> None:
        self.pool.close()


def interpreting_pool(size: int, timeout: int = 120) -> InterpretingPool:
    return InterpretingPool(size, timeout)
