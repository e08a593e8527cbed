"""A two-level round's handlers in-process (swarm/averaging/across.py, assembly.py): a member's layout
seal and an owner's assembly are served once they exist, within the wait, and a request that
comes before them waits for them instead of reading as "none"."""

import asyncio
import time
from types import SimpleNamespace

import torch
from hivemind.proto import averaging_pb2

from p2p_diloco.swarm.averaging.across import MAX_ROUND_KEY, AcrossServicer, _shaped
from p2p_diloco.swarm.averaging.assembly import AssemblyServicer

KEY = b"round key"
MEMBER, OUTSIDER = SimpleNamespace(remote_id="member"), SimpleNamespace(remote_id="outsider")


async def door(peer: str, which: str) -> bool:
    """As a certified run's doors: only "outsider" is not admitted."""
    return peer != "outsider"


def ask_seal(servicer: AcrossServicer, key: bytes = KEY, context=MEMBER):
    return servicer.rpc_layout_seal(averaging_pb2.AveragingData(group_id=key), context)


def test_a_layout_seal_asked_before_it_is_made_is_answered_once_it_is():
    async def scenario():
        servicer = AcrossServicer(wait_s=5.0)
        asked = asyncio.create_task(ask_seal(servicer))
        await asyncio.sleep(0)  # the request is waiting
        assert not asked.done()
        await servicer.offer(KEY, b"layout", b"seal")
        answer = await asyncio.wait_for(asked, 1.0)
        assert answer.tensor_part.buffer == b"layout" and answer.peer_id == b"seal"

    asyncio.run(scenario())


def test_no_seal_within_the_wait_or_for_an_oversized_key_is_an_empty_answer():
    async def scenario():
        servicer = AcrossServicer(wait_s=0.2)
        await servicer.offer(KEY, b"layout", b"seal")
        started = time.monotonic()
        other = await ask_seal(servicer, b"another round")
        assert other.tensor_part.buffer == b"" and other.peer_id == b""
        assert 0.2 <= time.monotonic() - started < 1.0
        assert (await ask_seal(servicer, b"k" * (MAX_ROUND_KEY + 1))).tensor_part.buffer == b""
        for r in range(10):  # only the last few rounds' seals are kept
            await servicer.offer(bytes([r]), b"layout", b"seal")
        assert list(servicer.sealed) == [bytes([r]) for r in range(6, 10)]
        guarded = AcrossServicer(wait_s=5.0, door=door)
        await guarded.offer(KEY, b"layout", b"seal")
        assert (await ask_seal(guarded)).peer_id == b"seal"
        assert (await ask_seal(guarded, context=OUTSIDER)).peer_id == b""  # at once, not after the wait

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
    layout = GroupLayout(KEY, ("a", "b", "outsider"), ("a", "b"))
    seals = {"a": b"sa", "b": b"sb", "outsider": b"so"}
    claims = [Claim("a", layout, seals), Claim("outsider", layout, seals)]
    kept = asyncio.run(across._admitted(claims))
    assert kept == [Claim("a", layout, {"a": b"sa", "b": b"sb"})]  # the outsider's claim and seal are gone
