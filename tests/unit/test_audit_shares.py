"""The audit's shares (trust/audit.py: checkers, verdicts, unvouched; swarm/averaging/ledger.py's
signed verdicts): each audited item is checked by CHECKERS members, the others take their signed word,
and check themselves whatever some checker did not vouch for."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.swarm.averaging.ledger import Ledger
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust import audit, wire

ITEMS = audit.AUDIT_CHUNKS


def _plan(seed: bytes, members: int) -> dict[audit.Item, tuple[int, ...]]:
    """Every reducer's ITEMS items (chunk i of part 0) with their checkers, as auditor._plan deals them."""
    plan = {}
    for j in range(members):
        who = audit.checkers(seed, f"peer{j}", j, members, ITEMS)
        plan.update({(j, 0, i): w for i, w in enumerate(who)})
    return plan


def test_in_groups_of_three_or_fewer_every_other_member_checks_every_item():
    assert audit.checkers(b"s", "r", 0, 2, 4) == [(1,)] * 4
    assert audit.checkers(b"s", "r", 1, 3, 4) == [(0, 2)] * 4  # as before the shares: no verdicts needed


def test_each_item_has_two_checkers_other_than_its_reducer_dealt_in_turn():
    # k = 5: the reducer's 4 others take 8 checks from a drawn offset, two at a time; every other
    # member checks exactly 2 of the 4 items.
    for seed in (b"a", b"b", b"c", b"d"):
        who = audit.checkers(seed, "r", 2, 5, 4)
        assert who == audit.checkers(seed, "r", 2, 5, 4)  # every member deals the same
        assert all(len(set(w)) == 2 and 2 not in w for w in who)
        counts = [sum(m in w for w in who) for m in (0, 1, 3, 4)]
        assert counts == [2, 2, 2, 2]
    offsets = {audit.checkers(bytes([i]), "r", 2, 5, 4)[0] for i in range(64)}
    assert len(offsets) > 1  # the seed moves who checks


def test_at_sixteen_members_a_member_checks_eight_items_not_sixty():
    # 16 reducers x 4 items x 2 checkers = 128 checks over 16 members: 8 each on average, against
    # 15 x 4 = 60 when every member checked every other reducer's items (the audit's bytes are each
    # check's: every sender's 64 KiB chunk). A member is among a reducer's 8 dealt slots of 15 with
    # probability 8/15 for each of 15 reducers (offsets drawn apart): Binomial(15, 8/15), by hand
    # P(>= 13 checks) = 105 p^13 q^2 + 15 p^14 q + p^15 = 0.0076.
    totals = []
    for s in range(500):
        plan = _plan(s.to_bytes(2, "big"), 16)
        per_member = [sum(m in who for who in plan.values()) for m in range(16)]
        assert sum(per_member) == 16 * ITEMS * audit.CHECKERS
        totals.extend(per_member)
    assert sum(totals) / len(totals) == 8.0
    assert 0.004 < sum(t >= 13 for t in totals) / len(totals) < 0.012


def test_verdicts_pack_and_read_back_in_item_order():
    verdicts = {(3, 1, 7): audit.DOUBT, (0, 0, audit.WHOLE_PART): audit.PASS, (2, 5, 0): audit.SILENT}
    packed = audit.pack_verdicts(verdicts)
    read, same, rest = audit.unpack_verdicts(packed + b"signature")
    assert read == verdicts and same == packed and rest == b"signature"
    assert list(read) == sorted(verdicts)
    assert audit.unpack_verdicts(audit.pack_verdicts({}) + b"s") == ({}, b"\x00\x00", b"s")


def test_bad_verdicts_are_wire_errors():
    one = audit.pack_verdicts({(1, 0, 0): audit.PASS})
    with pytest.raises(wire.WireError, match="unknown or repeated"):
        audit.unpack_verdicts(one[:-1] + b"\x07")  # no such outcome
    twice = b"\x00\x02" + one[2:] + one[2:]
    with pytest.raises(wire.WireError, match="unknown or repeated"):
        audit.unpack_verdicts(twice)  # one item, two words
    with pytest.raises(wire.WireError, match="cannot hold"):
        audit.unpack_verdicts(b"\x00\x05" + one[2:])
    with pytest.raises(wire.WireError, match="cut short"):
        audit.unpack_verdicts(b"\x00")


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=120))
def test_verdicts_from_another_node_are_verdicts_or_a_wire_error(raw):
    try:
        read, packed, rest = audit.unpack_verdicts(raw)
    except wire.WireError:
        return
    assert packed + rest == raw and audit.pack_verdicts(read) == packed
    assert all(outcome in (audit.PASS, audit.DOUBT, audit.SILENT) for outcome in read.values())


def test_a_member_checks_itself_what_a_checker_did_not_vouch_for():
    plan = {(1, 0, 0): (0, 2), (1, 0, 1): (2, 3), (1, 0, 2): (0, 3), (4, 0, 0): (2, 3)}
    vouched = {0: {(1, 0, 0): audit.PASS, (1, 0, 2): audit.PASS}, 2: {(1, 0, 0): audit.PASS, (1, 0, 1): audit.PASS}}
    vouched[3] = {(1, 0, 1): audit.PASS, (1, 0, 2): audit.PASS, (4, 0, 0): audit.PASS}
    vouched[2][(4, 0, 0)] = audit.PASS
    assert audit.unvouched(plan, 0, vouched) == []  # everything vouched for by both its checkers
    doubted = {m: dict(v) for m, v in vouched.items()}
    doubted[3][(1, 0, 1)] = audit.DOUBT  # 2 vouched, 3 did not: 0 checks it
    doubted[2][(4, 0, 0)] = audit.SILENT  # the reducer did not answer 2
    assert audit.unvouched(plan, 0, doubted) == [(1, 0, 1), (4, 0, 0)]
    del doubted[3][(1, 0, 2)]  # 3 said nothing of an item it was dealt: 0 checked it already itself
    assert audit.unvouched(plan, 0, doubted) == [(1, 0, 1), (4, 0, 0)]
    assert audit.unvouched(plan, 1, {}) == sorted(plan)  # no word from anyone: every item


def test_a_lie_escapes_a_member_only_where_every_checker_of_its_item_lies_with_the_reducer():
    # By hand over the dealing: reducer 0 lies on one item; the colluders vouch for everything, the
    # honest checkers doubt the lied item. Every honest member either checks it or takes it up
    # from a doubt, unless both its checkers collude.
    members, escaped, dealt = 8, 0, 0
    for s, lied, colluders in itertools.product(range(20), range(ITEMS), ({1}, {1, 2}, {3, 5})):
        plan = _plan(bytes([s]), members)
        item = (0, 0, lied)
        verdicts = {
            m: {i: audit.DOUBT if (i == item and m not in colluders) else audit.PASS for i, w in plan.items() if m in w}
            for m in range(1, members)
        }
        dealt += 1
        if set(plan[item]) <= colluders:
            escaped += 1
            continue
        for m in set(range(1, members)) - colluders:
            assert m in plan[item] or item in audit.unvouched(plan, m, verdicts)
    assert 0 < escaped < dealt  # the pairs {1, 2} and {3, 5} escape only where they are an item's two checkers


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = []
    for name in ("x", "y"):
        path = tmp_path_factory.mktemp(name) / "identity.key"
        out.append((identity.peer_id_of(path), identity.load_identity(path)))
    return out


def test_a_members_verdicts_are_kept_only_signed_by_it_for_this_group(pair):
    (x, kx), (y, ky) = pair
    public = {p: identity.key_of(p, identity.public_key_bytes(k)) for p, k in pair}
    at_x, at_y = (Ledger(b"group", [x, y], [x, y], k, public) for k in (kx, ky))
    verdicts = {(0, 0, 3): audit.PASS, (0, 1, 0): audit.DOUBT}
    shown = at_y.own_verdicts(y, verdicts)
    assert at_y.own_verdicts(y, {}) == shown  # shown once: the same bytes to everyone
    other_group = Ledger(b"other", [x, y], [x, y], ky, public).own_verdicts(y, verdicts)
    packed = audit.pack_verdicts(verdicts)
    tampered = audit.pack_verdicts({**verdicts, (0, 1, 0): audit.PASS}) + shown[len(packed) :]
    refused = [at_x.own_verdicts(x, verdicts), other_group, tampered, shown[:-1], b"", b"\xff" * 40]
    assert not any(at_x.verdicts.accept(y, value) for value in refused)
    assert not at_x.verdicts.accept("not a member", shown)
    assert at_x.verdicts.missing() == [y]
    assert at_x.verdicts.accept(y, shown) and at_x.verdicts.read[y] == verdicts and at_x.verdicts.missing() == []


def _checked(outcome, monkeypatch, shown):
    """One member's Auditor.check over a plan of two items of reducer 1 (index 0 checks the first,
    not the second) whose own check of the first ends in `outcome`; the verdicts' exchange and the
    checks are stand-ins recording what the audit asked of them (the real ones: test_average.py,
    test_faults.py). `shown` collects the verdicts this member showed. Returns what check raised."""
    import asyncio
    from types import SimpleNamespace

    from p2p_diloco.swarm.averaging.auditor import Auditor

    peers = ["me", "reducer", "x", "y"]
    plan = {(1, 0, 0): (0, 2), (1, 0, 1): (2, 3)}
    runner = SimpleNamespace(
        ordered_peer_ids=peers,
        peer_id="me",
        sender_timeout=5.0,
        ledger=SimpleNamespace(
            peers=peers,
            seed=lambda: b"seed",
            own_lot=lambda me: b"lot",
            own_verdicts=lambda me, verdicts: shown.append(verdicts) or b"verdicts",
            verdicts=SimpleNamespace(read={"x": {(1, 0, 0): audit.PASS}, "y": {(1, 0, 1): audit.PASS}}),
        ),
    )
    auditor = Auditor(stub=None, evidence=None, left_out_changed=lambda: None)

    async def gather(runner, own, wait_s):
        own()
        return 0

    async def inspect(runner, items, plan, received, pace):
        return {item: (outcome, "no answer" if outcome == audit.SILENT else "") for item in items}

    monkeypatch.setattr(auditor.lots, "gather", gather)
    monkeypatch.setattr(auditor.verdicts, "gather", gather)
    monkeypatch.setattr(auditor, "_plan", lambda runner, seed: plan)
    monkeypatch.setattr(auditor, "_inspect", inspect)
    try:
        asyncio.run(auditor.check(runner))
    except Exception as e:  # noqa: BLE001 - the caller looks at what it was
        return e
    return None


def test_a_member_shows_its_verdicts_when_its_checks_pass_and_fails_at_once_when_a_reducer_was_silent(monkeypatch):
    shown: list = []
    assert _checked(audit.PASS, monkeypatch, shown) is None
    assert shown == [{(1, 0, 0): audit.PASS}]  # its word on the item it was dealt, and the others' taken
    shown.clear()
    failed = _checked(audit.SILENT, monkeypatch, shown)
    assert shown == []  # no verdicts shown, no wait for the others' (test_faults.py: 28.6 s lost before)
    assert "reducer reducer: no answer; nothing applied" in str(failed)
