"""Link probes between members (protocol/links.py), outside the all-reduce's lockstep: the averager's
`LinkProber`, run in the averager process, where probes are sent and received.

A member probes each other member of its last group it holds a direct connection to
(links.probe_targets) with 1-8 MiB; the receiver times the chunks and answers with the rate. In
certified runs a probe from a peer that is not admitted is refused (swarm/trust/doors.py) before a
byte of it is read.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger

from p2p_diloco.protocol import links

logger = get_logger(__name__)

PROBE_RETRY_S = 0.5  # first pause before probing again a member that was busy receiving another probe


class ReceiverBusy(Exception):
    """A member was timing another member's probe: probe it again later."""


class LinkProber:
    """Sends link probes and answers them, and keeps what they measured (`link`). Held by
    DiLoCoAverager, whose `rpc_probe` hands each incoming probe to `answer`."""

    def __init__(
        self,
        stub: Callable[[PeerID], Any],
        may_enter: Callable[[Any, str], Awaitable[bool]],
        direct: Callable[[], Awaitable[Collection[str]]],
    ):
        """`stub(peer)`: the averager's RPC stub for `peer`; `may_enter(peer, door)`: its doors;
        `direct()`: the peers it holds a direct (not relayed) connection to now."""
        self._stub, self._may_enter, self._direct = stub, may_enter, direct
        self.link = links.LinkMeter()  # lives in the averager process, where probes are sent and received
        self._receiving = False  # one probe arrives at a time: two would share this peer's download

    def report(self) -> tuple[float | None, dict[str, float]]:
        """(this peer's figure, what it measured of each sender)."""
        return self.link.bandwidth(), self.link.seen()

    async def sweep(self, peers: list[str], size: int, deadline: float) -> dict[str, float | None]:
        """Probe each of `peers` this averager holds a direct connection to (links.probe_targets) in
        turn with `size` bytes until the monotonic `deadline`; {peer: the rate it reported}. A
        receiver already timing another member's probe answers busy (two probes would share its
        download, and each would under-read a link): it is tried again after the others, with a
        growing pause, until the deadline."""
        pending = links.probe_targets(peers, await self._direct())
        if len(pending) < len(peers):
            logger.debug("not probed (no direct connection): %s", sorted(set(peers) - set(pending)))
        reports, pause = {}, PROBE_RETRY_S
        while pending and time.monotonic() < deadline:
            busy = []
            for peer in pending:
                try:
                    rate = await asyncio.wait_for(
                        self._probe_one(PeerID.from_base58(peer), size), deadline - time.monotonic()
                    )
                except ReceiverBusy:
                    logger.debug("%s is busy with another probe: trying it again later", peer)
                    busy.append(peer)
                    continue
                except Exception as e:  # a peer that left or refuses: it is not measured this time
                    logger.debug("probe of %s failed: %r", peer, e)
                    continue
                self.link.sent(rate)
                reports[peer] = rate
            pending = busy
            if pending:  # every one left is being probed by someone else: let those probes end
                await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                pause *= 2
        return reports

    async def _probe_one(self, peer: PeerID, size: int) -> float | None:
        """One probe: a hello, then (once the receiver accepts) `size` bytes in chunks; the rate the
        receiver measured, or ReceiverBusy. Nothing is streamed before the receiver accepted, so a
        busy receiver's refusal cuts no stream short."""
        accepted = asyncio.Event()

        async def messages() -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(code=averaging_pb2.REQUEST_JOIN)
            await accepted.wait()
            chunk = runtime_pb2.Tensor(buffer=bytes(links.PROBE_CHUNK))
            for _ in range(max(2, size // links.PROBE_CHUNK)):
                yield averaging_pb2.AveragingData(tensor_part=chunk)

        async for reply in await self._stub(peer).rpc_probe(messages()):
            if reply.code == averaging_pb2.NOT_LOOKING_FOR_GROUP:
                raise ReceiverBusy(str(peer))
            if reply.code == averaging_pb2.ACCEPTED:
                accepted.set()
                continue
            rate = reply.weight
            return rate if reply.code == averaging_pb2.AVERAGED_PART and math.isfinite(rate) and rate > 0 else None
        return None

    async def answer(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """Another member's probe (untrusted, I4): a hello, then at most PROBE_MAX bytes in
        PROBE_CHUNK messages. One probe at a time: while one arrives, another sender's hello is
        answered busy. Answers with the rate the chunks arrived at (in `weight`)."""
        hello = await anext(aiter(stream), None)
        if hello is None or hello.code != averaging_pb2.REQUEST_JOIN:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if not await self._may_enter(context.remote_id, "probe"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self._receiving:
            yield averaging_pb2.AveragingData(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        self._receiving = True
        sender = str(context.remote_id)
        try:
            yield averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
            arrivals, total = [], 0
            async for message in stream:
                size = len(message.tensor_part.buffer)
                total += size
                if size > links.PROBE_CHUNK or total > links.PROBE_MAX:
                    yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                    return
                arrivals.append((time.perf_counter(), size))
            rate = links.probe_rate(arrivals)
            self.link.received(sender, rate)
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, weight=rate or 0.0)
        finally:
            self._receiving = False
