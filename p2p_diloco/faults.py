"""Named points in a peer's life where a test can inject a fault (tests/swarm/faulty_peer.py).

The peer calls `reached(point)` at each; nothing happens unless a hook was installed for it, which
only the fault-injection tests do. Hooks installed before the swarm starts also run in the
averager process (it is forked from the peer), which is where the all-reduce's points are.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

Hook = Callable[..., None]


class FaultPoint(enum.Enum):
    START = "start"  # the peer joined the swarm and is about to look for the run's state
    LOOK = "look"  # the peer published its start record and is about to catch up with the swarm
    INNER = "inner"  # an inner phase starts (the peer's main process)
    MATCHMAKING = "matchmaking"  # the peer starts looking for its round's group (context: window_s)
    ASSEMBLED = "assembled"  # the averager process's matchmaking assembled a group (context: dht_pid, its DHT process)
    AUDIT = "audit"  # the averager process, as a reducer, is asked for the audit of its span
    STAGE2_DECIDED = (
        "stage2-decided"  # a stage-2 decider decided a sub-span, before anyone heard (context: peer, span, sub)
    )
    STAGE2 = "stage2"  # a stage-2 primary summed a sub-span and is about to push it (context: peer, span, sub)
    LOTS = "lots"  # the averager process holds every average and is about to show its audit lot (context: group)
    VERDICTS = (
        "verdicts"  # the averager process checked its share of the audit, about to show its verdicts (context: group)
    )
    ALLREDUCE_PART = "allreduce"  # the averager process sends or receives a part of an all-reduce
    ALLREDUCE_DONE = "allreduce-done"  # the averager process completed an all-reduce
    SERVE = "serve"  # another peer asks for this peer's state, before a byte is sent


_hooks: dict[FaultPoint, Hook] = {}


def install(point: FaultPoint, hook: Hook) -> None:
    """Call `hook(**context)` whenever the peer reaches `point` (tests only)."""
    _hooks[point] = hook


def reached(point: FaultPoint, **context: Any) -> None:
    hook = _hooks.get(point)
    if hook is not None:
        hook(**context)
