"""Stage 2's signatures from another node (swarm/averaging/stage2.py): a seal counts only as its
claimed peer's signature over this round's statement, and any bytes are a seal or nothing."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.swarm.averaging import stage2
from p2p_diloco.swarm.transport import identity


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = []
    for name in ("x", "y"):
        path = tmp_path_factory.mktemp(name) / "identity.key"
        out.append((identity.peer_id_of(path), identity.load_identity(path)))
    return out


def test_a_seal_is_its_peers_signature_over_this_rounds_statement_and_nothing_else(two):
    (x, kx), (y, _) = two
    sealed = stage2.seal(kx, b"round 7", b"statement")
    assert stage2.sealed_by(x, b"round 7", b"statement", sealed)
    assert not stage2.sealed_by(y, b"round 7", b"statement", sealed)  # x's key shown as y's
    assert not stage2.sealed_by(x, b"round 8", b"statement", sealed)  # another round
    assert not stage2.sealed_by(x, b"round 7", b"another statement", sealed)
    assert not stage2.sealed_by(x, b"round 7", b"statement", sealed[:-1])  # the key cut short
    (length,) = struct.unpack_from(">H", sealed)
    assert not stage2.sealed_by(x, b"round 7", b"statement", struct.pack(">H", length + 1) + sealed[2:])
    assert not stage2.sealed_by(x, b"round 7", b"statement", b"")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=600))
def test_any_bytes_are_no_seal_and_unpair_without_error(raw):
    assert not stage2.sealed_by("QmNotAPeer", b"round", b"statement", raw)
    decider, primary = stage2._unpaired(raw)
    assert isinstance(decider, bytes) and isinstance(primary, bytes)
