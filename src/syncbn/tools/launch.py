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
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["WorkerPool", "WorkerError", "FAILURE_GRACE_S", "MAX_TIMEOUT_S", "free_port", "launched_by_torchrun"]

# Once a rank of a job has failed, how long (seconds) the pool waits for the next answer
# before it takes the ranks that have not answered as stuck on the failed one(s). Ranks that
# fail alike (an error every rank raises after the same collective) answer within
# scheduling jitter of each other, milliseconds, at most about a second with 4 ranks on 2
# busy cores; 10 s leaves a wide margin for a rank that is slow but honest, and still ends
# a one-rank failure long before a process group's timeout (60 s to 10 minutes).
FAILURE_GRACE_S = 10.0

# The longest process-group timeout (seconds) the command-line tools accept. torch holds
# the timeout as int64 nanoseconds and adds it to clock readings: past 2**63 ns (about
# 9.2e9 s) less the clock reading, a deadline overflows, and the ranks hang, fail to
# connect or die in an OverflowError (seen with 9e9, 1e10 and 1e300). 1e9 s (about 31
# years) is far below that and far beyond any wait a run needs.
MAX_TIMEOUT_S = 1e9


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_by_torchrun() -> bool:
    """True when the environment names this process's place in a job (torchrun sets these)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class WorkerError(RuntimeError):
    """A job raised on one or more ranks.

    ``errors`` maps rank to (exception, traceback text), in the order the ranks answered.
    ``stuck``: the ranks that had not answered when the pool gave up on them, taken as
    waiting on the failed ranks (their entry in ``errors`` is a ``TimeoutError`` saying so);
    the pool was then shut down. The message shows the failed ranks' tracebacks first.
    """

    def __init__(self, errors: dict, stuck=()):
        self.errors = errors
        self.stuck = sorted(stuck)
        failed = sorted(rank for rank in errors if rank not in self.stuck)
        head = f"job failed on rank(s) {failed}"
        if self.stuck:
            head += f"; rank(s) {self.stuck} waiting on the failed rank(s)"
        lines = [head + ":"]
        for rank in failed:
            lines.append(f"--- rank {rank} ---\n{errors[rank][1]}")
        for rank in self.stuck:
            lines.append(f"--- rank {rank} (waiting on the failed rank(s)) ---\n{errors[rank][1]}")
        super().__init__("\n".join(lines))


def failure_report(errors: dict, stuck: Sequence[int] = ()) -> str:
    """What to show when ranks raised: the traceback of the rank that failed first.

    ``errors`` (rank -> (exception, traceback text), from
    :class:`WorkerError`) is in the order the failures arrived;
    ``stuck``: the ranks the pool stopped because they were still waiting, most likely in
    a collective, on the failed ones. Their timeouts, like the errors of ranks that failed
    later because a peer was gone, say nothing of the cause."""
    first = next(rank for rank in errors if rank not in stuck)
    later = sorted(rank for rank in errors if rank != first and rank not in stuck)
    head = f"FAIL: the distributed run failed on rank {first}"
    if later:
        head += f" first; rank(s) {later} failed after it"
    if stuck:
        head += f"; rank(s) {sorted(stuck)} were still waiting on the failed rank(s) and were stopped"
    if later or stuck:
        head += f". Rank {first}'s error"
    return f"{head}:\n{errors[first][1]}"


def _end_with_parent() -> None:
    """End this worker as soon as the process that started it is gone.

    A parent killed outright (SIGKILL, the OOM killer, or SIGTERM's default action, which
    is what ``kill``, ``timeout`` and a cancelled CI job send) runs no cleanup, and a
    worker waits for its next job forever: its task queue holds a write end of its own.
    A daemon thread waits on multiprocessing's parent sentinel (a pipe whose other end
    only the parent holds, readable once the parent has exited) and then exits at once."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="syncbn-parent-watch", daemon=True).start()


def _worker_main(rank, world_size, port, backend, timeout_s, threads, tasks, results):
    # Ctrl-C reaches every process of the terminal's foreground group: the process holding
    # the pool handles it and stops the workers; a worker's own KeyboardInterrupt only
    # printed its traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401 - before the group exists, so that it can be freed
    # (imported after init_process_group it would hold the group for good: docs/torch.md,
    # "Ending a job"; the jobs import syncbn.torch, and with it this module, later)

    torch.set_num_threads(threads)
    # Start the rendezvous only once every rank has imported: ``timeout_s`` is the process
    # group's, and the first rank in would otherwise wait that long for the slowest one's
    # imports (seconds on a loaded machine) and give up before any job ran.
    results.put(pickle.dumps((rank, "imported", None)))
    if tasks.get() is None:
        return
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
    ``timeout`` is also the process group's timeout: the longest a collective waits.
    ``start_timeout`` bounds the start: every rank's imports, then the rendezvous, which
    begins only once all ranks have imported (so a slow import never counts against
    ``timeout``).

    A rank that raises while the others are inside a collective leaves them waiting for
    it. So once a rank has failed, ranks that do not answer within ``failure_grace``
    seconds of the last answer are taken as stuck on the failed one(s): the pool is shut
    down and :class:`WorkerError` names the failed ranks (their tracebacks first) and the
    stuck ones (``WorkerError.stuck``). A job that fails on every rank within the grace
    comes back with every rank's own error, and the pool stays up. A pool that was shut
    down is not ``alive``; start a new one to go on. The workers end by themselves,
    within a moment, when the process that started them is gone, even killed outright.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: float = 120.0,
        threads: int = 1,
        start_timeout: float = 120.0,
        failure_grace: float = FAILURE_GRACE_S,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not failure_grace > 0:
            raise ValueError(f"failure_grace must be a positive number of seconds, got {failure_grace}")
        self.world_size = world_size
        self.timeout = timeout
        self.failure_grace = failure_grace
        self._busy = False  # a job was handed out and not every rank has answered it
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
        started = time.monotonic()
        self._collect("imported", start_timeout)
        for tasks in self._tasks:
            tasks.put("join")
        self._collect("ready", max(start_timeout - (time.monotonic() - started), 1.0))

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(proc.is_alive() for proc in self._procs)

    def _collect(self, what: str, timeout: float) -> List[Any]:
        values: List[Any] = [None] * self.world_size
        errors = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        last_answer = time.monotonic()  # once a rank failed, the others have failure_grace from here

        def take(reply) -> None:
            nonlocal last_answer
            rank, status, value = pickle.loads(reply)
            pending.discard(rank)
            if status == "error":
                errors[rank] = value
            else:
                values[rank] = value
            last_answer = time.monotonic()

        while pending:
            now = time.monotonic()
            wait = deadline - now
            if errors:
                wait = min(wait, last_answer + self.failure_grace - now)
            try:
                take(self._results.get(timeout=min(max(wait, 0.01), 1.0)))
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            dead = sorted(r for r in pending if not self._procs[r].is_alive())
            expired = now >= deadline
            given_up = bool(errors) and now >= last_answer + self.failure_grace
            if not (dead or expired or given_up):
                continue
            try:  # an answer that came in meanwhile is the rank's own, not a hang
                take(self._results.get_nowait())
                continue
            except queue.Empty:
                pass
            self.close(force=True)
            if dead or expired:
                reason = f"worker(s) {dead} died" if dead else f"no answer in {timeout:.0f} s"
                message = f"{what}: {reason} from rank(s) {sorted(pending)}; pool shut down"
            else:
                message = (
                    f"{what}: rank(s) {sorted(errors)} failed and no answer came for {self.failure_grace:g} s: "
                    f"rank(s) {sorted(pending)} taken as waiting on the failed rank(s); pool shut down"
                )
            if errors:  # the ranks still waiting were most likely stuck on the failed ones
                for rank in sorted(pending):
                    errors[rank] = (TimeoutError(message), message)
                raise WorkerError(errors, stuck=() if dead else pending)
            raise TimeoutError(message)
        self._busy = False
        if errors:
            raise WorkerError(errors)
        return values

    def run_each(self, fn: Callable, per_rank_args, timeout: Optional[float] = None) -> List[Any]:
        """Run ``fn(*per_rank_args[r])`` on rank r, for every rank; results in rank order."""
        if not self.alive:
            raise RuntimeError("the worker pool is closed")
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"expected {self.world_size} argument tuples, got {len(per_rank_args)}")
        self._busy = True
        for rank, args in enumerate(per_rank_args):
            self._tasks[rank].put((fn, tuple(args), {}))
        return self._collect(getattr(fn, "__name__", "job"), timeout or self.timeout)

    def run(self, fn: Callable, *args, timeout: Optional[float] = None) -> List[Any]:
        """Run ``fn(*args)`` on every rank; results in rank order."""
        return self.run_each(fn, [args] * self.world_size, timeout=timeout)

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely, or at once with ``force``). Workers still in a job
        (the caller left :meth:`run` by an exception, Ctrl-C's ``KeyboardInterrupt`` say)
        are stopped at once too: they would read the request to stop only once the job
        is done."""
        if not force and not self._busy:
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
