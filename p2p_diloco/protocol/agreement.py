"""Agreement and catch-up: the decisions, as pure functions of what the swarm published.

After a round's outer step every peer publishes the digest of its new state and compares it with
the digests of the peers that should hold the same state; if the majority holds another, the peer
downloads the majority's state (I1). A peer that finds the swarm at a later round downloads that
round's state instead of training a round nobody else is in. This module decides:
- who is live (`live`: a record, and a heartbeat that is not stale);
- whom to wait for (`whom_to_wait_for`, `still_waiting`);
- what the majority is, with the tie-break every peer computes the same way (`majority`, `reference`);
- the swarm's state, backed by at least half of the live peers (`backed`), and whether this
  peer ran ahead of it (`runs_ahead`);
- adopt or keep (`should_adopt`, `catch_up_target`);
- which holders to download from (`download_sources`).
round/sync.py carries the decisions out; the `Swarm` (network.py) only reads and writes.

Client-mode peers (behind NAT) cannot serve a state, so they never count as a reference while a
reachable peer's digest is in: they follow the reachable peers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from p2p_diloco.protocol.network import RoundRecord


@dataclass(frozen=True)
class Reference:
    """A state some peers hold: its round, its digest, and the peers that can serve it (sorted)."""

    round: int
    digest: str
    holders: tuple[str, ...]
    backers: int = field(default=0, compare=False)  # peers that made it (`backed`): 0 when not counted


def majority(digests: Mapping[str, str]) -> str:
    """The digest most peers hold; ties go to the smallest digest so every peer picks the same one."""
    counts = Counter(digests.values())
    return min(counts, key=lambda d: (-counts[d], d))


def live(records: Mapping[str, RoundRecord], stale: set[str], *rounds: int) -> set[str]:
    """The live peers: those with a record (not expired in the DHT) whose heartbeat is not `stale`
    (heartbeat.stale_peers); with `rounds`, only those whose latest record is at one of them. The
    one rule of liveness the decisions here use."""
    return {p for p, r in records.items() if not rounds or r.round in rounds} - stale


def whom_to_wait_for(me: str, group: Iterable[str], seen_at_round: Iterable[str]) -> tuple[str, ...]:
    """The peers whose digests decide a round's agreement: its group, every live peer seen at the
    round (one that missed the group and averaged alone rejoins the majority in the same round),
    and this peer. Sorted, so every peer forms the same tuple."""
    return tuple(sorted(set(group) | set(seen_at_round) | {me}))


def still_waiting(expected: Iterable[str], published: Iterable[str], stale: set[str]) -> set[str]:
    """Expected peers whose digest is not in yet and who are still alive (a dead one is not waited for).
    By id, not by record (a member's record of the round may not be readable yet): `stale` alone decides."""
    return set(expected) - set(published) - stale


def tally(
    expected: tuple[str, ...], published: Mapping[str, str], me: str, mine: str
) -> tuple[dict[str, str], list[str]]:
    """(digests that count, expected peers missing). This peer's own record may not be readable
    yet, but it knows its digest."""
    digests = {**published, me: mine}
    return digests, [p for p in expected if p not in digests]


def clients(records: Mapping[str, RoundRecord], me: str, me_client: bool) -> set[str]:
    """Peers that cannot serve their state (client mode), this one included if it is one."""
    out = {p for p, r in records.items() if not r.serves}
    return out | {me} if me_client else out


def reference(digests: Mapping[str, str], cannot_serve: set[str]) -> tuple[str, list[str]]:
    """(majority digest, peers that hold it and can serve it) among `digests`. Client-mode peers'
    digests count only if nobody else's is in."""
    counted = {p: d for p, d in digests.items() if p not in cannot_serve} or dict(digests)
    winner = majority(counted)
    return winner, sorted(p for p, d in digests.items() if d == winner and p not in cannot_serve)


def strict_majority(holders: Iterable[str], expected: Iterable[str]) -> bool:
    """Whether the peers holding the majority's state are more than half of those expected in the
    round's agreement. Such a state is followed whatever its average's cosine with this peer's own
    Δ (the own-Δ veto guards against a colluding minority that wins a tie or a partial tally, not
    against an honest majority whose pseudo-gradients, late in a run, point against this one's)."""
    return 2 * len(set(holders)) > len(set(expected))


def should_adopt(mine: str, majority_digest: str) -> bool:
    """A peer whose state differs from the majority's reloads the majority's state."""
    return majority_digest != mine


def counted(records: Mapping[str, RoundRecord], stale: set[str], fresh: set[str]) -> set[str]:
    """The peers whose records count in the swarm's state: live (heartbeat fresh), and not an
    identity this peer first saw only moments ago (`fresh`: a flood of new ids cannot outvote
    the peers it knows; see the threat model)."""
    return live(records, stale) - fresh


def backed(
    records: Mapping[str, RoundRecord],
    counted: set[str],
    me: str,
    mine: RoundRecord | None = None,
    reachable: AbstractSet[str] = frozenset(),
) -> Reference | None:
    """The swarm's state: the latest (round, digest) that at least half of the counted peers hold,
    this peer counted too, as `mine` (default: its own record, if any). None if no state has that
    backing. Two states of one round with half each: the smallest digest, as `majority`.
    Client-mode peers count only while no peer that serves its state does (as in `reference`).
    Every counted peer votes; only the peers that made a state back it (`RoundRecord.copied`).
    Its holders are the voters that hold it and can serve it to this peer: those that serve, and
    the private peers in `reachable` (this peer holds a direct connection to them: hole punching).

    A peer catches up only to a backed state, so f < k/2 attackers who claim a later round, with
    a state they serve and that verifies, move nobody (threat model): one peer is one vote."""
    voters = {p: r for p, r in records.items() if p in counted and p != me}
    if (mine := mine or records.get(me)) is not None:
        voters[me] = mine
    voters = {p: r for p, r in voters.items() if r.serves} or voters
    # A state counts the peers that made it by their own outer step, not those that copied it: an
    # honest peer that caught up to an attacker's state (in the seconds after a start, when it
    # saw nobody else yet) must not become the attacker's second vote.
    counts = Counter((r.round, r.digest) for r in voters.values() if not r.copied)
    states = [state for state, n in counts.items() if 2 * n >= len(voters)]
    if not states:
        return None
    top = max(r for r, _ in states)
    digest = min(d for r, d in states if r == top)
    holders = sorted(
        p for p, r in voters.items() if (r.serves or p in reachable) and (r.round, r.digest) == (top, digest)
    )
    return Reference(top, digest, tuple(holders), counts[(top, digest)])


def runs_ahead(
    swarm_state: Reference | None, records: Mapping[str, RoundRecord], counted: set[str], my_round: int, mine: str
) -> bool:
    """Whether this peer, at `my_round` with digest `mine`, is ahead of the swarm without its
    backing: its state is not the backed one, and some counted peer that serves its state is at
    an earlier round. Such
    a peer waits for the others to reach its round (bounded) before it trains the next one: a
    peer that ran ahead alone (a resume from a later checkpoint than the others', a round the
    others' group failed) rejoins the majority at its round instead of splitting the swarm."""
    if swarm_state is not None and (swarm_state.round, swarm_state.digest) == (my_round, mine):
        return False
    if swarm_state is not None and swarm_state.round > my_round:
        return False
    return any(records[p].round < my_round and records[p].serves for p in counted if p in records)


def catch_up_target(swarm_state: Reference | None, my_round: int, my_digest: str, me_client: bool) -> Reference | None:
    """The state to download before the next round, or None to keep this peer's own.

    `swarm_state` is the backed state (`backed`). A later round, or the same round with another
    digest, is downloaded; none that no peer can serve. An earlier one is not, except by a
    client-mode peer: it follows the reachable peers even when it ran ahead of them alone.
    """
    if swarm_state is None or not swarm_state.holders:
        return None
    if swarm_state.round == my_round and swarm_state.digest == my_digest:
        return None
    if swarm_state.round < my_round and not me_client:
        return None
    return swarm_state


def download_sources(holders: Iterable[str], me: str) -> list[str]:
    """The holders to ask, in order (sorted by peer id, so every joiner asks in the same order);
    never this peer itself."""
    return [p for p in holders if p != me]


def expected_group(peers_in_round: int, at_rounds: set[str]) -> int:
    """The group to expect: every peer training this round (the swarm's progress), or finishing
    the one before (a peer that died lingers in the records for a while; then the matchmaking
    window runs out instead)."""
    return max(peers_in_round, len(at_rounds))


def still_finishing(records: Mapping[str, RoundRecord], stale: set[str], final: int, mine: str) -> list[str]:
    """Live peers that do not hold this peer's final state yet, at any round: whom a peer that
    finished the run lingers for, so they can download it. A peer that is starting up (settling,
    downloading) publishes its start record and beats while it looks, so it counts too: otherwise
    the last holders could leave while it settles, and it would find nobody to download from."""
    alive = live(records, stale)
    return [p for p, r in records.items() if r.round <= final and r.digest != mine and p in alive]
