"""A private peer under swarm.hole_punching: direct connections to the run's other private peers.

Such a peer runs its averager as a node, not a client: it may reduce a span for a group whose
every other member holds a direct connection to it (links.reachable_reducers), and lead a group
of members it holds direct connections to (the averager's door). A thread of its own punches, every
EVERY_S, to the live private peers it holds no direct connection to yet (swarm/transport/punch.py),
and each step shows the group whom it is connected to (`shown`). A peer it could not punch to (a symmetric NAT)
is tried again only after RETRY_S, doubled at each failure up to RETRY_MAX_S: a punch that fails
costs that thread up to PUNCH_S. While a public peer is live, it leads the groups: a private peer
then admits no followers (a second leader could split the round into two groups).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

from p2p_diloco.swarm.transport import punch
from p2p_diloco.swarm.transport.processes import wait_result

logger = logging.getLogger(__name__)

PUNCH_S = 4.0  # the longest one look waits for its punches (measured: 20-30 ms each, once both homes are ready)
EVERY_S = 2.0  # how often the thread looks for private peers it holds no direct connection to
RETRY_S = 60.0  # a peer no punch reached is tried again after this long, doubled at each failure
RETRY_MAX_S = 1800.0


class Punching:
    """This peer's direct connections to other private peers, kept up by a thread of its own."""

    def __init__(self, run_dht: Any, relays: Sequence[str], private_peers: Callable[[], Iterable[str]] = set):
        """`run_dht`: the peer's RunDHT (its handle's turns); `relays`: the relays to reach other
        private peers through (swarm.relays or the entry nodes: the run's private peers hold their
        slots there too); `private_peers()`: the run's live private peers now, whom `start`'s thread
        punches to every EVERY_S."""
        self._run_dht, self._relays, self._private_peers = run_dht, list(relays), private_peers
        self._failed: dict[str, tuple[float, int]] = {}  # peer -> (when a punch to it last failed, failures)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hole punching", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=PUNCH_S + 10)

    def _loop(self) -> None:
        # Apart from the steps: a punch that fails takes PUNCH_S, and a step that waited for it would
        # miss its group (seen in the lab: a cone home, retrying a symmetric one, missed a round).
        while True:
            try:
                self.reach(self._private_peers())
            except Exception as e:  # the next look tries again; never kill the peer
                logger.debug("hole punching failed: %s", e)
            if self._stop.wait(EVERY_S):
                return

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
        wanted = [p for p in private_peers if p not in connected and self._due(p, now)]
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
                self._failed[peer] = (time.monotonic(), self._failed.get(peer, (0.0, 0))[1] + 1)
                logger.info("no direct connection to private peer %s within %g s (hole punching)", peer, PUNCH_S)
            else:
                logger.info("punched a direct connection to private peer %s in %.2f s", peer, took)
        return connected | {p for p, took in times.items() if took is not None}

    def _due(self, peer: str, now: float) -> bool:
        """Whether to try `peer` again: never failed, or RETRY_S after its last failure, doubled at
        each (a symmetric NAT's peer fails every time; each try costs a step up to PUNCH_S)."""
        if peer not in self._failed:
            return True
        when, failures = self._failed[peer]
        return now - when >= min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))

    def shown(self, connected: set[str]) -> dict[str, Any]:
        """What this peer shows its group (gathered.Entry): it does not serve, and whom it holds
        direct connections to."""
        return {"serves": False, "direct": sorted(connected)}
