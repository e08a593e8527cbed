"""A run's genesis (p2p_diloco/protocol/genesis.py): what a starting peer makes of the run it found, and a
peer that comes after the end. Pure decisions with values by hand, then one real peer in-process."""

from __future__ import annotations

import logging
import time

import pytest

from p2p_diloco.errors import RunFinished
from p2p_diloco.protocol import genesis
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.round import joining
from tests.unit.fake_swarm import FakeSwarm
from tests.unit.test_round_protocol import make_peer, moved, records, run

MINE, OTHER, THIRD = "f" * 16, "a" * 16, "b" * 16
T0, D = "0" * 32, "d" * 32  # digests as outer.digest writes them
ROUNDS = 12


def g(fp=MINE, theta0="t0", final=-1, digest=""):
    return Genesis(fp, theta0, final, digest)


def test_live_peers_of_the_own_config_are_joined_whatever_the_genesis_says():
    found = {"p1": g(OTHER), "p2": g(OTHER)}
    assert genesis.judge(MINE, {MINE: 1, OTHER: 0}, found, ROUNDS).kind == "join"


def test_live_peers_of_another_config_refuse_the_peer():
    assert genesis.judge(MINE, {MINE: 0, OTHER: 2}, {}, ROUNDS) == Verdict("other", rival=OTHER)


def test_with_nobody_live_the_genesis_published_by_most_peers_is_the_run():
    found = {"p1": g(OTHER), "p2": g(OTHER), "p3": g(MINE)}
    assert genesis.judge(MINE, {MINE: 0}, found, ROUNDS) == Verdict("other", rival=OTHER, publishers=2)
    found["p4"] = g(MINE)  # 2 against 2: the smaller fingerprint is the run's ("a..." < "f...")
    assert genesis.judge(MINE, {MINE: 0}, found, ROUNDS).rival == OTHER
    found["p5"] = g(MINE)
    verdict = genesis.judge(MINE, {MINE: 0}, found, ROUNDS)
    assert (verdict.kind, verdict.publishers, verdict.final, verdict.theta0) == ("dormant", 3, None, "t0")


def test_no_genesis_and_nobody_live_is_a_new_run():
    assert genesis.judge(MINE, {MINE: 0}, {}, ROUNDS) == Verdict("new")


def test_the_end_is_the_final_digest_most_publishers_name_at_the_last_round():
    found = {
        "p1": g(final=ROUNDS, digest="d1"),
        "p2": g(final=ROUNDS, digest="d2"),
        "p3": g(final=ROUNDS, digest="d2"),
        "p4": g(final=ROUNDS + 5, digest="d9"),  # not this config's end: ignored
        "p5": g(OTHER, final=ROUNDS, digest="d7"),  # another config's
    }
    final = genesis.judge(MINE, {MINE: 0}, found, ROUNDS).final
    assert final is not None and (final.final_round, final.final_digest) == (ROUNDS, "d2")
    assert genesis.judge(MINE, {MINE: 0}, {"p1": g(), "p4": found["p4"]}, ROUNDS).final is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        "text",
        {"fingerprint": MINE, "theta0": T0, "final_digest": "", "signature": ""},  # no final_round
        {"fingerprint": MINE, "theta0": T0, "final_round": 3, "final_digest": "", "signature": ""},  # no digest
        {"fingerprint": MINE, "theta0": T0, "final_round": -1, "final_digest": D, "signature": ""},
        {"fingerprint": "", "theta0": T0, "final_round": -1, "final_digest": "", "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": 2.5, "final_digest": D, "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": True, "final_digest": "", "signature": ""},
        {"fingerprint": MINE, "theta0": "x" * 5000, "final_round": -1, "final_digest": "", "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": -1, "final_digest": "", "signature": "", "shared": []},
        # what every record's fields must be (trust/wire.py): real digests and fingerprints, configs of sections
        {"fingerprint": MINE, "theta0": "t0", "final_round": -1, "final_digest": "", "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": 4, "final_digest": "d", "signature": ""},
        {"fingerprint": "x" * 16, "theta0": T0, "final_round": -1, "final_digest": "", "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": 2**64, "final_digest": D, "signature": ""},
        {"fingerprint": MINE, "theta0": T0, "final_round": -1, "final_digest": "", "signature": "", "shared": {"a": 1}},
    ],
)
def test_a_malformed_genesis_record_is_dropped(value):
    assert Genesis.parse(value) is None


def test_a_genesis_record_reads_back_as_written():
    own = Genesis(MINE, T0, signature="sig", shared={"run": {"rounds": ROUNDS}})
    assert Genesis.parse(own.as_dict()) == own and Genesis.parse(own.finished_at(12, D).as_dict()).final_round == 12


def test_a_peer_adds_its_genesis_record_only_while_fewer_than_COPIES_carry_it():
    own = g()
    found = {f"p{i}": g() for i in range(genesis.COPIES - 1)} | {"x": g(OTHER)}
    assert genesis.should_publish(found, own)
    found["last"] = g()
    assert not genesis.should_publish(found, own)
    assert genesis.should_publish(found, own.finished_at(ROUNDS, "d"))  # the end is news


def test_a_typo_is_pointed_at_the_run_it_looks_like():
    seen = {"p2p-diloco", "c4-150m", "demo", "p2p-dilcoo"}
    assert genesis.nearby_runs("p2p-dilcoo", seen) == ["p2p-diloco"]
    assert genesis.nearby_runs("zzzz", seen) == ["c4-150m", "demo", "p2p-dilcoo"]  # sorted, first 3


# --- one real peer (tests/unit/fake_swarm.py) ------------------------------------------------------


def final_of(state) -> Genesis:
    return Genesis(MINE, "t0", state.round, state.digest())


def test_a_peer_that_comes_after_the_end_stops_without_training(tmp_path):
    end = moved(make_peer(tmp_path / "first", FakeSwarm()).state, 0.01, 4)
    fake = FakeSwarm(verdict=Verdict("dormant", publishers=3, final=final_of(end)))
    with pytest.raises(RunFinished, match=r"finished at round 4 \(final digest .*no peer serves its final state"):
        make_peer(tmp_path / "late", fake, **{"run.rounds": "4"})
    assert fake.closed and not fake.calls and not fake.downloads
    assert (
        not (tmp_path / "late" / "run" / "checkpoints").exists()
        and not (tmp_path / "late" / "run" / "metrics.jsonl").exists()
    )


def test_a_peer_that_comes_while_the_last_peers_linger_downloads_the_end(tmp_path, caplog, monkeypatch):
    from p2p_diloco.round import sync

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(sync, "SETTLE_S", 0.2)
    end = moved(make_peer(tmp_path / "first", FakeSwarm()).state, 0.01, 4)
    fake = FakeSwarm(verdict=Verdict("join", publishers=1, final=final_of(end)))
    fake.publish_other("p1", end)
    late = run(make_peer(tmp_path / "late", fake, **{"run.rounds": "4"}))
    assert late.state.digest() == end.digest() and not fake.calls
    assert [r["round"] for r in records(late)] == [4] and "run complete: 4 rounds" in caplog.text


def test_a_false_claim_of_the_end_does_not_stop_a_peer_while_peers_train(tmp_path, monkeypatch):
    from p2p_diloco.round import sync

    monkeypatch.setattr(sync, "SETTLE_S", 0.2)
    fake = FakeSwarm(verdict=Verdict("join", publishers=1, final=Genesis(MINE, "t0", 4, "forged")))
    fake.publish_other("p1", moved(make_peer(tmp_path / "first", FakeSwarm()).state, 0.01, 1))
    peer = make_peer(tmp_path / "late", fake, **{"run.rounds": "4"})
    assert peer.state.round == 1
    peer.close()


def test_one_peers_record_of_the_last_round_and_its_finished_genesis_send_no_joiner_home(tmp_path):
    # The attacker m publishes a round record at the run's last round and a genesis that says the
    # run ended there. The peer between rounds finds p1 ahead of it (round 3; no state the swarm
    # backs yet) and asks whether the run ended: it counted m's record as a live peer at the end
    # and stopped with "run finished", exit 0 (issue 27; in certified runs too, m being a member).
    from p2p_diloco.protocol.network import RoundRecord

    forged = "f" * 32
    fake = FakeSwarm()
    peer = make_peer(tmp_path / "late", fake, **{"run.rounds": "4"})
    fake.final = Genesis(MINE, T0, 4, forged)
    fake.publish_other("p1", moved(peer.state, 0.01, 3))
    fake.records["m"] = RoundRecord("m", 4, forged, 10, 1.0)
    joining.refuse_a_finished_run(peer.replica, peer.state, fake, peer.config.run.run_id)  # RunFinished before
    peer.close()
    training = moved(peer.state, 0.01, 1)
    # The end as it is: the peers that made the final state are live at it, a straggler behind.
    end = moved(training, 0.01, 3)
    fake = FakeSwarm(verdict=Verdict("join", publishers=2, final=final_of(end)))
    for p in ("p1", "p2"):
        fake.publish_other(p, end)
    fake.publish_other("p3", training)
    joiner = RoundRecord("me", 0, T0, 0, -1.0)
    assert joining.end_is_backed(fake.records, set(), final_of(end), joiner)  # 2 of 4 votes: half
    claim = Genesis(MINE, T0, 4, forged)
    attacker = {"p3": fake.records["p3"], "m": RoundRecord("m", 4, forged, 10, 1.0)}
    assert not joining.end_is_backed(attacker, set(), claim, joiner)  # 1 of 3 votes
    assert joining.end_is_backed({}, set(), claim, joiner)  # nobody live: the genesis is all there is


def test_a_peer_that_slept_through_the_end_does_not_finish_the_run_alone(tmp_path):
    # It averaged round 0 with p1, then slept: p1 finished the run (round 4), lingered and left.
    # Training rounds 1-3 alone would end the run on a model the swarm never agreed on.
    end = moved(make_peer(tmp_path / "first", FakeSwarm()).state, 0.01, 4)
    fake = FakeSwarm()
    group = fake.group("p1")

    def averaged_then_slept(call):
        average = group(call)
        fake.final = final_of(end)
        fake.publish_other("p1", end)
        fake.stale = {"p1"}
        return average

    fake.script = [averaged_then_slept]
    peer = make_peer(tmp_path / "slept", fake, **{"run.rounds": "4"})
    with pytest.raises(RunFinished, match=r"finished at round 4 \(final digest .*no peer serves its final state"):
        run(peer)
    assert len(fake.calls) == 1 and [r["round"] for r in records(peer)] == [0, 1]
    assert peer.state.round == 1, "it trained nothing after round 1"


@pytest.mark.parametrize("linger_s", [0.0, 1.5])
def test_a_peer_that_finished_serves_the_final_state_for_its_linger_window(tmp_path, linger_s):
    # Nobody lacks the final state when the run ends: with a window the peer still stays (a late
    # peer or an export may come), without one it leaves at its first look.
    fake, times = FakeSwarm(), {}
    publish_final, close = fake.publish_final, fake.close

    def noted_final(round_, digest):
        times["final"] = time.monotonic()
        publish_final(round_, digest)

    def noted_close():
        times.setdefault("left", time.monotonic())
        close()

    fake.publish_final, fake.close = noted_final, noted_close  # type: ignore[method-assign]
    run(make_peer(tmp_path, fake, **{"run.rounds": "1", "swarm.linger_s": str(linger_s)}))
    stayed = times["left"] - times["final"]
    assert (linger_s <= stayed < linger_s + 1.0) if linger_s else stayed < 0.5, stayed


def test_a_peer_that_finishes_the_run_publishes_its_end(tmp_path):
    fake = FakeSwarm()
    peer = run(make_peer(tmp_path, fake, **{"run.rounds": "2"}))
    assert fake.finals == [(2, peer.state.digest())]


def test_a_peer_defers_to_another_config_only_when_nobody_runs_its_own():
    # 3 peers live under "aaaa"; a newcomer with "bbbb" is refused, one with "aaaa" joins.
    assert genesis.config_to_defer_to("bbbb", {"bbbb": 0, "aaaa": 3}) == "aaaa"
    assert genesis.config_to_defer_to("aaaa", {"aaaa": 3, "bbbb": 0}) is None
    # A config record that no live peer speaks for (squatting) counts for nothing.
    assert genesis.config_to_defer_to("aaaa", {"aaaa": 0, "bbbb": 0}) is None
    # Whoever runs this peer's config, it joins them, even if another config has more peers.
    assert genesis.config_to_defer_to("aaaa", {"aaaa": 1, "bbbb": 5}) is None
    # Several others: the most live peers, then the smallest fingerprint.
    assert genesis.config_to_defer_to("cccc", {"aaaa": 2, "bbbb": 4, "dddd": 4}) == "bbbb"
    assert genesis.config_to_defer_to("cccc", {}) is None
