"""swarm/transport/streams.held_open over two real libp2p daemons (p2pd, TCP on 127.0.0.1, NAT
probing off): a handler of one request whose reply stream stays open after its last reply until
the caller closes its side, as the matchmaking leader's join handler now does (QUIC reset the
stream under ACCEPTED and BEGIN_ALLREDUCE when the handler returned at once: docs/benchmarks.md)."""

import asyncio
import time

import pytest
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

from p2p_diloco.swarm.transport import streams

NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}


async def _pair() -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **NO_NAT)
    client = await P2P.create(initial_peers=await server.get_visible_maddrs(), **NO_NAT)
    return server, client


async def _held_until_the_caller_closes() -> tuple[list[int], float, float]:
    """Replies the caller read, then how long the handler went on after its last reply while the
    caller held its side open (1 s), and after the caller closed it."""
    server, client = await _pair()
    ended = asyncio.Event()
    last_reply_at = []

    async def handler(request: averaging_pb2.MessageFromLeader, context):
        try:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE)
            last_reply_at.append(time.monotonic())
            await streams.held_open(10.0)
        finally:
            ended.set()

    try:
        await server.add_protobuf_handler("join", handler, averaging_pb2.MessageFromLeader, stream_output=True)
        replies = await client.iterate_protobuf_handler(
            server.peer_id, "join", averaging_pb2.MessageFromLeader(), averaging_pb2.MessageFromLeader
        )
        codes = [(await anext(replies)).code for _ in range(2)]
        # The caller holds its side open a while (a hold, not a wait for something): the handler must not end.
        await asyncio.sleep(1.0)
        held = time.monotonic() - last_reply_at[0] if not ended.is_set() else -1.0
        closed_at = time.monotonic()
        await replies.aclose()  # the caller read what it waited for, and closes
        await asyncio.wait_for(ended.wait(), 5.0)
        return codes, held, time.monotonic() - closed_at
    finally:
        await client.shutdown()
        await server.shutdown()


@pytest.mark.timeout(60)
def test_a_reply_stream_stays_open_after_the_last_reply_until_the_caller_closes_it():
    codes, held, after_close = asyncio.run(_held_until_the_caller_closes())
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE]
    assert held >= 1.0  # still open a second after its last reply, the caller's side open
    assert after_close < 2.0  # and ended once the caller closed (not at held_open's 10 s bound)


@pytest.mark.timeout(30)
def test_held_open_ends_at_its_bound_when_the_caller_never_closes():
    async def bounded() -> float:
        started = time.monotonic()
        await streams.held_open(0.3)
        return time.monotonic() - started

    assert 0.3 <= asyncio.run(bounded()) < 2.0
