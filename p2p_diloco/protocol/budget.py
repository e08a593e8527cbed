"""Speed-aware rounds: when a round ends, decided from the swarm's progress. Pure functions.

Peers of different speeds do not each run H steps (the slowest would set the pace and everyone
else would idle). Instead a round has a token budget, H x batch tokens for every live peer at the
round, and ends for everyone when the peers' tokens together reach it. A peer 3x faster does 3x
the steps of a slow one in the same wall time, and its pseudo-gradient weighs 3x in the average
(weights are tokens). With equal speeds every peer does about H steps, as in the paper.

Each peer publishes its progress in the round (tokens so far, tokens/s, when measured) when its
rate or round changed, and at least every few seconds (protocol/cadence.py); everyone reads it every
second. Between reports a peer's tokens are extrapolated at its reported rate, so all peers reach
the same verdict at about the same moment, within one read. A peer whose report is
older than `stale_s` (it died, hangs, or its laptop slept) no longer counts: neither its tokens
nor its share of the budget, so the others simply train on and lose nothing to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A peer whose latest progress report is older than this is stale: neither its tokens nor its share
# of the budget count in the round (`swarm_progress`), and it is not live (heartbeat.stale_peers,
# agreement.live). Three times cadence.REPORT_EVERY_S: a late store or two drop nobody.
STALE_S = 10.0
CLAIM_CAP = 2.0  # the pure functions' default cap (the tests' by-hand figures); a peer's: claim_cap()
# swarm.claim_cap = 0 picks one by the run's admission (docs/design.md §6): with k peers a liar's
# claims end the others' rounds at k / (k - 1 + c) of their length, and with speeds 1, 1 and 4.5 the
# rounds run 6.5 / (2 + min(c, 4.5)) x their budget. Open (anyone may lie, ids are free): 1.4, a
# liar among four costs 9 %. Certified (members known, a liar named on the dashboard, revocable):
# 4.5, that fast peer ends on budget.
OPEN_CLAIM_CAP = 1.4
CERTIFIED_CLAIM_CAP = 4.5


def claim_cap(configured: float, certified: bool) -> float:
    """The cap in force: `configured` (swarm.claim_cap), or for 0 the admission mode's."""
    if configured > 0:
        return configured
    return CERTIFIED_CLAIM_CAP if certified else OPEN_CLAIM_CAP


@dataclass(frozen=True)
class ProgressReport:
    """One peer's report of its current round."""

    peer: str
    round: int
    tokens: int  # tokens trained in this round so far
    tokens_per_s: float
    time: float  # wall-clock time (seconds since the epoch) of the measurement


@dataclass(frozen=True)
class SwarmProgress:
    """The swarm's progress in one round, as one peer sees it."""

    tokens: float  # estimated tokens trained in the round by every live peer, this one included
    target: int  # the round's token budget: H x batch tokens for each live peer
    peers: int  # live peers at the round, this one included

    @property
    def done(self) -> bool:
        return self.tokens >= self.target


def estimate(report: ProgressReport, now: float) -> float:
    """Tokens the peer has trained by `now`, extrapolated from its last report at its own rate."""
    elapsed = max(0.0, now - report.time)  # a clock ahead of ours must not make a peer look slower
    return report.tokens + max(0.0, report.tokens_per_s) * elapsed


def swarm_progress(
    me: str,
    round_: int,
    my_tokens: int,
    reports: Iterable[ProgressReport],
    now: float,
    tokens_per_peer: int,
    stale_s: float,
    cap: float = CLAIM_CAP,
) -> SwarmProgress:
    """The round's progress from this peer's tokens and the other peers' reports.

    Only reports of the same round that are younger than `stale_s` count. A live peer that has not
    reported yet (it joined this round a moment ago) counts for nothing until it does.
    """
    live = [r for r in reports if r.peer != me and r.round == round_ and now - r.time <= stale_s]
    estimates = [float(my_tokens)] + [estimate(r, now) for r in live]
    return SwarmProgress(sum(capped_claims(estimates, cap)), tokens_per_peer * (1 + len(live)), 1 + len(live))


def capped_claims(tokens: list[float], cap: float = CLAIM_CAP) -> list[float]:
    """Each peer's tokens counted up to `cap` x the lower median of all of them (swarm.claim_cap):
    a peer that claims infinite (or merely huge) progress shortens a round of k peers by at most
    about (cap - 1)/(k - 1 + cap), and a fast honest peer still counts `cap` times a median one."""
    ordered = sorted(tokens)
    limit = cap * ordered[(len(ordered) - 1) // 2]
    return [min(t, limit) for t in tokens]
