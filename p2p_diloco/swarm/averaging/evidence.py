"""What a conviction rests on, and how it reaches peers outside the group (docs/design.md §6).

A `Case` is one reducer's part as the audit saw it: every sender's signed part and the reducer's
signed average, with the group's ids and identity keys. Everything in it is signed, so anyone
can judge it again (`judge`) and nobody can make one against an honest reducer.

A member that convicts a reducer keeps the case and publishes the reducer's id in the DHT, under
its own key, with its progress (records.publish_progress). Another peer that reads the accusation asks the
accuser for the case (`rpc_evidence`), judges it, and convicts the reducer too only if the case
holds: an accusation without a valid case convicts nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.crypto import RSAPublicKey

from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.allreduce import WireCodec, check_part, malformed
from p2p_diloco.swarm.averaging.ledger import part_statement
from p2p_diloco.swarm.transport import identity, streams
from p2p_diloco.trust import audit, robust, wire

logger = get_logger(__name__)

EVIDENCE_TIMEOUT_S = 30.0
MAX_GROUP = 256  # members a case may name


@dataclass(frozen=True)
class Case:
    """One reducer's part as the audit saw it; every piece signed by its author."""

    group_id: bytes
    peers: list[str]  # the group, in reducer order
    senders: list[str]
    keys: dict[str, RSAPublicKey]
    reducer: int  # index in `peers`
    part: int
    shown: list[averaging_pb2.AveragingData]  # each sender's part: bytes, weight, signature
    answer: runtime_pb2.Tensor  # the reducer's average of that part
    answer_signature: bytes
    sender: int | None = None  # a case against this sender (index in `senders`): `shown` is its one signed part


def sender_case(ledger: Any, sender: str) -> Case:
    """The case against a sender that signed a malformed part (ledger.garbage), for anyone to judge."""
    reducer, part, message = ledger.garbage[sender]
    empty = runtime_pb2.Tensor()
    return Case(
        ledger.group_id,
        ledger.peers,
        ledger.senders,
        ledger.keys,
        reducer,
        part,
        [message],
        empty,
        b"",
        ledger.senders.index(sender),
    )


def judge(case: Case, codec: WireCodec, aggregation: tuple[robust.Aggregator, float, float]) -> tuple[bool, str] | None:
    """None if the reducer's average is the combination of the signed parts; otherwise (forged,
    why): `forged` when a part shown is not signed by its sender (the reducer's doing in an audit,
    but proof of nothing in someone else's case), else the average is wrong. A case against a
    sender holds if the part it signed does not decode or holds non-finite values."""
    if case.sender is not None:
        return _judge_sender(case, codec)
    if len(case.shown) != len(case.senders):
        return True, f"showed {len(case.shown)} parts of part {case.part} for {len(case.senders)} senders"
    answered = codec.extract(case.answer)
    parts: list[torch.Tensor] = []
    for sender, message in enumerate(case.shown):
        norms = signed_norms(case, case.senders[sender], message)
        if norms is None:
            return True, f"showed a part {case.part} that sender {case.senders[sender]} did not sign"
        try:
            parts.append(codec.extract(message.tensor_part))
            check_part(parts[-1], answered, case.senders[sender])
        except AllreduceException as e:  # signed garbage: the reducer should have refused it
            return False, f"combined a malformed part {case.part} ({e})"
        if (why := audit.misnormed(norms, parts[-1])) is not None:
            return False, f"combined a malformed part {case.part} ({why})"
    weights = [m.weight for m in case.shown]
    reason = audit.disagreement(parts, weights, aggregation, codecs.get(case.answer.dtype), answered)
    return None if reason is None else (False, f"part {case.part}: {reason}")


def signed_norms(case: Case, sender: str, message: averaging_pb2.AveragingData) -> tuple[float, ...] | None:
    """The chunk norms `sender` signed with the whole part in `message` (its seal in `peer_id`), or
    None if it did not sign that part."""
    try:
        norms, _, signature = audit.unpack_seal(message.peer_id)
    except wire.WireError:
        return None
    statement = part_statement(
        case.group_id, case.peers[case.reducer], case.part, message.weight, message.tensor_part, norms
    )
    return norms if case.keys[sender].verify(statement, signature) else None


def _judge_sender(case: Case, codec: WireCodec) -> tuple[bool, str] | None:
    assert case.sender is not None
    sender, message = case.senders[case.sender], case.shown[0]
    norms = signed_norms(case, sender, message)
    if norms is None:
        return True, f"a part {case.part} that sender {sender} did not sign"
    try:
        decoded: torch.Tensor | AllreduceException = codec.extract(message.tensor_part)
    except AllreduceException as e:
        decoded = e
    why = malformed(decoded, message.weight, norms)
    if why == "non-finite values":
        return False, f"signed a part {case.part} with non-finite values"
    return None if why is None else (False, f"signed a malformed part {case.part} ({why})")


class EvidenceDesk:
    """The cases behind this member's convictions (`cases`, filed by the auditor), served to peers
    that read its accusations, and the judging of other peers' cases. Held by DiLoCoAverager, whose
    `rpc_evidence` hands each request to `answer`."""

    def __init__(
        self,
        stub: Callable[[PeerID], Any],
        serializer: Any,
        codec: WireCodec,
        aggregation: tuple[robust.Aggregator, float, float],
    ):
        """`stub(peer)`: the averager's RPC stub for `peer`; `codec` and `aggregation`: how this
        run encodes and combines parts, by which every case is judged."""
        self._stub, self._serializer = stub, serializer
        self._codec, self._aggregation = codec, aggregation
        self.cases: dict[str, Case] = {}  # convicted member -> the case

    def file(self, peer: str, case: Case) -> None:
        """Keep the case behind a conviction of `peer`, for peers outside the group."""
        self.cases[peer] = case

    async def answer(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncGenerator[averaging_pb2.AveragingData, None]:
        """The case behind this peer's conviction of the member named in `peer_id`: a header
        (group, part, ids, keys), every signed part shown, then the signed average (the only
        message with code AVERAGED_PART). Ends once the asker holds it all (swarm/transport/streams.py)."""
        request = await streams.first_request(requests)
        case = None if request is None else self.cases.get(request.peer_id.decode(errors="replace"))
        if case is None:
            return
        async for message in self._serve_case(case):
            yield message
        await streams.linger(requests)

    async def _serve_case(self, case: Case) -> AsyncIterator[averaging_pb2.AveragingData]:
        header = {
            "peers": case.peers,
            "senders": case.senders,
            "keys": {p: k.to_bytes() for p, k in case.keys.items()},
            "reducer": case.reducer,
            "sender": -1 if case.sender is None else case.sender,
        }
        yield averaging_pb2.AveragingData(
            group_id=case.group_id, weight=float(case.part), peer_id=self._serializer.dumps(header)
        )
        for message in case.shown:  # as signed; the code is ours (a sender's own could end the case early)
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING,
                tensor_part=message.tensor_part,
                weight=message.weight,
                peer_id=message.peer_id,
            )
        yield averaging_pb2.AveragingData(
            code=averaging_pb2.AVERAGED_PART, tensor_part=case.answer, peer_id=case.answer_signature
        )

    async def verdict(self, accuser: str, accused: str) -> tuple[bool, str] | None:
        """Ask `accuser` for its case against `accused` and judge it (`judge`'s verdict). None, as
        for an innocent, if the accuser does not answer or answers no valid case: an accusation
        without a case convicts nobody."""
        try:
            request = averaging_pb2.AveragingData(peer_id=accused.encode())
            rpc = self._stub(PeerID.from_base58(accuser)).rpc_evidence
            asked = streams.ask(rpc, request, _case_complete, MAX_GROUP + 2, EVIDENCE_TIMEOUT_S)
            messages = await asyncio.wait_for(asked, EVIDENCE_TIMEOUT_S)
            case = self._case_from(accused, messages)
            return judge(case, self._codec, self._aggregation) if case else None
        except Exception as e:  # an accuser that does not answer, or answers garbage, convicts nobody
            logger.info("no valid case from %s against %s: %s", accuser, accused, type(e).__name__)
            return None

    def _case_from(self, accused: str, messages: list[averaging_pb2.AveragingData]) -> Case | None:
        """The case in an accuser's messages, if it is well-formed and the average is the accused's."""
        try:
            return case_from(accused, messages, self._serializer.loads)
        except wire.WireError as e:
            wire.dropped("case", str(e))
            return None


def case_from(accused: str, messages: list[averaging_pb2.AveragingData], loads: Callable[[bytes], Any]) -> Case | None:
    """The case an accuser served (untrusted: its header through trust/wire.py, WireError if malformed),
    or None if it is no case against `accused`: a part the accused did not sign, an id without
    its key."""
    if len(messages) < 3:
        return None
    header = wire.mapping(loads(messages[0].peer_id), "case header")
    peers = list(wire.field(header, "peers", lambda v: wire.items(v, MAX_GROUP, wire.peer_id)))
    senders = list(wire.field(header, "senders", lambda v: wire.items(v, MAX_GROUP, wire.peer_id)))
    raw_keys = wire.field(header, "keys", lambda v: _key_bytes(v, len(peers) + len(senders)))
    shown = {p: identity.key_of(p, raw_keys.get(p)) for p in set(peers) | set(senders)}
    keys = {p: k for p, k in shown.items() if k is not None}
    if accused not in peers or len(keys) != len(shown):
        return None
    part = _part_index(messages[0].weight)
    sender = wire.field(header, "sender", lambda v: wire.integer(v, -1, MAX_GROUP), -1)
    answer, group = messages[-1], messages[0].group_id
    if sender >= 0:  # against a sender: its one signed part
        reducer = wire.field(header, "reducer", lambda v: wire.integer(v, 0, len(peers) - 1))
        valid = sender < len(senders) and senders[sender] == accused and len(messages) == 3
        parts, signature, against = messages[1:2], b"", sender
    else:  # against a reducer: every sender's part, then its signed average
        reducer = peers.index(accused)
        statement = audit.output_statement(group, accused, part, answer.tensor_part.buffer)
        valid = keys[accused].verify(statement, answer.peer_id)  # else not the accused's average
        parts, signature, against = messages[1:-1], answer.peer_id, None
    if not valid:
        return None
    return Case(group, peers, senders, keys, reducer, part, parts, answer.tensor_part, signature, against)


def _part_index(weight: float) -> int:
    """The part a case is about: it travels as the header's weight, a whole number."""
    number = wire.real(weight, 0.0, 2.0**32)
    if number != int(number):
        raise wire.WireError("a part index that is no whole number")
    return int(number)


def _key_bytes(value: Any, max_n: int) -> dict[str, bytes]:
    """{peer id: its public key's bytes} as a case names them (identity.key_of checks each)."""
    keys = wire.mapping(value, "case keys")
    if len(keys) > max_n:
        raise wire.WireError(f"a case naming {len(keys)} keys for {max_n} members")
    out = {}
    for peer, key in keys.items():
        if not isinstance(key, bytes) or len(key) > 4096:
            raise wire.WireError("a case key that is no bytes of at most 4096")
        out[wire.peer_id(peer)] = key
    return out


def _case_complete(messages: list[averaging_pb2.AveragingData]) -> bool:
    """A case ends with its signed average, the one message after the header coded AVERAGED_PART."""
    return len(messages) >= 2 and messages[-1].code == averaging_pb2.AVERAGED_PART
