"""The observer's view of a run (p2p_diloco/observatory.py): who counted, why not, verified work.
Every expected value is worked out by hand from the records below."""

from __future__ import annotations

from p2p_diloco.network import RoundRecord
from p2p_diloco.observatory import REASONS, RunLog, Target, prometheus
from p2p_diloco.rounds import Progress

A, B, C, D = "peer-aaaaaaaa", "peer-bbbbbbbb", "peer-cccccccc", "peer-dddddddd"
D1, D2, D3, D4, X = "1" * 64, "2" * 64, "3" * 64, "4" * 64, "9" * 64


def rec(peer, round_, digest, tokens=100, group=(), outcome="averaged", copied=False, loss=2.0):
    return RoundRecord(peer, round_, digest, tokens, loss, copied=copied, group=tuple(group), outcome=outcome)


def beat(peer, t, tokens_per_s=50.0):
    return Progress(peer, 0, 0, tokens_per_s, t)


def four_rounds() -> RunLog:
    """A and B average together every round. C averages alone in round 1, catches up in round 2,
    and is stopped (no heartbeat) from then on, its record left in the DHT. D claims round 3 in a
    group nobody confirms. Round 4 is the latest: still open."""
    log = RunLog("r", "fp", rounds_total=10)
    start = {p: rec(p, 0, "0" * 64, 0, outcome="start") for p in (A, B, C)}
    log.ingest(start, [beat(A, 0), beat(B, 0), beat(C, 0)], {}, now=0)
    one = {A: rec(A, 1, D1, group=(A, B)), B: rec(B, 1, D1, 120, group=(A, B)), C: rec(C, 1, X, 80, outcome="alone")}
    log.ingest(one, [beat(A, 9), beat(B, 9), beat(C, 9)], {}, now=10)
    stopped = rec(C, 2, D2, 0, outcome="start", copied=True)  # stays in the DHT (90 s), unchanged
    two = {A: rec(A, 2, D2, group=(A, B)), B: rec(B, 2, D2, group=(A, B)), C: stopped}
    log.ingest(two, [beat(A, 19), beat(B, 19), beat(C, 19)], {}, now=20)
    claim = rec(D, 3, D3, 5000, group=(A, D))
    three = {A: rec(A, 3, D3, group=(A, B)), B: rec(B, 3, D3, group=(A, B)), C: stopped, D: claim}
    log.ingest(three, [beat(A, 29), beat(B, 29)], {C: [A]}, now=30)
    four = {A: rec(A, 4, D4, group=(A, B)), B: rec(B, 4, D4, group=(A, B)), C: stopped, D: claim}
    log.ingest(four, [beat(A, 39), beat(B, 39)], {C: [A]}, now=40)
    return log


def test_a_round_counts_the_members_its_group_confirms_and_says_why_not_for_the_others():
    view = four_rounds().view(now=41)
    by_round = {r["round"]: r for r in view["rounds"]}
    one, two, three = by_round[1], by_round[2], by_round[3]
    assert (one["digest"], one["counted"], one["all_agree"], one["tokens"]) == (D1, [A, B], False, 220)
    assert one["not_counted"] == [{"peer": C, "name": "cccccccc", "reason": REASONS["alone"]}]
    assert two["counted"] == [A, B] and two["not_counted"][0]["reason"] == REASONS["copied"]
    assert two["all_agree"]  # C's copy holds the agreed digest
    assert three["counted"] == [A, B]
    reasons = {n["peer"]: n["reason"] for n in three["not_counted"]}
    assert reasons == {C: REASONS["silent"], D: REASONS["unconfirmed"]}
    assert by_round[0]["not_counted"] == [] and by_round[4]["not_counted"] == []  # a start; still open


def test_contributors_are_credited_only_for_rounds_where_they_were_counted():
    view = four_rounds().view(now=41)
    assert [(c["peer"], c["tokens"], c["rounds"]) for c in view["contributors"]] == [(B, 420, 4), (A, 400, 4)]


def test_the_run_card_online_peers_and_the_next_round_due():
    view = four_rounds().view(now=41)
    assert view["run"] == {
        "run_id": "r",
        "fingerprint": "fp",
        "rounds_total": 10,
        "round": 4,
        "round_due_in_s": 9.0,  # rounds start every 10 s: round 4 started at 40, due at 50
        "finished": False,
        "eval_round": None,
        "eval_loss": None,
    }
    online = {p["peer"]: p["online"] for p in view["peers"]}
    assert online == {A: True, B: True, C: False, D: False}  # last signs of life: C at 20, D at 30
    assert {p["peer"]: p["convicted_by"] for p in view["peers"]}[C] == [A]


def test_the_held_out_loss_shows_only_for_the_agreed_digest():
    log = four_rounds()
    log.note_evaluation(3, D3, 1.25)
    log.note_evaluation(2, X, 9.0)  # a state that is not the round's agreed one
    by_round = {r["round"]: r for r in log.view(now=41)["rounds"]}
    assert by_round[3]["eval_loss"] == 1.25 and by_round[2]["eval_loss"] is None


def test_prometheus_text_has_the_run_s_figures():
    text = prometheus(four_rounds().view(now=41))
    assert 'p2p_diloco_round{run_id="r"} 4' in text
    assert 'p2p_diloco_peers_online{run_id="r"} 2' in text
    assert 'p2p_diloco_verified_tokens_total{run_id="r"} 820' in text
    assert f'p2p_diloco_peer_verified_tokens{{run_id="r",peer="{B}"}} 420' in text
    assert "# TYPE p2p_diloco_round gauge" in text and text.endswith("\n")


def test_the_observer_evaluates_the_newest_round_its_counted_peers_agreed_on_from_a_peer_that_holds_it():
    log = four_rounds()
    assert log.to_evaluate(every=1, now=41) == Target(4, D4, (A, B))  # their latest records hold round 4
    assert log.to_evaluate(every=1, now=40 + 10) is None  # A and B were last seen at 40 (new records): offline
    assert (log.agreed(1), log.agreed(3), log.agreed(0)) == (D1, D3, "")  # round 0: nobody averaged
    log.note_evaluation(4, D4, 2.5)
    assert log.to_evaluate(every=1, now=41) is None  # nothing newer than round 4
    run = log.view(now=41)["run"]
    assert (run["eval_round"], run["eval_loss"]) == (4, 2.5)
    text = prometheus(log.view(now=41))
    assert 'p2p_diloco_eval_loss{run_id="r"} 2.5' in text and 'p2p_diloco_eval_round{run_id="r"} 4' in text


def test_the_observer_waits_every_rounds_and_downloads_only_from_peers_that_serve():
    log = four_rounds()
    log.note_evaluation(2, D2, 3.0)
    assert log.to_evaluate(every=3, now=41) is None  # round 4 < 2 + 3
    assert log.to_evaluate(every=2, now=41) == Target(4, D4, (A, B))
    client = RoundRecord(A, 5, "5" * 64, 100, 2.0, serves=False, group=(A, B), outcome="averaged")
    log.ingest({A: client, B: rec(B, 5, "5" * 64, group=(A, B))}, [beat(A, 49), beat(B, 49)], {}, now=50)
    assert log.to_evaluate(every=1, now=51) == Target(5, "5" * 64, (B,))  # A is in client mode: nobody reaches it


def test_a_round_nobody_else_confirms_is_not_evaluated_and_a_wrong_evaluation_is_not_shown():
    log = RunLog("r", "fp", rounds_total=10)
    log.ingest({A: rec(A, 1, D1, group=(A, B))}, [beat(A, 0)], {}, now=0)  # A's claim alone
    assert log.to_evaluate(every=1, now=1) is None
    log.note_evaluation(1, D1, 1.0)  # (an evaluation of a state nobody confirmed)
    assert log.view(now=1)["run"]["eval_loss"] is None


def test_peers_are_named_as_their_certificates_name_them_and_otherwise_by_their_ids_end():
    log = four_rounds()
    log.ingest({}, [beat(A, 45)], {}, {A: "alice"}, now=45)
    view = log.view(now=45)
    assert {p["peer"]: p["name"] for p in view["peers"]} == {A: "alice", B: "bbbbbbbb", C: "cccccccc", D: "dddddddd"}
    assert [(c["peer"], c["name"]) for c in view["contributors"]] == [(B, "bbbbbbbb"), (A, "alice")]


def test_status_sums_up_the_last_closed_round_not_the_one_still_being_published():
    from p2p_diloco.observe import status_lines

    def round_(r, counted, closed=True):
        return {
            "round": r,
            "digest": str(r) * 32,
            "all_agree": True,
            "counted": counted,
            "train_loss": None,
            "closed": closed,
        }

    run = {"run_id": "r", "fingerprint": "f", "round": 8, "rounds_total": 10, "finished": False}
    view = {"run": run, "rounds": [round_(6, ["a", "b"]), round_(7, ["a"], False), round_(8, [], False)], "peers": []}
    assert status_lines(view)[2] == f"round 6: digest {'6' * 12}, every peer agrees, 2 counted"
    view["rounds"][1:] = [round_(7, ["a", "b"]), round_(8, [], False)]
    assert status_lines(view)[2] == f"round 7: digest {'7' * 12}, every peer agrees, 2 counted"
    view["rounds"] = [round_(8, [], False)]
    assert len(status_lines(view)) == 2  # no round closed yet: nothing to sum up
