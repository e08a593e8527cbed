"""A bootstrap node: a DHT-only peer with a stable address that volunteers use to enter the swarm.

It trains nothing and holds no model; it stores and serves DHT records like any peer, and reports
how many peers it sees and, given the run's config, the rounds they are at.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from p2p_diloco.config import Config
from p2p_diloco.swarm import records
from p2p_diloco.swarm.gate import Gate
from p2p_diloco.swarm.identity import make_validator
from p2p_diloco.swarm.node import start_dht

if TYPE_CHECKING:
    from hivemind import DHT
    from hivemind.dht.node import DHTNode

logger = logging.getLogger(__name__)


class Bootstrap:
    def __init__(self, config: Config, identity_path: Path, watch_run: bool = True):
        identity_path.parent.mkdir(parents=True, exist_ok=True)
        self.config, self.watch_run = config, watch_run
        validator = make_validator(identity_path)
        self.dht = start_dht(config.swarm, identity_path, config.swarm.initial_peers, False, [validator])
        self.prefix = records.run_prefix(config.run.run_id, config.fingerprint())
        # A certified run's bootstrap node counts only admitted peers and logs the ones it refused.
        self.gate = Gate(config, str(self.dht.peer_id), member=False)
        self.gate.attach(self.dht, validator, self.prefix, threading.Lock())

    def initial_peers(self) -> list[str]:
        """The multiaddrs to hand out: `--initial-peers` takes any of them."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def status(self) -> str:
        """One line: peers in the routing table, and the rounds this run's peers published."""
        known = self.dht.run_coroutine(_routing_table_size)
        if not self.watch_run:
            return f"{known} peers in the routing table (pass --config RUN_TOML to see the run's rounds)"
        found = records.read_rounds(self.dht, self.prefix)
        admitted = self.gate.admitted(found)
        rounds = Counter(r.round for p, r in found.items() if p in admitted)
        seen = (
            ", ".join(f"round {r}: {n} peer{'s' if n > 1 else ''}" for r, n in sorted(rounds.items()))
            or "no round records yet"
        )
        return f"{known} peers in the routing table; run {self.config.run.run_id!r}: {seen}"

    def serve(self, stop: threading.Event, report_every_s: float) -> None:
        """Log the status every `report_every_s` seconds until `stop` is set."""
        while not stop.wait(report_every_s):
            logger.info("[bootstrap] %s", self.status())

    def close(self) -> None:
        self.dht.shutdown()


async def _routing_table_size(_dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)
