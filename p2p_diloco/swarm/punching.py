"""A private peer under swarm.hole_punching: direct connections to the run's other private peers.

Such a peer runs its averager as a node, not a client: it may reduce a span for a group whose
every other member holds a direct connection to it (links.reachable_reducers), and lead a group
of members it holds direct connections to (the averager's door). Before each step it punches to
the live private peers it holds no direct connection to yet (swarm/transport/punch.py), and it
shows the group whom it is connected to (`shown`). A peer it could not punch to (a symmetric NAT)
is tried again only after RETRY_S: a punch that fails costs up to PUNCH_S of the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

from p2p_diloco.swarm.transport import punch
from p2p_diloco.swarm.transport.processes import wait_result

logger = logging.getLogger(__name__)

PUNCH_S = 4.0  # the longest a step waits for punches (measured: 20-30 ms each, once both homes are ready)
RETRY_S = 60.0  # a peer no punch reached is tried again after this long


class Punching:
    """This peer's direct connections to other private peers, kept up before each step."""

    def __init__(self, run_dht: Any, entry_nodes: Sequence[str]):
        """`run_dht`: the peer's RunDHT (its handle's turns); `entry_nodes`: the relays to reach
        other private peers through (theirs are the run's entry nodes too)."""
        self._run_dht, self._relays = run_dht, list(entry_nodes)
        self._failed: dict[str, float] = {}  # peer -> when a punch to it last failed

    def direct(self) -> set[str]:
        """The peers this node holds a direct connection to now."""
        with self._run_dht.turn() as dht:
            future = dht.run_coroutine(punch.direct_of, return_future=True)
        return set(wait_result(dht, future, "DHT process", dht.timeout_s))

    def reach(self, private_peers: Iterable[str]) -> set[str]:
        """Punch to each of `private_peers` not directly connected yet (and not failed lately), at
        once, for at most PUNCH_S; the peers directly connected afterwards."""
        connected = self.direct()
        now = time.monotonic()
        wanted = [p for p in private_peers if p not in connected and now - self._failed.get(p, -RETRY_S) >= RETRY_S]
        if not wanted:
            return connected
        with self._run_dht.turn() as dht:
            future = dht.run_coroutine(punch.punch_job(wanted, self._relays, PUNCH_S), return_future=True)
        try:
            times = wait_result(dht, future, "DHT process", PUNCH_S + dht.timeout_s)
        except FuturesTimeout:
            future.cancel()
            times = dict.fromkeys(wanted)
        for peer, took in times.items():
            if took is None:
                self._failed[peer] = time.monotonic()
                logger.info("no direct connection to private peer %s within %g s (hole punching)", peer, PUNCH_S)
            else:
                logger.info("punched a direct connection to private peer %s in %.2f s", peer, took)
        return connected | {p for p, took in times.items() if took is not None}

    def shown(self, connected: set[str]) -> dict[str, Any]:
        """What this peer shows its group (gathered.Entry): it does not serve, and whom it holds
        direct connections to."""
        return {"serves": False, "direct": sorted(connected)}
