"""What a hivemind child that missed its start deadline was doing: its stacks, for a bug report.

A DHT or averaging process that does not start within swarm.join_timeout_s is killed
(processes.wait_started) and the peer stops with one error line. A kill alone leaves no trace of
why it was stuck: a lock inherited from the parent, a wait on p2pd, a lookup in the swarm. So every
child forked by processes.quiet_fork is armed: on SIGUSR1 it writes, to its stderr (the peer's log)

- every thread's Python frames, from the signal handler itself (faulthandler), so also while the
  interpreter is stuck in C;
- then, once its main thread runs Python again, each asyncio task's coroutine stack (where an
  event loop waits, a thread's frames only show the loop's select);

and exits with STACKS_EXIT. The parent asks with `ask_for_stacks`, waits up to DUMP_S for it to
exit, and kills it otherwise.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
from typing import Any

DUMP_S = 3.0  # how long the parent waits for a stuck child to write its stacks and exit
STACKS_EXIT = 70  # the child's exit code after it wrote its stacks
SIGNAL = signal.SIGUSR1


def arm(what: str) -> None:
    """In a freshly forked child (its only thread): write the stacks on SIGNAL, then exit."""

    def write_tasks_and_exit(signum: int, frame: Any) -> None:
        out = sys.stderr
        for task in _tasks():
            print(f"--- asyncio task {task.get_name()}:", file=out)
            task.print_stack(limit=20, file=out)
        print(f"--- end of the stacks of the {what} (pid {os.getpid()})", file=out, flush=True)
        os._exit(STACKS_EXIT)

    signal.signal(SIGNAL, write_tasks_and_exit)
    # Registered after the Python handler: faulthandler writes the threads at once, then chains to it.
    faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True, chain=True)


def _tasks() -> list[asyncio.Task[Any]]:
    try:
        return list(asyncio.all_tasks(asyncio.get_running_loop()))
    except RuntimeError:  # no event loop runs in this thread
        return []


def ask_for_stacks(part: Any, what: str) -> bool:
    """Ask the stuck child `part` for its stacks; whether it wrote them and exited within DUMP_S."""
    header = f"--- the {what} (pid {part.pid}) did not start in time; its stacks, for a bug report:"
    print(header, file=sys.stderr, flush=True)
    try:
        os.kill(part.pid, SIGNAL)
    except ProcessLookupError:
        return False
    part.join(DUMP_S)
    return part.exitcode == STACKS_EXIT
