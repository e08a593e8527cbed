"""bench/uplinks.py: where an all-reduce leaves its links idle, read from the hosts' own counters."""

import os

from bench.uplinks import busy_share, timeline, tx_bytes, used_share


def test_busy_share_counts_the_intervals_at_90_percent_of_the_rate_inside_the_window():
    # 1,000 B/s link, samples every 0.5 s of two hosts' cumulative bytes. Host 0 sends 500, 450
    # (exactly 90 %), 449, 0, 500 per interval; host 1 nothing.
    samples = [(0.0, [0, 0]), (0.5, [500, 0]), (1.0, [950, 0]), (1.5, [1399, 0]), (2.0, [1399, 0]), (2.5, [1899, 0])]
    assert busy_share(samples, 0, 1000.0, (0.0, 2.5)) == 3 / 5
    assert busy_share(samples, 0, 1000.0, (0.5, 2.0)) == 1 / 3  # only [0.5, 1], [1, 1.5], [1.5, 2]
    assert busy_share(samples, 1, 1000.0, (0.0, 2.5)) == 0.0
    assert busy_share(samples, 0, 1000.0, (3.0, 4.0)) == 0.0  # no interval inside: nothing measured


def test_used_share_is_the_bytes_sent_inside_the_window_over_what_the_rate_allows():
    samples = [(0.0, [0, 0]), (0.5, [500, 0]), (1.0, [950, 0]), (1.5, [1399, 0]), (2.0, [1399, 0]), (2.5, [1899, 0])]
    # Intervals ending in (0.5, 2.0]: 450 + 449 + 0 = 899 bytes over 1.5 s at 1,000 B/s.
    assert used_share(samples, 0, 1000.0, (0.5, 2.0)) == 899 / 1500
    assert used_share(samples, 0, 1000.0, (0.0, 2.5)) == 1899 / 2500
    assert used_share(samples, 1, 1000.0, (0.0, 2.5)) == 0.0
    assert timeline(samples[:3]) == {"t": [0.5, 1.0], "per_host": [[0, 0], [0, 0]]}  # kB, rounded


def test_tx_bytes_reads_a_process_s_own_namespace():
    assert tx_bytes(os.getpid(), "lo") >= 0
