"""Pure: a group's partial of a span, as its members seal it (docs/design.md §3, "Past one group",
step (3): stage 1's partial checked by the group).

After stage 1 every member of a group holds the group's audited average, bit for bit, and the
weights its members showed. So every member can compute, alike, the partial its owner of span k
must send in stage 2 (`of_group`: the average's span times the group's weight, in fp32), cut it
into CHUNKS pieces, and hash each piece (`digests`). The members seal the root of those digests
and the weight (`root`) inside their group's layout (claims.GroupLayout.roots), and a claim counts
only with the seals of more than half of its members. A replica then takes an owner's partial of a
sub-span only where its weight and digests hash to the root the claim showed and each of its
pieces hashes to its digest (`refusal`): an owner cannot send what its group did not compute,
unless more than half of its group lies with it.

Sub-spans are runs of whole pieces (`sub_spans`), so a replica can check the pieces of the
sub-span it holds and nothing more; the digests travel with every partial (32 bytes a piece).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from p2p_diloco.protocol import twolevel
from p2p_diloco.protocol.twolevel import Partial

CHUNKS = 1024  # pieces of a span with a digest each: sub-spans are runs of whole pieces
DIGEST_BYTES = 32
ROOT_TAG = b"p2p-diloco/partial-root/v1"


def chunk_bounds(numel: int) -> list[tuple[int, int]]:
    """[start, end) of each piece of a span of `numel` values: min(CHUNKS, numel) of them, as even
    as whole values allow."""
    return twolevel.spans(numel, min(CHUNKS, numel))


def sub_spans(numel: int, groups: int) -> list[tuple[int, int]]:
    """[start, end) of each of `groups` sub-spans of a span of `numel` values: runs of whole
    pieces, as even as whole pieces allow (empty where there are more groups than pieces)."""
    pieces = chunk_bounds(numel)
    out = []
    for first, last in twolevel.spans(len(pieces), groups):
        start = pieces[first][0] if first < len(pieces) else numel
        out.append((start, pieces[last - 1][1] if last > first else start))
    return out


def digest(values: torch.Tensor) -> bytes:
    """One piece's digest: sha256 of its values as big-endian fp32 (as statements carry them)."""
    return hashlib.sha256(values.numpy().astype(">f4").tobytes()).digest()


def digests(values: torch.Tensor) -> tuple[bytes, ...]:
    """Each piece's digest of a span's partial values."""
    return tuple(digest(values[start:end]) for start, end in chunk_bounds(values.numel()))


def root(span: int, weight: float, pieces: Sequence[bytes]) -> bytes:
    """What a group's members seal of its partial of `span`: its weight and its pieces' digests, hashed."""
    return hashlib.sha256(ROOT_TAG + struct.pack(">Id", span, weight) + b"".join(pieces)).digest()


def scaled(average: torch.Tensor, weight: float) -> torch.Tensor:
    """A group's partial values of a span from its average of the span and its weight: each value
    times the weight rounded to fp32, each product rounded to fp32 (IEEE: the same bytes on every
    member that holds the same average)."""
    return (average.float() * weight).float()


def of_group(average: torch.Tensor, weight: float) -> Partial:
    """The partial of a span that a group's owner sends (`scaled`), with its pieces' digests."""
    values = scaled(average, weight)
    return Partial(values, weight, digests(values))


def refusal(piece: Partial, span: int, numel: int, bounds: tuple[int, int], sealed_root: bytes) -> str | None:
    """Why `piece` (an owner's partial of the sub-span `bounds` of a span of `numel` values, with
    the whole span's digests) is not what its group sealed (`sealed_root`), or None where it is."""
    if len(piece.digests) != len(chunk_bounds(numel)) or root(span, piece.weight, piece.digests) != sealed_root:
        return "its weight or digests are not what its group's members sealed"
    start, end = bounds
    for index, (a, b) in enumerate(chunk_bounds(numel)):
        if start <= a and b <= end and digest(piece.values[a - start : b - start]) != piece.digests[index]:
            return f"its piece {index} is not what its group's members sealed"
    return None
