"""Admission in the averager process (certified runs): the doors that hivemind's RPCs come through.

- **Matchmaking.** As a group's leader, this peer accepts a join request only from a peer whose
  certificate (sent with the request) admits the request's transport-authenticated peer id and
  that the organiser has not revoked. As a follower, it asks only admitted peers to lead it.
- **The all-gather.** Every member's certificate is checked again before any part is sent, so a
  leader that accepted an outsider cannot slip it into a group: the group fails, nothing averaged.
- **State downloads and link probes** are served only to admitted peers, looked up from the
  certificates they published in the DHT.

Verdicts are cached per peer id until the certificate expires; a refused peer is looked up again
after RECHECK_S, and each refusal is logged once per peer and door. The revocations come from the
host process (gate.py) before every step.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.averaging.allreduce import AllreduceException
from hivemind.utils import get_logger

from p2p_diloco.errors import AdmissionError
from p2p_diloco.trust import admission

logger = get_logger(__name__)

RECHECK_S = 30.0  # a refused peer's published certificate is looked up again after this long


class Doors:
    """Who may enter this peer's averager: cached certificate verdicts and the run's revocations."""

    def __init__(self, run_id: str, organiser_key: str, published: Callable[[], Awaitable[dict[str, str]]]):
        """`published`: reads the run's published certificates from the DHT ({peer id: JSON})."""
        self.run_id = run_id
        self._organiser = admission.parse_public_key(organiser_key)
        self._published = published
        self.revoked: frozenset[str] = frozenset()
        self._until: dict[str, float] = {}  # peer id -> when its certificate expires
        self._recheck: dict[str, float] = {}  # refused peer id -> when to look it up again
        self._logged: set[tuple[str, str]] = set()

    def set_revoked(self, revoked: frozenset[str]) -> None:
        self.revoked = frozenset(revoked)
        for peer in self.revoked:
            self._until.pop(peer, None)

    def reason_to_refuse(self, peer: str, certificate: Any) -> str | None:
        """Why `certificate` (untrusted JSON) does not admit `peer` now, or None if it does."""
        now = time.time()
        if peer in self.revoked:
            return "the organiser revoked it"
        if self._until.get(peer, 0.0) > now:
            return None
        if not isinstance(certificate, str):
            return "it showed no certificate"
        try:
            cert = admission.Certificate.parse(certificate)
            admission.check(cert, self._organiser, self.run_id, peer, now)
        except AdmissionError as e:
            return str(e)
        self._until[peer] = float(cert.expires)
        self._recheck.pop(peer, None)
        return None

    def check_member(self, peer: str, certificate: str | None) -> None:
        """Fail the group (before a part is sent) if its member `peer` is not admitted."""
        reason = self.reason_to_refuse(peer, certificate)
        if reason is not None:
            self.log_refusal(peer, "group", reason)
            raise AllreduceException(f"group member {peer} is not admitted to this run ({reason}): nothing averaged")

    async def admitted(self, peer: str) -> bool:
        """Whether `peer` is admitted, from the cache or the certificate it published in the DHT."""
        now = time.time()
        if peer in self.revoked:
            return False
        if self._until.get(peer, 0.0) > now:
            return True
        if self._recheck.get(peer, 0.0) > now:
            return False
        published = await self._published()
        reason = self.reason_to_refuse(peer, published.get(peer))
        if reason is not None:
            self._recheck[peer] = now + RECHECK_S
        return reason is None

    def log_refusal(self, peer: str, door: str, reason: str) -> None:
        if (peer, door) in self._logged or len(self._logged) > 4096:
            return
        self._logged.add((peer, door))
        logger.warning("refused peer %s at the %s door: %s", peer, door, reason)
