"""One member's checks of one reducer's audited items (trust/audit.py; auditor.py runs them).

For each item (a chunk, or a whole part where the aggregator is not chunk-local) the member asks
the reducer for every sender's signed chunk or part, checks the senders' signatures and seals,
recomputes the combination and compares it with the signed average it received. A chunk that does
not check is settled on its whole part (`audit.disagreement`): aligned-clip may have dropped a part,
which only the whole part shows. A conviction rests on what is signed only; its case is filed with
the evidence desk for peers outside the group (evidence.py).
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Callable
from typing import Any

from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner, malformed
from p2p_diloco.swarm.averaging.evidence import Case, EvidenceDesk, judge
from p2p_diloco.swarm.averaging.ledger import Ledger, codec_of, numel_of
from p2p_diloco.swarm.transport import streams
from p2p_diloco.trust import audit, wire

logger = get_logger(__name__)

WHOLE = None  # an audit request for whole parts, not a chunk
ESCALATE = (False, "")  # a chunk that did not check: the whole part settles it
CHUNK_ANSWER_BYTES = 4 * codecs.CHUNK_VALUES + 2048  # one sender's chunk and seal in an audit's answer, at most
Found = dict[audit.Item, tuple[int, str]]  # item -> (audit.PASS, DOUBT or SILENT, why)


class Inspector:
    """Runs this member's checks of a reducer's items."""

    def __init__(self, stub: Callable[[Any], Any], evidence: EvidenceDesk):
        """`stub(peer)`: the averager's RPC stub for `peer`; `evidence`: where the case behind
        each conviction is filed."""
        self._stub, self._evidence = stub, evidence

    async def check(
        self,
        runner: ConsistentAllReduceRunner,
        j: int,
        items: list[audit.Item],
        checks: int,
        received: list[int],
        pace_bytes_s: float,
    ) -> Found:
        """Check reducer `j`'s `items` (chunks first, then whole the parts of those that did not
        check): each item's outcome (audit.PASS; DOUBT: its part convicts; SILENT: no answer) and
        why. `checks`: how many asks for an item the reducer answers in all (its answers' volume:
        audit.reply_timeout_s); the size of each answer goes to `received`."""
        senders, members = len(runner.ledger.senders), len(runner.ledger.peers)
        wait_s = audit.reply_timeout_s(
            runner.sender_timeout, audit.answers_bytes(checks, senders, CHUNK_ANSWER_BYTES), pace_bytes_s
        )
        chunks = [i for i in items if i[2] != audit.WHOLE_PART]
        results = await asyncio.gather(*(self._audit_chunk(runner, j, p, c, received, wait_s) for _, p, c in chunks))
        found: Found = {
            item: (audit.PASS, "") if v is None else (audit.SILENT, v[1])
            for item, v in zip(chunks, results)
            if v is not ESCALATE
        }
        wholes = {i[1] for i in items if i[2] == audit.WHOLE_PART}
        parts = sorted(wholes | {i[1] for i, v in zip(chunks, results) if v is ESCALATE})
        volume = audit.answers_bytes((members - 1) * len(parts), senders, runner.tensor_part_container.part_size_bytes)
        wait_s = audit.reply_timeout_s(runner.sender_timeout, volume, pace_bytes_s)
        verdicts = await asyncio.gather(*(self._audit_part(runner, j, part, received, wait_s) for part in parts))
        whole = dict(zip(parts, verdicts))
        for item in items:
            if item not in found:
                v = whole[item[1]]
                found[item] = (audit.PASS, "") if v is None else ((audit.DOUBT if v[0] else audit.SILENT), v[1])
        return found

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
        """The verdict on one whole part of reducer `j`'s span, as `_judge`'s; `wait_s`: the
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
        """The audit's verdict on one part of reducer `j`: None if it checks, (True, why) if it
        convicts, (False, why) if the answer was short. A conviction only on what is signed; its
        case is kept for peers outside the group (swarm/averaging/evidence.py)."""
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
