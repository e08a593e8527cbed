"""A peer's processes as a tree: its DHT and averager processes share its process group, but p2pd
runs in a session of its own (p2p_diloco/swarm/transport/processes.py), so only the parent links find it."""

import os
import time


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the command may contain spaces
    except (OSError, ValueError, IndexError):  # gone meanwhile
        return None


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children, grandchildren...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent_of(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; not gone and not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def signal_tree(pid: int, signum: int) -> None:
    """Signal the process group led by `pid` and every descendant of `pid`: a crash (SIGKILL) or a
    laptop asleep (SIGSTOP) takes p2pd with it. The deepest first and the group last: the caller
    may be in the group (a peer that fails on purpose), and it stops with it."""
    for target in reversed(descendants(pid)[1:]):
        if target == os.getpid():  # the group signal below takes the caller, after everything else
            continue
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):  # no such group (any more)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def started_at(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with its pid, it names one process even
    after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def wait_gone(pids: list[int], deadline_s: float) -> None:
    """Until none of `pids` is alive (a SIGKILL takes effect when the process next runs), at most
    `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll, bounded by the deadline
