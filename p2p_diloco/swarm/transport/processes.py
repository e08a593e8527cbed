"""hivemind's child processes (the DHT node, the averager) and their p2pd, under a signal to the group.

A supervisor stops a peer by signalling its whole process group: Ctrl+C in a terminal sends SIGINT
to it, `systemctl stop` and `timeout` send SIGTERM. Every child then gets the signal at the same
moment as the peer. If the children died at once, the peer's next DHT read or averaging step would
wait on a dead pipe: the peer would hang, or die with "averaging process died".

So the children ignore both signals (hivemind makes them ignore SIGINT; `children_started`
SIGTERM) and the parent stops them in order when it leaves (`stop_process`). p2pd, a Go program,
cannot be made to ignore SIGTERM (Go honours an inherited SIG_IGN only for SIGINT and SIGHUP), so
it starts in a session of its own (`_p2pd_in_its_own_session`), out of reach of a signal to the
peer's group; hivemind ends it when the DHT process stops, and it ends by itself within a second
when that process dies (its connection to it closes). A supervisor that signals every
process of a cgroup (systemd's default KillMode) still reaches p2pd: the round in flight then
fails, and the peer stops with the checkpoint of its last round.

A child that ignores SIGTERM would survive `multiprocessing`'s exit handler (which terminates,
then joins: a hang), so `stop_process` kills what does not stop in time, and `_kill_leftovers`
(registered after multiprocessing's own handler, so it runs first) kills any child still alive at
exit.

Forks. hivemind forks its children (the DHT is a ForkProcess, the averager an mp.Process that
inherits the running DHT handle, its pipes and locks, so neither spawn nor forkserver can start it).
A fork copies the parent as its other threads left it. If one of them is inside a collection of
the cycle GC (running a finalizer that released the GIL: closing a pipe, joining an old child),
the child inherits "a collection is in progress" and never collects again, and a crash in it is
reported as "Garbage-collecting". `quiet_fork` pauses automatic collections and waits for the one
in flight to end before it forks. A child that dies or does not start within its deadline is one
SwarmError (`wait_started`, `wait_result`), never a wait on a dead pipe.

Leftovers. A SIGKILLed peer leaves its temporary files: p2pd's sockets, multiprocessing's pymp-*
folders, torch's torch-shm-dir-*. They all go to TMPDIR (`_sockets_in_the_tempdir` moves
hivemind's sockets there from its fixed /tmp), so a supervisor that gives a peer a TMPDIR of its
own (the test suite does) removes them with that folder. Its shared tensors stay in /dev/shm
whatever TMPDIR says: the next peer of its run dir removes them (leftovers.py).
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import atexit
import gc
import logging
import multiprocessing
import multiprocessing.util  # registers its exit handler before ours: ours runs first
import os
import queue
import re
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import contextmanager
from typing import Any

from hivemind.p2p import P2P
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.transport import stacks

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # the longest wait for a killed child to be reaped
LIVENESS_S = 0.5  # how often a wait on a child checks that the child still lives
QUIET_TIMEOUT_S = 10.0  # the longest wait for a collection in flight (a finalizer joining a child)
SOCKET_PATH_MAX = 100  # a Unix socket's path must fit its address (sun_path: 108 bytes with the NUL)
LOCK_CHECK_S = 2.0  # a lock of hivemind's futures not free after this long is held by a dead process


class _Collections:
    """Whether the cycle GC is collecting, in any thread, and a wake-up when it stops.

    gc.callbacks run in the collecting thread, possibly inside a finalizer's own locks: a
    SimpleQueue is the one primitive that is safe to put to from there."""

    def __init__(self) -> None:
        self.running = False
        self.stopped: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        self.running = phase == "start"
        if not self.running:
            self.stopped.put(True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether no collection runs (within `timeout_s`); new ones must be paused by the caller."""
        while not self.stopped.empty():  # wake-ups of collections that ended before this wait
            self.stopped.get_nowait()
        if not self.running:
            return True
        try:
            self.stopped.get(timeout=timeout_s)
        except queue.Empty:
            return False
        return True


_COLLECTIONS = _Collections()
gc.callbacks.append(_COLLECTIONS)


_FORKING: list[str] = []  # what quiet_fork is forking now: the child arms its stack dump


def _arm_child() -> None:
    if _FORKING:
        stacks.arm(_FORKING[-1])


os.register_at_fork(after_in_child=_arm_child)


@contextmanager
def quiet_fork(what: str) -> Iterator[None]:
    """Fork a hivemind child (`what`) inside this block: no collection of the cycle GC is in flight
    in any thread (automatic ones are paused for the block: keep it to the fork itself), no lock of
    hivemind's futures is held by a process that died (`_no_leaked_locks`), and the child writes
    its stacks when asked (stacks.py)."""
    _no_leaked_locks()
    enabled = gc.isenabled()
    gc.disable()
    _FORKING.append(what)
    try:
        if not _COLLECTIONS.wait_idle(QUIET_TIMEOUT_S):
            logger.warning("a garbage collection still ran after %g s: forking anyway", QUIET_TIMEOUT_S)
        yield
    finally:
        _FORKING.pop()
        if enabled:
            gc.enable()


def _no_leaked_locks() -> None:
    """hivemind's futures (MPFuture) guard their pipe with locks that every process forked from this
    one shares (semaphores made at import). A child killed while it held one, in the middle of a
    send, leaves it held for ever: every later child then blocks on its first update, its start
    included, and misses its start deadline (tests/swarm/test_fork_safety.py kills one so). A
    sender holds a lock for one pipe write, so one not free within LOCK_CHECK_S is leaked: later
    children get a fresh one (a child still alive from before keeps the old: it was stuck anyway)."""
    for owner, name in ((MPFuture, "_update_lock"), (MPFuture, "_initialization_lock"), (SharedBytes, "_lock")):
        lock = getattr(owner, name)
        if lock.acquire(timeout=LOCK_CHECK_S):
            lock.release()
            continue
        logger.warning("a process that died held hivemind's %s.%s: replaced before the next fork", owner.__name__, name)
        setattr(owner, name, multiprocessing.get_context("fork").Lock())


def wait_started(part: Any, what: str, timeout_s: float) -> None:
    """Wait until hivemind's child `part` is ready (its `_ready` future), within `timeout_s`.
    Raises SwarmError at once if it dies, and if it is not ready in time: it is then asked for its
    stacks (stacks.py), and killed if it does not exit."""
    try:
        wait_result(part, part._ready, what, timeout_s)
    except FuturesTimeout:
        wrote = stacks.ask_for_stacks(part, what)
        if part.is_alive():
            part.kill()
        part.join(STOP_TIMEOUT_S)
        raise SwarmError(
            f"the {what} did not start within {timeout_s:g} s (swarm.join_timeout_s); the machine may be "
            f"overloaded: raise swarm.join_timeout_s or free some CPU"
            + (" (its stacks, for a bug report, are in the log above)" if wrote else "")
        ) from None


def wait_result(part: Any, future: Any, what: str, timeout_s: float) -> Any:
    """`future`'s result, which the child `part` sets, within `timeout_s` (else FuturesTimeout).
    Raises SwarmError as soon as the child is found dead: its answer will never come."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.result(timeout=max(0.0, min(LIVENESS_S, deadline - time.monotonic())))
        except FuturesTimeout:
            if future.done() or time.monotonic() >= deadline:
                raise
            check_alive(part, what)


def check_alive(part: Any, what: str) -> None:
    """SwarmError if the child `part` died. Only its parent can ask (elsewhere: nothing to check)."""
    if getattr(part, "_parent_pid", None) != os.getpid() or part.is_alive():
        return
    raise SwarmError(f"the {what} (pid {part.pid}) died: {_how(part.exitcode)}; see its log lines above")


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@contextmanager
def children_started() -> Iterator[None]:
    """Start hivemind children inside this block: they ignore SIGTERM for life, while this process
    keeps its own handler (a SIGTERM during start-up still stops it). Both of the parent's handlers
    are restored afterwards: hivemind sets the parent's SIGINT to ignored when it starts a child,
    so a Ctrl+C is lost only while a child starts (the DHT: until it has joined)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    parent = os.getpid()

    def on_sigterm(signum: int, frame: Any) -> None:
        # A forked child inherits this handler: there it ignores the signal.
        own = saved[signal.SIGTERM]
        if os.getpid() == parent and callable(own):
            own(signum, frame)
        elif os.getpid() == parent and own == signal.SIG_DFL:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def stop_process(part: Any, what: str) -> None:
    """Stop a hivemind child (DHT or averager) in order, within its shutdown_timeout; kill it if
    it is still there (hivemind's fallback, SIGTERM, is ignored by design). One that already died
    is only reaped (hivemind would log an error)."""
    if part.is_alive():
        try:
            with _quiet(_HARD_WAY):
                part.shutdown()
        except Exception as e:  # a broken pipe to a child that is ending anyway
            logger.debug("shutdown of the %s: %s", what, e)
    if part.is_alive():
        logger.debug("the %s did not stop in time: killed", what)
        part.kill()
    part.join(STOP_TIMEOUT_S)


# hivemind logs this before its SIGTERM fallback, which the children ignore: stop_process kills.
_HARD_WAY = "did not shut down within the grace period"


@contextmanager
def _quiet(text: str) -> Iterator[None]:
    """Drop hivemind's log lines that contain `text` while the block runs."""

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    hivemind_loggers = [logging.getLogger(n) for n in ("hivemind.dht.dht", "hivemind.averaging.averager")]
    for log in hivemind_loggers:
        log.addFilter(keep)
    try:
        yield
    finally:
        for log in hivemind_loggers:
            log.removeFilter(keep)


def _p2pd_in_its_own_session() -> None:
    """hivemind starts p2pd with asyncio.subprocess.create_subprocess_exec and no way to pass
    options: wrap it so that p2pd (only) gets start_new_session=True. Forked children inherit it."""
    original = asyncio.subprocess.create_subprocess_exec

    async def create(program: Any, *args: Any, **kwargs: Any) -> Any:
        if str(program).endswith("p2pd"):
            kwargs.setdefault("start_new_session", True)
        return await original(program, *args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create  # type: ignore[assignment]


_METRICS_PORT: list[int] = []  # where this process's next p2pd serves its Prometheus metrics (metrics_at)


def metrics_at(port: int | None) -> None:
    """The p2pd this process starts next serves its own Prometheus metrics (libp2p's: connections,
    streams, the relay service's bytes and circuits) on 127.0.0.1:`port`; None: none. A DHT process
    calls it before its node starts, so that it is that one p2pd's (p2pd exits if the port is taken)."""
    _METRICS_PORT[:] = [] if port is None else [port]


# go-libp2p's relay v2 defaults. p2pd runs two relay services (docs/design.md, "Hole punching"):
# go-libp2p's own, always with these limits, and one that its flags configure (-relayDataLimit 4 GiB,
# -relayTimeLimit 30 min, -relayBufferSize 16 MiB unless given); whichever registered last serves.
# Given these, both cut a relayed connection at 128 KiB each way or 2 minutes: signalling only.
RELAY_LIMITS = {"relayDataLimit": 128 << 10, "relayTimeLimit": "2m0s", "relayBufferSize": 2048}


def _our_flags() -> None:
    """Flags hivemind never passes p2pd:
    - relayDiscovery off: a node that looks for relays (autoRelay: a private one, under
      swarm.hole_punching) takes its entry nodes as its relays (trustedRelays) and reserves a slot at
      once: p2pd's relay discovery would wait out go-libp2p's 3-minute boot delay first;
    - a relay's limits (RELAY_LIMITS) wherever p2pd may relay (-relay);
    - metricsAddr on loopback, once asked for (`metrics_at`)."""
    make = P2P._make_process_args

    def args(*positional: Any, **flags: Any) -> list[str]:
        if flags.get("autoRelay"):
            flags["relayDiscovery"] = False
        if flags.get("relay"):
            flags.update(RELAY_LIMITS)
        if _METRICS_PORT:
            flags["metricsAddr"] = f"127.0.0.1:{_METRICS_PORT.pop()}"
        return make(*positional, **flags)

    P2P._make_process_args = staticmethod(args)  # type: ignore[method-assign]


def _sockets_in_the_tempdir() -> None:
    """hivemind puts p2pd's two Unix sockets in /tmp, whatever TMPDIR says, and a SIGKILLed peer
    leaves them there. Put them where the process's other temporary files go (TMPDIR, as Python's
    and torch's do), where that path is plain and short enough for a socket: a supervisor or a test
    suite that gives its peers a TMPDIR of their own then removes what they left with it."""
    folder = tempfile.gettempdir()
    longest = f"{folder}/hivemind-p2pclient-{'x' * 11}.sock"  # the name ends in 11 random characters
    if re.fullmatch(r"/[\w./-]*", folder) and len(longest) <= SOCKET_PATH_MAX:
        P2P._UNIX_SOCKET_PREFIX = f"/unix{folder.rstrip('/')}/hivemind-"


def _kill_leftovers() -> None:
    for child in multiprocessing.active_children():
        if child.pid is not None and child.pid != os.getpid():
            child.kill()


atexit.register(_kill_leftovers)
_p2pd_in_its_own_session()
_our_flags()
_sockets_in_the_tempdir()
