"""Forged round records on a real DHT: one under an honest peer's id signed by another key, one
under a made-up id. Both reach the DHT and both are dropped by every reader."""

import pytest

from p2p_diloco import config
from p2p_diloco.network import RoundRecord
from p2p_diloco.swarm import records
from p2p_diloco.swarm.identity import make_validator, owner_peer_id
from p2p_diloco.swarm.node import start_dht
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
            dht = start_dht(cfg.swarm, tmp_path / f"{name}.key", [str(m) for m in peers], False, [validator])
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
