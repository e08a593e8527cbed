"""Convictions in the peer's process: others' accusations checked (swarm/averaging/evidence.py).

Each peer's progress record carries the peers it convicted (records.publish_progress), so the
heartbeat reads every accusation with the reports it reads anyway, at no extra DHT request. Each
(accuser, accused) pair is judged once, by the averager process, from the case the accuser
serves; a pair whose case holds convicts the peer here too (Gate.convict): its records count no
more, and the averager refuses it at every door.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from p2p_diloco.swarm.trust.gate import Gate

logger = logging.getLogger(__name__)

MAX_PENDING = 4  # cases being fetched at once: many accusers cannot make this peer fetch without end


class Convictions:
    """Checks everyone else's accusations."""

    def __init__(self, gate: Gate, peer_id: str):
        self.gate, self.peer_id = gate, peer_id
        self.verify: Callable[[str, str], Any] | None = None  # DiLoCoAverager.verify_accusation, once it runs
        self._tried: set[tuple[str, str]] = set()
        self._pending: list[tuple[str, Any]] = []  # (accused, MPFuture of "convicted")

    def refresh(self, accusations: dict[str, list[str]]) -> None:
        """Collect the verdicts that came in; have the new accusations judged."""
        self._collect()
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
