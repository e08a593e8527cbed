"""The audit after every all-reduce (trust/audit.py): the averager's `Auditor`, run in the averager process.

Once a member holds every average of its group, and before it applies any, it shows its lot and
collects every member's (showings.py): the audit's seed. The seed picks some chunks of each other
reducer's span (`audit.audited_chunks`), and for each chunk CHECKERS members that check it
(`audit.checkers`). A checker asks the reducer for every sender's signed chunk, checks the senders'
signatures and seals, recomputes the combination of the chunks and compares it with the same chunk
of the signed average it received (inspection.py). A chunk that does not check (or any part under
centered-clip, `audit.CHUNK_AUDITABLE`) is settled on the whole part: every sender's signed part
of it, recomputed as the reducer had to (`audit.disagreement`). Every member then shows its signed
verdicts and collects every member's (showings.py), and checks itself every item some checker did
not vouch for (`audit.unvouched`): a lie escapes a member only where every checker of its item lied
with the reducer, and each member checks about CHECKERS x AUDIT_CHUNKS items, not k - 1 times that.
In groups of 3 or fewer, every other member checks every item, and no verdicts are shown.

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
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger

from p2p_diloco import faults
from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.averaging.evidence import EvidenceDesk, sender_case
from p2p_diloco.swarm.averaging.inspection import WHOLE, Found, Inspector
from p2p_diloco.swarm.averaging.ledger import Ledger, SignedPart, codec_of, numel_of
from p2p_diloco.swarm.averaging.showings import Showing
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
        # What every member shows once it holds every average (showings.py): its lot, behind the
        # audit's seed, and then its verdicts on the items it checked.
        self._inspector = Inspector(stub, evidence)
        self.lots = Showing(stub, "rpc_lots", "lot", lambda ledger: ledger.lots, faults.FaultPoint.LOTS)
        self.verdicts = Showing(
            stub, "rpc_verdicts", "verdicts", lambda ledger: ledger.verdicts, faults.FaultPoint.VERDICTS
        )

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
        self.lots.keep(list(self._kept))
        self.verdicts.keep(list(self._kept))

    def answer_lots(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: another member's lot in, every member's out (showings.py)."""
        return self.lots.answer(requests, context, self._kept)

    def answer_verdicts(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: another member's verdicts in, every member's out (showings.py)."""
        return self.verdicts.answer(requests, context, self._kept)

    async def answer(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: every sender's signed part (or one chunk of it, with its seal) of one part
        of this member's span, in sender order. The request names the group, in `weight` the part
        index, and in `peer_id` the chunk (4 bytes; none: the whole part). The handler ends only
        once the auditor holds them all (swarm/transport/streams.py)."""
        request = await streams.first_request(requests)
        if request is None:
            return
        faults.reached(faults.FaultPoint.AUDIT, group=request.group_id)
        shown = self._shown_for_audit(request, context.remote_id)
        if not shown:
            return  # a refusal ends at once
        for message in shown:
            yield message
        await streams.linger(requests)

    def _shown_for_audit(self, request: averaging_pb2.AveragingData, auditor: Any) -> list[averaging_pb2.AveragingData]:
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
        chunk = _chunk_asked(request.peer_id)
        shown = [_shown(signed[sender], chunk) for sender in range(len(runner.sender_peer_ids))]
        if any(message is None for message in shown):
            logger.warning("audit request from %s refused: no chunk %s of part %s", auditor, chunk, part)
            return []
        return [message for message in shown if message is not None]

    async def check(
        self, runner: ConsistentAllReduceRunner, pace_bytes_s: float = 0.0, butterfly_s: float = 0.0
    ) -> int:
        """Gather every member's lot, check this member's share of the audit (audit.checkers),
        show its verdicts and check whatever the others did not vouch for; raise if a reducer
        failed (before anything is applied). `pace_bytes_s`: how fast the butterfly moved
        (audit.reply_timeout_s), in `butterfly_s` (audit.lot_wait_s). Returns the bytes the
        answers took (the reducers' to the audit, the lots and verdicts passed on)."""
        ledger, me = runner.ledger, runner.ordered_peer_ids.index(runner.peer_id)
        wait_s = audit.lot_wait_s(runner.sender_timeout, butterfly_s)
        received = [await self.lots.gather(runner, lambda: ledger.own_lot(ledger.peers[me]), wait_s)]
        plan = self._plan(runner, ledger.seed())
        started = time.monotonic()
        found = await self._inspect(runner, [i for i, who in plan.items() if me in who], plan, received, pace_bytes_s)
        # Some items are others' to check: take their word, unless a reducer did not answer this
        # member, which fails its round whatever the others say (it tells nobody: the others then
        # fail alike, within their wait for its verdicts, instead of waiting for it to wait too).
        silent = any(outcome == audit.SILENT for outcome, _ in found.values())
        if any(me not in who for who in plan.values()) and not silent:
            verdicts = {item: outcome for item, (outcome, _) in found.items()}
            wait_s = audit.verdict_wait_s(runner.sender_timeout, time.monotonic() - started)
            own = lambda: ledger.own_verdicts(ledger.peers[me], verdicts)  # noqa: E731
            received.append(await self.verdicts.gather(runner, own, wait_s))
            read = {ledger.peers.index(m): v for m, v in ledger.verdicts.read.items()}
            doubted = audit.unvouched(plan, me, read)
            if doubted:
                doubters = sorted(
                    {ledger.peers[m] for i in doubted for m in plan[i] if read.get(m, {}).get(i) != audit.PASS}
                )
                logger.info("%d audited items not vouched for by %s: checking them", len(doubted), ", ".join(doubters))
            more = await self._inspect(runner, doubted, plan, received, pace_bytes_s)
            found |= {item: (outcome, _doubters(item, plan, read) + why) for item, (outcome, why) in more.items()}
        self._conclude(runner, found)
        return sum(received)

    def _plan(self, runner: ConsistentAllReduceRunner, seed: bytes) -> dict[audit.Item, tuple[int, ...]]:
        """Every audited item of every other reducer's span, with the members that check it. Chunks
        (audit.audited_chunks), or whole parts where the aggregator is not chunk-local
        (audit.parts_to_audit)."""
        container, ledger = runner.tensor_part_container, runner.ledger
        me = runner.ordered_peer_ids.index(runner.peer_id)
        plan: dict[audit.Item, tuple[int, ...]] = {}
        for j, num_parts in enumerate(container.num_parts_by_peer):
            if num_parts == 0 or j == me:
                continue
            if runner.aggregation[0] in audit.CHUNK_AUDITABLE:
                sizes = [numel_of(ledger.averages[(j, p)].encoded) for p in range(num_parts)]
                items = [(j, part, chunk) for part, chunk in audit.audited_chunks(seed, ledger.peers[j], sizes)]
            else:
                count = audit.parts_to_audit(container.part_size_bytes)
                parts = audit.audited_parts(seed, ledger.peers[j], num_parts, count)
                items = [(j, part, audit.WHOLE_PART) for part in parts]
            who = audit.checkers(seed, ledger.peers[j], j, len(ledger.peers), len(items))
            plan.update(zip(items, who))
        return plan

    async def _inspect(
        self,
        runner: ConsistentAllReduceRunner,
        items: list[audit.Item],
        plan: dict[audit.Item, tuple[int, ...]],
        received: list[int],
        pace_bytes_s: float,
    ) -> Found:
        """Check `items`, every reducer's at once (inspection.py); `plan`: every item's checkers."""
        reducers = sorted({item[0] for item in items})
        checks = {j: sum(len(who) for item, who in plan.items() if item[0] == j) for j in reducers}
        found = await asyncio.gather(
            *(
                self._inspector.check(runner, j, [i for i in items if i[0] == j], checks[j], received, pace_bytes_s)
                for j in reducers
            )
        )
        return {item: outcome for by_reducer in found for item, outcome in by_reducer.items()}

    def _conclude(self, runner: ConsistentAllReduceRunner, found: Found) -> None:
        """Convict the reducers whose item convicted, bench those that did not answer; raise for
        the first of either (a conviction first): nothing is applied."""
        peers = runner.ledger.peers
        convictions = {item[0]: why for item, (outcome, why) in sorted(found.items()) if outcome == audit.DOUBT}
        for j, reason in convictions.items():
            self.convicted.add(peers[j])
            logger.warning(
                "convicted reducer %s in the audit: %s; it is refused for the rest of the run", peers[j], reason
            )
        if convictions:
            j, reason = next(iter(convictions.items()))
            raise ReducerConvicted(f"reducer {peers[j]} failed the audit: {reason}; nothing applied")
        unanswered = {item[0]: why for item, (outcome, why) in sorted(found.items()) if outcome == audit.SILENT}
        for j, reason in unanswered.items():
            self.bench(peers[j], reason)
        if unanswered:
            j, reason = next(iter(unanswered.items()))
            raise AllreduceException(f"reducer {peers[j]}: {reason}; nothing applied")


def _doubters(item: audit.Item, plan: dict[audit.Item, tuple[int, ...]], read: dict[int, dict[audit.Item, int]]) -> str:
    """How many of `item`'s checkers did not vouch for it, for the line that says why this member
    checked it (first: a failed round's line is cut at 200 characters, swarm/averaging/step.py)."""
    doubters = sum(read.get(m, {}).get(item) != audit.PASS for m in plan[item])
    return f"taken up after {doubters} of its {len(plan[item])} checkers did not vouch for it; "


def _chunk_asked(raw: bytes) -> int | None:
    """The chunk an audit request asks for (its `peer_id`: 4 bytes), WHOLE for none; -1 for a
    field that is neither, which no part has."""
    if not raw:
        return WHOLE
    return struct.unpack(">I", raw)[0] if len(raw) == 4 else -1


def _shown(part: SignedPart, chunk: int | None) -> averaging_pb2.AveragingData | None:
    """A sender's signed part as the audit shows it: whole with its seal's norms, or one chunk's
    piece with the whole seal (norms and digests). None if it has no such chunk."""
    if chunk is WHOLE:
        return averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, tensor_part=part.encoded, weight=part.weight, peer_id=part.sealed()
        )
    codec, numel = codec_of(part.encoded), numel_of(part.encoded)
    bounds = codecs.chunk_bounds(numel) if codec is not None and numel < 2**40 else []
    if not 0 <= chunk < len(bounds) or codec is None:
        return None
    start, end = bounds[chunk]
    try:
        piece = codec.piece(part.encoded.buffer, numel, start, end)
    except ValueError:  # a part this member kept does decode; not one that does not
        return None
    encoded = runtime_pb2.Tensor(buffer=piece, size=[end - start], dtype=part.encoded.dtype)
    return averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING,
        tensor_part=encoded,
        weight=part.weight,
        peer_id=part.sealed(digests=True),
    )
