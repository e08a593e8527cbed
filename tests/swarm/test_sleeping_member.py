"""A member that sleeps (SIGSTOP of its DHT process and its p2pd: a laptop lid closed) makes every
DHT call that tries it wait hivemind's 3 s per try: a store waited 6 s. The heartbeat stored its
progress every second under the DHT lock, so every read of the swarm by its own peer waited behind
it: a survivor of such a member learned seconds late that the others had finished the round
(test_faults.py::test_peer_hangs_between_its_allreduce_and_the_audit lost 26.8 s in hog run A13,
against 9-14.5 s in runs where hivemind's blacklist happened to skip the sleeper). The heartbeat
now waits for no store, and holds no lock while it waits for a read (node.OneSendAtATime keeps the
handle's writes whole). Real DHT processes, a real SIGSTOP."""

import os
import signal
import subprocess
import time

import pytest

from p2p_diloco import config
from p2p_diloco.protocol.deadlines import ROUND_POLL_S
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.heartbeat import Heartbeat
from p2p_diloco.swarm.transport.identity import make_validator, owner_peer_id
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT
from tests.swarm.conftest import SWARM

WATCH_S = 12.0  # long enough for several beats, each of which tries the sleeper at least once
LOCK_WAIT_S = 1.5  # the longest a read of the swarm may wait for the DHT lock (a store took 6 s)


def _with_children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=True)
    return [pid, *(int(p) for p in out.stdout.split())]


@pytest.mark.timeout(120)
def test_reads_of_the_swarm_never_wait_behind_the_heartbeats_stores_while_a_member_sleeps(tmp_path):
    cfg = config.load(None, SWARM)
    prefix = records.run_prefix(cfg.run.run_id, cfg.fingerprint())
    nodes, stopped, beat = [], [], None
    try:
        entry = start_dht(cfg.swarm, tmp_path / "entry.key", [], "public", [])
        nodes.append(entry)
        peers = [str(m) for m in entry.get_visible_maddrs()]
        keys = {name: make_validator(tmp_path / f"{name}.key") for name in ("a", "c")}
        a, c = (start_dht(cfg.swarm, tmp_path / f"{n}.key", peers, "public", [keys[n]]) for n in ("a", "c"))
        nodes += [a, c]
        ids = {n: owner_peer_id(k.local_public_key) for n, k in keys.items()}
        for name, node in (("a", a), ("c", c)):
            records.publish_round(node, keys[name], prefix, RoundRecord(ids[name], 3, "1" * 32, 10, 1.0))
        stopped = _with_children(c.pid)  # its DHT process and its p2pd
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        run_dht = RunDHT(a, keys["a"], prefix)
        beat = Heartbeat(run_dht, ids["a"], Gate(cfg, ids["a"]))
        beat.report_progress(4, 100, 50.0)  # something to store every beat
        beat.start()
        waits, seen = [], set()
        deadline = time.monotonic() + WATCH_S
        while time.monotonic() < deadline:
            asked = time.monotonic()
            with run_dht.turn():  # as HivemindSwarm.peers reads the swarm (RunDHT.read)
                waits.append(time.monotonic() - asked)
                seen |= set(records.rounds_from(records.read_entries(a, records.rounds_key(prefix))))
            time.sleep(ROUND_POLL_S)  # as HivemindSwarm.wait_for_round polls (the heartbeat may hold the lock)
        assert seen == {ids["a"], ids["c"]}, "the reads must have found both records, or they proved nothing"
        print("WAITS", sorted(waits)[-5:], len(waits), "beats read_at", beat._read_at - time.time())
        assert max(waits) < LOCK_WAIT_S, f"a read waited {max(waits):.1f} s for the DHT lock"
        assert beat._read_at > time.time() - 5.0, "the heartbeat kept reading the swarm"
    finally:
        if beat is not None:
            beat.stop()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for node in nodes:
            node.shutdown()
