"""The lots behind the audit's seed (trust/audit.py): every member's, gathered once it holds every average.

A member's lot is its unique signature over the group (identity.draw_lot). The audit's seed
hashes every average and every member's lot, so a member shows its lot only once it holds every
average of the group: no reducer can then learn a member's seed before its answers to that
member are fixed, and none can try variants of its last average against the seed.

How the lots travel: every member, once it holds every average, asks each other reducer (the
members that can be dialled: a client, behind its router, cannot) with its own lot, and the
reducer answers with every member's lot once it holds them all, its own included (so not before it
holds every average itself). A reducer holds the clients' lots from their requests and the other
reducers' from theirs or from its answers; a client holds them all from any reducer's answer. A lot
is checked against its member's key wherever it arrives, so a reducer may pass on others' lots but
not make one up.

A member whose lot does not come within the wait (`audit.lot_wait_s`) fails the round for the
others, as a sender whose parts do not come does: nothing is applied, and it is not benched (its
link may have failed its own all-reduce).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from p2p_diloco import faults
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.transport import streams
from p2p_diloco.trust import audit

logger = get_logger(__name__)


class Lots:
    """Each kept group's lots: shows this member's, collects the others' (`gather`), and answers
    other members' requests (`answer`, behind the averager's `rpc_lots`)."""

    def __init__(self, stub: Callable[[Any], Any]):
        """`stub(peer)`: the averager's RPC stub for `peer`."""
        self._stub = stub
        self._complete: dict[bytes, asyncio.Event] = {}  # group -> set once this member holds every lot
        self._since: dict[bytes, float] = {}  # group -> when its runner was kept (monotonic s)

    def keep(self, group_ids: list[bytes]) -> None:
        """Follow the groups whose runners the auditor keeps, and only those."""
        for group_id in list(self._complete):
            if group_id not in group_ids:
                del self._complete[group_id], self._since[group_id]
        for group_id in group_ids:
            self._complete.setdefault(group_id, asyncio.Event())
            self._since.setdefault(group_id, time.monotonic())

    def _took(self, runner: ConsistentAllReduceRunner) -> None:
        if not runner.ledger.missing_lots() and runner.group_id in self._complete:
            self._complete[runner.group_id].set()

    async def gather(self, runner: ConsistentAllReduceRunner, wait_s: float) -> None:
        """Once this member holds every average: show its lot and collect every member's within
        `wait_s`, or raise AllreduceException naming those whose lot did not come."""
        ledger, me = runner.ledger, runner.peer_id
        faults.reached(faults.FaultPoint.LOTS, group=runner.group_id)
        own = ledger.own_lot(str(me))
        self._took(runner)
        complete = self._complete.get(runner.group_id)
        if complete is None:
            raise AllreduceException("the group's runner is no longer kept; nothing applied")
        dialled = [
            peer
            for peer, parts in zip(runner.ordered_peer_ids, runner.tensor_part_container.num_parts_by_peer)
            if parts > 0 and peer != me
        ]
        request = averaging_pb2.AveragingData(group_id=runner.group_id, peer_id=own)
        deadline = time.monotonic() + wait_s
        asks = [asyncio.create_task(self._ask(runner, peer, request, wait_s)) for peer in dialled]
        try:
            await asyncio.wait_for(complete.wait(), wait_s)
            # The other reducers answer too, each once it holds every lot: let them, within the
            # wait. An ask cut short resets its stream, which the reducer logs as a broken request.
            if asks:
                await asyncio.wait(asks, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            missing = ", ".join(ledger.missing_lots())
            raise AllreduceException(f"no audit lot from {missing} within {wait_s:.0f} s; nothing applied") from None
        finally:
            for ask in asks:
                ask.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*asks, return_exceptions=True)

    async def _ask(
        self, runner: ConsistentAllReduceRunner, peer: Any, request: averaging_pb2.AveragingData, wait_s: float
    ) -> None:
        """Show `peer` this member's lot; keep the lots it answers with, each checked."""
        members = len(runner.ledger.peers)
        try:
            answers = await streams.ask(
                self._stub(peer).rpc_lots, request, lambda got: len(got) == members, members, wait_s
            )
        except Exception as e:  # noqa: BLE001 - another reducer may still answer; the wait decides
            logger.debug("lots from %s: %s: %s", peer, type(e).__name__, e)
            return
        for answer in answers:
            member = _member(answer.weight, runner.ledger.peers)
            if member is None or not runner.ledger.accept_lot(member, answer.peer_id):
                logger.warning("reducer %s passed on a lot that is not %s's", peer, member)
        self._took(runner)

    async def answer(
        self,
        requests: AsyncIterator[averaging_pb2.AveragingData],
        context: P2PContext,
        runners: Mapping[bytes, ConsistentAllReduceRunner],
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: keep the asking member's lot, and once this member holds every lot (its own
        only once it holds every average), answer with them all, in member order; `runners`: the
        kept groups'. It waits as long as the group has run so far, at least LOT_FLOOR_S: the
        asker, which holds every average already, waits less (audit.lot_wait_s)."""
        request = await streams.first_request(requests)
        if request is None:
            return
        asker, runner = str(context.remote_id), runners.get(request.group_id)
        if runner is None or not runner.ledger.accept_lot(asker, request.peer_id):
            why = "group not kept" if runner is None else "not a member, or not its lot"
            logger.warning("lots request from %s refused: %s", asker, why)
            return
        self._took(runner)
        complete = self._complete.get(runner.group_id)
        if complete is None:
            return
        wait_s = audit.lot_wait_s(None, 2 * (time.monotonic() - self._since[runner.group_id]))
        try:
            await asyncio.wait_for(complete.wait(), wait_s)
        except asyncio.TimeoutError:
            return  # the asker's own wait ends it
        for index, member in enumerate(runner.ledger.peers):
            yield averaging_pb2.AveragingData(
                group_id=runner.group_id, weight=float(index), peer_id=runner.ledger.lots[member]
            )
        await streams.linger(requests)


def _member(index: float, peers: list[str]) -> str | None:
    """The member a lot's `weight` names (its index in the group), or None for anything else."""
    if not (0 <= index < len(peers)) or index != int(index):  # NaN compares false: refused
        return None
    return peers[int(index)]
