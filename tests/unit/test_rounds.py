"""Speed-aware rounds: the round's budget and the swarm's tokens, by hand numbers."""

from p2p_diloco.rounds import Progress, estimate, swarm_progress
from p2p_diloco.swarm.records import parse_progress

BUDGET = 1000  # tokens per live peer (H x batch x seq_len)


def test_other_peers_are_extrapolated_at_their_reported_rate():
    assert estimate(Progress("b", 3, 200, 50.0, time=100.0), now=102.0) == 300.0
    # A clock ahead of ours never makes a peer look slower than its report.
    assert estimate(Progress("b", 3, 200, 50.0, time=105.0), now=102.0) == 200.0


def test_a_round_ends_when_the_live_peers_together_reach_their_budget():
    reports = [Progress("b", 3, 600, 100.0, time=10.0), Progress("c", 3, 200, 20.0, time=10.0)]
    # At t = 10: 900 (me) + 600 + 200 = 1700 of 3 x 1000.
    at_10 = swarm_progress("a", 3, 900, reports, now=10.0, tokens_per_peer=BUDGET, stale_s=5.0)
    assert (at_10.tokens, at_10.target, at_10.peers, at_10.done) == (1700.0, 3000, 3, False)
    # At t = 14, with me at 1900: 1900 + (600 + 400) + (200 + 80) = 3180 >= 3000.
    at_14 = swarm_progress("a", 3, 1900, reports, now=14.0, tokens_per_peer=BUDGET, stale_s=5.0)
    assert at_14.tokens == 3180.0 and at_14.done


def test_stale_peers_and_other_rounds_do_not_count():
    reports = [
        Progress("b", 3, 900, 100.0, time=0.0),  # last heard of 11 s ago: dead, hung or asleep
        Progress("c", 2, 900, 100.0, time=11.0),  # still at the previous round
        Progress("a", 3, 5000, 100.0, time=11.0),  # my own old report: my live count is used instead
    ]
    view = swarm_progress("a", 3, 999, reports, now=11.0, tokens_per_peer=BUDGET, stale_s=10.0)
    assert (view.tokens, view.target, view.peers, view.done) == (999.0, 1000, 1, False)
    assert swarm_progress("a", 3, 1000, reports, now=11.0, tokens_per_peer=BUDGET, stale_s=10.0).done


def test_a_lone_peer_ends_its_round_at_exactly_its_budget():
    assert not swarm_progress("a", 0, 999, [], 0.0, BUDGET, 10.0).done
    assert swarm_progress("a", 0, 1000, [], 0.0, BUDGET, 10.0).done


def test_progress_reports_from_the_dht_are_untrusted():
    good = {"peer": "12D3x", "round": 2, "tokens": 4096, "tokens_per_s": 812.5, "time": 1.7e9}
    assert parse_progress(good) == Progress("12D3x", 2, 4096, 812.5, 1.7e9)
    for bad in [
        None,
        [],
        {**good, "round": -1},
        {**good, "tokens": -5},
        {**good, "tokens": float("inf")},  # int(inf) raised OverflowError: every honest peer exited 1
        {**good, "tokens_per_s": float("inf")},
        {**good, "tokens_per_s": -1.0},
        {**good, "time": float("nan")},
        {**good, "time": "soon"},
        {k: v for k, v in good.items() if k != "tokens"},
        {**good, "peer": "x" * 500},
    ]:
        assert parse_progress(bad) is None, bad


def test_one_peer_claiming_huge_progress_cannot_end_the_round_by_itself():
    # me 100 tokens, two honest peers 100 each, a liar 10**18: it counts 2 x the lower median (200),
    # so 500 of the 4 x 400 budget: the round goes on. The honest peers end it at 320 each
    # (3 x 320 + 640 = 1600), a fifth early, not at once.
    liar = Progress("liar", 3, 10**18, 0.0, 100.0)
    honest = [Progress(p, 3, 100, 0.0, 100.0) for p in ("b", "c")]
    progress = swarm_progress("me", 3, 100, [liar, *honest], 100.0, 400, 10.0)
    assert progress.tokens == 500 and progress.target == 1600 and not progress.done
    honest = [Progress(p, 3, 320, 0.0, 100.0) for p in ("b", "c")]
    assert swarm_progress("me", 3, 320, [liar, *honest], 100.0, 400, 10.0).done
    # A fast honest peer still counts up to twice a median one.
    fast = swarm_progress("me", 3, 100, [Progress("f", 3, 300, 0.0, 100.0), *honest[:1]], 100.0, 400, 10.0)
    assert fast.tokens == 100 + 300 + 320
