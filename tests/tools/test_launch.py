"""The local worker pool: results in rank order, errors reported with their rank, hangs bounded,
a rank left waiting on a failed one stopped after the pool's grace, not its timeout."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from syncbn.tools.launch import WorkerError, WorkerPool, failure_report, free_port, launched_by_torchrun


def whoami(offset):
    return dist.get_rank() + offset, dist.get_world_size()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise KeyError("rank one says no")
    return "fine"


def stuck_in_collective():
    """Rank 0 skips the collective the others enter: a hang the pool must bound."""
    if dist.get_rank() != 0:
        import torch

        dist.all_reduce(torch.ones(1))
    return "done"


def environment(name):
    return os.environ.get(name)


def raise_on_rank_one_while_others_wait():
    """Rank 1 raises at once; every other rank enters a collective rank 1 never joins."""
    import torch

    if dist.get_rank() == 1:
        raise KeyError("rank one gave up")
    dist.all_reduce(torch.ones(1))
    return "never"


def raise_everywhere_one_rank_late(late_rank, seconds):
    """Every rank raises its own error; ``late_rank`` first works ``seconds`` outside any collective."""
    if dist.get_rank() == late_rank:
        time.sleep(seconds)
    raise ValueError(f"rank {dist.get_rank()} has its own reason")


def test_run_returns_results_in_rank_order(pool):
    assert pool.run(whoami, 10) == [(10, 4), (11, 4), (12, 4), (13, 4)]
    assert pool.run_each(whoami, [(0,), (1,), (2,), (3,)]) == [(0, 4), (2, 4), (4, 4), (6, 4)]


def test_error_names_the_rank_and_pool_survives(pool):
    with pytest.raises(WorkerError, match="rank one says no") as info:
        pool.run(fail_on_rank_one)
    assert sorted(info.value.errors) == [1]
    assert pool.run(whoami, 0)[3] == (3, 4)


def test_hang_is_bounded():
    with WorkerPool(2, timeout=5) as small:
        with pytest.raises((TimeoutError, WorkerError)):
            small.run(stuck_in_collective, timeout=30)  # gloo's own 5 s timeout fires first


SLOW_START = """
import os, sys, time
if "--multiprocessing-fork" in sys.argv:  # a worker (not multiprocessing's resource tracker)
    try:
        os.close(os.open({flag!r}, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        pass
    else:  # the first worker to start is {seconds} s late to everything after
        time.sleep({seconds})
"""


def test_a_slow_start_does_not_count_against_the_timeout(tmp_path, monkeypatch):
    """One worker starts 15 s after the other (a loaded machine, a cold import cache), with a
    3 s process-group timeout: the rendezvous waits for both to have imported, so the pool
    starts and runs a collective instead of failing in ``init_process_group`` (its store
    gives up a few seconds past the timeout: well before the late worker arrives)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_START.format(flag=str(tmp_path / "first"), seconds=15))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with WorkerPool(2, timeout=3) as small:
        assert (tmp_path / "first").exists()  # the delay did happen, in one of the workers
        assert small.run(whoami, 0) == [(0, 2), (1, 2)]


def test_a_rank_left_waiting_on_a_failed_one_is_stopped_after_the_grace():
    """Rank 1 fails, rank 0 waits in a collective for it: the pool stops waiting after its
    grace (10 s), well before the job's and the process group's 120 s, names rank 1 with its
    traceback first and rank 0 as waiting on it, and is shut down."""
    with WorkerPool(2, timeout=120) as small:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            small.run(raise_on_rank_one_while_others_wait, timeout=120)
        elapsed = time.monotonic() - start
        assert elapsed < 60, elapsed
        error = info.value
        assert list(error.errors) == [1, 0] and error.stuck == [0]
        assert isinstance(error.errors[1][0], KeyError)
        assert isinstance(error.errors[0][0], TimeoutError)
        text = str(error)
        assert text.startswith("job failed on rank(s) [1]; rank(s) [0] waiting on the failed rank(s):"), text
        assert text.index("rank one gave up") < text.index("--- rank 0 (waiting on the failed rank(s)) ---")
        assert not small.alive
        with pytest.raises(RuntimeError, match="closed"):
            small.run(whoami, 0)


def test_an_error_on_every_rank_keeps_the_pool(pool):
    """A job that fails on every rank of the shared pool, rank 3 answering 2 s after the
    others (well within the 10 s grace), is one WorkerError holding each rank's own error,
    and the same processes serve the next job."""
    pids = pool.run(os.getpid)
    with pytest.raises(WorkerError) as info:
        pool.run(raise_everywhere_one_rank_late, 3, 2.0)
    assert sorted(info.value.errors) == [0, 1, 2, 3] and info.value.stuck == []
    for rank, (exc, _) in info.value.errors.items():
        assert isinstance(exc, ValueError) and f"rank {rank} has its own reason" in str(exc)
    assert pool.alive and pool.run(os.getpid) == pids


def test_the_interpreting_pool_starts_anew_after_a_shutdown():
    """tests/triton_pool.py's pool, shut down as a job that fails on one rank leaves it,
    serves the next job on new processes that still interpret Triton."""
    from triton_pool import interpreting_pool

    interpreting = interpreting_pool(1)
    try:
        first = interpreting.run(os.getpid)
        interpreting.pool.close(force=True)
        assert interpreting.run(os.getpid) != first
        assert interpreting.run(environment, "TRITON_INTERPRET") == ["1"]
    finally:
        interpreting.close()


@contextlib.contextmanager
def holding_a_pool(script, world_size, **popen):
    """``(parent, workers)``: a Python process running ``script``, which starts a pool of
    ``world_size`` workers and prints their pids, and those workers (psutil); whatever
    the test leaves running is killed afterwards."""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, **popen)
    workers = []
    try:
        workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert len(workers) == world_size, "the pool did not start"
        yield parent, workers
    finally:
        parent.kill()
        parent.wait()
        for worker in workers:
            try:
                worker.kill()
            except psutil.NoSuchProcess:
                pass


ORPHANED = """
import os, time
from syncbn.tools.launch import WorkerPool

with WorkerPool(2, timeout=120) as pool:
    print(*pool.run(os.getpid), flush=True)
    pool.run(time.sleep, 600)
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_end_when_the_process_that_started_them_is_killed(signum):
    """The process holding a pool is killed (``kill``, ``timeout``, a CI job cancelled, the
    OOM killer) while its workers run a job: no cleanup of its own runs, and the workers
    must end by themselves instead of living on under PID 1 (before, ``syncbn soak``,
    ``verify`` and ``demo`` sent SIGTERM left their workers training, then waiting
    forever for a next job)."""
    with holding_a_pool(ORPHANED, 2) as (parent, workers):
        time.sleep(1.0)  # the workers are inside time.sleep(600)
        parent.send_signal(signum)
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"workers {[p.pid for p in alive]} outlived the process that started them"


INTERRUPTED = """
import os, time
from syncbn.tools.launch import WorkerPool

try:
    with WorkerPool(3, timeout=120) as pool:
        print(*pool.run(os.getpid), flush=True)
        pool.run(time.sleep, 600)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_pool_left_by_an_exception_during_a_job_ends_at_once():
    """Ctrl-C (here SIGINT to the process holding the pool alone, as ``kill -INT`` sends it)
    while the workers run a job: leaving the ``with`` block must not wait for the job. The
    polite close asked the busy workers to stop, which they cannot read until their job
    ends, and waited 10 s for each in turn (40 s for the demo's 4 ranks) before killing it."""
    with holding_a_pool(INTERRUPTED, 3) as (parent, workers):
        time.sleep(1.0)  # the workers are inside time.sleep(600)
        parent.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert parent.stdout.readline().strip() == "interrupted"
        parent.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert elapsed < 15, f"{elapsed:.0f} s from Ctrl-C to the end: the close waited for the busy workers"
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive


CTRL_C = """
import os, time
from syncbn.tools.launch import WorkerPool

try:
    with WorkerPool(2, timeout=120) as pool:
        print(*pool.run(os.getpid), flush=True)
        time.sleep(600)  # the workers wait for their next job
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_is_handled_by_the_process_holding_the_pool_alone():
    """Ctrl-C in a terminal sends SIGINT to every process of the foreground group, the
    workers too. The process holding the pool handles it (it stops them); each worker's
    own KeyboardInterrupt printed a traceback on the user's terminal."""
    with holding_a_pool(CTRL_C, 2, stderr=subprocess.PIPE, start_new_session=True) as (parent, workers):
        os.killpg(parent.pid, signal.SIGINT)
        out, err = parent.communicate(timeout=60)
        assert out.strip() == "interrupted" and parent.returncode == 0
        assert "Traceback" not in err, err
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive


def test_helpers():
    assert 0 < free_port() < 65536
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    try:
        assert not launched_by_torchrun()
    finally:
        os.environ.update(env)
    with pytest.raises(ValueError):
        WorkerPool(0)
    with pytest.raises(ValueError, match="failure_grace"):
        WorkerPool(2, failure_grace=0)


def test_the_rank_that_failed_first_is_the_one_shown():
    """Errors in the order they arrived: the first one's traceback is shown, the later
    failures and the ranks stopped while waiting are only named."""
    errors = {2: (ValueError("cause"), "rank 2's traceback"), 0: (RuntimeError("peer gone"), "rank 0's traceback"),
              1: (TimeoutError("stopped"), "rank 1 stopped")}
    report = failure_report(errors, stuck=[1])
    assert report.startswith("FAIL: the distributed run failed on rank 2 first; rank(s) [0] failed after it; "
                             "rank(s) [1] were still waiting on the failed rank(s) and were stopped. Rank 2's error:")
    assert "rank 2's traceback" in report and "rank 0's traceback" not in report and "rank 1 stopped" not in report
    assert failure_report({1: (ValueError("alone"), "tb")}) == "FAIL: the distributed run failed on rank 1:\ntb"
