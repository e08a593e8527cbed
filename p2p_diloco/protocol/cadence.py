"""What the heartbeat sends and reads, and when. Pure functions.

Every DHT operation on a run's record key costs the peer the whole key: a store or a read asks
several DHT nodes, and each answers every peer's signed entry under that key (about 1 KB each with
its RSA key and signature). At 8 peers, a store of the progress and a read of the progress and round
keys every second cost each peer about 130 KB/s each way, linear in the number of peers
(docs/benchmarks.md, Background traffic). So the heartbeat sends and reads only what a decision
needs:

- **Progress is sent when the readers' extrapolation would mislead**, or when its age nears the
  staleness bound. Readers extrapolate a report at its rate (budget.estimate): a report at the same
  rate says nothing new. Due are a new round, a rate that moved by more than RATE_CHANGE, the end
  of an inner phase (rate 0 with its final tokens), new convictions, and at least every
  REPORT_EVERY_S: a live peer's report is never older than that plus a store's time, against
  budget.STALE_S.
- **Round records are read when the progress says they changed.** A peer publishes its round
  record (waited for) before its progress shows the new round, so a round in anyone's progress
  that differs from the one seen at the last read of the round records is the sign that a record
  changed. Otherwise they are read every ROUNDS_EVERY_S, for what progress does not show: a record
  refreshed with new addresses, one that expired. Every decision of the round protocol reads them
  itself, fresh (Swarm.peers).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from p2p_diloco.protocol.budget import STALE_S, ProgressReport

REPORT_EVERY_S = 3.0  # a live peer's published report is at most this old (plus a store's time)
RATE_CHANGE = 0.25  # a rate that moved by more than this share of the published one is sent
ROUNDS_EVERY_S = 10.0  # round records are read at least this often
assert REPORT_EVERY_S * 3 <= STALE_S, "a live peer must not look stale after one late store"


def report_due(
    sent: ProgressReport | None, mine: ProgressReport, now: float, convictions_changed: bool = False
) -> bool:
    """Whether this peer's progress `mine` must go out at `now`, `sent` being the last report it
    published (its time: when it was sent)."""
    if sent is None or convictions_changed or mine.round != sent.round or now - sent.time >= REPORT_EVERY_S:
        return True
    if mine.tokens_per_s == 0 or sent.tokens_per_s == 0:  # a phase that ended, or began: exact tokens
        return mine.tokens_per_s != sent.tokens_per_s or mine.tokens != sent.tokens
    return abs(mine.tokens_per_s - sent.tokens_per_s) > RATE_CHANGE * sent.tokens_per_s


def rounds_due(
    marks: Mapping[str, int] | None, reports: Collection[ProgressReport], read_at: float, now: float
) -> bool:
    """Whether to read the round records now: `marks` are each peer's round in the progress reports
    of the last read of the round records, at `read_at` (None: never read); `reports` are the
    progress reports just read."""
    if marks is None or now - read_at >= ROUNDS_EVERY_S:
        return True
    return any(marks.get(r.peer) != r.round for r in reports)


def marks_of(reports: Collection[ProgressReport]) -> dict[str, int]:
    """Each peer's round in `reports`: the marks a read of the round records leaves (rounds_due)."""
    return {r.peer: r.round for r in reports}
