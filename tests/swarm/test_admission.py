"""A certified run with real peer processes: an intruder without a certificate publishes records,
looks for groups and offers its state, and the admitted peers never count or average with it."""

import sys

import pytest

from p2p_diloco import admission, config
from p2p_diloco.swarm.identity import peer_id_of
from tests.swarm.conftest import SWARM, wait_until

ROUNDS = 4


@pytest.mark.timeout(240)
def test_an_intruder_without_a_certificate_is_never_counted_or_averaged_with(swarm, tmp_path):
    public = admission.make_run_key(tmp_path / "run.key")
    key = admission.load_run_key(tmp_path / "run.key")
    # no retries: a group the intruder joined fails at once, and the test need not wait out a second one
    run = {
        "admission.mode": "certified",
        "admission.organiser_key": public,
        "run.rounds": str(ROUNDS),
        "swarm.averaging_retries": "0",
    }
    run_id = config.load(None, {**SWARM, **run}).run.run_id
    ids, peers = {}, []
    for name in ("a", "b", "intruder"):
        identity = tmp_path / f"{name}.key"
        ids[name] = peer_id_of(identity)
        options = {**run, "swarm.identity_path": str(identity)}
        if name != "intruder":
            cert = admission.issue(key, run_id, ids[name], name, 2_000_000_000)
            (tmp_path / f"{name}.cert").write_text(cert.to_json())
            options["admission.certificate"] = str(tmp_path / f"{name}.cert")
        script = [sys.executable, "-m", "tests.swarm.intruder_peer"] if name == "intruder" else None
        peers.append(swarm.peer(name, options, script=script))
    admitted = peers[:2]
    wait_until(lambda: all(p.poll() is not None for p in admitted), admitted, 200, "admitted peers finish")
    assert [p.returncode for p in admitted] == [0, 0], swarm.log("a")[-3000:]
    a, b = swarm.records("a"), swarm.records("b")
    assert max(a) == max(b) == ROUNDS
    for r in sorted(set(a) & set(b)):
        assert a[r]["digest"] == b[r]["digest"], r
    sizes = [rec.get("group_size", 1) for records in (a, b) for rec in records.values()]
    # Never a group of 3: a group the intruder joined failed before any part was sent. (It may make
    # every round fail, leaving each admitted peer its own Δ until refusal at matchmaking exists.)
    assert max(sizes) <= 2, f"a group with the intruder was averaged: {sizes}"
    intruder = swarm.records("intruder")
    assert intruder and all(rec.get("group_size", 1) == 1 for rec in intruder.values()), intruder
    for name in ("a", "b"):
        assert f"refused peer {ids['intruder']}: it published no certificate" in swarm.log(name)
    assert ids["intruder"] in swarm.log("intruder"), "the intruder ran"
