"""When the heartbeat sends its progress and reads the round records (protocol/cadence.py), by hand."""

from p2p_diloco.protocol import cadence
from p2p_diloco.protocol.budget import STALE_S, ProgressReport, estimate

SENT = ProgressReport("me", 4, 1_000, 200.0, 100.0)  # published at t = 100 s: 1,000 tokens at 200/s


def test_a_report_at_the_published_rate_is_not_sent_again_until_it_nears_staleness():
    # 2 s later at the same rate: readers extrapolate 1,000 + 200 x 2 = 1,400, what it has
    mine = ProgressReport("me", 4, 1_400, 200.0, 102.0)
    assert estimate(SENT, 102.0) == 1_400
    assert not cadence.report_due(SENT, mine, 102.0)
    assert cadence.report_due(SENT, mine, 100.0 + cadence.REPORT_EVERY_S)  # its liveness
    assert cadence.REPORT_EVERY_S * 3 <= STALE_S  # two late stores in a row drop nobody


def test_what_the_extrapolation_would_get_wrong_is_sent_at_once():
    assert cadence.report_due(None, SENT, 100.0)  # nothing published yet
    assert cadence.report_due(SENT, ProgressReport("me", 5, 0, 200.0, 101.0), 101.0)  # a new round
    assert cadence.report_due(SENT, ProgressReport("me", 4, 1_200, 251.0, 101.0), 101.0)  # +25.5 %
    assert not cadence.report_due(SENT, ProgressReport("me", 4, 1_200, 249.0, 101.0), 101.0)  # +24.5 %
    assert cadence.report_due(SENT, ProgressReport("me", 4, 1_200, 149.0, 101.0), 101.0)  # -25.5 %
    assert cadence.report_due(SENT, ProgressReport("me", 4, 1_150, 0.0, 101.0), 101.0)  # the phase ended
    assert cadence.report_due(SENT, ProgressReport("me", 4, 1_200, 200.0, 101.0), 101.0, convictions_changed=True)


def test_an_ended_phase_is_sent_once_then_only_for_liveness():
    ended = ProgressReport("me", 4, 1_150, 0.0, 101.0)
    assert not cadence.report_due(ended, ended, 102.0)
    assert cadence.report_due(ended, ProgressReport("me", 4, 1_170, 0.0, 101.5), 102.0)  # its final tokens moved
    assert cadence.report_due(ended, ended, 101.0 + cadence.REPORT_EVERY_S)


def test_round_records_are_read_when_someones_progress_shows_a_new_round():
    reports = [ProgressReport("a", 4, 0, 1.0, 0.0), ProgressReport("b", 4, 0, 1.0, 0.0)]
    assert cadence.rounds_due(None, reports, 0.0, 50.0)  # never read
    marks = cadence.marks_of(reports)
    assert marks == {"a": 4, "b": 4}
    assert not cadence.rounds_due(marks, reports, 50.0, 51.0)
    assert cadence.rounds_due(marks, [reports[0], ProgressReport("b", 5, 0, 1.0, 0.0)], 50.0, 51.0)
    assert cadence.rounds_due(marks, [*reports, ProgressReport("c", 4, 0, 1.0, 0.0)], 50.0, 51.0)  # a new peer
    assert not cadence.rounds_due(marks, reports[:1], 50.0, 51.0)  # one went silent: stale_peers's, not a read's
    assert cadence.rounds_due(marks, reports, 50.0, 50.0 + cadence.ROUNDS_EVERY_S)
