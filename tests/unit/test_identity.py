"""A record speaks only for its signer's peer id: the key that signs a peer's DHT records is its
libp2p identity, and any record whose claimed id is not its signer's is dropped."""

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.transport.identity import load_identity, make_validator, owner_peer_id
from p2p_diloco.swarm.trust.records import parse_progress, signed_by_their_peer

D = "a" * 32


def round_value(peer):
    return {"peer": peer, "round": 3, "digest": D, "tokens": 5, "loss": 2.5}


def test_the_signing_key_gives_the_peer_id_libp2p_gives_the_identity_file(tmp_path):
    validator = make_validator(tmp_path / "identity.key")  # made on first use
    assert (tmp_path / "identity.key").exists()
    expected = str(PeerID.from_identity((tmp_path / "identity.key").read_bytes()))
    assert owner_peer_id(validator.local_public_key) == expected
    # the same file, loaded again: the same key, the same id
    assert make_validator(tmp_path / "identity.key").local_public_key == validator.local_public_key


def test_records_that_claim_another_id_than_their_signers_are_dropped(tmp_path):
    me = make_validator(tmp_path / "me.key").local_public_key
    other = make_validator(tmp_path / "other.key").local_public_key
    mine, theirs = owner_peer_id(me), owner_peer_id(other)
    entries = [
        (me, round_value(mine)),  # honest
        (other, round_value(mine)),  # impersonation: signed by another key
        (other, round_value("QmMadeUpPeerIdThatNobodyOwns")),  # a made-up id
        (b"no owner here", round_value(mine)),  # not a protected subkey
        (other, {"peer": theirs, "round": -1}),  # malformed: dropped before the check
    ]
    assert signed_by_their_peer(entries, RoundRecord.parse) == [RoundRecord(mine, 3, D, 5, 2.5)]
    progress = {"peer": theirs, "round": 2, "tokens": 4096, "tokens_per_s": 812.5, "time": 1.7e9}
    assert [p.peer for p in signed_by_their_peer([(other, progress), (me, progress)], parse_progress)] == [theirs]


def test_a_key_that_is_not_rsa_or_not_a_key_is_refused_with_the_fix(tmp_path):
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key at all")
    with pytest.raises(SwarmError, match="is not a private key; delete it"):
        load_identity(garbage)
    # A bootstrap node's key is its address, which volunteers were given: restore it, do not delete it.
    with pytest.raises(SwarmError, match="bootstrap node's identity.*restore the file from its backup.*--identity"):
        load_identity(garbage, entry_node=True)
    ed25519 = tmp_path / "ed25519.key"
    ed25519.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString())
    with pytest.raises(SwarmError, match="holds a Ed25519 key; .* needs an RSA one"):
        load_identity(ed25519)
