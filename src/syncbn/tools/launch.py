"""Local multi-process launching: a pool of W worker processes joined in one
``torch.distributed`` process group, started once and reused for many jobs.

Used by the tests (spawn the CPU gloo workers once, run many checks on them), by
``syncbn demo``, ``syncbn bench`` and ``syncbn verify``. Under ``torchrun`` the demo
and the other tools use the processes they were given instead (see
:func:`launched_by_torchrun`).

Traffic only goes to 127.0.0.1.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable, List, Optional

__all__ = ["WorkerPool", "WorkerError", "free_port", "launched_by_torchrun"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_by_torchrun() -> bool:
    """True when the environment names this process's place in a job (torchrun sets these)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class WorkerError(RuntimeError):
    """A job raised on one or more ranks; ``errors`` maps rank to (exception, traceback text)."""

    def __init__(self, errors: dict):
        self.errors = errors
        lines = [f"job failed on rank(s) {sorted(errors)}:"]
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} ---\n{errors[rank][1]}")
        super().__init__("\n".join(lines))


def _worker_main(rank, world_size, port, backend, timeout_s, threads, tasks, results):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401 - before the group exists, so that it can be freed
    # (imported after init_process_group it would hold the group for good: docs/torch.md,
    # "Ending a job"; the jobs import syncbn.torch, and with it this module, later)

    torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results.put(pickle.dumps((rank, "ready", None)))
    while True:
        job = tasks.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            # pickle here, not in the queue's feeder thread, so a value that cannot
            # travel is reported as this job's error instead of never arriving
            reply = pickle.dumps((rank, "ok", fn(*args, **kwargs)))
        except BaseException as exc:  # report everything, keep serving
            text = traceback.format_exc()
            try:
                reply = pickle.dumps((rank, "error", (exc, text)))
            except Exception:  # the exception itself would not pickle
                reply = pickle.dumps((rank, "error", (RuntimeError(str(exc)), text)))
        results.put(reply)
    dist.destroy_process_group()


class WorkerPool:
    """W processes on this machine, ranks 0..W-1 of one process group, kept alive.

    ``pool.run(fn, *args)`` runs ``fn(*args)`` on every rank at once (``fn`` must be
    importable: a module-level function) and returns the W results in rank order.
    ``pool.run_each(fn, [args_rank0, args_rank1, ...])`` gives each rank its own
    arguments. A job that raises on any rank raises :class:`WorkerError` here with each
    failing rank's traceback; a job that does not finish in ``timeout`` seconds shuts
    the pool down and raises ``TimeoutError``, so a hang can never block the caller.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 120.0,
        threads: int = 1,
        start_timeout: float = 120.0,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, backend, timeout, threads, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect("ready", start_timeout)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def _collect(self, what: str, timeout: float) -> List[Any]:
        values: List[Any] = [None] * self.world_size
        errors = {}
        pending = set(range(self.world_size))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while pending:
            left = (deadline - datetime.datetime.now()).total_seconds()
            try:
                reply = self._results.get(timeout=max(min(left, 1.0), 0.01))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead or left <= 0:
                    self.close(force=True)
                    reason = f"worker(s) {dead} died" if dead else f"no answer in {timeout:.0f} s"
                    message = f"{what}: {reason} from rank(s) {sorted(pending)}; pool shut down"
                    if errors:  # the ranks still waiting were most likely stuck on the failed ones
                        for rank in pending:
                            errors[rank] = (TimeoutError(message), message)
                        raise WorkerError(errors)
                    raise TimeoutError(message)
                continue
            rank, status, value = pickle.loads(reply)
            pending.discard(rank)
            if status == "error":
                errors[rank] = value
            else:
                values[rank] = value
        if errors:
            raise WorkerError(errors)
        return values

    def run_each(self, fn: Callable, per_rank_args, timeout: Optional[float] = None) -> List[Any]:
        """Run ``fn(*per_rank_args[r])`` on rank r, for every rank; results in rank order."""
        if not self.alive:
            raise RuntimeError("the worker pool is closed")
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"expected {self.world_size} argument tuples, got {len(per_rank_args)}")
        for rank, args in enumerate(per_rank_args):
            self._tasks[rank].put((fn, tuple(args), {}))
        return self._collect(getattr(fn, "__name__", "job"), timeout or self.timeout)

    def run(self, fn: Callable, *args, timeout: Optional[float] = None) -> List[Any]:
        """Run ``fn(*args)`` on every rank; results in rank order."""
        return self.run_each(fn, [args] * self.world_size, timeout=timeout)

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely, or at once with ``force``)."""
        if not force:
            for tasks, proc in zip(self._tasks, self._procs):
                if proc.is_alive():
                    tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
