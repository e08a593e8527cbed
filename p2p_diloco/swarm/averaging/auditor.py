"""The audit after every all-reduce (trust/audit.py): the averager's `Auditor`, run in the averager process.

Once a member holds every average of its group, and before it applies any, it asks each other
reducer for the signed parts of some parts of its span (`audit.audited_parts`), checks the senders'
signatures, recomputes the combination and compares it with the signed average it received.

- A reducer whose average does not match, or that shows a part its sender did not sign, is
  **convicted**: the all-reduce fails (nothing applied, I2), and this member refuses the reducer
  at every door for the rest of the run (`convicted`). The retry of the round forms without it.
- A reducer that does not answer in time, or answers with too few parts, fails the
  round and is left out of this member's groups for a while (`audit.bench_s`: 2 minutes, doubled at
  each repeat): it may be slow or gone, not lying, but it must not fail every round.

A reducer serves the parts of its KEEP_GROUPS latest groups, to members of that group only.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from p2p_diloco import faults
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.averaging.evidence import Case, EvidenceDesk, judge, sender_case
from p2p_diloco.swarm.averaging.ledger import Ledger, SignedPart
from p2p_diloco.swarm.transport import streams
from p2p_diloco.trust import audit

logger = get_logger(__name__)

KEEP_GROUPS = 2  # groups whose signed parts a reducer keeps for auditors


class ReducerConvicted(AllreduceException):
    """A reducer answered an average that is not the combination of the signed parts."""


class Auditor:
    """Serves and runs the audits of this member's all-reduces, and keeps who is left out of its
    groups for them (`convicted`, the benched). Held by DiLoCoAverager, whose `rpc_audit` hands each
    request to `answer`."""

    def __init__(self, stub: Callable[[Any], Any], evidence: EvidenceDesk, left_out_changed: Callable[[], None]):
        """`stub(peer)`: the averager's RPC stub for `peer`; `evidence`: where the case behind each
        conviction is filed; `left_out_changed()`: called once a peer is convicted or benched, so
        that the averager's matchmaking stops asking it to lead."""
        self._stub, self._evidence, self._left_out_changed = stub, evidence, left_out_changed
        self.convicted: set[str] = set()  # reducers and senders this member refuses for the rest of the run
        self._benched: dict[str, tuple[int, float]] = {}  # reducer -> (unanswered audits, left out until: monotonic s)
        self._kept: OrderedDict[bytes, ConsistentAllReduceRunner] = OrderedDict()  # group -> its runner

    def left_out(self, peer: Any) -> str | None:
        """Why `peer` is kept out of this member's groups (at every door), or None."""
        if str(peer) in self.convicted:
            return "it failed an audit as a reducer"
        offences, until = self._benched.get(str(peer), (0, 0.0))
        if time.monotonic() < until:
            return f"it did not answer its audit; left out for {until - time.monotonic():.0f} s more"
        return None

    def bench(self, peer: str, reason: str, role: str = "reducer") -> None:
        """Leave `peer` out of this member's groups for a while (audit.bench_s, doubled at each repeat)."""
        offences = self._benched.get(peer, (0, 0.0))[0] + 1
        period = audit.bench_s(offences)
        self._benched[peer] = (offences, time.monotonic() + period)
        logger.warning("%s %s: %s; left out of this peer's groups for %.0f s", role, peer, reason, period)
        self._left_out_changed()

    def convict(self, peer: str) -> None:
        """Refuse `peer` for the rest of the run (convicted on a case another member served)."""
        self.convicted.add(peer)
        self._left_out_changed()

    def settle(self, ledger: Ledger) -> None:
        """After an all-reduce, whatever its end: refuse whoever signed what it did not send, and
        convict, with a case, whoever signed a malformed part (evidence.sender_case)."""
        self.convicted |= ledger.bad_signers
        for sender in sorted(ledger.misfits - self.convicted):
            logger.warning(
                "refused sender %s: it signed a part of another size than the group's layout; "
                "it is refused for the rest of the run",
                sender,
            )
        self.convicted |= ledger.misfits
        for sender in ledger.garbage:
            if sender not in self.convicted:
                logger.warning(
                    "convicted sender %s: it signed a malformed part; it is refused for the rest of the run", sender
                )
            self.convicted.add(sender)
            self._evidence.file(sender, sender_case(ledger, sender))
        if self.convicted:
            self._left_out_changed()

    def keep(self, runner: ConsistentAllReduceRunner) -> None:
        """Keep the signed parts of `runner`'s group for its auditors (the KEEP_GROUPS latest)."""
        self._kept[runner.group_id] = runner
        while len(self._kept) > KEEP_GROUPS:
            self._kept.popitem(last=False)

    async def answer(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: every sender's signed part of one part of this member's span, in sender
        order. The request names the group and, in `weight`, the part index. The handler ends only
        once the auditor holds them all (swarm/transport/streams.py)."""
        request = await streams.first_request(requests)
        if request is None:
            return
        faults.reached(faults.FaultPoint.AUDIT, group=request.group_id)
        shown = self._shown_for_audit(request, context.remote_id)
        if not shown:
            return  # a refusal ends at once
        for part in shown:
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING,
                tensor_part=part.encoded,
                weight=part.weight,
                peer_id=part.signature,
            )
        await streams.linger(requests)

    def _shown_for_audit(self, request: averaging_pb2.AveragingData, auditor: Any) -> list[SignedPart]:
        """What the audit request asks for, if this member reduced it and `auditor` was in the group."""
        runner = self._kept.get(request.group_id)
        part = request.weight
        signed = runner.ledger.parts.get(int(part)) if runner is not None and part == int(part) else None
        if runner is None or auditor not in runner.ordered_peer_ids or signed is None:
            why = "group not kept" if runner is None else "not a member, or no such part"
            logger.warning("audit request from %s refused: %s", auditor, why)
            return []
        if len(signed) != len(runner.sender_peer_ids):
            logger.warning("audit of part %s: holds %d parts of %d", part, len(signed), len(runner.sender_peer_ids))
            return []
        return [signed[sender] for sender in range(len(runner.sender_peer_ids))]

    async def check(self, runner: ConsistentAllReduceRunner, pace_bytes_s: float = 0.0) -> int:
        """Audit every other reducer of the group; raise if any failed (before anything is applied).
        `pace_bytes_s`: how fast the butterfly moved (audit.reply_timeout_s). Returns the bytes the
        reducers' answers took (their messages' sizes)."""
        seed = runner.ledger.seed()
        me = runner.ordered_peer_ids.index(runner.peer_id)
        reducers = [j for j, n in enumerate(runner.tensor_part_container.num_parts_by_peer) if n > 0 and j != me]
        received: list[int] = []
        audits = (self._audit_one(runner, j, seed, received, pace_bytes_s) for j in reducers)
        verdicts = await asyncio.gather(*audits)
        convictions = [(j, v[1]) for j, v in zip(reducers, verdicts) if v is not None and v[0]]
        for j, reason in convictions:
            peer = str(runner.ordered_peer_ids[j])
            self.convicted.add(peer)
            logger.warning("convicted reducer %s in the audit: %s; it is refused for the rest of the run", peer, reason)
        if convictions:
            j, reason = convictions[0]
            raise ReducerConvicted(f"reducer {runner.ordered_peer_ids[j]} failed the audit: {reason}; nothing applied")
        unanswered = [(j, v[1]) for j, v in zip(reducers, verdicts) if v is not None]
        for j, reason in unanswered:
            self.bench(str(runner.ordered_peer_ids[j]), reason)
        if unanswered:
            j, reason = unanswered[0]
            raise AllreduceException(f"reducer {runner.ordered_peer_ids[j]}: {reason}; nothing applied")
        return sum(received)

    async def _audit_one(
        self, runner: ConsistentAllReduceRunner, j: int, seed: bytes, received: list[int], pace_bytes_s: float
    ) -> tuple[bool, str] | None:
        """None if reducer `j` passes; (True, why) if it is convicted; (False, why) if it did not
        answer. The size of each answer goes to `received`."""
        container = runner.tensor_part_container
        count = audit.parts_to_audit(container.part_size_bytes)
        parts = audit.audited_parts(seed, str(runner.ordered_peer_ids[j]), container.num_parts_by_peer[j], count)
        senders, auditors = len(runner.ledger.senders), len(runner.ordered_peer_ids) - 1
        volume = audit.answers_bytes(auditors, len(parts), senders, container.part_size_bytes)
        wait_s = audit.reply_timeout_s(runner.sender_timeout, volume, pace_bytes_s)
        verdicts = await asyncio.gather(*(self._audit_part(runner, j, part, received, wait_s) for part in parts))
        failed = [v for v in verdicts if v is not None]
        return next((v for v in failed if v[0]), failed[0] if failed else None)  # a conviction first

    async def _audit_part(
        self, runner: ConsistentAllReduceRunner, j: int, part: int, received: list[int], wait_s: float | None
    ) -> tuple[bool, str] | None:
        """The verdict on one part of reducer `j`'s span, as `_audit_one`'s; `wait_s`: the longest
        wait for the next message of its answer."""
        peer = runner.ordered_peer_ids[j]
        try:
            shown = await self._ask(peer, runner.group_id, part, len(runner.ledger.senders), wait_s)
        except Exception as e:  # a dead, slow or garbled reducer: the round fails, nobody is convicted
            return False, f"no answer to the audit of part {part} ({type(e).__name__})"
        received.append(sum(message.ByteSize() for message in shown))
        return self._judge(runner, j, part, shown)

    async def _ask(
        self, peer: Any, group_id: bytes, part: int, senders: int, reply_timeout_s: float | None
    ) -> list[averaging_pb2.AveragingData]:
        """The reducer's answer, each signed part within `reply_timeout_s` (audit.reply_timeout_s:
        the all-reduce's own wait for a chunk, longer only as far as the answers' volume needs at
        the butterfly's pace): a member that hung after its all-reduce (its answers all sent, a
        laptop gone to sleep) would cost the others the whole all-reduce deadline and then the
        retry's matchmaking (docs/design.md §3, step 7)."""
        request = averaging_pb2.AveragingData(group_id=group_id, weight=float(part))
        return await streams.ask(
            self._stub(peer).rpc_audit, request, lambda shown: len(shown) == senders, senders, reply_timeout_s
        )

    def _judge(
        self, runner: ConsistentAllReduceRunner, j: int, part: int, shown: list[averaging_pb2.AveragingData]
    ) -> tuple[bool, str] | None:
        """The audit's verdict on reducer `j` (see `_audit_one`): a conviction only on what is
        signed; its case is kept for peers outside the group (swarm/averaging/evidence.py)."""
        ledger = runner.ledger
        if len(shown) != len(ledger.senders):
            # Nothing signed says so: a stream cut short looks the same (a peer that just resumed,
            # say). The round fails; nobody is convicted.
            return False, f"answered the audit of part {part} with {len(shown)} parts for {len(ledger.senders)} senders"
        average = ledger.averages[(j, part)]
        case = Case(
            ledger.group_id,
            ledger.peers,
            ledger.senders,
            ledger.keys,
            j,
            part,
            shown,
            average.encoded,
            average.signature,
        )
        verdict = judge(case, runner.codec, runner.aggregation)
        if verdict is None:
            return None
        self._evidence.file(ledger.peers[j], case)
        return True, verdict[1]
