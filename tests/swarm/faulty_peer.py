"""A peer that fails on purpose at a chosen phase and round: the fault-injection tests' subject.

    FAULT=<phase>:<n>:<KILL|STOP> python -m tests.swarm.faulty_peer peer ...   (same arguments as p2p-diloco peer)

phase `inner`: at the start of the n-th inner phase this peer runs, the main process signals its
whole process group (itself, its DHT and averager processes and their p2pd): SIGKILL is a crash,
SIGSTOP a laptop that went to sleep. phase `allreduce`: the averager process does the same in the
n-th all-reduce this peer takes part in, as a reducer, when the first part of its span arrived
(it has answered nothing yet). Counting from this peer's start makes the fault land after it took
part in the swarm, however many rounds it skipped by catching up.
The tests start this process in a session of its own, so the group is exactly this peer.
"""

import os
import signal
import sys

from p2p_diloco import cli, peer
from p2p_diloco.swarm.allreduce import ConsistentAllReduceRunner

PHASE, NTH, SIGNAL = os.environ["FAULT"].split(":")
NTH = int(NTH)
SIGNUM = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[SIGNAL]


def fail() -> None:
    os.killpg(os.getpgid(0), SIGNUM)


def patch_inner() -> None:
    original = peer.Peer._inner_phase
    state = {"phases": 0}

    def inner_phase(self, stop):
        state["phases"] += 1
        if state["phases"] == NTH:
            fail()
        return original(self, stop)

    peer.Peer._inner_phase = inner_phase


def patch_allreduce() -> None:
    """The averager process counts its all-reduces."""
    original_init = ConsistentAllReduceRunner.__init__
    original_reduce = ConsistentAllReduceRunner._accumulate_parts_streaming
    state = {"runs": 0}

    def init(self, *args, **kwargs):
        state["runs"] += 1
        original_init(self, *args, **kwargs)

    async def reduce(self, stream, sender_index):
        async def parts():
            async for message in stream:
                if state["runs"] == NTH:
                    fail()
                yield message

        async for reply in original_reduce(self, parts(), sender_index):
            yield reply

    ConsistentAllReduceRunner.__init__ = init
    ConsistentAllReduceRunner._accumulate_parts_streaming = reduce


{"inner": patch_inner, "allreduce": patch_allreduce}[PHASE]()

if __name__ == "__main__":
    sys.exit(cli.main())
