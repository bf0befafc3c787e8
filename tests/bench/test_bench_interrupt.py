"""``syncbn bench`` interrupted (SIGTERM, or Ctrl-C's SIGINT) ends every process it
started: its peer and the peer's own workers, none left running under PID 1.

The bench runs the cheapest peer (``torch_bn``: one torch peer process, which starts a
pool of gloo workers); the signal comes once that pool exists, so a peer of a peer is
among the processes that must end.
"""

import signal
import subprocess
import sys
import time

import psutil
import pytest

START_S = 120  # until the peer's worker pool exists: about 10 s on two idle cores
EXIT_S = 30  # the bench ends its peers' groups within a few seconds
GONE_S = 3  # and they are gone a few seconds later (left to themselves, the peer and its
# pool took 6-10 s to fail on their own, once their output pipe and folder were gone)


def _descendants(proc: psutil.Process):
    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pool_started(bench: psutil.Process) -> bool:
    """True once a process two levels below the bench is a multiprocessing worker: the
    torch peer's pool (its resource tracker comes first and does not count)."""
    for p in _descendants(bench):
        try:
            if p.ppid() != bench.pid and "spawn_main" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            pass
    return False


def _alive(procs):
    """The processes still running (a killed orphan left unreaped as a zombie is ended)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(procs):
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_interrupted_bench_ends_every_process_it_started(tmp_path, signum):
    cmd = [sys.executable, "-m", "syncbn", "bench", "--quick", "--out", str(tmp_path / "out"), "--peers", "torch_bn"]
    log = open(tmp_path / "bench.log", "w")
    bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    seen = []
    try:
        me = psutil.Process(bench.pid)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and bench.poll() is None and not _pool_started(me):
            time.sleep(0.2)
        assert bench.poll() is None, f"the bench ended before its peer started workers: {bench.returncode}"
        seen = _alive(_descendants(me))  # the peer, its resource tracker and workers
        assert _pool_started(me), f"no worker pool within {START_S} s: {_describe(seen)}"
        bench.send_signal(signum)
        try:
            code = bench.wait(timeout=EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bench did not end within {EXIT_S} s of {signum.name}")
        # ended by its own handling (cli: 130 for Ctrl-C; SIGTERM as exit 128 + 15), not killed outright
        assert code == 128 + signum, code
        deadline = time.monotonic() + GONE_S
        while _alive(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(seen)
        assert not left, f"still running after the bench ended: {_describe(left)}"
    finally:  # whatever happened above, the test leaves no process behind
        leftovers = list(seen)
        for p in _alive(seen):  # and what they started since (orphans now, if the bench died)
            leftovers += _descendants(p)
        if bench.poll() is None:
            try:
                leftovers += _descendants(psutil.Process(bench.pid))
            except psutil.Error:
                pass
            bench.kill()
            bench.wait()
        for p in _alive(leftovers):
            try:
                p.kill()
            except psutil.Error:
                pass
        log.close()


CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(120)"


def test_end_group_ends_a_grandchild_that_ignores_sigterm():
    """end_group: SIGTERM to the peer's group, then SIGKILL to what is left of it, here a
    grandchild that ignores SIGTERM (the multiprocessing resource tracker does)."""
    from syncbn.bench.peers import end_group

    peer = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True, stdout=subprocess.PIPE, text=True)
    family = []
    try:
        assert peer.stdout.readline().strip() == "ready"  # the child ignores SIGTERM from now on
        family = _alive(_descendants(psutil.Process(peer.pid)))
        assert family, "the peer started no child"
        end_group(peer, grace=0.5)
        assert peer.poll() is not None
        deadline = time.monotonic() + GONE_S
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(family), _describe(_alive(family))
    finally:
        for p in _alive(family):
            p.kill()
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        peer.stdout.close()
