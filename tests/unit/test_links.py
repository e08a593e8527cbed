"""Bandwidth-aware reduction: measured figures that cannot spiral down, claims that cannot take over."""

import math

from p2p_diloco import links


def test_lower_median_caps_a_liar():
    # Honest peers at 10, 12 and 20 MB/s; a liar claims 1e12. Lower median of the four = 12: cap 48.
    assert links.fair_bandwidths([10.0, 12.0, 20.0, 1e12]) == [10.0, 12.0, 20.0, 48.0]


def test_two_peers_a_liar_gets_at_most_cap_shares():
    fair = links.fair_bandwidths([5.0, 1e15])
    assert fair == [5.0, 20.0]  # lower median of two is the honest figure
    assert fair[1] / sum(fair) == 0.8  # never the sole reducer


def test_garbage_claims_count_as_none_and_zero_stays_zero():
    assert links.fair_bandwidths([10.0, float("nan"), "fast", -3.0, True, 0.0, math.inf]) == \
        [10.0, None, None, None, None, 0.0, None]
    assert links.fair_bandwidths([None, None]) == [None, None]


def test_honest_figures_within_the_cap_are_untouched():
    assert links.fair_bandwidths([1.0, 2.0, 3.9]) == [1.0, 2.0, 3.9]


def test_meter_announces_its_best_recent_measurement():
    meter = links.LinkMeter()
    assert meter.bandwidth() is None
    meter.record(1000.0, 2000.0)  # up 1000 B/s, down 2000 B/s: the slower direction
    assert meter.bandwidth() == 1000.0
    meter.record(100.0, 100.0)  # an all-reduce paced by a slow peer: not a slower link
    assert meter.bandwidth() == 1000.0
    for _ in range(links.RECENT):
        meter.record(300.0, 300.0)
    assert meter.bandwidth() == 300.0  # the old figure ages out: a link that got slower is believed


def test_meter_uses_the_one_direction_it_measured():
    meter = links.LinkMeter()
    meter.record(0.0, 0.0)
    assert meter.bandwidth() is None
    meter.record(500.0, 0.0)  # reduced nothing, so received no parts: its upload is what is known
    assert meter.bandwidth() == 500.0
