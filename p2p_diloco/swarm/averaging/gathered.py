"""What each member shows its group in hivemind's all-gather, read by one total parser, and who is
left out when an entry does not parse: the averager's `Gathering`, run in the averager process.

hivemind's matchmaking carries, for each member, msgpack bytes `[bandwidth, mode, user bytes]`,
and the user bytes are step.py's `{"round", "seen", "key", "cert"}`. The member chose every byte.
`parse_entry` returns an `Entry` or raises WireError; nothing else reads these bytes.

Who is to blame for an entry that does not parse. A follower sends its entry to the leader with its
join request, and the leader forwards it unchanged in the group it assembles. The leader parses it
at its door and refuses one that does not parse, so a group that holds a malformed entry was
assembled by a leader that let it in, or made it. The entries are not signed, so nobody else could
judge who wrote it: each member leaves that leader out of its groups for a while (the audit's
bench, doubled at each repeat) and fails the group before a part is sent (I2). A member that sends
garbage is refused by every honest leader and fails no group; a leader that forwards it fails its
own groups only until its followers have all benched it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from p2p_diloco.protocol import links
from p2p_diloco.swarm.transport import identity
from p2p_diloco.swarm.trust.doors import Doors
from p2p_diloco.trust import wire
from p2p_diloco.trust.wire import WireError

MAX_ENTRY = 64 * 1024  # bytes of one member's entry: a key (~300 B), a certificate (~1 KiB), vouches
MAX_SEEN = 4096  # vouches in one entry: one for each peer this member measured
MAX_KEY = 4096  # bytes of an identity key (RSA-2048: 294)
MAX_CERT = 16 * 1024  # characters of a certificate


@dataclass(frozen=True)
class Entry:
    """One member's part of the all-gather, valid in form (what it says is checked by its users)."""

    bandwidth: float | None  # its link figure (protocol/links.py); None: no claim
    mode: AveragingMode
    round: int
    seen: Mapping[str, float]  # what it measured of other members' probes
    key: bytes  # its identity key, checked against its peer id by `identity.key_of`
    cert: str | None  # its certificate, in certified runs
    serves: bool = True  # others can dial it (a peer from before this field: a reducer was public)
    direct: frozenset[str] = frozenset()  # the peers it holds a direct connection to (hole punching)
    weight: float | None = None  # the weight it averages with (a two-level round's group weight); None: not shown


def parse_entry(data: object, loads: Callable[[bytes], Any]) -> Entry:
    """`data`, as hivemind's serializer wrote it, or WireError."""
    outer = _unpacked(data, loads)
    if not isinstance(outer, list | tuple) or len(outer) != 3:
        raise WireError("not a [bandwidth, mode, user data] triple")
    bandwidth = None if outer[0] is None else wire.real(outer[0], 0.0)
    mode = AveragingMode(wire.integer(outer[1], 0, max(m.value for m in AveragingMode)))
    user = wire.mapping(_unpacked(outer[2], loads), "user data")
    seen = wire.field(user, "seen", _seen, {})
    key = wire.field(user, "key", _bytes)
    cert = wire.field(user, "cert", lambda v: wire.text(v, MAX_CERT), None)
    serves, direct = wire.field(user, "serves", wire.flag, True), wire.field(user, "direct", _peers, frozenset())
    weight = wire.field(user, "weight", lambda v: wire.real(v, 0.0), None)
    return Entry(bandwidth, mode, wire.field(user, "round", wire.integer), seen, key, cert, serves, direct, weight)


def _unpacked(data: object, loads: Callable[[bytes], Any]) -> Any:
    if not isinstance(data, bytes) or len(data) > MAX_ENTRY:
        raise WireError(f"not bytes of at most {MAX_ENTRY}")
    try:
        return loads(data)
    except Exception:  # msgpack raises several types on foreign bytes
        raise WireError("not msgpack") from None


def _seen(value: Any) -> dict[str, float]:
    seen = wire.mapping(value, "vouches")
    if len(seen) > MAX_SEEN:
        raise WireError(f"more than {MAX_SEEN} vouches")
    return {wire.peer_id(peer): wire.real(rate, 0.0) for peer, rate in seen.items()}


def _peers(value: Any) -> frozenset[str]:
    if not isinstance(value, list | tuple) or len(value) > MAX_SEEN:
        raise WireError(f"not a list of at most {MAX_SEEN} peer ids")
    return frozenset(wire.peer_id(peer) for peer in value)


def _bytes(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) > MAX_KEY:
        raise WireError(f"not bytes of at most {MAX_KEY}")
    return value


def reducers(group_info: GroupInfo, entries: Sequence[Entry]) -> list[bool]:
    """Which members reduce a span: links.reachable_reducers of what their entries show."""
    members = [str(p) for p in group_info.peer_ids]
    reduces = [e.mode != AveragingMode.CLIENT for e in entries]
    return links.reachable_reducers(members, reduces, [e.serves for e in entries], [e.direct for e in entries])


def fair(group_info: GroupInfo, entries: Sequence[Entry], serializer: Any) -> GroupInfo:
    """The group with every member's bandwidth claim counted only up to what the other members
    measured of its probes (links.vouched_bandwidths) and capped (links.fair_bandwidths), so that no
    peer can claim its way to reducing the whole vector, figures the probes cannot tell apart made
    equal (links.settled_bandwidths), and 0 for a member that may not reduce
    (`reducers`: not every other member reaches it directly). Each member computes the same figures
    from the same gathered bytes (`entries`: parsed from them). AllreduceException, before a part is
    sent, if no member may reduce."""
    members = [str(p) for p in group_info.peer_ids]
    may_reduce = reducers(group_info, entries)
    if not any(may_reduce):
        raise AllreduceException("no member of the group can be reached directly by all the others: nothing averaged")
    vouched = links.vouched_bandwidths(members, [e.bandwidth for e in entries], [dict(e.seen) for e in entries])
    figures = links.settled_bandwidths(links.fair_bandwidths(vouched))
    gathered = tuple(
        serializer.dumps([figure if reduces else 0.0, *serializer.loads(data)[1:]])
        for figure, reduces, data in zip(figures, may_reduce, group_info.gathered)
    )
    return GroupInfo(group_info.group_id, group_info.peer_ids, gathered)


class Gathering:
    """The all-gather's entries at the leader's door and in the group. Held by DiLoCoAverager,
    whose `rpc_join_group` asks `refusal` before hivemind sees a join request."""

    def __init__(
        self,
        loads: Callable[[bytes], Any],
        peer_id: PeerID,
        doors: Doors | None,
        left_out: Callable[[Any], str | None],
        bench: Callable[[str, str, str], None],
        leader_of: Callable[[bytes], PeerID | None],
    ):
        """`loads`: hivemind's serializer's; `peer_id`: this member's; `doors`: admission in
        certified runs (None in open ones); `left_out(peer)` and `bench(peer, reason, role)`: the
        auditor's; `leader_of(group id)`: who assembled a recent group (LedMatchmaking), if known."""
        self._loads, self._peer_id, self._doors = loads, peer_id, doors
        self._left_out, self._bench, self._leader_of = left_out, bench, leader_of

    def refusal(self, peer: Any, gather: bytes) -> str | None:
        """As a leader: why to refuse a join request from `peer` with the entry `gather`, or None.
        Refused: an entry that does not parse, a peer that is not admitted (its certificate comes
        with the request, checked against its transport id), a peer this one convicted or left
        out after an audit."""
        reason = self._left_out(peer)
        return reason if reason is not None else self._entry_refusal(str(peer), gather)

    def _entry_refusal(self, peer: str, gather: bytes) -> str | None:
        try:
            entry = parse_entry(gather, self._loads)
        except WireError as e:
            wire.dropped("a join request's group data", str(e))
            return f"its group data does not parse ({e})"
        if self._doors is None:
            return None
        refused = self._doors.reason_to_refuse(peer, entry.cert)
        if refused is not None:
            self._doors.log_refusal(peer, "matchmaking", refused)
        return refused

    def entries(self, group_info: GroupInfo) -> list[Entry]:
        """Every member's entry. If one does not parse, the leader that assembled the group is left
        out of this member's groups, and the group fails before a part is sent."""
        entries = []
        for peer, data in zip(group_info.peer_ids, group_info.gathered):
            try:
                entries.append(parse_entry(data, self._loads))
            except WireError as e:
                reason = f"the group data of {peer} does not parse ({e})"
                self._blame_leader(group_info.group_id, f"it assembled a group in which {reason}")
                raise AllreduceException(f"{reason}: nothing averaged") from None
        return entries

    def admit_members(self, group_info: GroupInfo, entries: Sequence[Entry]) -> None:
        """In a certified run, fail the group before a part is sent if a member is not admitted."""
        if self._doors is not None:
            for peer, entry in zip(group_info.peer_ids, entries):
                self._doors.check_member(str(peer), entry.cert)

    def _blame_leader(self, group_id: bytes, reason: str) -> None:
        leader = self._leader_of(group_id)
        if leader is not None and leader != self._peer_id:
            self._bench(str(leader), reason, "leader")

    def member_keys(self, group_info: GroupInfo, entries: Sequence[Entry]) -> dict[str, Any]:
        """Each member's identity key from its entry, checked against its peer id: a member without
        one fails the group before a part is sent."""
        keys = {}
        for peer, entry in zip(group_info.peer_ids, entries):
            key = identity.key_of(str(peer), entry.key)
            if key is None:
                raise AllreduceException(f"group member {peer} showed no identity key of its own: nothing averaged")
            keys[str(peer)] = key
        return keys
