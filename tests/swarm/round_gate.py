"""A gate at the first round for swarm tests whose peers must all take part from it (a delay hook,
not a fault): with ROUND_GO=<path> in its environment, a peer holds when it first starts looking
for its group (FaultPoint.MATCHMAKING: its model, DHT and first inner phase are done, it has not
declared itself yet), says so by creating <path>.<pid>, and goes on once the test creates <path>.
All of them then declare themselves within a poll of each other, and form one group: on a loaded
machine a peer slower to come up, or to train, no longer finds the others' group formed without
it (or their 4-round run over). Later rounds are not held. Bounded: it goes on after GO_TIMEOUT_S."""

import os
import threading
import time
from pathlib import Path

from p2p_diloco.faults import FaultPoint, install

GO_TIMEOUT_S = 120.0


def wait_for_file(path: str, timeout_s: float = GO_TIMEOUT_S) -> None:
    """Hold this thread until the test creates `path` (a delay hook's "go"), at most `timeout_s`."""
    deadline, tick = time.monotonic() + timeout_s, threading.Event()
    while not os.path.exists(path) and time.monotonic() < deadline:
        tick.wait(0.1)  # a poll of the file, bounded by the deadline


def install_gate() -> None:
    """Hold at the first FaultPoint.MATCHMAKING when ROUND_GO is set (a fault of faulty_peer's
    installed after this one at the same point replaces it)."""
    go = os.environ.get("ROUND_GO")
    if not go:
        return
    held = threading.Event()

    def hold(**context) -> None:
        if not held.is_set():
            held.set()
            Path(f"{go}.{os.getpid()}").touch()
            wait_for_file(go)

    install(FaultPoint.MATCHMAKING, hold)


def open_gate(go: Path, procs, timeout_s: float = 180.0) -> None:
    """Once every one of `procs` holds at the gate (or the deadline passed: the test then fails on
    what it asserts), let them all go."""
    from tests.swarm.conftest import wait_until

    wait_until(lambda: all(Path(f"{go}.{p.pid}").exists() for p in procs), procs, timeout_s, "every peer at the gate")
    go.touch()
