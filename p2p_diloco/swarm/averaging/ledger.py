"""The signed record of one all-reduce, kept for the audit that follows it (trust/audit.py).

As a sender, a member signs every part it sends; as a reducer, it checks each sender's signature,
keeps every signed part of its span (about one encoded model copy over the group, while the
all-reduce is audited) and signs every average it answers; as a receiver of an average, it checks
the reducer's signature and keeps the signed bytes. A part or an average whose signature does not
verify fails the all-reduce at once: nothing unsigned is ever combined or applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.allreduce import AllreduceException
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.trust import audit


def part_statement(group_id: bytes, reducer: str, part: int, weight: float, encoded: runtime_pb2.Tensor) -> bytes:
    """audit.part_statement of an encoded part: its bytes, its number of values and its codec. A
    size no honest part has (negative, or past 64 bits: a part's header is the sender's word)
    stands as 2**64 - 1, so its statement is still one a liar can sign and be held to."""
    numel = math.prod(encoded.size) if len(encoded.size) else 0
    numel = numel if 0 <= numel < 2**64 else 2**64 - 1
    return audit.part_statement(group_id, reducer, part, weight, encoded.buffer, numel, encoded.dtype)


@dataclass(frozen=True)
class SignedPart:
    """One sender's part of a reducer's span, as the reducer received it."""

    sender: int  # index among the group's senders
    weight: float
    encoded: runtime_pb2.Tensor
    signature: bytes


@dataclass(frozen=True)
class SignedAverage:
    """One average of a reducer's span, as this member received it (or made it, for its own span)."""

    encoded: runtime_pb2.Tensor
    signature: bytes


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

    def sign_part(self, reducer: int, part: int, weight: float, encoded: runtime_pb2.Tensor) -> bytes:
        statement = part_statement(self.group_id, self.peers[reducer], part, weight, encoded)
        return self._signer.sign(statement)

    def accept_part(
        self, reducer: int, sender: int, part: int, weight: float, encoded: runtime_pb2.Tensor, signature: bytes
    ) -> None:
        """Keep a sender's part of this member's span, once its signature verifies."""
        statement = part_statement(self.group_id, self.peers[reducer], part, weight, encoded)
        if not self.keys[self.senders[sender]].verify(statement, signature):
            self.bad_signers.add(self.senders[sender])
            raise AllreduceException(f"sender {self.senders[sender]} sent part {part} without a valid signature")
        self.parts.setdefault(part, {})[sender] = SignedPart(sender, weight, encoded, signature)

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

    def seed(self) -> bytes:
        """The audit's randomness, from every average this member holds (reducer, then part order)."""
        return audit.seed(self.group_id, [audit.digest(self.averages[k].encoded.buffer) for k in sorted(self.averages)])
