"""Who owns span k in each group, as every owner of span k agrees it (protocol/claims.py): groups'
layouts signed by their members with real identity keys (the seals of swarm/averaging/stage2.py),
claims shown in any order, and claims that must not count."""

import hashlib
import itertools
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol import claims, twolevel
from p2p_diloco.protocol.claims import Claim, GroupLayout
from p2p_diloco.swarm.averaging import stage2
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust.wire import WireError

ROUND_KEY = b"digest of theta(r)"
SEED = ROUND_KEY.hex()
SPANS = 4
ROOTS = tuple(hashlib.sha256(b"partial of span %d" % k).digest() for k in range(SPANS))


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = {}
    for i in range(12):
        path = tmp_path_factory.mktemp(f"peer{i}") / "identity.key"
        out[identity.peer_id_of(path)] = identity.load_identity(path)
    return out


def holds(member: str, statement: bytes, seal: bytes) -> bool:
    return stage2.sealed_by(member, ROUND_KEY, statement, seal)


def layout_of(group) -> GroupLayout:
    return GroupLayout(ROUND_KEY, tuple(group), tuple(twolevel.owners(SEED, group, SPANS)), ROOTS)


def claim(layout: GroupLayout, keys, span: int, signed_by=None, by=None) -> Claim:
    statement = layout.statement()
    signed_by = layout.members if signed_by is None else signed_by
    seals = {m: stage2.seal(keys[m], ROUND_KEY, statement) for m in signed_by}
    return Claim(by or layout.span_owners[span], layout, seals)


def test_three_groups_owners_agree_on_every_span_whatever_order_the_claims_came_in(keys):
    peers = sorted(keys)
    groups = twolevel.groups_of(SEED, peers, size=4)  # 12 peers: 3 buckets of about 4, merged to >= 2
    assert len(groups) >= 2
    count = twolevel.group_count(len(peers), 4)
    for span in range(SPANS):
        shown = [claim(layout_of(g), keys, span) for g in groups]
        # By hand: each group's owner of the span, groups in the order of their lowest bucket,
        # which is `groups_of`'s order (buckets walked in index order).
        expected = tuple(layout_of(g).span_owners[span] for g in groups)
        for order in range(5):
            random.Random(order).shuffle(shown)
            assert claims.plan_owners(SEED, count, span, shown, holds) == expected


def test_a_claim_counts_only_from_the_spans_owner_and_with_more_than_half_of_its_members(keys):
    peers = sorted(keys)[:4]
    layout = layout_of(peers)
    owner = layout.span_owners[0]
    other = next(p for p in peers if p != owner)
    assert claims.plan_owners(SEED, 1, 0, [claim(layout, keys, 0)], holds) == (owner,)
    assert claims.plan_owners(SEED, 1, 0, [claim(layout, keys, 0, by=other)], holds) == ()
    assert claims.plan_owners(SEED, 1, 0, [claim(layout, keys, 0, signed_by=peers[:3])], holds) == (owner,)
    assert claims.plan_owners(SEED, 1, 0, [claim(layout, keys, 0, signed_by=peers[:2])], holds) == ()  # 2 of 4
    # A member's seal shown under another member's name, or over another layout, is no signature.
    good = claim(layout, keys, 0)
    swapped = dict(good.seals)
    swapped[peers[3]] = good.seals[peers[2]]
    swapped[peers[2]] = good.seals[peers[3]]
    swapped[peers[1]] = good.seals[peers[0]]
    assert claims.signers(Claim(owner, layout, swapped), holds) == {peers[0]}
    moved = GroupLayout(ROUND_KEY, layout.members, (other,) * SPANS, ROOTS)
    assert claims.plan_owners(SEED, 1, 0, [Claim(other, moved, good.seals)], holds) == ()
    # Its members' seals shown with the root of a partial they did not compute (step (3)): none holds.
    forged = GroupLayout(ROUND_KEY, layout.members, layout.span_owners, (bytes(32),) + ROOTS[1:])
    assert claims.signers(Claim(owner, forged, good.seals), holds) == frozenset()
    assert claims.plan_owners(SEED, 1, 0, [Claim(owner, forged, good.seals)], holds) == ()
    with pytest.raises(ValueError, match="root"):
        GroupLayout(ROUND_KEY, layout.members, layout.span_owners, ROOTS[1:]).statement()
    # Seals of peers outside the group do not make a majority.
    outsiders = sorted(keys)[4:8]
    padded = {**claim(layout, keys, 0, signed_by=peers[:1]).seals}
    padded.update({m: stage2.seal(keys[m], ROUND_KEY, layout.statement()) for m in outsiders})
    assert claims.plan_owners(SEED, 1, 0, [Claim(owner, layout, padded)], holds) == ()


def test_of_two_claims_over_one_bucket_the_one_more_members_signed_counts(keys):
    peers = sorted(keys)[:6]
    whole = layout_of(peers)
    # Two peers of the group make up a group of their own (both sign: a majority of it) and claim
    # span 0 for it: their buckets overlap the whole group's, which more members signed. Every
    # pair of the 6, so that some made-up layouts hash lower than the whole group's.
    real = claim(whole, keys, 0)
    lower = 0
    for pair in itertools.combinations(peers, 2):
        made_up = GroupLayout(ROUND_KEY, pair, (pair[0],) * SPANS, ROOTS)
        lower += hashlib.sha256(made_up.statement()).digest() < hashlib.sha256(whole.statement()).digest()
        for shown in ([claim(made_up, keys, 0), real], [real, claim(made_up, keys, 0)]):
            assert claims.plan_owners(SEED, 1, 0, shown, holds) == (whole.span_owners[0],)
    assert 0 < lower < 15, lower
    # Without the whole group's claim, the made-up group counts: its partial is for the audit of
    # stage 1 to check (docs/design.md §3, step (3)), not for this rule.
    assert claims.plan_owners(SEED, 1, 0, [claim(made_up, keys, 0)], holds) == (made_up.members[0],)
    # A bucket that split into two groups of 3, both fully signed: ties go to the lower sha256 of
    # the layout, whichever came first.
    a, b = layout_of(peers[:3]), layout_of(peers[3:])
    count = 1  # one bucket: both groups cover it
    first = min((a, b), key=lambda lay: hashlib.sha256(lay.statement()).digest())
    for shown in ([claim(a, keys, 1), claim(b, keys, 1)], [claim(b, keys, 1), claim(a, keys, 1)]):
        assert claims.plan_owners(SEED, count, 1, shown, holds) == (first.span_owners[1],)
    # The same claim shown twice counts once.
    twice = [claim(whole, keys, 2)] * 2
    assert claims.plan_owners(SEED, 1, 2, twice, holds) == (whole.span_owners[2],)


def test_a_claim_travels_and_reads_back_whole(keys):
    layout = layout_of(sorted(keys)[:5])
    shown = claim(layout, keys, 3, signed_by=layout.members[1:4])
    back = claims.parse_claim(shown.encode(), shown.by, ROUND_KEY, SPANS)
    assert back == shown
    assert claims.parse_layout(layout.statement(), ROUND_KEY, SPANS) == layout


def test_a_malformed_layout_or_claim_is_a_wire_error(keys):
    members = sorted(keys)[:3]
    layout = GroupLayout(ROUND_KEY, tuple(members), (members[0], members[1], members[2], members[0]), ROOTS)
    raw = layout.statement()
    with pytest.raises(WireError, match="another round"):
        claims.parse_layout(raw, b"another key", SPANS)
    with pytest.raises(WireError, match="spans"):
        claims.parse_layout(raw, ROUND_KEY, SPANS + 1)
    with pytest.raises(WireError, match="too many"):
        claims.parse_layout(raw + b"\0", ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="cut short"):
        claims.parse_layout(raw[:-1], ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="owned by no member"):
        roots = 32 * SPANS  # the last owner index sits before the roots
        claims.parse_layout(raw[: -roots - 2] + struct.pack(">H", 3) + raw[-roots:], ROUND_KEY, SPANS)
    twice = GroupLayout(ROUND_KEY, (members[0], members[1], members[0]), (members[0],) * SPANS, ROOTS)
    with pytest.raises(WireError, match="named twice"):
        claims.parse_layout(twice.statement(), ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="not a peer id"):
        claims.parse_layout(GroupLayout(ROUND_KEY, ("a/b",), ("a/b",) * SPANS, ROOTS).statement(), ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="not a group layout"):
        claims.parse_layout(b"nonsense", ROUND_KEY, SPANS)
    encoded = claim(layout, keys, 0).encode()
    with pytest.raises(WireError, match="a seal of member"):  # the first seal's index set past the members
        at = len(claims.CLAIM_TAG) + 4 + len(raw) + 2
        claims.parse_claim(encoded[:at] + struct.pack(">H", 9) + encoded[at + 2 :], members[0], ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="cut short"):
        claims.parse_claim(encoded[:-1], members[0], ROUND_KEY, SPANS)
    with pytest.raises(WireError, match="not a span claim"):
        claims.parse_claim(None, members[0], ROUND_KEY, SPANS)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=400))
def test_any_bytes_are_a_claim_or_a_wire_error(raw):
    for candidate in (raw, claims.CLAIM_TAG + raw, claims.LAYOUT_TAG + raw):
        try:
            claims.parse_claim(candidate, "QmPeer", ROUND_KEY, SPANS)
        except WireError:
            pass
        try:
            claims.parse_layout(candidate, ROUND_KEY, SPANS)
        except WireError:
            pass


def test_the_stage_2_key_binds_the_very_list_of_claims_the_assembly_showed(keys):
    peers = sorted(keys)
    a, b = layout_of(peers[:4]), layout_of(peers[4:8])
    shown = [claim(a, keys, 0), claim(b, keys, 0)]
    key = claims.plan_key(ROUND_KEY, 0, shown)
    assert claims.plan_key(ROUND_KEY, 0, shown[::-1]) == key  # the leader's order does not matter
    assert claims.plan_key(ROUND_KEY, 0, shown[:1]) != key  # a leader that left one out for some owners
    assert claims.plan_key(ROUND_KEY, 1, shown) != key  # another span
    assert claims.plan_key(b"another round", 0, shown) != key
    fewer = claim(a, keys, 0, signed_by=a.members[:3])  # the same layout, other seals
    assert claims.plan_key(ROUND_KEY, 0, [fewer, shown[1]]) != key


def test_a_member_makes_the_owners_plan_only_from_a_list_that_holds_the_layout_it_sealed(keys):
    peers = sorted(keys)
    a, b = layout_of(peers[:4]), layout_of(peers[4:8])
    shown = [claim(a, keys, 0), claim(b, keys, 0)]
    count = 1  # one bucket: the larger claim counts (a tie here: the lower layout hash)
    counted, key = claims.plan_for_member(shown, a.span_owners[0], a, SEED, count, 0, holds)
    owners = tuple(c.by for c in counted)
    assert (owners, key) == (claims.plan_owners(SEED, count, 0, shown, holds), claims.plan_key(ROUND_KEY, 0, shown))
    # Its owner passed on a list without its group's layout, or with another layout of its group
    # (a member left out): the member makes no plan of it.
    with pytest.raises(WireError, match="no claim of the layout this member sealed"):
        claims.plan_for_member(shown[1:], a.span_owners[0], a, SEED, count, 0, holds)
    fewer = GroupLayout(ROUND_KEY, a.members[:3], tuple(a.members[0] for _ in range(SPANS)), ROOTS)
    with pytest.raises(WireError, match="no claim of the layout this member sealed"):
        claims.plan_for_member([claim(fewer, keys, 0), shown[1]], fewer.span_owners[0], a, SEED, count, 0, holds)


def test_what_an_assembly_showed_travels_to_the_members_whole_and_nothing_else_reads_as_it(keys):
    layout = layout_of(sorted(keys)[:4])
    shown = [(layout.span_owners[0], claim(layout, keys, 0).encode()), ("QmOther", b"anything a peer showed")]
    raw = claims.pack_shown(shown)
    assert claims.unpack_shown(raw) == shown
    assert claims.unpack_shown(claims.pack_shown([])) == []
    with pytest.raises(WireError, match="too many"):
        claims.unpack_shown(raw + b"\0")
    with pytest.raises(WireError, match="cut short"):
        claims.unpack_shown(raw[:-1])
    with pytest.raises(WireError, match="of them"):
        claims.unpack_shown(struct.pack(">H", claims.MAX_SHOWN + 1))
    with pytest.raises(WireError, match="bytes"):
        claims.unpack_shown(struct.pack(">HB", 1, 2) + b"Qm" + struct.pack(">I", claims.MAX_CLAIM + 1))
    with pytest.raises(WireError, match="not a peer id"):
        claims.unpack_shown(claims.pack_shown([("a b", b"")]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=300))
def test_any_bytes_are_an_assemblys_list_or_a_wire_error(raw):
    try:
        shown = claims.unpack_shown(raw)
    except WireError:
        return
    assert all(isinstance(by, str) and isinstance(c, bytes) for by, c in shown)


def test_an_assembly_list_no_round_could_hold_is_refused_before_it_is_kept():
    # A leader's list, which hivemind's followers take as sent: at most the assembly's size, none
    # larger than a group of MAX_MEMBERS could seal, each peer once.
    assert claims.unfit([("QmA", b"x"), ("QmB", b"y")], most=2) is None
    assert claims.unfit([("QmA", b"x"), ("QmB", b"y"), ("QmC", b"z")], most=2) == "3 claims, at most 2 asked for"
    assert "bytes" in claims.unfit([("QmA", b"\0" * (claims.MAX_CLAIM + 1))], most=2)
    assert claims.unfit([("QmA", b"x"), ("QmA", b"y")], most=3) == "a peer twice"
