"""What every member shows its group once it holds every average: its audit lot, then its verdicts (trust/audit.py).

A member's lot is its unique signature over the group (identity.draw_lot). The audit's seed
hashes every average and every member's lot, so a member shows its lot only once it holds every
average of the group: no reducer can then learn a member's seed before its answers to that
member are fixed, and none can try variants of its last average against the seed. A member's
verdicts are its signed word on the items of the audit it checked (audit.checkers); the others
check themselves only what was not vouched for (audit.unvouched).

How the values travel: every member asks each other reducer (the members that can be dialled: a
client, behind its router, cannot) with its own value, and the reducer answers with every member's
value once it holds them all, its own included (so a lot not before it holds every average
itself). A reducer holds the clients' values from their requests and the other reducers' from
theirs or from its answers; a client holds them all from any reducer's answer. A value is checked
against its member's key wherever it arrives (ledger.Board), so a reducer may pass on others'
values but not make one up.

A member whose value does not come within the wait (`audit.lot_wait_s`, `audit.verdict_wait_s`)
fails the round for the others, as a sender whose parts do not come does: nothing is applied, and
it is not benched (its link may have failed its own all-reduce).
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
from p2p_diloco.swarm.averaging.ledger import Board, Ledger
from p2p_diloco.swarm.transport import streams
from p2p_diloco.trust import audit

logger = get_logger(__name__)


class Showing:
    """One kind of value every member of each kept group shows the others (its lot, its verdicts):
    shows this member's and collects the others' (`gather`), and answers other members' requests
    (`answer`, behind one of the averager's RPCs)."""

    def __init__(
        self,
        stub: Callable[[Any], Any],
        rpc: str,
        kind: str,
        board: Callable[[Ledger], Board],
        fault: faults.FaultPoint,
    ):
        """`stub(peer)`: the averager's RPC stub for `peer`, whose method `rpc` reaches another
        member's `answer`; `kind`: what the values are, for the log; `board(ledger)`: where a
        group's values are kept; `fault`: the fault point reached before this member shows its own."""
        self._stub, self._rpc, self._kind, self._board, self._fault = stub, rpc, kind, board, fault
        self._complete: dict[bytes, asyncio.Event] = {}  # group -> set once this member holds every value
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
        if not self._board(runner.ledger).missing() and runner.group_id in self._complete:
            self._complete[runner.group_id].set()

    async def gather(self, runner: ConsistentAllReduceRunner, own: Callable[[], bytes], wait_s: float) -> int:
        """Show this member's value (`own()`, made once the fault point is passed) and collect every
        member's within `wait_s`, or raise AllreduceException naming those whose value did not
        come. Returns the bytes of the answers it read."""
        faults.reached(self._fault, group=runner.group_id)
        request = averaging_pb2.AveragingData(group_id=runner.group_id, peer_id=own())
        self._took(runner)
        complete = self._complete.get(runner.group_id)
        if complete is None:
            raise AllreduceException("the group's runner is no longer kept; nothing applied")
        me = runner.peer_id
        dialled = [
            peer
            for peer, parts in zip(runner.ordered_peer_ids, runner.tensor_part_container.num_parts_by_peer)
            if parts > 0 and peer != me
        ]
        deadline, received = time.monotonic() + wait_s, [0]
        asks = [asyncio.create_task(self._ask(runner, peer, request, wait_s, received)) for peer in dialled]
        try:
            await asyncio.wait_for(complete.wait(), wait_s)
            # The other reducers answer too, each once it holds every value: let them, within the
            # wait. An ask cut short resets its stream, which the reducer logs as a broken request.
            if asks:
                await asyncio.wait(asks, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            missing = ", ".join(self._board(runner.ledger).missing())
            raise AllreduceException(
                f"no audit {self._kind} from {missing} within {wait_s:.0f} s; nothing applied"
            ) from None
        finally:
            for ask in asks:
                ask.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*asks, return_exceptions=True)
        return received[0]

    async def _ask(
        self,
        runner: ConsistentAllReduceRunner,
        peer: Any,
        request: averaging_pb2.AveragingData,
        wait_s: float,
        received: list[int],
    ) -> None:
        """Show `peer` this member's value; keep the values it answers with, each checked."""
        members, board = len(runner.ledger.peers), self._board(runner.ledger)
        try:
            answers = await streams.ask(
                getattr(self._stub(peer), self._rpc), request, lambda got: len(got) == members, members, wait_s
            )
        except Exception as e:  # noqa: BLE001 - another reducer may still answer; the wait decides
            logger.debug("%s from %s: %s: %s", self._kind, peer, type(e).__name__, e)
            return
        received[0] += sum(answer.ByteSize() for answer in answers)
        for answer in answers:
            member = _member(answer.weight, runner.ledger.peers)
            if member is None or not board.accept(member, answer.peer_id):
                logger.warning("reducer %s passed on a value that is not %s's %s", peer, member, self._kind)
        self._took(runner)

    async def answer(
        self,
        requests: AsyncIterator[averaging_pb2.AveragingData],
        context: P2PContext,
        runners: Mapping[bytes, ConsistentAllReduceRunner],
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: keep the asking member's value, and once this member holds every value
        (its own only once it showed it), answer with them all, in member order; `runners`: the
        kept groups'. It waits as long as the group has run so far, at least LOT_FLOOR_S: the
        asker, whose own value is out already, waits less (audit.lot_wait_s, audit.verdict_wait_s)."""
        request = await streams.first_request(requests)
        if request is None:
            return
        asker, runner = str(context.remote_id), runners.get(request.group_id)
        if runner is None or not self._board(runner.ledger).accept(asker, request.peer_id):
            why = "group not kept" if runner is None else f"not a member, or not its {self._kind}"
            logger.warning("%s request from %s refused: %s", self._kind, asker, why)
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
        board = self._board(runner.ledger)
        for index, member in enumerate(runner.ledger.peers):
            yield averaging_pb2.AveragingData(
                group_id=runner.group_id, weight=float(index), peer_id=board.shown[member]
            )
        await streams.linger(requests)


def _member(index: float, peers: list[str]) -> str | None:
    """The member a value's `weight` names (its index in the group), or None for anything else."""
    if not (0 <= index < len(peers)) or index != int(index):  # NaN compares false: refused
        return None
    return peers[int(index)]
