"""Liveness as the heartbeat judges it (swarm/heartbeat.py), with the DHT replaced by a scripted
read: the judgement is as of this peer's last read of the swarm, never of reads that failed."""

import pytest

from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.swarm import heartbeat
from p2p_diloco.swarm.heartbeat import STALE_S, Heartbeat
from p2p_diloco.swarm.trust.run_dht import RunDHT


class Gate:
    convicted: set[str] = set()

    def admitted(self, peers):
        return set(peers)

    def publish(self):
        pass

    def refresh_revocations(self):
        pass


class Entries:
    def tend(self, *args):
        pass


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(heartbeat.time, "time", lambda: now[0])
    return now


def test_a_peer_whose_own_reads_fail_judges_nobody_stale_on_what_it_could_not_read(clock, monkeypatch):
    # bench/slow_join.py: a joiner whose 1 Mbit/s link a state download saturated could not read
    # the DHT; its last view aged, the holder it was downloading from looked stale after 10 s, and
    # it took it for gone: "the run finished" (exit 0), or in a running swarm, training alone.
    reads = {"ok": True}
    holder = {"time": lambda: clock[0]}  # the time of the holder's latest report, as read

    def read_entries(dht, key):
        if not reads["ok"]:
            raise TimeoutError("the DHT did not answer")
        return []

    monkeypatch.setattr(heartbeat.records, "read_entries", read_entries)
    progress = lambda entries, admit: ([ProgressReport("holder", 3, 0, 0.0, holder["time"]())], {})  # noqa: E731
    monkeypatch.setattr(heartbeat.records, "progress_from", progress)
    monkeypatch.setattr(heartbeat.records, "rounds_from", lambda entries, admit: {})
    beat = Heartbeat(RunDHT(None, None, "run"), "me", Gate(), Entries())
    beat.convictions.refresh = lambda accusations: None
    beat._beat()
    reads["ok"] = False
    clock[0] += 3 * STALE_S  # 30 s of failed reads
    with pytest.raises(TimeoutError):
        beat._beat()
    assert beat.stale_peers() == set(), "it knows nothing newer than its last read, when the holder was live"
    reads["ok"] = True  # a read again: the holder's report is fresh, so it is live
    beat._beat()
    assert beat.stale_peers() == set()
    holder["time"] = lambda: 0.0
    clock[0] += 1
    beat._beat()  # a read that shows the holder's last report 1,031 s old: it stopped
    assert beat.stale_peers() == {"holder"}


def test_ids_that_arrive_after_a_starting_peer_knew_the_swarm_are_new_to_it(clock, monkeypatch):
    # Before, every id a peer saw in its own first 120 s counted at once in its votes: a flood of
    # ids that arrived while it started outvoted the peers it knew (the threat model said less).
    present: list[str] = []
    monkeypatch.setattr(heartbeat.records, "read_entries", lambda dht, key: [])
    reports = lambda entries, admit: ([ProgressReport(p, 3, 0, 0.0, clock[0]) for p in present], {})  # noqa: E731
    monkeypatch.setattr(heartbeat.records, "progress_from", reports)
    monkeypatch.setattr(heartbeat.records, "rounds_from", lambda entries, admit: {})
    beat = Heartbeat(RunDHT(None, None, "run"), "me", Gate(), Entries())
    beat.convictions.refresh = lambda accusations: None
    beat._beat()  # alone for a minute: nobody known yet, nobody new
    clock[0] += 60
    present[:] = ["me", "a"]
    beat._beat()  # its first read that shows another peer: "a" is known
    clock[0] += heartbeat.SETTLE_S
    present.append("b")  # started with "a", its record a few seconds later: known too
    beat._beat()
    assert beat.fresh_peers() == set()
    clock[0] += 20  # 90 s after this peer started
    present.extend(["flood-1", "flood-2"])
    beat._beat()
    assert beat.fresh_peers() == {"flood-1", "flood-2"}
    clock[0] += heartbeat.FRESH_S  # known for FRESH_S: they count
    beat._beat()
    assert beat.fresh_peers() == set()
