"""A two-level round's handlers in-process (swarm/averaging/across.py, assembly.py): an owner keeps
the layout seals its members push for the round and attempt it expects, and an owner's assembly is
served once it exists, within the wait: a request that comes before it waits for it instead of
reading as "none"."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.swarm.averaging.across import AcrossServicer, _shaped
from p2p_diloco.swarm.averaging.assembly import AssemblyServicer, Traffic

KEY = b"round key"
MEMBER, OUTSIDER = SimpleNamespace(remote_id="member"), SimpleNamespace(remote_id="outsider")


async def door(peer: str, which: str) -> bool:
    """As a certified run's doors: only "outsider" is not admitted."""
    return peer != "outsider"


def push(servicer: AcrossServicer, key: bytes = KEY, context=MEMBER, statement=b"layout", seal=b"seal"):
    request = averaging_pb2.AveragingData(group_id=key, tensor_part=runtime_pb2.Tensor(buffer=statement), peer_id=seal)
    return servicer.rpc_layout_seal(request, context)


def test_an_owner_takes_the_seals_its_members_push_for_the_round_it_expects():
    async def scenario():
        await push(servicer)  # before the step's levels are set: not kept
        assert servicer.seals == {}
        servicer.expect(KEY)
        waiting = asyncio.create_task(servicer.wait_for(KEY, ["member", "other"], 5.0))
        await push(servicer)
        await push(servicer, b"another round", SimpleNamespace(remote_id="other"))  # not this round's
        await push(servicer, context=OUTSIDER)  # not let in
        await asyncio.sleep(0)
        assert not waiting.done()  # "other" has not pushed for this round yet
        await push(servicer, context=SimpleNamespace(remote_id="other"), statement=b"its layout", seal=b"its seal")
        seals = await asyncio.wait_for(waiting, 1.0)
        assert seals == {"member": (b"layout", b"seal"), "other": (b"its layout", b"its seal")}
        servicer.expect(KEY + b"2")  # a retry: the attempt's own seals only
        assert servicer.seals == {}

        # Every push counted, kept or not: 5 requests in and 5 answers out, by protobuf's sizes by
        # hand (a field: its tag and length bytes, then its bytes; the statement nested in a Tensor).
        def size(key: bytes, statement: bytes = b"", seal: bytes = b"") -> int:
            return 2 + len(key) + (4 + len(statement) if statement else 0) + (2 + len(seal) if seal else 0)

        pushed = [(KEY, b"layout", b"seal")] * 3 + [(b"another round", b"layout", b"seal")]
        pushed.append((KEY, b"its layout", b"its seal"))
        assert traffic.received == sum(size(*p) for p in pushed) == 147
        assert traffic.sent == sum(size(p[0]) for p in pushed) == 59  # each answer names the round it was for

    traffic = Traffic()
    servicer = AcrossServicer(door, traffic)
    asyncio.run(scenario())


def test_an_owner_stops_waiting_for_seals_at_its_deadline_with_what_came():
    async def scenario():
        servicer = AcrossServicer(door)
        servicer.expect(KEY)
        await push(servicer)
        started = time.monotonic()
        assert await servicer.wait_for(KEY, ["member", "silent"], 0.2) == {"member": (b"layout", b"seal")}
        assert 0.2 <= time.monotonic() - started < 1.0
        assert await servicer.wait_for(b"other key", [], 0.1) == {}

    asyncio.run(scenario())


def test_an_assembly_asked_for_before_it_ended_is_answered_once_it_did():
    async def scenario():
        servicer = AssemblyServicer(wait_s=5.0)
        asked = asyncio.create_task(servicer.rpc_assembled(averaging_pb2.AveragingData(group_id=b"span0"), MEMBER))
        await asyncio.sleep(0)
        assert not asked.done()
        await servicer.keep("span0", b"shown")
        assert (await asyncio.wait_for(asked, 1.0)).tensor_part.buffer == b"shown"
        quick = AssemblyServicer(wait_s=0.1)
        none = await quick.rpc_assembled(averaging_pb2.AveragingData(group_id=b"span1"), MEMBER)
        assert none.tensor_part.buffer == b""
        servicer.door = door  # an outsider gets nothing, though the assembly is kept
        refused = await servicer.rpc_assembled(averaging_pb2.AveragingData(group_id=b"span0"), OUTSIDER)
        assert refused.tensor_part.buffer == b""

    asyncio.run(scenario())


def test_the_result_goes_back_into_the_averaged_tensors_shapes():
    like = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float16)]
    out = _shaped(torch.arange(10, dtype=torch.float32), like)
    assert torch.equal(out[0], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert out[1].dtype == torch.float16 and torch.equal(out[1], torch.tensor([6.0, 7.0, 8.0, 9.0]).half())


def test_a_claim_keeps_only_the_seals_of_members_that_may_come_in():
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.protocol.claims import Claim, GroupLayout
    from p2p_diloco.swarm.averaging.across import Across

    across = Across("me", RSAPrivateKey(), "run.x", 1.0, door)
    layout = GroupLayout(KEY, ("a", "b", "outsider"), ("a", "b"), (bytes(32), bytes(32)))
    seals = {"a": b"sa", "b": b"sb", "outsider": b"so"}
    claims = [Claim("a", layout, seals), Claim("outsider", layout, seals)]
    kept = asyncio.run(across._admitted(claims))
    assert kept == [Claim("a", layout, {"a": b"sa", "b": b"sb"})]  # the outsider's claim and seal are gone


def test_a_replica_holds_what_a_group_sealed_and_convicts_an_owner_that_sends_anything_else(tmp_path):
    from p2p_diloco.protocol import partials, twolevel
    from p2p_diloco.swarm.averaging import stage2
    from p2p_diloco.swarm.averaging.stage2 import Plan, Stage2
    from p2p_diloco.swarm.transport import identity

    paths = [tmp_path / f"{i}.key" for i in range(2)]
    ids, keys = [identity.peer_id_of(p) for p in paths], [identity.load_identity(p) for p in paths]
    groups = [partials.of_group(torch.arange(6.0) * (g + 1), 2.0) for g in range(2)]
    plan = Plan(b"key", 0, 1, tuple(ids), 6, tuple(partials.root(0, p.weight, p.digests) for p in groups))
    told: list[str] = []
    replica = Stage2(ids[0], keys[0], lambda peer: None, 1.0, convicted=told.append)
    kept = replica._round(plan.key, plan)
    start, end = plan.bounds(1)  # group 1's sub-span 1 (values 3-5): replica 0 is its secondary

    def sent(values: torch.Tensor) -> averaging_pb2.AveragingData:
        piece = twolevel.Partial(values, 2.0, groups[1].digests)
        statement = twolevel.partial_statement(plan.round_key, 0, 1, 1, piece)
        return stage2._message(plan.key, 1, statement, stage2.seal(keys[1], plan.round_key, statement))

    sender = SimpleNamespace(remote_id=ids[1])
    answer = asyncio.run(replica.take_partial(sent(groups[1].values[start:end] * 100), sender))
    assert answer.tensor_part.buffer == b"" and kept.held == {}
    assert told == [ids[1]] and replica.convicted == {ids[1]}
    answer = asyncio.run(replica.take_partial(sent(groups[1].values[start:end].clone()), sender))
    assert answer.tensor_part.buffer == b"held" and torch.equal(kept.held[1][1].values, groups[1].values[3:6])
    assert told == [ids[1]]  # the sealed partial convicts nobody


def test_an_owner_keeps_every_span_it_owns_in_this_round_and_the_last():
    # Found in the lab (bench/two_level.py --homes 2): a group of two whose other member is behind
    # NAT has one owner of all its spans. With 2 planned spans kept, planning its third evicted its
    # first: every other owner's message for that span then waited out the wait, and the span's
    # sub-spans failed for them while this owner ended with a result.
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.swarm.averaging.stage2 import Plan, Stage2

    desk = Stage2("me", RSAPrivateKey(), lambda peer: None, 1.0)

    def plans(r: int, spans: int = 4) -> list[Plan]:
        return [Plan(b"round %d span %d" % (r, k), k, spans, ("me", "b"), 8, (bytes(32),) * 2) for k in range(spans)]

    this, last = plans(2), plans(1)
    for plan in last + this:
        desk._round(plan.key, plan)
    assert all(desk._round(p.key).plan is p for p in last + this)  # every span of both rounds
    for plan in plans(3):
        desk._round(plan.key, plan)
    assert all(desk._round(p.key).plan is p for p in this)
    # Another owner may open a round here before this one planned it: as many as two rounds' spans.
    opened = [desk._round(b"early %d" % i) for i in range(2 * 4)]
    assert all(r is not None for r in opened) and desk._round(b"one too many") is None


def test_a_groups_dialable_members_share_its_spans_by_their_link_figures():
    from hivemind.averaging.allreduce import AveragingMode

    from p2p_diloco.protocol import twolevel
    from p2p_diloco.swarm.averaging.across import AcrossError, group_of
    from p2p_diloco.swarm.averaging.gathered import Entry

    def entry(bandwidth, mode=AveragingMode.NODE, serves=True, weight=1.0):
        return Entry(bandwidth, mode, 3, {}, b"key", None, serves, frozenset(), weight)

    # a: 100 (vouched, as gathered.fair left it), b: a client behind NAT (0), c: 50, d: public but may
    # not reduce (0: gathered.fair's figure for a member not every other member reaches directly)
    members = ["a", "b", "c", "d"]
    entries = [entry(100.0), entry(0.0, AveragingMode.CLIENT, serves=False), entry(50.0), entry(0.0, weight=2.0)]
    group = group_of(members, entries)
    assert group.dialable == {"a", "c", "d"} and group.weights == (1.0, 1.0, 1.0, 2.0)
    assert group.rates == (100.0, 0.0, 50.0, 0.0)
    owners = twolevel.owners("seed", group.members, 6, group.dialable.__contains__, dict(zip(members, group.rates)))
    assert sorted(owners.count(m) for m in members) == [0, 0, 2, 4] and owners.count("a") == 4  # D'Hondt: 100:50
    with pytest.raises(AcrossError, match="showed no weight"):
        group_of(members, [*entries[:3], entry(10.0, weight=None)])
