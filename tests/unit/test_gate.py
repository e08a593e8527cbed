"""The door of a certified run on this peer's side: without a valid certificate for its own id a
peer stops before it touches the network, with one line that names the fix."""

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2p_diloco import admission, config
from p2p_diloco.errors import AdmissionError
from p2p_diloco.swarm.gate import Gate
from tests.conftest import TINY

ME, OTHER = "QmThisVolunteer", "QmSomebodyElse"


def certified(tmp_path, cert_path=None):
    public = admission.make_run_key(tmp_path / "run.key")
    overrides = {**TINY, "admission.mode": "certified", "admission.organiser_key": public}
    if cert_path is not None:
        overrides["admission.certificate"] = str(cert_path)
    return config.load(None, overrides), admission.load_run_key(tmp_path / "run.key")


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
    admission.check_member(gate.gather(), *gate.averager_check(), ME, time.time())
    with pytest.raises(AdmissionError, match="for peer QmThisVolunteer, not QmSomebodyElse"):
        admission.check_member(gate.gather(), *gate.averager_check(), OTHER, time.time())
    with pytest.raises(AdmissionError, match="sent no certificate"):
        admission.check_member({"round": 3}, *gate.averager_check(), OTHER, time.time())


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
