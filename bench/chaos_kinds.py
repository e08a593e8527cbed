"""Timing chaos for real peer processes: a CPU hog on one core, a peer in a CPU quota (cgroup v1),
random SIGSTOP/SIGCONT pauses of a peer. Each is a context manager that ends what it started on
every exit path, by pid or process group, never by name. Used by bench/chaos.py and by
tests/swarm/conftest.py (P2P_DILOCO_CHAOS).

    with Hog(), CpuQuota("c", 0.15) as quota, Pauses(proc.pid, random.Random(0)):
        quota.add(proc.pid)  # the peer's whole process tree, p2pd included
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.swarm.procs import alive, descendants, signal_tree, started_at

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # the cgroup v1 cpu controller


class Hog:
    """A busy process pinned to one core for as long as the block runs: another program (a game,
    a compile) that takes a core from the peers."""

    def __init__(self, core: int = 0):
        self.core = core
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Hog:
        core = self.core
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
            start_new_session=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()  # by its pid: the one process we started
            self.proc.wait(timeout=30)


class CpuQuota:
    """A child cgroup of the cpu controller that lets its processes use `share` of one core:
    a volunteer's machine busy with something else. Removed on exit, its processes moved back."""

    def __init__(self, name: str, share: float, period_us: int = 100_000):
        self.path = CGROUP_CPU / f"p2p-diloco-chaos-{os.getpid()}-{name}"
        self.share, self.period_us = share, period_us

    def __enter__(self) -> CpuQuota:
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(self.share * self.period_us)))
        return self

    def add(self, pid: int) -> int:
        """Put `pid` and every process below it in the cgroup (children forked later inherit it;
        p2pd, in a session of its own, is still below its peer). Returns how many are in now."""
        for target in descendants(pid):
            try:
                (self.path / "cgroup.procs").write_text(str(target))
            except OSError:  # gone meanwhile, or a zombie
                pass
        return len(self.members())

    def members(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def __exit__(self, *exc: object) -> None:
        # A cgroup with processes cannot be removed: move what is left to the root group first.
        deadline = time.monotonic() + 10
        while True:
            for pid in self.members():
                try:
                    (CGROUP_CPU / "cgroup.procs").write_text(str(pid))
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # a process exiting meanwhile; bounded by the deadline


class Pauses:
    """Stops the process tree of `pid` (its group, its DHT and averager, p2pd) for 0.1-3 s at random
    moments, 1-5 s apart, seeded: a laptop lid closed, a VM descheduled. SIGCONT on exit, always."""

    def __init__(self, pid: int, rng: random.Random, pause_s=(0.1, 3.0), gap_s=(1.0, 5.0)):
        self.pid, self.rng = pid, rng
        self.pause_s, self.gap_s = pause_s, gap_s
        self.pauses: list[tuple[float, float]] = []  # (seconds after start, length)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, daemon=True)

    def __enter__(self) -> Pauses:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def _cycle(self) -> None:
        while not self._done.wait(self.rng.uniform(*self.gap_s)):
            length = self.rng.uniform(*self.pause_s)
            self.pauses.append((round(time.monotonic() - self._started, 2), round(length, 2)))
            signal_tree(self.pid, signal.SIGSTOP)
            self._done.wait(length)
            signal_tree(self.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        signal_tree(self.pid, signal.SIGCONT)  # never leave it stopped


class Reaper:
    """Remembers every process below the groups it is shown, so that what outlives its parent
    (p2pd is reparented to init when its peer dies) is still ended: by pid and start time."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int | None]] = set()

    def note(self, pids) -> None:
        for pid in pids:
            self.seen |= {(p, started_at(p)) for p in descendants(pid)}

    def end(self) -> None:
        for pid, started in self.seen:
            if pid != os.getpid() and alive(pid) and started_at(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
