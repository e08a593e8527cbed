"""A read-only view of a run's DHT records, for the observer and `p2p-diloco status`.

An observer joins the run's DHT as a client node and publishes nothing: no round, progress or
config record, so no peer ever expects it in a group, counts it in agreement or waits for it. (In
a certified run, given a certificate of its own, it publishes that: peers serve their state to
admitted askers only, and the observer downloads the agreed state to evaluate it.) It
reads what every peer reads (swarm/trust/records.py), filtered as a peer filters it: in a certified run
only admitted peers' records count (swarm/trust/gate.py). A bootstrap node can serve the same view from
its own DHT node (`RunReader` over its `run_dht`).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from p2p_diloco.config import Config
from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.heartbeat import Entries
from p2p_diloco.swarm.state_client import StateClient
from p2p_diloco.swarm.transport.identity import make_validator, peer_id_of
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.transport.processes import stop_process
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

# Each admitted peer's latest round record, their progress reports, {accused: accusers},
# {peer: name} from the organiser's certificates and {revoked peer: (reason, unix time issued)}
# (certified runs; both empty in open ones). Revoked peers' records are in, for the view to mark.
Poll = tuple[
    dict[str, RoundRecord], list[ProgressReport], dict[str, list[str]], dict[str, str], dict[str, tuple[str, float]]
]


class RunReader:
    """Reads one run's round records, progress reports and convictions from a DHT node."""

    def __init__(self, config: Config, run_dht: RunDHT, gate: Gate | None = None):
        """`run_dht`: the records of `config`'s run, on a node whose threads take turns with it
        (a bootstrap node's, with its `gate`)."""
        self.config, self.run_dht = config, run_dht
        if gate is None:  # with a certificate of its own, a certified run's peers serve it their state
            gate = Gate(config, run_dht.peer_id, member=bool(config.admission.certificate))
            gate.attach(run_dht)
        self.gate = gate

    def poll(self) -> Poll:
        """One read of the run's records (`Poll`)."""
        round_entries, progress_entries = self.run_dht.read(records.rounds_key, records.progress_key)
        self.gate.refresh_revocations(publish=False)  # a bootstrap node's own loop publishes them

        def admit(peers: set[str]) -> set[str]:  # revoked members are shown, marked
            return self.gate.admitted(peers, revoked_too=True)

        found = records.rounds_from(round_entries, admit)
        progress, accusations = records.progress_from(progress_entries, admit)
        admitted = set(found) | {p.peer for p in progress}
        return (
            found,
            progress,
            records.convicted_by(accusations),
            {p: self.gate.names[p] for p in admitted if p in self.gate.names},
            self.gate.revocations(),
        )

    def healthy(self) -> tuple[bool, str]:
        return (True, "") if self.run_dht.dht.is_alive() else (False, "the DHT process is not running")

    def state_client(self, numel: int) -> StateClient:
        """Downloads the states peers serve, over this node (its caller closes it). In a certified
        run, peers serve admitted askers only: the observer needs a certificate of its own."""
        return StateClient(self.run_dht, numel, self.config.swarm.join_timeout_s)


class Observer(RunReader):
    """A client DHT node of its own that reads the run (an organiser's laptop, a status query)."""

    def __init__(self, config: Config, identity_path: Path | None = None):
        self._folder = None
        if identity_path is None:  # a throwaway identity: an observer needs no stable address
            self._folder = tempfile.TemporaryDirectory()
            identity_path = Path(self._folder.name) / "observer.key"
        validator = make_validator(identity_path)
        dht = start_dht(config.swarm, identity_path, config.swarm.initial_peers, "private", [validator])
        self._published = time.monotonic()
        try:
            super().__init__(config, RunDHT.of_run(dht, validator, config))
            self.entries = Entries(dht, list(config.swarm.initial_peers), identity_path)
        except BaseException:
            stop_process(dht, "DHT process")
            raise

    def poll(self) -> Poll:
        found = super().poll()
        with self.run_dht.turn():  # re-attach to restarted entry nodes
            self.entries.tend(time.time(), found[0], self.run_dht.peer_id)
        if time.monotonic() - self._published >= records.REFRESH_S:  # its certificate, if it has one
            self.gate.publish()
            self._published = time.monotonic()
        return found

    def close(self) -> None:
        stop_process(self.run_dht.dht, "DHT process")
        if self._folder is not None:
            self._folder.cleanup()


def peer_of_run_dir(run_dir: Path) -> str:
    """The peer id of the peer whose run dir this is (from its identity key)."""
    key = run_dir / "identity.key"
    if not key.exists():
        raise SwarmError(f"no identity.key in {run_dir}: is it a swarm peer's run dir? (or pass --peer ID)")
    return peer_id_of(key)
