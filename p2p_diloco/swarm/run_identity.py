"""The run beyond its name, as the DHT holds it: configs and genesis records of a run id, read,
judged (genesis.judge, pure) and published. A peer that would start a second run under the same
name is refused, one that comes after the end is told, one with a new name is told it is new."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from p2p_diloco.config import Config, diff_shared
from p2p_diloco.errors import RunConfigMismatch
from p2p_diloco.protocol import genesis
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

logger = logging.getLogger(__name__)

MAX_CONFIGS = 8  # configs of one run id looked at (each costs a DHT read)
LOOKS = 3  # reads of another config's live peers before a refused peer is told none is live


class RunIdentity:
    """One peer's view of its run's configs and genesis."""

    def __init__(self, config: Config, run_dht: RunDHT, gate: Gate, peer_id: str):
        """`run_dht`: its records are those of every config of the run id, read and written in turns."""
        self.config, self.run_dht, self.gate, self.peer_id = config, run_dht, gate, peer_id
        self.genesis = Genesis(config.fingerprint(), "", shared=config.shared_dict())

    def check(self, theta0: str) -> Verdict:
        """Judge the run this peer found (genesis.judge): refuse to start beside the run's peers if
        they hold another config, or in place of another config's run (I5); then publish this
        peer's config, its genesis record (`theta0`: the digest of its θ(0)) and its run id."""
        run_id, mine = self.config.run.run_id, self.config.fingerprint()
        with self.run_dht.turn() as dht:  # one turn: believes_config checks a signature, reads nothing
            published = records.read_configs(dht, run_id)
            found = records.read_geneses(dht, run_id)
            seen_runs = records.read_run_ids(dht)
            counted = [c for c in published.values() if self.gate.believes_config(c.signature, c.fingerprint)]
            fingerprints = [mine] + [c.fingerprint for c in counted if c.fingerprint != mine][:MAX_CONFIGS]
            live = {fp: len(records.live_peers(dht, run_id, fp) - {self.peer_id}) for fp in fingerprints}
        if len(published) > len(counted):
            logger.warning(
                "ignored %d config(s) published under run %r without the organiser's signature",
                len(published) - len(counted),
                run_id,
            )
        geneses = self._believed(found)
        verdict = genesis.judge(mine, live, geneses, self.config.run.rounds)
        if verdict.kind == "other":
            if not live.get(verdict.rival):  # a new node's first reads may come back incomplete
                live[verdict.rival] = self._live_on_second_look(run_id, verdict.rival)
            raise RunConfigMismatch(self._mismatch(verdict, published, geneses, live))
        self._publish_start(theta0, geneses)
        return replace(verdict, nearby=tuple(genesis.nearby_runs(run_id, seen_runs)))

    def _live_on_second_look(self, run_id: str, fingerprint: str) -> int:
        """Live peers of the run's other config, read again LOOKS times a second apart before this
        peer is told none is live: a node that just joined the DHT may not yet reach every record,
        and a refused peer would be told "none is live now" of a run that trains."""
        for _ in range(LOOKS):
            time.sleep(1.0)  # a DHT re-read interval, bounded by LOOKS
            found = len(self.run_dht.live_peers(run_id, fingerprint) - {self.peer_id})
            if found:
                return found
        return 0

    def _believed(self, found: dict[str, Genesis]) -> dict[str, Genesis]:
        """The genesis records that count: from admitted peers, and in certified runs only those
        whose config the organiser signed."""
        admitted = self.gate.admitted(found)
        return {
            p: g for p, g in found.items() if p in admitted and self.gate.believes_config(g.signature, g.fingerprint)
        }

    def _mismatch(
        self, verdict: Verdict, published: dict[str, Any], geneses: dict[str, Genesis], live: dict[str, int]
    ) -> str:
        run_id, rival = self.config.run.run_id, verdict.rival
        shared = (
            published[rival].shared
            if rival in published
            else next((g.shared for g in geneses.values() if g.fingerprint == rival), {})
        )
        differ = "; ".join(diff_shared(shared, self.config.shared_dict())) or "unknown (no peer published them)"
        how = (
            f"{live[rival]} peer(s) live"
            if live.get(rival)
            else f"started by its genesis, published by {verdict.publishers} peer(s); none is live now"
        )
        return (
            f"run {run_id!r} is running with another config (fingerprint {rival}, {how}); fields that differ "
            f"(run != this peer): {differ}; use the run's config file, or choose a new run.run_id for a new run"
        )

    def _publish_start(self, theta0: str, geneses: dict[str, Genesis]) -> None:
        config, run_id = self.config, self.config.run.run_id
        shared, signature = config.shared_dict(), config.admission.config_signature
        self.genesis = Genesis(config.fingerprint(), theta0, signature=signature, shared=shared)
        published = records.PublishedConfig(config.fingerprint(), shared, signature)
        start = self.genesis if genesis.should_publish(geneses, self.genesis) else None
        self.run_dht.publish_start(run_id, published, start)

    def publish_final(self, round_: int, digest: str) -> None:
        """This peer finished the run's last round with `digest`: the run's genesis says so from
        now on (a peer that comes later is told the run is over instead of training it alone)."""
        final = self.genesis.finished_at(round_, digest)
        if genesis.should_publish(self._geneses(), final):
            self.run_dht.publish_genesis(self.config.run.run_id, final)

    def final_state(self) -> Genesis | None:
        """The run's end as the genesis records claim it (genesis.final_claim), if any."""
        return genesis.final_claim(self._geneses(), self.config.fingerprint(), self.config.run.rounds)

    def _geneses(self) -> dict[str, Genesis]:
        """The run's genesis records that count. Read under the DHT lock, judged after it: in a
        certified run the gate reads the certificates of publishers it does not know yet, under
        the same lock (not reentrant: taken inside, it would deadlock every certified peer's start)."""
        return self._believed(self.run_dht.read_geneses(self.config.run.run_id))
