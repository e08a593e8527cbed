"""bench/tcp_butterfly.py's worker over libp2p: the same bytes in the same two phases, through
hivemind's p2pd (one per host, TCP, yamux, noise) and raw libp2p streams, with no protobuf, codec,
signature or arithmetic. What the stack under our all-reduce costs in its pattern, against raw TCP.

One host: start its p2pd on its lab address, print its peer id and address, read the others' and
"go" on stdin, then per phase open one stream to each other host and write `part` bytes while
reading `part` bytes from each host's stream to it; phase 2 starts once phase 1 is done both
ways. Prints the seconds from "go" to the last byte received.

With TCPB_RPC=1 as well (--rpc), that schedule through hivemind's protobuf RPC streams, as our
all-reduce's runner uses them: one request stream to each other host carrying its pieces as
AveragingData messages, and the answers on the same stream, still with no codec, signature or
arithmetic: what hivemind's RPC path costs against raw streams. A host is done once it holds every
answer and the others hold its answers: one that shut its p2pd down once it held its own broke the
others' streams to it ("Broken pipe", no result within 300 s; session 34, past 250 KB pieces).

With TCPB_PIECES=P (--pieces), our all-reduce's schedule instead: each host's part for another
is P pieces sent back to back, and a host answers piece i of its own span to every other host as
soon as it holds every other host's piece i (as our reducers answer each part of 2 MiB once every
sender's is in), still with no protobuf, codec, signature or arithmetic.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}
CHUNK = 1 << 20
HANDLER = "butterfly"


async def _read_line() -> str:
    return await asyncio.get_event_loop().run_in_executor(None, sys.stdin.readline)


async def _dial(p2p: P2P, peer: PeerID, addrs: list[Multiaddr], tries: int = 3) -> None:
    """Connect to `peer`, up to `tries` times: a single dial still failed noise's handshake once
    ("message is too short", session 35, with cubic), which ended the whole bench."""
    for attempt in range(tries):
        try:
            await p2p._client.connect(peer, addrs)
            return
        except ControlFailure as e:
            if attempt == tries - 1:
                raise
            print(f"dial {attempt + 1} of {tries} to {str(peer)[-6:]} failed: {e}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5 * (attempt + 1))


async def worker(ip: str, part: int) -> None:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"], **NO_NAT)
    addrs = [str(a).split("/p2p/")[0] for a in await p2p.get_visible_maddrs()]
    addrs = [a for a in addrs if f"/ip4/{ip}/" in a] or addrs  # the lab's address, not loopback
    print(json.dumps({"id": str(p2p.peer_id), "addrs": addrs}), flush=True)
    peers = json.loads(await _read_line())  # [{"id", "addrs"} or None for this host], in host order
    others = [PeerID.from_base58(p["id"]) for p in peers if p is not None]
    me = peers.index(None)
    for p in peers[me + 1 :]:  # one dial a pair: two at once can fail noise's handshake ("message is too short")
        await _dial(p2p, PeerID.from_base58(p["id"]), [Multiaddr(a) for a in p["addrs"]])
    if pieces := int(os.environ.get("TCPB_PIECES") or 0):
        await (rpc if os.environ.get("TCPB_RPC") else streamed)(p2p, others, part, pieces)
        return
    arrived = {1: asyncio.Queue(), 2: asyncio.Queue()}

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        phase = (await reader.readexactly(1))[0]
        left = part
        while left > 0:
            chunk = await reader.read(min(CHUNK, left))
            if not chunk:
                raise ConnectionError("a stream ended early")
            left -= len(chunk)
        writer.close()  # the sender waits for this: p2pd drops what it still holds of a stream closed early
        arrived[phase].put_nowait(True)

    await p2p.add_binary_stream_handler(HANDLER, handle)
    print("ready", flush=True)
    await _read_line()  # "go"
    start = time.perf_counter()
    for phase in (1, 2):
        await asyncio.gather(
            *(_send(p2p, peer, phase, part) for peer in others), *(arrived[phase].get() for _ in others)
        )
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
    await p2p.shutdown()


async def _send(p2p: P2P, peer: PeerID, phase: int, part: int) -> None:
    _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
    writer.write(bytes([phase]))
    payload, left = b"\0" * CHUNK, part
    while left > 0:
        writer.write(payload[: min(CHUNK, left)])
        await writer.drain()
        left -= min(CHUNK, left)
    await reader.read()  # until the receiver closes, holding every byte: closing first could lose the tail
    writer.close()


async def streamed(p2p: P2P, others: list[PeerID], part: int, pieces: int) -> None:
    """Our all-reduce's schedule (see the module's doc): parts out in pieces, each piece's average
    out to every other host once every other host's piece of it is in."""
    size = part // pieces
    have = [0] * pieces  # piece index -> other hosts' pieces of it received
    answers = {str(peer): asyncio.Queue() for peer in others}  # piece indices ready to answer, per host
    averages_in: asyncio.Queue = asyncio.Queue()

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = await reader.readexactly(1)
        for i in range(pieces):
            await reader.readexactly(size)
            if kind == b"p":
                have[i] += 1
                if have[i] == len(others):
                    for queue in answers.values():
                        queue.put_nowait(i)
        writer.close()  # the sender waits for this (see _send)
        if kind == b"a":
            averages_in.put_nowait(True)

    async def out(peer: PeerID, kind: bytes) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
        writer.write(kind)
        for _ in range(pieces):
            if kind == b"a":
                await answers[str(peer)].get()
            writer.write(b"\0" * size)
            await writer.drain()
        await reader.read()
        writer.close()

    await p2p.add_binary_stream_handler(HANDLER, handle)
    print("ready", flush=True)
    await _read_line()  # "go"
    start = time.perf_counter()
    sends = [out(peer, kind) for peer in others for kind in (b"p", b"a")]
    await asyncio.gather(*sends, *(averages_in.get() for _ in others))
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
    await p2p.shutdown()


RPC = "butterfly-rpc"


def _piece(i: int, size: int) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=bytes(size)), weight=float(i))


async def rpc(p2p: P2P, others: list[PeerID], part: int, pieces: int) -> None:
    """`streamed`'s schedule through hivemind's protobuf stream handlers (see the module's doc).
    A request stream stays open until every answer on it arrived, as our runner's does."""
    size = part // pieces
    have = [0] * pieces
    ready = [asyncio.Event() for _ in range(pieces)]
    served, all_served = [0], asyncio.Event()  # this host's answers delivered, host by host

    async def handle(requests, context):
        async def take() -> None:
            async for request in requests:
                i = int(request.weight)
                have[i] += 1
                if have[i] == len(others):
                    ready[i].set()

        taking = asyncio.create_task(take())
        try:
            for i in range(pieces):
                await ready[i].wait()
                yield _piece(i, size)
            await taking  # the asker ends its requests once it holds every answer
            served[0] += 1
            if served[0] == len(others):
                all_served.set()
        finally:
            taking.cancel()

    async def exchange(peer: PeerID) -> None:
        received_all = asyncio.Event()

        async def requests():
            for i in range(pieces):
                yield _piece(i, size)
            await received_all.wait()

        got = 0
        stream = await p2p.iterate_protobuf_handler(peer, RPC, requests(), averaging_pb2.AveragingData)
        async for _ in stream:
            got += 1
            if got == pieces:
                received_all.set()

    await p2p.add_protobuf_handler(RPC, handle, averaging_pb2.AveragingData, stream_input=True, stream_output=True)
    print("ready", flush=True)
    await _read_line()  # "go"
    start = time.perf_counter()
    # Done once it holds every answer and every other host holds its answers: a host that shut its
    # p2pd down once it held its own broke the others' streams to it (no result in 300 s).
    await asyncio.gather(*(exchange(peer) for peer in others), all_served.wait())
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
    await p2p.shutdown()
