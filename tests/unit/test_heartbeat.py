"""Liveness as the heartbeat judges it (swarm/heartbeat.py), with the DHT replaced by a scripted
read: the judgement is as of this peer's last read of the swarm, never of reads that failed."""

import threading

import pytest

from p2p_diloco.rounds import Progress
from p2p_diloco.swarm import heartbeat
from p2p_diloco.swarm.heartbeat import STALE_S, Heartbeat


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
    progress = lambda entries, admit: ([Progress("holder", 3, 0, 0.0, holder["time"]())], {})  # noqa: E731
    monkeypatch.setattr(heartbeat.records, "progress_from", progress)
    monkeypatch.setattr(heartbeat.records, "rounds_from", lambda entries, admit: {})
    beat = Heartbeat(None, None, "run", "me", threading.Lock(), Gate(), Entries())
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
