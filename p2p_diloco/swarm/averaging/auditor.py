"""The audit after every all-reduce (trust/audit.py): the averager's `Auditor`, run in the averager process.

Once a member holds every average of its group, and before it applies any, it asks each other
reducer for every sender's signed chunk of some chunks of its span (`audit.audited_chunks`), checks
the senders' signatures and seals, recomputes the combination of the chunks and compares it with
the same chunk of the signed average it received. A chunk that does not check (or any part under
centered-clip, `audit.CHUNK_AUDITABLE`) is settled on the whole part: every sender's signed part
of it, recomputed as the reducer had to (`audit.disagreement`).

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
import math
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
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner, malformed
from p2p_diloco.swarm.averaging.evidence import Case, EvidenceDesk, judge, sender_case
from p2p_diloco.swarm.averaging.ledger import Ledger, SignedPart, codec_of, numel_of
from p2p_diloco.swarm.averaging.lots import Lots
from p2p_diloco.swarm.transport import streams
from p2p_diloco.trust import audit, wire

logger = get_logger(__name__)

KEEP_GROUPS = 2  # groups whose signed parts a reducer keeps for auditors
WHOLE = None  # an audit request for whole parts, not a chunk
ESCALATE = (False, "")  # a chunk that did not check: the whole part settles it
CHUNK_ANSWER_BYTES = 4 * codecs.CHUNK_VALUES + 2048  # one sender's chunk and seal in an audit's answer, at most


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
        self.lots = Lots(stub)  # the lots behind each kept group's audit seed (lots.py)

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

    def answer_lots(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """As a reducer: another member's lot in, every member's out (lots.py)."""
        return self.lots.answer(requests, context, self._kept)

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
        """Gather every member's lot, then audit every other reducer of the group; raise if any
        failed (before anything is applied). `pace_bytes_s`: how fast the butterfly moved
        (audit.reply_timeout_s), in `butterfly_s` (audit.lot_wait_s). Returns the bytes the
        reducers' answers took (their messages' sizes)."""
        await self.lots.gather(runner, audit.lot_wait_s(runner.sender_timeout, butterfly_s))
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
        answer. Its chunks first, then whole the parts whose chunk did not check (or, where the
        aggregator is not chunk-local, parts as audit.parts_to_audit). The size of each answer goes
        to `received`."""
        container = runner.tensor_part_container
        reducer, num_parts = str(runner.ordered_peer_ids[j]), container.num_parts_by_peer[j]
        senders, auditors = len(runner.ledger.senders), len(runner.ordered_peer_ids) - 1
        if runner.aggregation[0] in audit.CHUNK_AUDITABLE:
            sizes = [numel_of(runner.ledger.averages[(j, p)].encoded) for p in range(num_parts)]
            picked = audit.audited_chunks(seed, reducer, sizes)
            volume = audit.answers_bytes(auditors, len(picked), senders, CHUNK_ANSWER_BYTES)
            wait_s = audit.reply_timeout_s(runner.sender_timeout, volume, pace_bytes_s)
            checks = (self._audit_chunk(runner, j, part, chunk, received, wait_s) for part, chunk in picked)
            results = await asyncio.gather(*checks)
            unanswered = [v for v in results if v is not None and v is not ESCALATE]
            if unanswered:
                return unanswered[0]
            parts = sorted({part for (part, _), v in zip(picked, results) if v is ESCALATE})
        else:
            parts = audit.audited_parts(seed, reducer, num_parts, audit.parts_to_audit(container.part_size_bytes))
        volume = audit.answers_bytes(auditors, len(parts), senders, container.part_size_bytes)
        wait_s = audit.reply_timeout_s(runner.sender_timeout, volume, pace_bytes_s)
        verdicts = await asyncio.gather(*(self._audit_part(runner, j, part, received, wait_s) for part in parts))
        failed = [v for v in verdicts if v is not None]
        return next((v for v in failed if v[0]), failed[0] if failed else None)  # a conviction first

    async def _audit_chunk(
        self,
        runner: ConsistentAllReduceRunner,
        j: int,
        part: int,
        chunk: int,
        received: list[int],
        wait_s: float | None,
    ) -> tuple[bool, str] | None:
        """None if chunk `chunk` of reducer `j`'s part checks, ESCALATE if it does not, (False, why)
        if the reducer did not answer."""
        peer = runner.ordered_peer_ids[j]
        try:
            shown = await self._ask(peer, runner.group_id, part, len(runner.ledger.senders), wait_s, chunk)
        except Exception as e:  # a dead, slow or garbled reducer: the round fails, nobody is convicted
            return False, f"no answer to the audit of part {part}, chunk {chunk} ({type(e).__name__})"
        received.append(sum(message.ByteSize() for message in shown))
        why = chunk_disagreement(runner.ledger, runner.aggregation, j, part, chunk, shown)
        if why is None:
            return None
        logger.info(
            "reducer %s: chunk %d of part %d does not check (%s); auditing the part whole", peer, chunk, part, why
        )
        return ESCALATE

    async def _audit_part(
        self, runner: ConsistentAllReduceRunner, j: int, part: int, received: list[int], wait_s: float | None
    ) -> tuple[bool, str] | None:
        """The verdict on one whole part of reducer `j`'s span, as `_audit_one`'s; `wait_s`: the
        longest wait for the next message of its answer."""
        peer = runner.ordered_peer_ids[j]
        try:
            shown = await self._ask(peer, runner.group_id, part, len(runner.ledger.senders), wait_s)
        except Exception as e:  # a dead, slow or garbled reducer: the round fails, nobody is convicted
            return False, f"no answer to the audit of part {part} ({type(e).__name__})"
        received.append(sum(message.ByteSize() for message in shown))
        return self._judge(runner, j, part, shown)

    async def _ask(
        self,
        peer: Any,
        group_id: bytes,
        part: int,
        senders: int,
        reply_timeout_s: float | None,
        chunk: int | None = WHOLE,
    ) -> list[averaging_pb2.AveragingData]:
        """The reducer's answer, each signed part within `reply_timeout_s` (audit.reply_timeout_s:
        the all-reduce's own wait for a chunk, longer only as far as the answers' volume needs at
        the butterfly's pace): a member that hung after its all-reduce (its answers all sent, a
        laptop gone to sleep) would cost the others the whole all-reduce deadline and then the
        retry's matchmaking (docs/design.md §3, step 7)."""
        asked = b"" if chunk is WHOLE else struct.pack(">I", chunk)
        request = averaging_pb2.AveragingData(group_id=group_id, weight=float(part), peer_id=asked)
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


def chunk_disagreement(
    ledger: Ledger,
    aggregation: tuple[Any, float, float],
    j: int,
    part: int,
    chunk: int,
    shown: list[averaging_pb2.AveragingData],
) -> str | None:
    """Why the chunks reducer `j` showed of `part` do not check against the signed average this
    member holds (a chunk or seal not signed, a chunk not its seal's, or not the combination), or
    None. Not a conviction: the whole part settles it."""
    if len(shown) != len(ledger.senders):
        return f"{len(shown)} chunks for {len(ledger.senders)} senders"
    average = ledger.averages[(j, part)].encoded
    codec, numel = codec_of(average), numel_of(average)
    if codec is None:
        return f"an average encoded as {average.dtype!r}"
    start, end = codecs.chunk_bounds(numel)[chunk]
    pieces, norms = [], []
    for sender, message in zip(ledger.senders, shown):
        checked = _signed_chunk(ledger, j, part, chunk, sender, message, numel)
        if isinstance(checked, str):
            return f"sender {sender}'s: {checked}"
        pieces.append(checked[0])
        norms.append(checked[1])
    answered = codec.decode(codec.piece(average.buffer, numel, start, end), end - start)
    return audit.chunk_disagreement(pieces, [m.weight for m in shown], norms, aggregation, codec, answered)


def _signed_chunk(
    ledger: Ledger, j: int, part: int, chunk: int, sender: str, message: averaging_pb2.AveragingData, numel: int
) -> tuple[Any, float] | str:
    """(the decoded chunk, the norm of its whole part) of what `sender` signed, or why not."""
    try:
        norms, digests, signature = audit.unpack_seal(message.peer_id)
    except wire.WireError as e:
        return str(e)
    bounds = codecs.chunk_bounds(numel)
    seal = audit.Seal(digests, norms)
    statement = audit.part_statement(
        ledger.group_id, ledger.peers[j], part, message.weight, seal.root(), numel, message.tensor_part.dtype
    )
    if len(digests) != len(bounds) or not ledger.keys[sender].verify(statement, signature):
        return "not signed"
    if audit.digest(message.tensor_part.buffer) != digests[chunk] or not all(
        math.isfinite(n) and n >= 0 for n in norms
    ):
        return "not its seal's"
    codec = codec_of(message.tensor_part)
    start, end = bounds[chunk]
    try:
        decoded = codec.decode(message.tensor_part.buffer, end - start) if codec is not None else None
    except ValueError:
        decoded = None
    if decoded is None or malformed(decoded, message.weight, (norms[chunk],)) is not None:
        return "malformed"
    return decoded, seal.norm()
