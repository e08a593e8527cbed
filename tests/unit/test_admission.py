"""Certificates from the organiser: issued offline, checked by every peer with the run config alone."""

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_diloco.errors import AdmissionError
from p2p_diloco.trust import admission
from p2p_diloco.trust.admission import Certificate

RUN, PEER, NOW = "public-run", "QmVolunteerPeerId", 1_800_000_000


@pytest.fixture
def run_key(tmp_path):
    public = admission.make_run_key(tmp_path / "run.key")
    return admission.load_run_key(tmp_path / "run.key"), admission.parse_public_key(public)


def test_a_certificate_admits_its_peer_to_its_run_until_it_expires(run_key):
    private, public = run_key
    cert = admission.issue(private, RUN, PEER, "alice", NOW + 3600)
    admission.check(cert, public, RUN, PEER, now=NOW)  # no error: admitted
    with pytest.raises(AdmissionError, match="expired"):
        admission.check(cert, public, RUN, PEER, now=NOW + 3600)
    with pytest.raises(AdmissionError, match="for peer QmVolunteerPeerId, not QmSomeoneElse"):
        admission.check(cert, public, RUN, "QmSomeoneElse", now=NOW)
    with pytest.raises(AdmissionError, match="for run 'public-run', not 'other-run'"):
        admission.check(cert, public, "other-run", PEER, now=NOW)


def test_a_certificate_from_another_organiser_or_altered_is_refused(run_key):
    private, public = run_key
    stranger = admission.issue(Ed25519PrivateKey.generate(), RUN, PEER, "mallory", NOW + 3600)
    with pytest.raises(AdmissionError, match="not signed by this run's organiser"):
        admission.check(stranger, public, RUN, PEER, now=NOW)
    honest = admission.issue(private, RUN, PEER, "alice", NOW + 3600)
    for altered in [
        Certificate(RUN, "QmMallory", "alice", honest.expires, honest.signature),  # another peer id
        Certificate(RUN, PEER, "alice", honest.expires + 10**6, honest.signature),  # a longer life
        Certificate(RUN, PEER, "alice", honest.expires, "bm90IGEgc2lnbmF0dXJl"),  # another signature
        Certificate(RUN, PEER, "alice", honest.expires, "%%%"),  # not base64
    ]:
        with pytest.raises(AdmissionError, match="not signed by this run's organiser"):
            admission.check(altered, public, RUN, altered.peer_id, now=NOW)


def test_certificates_round_trip_through_their_file_format(run_key, tmp_path):
    private, public = run_key
    cert = admission.issue(private, RUN, PEER, "alice", NOW + 60)
    (tmp_path / "alice.cert").write_text(cert.to_json())
    assert admission.read_certificate(tmp_path / "alice.cert") == cert
    assert set(json.loads(cert.to_json())) == {"run_id", "peer_id", "name", "expires", "signature"}


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"\x00\x01garbage", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"run_id": "r", "peer_id": "p"}', "lacks a field"),
        (b"x" * 5000, "at most 4096 bytes"),
    ],
)
def test_a_certificate_file_that_is_garbage_is_one_clear_error(tmp_path, content, problem):
    (tmp_path / "bad.cert").write_bytes(content)
    with pytest.raises(AdmissionError, match=f"is not a certificate .*{problem}.*ask the organiser"):
        admission.read_certificate(tmp_path / "bad.cert")
    with pytest.raises(AdmissionError, match="not found"):
        admission.read_certificate(tmp_path / "missing.cert")


def test_run_keys_are_never_overwritten_and_public_keys_are_checked(tmp_path):
    public = admission.make_run_key(tmp_path / "run.key")
    assert public.startswith("ed25519:") and (tmp_path / "run.key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(AdmissionError, match="never overwritten"):
        admission.make_run_key(tmp_path / "run.key")
    for bad in ["rsa:AAAA", "ed25519:not base64!", "ed25519:" + "QUFB" * 3]:
        with pytest.raises(AdmissionError):
            admission.parse_public_key(bad)
    (tmp_path / "not-a-key.pem").write_text("hello")
    with pytest.raises(AdmissionError, match="is not a run key"):
        admission.load_run_key(tmp_path / "not-a-key.pem")


def test_revocations_count_only_when_the_organiser_signed_them_for_this_run(tmp_path):
    key = Ed25519PrivateKey.generate()
    mallory = Ed25519PrivateKey.generate()
    good = admission.Revocation("run-a", "QmBob", "key leaked", 1_700_000_000).signed_with(key)
    texts = [
        good.to_json(),
        admission.Revocation("run-a", "QmAlice", "forged", 1).signed_with(mallory).to_json(),  # another key
        admission.Revocation("run-b", "QmCarol", "other run", 1).signed_with(key).to_json(),  # another run
        admission.Certificate("run-a", "QmDave", "dave", 2**40).signed_with(key).to_json(),  # not a revocation
        "not json",
        {"run_id": "run-a"},
        7,
    ]
    assert admission.revoked_ids(texts, key.public_key(), "run-a") == {"QmBob": good.to_json()}
    assert admission.revoked_ids("not a list", key.public_key(), "run-a") == {}


def test_a_signature_of_one_kind_never_verifies_as_another():
    # The same fields signed as a certificate do not make a revocation (domain strings differ).
    key = Ed25519PrivateKey.generate()
    cert = admission.Certificate("run-a", "QmBob", "x", 5).signed_with(key)
    as_config = admission.ConfigSignature("run-a", "QmBob", cert.signature)
    with pytest.raises(AdmissionError, match="config signature is not signed by this run's organiser"):
        as_config.verify(key.public_key())


def test_the_organiser_revokes_with_the_run_key_only(tmp_path):
    public = admission.make_run_key(tmp_path / "run.key")
    other = admission.make_run_key(tmp_path / "other.key")
    revocation = admission.revoke(tmp_path / "run.key", "run-a", public, BOB, "left", tmp_path / "r.json")
    assert admission.Revocation.parse((tmp_path / "r.json").read_text()) == revocation
    assert admission.revoked_ids([revocation.to_json()], admission.parse_public_key(public), "run-a") == {
        BOB: revocation.to_json()
    }
    with pytest.raises(AdmissionError, match="is not the key of this run"):
        admission.revoke(tmp_path / "run.key", "run-a", other, BOB, "left", tmp_path / "s.json")


@pytest.mark.parametrize("peer_id", ["../notes", "revoked/../../x", "Qm Bob", "", "Qm/Bob", "Qm.Bob", "QmBob"])
def test_a_revocation_of_an_id_that_is_not_a_plain_name_is_refused_and_writes_nothing(tmp_path, peer_id):
    # The CLI names the organiser's copy revoked/<peer id>.json: "../notes" would write over notes.json.
    public = admission.make_run_key(tmp_path / "run.key")
    (tmp_path / "notes.json").write_text("mine")
    out = tmp_path / "certs" / admission.REVOKED_DIR / f"{peer_id}.json"
    with pytest.raises(AdmissionError, match="is not a peer id"):
        admission.revoke(tmp_path / "run.key", "run-a", public, peer_id, "left", out)
    assert (tmp_path / "notes.json").read_text() == "mine"
    assert not (tmp_path / "certs").exists()


BOB = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"  # a sha2-256 peer id ("Qm…")


def test_only_libp2p_peer_ids_are_peer_ids():
    from hivemind.p2p import PeerID  # what the swarm itself parses ids with

    ed25519 = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"  # an identity multihash of a key
    for real in (BOB, ed25519, str(PeerID(bytes([0x12, 0x20]) + bytes(range(32))))):
        assert admission.is_peer_id(real) and PeerID.from_base58(real).to_base58() == real
    sha_of_31 = str(PeerID(bytes([0x12, 0x1F]) + bytes(31)))  # a sha2-256 multihash must hold 32 bytes
    for fake in ("QmNotAnId", "QmBob", "Qm", "1", BOB[:-1], BOB + "1", sha_of_31, "Qm0aa", "x" * 129):
        assert not admission.is_peer_id(fake), fake


def test_the_organiser_cannot_admit_what_is_not_a_peer_id(tmp_path):
    public = admission.make_run_key(tmp_path / "run.key")
    with pytest.raises(AdmissionError, match="'QmNotAnId' is not a peer id; the volunteer gets theirs from"):
        admission.admit(tmp_path / "run.key", "run-a", public, "QmNotAnId", "alice", 30, tmp_path / "a.cert")
    assert not (tmp_path / "a.cert").exists()
    cert = admission.admit(tmp_path / "run.key", "run-a", public, BOB, "bob", 30, tmp_path / "b.cert")
    assert cert.peer_id == BOB


def test_a_missing_run_key_is_not_answered_with_a_new_one(tmp_path):
    # sign-config, admit and revoke without the run key advised `admission keygen`: a new key cannot
    # sign for a run whose config names its organiser's key.
    with pytest.raises(AdmissionError) as e:
        admission.load_run_key(tmp_path / "run.key")
    assert "pass --key with the file `admission keygen` wrote for this run" in str(e.value)
    assert "a new key cannot sign for a run that has one" in str(e.value)
