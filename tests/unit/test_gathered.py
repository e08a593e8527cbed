"""The all-gather's entries (swarm/averaging/gathered.py), in-process: one total parser for what each member
shows its group; a leader refuses an entry that does not parse at its door, and a member that finds
one in its group leaves out the leader that assembled it. Real keys, hivemind's own serializer."""

import asyncio
from collections import OrderedDict
from types import SimpleNamespace

import pytest
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given
from hypothesis import strategies as st

from p2p_diloco.swarm.averaging.gathered import Entry, Gathering, fair, parse_entry, reducers
from p2p_diloco.swarm.transport.identity import owner_peer_id, public_key_bytes
from p2p_diloco.trust.wire import WireError
from tests.unit.test_untrusted_records import FUZZ, HOSTILE, hostile_like

KEYS = [RSAPrivateKey() for _ in range(3)]
PEERS = [owner_peer_id(b"[owner:" + public_key_bytes(k) + b"]") for k in KEYS]


def user(i: int, **changes) -> dict:
    """What swarm/averaging/step.py shows for peer i: its round, its vouches for the others, its identity key."""
    return {
        "round": 7,
        "seen": {p: 1e6 * (j + 1) for j, p in enumerate(PEERS) if j != i},
        "key": public_key_bytes(KEYS[i]),
        **changes,
    }


def entry_bytes(i: int, bandwidth=2e6, mode=0, user_data=None) -> bytes:
    """As hivemind packs it: [bandwidth, mode, user bytes]."""
    data = user(i) if user_data is None else user_data
    return MSGPackSerializer.dumps([bandwidth, mode, MSGPackSerializer.dumps(data)])


def test_an_honest_entry_reads_back_whole():
    entry = parse_entry(entry_bytes(0), MSGPackSerializer.loads)
    assert entry == Entry(2e6, AveragingMode.NODE, 7, user(0)["seen"], public_key_bytes(KEYS[0]), None)
    with_cert = parse_entry(entry_bytes(1, None, 1, {**user(1), "cert": "{}"}), MSGPackSerializer.loads)
    assert with_cert.bandwidth is None and with_cert.mode == AveragingMode.CLIENT and with_cert.cert == "{}"
    assert entry.weight is None  # a peer from before two-level rounds shows none
    assert parse_entry(entry_bytes(2, user_data=user(2, weight=3)), MSGPackSerializer.loads).weight == 3.0


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"", "not msgpack"),
        (b"\xc1", "not msgpack"),
        (MSGPackSerializer.dumps([1]), "triple"),
        (MSGPackSerializer.dumps([float("nan"), 0, b""]), "not finite"),
        (MSGPackSerializer.dumps([-1.0, 0, b""]), "out of"),
        (MSGPackSerializer.dumps([None, 3, b""]), "out of"),
        (MSGPackSerializer.dumps([None, True, b""]), "not an integer"),
        (MSGPackSerializer.dumps([None, 0, "text"]), "not bytes"),
        (entry_bytes(0, user_data={"seen": {}, "key": b"k"}), "no 'round'"),
        (entry_bytes(0, user_data={"round": 7}), "no 'key'"),
        (entry_bytes(0, user_data=user(0, round=2**64 - 1)), "'round'"),
        (entry_bytes(0, user_data=user(0, seen={"not base58!": 1.0})), "'seen'"),
        (entry_bytes(0, user_data=user(0, seen={PEERS[1]: float("inf")})), "'seen'"),
        (entry_bytes(0, user_data=user(0, key="a string")), "'key'"),
        (entry_bytes(0, user_data=user(0, cert=b"bytes")), "'cert'"),
        (entry_bytes(0, user_data=user(0, serves=1)), "'serves'"),
        (entry_bytes(0, user_data=user(0, direct=["not base58!"])), "'direct'"),
        (entry_bytes(0, user_data=user(0, direct=[0] * 4097)), "'direct'"),  # more than MAX_SEEN
        (entry_bytes(0, user_data=user(0, weight=-1.0)), "'weight'"),
        (entry_bytes(0, user_data=user(0, weight=float("nan"))), "'weight'"),
        (entry_bytes(0, user_data=user(0, weight="1")), "'weight'"),
        (b"\x00" * 70_000, "at most"),
    ],
)
def test_an_entry_that_does_not_parse_is_one_wire_error(data, problem):
    with pytest.raises(WireError, match=problem):
        parse_entry(data, MSGPackSerializer.loads)


@FUZZ
@given(
    outer=st.one_of(HOSTILE, st.tuples(HOSTILE, HOSTILE, HOSTILE)),
    user_m=hostile_like(user(0)),
    raw=st.binary(max_size=64),
)
def test_any_entry_is_an_entry_or_a_wire_error(outer, user_m, raw):
    """Hostile values in every field (and raw bytes): parse_entry returns or raises WireError."""
    for data in (raw, _dumps_or_none(outer), _dumps_or_none([2e6, 0, _dumps_or_none(user_m)])):
        if data is None:
            continue
        try:
            entry = parse_entry(data, MSGPackSerializer.loads)
        except WireError:
            continue
        assert isinstance(entry.round, int) and isinstance(entry.key, bytes) and isinstance(entry.seen, dict)


def _dumps_or_none(value):
    try:
        return MSGPackSerializer.dumps(value)
    except Exception:  # a value msgpack cannot pack (an int over 64 bits): no bytes to send
        return None


class Member(Gathering):
    """The all-gather's checks with what the averager gives them: hivemind's serializer, an id, no
    doors (an open run), nobody left out, a bench that records, the leaders matchmaking remembers."""

    def __init__(self, me: str, leaders: dict):
        self.benched: list[tuple[str, str, str]] = []
        super().__init__(MSGPackSerializer.loads, me, None, lambda peer: None, self._record, OrderedDict(leaders).get)

    def _record(self, peer: str, reason: str, role: str) -> None:
        self.benched.append((peer, reason, role))


def test_a_group_with_an_entry_that_does_not_parse_fails_and_its_leader_is_left_out():
    gathered = (entry_bytes(0), MSGPackSerializer.dumps([None, 0, b"\xc1"]), entry_bytes(2))
    group = GroupInfo(b"g1", tuple(PEERS), gathered)
    follower = Member(PEERS[0], {b"g1": PEERS[2]})  # peer 2 assembled the group
    with pytest.raises(AllreduceException, match=f"group data of {PEERS[1]} does not parse.*nothing averaged"):
        follower.entries(group)
    assert [(p, role) for p, _, role in follower.benched] == [(PEERS[2], "leader")]
    leader = Member(PEERS[2], {b"g1": PEERS[2]})  # the leader itself refused it at its door: nobody to bench
    with pytest.raises(AllreduceException):
        leader.entries(group)
    assert leader.benched == []


def test_a_well_formed_group_gives_each_member_its_own_key_and_a_member_with_anothers_fails_it():
    group = GroupInfo(b"g2", tuple(PEERS), tuple(entry_bytes(i) for i in range(3)))
    member = Member(PEERS[0], {})
    entries = member.entries(group)
    assert list(member.member_keys(group, entries)) == PEERS
    stolen = GroupInfo(b"g3", tuple(PEERS), (entry_bytes(0), entry_bytes(1, user_data=user(0)), entry_bytes(2)))
    with pytest.raises(AllreduceException, match=f"group member {PEERS[1]} showed no identity key of its own"):
        member.member_keys(stolen, member.entries(stolen))


def test_a_leader_refuses_a_join_request_whose_entry_does_not_parse_before_hivemind_sees_it():
    from p2p_diloco.swarm.averaging.averager import DiLoCoAverager

    # The averager's handler with only its all-gather checks: a refused request never reaches
    # hivemind's handler (its `super()` call), which this stand-in could not run.
    averager = SimpleNamespace(gathering=Member(PEERS[0], {}))
    request = averaging_pb2.JoinRequest(gather=MSGPackSerializer.dumps([None, "node", b""]))
    context = SimpleNamespace(remote_id=PEERS[1])

    async def answers():
        return [m async for m in DiLoCoAverager.rpc_join_group(averager, request, context)]

    assert [m.code for m in asyncio.run(answers())] == [averaging_pb2.PROTOCOL_VIOLATION]
    assert averager.gathering.refusal(PEERS[1], entry_bytes(1)) is None  # an honest one goes on to hivemind


def test_fair_replaces_only_the_bandwidths_and_keeps_every_other_byte():
    claims = [5e6, 1e6, 1e9]  # peer 2 claims far more than anyone measured of it (3e6)
    group = GroupInfo(b"g4", tuple(PEERS), tuple(entry_bytes(i, claims[i]) for i in range(3)))
    entries = Member(PEERS[0], {}).entries(group)
    fair_group = fair(group, entries, MSGPackSerializer)
    before = [MSGPackSerializer.loads(d) for d in group.gathered]
    after = [MSGPackSerializer.loads(d) for d in fair_group.gathered]
    assert [a[1:] for a in after] == [b[1:] for b in before]
    # Vouched: each claim up to the best rate the others measured of it (peer i was seen at
    # 1e6 * (i + 1)): min(5e6, 1e6), min(1e6, 2e6), min(1e9, 3e6) = 1e6, 1e6, 3e6, each under
    # links.CLAIM_CAP (4) x their lower median (1e6).
    assert [a[0] for a in after] == [1e6, 1e6, 3e6]


def test_probe_noise_on_equal_links_does_not_halve_a_members_span():
    # Three equal links probed at 2.98, 2.97 and 2.44 MB/s, each vouched for by the others as
    # claimed: the figures bench/allreduce.py measured of 25 Mbit/s links (3.125 MB/s). hivemind's
    # balancer (a linear program) gave the member probed 18 % low half the others' span; the
    # settled figures give every member a third.
    claims = [2.98e6, 2.97e6, 2.44e6]
    shown = [user(i, seen={p: claims[j] for j, p in enumerate(PEERS) if j != i}) for i in range(3)]
    group = GroupInfo(b"g8", tuple(PEERS), tuple(entry_bytes(i, claims[i], 0, shown[i]) for i in range(3)))
    figures = [
        MSGPackSerializer.loads(d)[0]
        for d in fair(group, Member(PEERS[0], {}).entries(group), MSGPackSerializer).gathered
    ]
    assert figures == [2.97e6] * 3  # the lower median, 2.97: 2.44 is within 1.25x of it
    assert load_balance_peers(3_000_000, figures, 0) == (1_000_000, 1_000_000, 1_000_000)
    unsettled = load_balance_peers(3_000_000, claims, 0)  # what it did before
    assert unsettled[2] < 0.6 * unsettled[0]


def test_a_private_member_reduces_only_when_every_other_member_holds_a_direct_connection_to_it():
    # Peer 0 public; peers 1 and 2 private under hole punching (nodes, not clients): 1 punched to
    # both others, 2 to peer 1 only. Every member sends parts to each reducer: 2 would need peer 0
    # to reach it, and peer 0 holds no connection to it.
    shown = [
        user(0, serves=True),
        user(1, serves=False, direct=[PEERS[0], PEERS[2]]),
        user(2, serves=False, direct=[PEERS[1]]),
    ]
    shown[0]["direct"] = [PEERS[1]]  # what peer 0 shows of itself (a public one needs nothing)
    group = GroupInfo(b"g5", tuple(PEERS), tuple(entry_bytes(i, 2e6, 0, shown[i]) for i in range(3)))
    entries = Member(PEERS[0], {}).entries(group)
    assert [e.serves for e in entries] == [True, False, False]
    assert entries[1].direct == frozenset({PEERS[0], PEERS[2]})
    assert reducers(group, entries) == [True, True, False]
    after = [MSGPackSerializer.loads(d)[0] for d in fair(group, entries, MSGPackSerializer).gathered]
    assert after[2] == 0.0 and after[0] > 0 and after[1] > 0
    # A group of private members that do not all reach one another: nothing is sent.
    alone = [user(i, serves=False, direct=[]) for i in range(3)]
    group = GroupInfo(b"g6", tuple(PEERS), tuple(entry_bytes(i, 2e6, 0, alone[i]) for i in range(3)))
    with pytest.raises(AllreduceException, match="no member of the group can be reached directly"):
        fair(group, Member(PEERS[0], {}).entries(group), MSGPackSerializer)
    # A client never reduces, whatever it shows; an entry from before these fields is a public node's.
    assert parse_entry(entry_bytes(0, 2e6, 0, user(0)), MSGPackSerializer.loads).serves is True
    client = [user(0, serves=True), user(1, serves=True)]
    group = GroupInfo(b"g7", tuple(PEERS[:2]), (entry_bytes(0, 2e6, 0, client[0]), entry_bytes(1, 2e6, 1, client[1])))
    assert reducers(group, Member(PEERS[0], {}).entries(group)) == [True, False]
