"""Readers that poll less often than rounds end (the observer, `status`) miss no round: each round
record repeats its peer's final records of its last rounds (`RoundRecord.history`, protocol/network.py),
bounded and parsed entry by entry (I4), and `RunLog` credits every round from them. Every expected
value is worked out by hand from the records below."""

from __future__ import annotations

from dataclasses import asdict, replace

from p2p_diloco.observe.run_view import MIN_POLL_S, REASONS, RunLog
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import HISTORY_MEMBERS, HISTORY_ROUNDS, PastRound, RoundRecord, history_after

A, B, C = "PeerAaaaaaaa", "PeerBbbbbbbb", "PeerCccccccc"  # base58, as libp2p ids are
X = "f" * 32  # a digest of C's own (it averaged alone)


def digest(round_: int) -> str:
    return f"{round_:x}" * 32


def beat(peer, t):
    return ProgressReport(peer, 0, 0, 50.0, t)


class Publisher:
    """One peer's records as `Swarm.publish_round` makes them: each repeats the ones before."""

    def __init__(self, peer: str):
        self.peer, self.last = peer, None

    def publish(self, round_, digest_, tokens=0, group=(), outcome="start", copied=False) -> RoundRecord:
        record = RoundRecord(self.peer, round_, digest_, tokens, 2.0, copied=copied, group=group, outcome=outcome)
        self.last = replace(record, history=history_after(self.last, round_))
        return self.last


def on_the_wire(record: RoundRecord) -> dict:
    """What records.publish_round stores (msgpack keeps tuples, as asdict makes them)."""
    return {**asdict(record), "addrs": list(record.addrs)}


# --- what a record carries -------------------------------------------------------------------------


def test_a_record_repeats_the_peer_s_final_record_of_each_of_its_last_rounds():
    a = Publisher(A)
    a.publish(0, digest(0))
    a.publish(1, digest(1), 100, (A, B), "averaged")
    a.publish(2, X, 100, (A, B), "averaged")  # its own digest, then the majority's, downloaded:
    a.publish(2, digest(2), 100, copied=True)  # the copy is its final word on round 2
    three = a.publish(3, digest(3), 100, (A, B), "averaged")
    assert [(p.round, p.digest, p.copied) for p in three.history] == [
        (2, digest(2), True),
        (1, digest(1), False),
        (0, digest(0), False),
    ]
    assert three.history[1] == PastRound(1, digest(1), 100, 2.0, False, (A, B), "averaged")
    assert RoundRecord.parse(on_the_wire(three)) == three  # what a reader parses is what was published


def test_the_history_is_bounded_in_rounds_and_in_group_members():
    a = Publisher(A)
    for r in range(20):
        latest = a.publish(r, digest(r % 16), 100, (A, B), "averaged")
    assert [p.round for p in latest.history] == list(range(18, 18 - HISTORY_ROUNDS, -1))
    big = tuple(f"peer-{i:08d}" for i in range(40))  # 40 + 40 > HISTORY_MEMBERS: one round of these
    b = Publisher(B)
    b.publish(0, digest(0), 100, big, "averaged")
    b.publish(1, digest(1), 100, big, "averaged")
    assert [p.round for p in b.publish(2, digest(2), 100, big, "averaged").history] == [1]
    assert HISTORY_MEMBERS == 64


def test_a_record_without_history_still_parses():
    old = {"peer": A, "round": 3, "digest": digest(3), "tokens": 5, "loss": 2.5, "group": [A, B], "outcome": "averaged"}
    assert RoundRecord.parse(old) == RoundRecord(A, 3, digest(3), 5, 2.5, group=(A, B), outcome="averaged")


def test_a_malformed_history_entry_is_dropped_never_the_record():
    good = {"round": 4, "digest": digest(4), "tokens": 7, "loss": 1.5, "group": [A, B], "outcome": "averaged"}
    bad = [
        "text",
        None,
        {**good, "round": 9},  # not before the record's own round
        {**good, "round": -1},
        {**good, "round": float("inf")},  # int(inf) raises OverflowError
        {**good, "digest": "zz"},
        {**good, "tokens": "many"},
        {**good, "group": 5},
        {k: v for k, v in good.items() if k != "loss"},
    ]
    value = {
        "peer": A,
        "round": 9,
        "digest": digest(9),
        "tokens": 1,
        "loss": 1.0,
        "history": [*bad[:4], good, *bad[4:]],
    }
    assert RoundRecord.parse(value).history == (PastRound(4, digest(4), 7, 1.5, False, (A, B), "averaged"),)
    for history in ["text", 5, {"round": 4}, None]:  # not a list: no history
        assert RoundRecord.parse({**value, "history": history}).history == ()


def test_a_reader_keeps_one_entry_a_round_and_at_most_the_publisher_s_bounds():
    entry = {"digest": digest(1), "tokens": 1, "loss": 1.0}
    many = [{**entry, "round": r} for r in [3, 3, 2, *range(30)]]
    value = {"peer": A, "round": 40, "digest": digest(0), "tokens": 1, "loss": 1.0, "history": many}
    # Only the first HISTORY_ROUNDS entries are read: rounds 3, 3, 2, 0, 1, 2, 3, 4.
    assert [p.round for p in RoundRecord.parse(value).history] == [4, 3, 2, 1, 0]


def test_a_record_whose_round_is_not_a_number_is_dropped_not_raised():
    value = {"peer": A, "round": float("inf"), "digest": digest(1), "tokens": 1, "loss": 1.0}
    assert RoundRecord.parse(value) is None


# --- what a reader makes of it ---------------------------------------------------------------------


def six_rounds(polls: list[float]) -> RunLog:
    """A, B and C average as a group each round, 1 s apart, from t = 0 (round 0: θ(0)) to round 6 at
    t = 6, except round 3, which C averages alone (its own digest X), and round 4, whose state C
    downloads instead (it caught up). The observer reads the DHT at `polls` (and a heartbeat of
    every peer at each): what it reads is each peer's latest record at that time."""
    peers = {p: Publisher(p) for p in (A, B, C)}
    tokens = {A: 100, B: 120, C: 80}
    timeline = {0: {p: peers[p].publish(0, digest(0)) for p in peers}}
    for r in range(1, 7):
        group = (A, B) if r in (3, 4) else (A, B, C)
        timeline[r] = {p: peers[p].publish(r, digest(r), tokens[p], group, "averaged") for p in (A, B)}
        if r == 3:
            timeline[r][C] = peers[C].publish(3, X, 80, (C,), "alone")
        elif r == 4:
            timeline[r][C] = peers[C].publish(4, digest(4), copied=True)
        else:
            timeline[r][C] = peers[C].publish(r, digest(r), 80, group, "averaged")
    log = RunLog("r", "fp", rounds_total=100)
    for t in polls:
        latest = timeline[min(int(t), 6)]
        log.ingest(latest, [beat(p, t) for p in peers], {}, now=t)
    return log


def rounds_of(log: RunLog, now: float) -> dict[int, tuple]:
    return {
        r["round"]: (r["digest"], r["counted"], r["tokens"], [(n["peer"], n["reason"]) for n in r["not_counted"]])
        for r in log.view(now)["rounds"]
    }


def test_a_reader_that_polls_every_few_rounds_credits_every_round_as_one_that_polls_every_round():
    every_round = rounds_of(six_rounds([0, 1, 2, 3, 4, 5, 6]), now=6.5)
    every_third = six_rounds([0, 3.5, 6.2])  # rounds 1, 2, 4 and 5 are nobody's latest at any poll
    assert rounds_of(every_third, now=6.5) == every_round
    by_round = rounds_of(every_third, now=6.5)
    assert by_round[2] == (digest(2), [A, B, C], 300, [])
    assert by_round[3] == (digest(3), [A, B], 220, [(C, REASONS["alone"])])
    assert by_round[4] == (digest(4), [A, B], 220, [(C, REASONS["copied"])])
    assert by_round[5] == (digest(5), [A, B, C], 300, [])
    contributors = every_third.view(now=6.5)["contributors"]
    # A: 6 rounds of 100; B: 6 of 120; C: rounds 1, 2, 5 and 6, 80 each.
    assert [(c["peer"], c["tokens"], c["rounds"]) for c in contributors] == [(B, 720, 6), (A, 600, 6), (C, 320, 4)]


def test_before_history_a_poll_every_third_round_missed_four_of_six_rounds():
    """The failure this fixes, replayed: the same polls of records without history."""
    log = RunLog("r", "fp", rounds_total=100)
    full = six_rounds([0, 3.5, 6.2])
    for t, r in [(0, 0), (3.5, 3), (6.2, 6)]:
        latest = {p: replace(rec, history=()) for p, rec in full.rounds[r].records.items()}
        log.ingest(latest, [beat(p, t) for p in (A, B, C)], {}, now=t)
    assert sorted(log.rounds) == [0, 3, 6]


def test_a_round_closes_when_every_online_peer_in_it_has_published_a_later_round():
    log = six_rounds([0, 3.5, 6.2])
    assert [r["round"] for r in log.view(now=6.5)["rounds"] if not r["closed"]] == [6]  # all three are at 6
    assert not log.closed(6, now=6.5) and log.closed(5, now=6.5)
    assert log.closed(6, now=6.2 + 10)  # nobody online any more: nothing more can come
    log.rounds_total = 6
    assert log.closed(6, now=6.5)  # the run's last round: there is no later one to publish


def test_a_round_a_late_member_has_not_yet_published_stays_open():
    """B's record of round 2 is not in yet (it is slow) while A is at round 3: round 2 is open, so a
    summary read now does not report it as A alone, unconfirmed."""
    a, b = Publisher(A), Publisher(B)
    log = RunLog("r", "fp", rounds_total=100)
    log.ingest(
        {A: a.publish(1, digest(1), 100, (A, B), "averaged"), B: b.publish(1, digest(1), 120, (A, B), "averaged")},
        [beat(A, 1), beat(B, 1)],
        {},
        now=1,
    )
    a.publish(2, digest(2), 100, (A, B), "averaged")
    log.ingest({A: a.publish(3, digest(3), 100, (A, B), "averaged"), B: b.last}, [beat(A, 3), beat(B, 3)], {}, now=3)
    assert (log.closed(1, now=3), log.closed(2, now=3)) == (False, False)  # B is still at round 1
    two = next(r for r in log.view(now=3)["rounds"] if r["round"] == 2)
    assert (two["counted"], two["not_counted"]) == ([], [])  # open: nobody is said to be missing yet
    log.ingest({A: a.last, B: b.publish(2, digest(2), 120, (A, B), "averaged")}, [beat(A, 4), beat(B, 4)], {}, now=4)
    assert (log.closed(1, now=4), log.closed(2, now=4)) == (True, False)  # B may still replace its record of 2
    log.ingest({A: a.last, B: b.publish(3, digest(3), 120, (A, B), "averaged")}, [beat(A, 5), beat(B, 5)], {}, now=5)
    assert log.closed(2, now=5)
    assert next(r for r in log.view(now=5)["rounds"] if r["round"] == 2)["counted"] == [A, B]


def test_a_record_replaced_within_its_round_is_credited_by_the_replacement():
    """C published its own digest of round 2, then downloaded the majority's: a poll between the two
    saw the first; C's record of round 3 repeats the copy, its final word on round 2."""
    pubs = {p: Publisher(p) for p in (A, B, C)}
    log = RunLog("r", "fp", rounds_total=100)
    two = {p: pubs[p].publish(2, digest(2), 100, (A, B, C), "averaged") for p in (A, B)}
    two[C] = pubs[C].publish(2, X, 100, (A, B, C), "averaged")
    log.ingest(two, [beat(p, 2) for p in pubs], {}, now=2)
    assert next(r for r in log.view(now=2.5)["rounds"] if r["round"] == 2)["all_agree"] is False
    pubs[C].publish(2, digest(2), 100, copied=True)
    three = {p: pubs[p].publish(3, digest(3), 100, (A, B), "averaged") for p in (A, B)}
    three[C] = pubs[C].publish(3, digest(3), 0, copied=True)
    log.ingest(three, [beat(p, 3) for p in pubs], {}, now=3)
    round2 = next(r for r in log.view(now=3.5)["rounds"] if r["round"] == 2)
    assert (round2["all_agree"], round2["counted"]) == (True, [A, B])
    assert round2["not_counted"] == [{"peer": C, "name": "Cccccccc", "reason": REASONS["copied"]}]


def test_the_next_round_is_due_from_round_lengths_even_when_polls_skip_rounds():
    log = six_rounds([0, 3.5, 6.2])  # rounds 0, 3 and 6 seen starting, at 0, 3.5 and 6.2 s
    # lengths (3.5 - 0) / 3 and (6.2 - 3.5) / 3 = 1.167 and 0.9 s: median 1.033 s; round 6 seen at
    # 6.2, due at 7.233: in 0.7 s (a median of lengths between polls, 2.7-3.5 s, said 3.1 s)
    assert log.view(now=6.5)["run"]["round_due_in_s"] == 0.7


def paced_rounds(lengths: list[float], poll_in) -> RunLog:
    """A and B average round after round, round r lasting lengths[r]; a reader polls at t = 0 and
    then after poll_in(log) seconds each time, until one is past the last round's start: what it credited."""
    a, b = Publisher(A), Publisher(B)
    starts = [sum(lengths[:r]) for r in range(len(lengths) + 1)]
    timeline = [{A: a.publish(0, digest(0)), B: b.publish(0, digest(0))}]
    for r in range(1, len(starts)):
        timeline.append({p: w.publish(r, digest(r % 16), 100, (A, B), "averaged") for p, w in ((A, a), (B, b))})
    log, t = RunLog("r", "fp", rounds_total=1000), 0.0
    while True:  # the last poll is the first one past the last round's start
        latest = timeline[max(r for r, s in enumerate(starts) if s <= t)]
        log.ingest(latest, [beat(A, t), beat(B, t)], {}, now=t)
        if t >= starts[-1]:
            return log
        t += poll_in(log)


def test_a_reader_that_polls_every_4_s_misses_rounds_once_they_end_every_0_3_s():
    """The dashboard test's failure in a fresh clone, replayed: rounds of 1.5 s with three peers,
    then 0.3 s for the two left once the third fell asleep. A poll every 4 s then finds 13 rounds
    passed, more than the 8 a record repeats (HISTORY_ROUNDS): rounds are missed."""
    lengths = [1.5] * 6 + [0.3] * 60
    fixed = paced_rounds(lengths, lambda log: 4.0)
    assert len(set(range(len(lengths) + 1)) - set(fixed.rounds)) > 0
    # Following the pace (RunLog.poll_in_s) it polls sooner once it saw rounds that fast: only the
    # one poll that first met the new pace can find more rounds passed than a record repeats.
    paced = paced_rounds(lengths, lambda log: log.poll_in_s(4.0))
    missed = sorted(set(range(len(lengths) + 1)) - set(paced.rounds))
    assert missed and max(missed) - min(missed) < 13 - HISTORY_ROUNDS, missed
    # A reader asked for every 2 s misses none: 6 or 7 fast rounds a poll, then sooner.
    assert set(paced_rounds(lengths, lambda log: log.poll_in_s(2.0)).rounds) == set(range(len(lengths) + 1))


def test_a_reader_of_fast_rounds_polls_every_second_until_it_knows_their_pace_and_misses_none():
    lengths = [0.15] * 100  # 15 s of rounds of 0.15 s: 33 rounds in 5 s, 6.7 in the 1 s floor
    assert set(paced_rounds(lengths, lambda log: log.poll_in_s(5.0)).rounds) == set(range(101))
    # A poll every 5 s: each finds a round and the 8 before it, about 9 of every 33 (29 of 101 here).
    assert len(paced_rounds(lengths, lambda log: 5.0).rounds) < 35
    empty = RunLog("r", "fp", rounds_total=10)
    assert empty.poll_in_s(5.0) == 5.0  # no round seen start yet: nothing to miss
    one = paced_rounds([], lambda log: 5.0)  # one poll: round 0 seen start
    assert one.poll_in_s(5.0) == MIN_POLL_S == 1.0 and one.poll_in_s(0.5) == 0.5  # the floor, or the reader's own
    slow = paced_rounds([60.0] * 5, lambda log: log.poll_in_s(5.0))
    assert slow.poll_in_s(5.0) == 5.0  # rounds of a minute: the reader's own interval
