"""Admission at the swarm's doors (admission.mode = certified): who counts as a member of the run.

- **This peer** must hold a certificate for its own id before it touches the network; without one
  it stops with one line that names the fix (send the id to the organiser).
- **Records**: each peer publishes its certificate in the DHT, signed by its own key; the round and
  progress records of a peer count only once its certificate verified (checked once, cached until
  it expires).
- **Revocations**: the organiser's signed revocations arrive through the DHT (read every
  REVOCATIONS_POLL_S); every peer that verified one publishes it again under its own key, so it
  outlives the organiser's node. A revoked peer is admitted nowhere from then on, and stops itself
  (`check_self`, exit 2) at its next round.
- **The run's config**: only a config the organiser signed counts (`believes_config`); this peer's
  own must carry that signature (admission.config_signature).
- **Groups, state downloads, link probes** are checked in the averager process (doors.py), from the
  certificates members send and publish, and the revocations this class hands it every round.

In `open` mode every door is open and this class admits everyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from p2p_diloco.config import Config
from p2p_diloco.errors import AdmissionError
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.run_dht import RunDHT
from p2p_diloco.trust import admission

logger = logging.getLogger(__name__)

RECHECK_S = 30.0  # a peer without a valid certificate is looked up again after this long
REVOCATIONS_POLL_S = 1.0  # how often the heartbeat reads the run's revocations (one DHT read)


class Gate:
    """This peer's admission checks, with verdicts cached per peer id."""

    def __init__(self, config: Config, peer_id: str, member: bool = True):
        """`member`: this node trains in the run and needs a certificate (a bootstrap node does not)."""
        self.certified = config.admission.mode == "certified"
        self.run_id, self.peer_id = config.run.run_id, peer_id
        self.organiser = admission.parse_public_key(config.admission.organiser_key) if self.certified else None
        self.certificate = self._own_certificate(config) if self.certified and member else None
        if self.certificate is not None:
            self._check_own_config(config)
        self._admitted_until: dict[str, float] = {}  # peer id -> when its certificate expires
        self._refused_until: dict[str, float] = {}  # peer id -> when to look it up again
        self._revocations: dict[str, str] = {}  # peer id -> the organiser's revocation (JSON)
        self.convicted: set[str] = set()  # reducers this peer convicted in an audit (swarm/averaging/auditor.py)
        self.names: dict[str, str] = {}  # peer id -> the name its certificate gives (certified runs)
        self._revocations_read = self._revocations_published = 0.0
        self._dht: RunDHT | None = None  # once attached: the run's records, in the node's turns

    def _own_certificate(self, config: Config) -> admission.Certificate:
        """This peer's certificate, checked: AdmissionError (exit 2) naming the fix if there is none."""
        fix = f"this run admits certified peers only: send your id ({self.peer_id}) to the organiser"
        if not config.admission.certificate:
            raise AdmissionError(f"{fix}, then pass their certificate as --admission.certificate FILE")
        try:
            cert = admission.read_certificate(Path(config.admission.certificate))
            assert self.organiser is not None
            admission.check(cert, self.organiser, self.run_id, self.peer_id, time.time())
        except AdmissionError as e:
            raise AdmissionError(f"{e}; {fix} for a new certificate") from None
        return cert

    def _check_own_config(self, config: Config) -> None:
        """A certified run's peer trains only on the config its organiser signed."""
        try:
            admission.check_config_signature(
                config.admission.config_signature, config.admission.organiser_key, self.run_id, config.fingerprint()
            )
        except AdmissionError:
            raise AdmissionError(
                f"this config (fingerprint {config.fingerprint()}) is not the one the organiser signed for run "
                f"{self.run_id!r}: use the run.toml the organiser published (its [admission] config_signature)"
            ) from None

    def believes_config(self, signature: str, fingerprint: str) -> bool:
        """Whether a config published under the run id counts: any in open runs; in certified runs
        only one the organiser signed."""
        if not self.certified:
            return True
        try:
            assert self.organiser is not None
            admission.ConfigSignature(self.run_id, fingerprint, signature).verify(self.organiser)
        except AdmissionError:
            return False
        return True

    def check_self(self) -> None:
        """AdmissionError (exit 2) once the organiser revoked this peer, or its certificate expired."""
        if self.peer_id in self._revocations:
            reason = admission.Revocation.parse(self._revocations[self.peer_id]).reason
            raise AdmissionError(
                f"the organiser revoked this peer's admission to run {self.run_id!r} ({reason or 'no reason given'})"
            )
        if self.certificate is not None and self.certificate.expires <= time.time():
            raise AdmissionError(
                f"this peer's certificate expired (unix time {self.certificate.expires}): send your id "
                f"({self.peer_id}) to the organiser for a new one"
            )

    @property
    def revoked(self) -> frozenset[str]:
        return frozenset(self._revocations)

    def revocations(self) -> dict[str, tuple[str, float]]:
        """{revoked peer: (the organiser's reason, unix time issued)}, for observers."""
        found = {p: admission.Revocation.parse(text) for p, text in self._revocations.items()}
        # one printable line of at most 200 characters, as `admission revoke` writes it
        return {
            p: ("".join(c for c in " ".join(r.reason.split()) if c.isprintable())[:200], float(r.issued))
            for p, r in found.items()
        }

    def refresh_revocations(self, publish: bool = True) -> None:
        """Read the run's revocations (every REVOCATIONS_POLL_S); publish those verified again
        (not `publish`: an observer, which publishes nothing of the run's)."""
        now = time.time()
        if not self.certified or self._dht is None or now - self._revocations_read < REVOCATIONS_POLL_S:
            return
        self._revocations_read = now
        texts = self._dht.read_revocations()
        assert self.organiser is not None
        found = admission.revoked_ids(texts, self.organiser, self.run_id)
        new = set(found) - set(self._revocations)
        for peer in sorted(new):
            logger.warning("the organiser revoked peer %s (%s)", peer, admission.Revocation.parse(found[peer]).reason)
            self._admitted_until.pop(peer, None)
        self._revocations.update(found)
        if publish and self._revocations and (new or now - self._revocations_published >= records.REFRESH_S):
            self._dht.publish_revocations(list(self._revocations.values()))
            self._revocations_published = now

    def attach(self, dht: RunDHT) -> None:
        """The DHT is up: publish this peer's certificate (again every records.REFRESH_S)."""
        self._dht = dht
        self.publish()

    def publish(self) -> None:
        if self.certificate is None or self._dht is None:
            return
        self._dht.publish_certificate(self.certificate.to_json())

    def gather(self) -> dict[str, str]:
        """What this peer adds to a group's all-gather: its certificate (certified runs)."""
        return {"cert": self.certificate.to_json()} if self.certificate is not None else {}

    def averager_check(self) -> tuple[str, str] | None:
        """What the averager process needs to check a group's certificates: (run id, organiser key)."""
        return (self.run_id, admission.public_key_text(self.organiser)) if self.organiser is not None else None

    def convict(self, peers: Iterable[str]) -> None:
        """Peers this peer convicted (swarm/averaging/auditor.py, swarm/averaging/evidence.py) or caught signing what
        they did not send (swarm/averaging/ledger.py): their records count no more."""
        new = set(peers) - self.convicted
        for peer in sorted(new):
            logger.warning("records of peer %s count no more: it lied in an all-reduce", peer)
        self.convicted |= new

    def admitted(self, peers: Iterable[str], revoked_too: bool = False) -> set[str]:
        """Those of `peers` that hold a valid certificate (all of them in open mode), less those
        this peer convicted in an audit, and those the organiser revoked unless `revoked_too` (an
        observer shows them, marked)."""
        peers = set(peers) - self.convicted
        if not self.certified:
            return peers
        now = time.time()
        unknown = {
            p for p in peers if self._admitted_until.get(p, 0.0) <= now and self._refused_until.get(p, 0.0) <= now
        }
        if unknown:
            self._look_up(unknown, now)
        return {
            p
            for p in peers
            if (p == self.peer_id or self._admitted_until.get(p, 0.0) > now)
            and (revoked_too or p not in self._revocations)
        }

    def _look_up(self, unknown: set[str], now: float) -> None:
        """Read the run's published certificates and check those of `unknown` peers."""
        if self._dht is None:
            return
        published = self._dht.read_certificates()
        assert self.organiser is not None
        for peer in unknown:
            try:
                cert = admission.Certificate.parse(published.get(peer, ""))
                admission.check(cert, self.organiser, self.run_id, peer, now)
                self._admitted_until[peer] = float(cert.expires)
                self.names[peer] = cert.name
            except AdmissionError as e:
                if peer not in self._refused_until:
                    self._say_refused(peer, e if peer in published else None)
                self._refused_until[peer] = now + RECHECK_S

    @staticmethod
    def _say_refused(peer: str, problem: AdmissionError | None) -> None:
        """Once per peer. A certificate that fails its check is news (WARNING). None found may be a
        DHT read that came back incomplete, as a reader's first ones do (export in a certified
        run): a warning would call an admitted peer uncertified, so that is said as it is, at INFO."""
        if problem is not None:
            logger.warning("refused peer %s: %s", peer, problem)
        else:
            logger.info("peer %s not counted: no certificate of it seen yet (looked up again in %g s)", peer, RECHECK_S)
