"""A certified run with real peer processes: an intruder without a certificate publishes records,
looks for groups and asks for states, and the admitted peers never count, group with or serve it;
then the organiser revokes one admitted peer mid-run, with the real `admission revoke` command."""

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from p2p_diloco import config
from p2p_diloco.swarm.transport.identity import peer_id_of
from p2p_diloco.trust import admission
from tests.swarm.conftest import CLI, ENV, SWARM, wait_until

# Enough 1-second rounds that the revoke command (a fresh process: imports, a DHT node, the wait for
# holders; 5 s idle, over 20 s under load) returns while c still trains: with 14, c once finished first.
ROUNDS = 24


def certified_run(tmp_path):
    """The organiser's side: a run key, a signed run config (options and run.toml), and the key."""
    public = admission.make_run_key(tmp_path / "run.key")
    # no retries: a failed group is not waited out twice
    run = {"admission.mode": "certified", "admission.organiser_key": public, "run.rounds": str(ROUNDS)}
    run["swarm.averaging_retries"] = "0"
    run["swarm.linger_s"] = "10"  # the final state served 10 s after the end: the observer evaluates it
    cfg = config.load(None, {**SWARM, **run})
    signed = admission.sign_config(tmp_path / "run.key", cfg.run.run_id, public, cfg.fingerprint())
    run["admission.config_signature"] = signed.signature
    config.save(config.load(None, {**SWARM, **run}), tmp_path / "run.toml")
    return run, cfg.run.run_id, admission.load_run_key(tmp_path / "run.key")


@pytest.mark.timeout(300)
def test_outsiders_are_refused_at_every_door_and_a_revoked_peer_stops_while_the_others_go_on(swarm, tmp_path):
    run, run_id, key = certified_run(tmp_path)
    ids, peers = {}, {}
    for name in ("a", "b", "c", "intruder"):
        identity = tmp_path / f"{name}.key"
        ids[name] = peer_id_of(identity)
        options = {**run, "swarm.identity_path": str(identity)}
        if name != "intruder":
            cert = admission.issue(key, run_id, ids[name], name, 2_000_000_000)
            (tmp_path / f"{name}.cert").write_text(cert.to_json())
            options["admission.certificate"] = str(tmp_path / f"{name}.cert")
        script = [sys.executable, "-m", "tests.swarm.intruder_peer"] if name == "intruder" else None
        peers[name] = swarm.peer(name, options, script=script)
    admitted = [peers["a"], peers["b"]]
    watcher, url = start_observer(swarm, tmp_path, key, run_id)  # the organiser's, certified: it evaluates
    wait_until(lambda: max(swarm.records("a"), default=0) >= 1, admitted, 150, "round 1")
    revoke = [*CLI, "admission", "revoke", "--key", str(tmp_path / "run.key"), "--config", str(tmp_path / "run.toml")]
    revoke += ["--peer-id", ids["c"], "--reason", "left the project", "--folder", str(tmp_path / "certs")]
    revoke += ["--initial-peers", swarm.maddr, "--wait", "40"]
    done = subprocess.run(revoke, capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"revoked {ids['c']}:" in done.stdout
    revoked_at = max(swarm.records("a"))  # the round a had finished when peers held the revocation
    wait_until(lambda: all(p.poll() is not None for p in admitted), admitted, 200, "a and b finish")
    assert [p.returncode for p in admitted] == [0, 0], swarm.log("a")[-3000:]
    view = json.loads(urllib.request.urlopen(url + "api/v1/run", timeout=10).read())  # the run's end, as it saw it
    watcher.send_signal(signal.SIGINT)
    code, observer_log = watcher.wait(timeout=60), watcher.stderr.read()
    assert code == 0, observer_log[-2000:]
    # It downloaded agreed states in chunks, over libp2p, from the holders that admitted its
    # certificate (swarm/state_client.py). Not every evaluation: with rounds of a second, holders
    # have often moved on by the time it asks for the round it picked (they serve no manifest of
    # it), and it then takes a holder's newer agreed state whole (evaluate.download_agreed): 3-4 of
    # 6 evaluations came in chunks in the runs looked at, the first one in each.
    chunked = r"downloaded round \d+ \(digest [0-9a-f]{12}\) in chunks from [123] holder"
    assert re.search(chunked, observer_log), observer_log[-3000:]

    # The revoked peer stopped itself with one line, at most one round later; a and b went on and agree.
    assert peers["c"].wait(timeout=60) == 2, swarm.log("c")[-2000:]
    assert "the organiser revoked this peer's admission to run" in swarm.log("c")
    # Rounds here take about a second and revocations are read every second (a round of a real run
    # takes minutes): c is out within a couple of these rounds; seen +1 here and +2 in CI.
    assert max(swarm.records("c")) <= revoked_at + 3
    a, b = swarm.records("a"), swarm.records("b")
    assert max(a) == max(b) == ROUNDS
    for r in sorted(set(a) & set(b)):
        assert a[r]["digest"] == b[r]["digest"], r
    sizes = [rec.get("group_size", 1) for records in (a, b) for rec in records.values()]
    late = [rec.get("group_size", 1) for records in (a, b) for r, rec in records.items() if r > revoked_at + 3]
    # (under CI load the command may return late in the run, leaving no rounds after c's last)
    assert max(sizes) <= 3 and max(late, default=2) <= 2, f"an outsider or the revoked peer was averaged with: {sizes}"
    assert max(sizes) >= 2, f"the admitted peers never averaged together: {sizes}"
    assert f"the organiser revoked peer {ids['c']}" in swarm.log("a")
    check_observer(view, ids)

    # The intruder never held the swarm's state nor averaged with anyone. Whether it wrote a record
    # at all depends on timing (CI: none): a peer that finds the swarm past round 0 when its start-up
    # ends asks for the state first, and goes on from θ(0) only once the peers ahead left.
    intruder = swarm.records("intruder")
    assert all(rec.get("group_size", 1) == 1 for rec in intruder.values()), intruder
    assert all(r == 0 or rec["digest"] != a.get(r, {}).get("digest") for r, rec in intruder.items()), intruder
    honest_logs = swarm.log("a") + swarm.log("b") + swarm.log("c")
    assert f"peer {ids['intruder']} not counted: no certificate of it seen yet" in swarm.log("a")
    # Whether the intruder is ever in matchmaking with them depends on timing (seen in CI: it stayed
    # at round 0 while they moved on); the matchmaking door is tested in-process (test_doors.py).
    assert f"refused peer {ids['intruder']} at the state download door" in honest_logs
    assert "sent nothing" in swarm.log("intruder"), "the intruder asked for a state and got none"


def start_observer(swarm, tmp_path, key, run_id) -> tuple[subprocess.Popen, str]:
    """`p2p-diloco observe` with a key and certificate of its own (peers serve admitted askers only),
    evaluating every 4 rounds: the process and its dashboard's URL."""
    identity = tmp_path / "observer.key"
    cert = admission.issue(key, run_id, peer_id_of(identity), "organiser's observer", 2_000_000_000)
    (tmp_path / "observer.cert").write_text(cert.to_json())
    command = [*CLI, "observe", "--config", str(tmp_path / "run.toml"), "--initial-peers", swarm.maddr, "--port", "0"]
    command += ["--poll-s", "1", "--eval-every", "4", "--identity", str(identity)]
    command += ["--certificate", str(tmp_path / "observer.cert")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    swarm.procs.append(proc)  # ended with the swarm if the test fails first
    swarm.sessions.add(proc.pid)
    found = re.search(r"dashboard (http://\S+/)", proc.stdout.readline())
    assert found, proc.stderr.read()[-2000:] if proc.poll() is not None else "no dashboard line"
    return proc, found.group(1)


def check_observer(view: dict, ids: dict) -> None:
    """The organiser's observer marks the revoked peer with the organiser's reason, in the peers,
    the rounds it missed after it and the contributors, names peers as their certificates do, and
    evaluated the agreed state with its own certificate, the run's last round included."""
    peers = {p["peer"]: p for p in view["peers"]}
    assert peers[ids["c"]]["revoked"] == "left the project" and peers[ids["a"]]["revoked"] is None
    assert {peers[ids[n]]["name"] for n in "abc"} == {"a", "b", "c"}
    assert ids["intruder"] not in peers  # no certificate: not a member of the run
    revoked = [(r["round"], n["peer"]) for r in view["rounds"] for n in r["not_counted"] if "revoked" in n["reason"]]
    assert revoked and {p for _, p in revoked} == {ids["c"]}, revoked  # while its last record was in the DHT
    assert all(n["reason"] == "revoked by the organiser: left the project" for r in view["rounds"]
               for n in r["not_counted"] if "revoked" in n["reason"])  # fmt: skip
    contributors = {c["peer"]: c for c in view["contributors"]}
    assert contributors[ids["c"]]["revoked"] == "left the project"  # its work before stays credited
    assert view["run"]["eval_off"] == "" and view["run"]["eval_round"] == ROUNDS, view["run"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["garbage", "another peer"])
def test_a_peer_its_certificate_does_not_admit_stops_with_one_line_and_exit_2(tmp_path, case):
    run, run_id, key = certified_run(tmp_path)
    me, other = tmp_path / "me.key", tmp_path / "other.key"
    if case == "garbage":
        (tmp_path / "me.cert").write_bytes(b"\x89PNG\r\n not a certificate")
    else:
        (tmp_path / "me.cert").write_text(
            admission.issue(key, run_id, peer_id_of(other), "bob", 2_000_000_000).to_json()
        )
    options = {**run, "swarm.identity_path": str(me), "admission.certificate": str(tmp_path / "me.cert")}
    options["run.dir"] = str(tmp_path / "me")
    # The refusal comes before the peer touches the network: the address is never dialled.
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/QmNqE5ohLW7wcDvQDBzNoe2rkoGjuTjmUGaVdu8ZppYsaV"
    command = [*CLI, "peer", *[f"--{k}={v}" for k, v in {**SWARM, **options}.items()], "--initial-peers", maddr]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=100)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    problem = "is not a certificate" if case == "garbage" else f"the certificate is for peer {peer_id_of(other)}"
    assert len(errors) == 1 and problem in errors[0], errors
    assert f"send your id ({peer_id_of(me)}) to the organiser" in errors[0]
    assert "Traceback" not in done.stdout + done.stderr
