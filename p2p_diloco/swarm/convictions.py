"""Convictions in the peer's process: this peer's published, others' checked (swarm/evidence.py).

On every heartbeat (at most every POLL_S) it publishes the reducers this peer convicted, reads the
run's accusations, and has the averager process judge each (accuser, accused) pair once, from the
case the accuser serves; a pair whose case holds convicts the reducer here too (Gate.convict):
its records count no more, and the averager refuses it at every door.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.swarm import records
from p2p_diloco.swarm.gate import Gate

logger = logging.getLogger(__name__)

POLL_S = 2.0
MAX_PENDING = 4  # cases being fetched at once: many accusers cannot make this peer fetch without end


class Convictions:
    """Publishes this peer's convictions and checks everyone else's accusations."""

    def __init__(self, gate: Gate, peer_id: str):
        self.gate, self.peer_id = gate, peer_id
        self.verify: Callable[[str, str], Any] | None = None  # DiLoCoAverager.verify_accusation, once it runs
        self._tried: set[tuple[str, str]] = set()
        self._pending: list[tuple[str, Any]] = []  # (accused, MPFuture of "convicted")
        self._published: frozenset[str] = frozenset()
        self._published_at = 0.0
        self._read_at = 0.0

    def refresh(self, dht: Any, validator: Any, prefix: str, lock: threading.Lock) -> None:
        now = time.time()
        self._collect()
        if now - self._read_at < POLL_S:
            return
        self._read_at = now
        mine = frozenset(self.gate.convicted)
        if mine and (mine != self._published or now - self._published_at >= records.REFRESH_S):
            with lock:
                records.publish_convictions(dht, validator, prefix, sorted(mine))
            self._published, self._published_at = mine, now
        with lock:
            accusations = records.read_convictions(dht, prefix)
        self._check(accusations)

    def _check(self, accusations: dict[str, list[str]]) -> None:
        if self.verify is None:
            return
        for accuser, accused in sorted(accusations.items()):
            for peer in accused:
                pair = (accuser, peer)
                judging = {p for p, _ in self._pending}
                settled = peer in self.gate.convicted or peer in judging or pair in self._tried
                if accuser == self.peer_id or peer == self.peer_id or settled:
                    continue
                if len(self._pending) >= MAX_PENDING:
                    return
                self._tried.add(pair)
                self._pending.append((peer, self.verify(accuser, peer)))

    def _collect(self) -> None:
        for item in list(self._pending):
            peer, future = item
            if not future.done():
                continue
            self._pending.remove(item)
            try:
                if future.result():
                    self.gate.convict([peer])
            except Exception as e:  # the averager process could not judge it: tried again never
                logger.debug("could not judge the case against %s: %s", peer, e)
