"""Pure: reducer accountability, the checks behind the audit after every all-reduce.

A reducer answers every sender with one combination of the group's parts of its span
(robust.aggregate). A lying reducer (its span's average × 100, or random values) would otherwise
move every honest peer's θ at will, since all members apply the same bytes (I1). So:

1. **Commitments.** Every part a sender sends carries the sender's signature over
   `part_statement(group, reducer, part index, weight, seal root, size, codec)`, where the seal
   (`Seal`) is the digest and the norm of each CHUNK_VALUES-value chunk of the part; every average a
   reducer answers carries the reducer's signature over `output_statement(group, reducer, part
   index, bytes)`. The keys are the peers' libp2p identity keys, bound to their peer ids
   (swarm/transport/identity.py), so a statement is evidence anyone can check, and nobody can sign
   for someone else. A reducer refuses a part whose signed norms are not its chunks' (`misnormed`):
   the sender signed a malformed part, a case against it.
2. **The check's randomness comes after, from every member.** Every member's *lot* is its unique
   signature over `lot_statement(group)` (RSA PKCS#1 v1.5: one valid signature per key and
   statement, so no member can choose its lot, and nobody can compute another's). A member shows
   its lot only once it holds every average of the group, and the audit `seed` hashes the group
   id, every average it received and every member's lot. So no reducer knows, when it answers a
   member, which of its chunks that member will check: the hashes of the averages alone would let
   a reducer that answers last (it receives the others' averages as a member) try variants of its
   last average until the seed spared the values it lied on. No reducer can change an answer after.
3. **The audit.** For each other reducer, every member asks it for every sender's signed chunk of
   AUDIT_CHUNKS chunks of its span (`audited_chunks`), each with the sender's seal, checks the
   signatures and the chunks against the seals, recomputes the combination of the chunks
   (`chunk_disagreement`: the clip scales from the signed norms, so every aggregator but
   centered-clip is chunk-local) and compares it with the same chunk of the signed average it
   received. A chunk that does not check is no proof yet (aligned-clip may have dropped a part,
   which only the whole part shows): the member then asks for every sender's whole part and
   judges that (`disagreement`), as it does for centered-clip's parts. Every honest member checks
   the same chunks with the same data, so all reach the same verdict.

A reducer whose answer is not the combination of the signed parts is convicted: the round's
average is discarded (I2), and the members refuse it for the rest of the run. A sender cannot
frame a reducer: the reducer shows the sender's own signature over what it sent. A reducer that
does not answer the audit fails the round only (it may be slow, not lying).

Recomputing on another machine may round differently (torch's reductions differ between CPU
kernels), so the comparison allows `TOLERANCE` of the average's norm, after the codec: a liar can
bias its span by at most that much per round, the size of the codec's own rounding.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.protocol import codecs
from p2p_diloco.trust import robust, wire

TOLERANCE = 0.01  # of the recomputed average's norm (after the codec)
AUDIT_BYTES = 2 * 1024 * 1024  # of each reducer's parts checked whole, where a whole part is audited
AUDIT_CHUNKS = 4  # chunks of each reducer's span every member checks per all-reduce
NORM_TOLERANCE = 1e-6  # a signed chunk norm against the one recomputed (float64 sums in another order)
CHUNK_AUDITABLE = ("mean", "clip", "aligned-clip", "trimmed-mean")  # centered-clip needs whole parts
MAX_CHUNKS = 1 << 16  # a seal's chunks: 1 Gi values in a part, far past any part size
_PART = b"p2p-diloco/part/v1"
_OUTPUT = b"p2p-diloco/average/v1"


def digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def _framed(*fields: bytes) -> bytes:
    """Fields with their lengths, so that no two field lists give the same bytes."""
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


@dataclass(frozen=True)
class Seal:
    """What a sender signs of a part's bytes: each chunk's digest (of its piece, codecs.Codec.piece)
    and the norm of its decoded values. A member holding one chunk checks it against its digest;
    the norms give the part's norm (clip's scale) without the part."""

    digests: tuple[bytes, ...]
    norms: tuple[float, ...]

    def root(self) -> bytes:
        return digest(_framed(b"seal", *self.digests, struct.pack(f">{len(self.norms)}d", *self.norms)))

    def norm(self) -> float:
        """The part's norm, as every member computes it from the signed chunk norms (bit for bit)."""
        return math.sqrt(math.fsum(n * n for n in self.norms))


def chunk_digests(codec: codecs.Codec | None, payload: bytes, numel: int) -> tuple[bytes, ...]:
    """The digest of each chunk's piece of `payload`; bytes that are no encoding of `numel` values
    in `codec` (a liar's; None: a codec this run does not know) count as one chunk, so that what
    they are is still a statement its signer is held to."""
    if codec is None or numel <= 0 or len(payload) != codec.encoded_size(numel):
        return (digest(payload),)
    return tuple(digest(codec.piece(payload, numel, s, e)) for s, e in codecs.chunk_bounds(numel))


def chunk_norms(decoded: torch.Tensor) -> tuple[float, ...]:
    """The norm of each chunk of a decoded part, in float64."""
    flat = decoded.reshape(-1).double()
    whole = flat.numel() // codecs.CHUNK_VALUES * codecs.CHUNK_VALUES
    norms = flat[:whole].view(-1, codecs.CHUNK_VALUES).norm(dim=1).tolist()
    return tuple(norms + ([float(flat[whole:].norm())] if whole < flat.numel() else []))


def misnormed(signed: Sequence[float], decoded: torch.Tensor) -> str | None:
    """Why the signed chunk norms are not those of `decoded` (its sender signed a malformed part),
    or None: as many as its chunks, each within NORM_TOLERANCE."""
    actual = chunk_norms(decoded)
    if len(signed) != len(actual):
        return f"{len(signed)} chunk norms for {len(actual)} chunks"
    for i, (claimed, norm) in enumerate(zip(signed, actual)):
        if not abs(claimed - norm) <= NORM_TOLERANCE * max(norm, 1e-30):  # a NaN fails too
            return f"chunk {i} signed with norm {claimed:.6g}, its values' is {norm:.6g}"
    return None


def pack_seal(norms: Sequence[float], digests: Sequence[bytes], signature: bytes) -> bytes:
    """A part's signature with its chunk norms, and where a member needs them (the audit's
    chunks) its chunk digests, as one field of a part message."""
    return b"".join(
        (struct.pack(f">H{len(norms)}d", len(norms), *norms), struct.pack(">H", len(digests)), *digests, signature)
    )


def unpack_seal(raw: bytes) -> tuple[tuple[float, ...], tuple[bytes, ...], bytes]:
    """(norms, digests, signature) of a `pack_seal` field from another node (untrusted): WireError
    if it is not one."""
    n = _count(raw, 0)
    at = 2 + 8 * n
    norms = struct.unpack(f">{n}d", raw[2:at])
    m = _count(raw, at)
    end = at + 2 + 32 * m
    if len(raw) < end:
        raise wire.WireError(f"a seal of {len(raw)} bytes cannot hold {m} digests")
    digests = tuple(raw[i : i + 32] for i in range(at + 2, end, 32))
    return norms, digests, raw[end:]


def _count(raw: bytes, at: int) -> int:
    if len(raw) < at + 2:
        raise wire.WireError("a seal cut short")
    n = struct.unpack(">H", raw[at : at + 2])[0]
    if len(raw) < at + 2 + 8 * n:
        raise wire.WireError(f"a seal of {len(raw)} bytes cannot hold {n} norms")
    return n


def part_statement(
    group_id: bytes, reducer: str, part: int, weight: float, root: bytes, numel: int = 0, codec: str = ""
) -> bytes:
    """What a sender signs for one part it sends: which group, to whom, which part, its weight, its
    bytes and norms (`Seal.root`), and how they decode (how many values, which codec), so nobody
    can make honest bytes look malformed by telling another size or codec."""
    return _framed(_PART, group_id, reducer.encode(), struct.pack(">QdQ", part, weight, numel), codec.encode(), root)


def output_statement(group_id: bytes, reducer: str, part: int, payload: bytes) -> bytes:
    """What a reducer signs for one average it answers."""
    return _framed(_OUTPUT, group_id, reducer.encode(), struct.pack(">Q", part), digest(payload))


def lot_statement(group_id: bytes) -> bytes:
    """What a member signs, with a signature unique to its key, for its lot in the group's audit."""
    return _framed(b"p2p-diloco/audit-lot/v1", group_id)


def seed(group_id: bytes, output_digests: Sequence[bytes], lots: Sequence[bytes]) -> bytes:
    """The audit's randomness: fixed only once every average of the group is (in reducer, part
    order) and every member has shown its lot (in member order), which it does only once it holds
    every average."""
    return digest(_framed(b"p2p-diloco/audit/v2", group_id, *output_digests, b"lots", *lots))


def audited_parts(audit_seed: bytes, reducer: str, num_parts: int, count: int = 1) -> list[int]:
    """Which of `reducer`'s parts every member checks (num_parts > 0): `count` of them (all when
    count >= num_parts), chosen by the seed, in increasing order."""
    value = int.from_bytes(digest(audit_seed + reducer.encode())[:8], "big")
    count = max(1, min(count, num_parts))
    return sorted((value + i * num_parts // count) % num_parts for i in range(count))


def audited_chunks(
    audit_seed: bytes, reducer: str, part_sizes: Sequence[int], count: int = AUDIT_CHUNKS
) -> list[tuple[int, int]]:
    """Which chunks of `reducer`'s span every member checks: (part, chunk) pairs, in order. All of
    them when the span has no more than `count` chunks (`part_sizes`: the values of each of its
    parts, cut by codecs.chunk_bounds); else one chunk from each of `count` runs of neighbouring
    chunks (equal in number, within one), each drawn by its own hash of the seed, with a chance in
    proportion to its values: a small model's parts are one full chunk and a short tail each
    (16,666 values: 16,384 + 282), and picks by chunk index fell on tails half the time.

    The draws are independent. Before, the picks were `count` values evenly spaced from one drawn
    offset: a lie repeated with that spacing (on every other stretch of span / count values, say)
    then escaped whenever the offset did, with probability 1 - q for a lie on a fraction q, not
    (1 - q)^count. Now a lie on a fraction q_i of run i escapes with probability the product of the
    (1 - q_i): at most (1 - q)^count where the runs hold equal values."""
    bounds = [(part, start, end) for part, size in enumerate(part_sizes) for start, end in codecs.chunk_bounds(size)]
    if len(bounds) <= count:
        return [(part, codecs.chunk_index(start)) for part, start, _ in bounds]
    runs = [range(i * len(bounds) // count, (i + 1) * len(bounds) // count) for i in range(count)]
    picked: list[tuple[int, int]] = []
    for i, run in enumerate(runs):
        ends = list(itertools.accumulate(bounds[c][2] - bounds[c][1] for c in run))
        drawn = digest(audit_seed + b"chunks" + struct.pack(">I", i) + reducer.encode())
        value = int.from_bytes(drawn[:8], "big") % ends[-1]
        part, start, _ = bounds[run[bisect.bisect_right(ends, value)]]
        picked.append((part, codecs.chunk_index(start)))
    return picked


CHECKERS = 2  # members that check each audited chunk (or part) of a reducer; the others take their verdicts
PASS, DOUBT, SILENT = (
    0,
    1,
    2,
)  # a checker's verdict on one item: it checks; it does not (or the part convicts); no answer
WHOLE_PART = 0xFFFFFFFF  # an item's chunk field where the item is a whole part
_VERDICT = struct.Struct(">HIIB")  # reducer index, part, chunk (WHOLE_PART), outcome
Item = tuple[int, int, int]  # (reducer index, part, chunk or WHOLE_PART): one audited piece of a reducer's span


def checkers(audit_seed: bytes, reducer: str, reducer_index: int, members: int, items: int) -> list[tuple[int, ...]]:
    """Which members (indices in the group) check each of a reducer's `items` audited items: the
    reducer's CHECKERS * items checks dealt in turn to the other members from an offset drawn by
    the seed, CHECKERS different members an item; every other member checks every item where there
    are no more than CHECKERS of them. Each member then checks about CHECKERS * items of the
    group's items in all, whatever its size (every member checked every item before: k - 1 times
    the items at k members), and a lie escapes only where every checker of its item lies with it."""
    others = [m for m in range(members) if m != reducer_index]
    if len(others) <= CHECKERS:
        return [tuple(others)] * items
    drawn = digest(audit_seed + b"checkers" + reducer.encode())
    offset = int.from_bytes(drawn[:8], "big") % len(others)
    return [
        tuple(sorted(others[(offset + CHECKERS * i + c) % len(others)] for c in range(CHECKERS))) for i in range(items)
    ]


def verdict_statement(group_id: bytes, member: str, packed: bytes) -> bytes:
    """What a member signs of its verdicts (`pack_verdicts`) in a group's audit."""
    return _framed(b"p2p-diloco/audit-verdicts/v1", group_id, member.encode(), packed)


def pack_verdicts(verdicts: dict[Item, int]) -> bytes:
    """A member's verdicts on the items it checked, in item order, as one field."""
    ordered = sorted(verdicts.items())
    return struct.pack(">H", len(ordered)) + b"".join(_VERDICT.pack(*item, outcome) for item, outcome in ordered)


def unpack_verdicts(raw: bytes) -> tuple[dict[Item, int], bytes, bytes]:
    """(verdicts, their packed bytes, the rest: the signature) of a signed verdicts field from
    another node (untrusted): WireError if it is not one."""
    if len(raw) < 2:
        raise wire.WireError("verdicts cut short")
    n = struct.unpack(">H", raw[:2])[0]
    end = 2 + n * _VERDICT.size
    if len(raw) < end:
        raise wire.WireError(f"a verdicts field of {len(raw)} bytes cannot hold {n} verdicts")
    verdicts: dict[Item, int] = {}
    for at in range(2, end, _VERDICT.size):
        j, part, chunk, outcome = _VERDICT.unpack(raw[at : at + _VERDICT.size])
        if outcome not in (PASS, DOUBT, SILENT) or (j, part, chunk) in verdicts:
            raise wire.WireError(f"a verdict {outcome} on ({j}, {part}, {chunk}): unknown or repeated")
        verdicts[(j, part, chunk)] = outcome
    return verdicts, raw[:end], raw[end:]


def unvouched(plan: dict[Item, tuple[int, ...]], me: int, verdicts: dict[int, dict[Item, int]]) -> list[Item]:
    """The items this member (index `me`) must check itself after the verdicts came (`plan`: each
    item's checkers; `verdicts`: member index -> its verdicts): those it did not check already
    and that some checker did not vouch for (a doubt, no answer from the reducer, or no word at
    all on it). A lie then escapes this member only where every checker of its item vouched for it."""
    return [
        item
        for item, who in sorted(plan.items())
        if me not in who and any(verdicts.get(m, {}).get(item) != PASS for m in who)
    ]


def parts_to_audit(part_bytes: int, budget_bytes: int = AUDIT_BYTES) -> int:
    """How many of a reducer's parts each audit checks: as many as fit `budget_bytes`, at least one.
    A big model's 2 MiB parts: one, a fraction q of a liar's parts caught with probability q per
    round. A small model cut into small parts (links.part_bytes): its whole span, as when it was one
    part."""
    return max(1, budget_bytes // max(1, part_bytes))


LOT_SPREAD = 0.5  # a member may hold every average this share of the butterfly after another
LOT_FLOOR_S = 30.0  # the lots' wait where the all-reduce has no wait for a chunk
AUDIT_MARGIN = 3.0  # the audit's wait: this many times what its answers take at the butterfly's pace


def reply_timeout_s(chunk_timeout_s: float | None, answers_bytes: int, pace_bytes_s: float) -> float | None:
    """How long an auditor waits for the next message of a reducer's answer. The reducer answers
    every auditor of its group at once, `answers_bytes` in all, through its own upload; one stream's
    next message may wait for most of the others. So: AUDIT_MARGIN times that volume at the pace the
    group's butterfly just moved (this member's bytes received over its butterfly time: the
    lockstep moves at the slowest member's pace), never under the all-reduce's wait for a chunk
    (`chunk_timeout_s`). At 10 Mbit/s up, 4 members and 10 MB of fp32, the reducer's answers take
    22.5 MB (~20 s): a fixed 15 s wait failed 1 all-reduce in 6 (bench/allreduce.py). No chunk
    wait (None): no wait limit, as the all-reduce's."""
    if chunk_timeout_s is None or pace_bytes_s <= 0 or answers_bytes <= 0:
        return chunk_timeout_s
    return max(chunk_timeout_s, AUDIT_MARGIN * answers_bytes / pace_bytes_s)


def lot_wait_s(chunk_timeout_s: float | None, butterfly_s: float) -> float:
    """How long a member waits for every member's lot once it holds every average: the others may
    still be receiving their last averages, up to LOT_SPREAD of this member's butterfly later
    (measured: 1.3-4.2 s apart on 12-16 s butterflies, docs/benchmarks.md), and never under the
    all-reduce's wait for a chunk (LOT_FLOOR_S where it has none)."""
    return max(_floor(chunk_timeout_s), LOT_SPREAD * max(butterfly_s, 0.0))


def _floor(chunk_timeout_s: float | None) -> float:
    """The shortest wait for what every member shows: the all-reduce's wait for a chunk, or
    LOT_FLOOR_S where it has none."""
    return LOT_FLOOR_S if chunk_timeout_s is None else chunk_timeout_s


def verdict_wait_s(chunk_timeout_s: float | None, checks_s: float) -> float:
    """How long a member waits for every member's verdicts once its own checks are done (in
    `checks_s`): the others started theirs within a round trip of this member (the lots come to
    all at once) but may check more items or over a slower link, up to AUDIT_MARGIN times as
    long; never under the all-reduce's wait for a chunk (LOT_FLOOR_S where it has none)."""
    return max(_floor(chunk_timeout_s), AUDIT_MARGIN * max(checks_s, 0.0))


def answers_bytes(checks: int, senders: int, part_bytes: int) -> int:
    """What one reducer uploads to answer a group's audits: `checks` items (a checker's ask for one
    of its parts or chunks: then `part_bytes` is a chunk's), each with every sender's signed one."""
    return checks * senders * part_bytes


def disagreement(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    aggregation: tuple[robust.Aggregator, float, float],
    codec: codecs.Codec,
    answered: torch.Tensor,
) -> str | None:
    """Why `answered` (the decoded average a reducer signed) is not the combination of `parts`
    (decoded, with their signed weights) under `aggregation`, or None if it is, within TOLERANCE."""
    how, clip, cap = aggregation
    return _compared(robust.aggregate(parts, weights, how, clip, cap), codec, answered)


def chunk_disagreement(
    pieces: Sequence[torch.Tensor],
    weights: Sequence[float],
    norms: Sequence[float],
    aggregation: tuple[robust.Aggregator, float, float],
    codec: codecs.Codec,
    answered: torch.Tensor,
) -> str | None:
    """`disagreement` on one chunk: `pieces`, each sender's decoded chunk, `norms`, each sender's
    signed part norm (clip's scales). aligned-clip is checked as clip with every part kept: a part
    it dropped shows as a disagreement here, which the whole part then settles. Not for
    centered-clip (CHUNK_AUDITABLE)."""
    how, clip, cap = aggregation
    how = "clip" if how == "aligned-clip" else how
    return _compared(robust.aggregate(pieces, weights, how, clip, cap, norms), codec, answered)


def _compared(expected: torch.Tensor, codec: codecs.Codec, answered: torch.Tensor) -> str | None:
    expected = codec.roundtrip(expected.reshape(-1)).view_as(expected)
    if answered.shape != expected.shape:
        return f"an average of shape {tuple(answered.shape)} for parts of shape {tuple(expected.shape)}"
    if not bool(torch.isfinite(answered).all()):
        return "a non-finite average"
    error = float((answered.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    if error > TOLERANCE * scale + 1e-12:
        return f"an average off by {error:.4g} (norm of the true one: {scale:.4g})"
    return None


BENCH_S = 120.0  # a reducer's first unanswered audit: left out of this member's groups this long
BENCH_MAX_S = 3600.0


def bench_s(offences: int) -> float:
    """How long a reducer is left out after its `offences`-th unanswered audit (1, 2, ...): BENCH_S,
    doubled at each repeat up to BENCH_MAX_S. Not a conviction (nothing signed says it lied: it may be
    slow or gone), but a reducer that never answers costs each honest peer one failed round per
    period, and the periods grow, instead of failing every round."""
    return min(BENCH_MAX_S, BENCH_S * 2.0 ** max(0, offences - 1))
