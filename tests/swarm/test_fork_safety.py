"""hivemind's children are forked with no garbage collection in flight, and a child that dies or
does not start is one SwarmError within its deadline, never a hang (swarm/transport/processes.py).

bench/fork_stress.py is the long version: many DHT starts from a parent with busy threads."""

import asyncio
import faulthandler
import gc
import inspect
import multiprocessing
import os
import signal
import threading
import time

import pytest

from p2p_diloco import config
from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.transport.node import SwarmDHT, start_dht
from p2p_diloco.swarm.transport.processes import quiet_fork, stop_process

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FINALIZER_S = 0.5  # how long the finalizer of the collection in flight takes (a child being joined)


class SlowFinalizer:
    """A cycle whose finalizer releases the GIL for a while, as one that joins a process does."""

    def __init__(self, entered: threading.Event):
        self.me, self.entered = self, entered

    def __del__(self):
        self.entered.set()
        time.sleep(FINALIZER_S)  # the finalizer's own work: the collection is in flight meanwhile


def collection_in_flight() -> threading.Thread:
    """A thread inside a collection of the cycle GC (in its finalizer) when this returns."""
    entered = threading.Event()
    SlowFinalizer(entered)
    collector = threading.Thread(target=gc.collect, name="collector")
    collector.start()
    assert entered.wait(10), "the collection did not reach the finalizer"
    return collector


async def gc_collects(_dht, _node) -> bool:
    """In the DHT process: does its cycle GC still collect a cycle?"""
    cycle = []
    cycle.append(cycle)
    del cycle
    return gc.collect() > 0


def _report_gc(conn) -> None:
    cycle = []
    cycle.append(cycle)
    del cycle
    conn.send(gc.collect() > 0)


def forked_child_collects(quiet: bool) -> bool:
    """Fork a plain child (inside quiet_fork or not) and ask whether its cycle GC collects."""
    mine, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_report_gc, args=(theirs,))
    try:
        if quiet:
            with quiet_fork("test child"):
                child.start()
        else:
            child.start()
        assert mine.poll(10), "the child did not answer"
        return mine.recv()
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.fixture
def swarm_config():
    return config.load(None, {"swarm.host": "127.0.0.1", "swarm.join_timeout_s": "20"})


@pytest.mark.timeout(30)
def test_a_child_forked_during_a_collection_in_another_thread_never_collects_again():
    """The hazard (CPython 3.11): the child inherits "a collection is in progress" for life.
    If this fails, CPython no longer has it and quiet_fork could go."""
    collector = collection_in_flight()
    try:
        assert not forked_child_collects(quiet=False)
    finally:
        collector.join(10)


@pytest.mark.timeout(30)
def test_quiet_fork_waits_for_the_collection_in_flight_and_the_child_collects():
    collector = collection_in_flight()
    try:
        assert forked_child_collects(quiet=True)
        assert gc.isenabled(), "quiet_fork gives automatic collections back"
    finally:
        collector.join(10)


@pytest.mark.timeout(60)
def test_a_dht_started_while_another_thread_collects_can_collect_in_its_process(swarm_config):
    collector = collection_in_flight()
    dht = None
    try:
        dht = start_dht(swarm_config.swarm, None, [], "public")
        assert dht.run_coroutine(gc_collects)
    finally:
        collector.join(10)
        if dht is not None:
            stop_process(dht, "DHT process")


def hold_the_update_lock(holding):
    from hivemind.utils.mpfuture import MPFuture

    MPFuture._update_lock.acquire()  # as a child does while it sends an update to its parent
    holding.set()
    time.sleep(60)  # killed here by the test, the lock still held


@pytest.mark.timeout(60)
def test_a_child_killed_while_it_held_hiveminds_update_lock_does_not_stop_the_next_dht_start(swarm_config, caplog):
    # Before: every later child blocked on its first update, and the next DHT "did not start within
    # 20 s" (a CPU hog had this SIGKILL test's child killed in the middle of a send).
    context = multiprocessing.get_context("fork")
    holding = context.Event()
    holder = context.Process(target=hold_the_update_lock, args=(holding,))
    holder.start()
    try:
        assert holding.wait(10), "the child did not take the lock"
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # the pid of the child this test started
        holder.join(10)
    dht = start_dht(swarm_config.swarm, None, [], "public")
    try:
        assert dht.run_coroutine(gc_collects)  # the child answers through its futures, too
    finally:
        stop_process(dht, "DHT process")
    assert "a process that died held hivemind's MPFuture._update_lock: replaced before the next fork" in caplog.text


@pytest.mark.timeout(60)
def test_a_dht_process_killed_after_its_start_is_one_error_line_within_a_second(swarm_config, monkeypatch):
    # The killed process cannot remove its p2pd client socket: it goes to a folder of this test's
    # (before, one was left in /tmp at every run of the suite).
    import shutil
    import tempfile

    from hivemind.p2p import P2P

    folder = tempfile.mkdtemp(prefix="own-")  # short: a socket's path has at most 107 bytes
    monkeypatch.setattr(P2P, "_UNIX_SOCKET_PREFIX", f"/unix{folder}/hivemind-")
    dht = start_dht(swarm_config.swarm, None, [], "public")
    try:
        os.kill(dht.pid, signal.SIGKILL)  # the pid of the child this test started
        started = time.monotonic()
        with pytest.raises(SwarmError) as caught:
            dht.get_visible_maddrs()
        assert time.monotonic() - started < 2.0, "a dead DHT process must be noticed within a second or so"
        assert str(caught.value) == f"the DHT process (pid {dht.pid}) died: killed by SIGKILL; see its log lines above"
    finally:
        stop_process(dht, "DHT process")
        shutil.rmtree(folder, ignore_errors=True)


class DiesAtStart(SwarmDHT):
    """A DHT process that crashes before it is ready, as the one of CI did while it imported."""

    def run(self):
        faulthandler.disable()  # pytest's handler would print the child's stacks: the test expects the crash
        os.kill(os.getpid(), signal.SIGSEGV)


class NeverReady(SwarmDHT):
    """A DHT process that never reports ready (stuck in its start)."""

    def run(self):
        threading.Event().wait(60)  # the stuck start itself: the parent's deadline ends it


INHERITED = threading.Lock()


class StuckOnAnInheritedLock(SwarmDHT):
    """A DHT process forked while another thread of its parent held a lock: the child's copy of
    the lock has no owner left to release it (the classic fork-from-threads deadlock)."""

    def run(self):
        INHERITED.acquire()


class StuckInATask(SwarmDHT):
    """A DHT process whose event loop waits, in a task, on something that never comes: a thread's
    frames show only the loop; the task's coroutine stack shows what it waits on."""

    def run(self):
        async def wait_for_the_daemon():
            await asyncio.get_running_loop().create_future()

        asyncio.run(wait_for_the_daemon())


@pytest.mark.timeout(30)
def test_a_dht_process_that_dies_while_it_starts_is_one_error_line_not_a_hang():
    started = time.monotonic()
    with pytest.raises(SwarmError, match=r"^the DHT process \(pid \d+\) died: killed by SIGSEGV"):
        DiesAtStart(host_maddrs=LOOPBACK, start=True, timeout_s=20)
    assert time.monotonic() - started < 5.0


@pytest.mark.timeout(30)
def test_a_dht_process_that_does_not_start_within_its_deadline_is_killed_and_one_error_line():
    started = time.monotonic()
    with pytest.raises(SwarmError, match=r"^the DHT process did not start within 1 s \(swarm.join_timeout_s\)"):
        NeverReady(host_maddrs=LOOPBACK, start=True, timeout_s=1)
    assert time.monotonic() - started < 5.0
    assert not [c for c in multiprocessing.active_children() if isinstance(c, NeverReady)], "it was killed"


@pytest.mark.timeout(30)
def test_a_dht_process_stuck_on_a_lock_inherited_from_its_parent_writes_its_stacks_and_exits(capfd):
    """Why a start was stuck is in the log: the stuck frame, not only a kill after the deadline."""
    holder_in, release = threading.Event(), threading.Event()

    def hold():
        with INHERITED:
            holder_in.set()
            release.wait(30)

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    assert holder_in.wait(5)
    try:
        with pytest.raises(SwarmError, match=r"within 1 s .*\(its stacks, for a bug report, are in the log above\)$"):
            StuckOnAnInheritedLock(host_maddrs=LOOPBACK, start=True, timeout_s=1)
    finally:
        release.set()
        holder.join(5)
    err = capfd.readouterr().err
    assert "the DHT process (pid " in err and "did not start in time; its stacks" in err
    assert _frame_line(StuckOnAnInheritedLock.run, "acquire") in err, err  # the stuck frame itself
    assert "end of the stacks of the DHT process" in err, err


@pytest.mark.timeout(30)
def test_a_dht_process_stuck_in_an_asyncio_task_names_the_coroutine_it_waits_in(capfd):
    with pytest.raises(SwarmError, match=r"are in the log above\)$"):
        StuckInATask(host_maddrs=LOOPBACK, start=True, timeout_s=1)
    err = capfd.readouterr().err
    assert "--- asyncio task" in err and "wait_for_the_daemon" in err, err
    assert not [c for c in multiprocessing.active_children() if isinstance(c, StuckInATask)]


def _frame_line(function, text: str) -> str:
    """How faulthandler names the line of `function` that holds `text`: 'line N in name'."""
    lines = inspect.getsource(function).splitlines()
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"line {function.__code__.co_firstlineno + offset} in {function.__code__.co_name}"


SOCKETS_THEN_SIGKILL = """
import asyncio, os, signal
from p2p_diloco.swarm.transport import processes  # places hivemind's sockets, as every peer does
from hivemind.p2p import P2P

async def main():
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await p2p.add_binary_stream_handler("x", None)  # the client listens too, as every peer's does
    print(p2p._child.pid, *sorted(os.listdir(os.environ["TMPDIR"])), flush=True)
    signal.raise_signal(signal.SIGKILL)  # a crash: nothing of hivemind's cleans up

asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_a_killed_peers_p2pd_sockets_are_left_in_its_tmpdir_not_in_tmp(tmp_path):
    # hivemind fixes its sockets to /tmp; a SIGKILLed peer's piled up there (57 in a day of tests).
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.swarm.conftest import wait_until
    from tests.swarm.procs import alive

    folder = tempfile.mkdtemp(prefix="own-")  # short: a socket's path has at most 107 bytes
    try:
        child = subprocess.run(
            [sys.executable, "-c", SOCKETS_THEN_SIGKILL],
            env={**os.environ, "TMPDIR": folder},
            capture_output=True,
            text=True,
            timeout=45,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
        p2pd, *listed = child.stdout.split()
        sockets = [name for name in listed if name.startswith("hivemind-")]
        assert [name for name in sockets if name.startswith("hivemind-p2pd-")], listed
        clients = [name for name in sockets if name.startswith("hivemind-p2pclient-")]
        assert clients, listed
        assert not any(os.path.exists(f"/tmp/{name}") for name in sockets)
        try:  # p2pd ends by itself once its parent's connection closed
            wait_until(lambda: not alive(int(p2pd)), [], 10, "p2pd ending after its parent was killed")
        finally:
            if alive(int(p2pd)):
                os.kill(int(p2pd), signal.SIGKILL)
        # The killed process's own socket is left, in its TMPDIR. (Not p2pd's: whether p2pd removes
        # its socket as it ends races inside p2pd, its main goroutine exiting while Close removes it.)
        assert all(os.path.exists(os.path.join(folder, name)) for name in clients), "nothing was left to tidy"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
