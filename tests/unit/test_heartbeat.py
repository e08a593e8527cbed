"""Liveness as the heartbeat judges it (swarm/heartbeat.py), with the DHT replaced by a scripted
read: the judgement is as of this peer's last read of the swarm, never of reads that failed."""

from concurrent.futures import Future

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


class ScriptedDHT(RunDHT):
    """The run's records as a dict, with every store and read kept: what the heartbeat sent and read."""

    def __init__(self):
        super().__init__(None, None, "run")
        self.progress: list[ProgressReport] = []
        self.rounds: dict = {}
        self.sent: list[ProgressReport] = []
        self.convicted: list[list[str]] = []  # the accusations each report carried
        self.read_keys: list[str] = []

    def send_progress(self, report, convicted):
        self.sent.append(report)
        self.convicted.append(sorted(convicted))
        done = Future()
        done.set_result(True)
        return done  # a store that ended at once

    def read_now(self, *keys):
        self.read_keys.extend(key.__name__ for key in keys)
        return [key.__name__ for key in keys]


def scripted(monkeypatch, dht):
    monkeypatch.setattr(heartbeat.records, "progress_from", lambda entries, admit: (list(dht.progress), {}))
    monkeypatch.setattr(heartbeat.records, "rounds_from", lambda entries, admit: dict(dht.rounds))
    beat = Heartbeat(dht, "me", Gate(), Entries())
    beat.convictions.refresh = lambda accusations: None
    return beat


def test_the_heartbeat_sends_progress_only_when_due_and_reads_round_records_on_a_new_round(clock, monkeypatch):
    # Before, every beat stored this peer's progress and read both keys: about 130 KB/s each way
    # per peer at 8 peers (docs/benchmarks.md, Background traffic).
    dht = ScriptedDHT()
    beat = scripted(monkeypatch, dht)
    dht.progress = [ProgressReport("a", 4, 0, 100.0, clock[0])]
    beat.report_progress(4, 0, 100.0)
    beat._beat()
    assert [r.tokens for r in dht.sent] == [0] and dht.read_keys == ["progress_key", "rounds_key"]
    for _ in range(2):  # the same rate: readers extrapolate it, nothing to send or read
        clock[0] += 1
        beat.report_progress(4, int(100 * (clock[0] - 1000)), 100.0)
        beat._beat()
    assert len(dht.sent) == 1 and dht.read_keys.count("rounds_key") == 1
    assert dht.read_keys.count("progress_key") == 3  # everyone's progress: every beat
    clock[0] += 1  # 3 s since it was sent: again, for its liveness
    beat.report_progress(4, 300, 100.0)
    beat._beat()
    assert [r.tokens for r in dht.sent] == [0, 300]
    dht.progress = [ProgressReport("a", 5, 0, 100.0, clock[0])]  # a's progress shows a new round
    clock[0] += 1
    beat._beat()
    assert dht.read_keys.count("rounds_key") == 2
    beat.report_progress(4, 400, 0.0)  # this peer's phase ended: sent at once
    clock[0] += 1
    beat._beat()
    assert [(r.tokens, r.tokens_per_s) for r in dht.sent][-1] == (400, 0.0)
    clock[0] += heartbeat.cadence.ROUNDS_EVERY_S  # nothing new for 10 s: read the records anyway
    beat._beat()
    assert dht.read_keys.count("rounds_key") == 3


def test_a_peer_that_convicted_someone_since_its_last_report_says_so_before_it_leaves(clock, monkeypatch):
    # CI of session 33: a peer convicted a reducer on another's case and ended its run 2 s later
    # (swarm.linger_s = 0): no beat published the accusation, and the organiser's list named one
    # accuser of two. Leaving now publishes it, once; a peer with nothing new to say sends nothing.
    dht = ScriptedDHT()
    gate = Gate()
    gate.convicted = set()
    beat = scripted(monkeypatch, dht)
    beat.gate = gate
    beat.report_progress(4, 0, 100.0)
    beat._beat()
    assert dht.convicted == [[]]
    gate.convicted = {"liar"}  # the verdict came in after the last beat
    beat.stop()  # the thread never started: only the last word
    assert dht.convicted == [[], ["liar"]] and dht.sent[-1].round == 4
    beat.stop()
    assert len(dht.sent) == 2  # nothing new: nothing sent
