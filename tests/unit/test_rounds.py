"""Speed-aware rounds: the round's budget and the swarm's tokens, by hand numbers."""

import pytest

from p2p_diloco.protocol.budget import ProgressReport, estimate, swarm_progress
from p2p_diloco.swarm.trust.records import parse_progress

BUDGET = 1000  # tokens per live peer (H x batch x seq_len)


def test_other_peers_are_extrapolated_at_their_reported_rate():
    assert estimate(ProgressReport("b", 3, 200, 50.0, time=100.0), now=102.0) == 300.0
    # A clock ahead of ours never makes a peer look slower than its report.
    assert estimate(ProgressReport("b", 3, 200, 50.0, time=105.0), now=102.0) == 200.0


def test_a_round_ends_when_the_live_peers_together_reach_their_budget():
    reports = [ProgressReport("b", 3, 600, 100.0, time=10.0), ProgressReport("c", 3, 200, 20.0, time=10.0)]
    # At t = 10: 900 (me) + 600 + 200 = 1700 of 3 x 1000.
    at_10 = swarm_progress("a", 3, 900, reports, now=10.0, tokens_per_peer=BUDGET, stale_s=5.0)
    assert (at_10.tokens, at_10.target, at_10.peers, at_10.done) == (1700.0, 3000, 3, False)
    # At t = 14, with me at 1900: 1900 + (600 + 400) + (200 + 80) = 3180 >= 3000.
    at_14 = swarm_progress("a", 3, 1900, reports, now=14.0, tokens_per_peer=BUDGET, stale_s=5.0)
    assert at_14.tokens == 3180.0 and at_14.done


def test_stale_peers_and_other_rounds_do_not_count():
    reports = [
        ProgressReport("b", 3, 900, 100.0, time=0.0),  # last heard of 11 s ago: dead, hung or asleep
        ProgressReport("c", 2, 900, 100.0, time=11.0),  # still at the previous round
        ProgressReport("a", 3, 5000, 100.0, time=11.0),  # my own old report: my live count is used instead
    ]
    view = swarm_progress("a", 3, 999, reports, now=11.0, tokens_per_peer=BUDGET, stale_s=10.0)
    assert (view.tokens, view.target, view.peers, view.done) == (999.0, 1000, 1, False)
    assert swarm_progress("a", 3, 1000, reports, now=11.0, tokens_per_peer=BUDGET, stale_s=10.0).done


def test_a_lone_peer_ends_its_round_at_exactly_its_budget():
    assert not swarm_progress("a", 0, 999, [], 0.0, BUDGET, 10.0).done
    assert swarm_progress("a", 0, 1000, [], 0.0, BUDGET, 10.0).done


def test_progress_reports_from_the_dht_are_untrusted():
    good = {"peer": "12D3x", "round": 2, "tokens": 4096, "tokens_per_s": 812.5, "time": 1.7e9}
    assert parse_progress(good) == ProgressReport("12D3x", 2, 4096, 812.5, 1.7e9)
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
    liar = ProgressReport("liar", 3, 10**18, 0.0, 100.0)
    honest = [ProgressReport(p, 3, 100, 0.0, 100.0) for p in ("b", "c")]
    progress = swarm_progress("me", 3, 100, [liar, *honest], 100.0, 400, 10.0)
    assert progress.tokens == 500 and progress.target == 1600 and not progress.done
    honest = [ProgressReport(p, 3, 320, 0.0, 100.0) for p in ("b", "c")]
    assert swarm_progress("me", 3, 320, [liar, *honest], 100.0, 400, 10.0).done
    # A fast honest peer still counts up to twice a median one.
    fast = swarm_progress("me", 3, 100, [ProgressReport("f", 3, 300, 0.0, 100.0), *honest[:1]], 100.0, 400, 10.0)
    assert fast.tokens == 100 + 300 + 320


def end_of_round(speeds: list[float], cap: float, tokens_per_peer: int = 1000) -> float:
    """When (s) peer 0 sees the round done, peer i claiming speeds[i] tokens/s from t = 0; every
    other peer reports each 0.01 s, so nothing is extrapolated."""
    for tick in range(1, 100_000):
        t = tick / 100
        reports = [ProgressReport(f"p{i}", 3, int(s * t), 0.0, t) for i, s in enumerate(speeds) if i]
        if swarm_progress("p0", 3, int(speeds[0] * t), reports, t, tokens_per_peer, 10.0, cap).done:
            return t
    raise AssertionError("the round never ended")


def test_the_claim_cap_trades_a_fast_peer_s_overshoot_against_a_liar_s_reach():
    # Speeds 1, 1, 4.5 (x 100 tokens/s), budget 3 x 1000. Counted at time t: 100 t + 100 t +
    # min(450 t, cap x 100 t). cap 2: 400 t = 3000 at t = 7.5, when they trained 650 x 7.5 = 4875,
    # 1.625 x the budget. cap 4.5: 650 t = 3000, 1.0 x.
    assert 650 * end_of_round([100, 100, 450], 2.0) / 3000 == pytest.approx(1.625, abs=0.01)
    assert 650 * end_of_round([100, 100, 450], 4.5) / 3000 == pytest.approx(1.0, abs=0.01)
    # Three honest peers at 100 and a liar claiming 10**9 tokens/s, budget 4 x 1000. Without it the
    # round ends at t = 10 (400 t = 4000). cap 2: 300 t + 200 t = 4000 at t = 8, 20 % shorter;
    # cap 4.5: 750 t = 4000 at t = 5.33, 47 % shorter.
    assert end_of_round([100, 100, 100, 100], 2.0) == pytest.approx(10.0, abs=0.02)
    assert end_of_round([100, 100, 100, 1e9], 2.0) == pytest.approx(8.0, abs=0.02)
    assert end_of_round([100, 100, 100, 1e9], 4.5) == pytest.approx(16 / 3, abs=0.02)


def test_the_default_cap_follows_the_run_s_admission():
    from p2p_diloco.protocol.budget import claim_cap

    assert claim_cap(0.0, certified=False) == 1.4 and claim_cap(0.0, certified=True) == 4.5
    assert claim_cap(2.0, certified=False) == claim_cap(2.0, certified=True) == 2.0  # as configured
    # Open: a liar among four ends the honest rounds at 4 / 4.4 of their length, 9 % shorter (target
    # 10 %); certified: the speeds 1, 1, 4.5 end on budget (target 1.1 x).
    assert end_of_round([100, 100, 100, 1e9], claim_cap(0.0, False)) == pytest.approx(10 * 4 / 4.4, abs=0.02)
    assert 650 * end_of_round([100, 100, 450], claim_cap(0.0, True)) / 3000 == pytest.approx(1.0, abs=0.01)
