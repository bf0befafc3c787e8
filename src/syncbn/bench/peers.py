"""Starting a peer: one implementation's measurements in a fresh Python process.

Each peer process gets the plan as a JSON file and writes its results to another; it
runs in its own session (a process group of its own), and that whole group is ended
whenever :func:`run_peer` returns or raises: after a timeout, an exception, Ctrl-C
(``KeyboardInterrupt``) or SIGTERM (made an exception by :func:`sigterm_exits`), so no
peer, and nothing a peer started (its worker pool), outlives the bench. Nothing here
imports a deep-learning framework.

CPU budget: a peer with W replicas gets W x T threads in all, whether it runs W
processes of T threads (torch + gloo) or one process of W replicas (TensorFlow's
MirroredStrategy over logical CPU devices, JAX's pmap over host devices). A
one-process peer is also pinned to ``min(W x T, cores)`` cores (:func:`limit_cpus`),
since JAX has no documented thread-count setting.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["run_peer", "peer_failed", "end_group", "sigterm_exits", "limit_cpus", "cpu_count", "load_average", "ALLOCATOR_ENV"]

# seconds a peer's group gets to end after SIGTERM before it is killed
END_GRACE_S = 3.0

# glibc malloc, left to its defaults, decides from the history of a process whether a
# step's multi-megabyte buffers come from fresh pages (a page fault per 4 KiB, every
# step) or from memory it kept: measured here, the same BatchNorm2d step ran at 5 ms or
# 17 ms in one process depending on what it had allocated before. Every peer process
# gets the same setting instead: buffers up to 32 MiB from the heap, and a heap that is
# never given back, so that steady-state steps fault no pages (what a caching
# allocator gives on a GPU). A value already in the environment is kept.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> Optional[list]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def limit_cpus(count: int) -> Optional[list]:
    """Pin this process (and the threads it starts later) to ``count`` of its cores."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None
    chosen = allowed[: max(1, min(count, len(allowed)))]
    os.sched_setaffinity(0, chosen)
    return chosen


@contextlib.contextmanager
def sigterm_exits():
    """Within the block, SIGTERM raises ``SystemExit(143)`` in this process instead of
    ending it on the spot, so ``finally`` blocks (those that end the peers) run, as they
    do for Ctrl-C's ``KeyboardInterrupt``. Only in the main thread, and only where SIGTERM
    has its default action (a handler someone installed is left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # the group has ended already
        pass


def end_group(proc: subprocess.Popen, grace: float = END_GRACE_S) -> None:
    """End ``proc``, started with ``start_new_session=True``, and every process in its
    group (its workers, and theirs): SIGTERM to the group, up to ``grace`` seconds for
    ``proc`` to exit, then SIGKILL to whatever of the group is left. Run after a normal
    exit too (it ends what the peer left behind). SIGINT and SIGTERM are held back while
    it runs (delivered right after), so a second Ctrl-C cannot cut the cleanup short."""
    held = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held) if hasattr(signal, "pthread_sigmask") else None
    try:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def peer_failed(outcome: dict) -> bool:
    """Whether a peer run (what :func:`run_peer` returned) failed: it timed out, exited
    with an error, or left a result file that could not be read."""
    return outcome["returncode"] != 0 or bool(outcome.get("unreadable"))


def run_peer(module: str, plan: dict, timeout: float, args: Sequence[str] = (), env: Optional[dict] = None,
             log_path: Optional[Path] = None) -> dict:
    """Run ``python -m module --plan P --out R *args``; returns what happened and the
    peer's result (None if it wrote none, or only part of one: ``unreadable`` says so)."""
    with tempfile.TemporaryDirectory(prefix="syncbn-bench-") as tmp:
        plan_path, out_path = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan_path.write_text(json.dumps(plan))
        full_env = dict(os.environ)
        full_env.update(PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                        OMP_NUM_THREADS=str(plan["threads"]))
        for key, value in ALLOCATOR_ENV.items():
            full_env.setdefault(key, value)
        full_env.update(env or {})
        cmd = [sys.executable, "-m", module, "--plan", str(plan_path), "--out", str(out_path), *map(str, args)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            end_group(proc, grace=0)
            output, _ = proc.communicate()
        finally:  # returned, timed out, raised, Ctrl-C, SIGTERM: the peer's group ends here
            end_group(proc)
        seconds = time.perf_counter() - start
        result, unreadable = None, None
        if out_path.exists():
            try:  # a peer ended while it wrote (a timeout's SIGKILL, the OOM killer) leaves half a file
                result = json.loads(out_path.read_text())
            except ValueError as exc:
                unreadable = f"its result file could not be read ({exc}): its figures are lost"
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {' '.join(cmd[1:3])} {' '.join(map(str, args))}\n{output}")
    lines = [line for line in (output or "").splitlines() if not line.startswith("USDT:")]
    return {
        "returncode": None if timed_out else proc.returncode,
        "timed_out": timed_out,
        "seconds": round(seconds, 2),
        "output_tail": "\n".join(lines[-40:] + ([unreadable] if unreadable else [])),
        "result": result,
        "unreadable": unreadable,
    }
