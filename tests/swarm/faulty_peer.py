"""A peer that fails on purpose at a chosen phase and round: the fault-injection tests' subject.

    FAULT=<phase>:<n>:<KILL|STOP|INT> python -m tests.swarm.faulty_peer peer ...   (same arguments as p2p-diloco peer)

phase `inner`: at the start of the n-th inner phase this peer runs, the main process signals its
whole process group (itself, its DHT and averager processes and their p2pd): SIGKILL is a crash,
SIGSTOP a laptop that went to sleep, SIGINT a Ctrl+C in the peer's terminal (which also signals
the whole foreground process group). phase `allreduce`: the averager process does the same in the
first all-reduce it starts after n-1 all-reduces completed (failed attempts, which a loaded
machine sees now and then, do not count), at the first part it sends (as a sender) or receives (as
a reducer, before it answered anything). phase `matchmaking`: the n-th time this peer looks for its round's
group, half a matchmaking window after it declared itself (others have seen it and may be
waiting for it). phase `serve`: when another peer downloads this peer's state for the n-th time,
before a byte was sent. Counting from this peer's start makes the fault land after it took part in
the swarm, however many rounds it skipped by catching up.
The tests start this process in a session of its own, so the group is exactly this peer.
"""

import os
import signal
import sys
import threading

from p2p_diloco import cli, peer
from p2p_diloco.swarm import Swarm
from p2p_diloco.swarm.allreduce import ConsistentAllReduceRunner, DiLoCoAverager

PHASE, NTH, SIGNAL = os.environ["FAULT"].split(":")
NTH = int(NTH)
SIGNUM = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "INT": signal.SIGINT}[SIGNAL]


FIRED = threading.Event()


def fail() -> None:
    """Signal the whole group, once: a second SIGINT would be a second Ctrl+C (stop at once)."""
    if not FIRED.is_set():
        FIRED.set()
        os.killpg(os.getpgid(0), SIGNUM)


def patch_inner() -> None:
    original = peer.Peer._inner_phase
    state = {"phases": 0}

    def inner_phase(self, stop, lead=0):
        state["phases"] += 1
        if state["phases"] == NTH:
            fail()
        return original(self, stop, lead)

    peer.Peer._inner_phase = inner_phase


def patch_allreduce() -> None:
    """The averager process counts its completed all-reduces; in the next one after n-1 it fails on
    the first part it sends or receives, whichever role (sender, reducer) comes first. hivemind's
    load balancer may give a peer no span to reduce, so the fault does not wait for that role."""
    original_run = DiLoCoAverager._run_allreduce_inplace_
    original_reduce = ConsistentAllReduceRunner._accumulate_parts_streaming
    original_counted = ConsistentAllReduceRunner._counted
    state = {"completed": 0}

    async def run(self, *args, **kwargs):
        await original_run(self, *args, **kwargs)
        state["completed"] += 1

    def armed() -> bool:
        return state["completed"] == NTH - 1

    async def reduce(self, stream, sender_index):
        async def parts():
            async for message in stream:
                if armed():
                    fail()
                yield message

        async for reply in original_reduce(self, parts(), sender_index):
            yield reply

    async def counted(self, messages, peer_index):
        async for message in original_counted(self, messages, peer_index):
            if armed():
                fail()
            yield message

    DiLoCoAverager._run_allreduce_inplace_ = run
    ConsistentAllReduceRunner._accumulate_parts_streaming = reduce
    ConsistentAllReduceRunner._counted = counted


def patch_matchmaking() -> None:
    original = Swarm.average
    state = {"steps": 0}

    def average(self, *args, **kwargs):
        state["steps"] += 1
        if state["steps"] == NTH:  # the fault's timing, not a synchronisation: it lands mid-matchmaking
            threading.Timer(self.config.swarm.matchmaking_time_s / 2, fail).start()
        return original(self, *args, **kwargs)

    Swarm.average = average


def patch_serve() -> None:
    original = peer.Peer._serve_state
    state = {"served": 0}

    def serve_state(self):
        state["served"] += 1
        if state["served"] == NTH:
            fail()
        return original(self)

    peer.Peer._serve_state = serve_state


{"inner": patch_inner, "allreduce": patch_allreduce, "matchmaking": patch_matchmaking, "serve": patch_serve}[PHASE]()

if __name__ == "__main__":
    sys.exit(cli.main())
