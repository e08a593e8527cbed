"""A start gate for swarm tests whose peers must all take part from round 0 (a delay hook, not a
fault): with START_GO=<path> in its environment, a peer holds at FaultPoint.START (its imports,
model, data and DHT are up; it has not looked at the swarm yet), says so by creating
<path>.<pid>, and goes on once the test creates <path>. A peer slowed by a loaded machine then no
longer finds the others' 4-round run over when it comes up. Bounded: it goes on after GO_TIMEOUT_S."""

import os
import threading
import time
from pathlib import Path

from p2p_diloco.faults import FaultPoint, install

GO_TIMEOUT_S = 120.0


def install_gate() -> None:
    go = os.environ.get("START_GO")
    if not go:
        return

    def hold(**context) -> None:
        Path(f"{go}.{os.getpid()}").touch()
        deadline = time.monotonic() + GO_TIMEOUT_S
        while not os.path.exists(go) and time.monotonic() < deadline:
            threading.Event().wait(0.1)  # a poll of the file, bounded by the deadline

    install(FaultPoint.START, hold)


def open_gate(go: Path, procs, timeout_s: float = 120.0) -> None:
    """Once every one of `procs` holds at the gate (or the deadline passed: the test then fails on
    what it asserts), let them all go."""
    from tests.swarm.conftest import wait_until

    wait_until(lambda: all(Path(f"{go}.{p.pid}").exists() for p in procs), procs, timeout_s, "every peer at the gate")
    go.touch()
