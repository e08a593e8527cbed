"""`RunDHT`: one node's handle on a run's records in the DHT, and the lock its threads share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

from p2p_diloco.config import Config
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.genesis import Genesis
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.trust import records

Unparsed = list[tuple[Any, Any]]  # (subkey, value) under one key, unparsed (records.read_entries)
Key = Callable[[str], str]  # a record kind's key in the run's namespace, from the prefix (records.rounds_key)


class RunDHT:
    """One node's DHT handle (hivemind's, in a process of its own), the key that signs this node's
    records (`validator`: its libp2p identity, swarm/transport/identity.py), the run's namespace
    (`prefix`, records.run_prefix: the run id and config fingerprint) and the lock the node's
    threads share. Every part of a node that reads or writes the run's records takes this one
    object: HivemindSwarm, Heartbeat, RunIdentity, Gate, RunReader, StateClient, Bootstrap.

    The lock discipline. hivemind's handle is one pipe to the DHT process, shared by the node's
    threads; node.OneSendAtATime keeps each write to it whole, and this lock makes the threads take
    turns for whole exchanges (a call and its answer, or several reads that belong together).
    - **Who holds it.** Calls that wait for the DHT process's answer on behalf of the peer's round,
      its start and its admission: the peer's reads of the round records (`read`) and its round
      record (`publish_round`), its run's configs, geneses and run ids (RunIdentity), the gate's
      certificates and revocations, an observer's poll (RunReader), and calls that are not
      records (`turn`: the node's addresses, the state client's libp2p replica, pinging the entry
      nodes). Each method below says whether it takes the lock.
    - **Who must not.** The heartbeat's own stores and reads (`send_round`, `send_progress`,
      `read_now`): with a member asleep, a call that tries it waits hivemind's 3 s a try, and
      under the lock every read of the swarm by the peer, a survivor's catch-up too, waited behind
      it (I3; tests/swarm/test_sleeping_member.py: 6 s before, under 1.5 s now). Its stores are
      not waited for (one of each kind in flight). A bootstrap node's loop (Bootstrap.serve: the
      thread that uses its handle) reads and publishes its run id without it (`read_now`,
      `publish_run_id`).
    - **Not reentrant.** A reader that admits signers (Gate.admitted) reads the entries under the
      lock and admits and parses them once it is let go (`read`, then records.rounds_from, I4):
      admitting may read certificates under this same lock, and a thread that took it twice
      would wait for itself for ever. Nothing that holds the lock calls Gate.admitted.
    - **Bounded.** Every call under the lock has its deadline (I3): node.SwarmDHT bounds each
      answer of the handle by swarm.join_timeout_s, and StateClient its replica's by its own.
    """

    def __init__(self, dht: Any, validator: Any, prefix: str):
        self.dht, self.validator, self.prefix = dht, validator, prefix
        self._lock = threading.Lock()

    @classmethod
    def of_run(cls, dht: Any, validator: Any, config: Config) -> RunDHT:
        """The handle on the records of `config`'s run (its run id and fingerprint)."""
        return cls(dht, validator, records.run_prefix(config.run.run_id, config.fingerprint()))

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @contextmanager
    def turn(self) -> Iterator[Any]:
        """The DHT handle, under the lock: for calls that are not the run's records, and for
        several reads that belong together."""
        with self._lock:
            yield self.dht

    # --- the run's records, under the lock ---------------------------------------------------

    def read(self, *keys: Key) -> list[Unparsed]:
        """The entries under each of the run's `keys` (records.rounds_key, ...), unparsed: parse
        them once this returned (records.rounds_from, progress_from)."""
        with self._lock:
            return [records.read_entries(self.dht, key(self.prefix)) for key in keys]

    def publish_round(self, record: RoundRecord) -> None:
        """This node's round record, waited for."""
        with self._lock:
            records.publish_round(self.dht, self.validator, self.prefix, record)

    def publish_certificate(self, text: str) -> None:
        with self._lock:
            records.publish_certificate(self.dht, self.validator, self.prefix, text)

    def read_certificates(self) -> dict[str, str]:
        """{peer id: certificate JSON} as each peer published its own; unchecked (admission.check)."""
        with self._lock:
            return records.read_certificates(self.dht, self.prefix)

    def publish_revocations(self, texts: list[str]) -> None:
        with self._lock:
            records.publish_revocations(self.dht, self.validator, self.prefix, texts)

    def read_revocations(self) -> list[str]:
        """Every revocation text published for the run; unchecked (admission.revoked_ids)."""
        with self._lock:
            return records.read_revocations(self.dht, self.prefix)

    # --- records of a run id, whatever its config: under the lock ------------------------------

    def publish_genesis(self, run_id: str, genesis: Genesis) -> None:
        with self._lock:
            records.publish_genesis(self.dht, self.validator, run_id, genesis)

    def read_geneses(self, run_id: str) -> dict[str, Genesis]:
        with self._lock:
            return records.read_geneses(self.dht, run_id)

    def publish_start(self, run_id: str, config: records.PublishedConfig, genesis: Genesis | None) -> None:
        """A starting peer's config, its genesis record (if it is to publish one) and the run id,
        in one turn."""
        with self._lock:
            records.publish_config(self.dht, self.validator, run_id, config)
            if genesis is not None:
                records.publish_genesis(self.dht, self.validator, run_id, genesis)
            records.publish_run_id(self.dht, self.validator, run_id)

    def live_peers(self, run_id: str, fingerprint: str) -> set[str]:
        """records.live_peers of that config of the run id."""
        with self._lock:
            return records.live_peers(self.dht, run_id, fingerprint)

    # --- without the lock: the heartbeat's, and a node whose one thread uses the handle -------

    def send_round(self, record: RoundRecord) -> Any:
        """This node's round record, not waited for: the store's future."""
        return records.publish_round(self.dht, self.validator, self.prefix, record, wait=False)

    def send_progress(self, report: ProgressReport, convicted: Collection[str]) -> Any:
        """This node's progress and accusations, not waited for: the store's future."""
        return records.publish_progress(self.dht, self.validator, self.prefix, report, convicted, wait=False)

    def read_now(self, *keys: Key) -> list[Unparsed]:
        """As `read`, without the lock (see the class's docstring: who must not hold it)."""
        return [records.read_entries(self.dht, key(self.prefix)) for key in keys]

    def publish_run_id(self, run_id: str) -> None:
        """The run id among the DHT's runs (records.RUNS_KEY), waited for, without the lock (a
        bootstrap node's loop)."""
        records.publish_run_id(self.dht, self.validator, run_id)
