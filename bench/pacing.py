"""Kernel pacing of another process's TCP sockets, from outside it (an experiment's tool).

p2pd (Go) opens the sockets that carry an all-reduce; nothing in it sets SO_MAX_PACING_RATE.
`pace_tree(pid, bps)` finds every TCP socket held by `pid` and its descendants, duplicates each
into this process with pidfd_getfd(2) (Linux 5.6+; root, or the owner under Yama's ptrace rules)
and caps its sending rate: the kernel then spaces that connection's packets itself (TCP's own
pacing, no fq qdisc needed). The duplicate is closed at once; the setting stays on the socket.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path

SO_MAX_PACING_RATE = 47  # asm-generic/socket.h
SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _tcp_inodes(pid: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        inodes |= {line.split()[9] for line in lines}
    return inodes


def tcp_fds(pid: int) -> list[int]:
    """The fds of `pid` that are TCP sockets (its network namespace's tables)."""
    inodes, fds = _tcp_inodes(pid), []
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            fds.append(int(fd.name))
    return fds


def pace_fd(pid: int, fd: int, bps: int) -> bool:
    """Cap socket `fd` of process `pid` at `bps` bytes/s (0: no cap); whether it took."""
    pidfd = os.pidfd_open(pid)
    try:
        mine = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            return False
        sock = socket.socket(fileno=mine)
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, bps if bps > 0 else 0xFFFFFFFF)
            return True
        except OSError:
            return False
        finally:
            sock.close()  # the duplicate only; the socket lives on in `pid`
    finally:
        os.close(pidfd)


def pace_tree(pid: int, bps: int, done: set[tuple[int, int]] | None = None) -> int:
    """Cap every TCP socket of `pid` and its descendants not in `done` (pid, fd); how many now."""
    done = set() if done is None else done
    count = 0
    for p in descendants(pid):
        for fd in tcp_fds(p):
            if (p, fd) not in done and pace_fd(p, fd, bps):
                done.add((p, fd))
                count += 1
    return count
