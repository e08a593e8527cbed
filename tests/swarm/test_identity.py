"""Forged round records on a real DHT: one under an honest peer's id signed by another key, one
under a made-up id. Both reach the DHT and both are dropped by every reader."""

import logging
import sys

import pytest
from hivemind.utils import logging as hivemind_logging

from p2p_diloco import config
from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.transport.identity import make_validator, owner_peer_id
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.trust import records
from tests.swarm.conftest import SWARM

HONEST, FORGED = "a" * 32, "f" * 32


@pytest.mark.timeout(120)
def test_records_under_ids_their_signer_does_not_own_are_ignored(tmp_path):
    cfg = config.load(None, SWARM)
    prefix = records.run_prefix(cfg.run.run_id, cfg.fingerprint())
    started = []
    try:
        nodes = []
        for name in ("honest", "impersonator", "forger"):  # each its own DHT process and key
            validator = make_validator(tmp_path / f"{name}.key")
            peers = nodes[0][0].get_visible_maddrs() if nodes else []
            dht = start_dht(cfg.swarm, tmp_path / f"{name}.key", [str(m) for m in peers], "public", [validator])
            started.append(dht)
            nodes.append((dht, validator))
        (honest, honest_key), (impersonator, impersonator_key), (forger, forger_key) = nodes
        me = str(honest.peer_id)
        assert owner_peer_id(honest_key.local_public_key) == me
        records.publish_round(honest, honest_key, prefix, RoundRecord(me, 3, HONEST, 10, 1.0))
        # later, so fresher: before the binding the freshest record of an id won
        records.publish_round(impersonator, impersonator_key, prefix, RoundRecord(me, 9, FORGED, 10, 1.0))
        records.publish_round(forger, forger_key, prefix, RoundRecord("QmMadeUpSybil", 9, FORGED, 10, 1.0))
        raw = records._read(honest, f"{prefix}_rounds")
        assert len(raw) == 3, "all three records must be in the DHT, or the test proves nothing"
        for reader in (honest, impersonator, forger):
            assert records.read_rounds(reader, prefix) == {me: RoundRecord(me, 3, HONEST, 10, 1.0)}
    finally:
        for dht in started:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_a_second_node_with_a_running_nodes_key_stops_with_one_line_and_no_daemon_probes_the_router(tmp_path, capfd):
    """Two nodes with one key take each other's messages: the second is refused before its DHT
    starts (swarm/transport/in_use.py). Every p2pd of both starts, the throwaway one of the check included,
    runs with UPnP/NAT-PMP port mapping and AutoNAT off: nothing probes the router outside a lab."""
    cfg = config.load(None, SWARM)
    hivemind_log, handler = logging.getLogger("hivemind"), hivemind_logging._default_handler
    level = hivemind_log.level
    hivemind_log.setLevel(logging.DEBUG)  # the DHT processes inherit it: they log each p2pd they launch
    stream = handler.setStream(sys.__stderr__)  # to the file descriptor that capfd reads
    started = []
    try:
        entry = start_dht(cfg.swarm, tmp_path / "entry.key", [], "public", [])
        started.append(entry)
        peers = [str(m) for m in entry.get_visible_maddrs()]
        first = start_dht(cfg.swarm, tmp_path / "peer.key", peers, "public", [])  # a new key: nothing to check
        started.append(first)
        first.shutdown()
        started.append(start_dht(cfg.swarm, tmp_path / "peer.key", peers, "public", []))  # its restart: checked, free
        with pytest.raises(SwarmError, match=r"^the identity .*peer\.key is in use by another running node"):
            started.append(start_dht(cfg.swarm, tmp_path / "peer.key", peers, "public", []))
        validator = make_validator(tmp_path / "new.key")  # makes the key in this process: nobody else has it
        started.append(start_dht(cfg.swarm, tmp_path / "new.key", peers, "public", [validator]))
    finally:
        hivemind_log.setLevel(level)
        handler.setStream(stream)
        for dht in started:
            dht.shutdown()
    launches = [line for line in capfd.readouterr().err.splitlines() if "Launching [" in line]
    # entry, first, the restart's check and its own p2pd, the refused one's check, new (no check)
    assert len(launches) == 6, launches
    assert all("'-natPortMap=0'" in line and "'-autonat=0'" in line for line in launches), launches
