"""The signed record of one all-reduce, kept for the audit that follows it (trust/audit.py).

As a sender, a member signs every part it sends (with its chunks' norms: the seal,
trust/audit.py); as a reducer, it checks each sender's signature, keeps every signed part of its
span (about one encoded model copy over the group, while the all-reduce is audited) and signs
every average it answers; as a receiver of an average, it checks the reducer's signature and
keeps the signed bytes. A part or an average whose signature does not
verify fails the all-reduce at once: nothing unsigned is ever combined or applied. Once it holds
every average, a member shows its lot (trust/audit.py) and collects every other member's: the
audit's seed needs them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust import audit, wire


def numel_of(encoded: runtime_pb2.Tensor) -> int:
    """How many values a part's header says it holds. A size no honest part has (negative, or past
    64 bits: the header is the sender's word) stands as 2**64 - 1, so its statement is still one a
    liar can sign and be held to."""
    numel = math.prod(encoded.size) if len(encoded.size) else 0
    return numel if 0 <= numel < 2**64 else 2**64 - 1


def codec_of(encoded: runtime_pb2.Tensor) -> codecs.Codec | None:
    return codecs.get(encoded.dtype) if encoded.dtype in codecs.CODECS else None


def seal_of(encoded: runtime_pb2.Tensor, norms: tuple[float, ...]) -> audit.Seal:
    """The seal of a whole encoded part with these (signed) chunk norms: its digests from its bytes."""
    return audit.Seal(audit.chunk_digests(codec_of(encoded), encoded.buffer, numel_of(encoded)), norms)


def part_statement(
    group_id: bytes, reducer: str, part: int, weight: float, encoded: runtime_pb2.Tensor, norms: tuple[float, ...]
) -> bytes:
    """audit.part_statement of a whole encoded part: its seal, its number of values and its codec."""
    root = seal_of(encoded, norms).root()
    return audit.part_statement(group_id, reducer, part, weight, root, numel_of(encoded), encoded.dtype)


def unsealed(sealed: bytes, signer: str) -> tuple[tuple[float, ...], tuple[bytes, ...], bytes]:
    """audit.unpack_seal of a part message's `peer_id` field; a field that is no seal is a part
    without a valid signature."""
    try:
        return audit.unpack_seal(sealed)
    except wire.WireError as e:
        raise AllreduceException(f"{signer} sent a part without a valid signature ({e})") from None


@dataclass(frozen=True)
class SignedPart:
    """One sender's part of a reducer's span, as the reducer received it."""

    sender: int  # index among the group's senders
    weight: float
    encoded: runtime_pb2.Tensor
    signature: bytes
    seal: audit.Seal  # its chunks' digests and signed norms

    def sealed(self, digests: bool = False) -> bytes:
        """Its signature and norms as they travel (with the chunk digests for the audit of a chunk)."""
        return audit.pack_seal(self.seal.norms, self.seal.digests if digests else (), self.signature)


@dataclass(frozen=True)
class SignedAverage:
    """One average of a reducer's span, as this member received it (or made it, for its own span)."""

    encoded: runtime_pb2.Tensor
    signature: bytes


class Board:
    """What every member of a group shows the others once after its all-reduce (its audit lot, its
    verdicts: swarm/averaging/showings.py), each value kept only once it holds for its member."""

    def __init__(self, peers: list[str], keys: dict[str, RSAPublicKey], holds: Callable[[str, bytes], Any]):
        """`holds(member, value)`: what the value says if it is `member`'s (checked against its
        key), else None."""
        self.peers, self._keys, self._holds = peers, keys, holds
        self.shown: dict[str, bytes] = {}  # member -> the value it showed, as it came
        self.read: dict[str, Any] = {}  # member -> what its value says

    def show(self, member: str, value: bytes, read: Any) -> None:
        self.shown[member], self.read[member] = value, read

    def accept(self, member: str, value: bytes) -> bool:
        """Keep `member`'s value if it is a member and the value holds; whether it was kept."""
        if member not in self.peers or member not in self._keys:
            return False
        read = self._holds(member, value)
        if read is None:
            return False
        self.show(member, value, read)
        return True

    def missing(self) -> list[str]:
        """The members whose value this member does not hold yet."""
        return [p for p in self.peers if p not in self.shown]


class Ledger:
    """Signatures made and checked in one all-reduce, and what they cover."""

    def __init__(
        self,
        group_id: bytes,
        peers: list[str],
        senders: list[str],
        signer: RSAPrivateKey,
        keys: dict[str, RSAPublicKey],
    ):
        """`peers`: the group in reducer order; `senders`: those that send parts; `keys`: every
        member's identity key, checked against its peer id (identity.key_of)."""
        self.group_id, self.peers, self.senders = group_id, peers, senders
        self._signer, self.keys = signer, keys
        self.parts: dict[int, dict[int, SignedPart]] = {}  # part of this member's span -> sender -> its part
        self.averages: dict[tuple[int, int], SignedAverage] = {}  # (reducer index, part) -> its average
        # Members whose part or average came with a signature that does not verify: only a liar or
        # a broken peer sends one (an honest one signs the very bytes it sends). Refused here from
        # then on, without a case others could check.
        self.bad_signers: set[str] = set()
        # Senders whose signed part does not decode or holds non-finite values: sender -> (reducer
        # index, part, the signed message), a case anyone can judge (evidence.judge_sender).
        self.garbage: dict[str, tuple[int, int, Any]] = {}
        # Senders whose signed part is well-formed but not the size of the part this member reduces:
        # only this member knows the span layout it computed, so no case others could judge;
        # refused here from then on, like a bad signer.
        self.misfits: set[str] = set()
        # Each sender's weight as it showed it in the all-gather (a two-level round's group weight
        # is made of them): a part of another weight is refused (`accept_part`).
        self.shown_weights: dict[str, float] = {}
        self.lots = Board(peers, keys, self._lot_holds)  # every member's lot in this group's audit
        self.verdicts = Board(peers, keys, self._verdicts_hold)  # every member's verdicts on the items it checked

    def sign_part(
        self, reducer: int, part: int, weight: float, encoded: runtime_pb2.Tensor, decoded: torch.Tensor
    ) -> bytes:
        """The seal of a part this member sends, signed (audit.pack_seal): `decoded`, what its bytes decode to."""
        norms = audit.chunk_norms(decoded)
        signature = self._signer.sign(part_statement(self.group_id, self.peers[reducer], part, weight, encoded, norms))
        return audit.pack_seal(norms, (), signature)

    def accept_part(
        self, reducer: int, sender: int, part: int, weight: float, encoded: runtime_pb2.Tensor, sealed: bytes
    ) -> SignedPart:
        """Keep a sender's part of this member's span, once its signature verifies and its weight is
        the one its sender showed in the all-gather (else the all-reduce fails: the shown weight
        came through the leader, so nobody is convicted). Its norms are not checked here (the
        caller decodes it: audit.misnormed)."""
        signer = self.senders[sender]
        try:
            norms, _, signature = unsealed(sealed, signer)
        except AllreduceException:
            self.bad_signers.add(signer)
            raise
        seal = seal_of(encoded, norms)
        statement = audit.part_statement(
            self.group_id, self.peers[reducer], part, weight, seal.root(), numel_of(encoded), encoded.dtype
        )
        if not self.keys[signer].verify(statement, signature):
            self.bad_signers.add(signer)
            raise AllreduceException(f"sender {signer} sent part {part} without a valid signature")
        shown = self.shown_weights.get(signer, weight)
        if weight != shown:
            why = f"weight {weight:g}, not the {shown:g} it showed in the all-gather"
            raise AllreduceException(f"sender {signer} signed part {part} with {why}")
        signed = self.parts.setdefault(part, {})[sender] = SignedPart(sender, weight, encoded, signature, seal)
        return signed

    def sign_average(self, reducer: int, part: int, encoded: runtime_pb2.Tensor) -> bytes:
        signature = self._signer.sign(audit.output_statement(self.group_id, self.peers[reducer], part, encoded.buffer))
        self.averages[(reducer, part)] = SignedAverage(encoded, signature)
        return signature

    def accept_average(self, reducer: int, part: int, encoded: runtime_pb2.Tensor, signature: bytes) -> None:
        """Keep a reducer's average, once its signature verifies."""
        statement = audit.output_statement(self.group_id, self.peers[reducer], part, encoded.buffer)
        if not self.keys[self.peers[reducer]].verify(statement, signature):
            self.bad_signers.add(self.peers[reducer])
            raise AllreduceException(f"reducer {self.peers[reducer]} answered part {part} without a valid signature")
        self.averages[(reducer, part)] = SignedAverage(encoded, signature)

    def own_lot(self, me: str) -> bytes:
        """This member's lot (identity.draw_lot; `me`: its peer id): show it only once this member
        holds every average."""
        if me not in self.lots.shown:
            self.lots.show(me, identity.draw_lot(self._signer, audit.lot_statement(self.group_id)), True)
        return self.lots.shown[me]

    def own_verdicts(self, me: str, verdicts: dict[audit.Item, int]) -> bytes:
        """This member's verdicts on the items it checked, signed (audit.pack_verdicts)."""
        if me not in self.verdicts.shown:
            packed = audit.pack_verdicts(verdicts)
            signature = self._signer.sign(audit.verdict_statement(self.group_id, me, packed))
            self.verdicts.show(me, packed + signature, dict(verdicts))
        return self.verdicts.shown[me]

    def _lot_holds(self, member: str, lot: bytes) -> bool | None:
        return identity.lot_holds(self.keys[member], audit.lot_statement(self.group_id), lot) or None

    def _verdicts_hold(self, member: str, raw: bytes) -> dict[audit.Item, int] | None:
        try:
            verdicts, packed, signature = audit.unpack_verdicts(raw)
        except wire.WireError:
            return None
        return (
            verdicts
            if self.keys[member].verify(audit.verdict_statement(self.group_id, member, packed), signature)
            else None
        )

    def seed(self) -> bytes:
        """The audit's randomness, from every average this member holds (reducer, then part order)
        and every member's lot (member order); all of them must be here."""
        if missing := self.lots.missing():
            raise AllreduceException(f"no audit lot from {', '.join(missing)}")
        outputs = [audit.digest(self.averages[k].encoded.buffer) for k in sorted(self.averages)]
        return audit.seed(self.group_id, outputs, [self.lots.shown[p] for p in self.peers])
