"""The door of a certified run on this peer's side: without a valid certificate for its own id a
peer stops before it touches the network, with one line that names the fix."""

import time
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_diloco import config
from p2p_diloco.errors import AdmissionError
from p2p_diloco.swarm.trust.doors import Doors
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT
from p2p_diloco.trust import admission
from tests.conftest import TINY

ME, OTHER = "QmThisVolunteer", "QmSomebodyElse"


def certified(tmp_path, cert_path=None, sign=True):
    """A certified run's config, signed by its organiser (as `admission sign-config` does), and the run key."""
    public = admission.make_run_key(tmp_path / "run.key")
    overrides = {**TINY, "admission.mode": "certified", "admission.organiser_key": public}
    if cert_path is not None:
        overrides["admission.certificate"] = str(cert_path)
    cfg = config.load(None, overrides)
    if sign:
        signed = admission.sign_config(tmp_path / "run.key", cfg.run.run_id, public, cfg.fingerprint())
        cfg = config.load(None, {**overrides, "admission.config_signature": signed.signature})
    return cfg, admission.load_run_key(tmp_path / "run.key")


def write(tmp_path, cert):
    (tmp_path / "me.cert").write_text(cert.to_json())
    return tmp_path / "me.cert"


def test_an_admitted_peer_shows_its_certificate_to_its_groups(tmp_path):
    cfg, key = certified(tmp_path, tmp_path / "me.cert")
    cert = admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) + 3600)
    write(tmp_path, cert)
    gate = Gate(cfg, ME)
    assert gate.gather() == {"cert": cert.to_json()}
    assert gate.averager_check() == (cfg.run.run_id, cfg.admission.organiser_key)
    # What the averager's doors (swarm/trust/doors.py) make of it: this peer's certificate admits this peer only.
    doors = Doors(*gate.averager_check(), published=None)
    assert doors.reason_to_refuse(ME, gate.gather()["cert"]) is None
    assert "for peer QmThisVolunteer, not QmSomebodyElse" in doors.reason_to_refuse(OTHER, gate.gather()["cert"])


def test_an_open_run_admits_everyone_and_asks_nothing(tmp_path):
    gate = Gate(config.load(None, TINY), ME)
    assert gate.gather() == {} and gate.averager_check() is None
    assert gate.admitted({ME, OTHER}) == {ME, OTHER}


@pytest.mark.parametrize("case", ["none", "expired", "another peer", "another organiser", "garbage"])
def test_a_peer_without_a_valid_certificate_is_refused_with_its_id_and_the_fix(tmp_path, case):
    cfg, key = certified(tmp_path, None if case == "none" else tmp_path / "me.cert")
    later = int(time.time()) + 3600
    certs = {
        "expired": admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) - 1),
        "another peer": admission.issue(key, cfg.run.run_id, OTHER, "bob", later),
        "another organiser": admission.issue(Ed25519PrivateKey.generate(), cfg.run.run_id, ME, "alice", later),
    }
    if case in certs:
        write(tmp_path, certs[case])
    elif case == "garbage":
        (tmp_path / "me.cert").write_bytes(b"\x89PNG not a certificate")
    problem = {
        "none": "then pass their certificate as --admission.certificate FILE",
        "expired": "expired",
        "another peer": "for peer QmSomebodyElse, not QmThisVolunteer",
        "another organiser": "not signed by this run's organiser",
        "garbage": "is not a certificate",
    }[case]
    with pytest.raises(AdmissionError, match=problem) as refused:
        Gate(cfg, ME)
    assert f"this run admits certified peers only: send your id ({ME}) to the organiser" in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("case", ["unsigned", "another config", "another organiser"])
def test_a_certified_peer_trains_only_on_the_config_its_organiser_signed(tmp_path, case):
    cfg, key = certified(tmp_path, tmp_path / "me.cert", sign=False)
    write(tmp_path, admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) + 3600))
    signature = {
        "unsigned": "",
        "another config": admission.ConfigSignature(cfg.run.run_id, "0123456789abcdef").signed_with(key).signature,
        "another organiser": admission.ConfigSignature(cfg.run.run_id, cfg.fingerprint())
        .signed_with(Ed25519PrivateKey.generate())
        .signature,
    }[case]
    cfg = replace(cfg, admission=replace(cfg.admission, config_signature=signature))
    with pytest.raises(AdmissionError, match="is not the one the organiser signed for run 'p2p-diloco'"):
        Gate(cfg, ME)


def test_a_certified_peer_believes_only_configs_its_organiser_signed(tmp_path):
    cfg, key = certified(tmp_path, tmp_path / "me.cert")
    write(tmp_path, admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) + 3600))
    gate = Gate(cfg, ME)
    signed = admission.ConfigSignature(cfg.run.run_id, "0123456789abcdef").signed_with(key)
    assert gate.believes_config(signed.signature, "0123456789abcdef")
    assert not gate.believes_config(signed.signature, "fedcba9876543210")  # a signature moved to another config
    assert not gate.believes_config("", "0123456789abcdef")
    assert Gate(config.load(None, TINY), ME).believes_config("", "anything")  # open runs believe every config


def test_a_revoked_or_expired_peer_stops_itself(tmp_path):
    cfg, key = certified(tmp_path, tmp_path / "me.cert")
    write(tmp_path, admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) + 3600))
    gate = Gate(cfg, ME)
    gate.check_self()  # admitted, not revoked
    revoked = admission.Revocation(cfg.run.run_id, ME, "left the project", int(time.time())).signed_with(key)
    gate._revocations = admission.revoked_ids([revoked.to_json()], key.public_key(), cfg.run.run_id)
    with pytest.raises(AdmissionError, match=r"the organiser revoked this peer's admission .*\(left the project\)"):
        gate.check_self()
    assert gate.admitted({ME, OTHER}) == set() and gate.revoked == {ME}
    gate._revocations = {}
    gate.certificate = admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) - 1)
    with pytest.raises(AdmissionError, match=r"this peer's certificate expired .* send your id \(QmThisVolunteer\)"):
        gate.check_self()


def test_an_observer_is_handed_each_revocation_s_reason_as_one_printable_line_and_when_it_was_issued(tmp_path):
    cfg, key = certified(tmp_path, tmp_path / "me.cert")
    write(tmp_path, admission.issue(key, cfg.run.run_id, ME, "alice", int(time.time()) + 3600))
    gate = Gate(cfg, ME)
    reason = "ran a\nmodified\x1b[31m client " + "x" * 300  # signed by the organiser, by another tool
    revoked = admission.Revocation(cfg.run.run_id, OTHER, reason, 1_700_000_000).signed_with(key)
    gate._revocations = admission.revoked_ids([revoked.to_json()], key.public_key(), cfg.run.run_id)
    ((peer, (said, issued)),) = gate.revocations().items()
    assert (peer, issued) == (OTHER, 1_700_000_000.0)
    assert said.startswith("ran a modified[31m client xxx") and len(said) == 200 and said.isprintable()


def test_an_observer_names_admitted_peers_as_their_certificates_do(tmp_path, monkeypatch):
    cfg, key = certified(tmp_path)
    alice = admission.issue(key, cfg.run.run_id, OTHER, "alice", int(time.time()) + 3600)
    stolen = admission.issue(key, cfg.run.run_id, OTHER, "mallory", int(time.time()) + 3600)  # for another id
    published = {OTHER: alice.to_json(), "QmMallory": stolen.to_json()}
    monkeypatch.setattr("p2p_diloco.swarm.trust.records.read_certificates", lambda dht, prefix: published)
    gate = Gate(cfg, "QmObserver", member=False)  # an observer: no certificate of its own
    gate.attach(RunDHT(None, None, "prefix"))
    assert gate.admitted({OTHER, "QmMallory"}) == {OTHER}
    assert gate.names == {OTHER: "alice"}
