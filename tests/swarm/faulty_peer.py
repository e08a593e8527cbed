"""A peer that fails on purpose at a chosen fault point and count: the fault-injection tests' subject.

    FAULT=<phase>:<n>:<KILL|STOP|INT|TERM|WAIT> python -m tests.swarm.faulty_peer peer ...
    (the same arguments as p2p-diloco peer)

The phases are the peer's own fault points (p2p_diloco.faults.FaultPoint); at the n-th time the
peer reaches one, it signals its whole process group (itself, its DHT and averager processes and
their p2pd): SIGKILL is a crash, SIGSTOP a laptop that went to sleep, SIGINT a Ctrl+C in the peer's
terminal (which also signals the whole foreground process group), SIGTERM `timeout` or a supervisor.
- `start`: the peer joined the swarm and is about to look for the run's state (start-up).
- `inner`: at the start of the n-th inner phase this peer runs.
- `allreduce`: in the first all-reduce the averager process starts after n-1 all-reduces completed
  (failed attempts, which a loaded machine sees now and then, do not count), at the first part it
  sends (as a sender) or receives (as a reducer, before it answered anything).
- `matchmaking`: the n-th time this peer looks for its round's group, half a matchmaking window
  after it declared itself (others have seen it and may be waiting for it).
- `audit`: in the n-th group whose members audit this peer (a reducer), when the second of them
  asks: the first got its answer (its all-reduce completed), the second gets none (its fails).
- `serve`: when another peer downloads this peer's state for the n-th time, before a byte was sent.
- `assembled`: the averager process's matchmaking assembled the n-th group this peer takes part in.
  With the signal STALLDHT the peer's DHT process (the averager's sibling) is stopped there for
  STALL_S seconds (default 8) and then continued: a DHT that stalls (a starved process, a slow
  DHT node) just as a group formed, while the peer itself runs on.
- `look`: the peer published its start record and is about to catch up with the swarm. With the
  signal WAIT (`FAULT=look:1:WAIT`, `FAULT_GO=<path>`) the peer is held there until the test
  creates the file: a delay hook, not a fault.
With ROUND_GO=<path> the peer also holds before its first round's group with the test's other
peers (round_gate.py; a `matchmaking` fault replaces that hold).
Counting from this peer's start makes the fault land after it took part in the swarm, however many
rounds it skipped by catching up. The tests start this process in a session of its own, so the
group is exactly this peer.
"""

import logging
import os
import signal
import sys
import threading

from p2p_diloco import cli
from p2p_diloco.faults import FaultPoint, install
from tests.swarm.procs import signal_tree
from tests.swarm.round_gate import install_gate, wait_for_file

PHASE, NTH, SIGNAL = os.environ["FAULT"].split(":")
NTH = int(NTH)
SIGNUM = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "INT": signal.SIGINT, "TERM": signal.SIGTERM}.get(SIGNAL)
FIRED = threading.Event()


def wait_for_go() -> None:
    """WAIT: hold the peer at the point until the test creates the file $FAULT_GO (a delay hook:
    the test chooses what the swarm has done meanwhile). Bounded: the peer goes on after
    round_gate.GO_TIMEOUT_S."""
    wait_for_file(os.environ["FAULT_GO"])


def fail() -> None:
    """Signal the whole peer, once: a second SIGINT would be a second Ctrl+C (stop at once). A
    terminal's Ctrl+C and a supervisor's SIGTERM reach the process group; a crash or a sleep
    reaches p2pd too, which runs in a session of its own."""
    if not FIRED.is_set():
        FIRED.set()
        if SIGNUM in (signal.SIGINT, signal.SIGTERM):
            os.killpg(os.getpgid(0), SIGNUM)
        else:
            signal_tree(os.getpgid(0), SIGNUM)


def on_nth(point: FaultPoint, act=lambda **context: fail()) -> None:
    """`act` when the peer reaches `point` for the n-th time."""
    count = {"n": 0}

    def hook(**context) -> None:
        count["n"] += 1
        if count["n"] == NTH:
            act(**context)

    install(point, hook)


def in_allreduce_after_completed() -> None:
    """The averager process counts its completed all-reduces; in the next one after n-1 it fails at
    the first part it sends or receives, whichever role (sender, reducer) comes first: hivemind's
    load balancer may give a peer no span to reduce, so the fault does not wait for that role."""
    completed = {"n": 0}

    def done(**context) -> None:
        completed["n"] += 1

    def part(**context) -> None:
        if completed["n"] == NTH - 1:
            fail()

    install(FaultPoint.ALLREDUCE_DONE, done)
    install(FaultPoint.ALLREDUCE_PART, part)


def second_audit_of_nth_group() -> None:
    """As a reducer: the second member that audits this peer's span, in its n-th audited group or a
    later one, gets no answer; the first got its answer, so its all-reduce completed and the other's failed."""
    asked: dict[bytes, int] = {}

    def audit(group: bytes, **context) -> None:
        asked[group] = asked.get(group, 0) + 1
        if len(asked) >= NTH and asked[group] == 2:  # a later group if the n-th had one auditor only
            fail()

    install(FaultPoint.AUDIT, audit)


def mid_matchmaking(window_s: float, **context) -> None:
    # the fault's timing, not a synchronisation: it lands half-way through the matchmaking window
    threading.Timer(window_s / 2, fail).start()


def stall_dht(dht_pid: int, **context) -> None:
    """STALLDHT: stop this peer's DHT process for STALL_S s (called in the averager process)."""
    stall_s = float(os.environ.get("STALL_S", "8"))
    os.kill(dht_pid, signal.SIGSTOP)
    logging.getLogger(__name__).info("STALLDHT: stopped the DHT process %d for %g s", dht_pid, stall_s)
    threading.Timer(stall_s, os.kill, (dht_pid, signal.SIGCONT)).start()


install_gate()  # ROUND_GO: held before the first round with the test's other peers (round_gate.py)
if PHASE == "allreduce":
    in_allreduce_after_completed()
elif PHASE == "audit":
    second_audit_of_nth_group()
elif PHASE == "matchmaking":
    on_nth(FaultPoint.MATCHMAKING, mid_matchmaking)
elif SIGNAL == "STALLDHT":
    on_nth(FaultPoint(PHASE), stall_dht)
elif SIGNAL == "WAIT":
    on_nth(FaultPoint(PHASE), lambda **context: wait_for_go())
else:
    on_nth(FaultPoint(PHASE))

if __name__ == "__main__":
    sys.exit(cli.main())
