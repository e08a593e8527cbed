"""The observer's view of a run (p2p_diloco/observe/run_view.py): who counted, why not, verified work.
Every expected value is worked out by hand from the records below."""

from __future__ import annotations

from functools import partial

from p2p_diloco.observe.run_view import REASONS, RunLog, Target, prometheus
from p2p_diloco.observe.service import status_lines
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.trust.robust import weighed_tokens

A, B, C, D = "peer-aaaaaaaa", "peer-bbbbbbbb", "peer-cccccccc", "peer-dddddddd"
D1, D2, D3, D4, X = "1" * 64, "2" * 64, "3" * 64, "4" * 64, "9" * 64


def rec(peer, round_, digest, tokens=100, group=(), outcome="averaged", copied=False, loss=2.0):
    return RoundRecord(peer, round_, digest, tokens, loss, copied=copied, group=tuple(group), outcome=outcome)


def beat(peer, t, tokens_per_s=50.0):
    return ProgressReport(peer, 0, 0, tokens_per_s, t)


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
        "tokens_per_s": 100.0,  # A and B online, 50 tokens/s each (C and D: offline)
        "eval_every": 0,
        "eval_off": "held-out loss off: not asked for",
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
    assert 'p2p_diloco_tokens_per_s{run_id="r"} 100.0' in text and 'p2p_diloco_peers_revoked{run_id="r"} 0' in text
    assert f'p2p_diloco_peer_verified_tokens{{run_id="r",peer="{B}"}} 420' in text
    assert 'p2p_diloco_round_groups{run_id="r"} 1' in text  # one flat group
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
    tiers = {p["peer"]: p["tier"] for p in log.view(now=51)["peers"]}
    assert (tiers[A], tiers[B]) == ("private", "public")  # what the dashboard and status show
    # A private peer under hole punching is shown as punched, and still serves nobody its state.
    punched = RoundRecord(A, 6, "6" * 64, 100, 2.0, serves=False, group=(A, B), outcome="averaged", punches=True)
    log.ingest({A: punched, B: rec(B, 6, "6" * 64, group=(A, B))}, [beat(A, 59), beat(B, 59)], {}, now=60)
    assert {p["peer"]: p["tier"] for p in log.view(now=61)["peers"]}[A] == "punched"
    assert log.to_evaluate(every=1, now=61) == Target(6, "6" * 64, (B,))
    assert "1 punched: behind NAT, hole punching" in status_lines(log.view(now=61))[1]


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
    from p2p_diloco.observe.service import status_lines

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


def three_unequal(how: str) -> RunLog:
    """A, B and C average as one group in rounds 1 and 2; B trains ten times the tokens of A and C."""
    log = RunLog("r", "fp", rounds_total=10, credit=partial(weighed_tokens, how=how, weight_cap=2.0))
    for r in (1, 2):
        records = {p: rec(p, r, D1 if r == 1 else D2, 1000 if p == B else 100, group=(A, B, C)) for p in (A, B, C)}
        log.ingest(records, [beat(p, 10 * r) for p in (A, B, C)], {}, now=10 * r)
    return log


def test_a_peer_is_credited_with_what_its_groups_average_weighed_its_tokens_at():
    # weight_cap 2 x the lower median of (100, 1000, 100), 100: B's 1000 tokens weighed as 200
    # (clip, aligned-clip, centered-clip); mean weighs them all; trimmed-mean counts each sender
    # once, as at most the median's 100.
    for how, b_weighed in (
        ("aligned-clip", 200),
        ("clip", 200),
        ("centered-clip", 200),
        ("mean", 1000),
        ("trimmed-mean", 100),
    ):
        view = three_unequal(how).view(now=21)
        credit = {c["peer"]: (c["tokens"], c["tokens_trained"], c["rounds"]) for c in view["contributors"]}
        assert credit == {A: (200, 200, 2), B: (2 * b_weighed, 2000, 2), C: (200, 200, 2)}, how
        two = view["rounds"][-1]
        assert (two["tokens"], two["tokens_trained"]) == (200 + b_weighed, 1200), how


def test_revoked_and_convicted_peers_are_marked_with_why_from_the_round_after_on():
    log = four_rounds()  # C is stopped from round 2 on, its record left; A convicted C at 30
    log.ingest({}, [beat(A, 45)], {C: [A]}, revoked={C: ("sold its GPU time twice", 25.0)}, now=45)
    view = log.view(now=45)
    peers = {p["peer"]: p for p in view["peers"]}
    assert (peers[C]["revoked"], peers[C]["convicted_by"], peers[A]["revoked"]) == (
        "sold its GPU time twice",
        [A],
        None,
    )
    reasons = {r["round"]: {n["peer"]: n["reason"] for n in r["not_counted"]} for r in view["rounds"]}
    assert reasons[1][C] == REASONS["alone"]  # before the revocation (issued at 25): what it was then
    assert reasons[3][C] == f"{REASONS['revoked']}: sold its GPU time twice"  # round 3 started at 30
    log = four_rounds()  # the same conviction without a revocation: from the round after it was seen
    stopped = rec(C, 2, D2, 0, outcome="start", copied=True)
    five = {A: rec(A, 5, "5" * 64, group=(A, B)), B: rec(B, 5, "5" * 64, group=(A, B)), C: stopped}
    log.ingest(five, [beat(A, 49), beat(B, 49)], {C: [A]}, now=50)  # closes round 4
    reasons = {r["round"]: {n["peer"]: n["reason"] for n in r["not_counted"]} for r in log.view(now=51)["rounds"]}
    assert reasons[3][C] == REASONS["silent"]  # seen convicted at 30, as round 3 began
    assert reasons[4][C] == f"{REASONS['convicted']} (by 1 peer(s))"


def test_a_contributor_that_was_revoked_keeps_its_verified_work_and_says_so():
    log = three_unequal("mean")
    log.ingest({}, [], {}, revoked={B: ("", 30.0)}, now=30)
    marked = {c["peer"]: (c["tokens"], c["revoked"], c["convicted_by"]) for c in log.view(now=31)["contributors"]}
    assert marked == {B: (2000, "no reason given", []), A: (200, None, []), C: (200, None, [])}


def test_a_peer_s_speed_is_its_last_measured_one_not_the_zero_it_reports_between_phases():
    log = RunLog("r", "fp", rounds_total=10)
    log.ingest({}, [beat(A, 1, tokens_per_s=80.0), beat(B, 1, tokens_per_s=20.0)], {}, now=1)
    log.ingest({}, [beat(A, 2, tokens_per_s=0.0), beat(B, 2, tokens_per_s=30.0)], {}, now=2)
    view = log.view(now=3)
    assert {p["peer"]: p["tokens_per_s"] for p in view["peers"]} == {A: 80.0, B: 30.0}
    assert view["run"]["tokens_per_s"] == 110.0


def test_the_run_s_last_round_is_evaluated_whatever_eval_every_says():
    log = RunLog("r", "fp", rounds_total=4)
    for r in range(1, 5):
        log.ingest({p: rec(p, r, str(r) * 64, group=(A, B)) for p in (A, B)}, [beat(A, r), beat(B, r)], {}, now=r)
        if r == 3:
            assert log.to_evaluate(every=10, now=r) == Target(3, "3" * 64, (A, B))  # the first
            log.note_evaluation(3, "3" * 64, 2.0)
    assert log.to_evaluate(every=10, now=4) == Target(4, "4" * 64, (A, B))  # 4 < 3 + 10, but the last
    log.note_evaluation(4, "4" * 64, 1.9)
    assert log.to_evaluate(every=10, now=4) is None


def test_a_two_level_round_shows_its_groups_and_spans_and_a_flat_round_none():
    log = RunLog("r", "fp", rounds_total=10)

    def two_level(peer, group, groups=2):
        return RoundRecord(peer, 1, D1, 100, 2.0, group=group, outcome="averaged", groups=groups, spans=4)

    # A, B and C in one stage-1 group, D and E in another.
    E = "peer-eeeeeeee"
    records = {p: two_level(p, (A, B, C)) for p in (A, B, C)} | {p: two_level(p, (D, E)) for p in (D, E)}
    log.ingest(records, [beat(p, 9) for p in records], {}, now=10)
    log.ingest({p: rec(p, 2, D2, group=tuple(records)) for p in records}, [beat(p, 19) for p in records], {}, now=20)
    one, two = log.view(now=20)["rounds"][:2]
    assert one["round"] == 1 and one["counted"] == sorted([A, B, C, D, E])
    assert one["levels"] == {"groups": [[A, B, C], [D, E]], "counted": 2, "spans": 4}
    assert two["round"] == 2 and two["levels"] is None
    run = {"run_id": "r", "fingerprint": "f", "round": 2, "rounds_total": 10, "finished": False}
    lines = status_lines({"run": run, "rounds": [one, {**two, "closed": False}], "peers": []})
    said = "  two levels: 2 groups (3+2 peers), 4 spans a group; the result counted at most 2 groups a sub-span"
    assert lines[3] == said
    text = prometheus(log.view(now=20))  # round 1 is the latest closed one
    assert 'p2p_diloco_round_groups{run_id="r"} 2' in text and 'p2p_diloco_round_groups_counted{run_id="r"} 2' in text
