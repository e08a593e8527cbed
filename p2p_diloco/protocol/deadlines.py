"""Deadlines that follow the work instead of a machine's speed (docs/design.md I3).

A whole-state download moves θ and the outer momentum, 8 bytes a parameter: 8 GB for a model of a
billion parameters, 640 s on a home link of 100 Mbit/s. A fixed deadline such as
`swarm.join_timeout_s` (30 s) would cut every such download: no volunteer could join a run of a
real model. So its deadline follows the state's size at the slowest link the run accepts
(`swarm.min_download_mbps`), never under `join_timeout_s`, and a server that stops sending is
given up after `join_timeout_s` of silence (`stall_s`), however long the whole download may take:
a hung peer still costs one short deadline, and a slow link is not mistaken for one.

Every wait on the swarm's records goes through `poll_until`: none without a deadline. How often it
reads depends on how fast what it waits for moves (the *_POLL_S below).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# Round records are published the moment a peer commits its round (Swarm.publish_round), not at
# the heartbeat's pace (heartbeat.BEAT_S, 1 s), and every peer of a round waits on the
# others' (agreement's digests; a client for a reachable peer): a wait on them re-reads this often,
# so that it ends within a fraction of a second of the last record it waits for, on every round.
ROUND_POLL_S = 0.2
# ... and a wait that lasts re-reads less often: each pause 1.5x the last, up to ROUND_POLL_MAX_S.
# A read returns every peer's round record (about 2.4 KB each with its history) from 3 DHT nodes,
# so at 5 a second N peers waiting cost those nodes 5 N reads of N records a second: a 15-s
# agreement wait read 76 times, now 19; one that ends within a second reads at 0, 0.2, 0.5 and
# 0.95 s (6 times before), so a record is seen at most 0.45 s after it lands there, 1 s later on.
ROUND_POLL_GROWTH = 1.5
ROUND_POLL_MAX_S = 1.0
# A wait for the swarm to move (a peer ahead waits for the others to train up to its round; a
# starting peer looks before it follows a state one peer backs) lasts seconds to minutes: it
# re-reads less often. Also the first pause between two tries of a whole-state download (round/sync.py).
CATCH_UP_POLL_S = 0.5
# A one-off command's node (export, revoke, convictions) waits for what peers publish at their
# heartbeat's pace, one beat a second (progress records with convictions, revocations published
# again), or slower (a round agreed): a read more often than the beat would find nothing new.
COMMAND_POLL_S = 1.0

STATE_BYTES_PER_VALUE = 2 * 4  # a served state is θ and the outer momentum, fp32
STATE_SLACK_BYTES = 1 << 20  # metadata and serialization headers


def state_bytes(numel: int) -> int:
    """The most bytes a served state of a model with `numel` values takes on the wire."""
    return STATE_BYTES_PER_VALUE * numel + STATE_SLACK_BYTES


@dataclass(frozen=True)
class Download:
    """The deadlines of one whole-state download from one peer."""

    total_s: float  # the whole download
    stall_s: float  # the longest silence between two messages of the stream


def state_download(numel: int, join_timeout_s: float, min_download_mbps: float) -> Download:
    """A state of `numel` values at `min_download_mbps`, never under `join_timeout_s`; silence of
    `join_timeout_s` ends it."""
    at_the_slowest = state_bytes(numel) * 8 / (min_download_mbps * 1e6)
    return Download(total_s=max(join_timeout_s, at_the_slowest), stall_s=join_timeout_s)


def poll_until(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    deadline: float,
    interval_s: float,
    stop: threading.Event | None = None,
    growth: float = 1.0,
    most_s: float | None = None,
) -> T:
    """`probe()` every `interval_s` until `done` holds for its value, the monotonic `deadline`
    passes, or `stop` is set; the last value. It probes at least once (I3: no wait without a
    deadline, and a deadline already past still reads once). With `growth`, each pause is that
    many times the last, up to `most_s`: a long wait reads less often."""
    value, interval = probe(), interval_s
    while not done(value) and time.monotonic() < deadline:
        pause = min(interval, max(0.0, deadline - time.monotonic()))
        if stop is not None and stop.wait(pause):
            return value
        if stop is None:
            time.sleep(pause)  # the poll interval, bounded by the deadline
        value = probe()
        interval = interval * growth if most_s is None else min(interval * growth, most_s)
    return value


def round_poll(probe: Callable[[], T], done: Callable[[T], bool], deadline: float) -> T:
    """`poll_until` for waits on the peers' round records: ROUND_POLL_S, growing to ROUND_POLL_MAX_S."""
    return poll_until(probe, done, deadline, ROUND_POLL_S, growth=ROUND_POLL_GROWTH, most_s=ROUND_POLL_MAX_S)
