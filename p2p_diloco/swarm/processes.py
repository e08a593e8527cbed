"""hivemind's child processes (the DHT node, the averager) and their p2pd, under a signal to the group.

A supervisor stops a peer by signalling its whole process group: Ctrl+C in a terminal sends SIGINT
to it, `systemctl stop` and `timeout` send SIGTERM. Every child then gets the signal at the same
moment as the peer. If the children died at once, the peer's next DHT read or averaging step would
wait on a dead pipe (measured: a peer hung for over 60 s, or died with "averaging process died").

So the children ignore both signals (hivemind makes them ignore SIGINT; `children_started`
SIGTERM) and the parent stops them in order when it leaves (`stop_process`). p2pd, a Go program,
cannot be made to ignore SIGTERM (Go honours an inherited SIG_IGN only for SIGINT and SIGHUP), so
it starts in a session of its own (`_p2pd_in_its_own_session`), out of reach of a signal to the
peer's group; hivemind ends it when the DHT process stops, and it ends by itself within a second
when that process dies (measured: its connection to it closes). A supervisor that signals every
process of a cgroup (systemd's default KillMode) still reaches p2pd: the round in flight then
fails, and the peer stops with the checkpoint of its last round.

A child that ignores SIGTERM would survive `multiprocessing`'s exit handler (which terminates,
then joins: a hang), so `stop_process` kills what does not stop in time, and `_kill_leftovers`
(registered after multiprocessing's own handler, so it runs first) kills any child still alive at
exit.
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import atexit
import logging
import multiprocessing
import multiprocessing.util  # registers its exit handler before ours: ours runs first
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # the longest wait for a killed child to be reaped


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


def _kill_leftovers() -> None:
    for child in multiprocessing.active_children():
        if child.pid is not None and child.pid != os.getpid():
            child.kill()


atexit.register(_kill_leftovers)
_p2pd_in_its_own_session()
