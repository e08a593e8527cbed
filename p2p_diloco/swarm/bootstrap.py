"""A bootstrap node: a DHT-only peer with a stable address that volunteers use to enter the swarm.

It trains nothing and holds no model; it stores and serves DHT records like any peer, and reports
how many peers it sees and, given the run's config, the rounds they are at. In a certified run it
counts only admitted peers, logs those it refused, and keeps the organiser's revocations alive.

`publish_revocation` is the organiser's side of a revocation: a short-lived client node that puts
it into the run's DHT and waits until peers of the run publish it again.
"""

from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p_diloco.config import Config
from p2p_diloco.protocol import cadence
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.deadlines import COMMAND_POLL_S, poll_until
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.heartbeat import STALE_S, Entries
from p2p_diloco.swarm.transport import entry
from p2p_diloco.swarm.transport.identity import make_validator
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.transport.processes import stop_process
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import REVOCATIONS_POLL_S, Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.dht.node import DHTNode

logger = logging.getLogger(__name__)


class Bootstrap:
    def __init__(self, config: Config, identity_path: Path, watch_run: bool = True, metrics_port: int | None = None):
        """`metrics_port`: its p2pd serves Prometheus metrics on 127.0.0.1 there (0: a free port,
        `.metrics_port`)."""
        identity_path.parent.mkdir(parents=True, exist_ok=True)
        self.config, self.watch_run = config, watch_run
        validator = make_validator(identity_path, entry_node=True)
        swarm = config.swarm
        self.dht = start_dht(swarm, identity_path, swarm.initial_peers, "public", [validator], metrics_port)
        self.metrics_port = self.dht.metrics_port
        try:
            self._watch(validator, identity_path)
        except BaseException:  # also Ctrl+C during start-up: never leave the DHT process behind
            self.close()
            raise

    def _watch(self, validator: Any, identity_path: Path) -> None:
        config = self.config
        # The run's records, read and written by this node's loop (`serve`), and in turns with it
        # by an observer over this node (cli's --observe-port, the demo's dashboard: RunReader).
        self.run_dht = RunDHT.of_run(self.dht, validator, config)
        # A certified run's bootstrap node counts only admitted peers and logs the ones it refused.
        # Given a certificate of its own (`bootstrap --certificate`), it publishes that, so that
        # peers serve its observer their state to evaluate.
        self.gate = Gate(config, str(self.dht.peer_id), member=bool(config.admission.certificate))
        self.gate.attach(self.run_dht)
        # Other entry nodes (--initial-peers) are pinged every entry.REATTACH_S, and so are the
        # peers this node saw before a restart: it knows the swarm again within seconds (entry.py).
        self.entries = Entries(self.dht, list(config.swarm.initial_peers), identity_path)
        self.remembered = tuple(entry.remembered(identity_path))
        self._run_id_published, self._certificate_published = -math.inf, time.monotonic()
        self._rounds_seen: dict[str, RoundRecord] = {}
        self._rounds_read_at = -math.inf

    def _publish_run_id(self) -> None:
        """The run this node watches is a run id that a peer with a typo is pointed at (protocol/genesis.py)."""
        if self.watch_run and time.monotonic() - self._run_id_published > records.RUNS_TTL_S / 4:
            self.run_dht.publish_run_id(self.config.run.run_id)
            self._run_id_published = time.monotonic()

    def initial_peers(self) -> list[str]:
        """The multiaddrs to hand out: `--initial-peers` takes any of them."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def status(self) -> str:
        """One line: peers in the routing table, and the rounds this run's peers published."""
        known = self.dht.run_coroutine(_routing_table_size)
        if not self.watch_run:
            unwatched = "peers in the routing table (pass --config RUN_TOML to see the run's rounds)"
            return f"{known} {unwatched}"
        round_entries, progress_entries = self.run_dht.read_now(records.rounds_key, records.progress_key)
        found = records.rounds_from(round_entries, self.gate.admitted)
        reports, _ = records.progress_from(progress_entries, self.gate.admitted)
        seen = rounds_seen(found, reports, time.time())
        return f"{known} peers in the routing table; run {self.config.run.run_id!r}: {seen}"

    def serve(self, stop: threading.Event, report_every_s: float, observatory: Any = None) -> None:
        """Log the status every `report_every_s` seconds until `stop` is set; meanwhile read (and
        publish again) the organiser's revocations, and feed `observatory` (service.Observatory,
        with its `reader`) every `observatory.poll_s` seconds, sooner while rounds are fast (its
        `poll_in_s`; this loop turns every REVOCATIONS_POLL_S, 1 s): this one thread uses the DHT handle."""
        try:
            self._serve(stop, report_every_s, observatory)
        finally:
            if observatory is not None:
                observatory.close()

    def _serve(self, stop: threading.Event, report_every_s: float, observatory: Any) -> None:
        last_report = last_poll = time.monotonic()
        while not stop.wait(min(report_every_s, REVOCATIONS_POLL_S)):
            if observatory is not None and time.monotonic() - last_poll >= observatory.poll_in_s() - 0.05:
                observatory.ingest(observatory.reader.poll())
                last_poll = time.monotonic()
            seen = self._rounds() if self.watch_run else {}  # read every cadence.ROUNDS_EVERY_S
            self.entries.tend(time.time(), seen, str(self.dht.peer_id), also=self.remembered)
            if self.watch_run:
                self.gate.refresh_revocations()
            self._publish_run_id()
            if time.monotonic() - self._certificate_published >= records.REFRESH_S:  # if it has one
                self.gate.publish()
                self._certificate_published = time.monotonic()
            if time.monotonic() - last_report >= report_every_s:
                logger.info("[bootstrap] %s", self.status())
                last_report = time.monotonic()

    def _rounds(self) -> dict[str, RoundRecord]:
        """The run's round records, read again once cadence.ROUNDS_EVERY_S passed: the loop turns every
        second, and a read costs every peer's record from each DHT node asked (protocol/cadence.py)."""
        if time.monotonic() - self._rounds_read_at >= cadence.ROUNDS_EVERY_S:
            (entries,) = self.run_dht.read_now(records.rounds_key)
            self._rounds_seen = records.rounds_from(entries, self.gate.admitted)
            self._rounds_read_at = time.monotonic()
        return self._rounds_seen

    def close(self) -> None:
        stop_process(self.dht, "DHT process")


def publish_revocation(config: Config, revocation: str, timeout_s: float) -> set[str]:
    """Publish the organiser's `revocation` (JSON) into the run's DHT from a throwaway client node,
    and wait up to `timeout_s` until peers of the run publish it again (each verified it). Returns
    those peers' ids (empty if none did in time)."""
    with tempfile.TemporaryDirectory() as folder:
        identity = Path(folder) / "organiser-node.key"
        validator = make_validator(identity)
        dht = start_dht(config.swarm, identity, config.swarm.initial_peers, "private", [validator])
        try:
            run_dht = RunDHT.of_run(dht, validator, config)
            run_dht.publish_revocations([revocation])
            holders = lambda: records.revocation_holders(dht, run_dht.prefix, revocation) - {run_dht.peer_id}  # noqa: E731
            return poll_until(holders, bool, time.monotonic() + timeout_s, COMMAND_POLL_S)
        finally:
            stop_process(dht, "DHT process")


def read_convictions(config: Config, timeout_s: float) -> dict[str, list[str]]:
    """{accused: accusers} from the run's progress records (records.convicted_by), read from a
    throwaway client node; empty if none was published within `timeout_s`."""
    prefix = records.run_prefix(config.run.run_id, config.fingerprint())
    with tempfile.TemporaryDirectory() as folder:
        identity = Path(folder) / "organiser-node.key"
        dht = start_dht(config.swarm, identity, config.swarm.initial_peers, "private", [make_validator(identity)])
        try:
            read = lambda: records.convicted_by(records.read_progress(dht, prefix)[1])  # noqa: E731
            return poll_until(read, bool, time.monotonic() + timeout_s, COMMAND_POLL_S)
        finally:
            stop_process(dht, "DHT process")


async def _routing_table_size(_dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def rounds_seen(found: dict[str, RoundRecord], reports: list[ProgressReport], now: float) -> str:
    """The run's peers by round, counting only those whose heartbeat is fresh (`STALE_S`): a round
    record lives records.RECORD_TTL_S (90 s) after its peer stopped, so records alone would show a
    run that ended as training. Stopped peers are counted apart. By reports alone, not
    agreement.live: one status line, with no memory of when each peer was first seen."""
    beating = {r.peer for r in reports if now - r.time <= STALE_S}
    rounds = Counter(r.round for p, r in found.items() if p in beating)
    stopped = len(set(found) - beating)
    seen = ", ".join(f"round {r}: {n} peer{'s' if n > 1 else ''}" for r, n in sorted(rounds.items()))
    if stopped:
        seen += f"{'; ' if seen else ''}{stopped} stopped (no heartbeat for {STALE_S:g} s)"
    return seen or "no round records yet"
