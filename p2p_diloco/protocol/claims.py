"""Pure: who owns span k in each group of a two-level round, as every owner of span k agrees it
(docs/design.md §3, "Past one group": step (1) of "The round around it").

Stage 2 needs the same `Plan.owners` on every owner of a span: who is the primary and who the
decider of each sub-span follows from it. After stage 1's all-gather, a group's members know its
*layout*: its members in group order and the owner of each of the s spans. Each member signs that
layout, bound to the round's key (`GroupLayout.statement`), once a round. The span-k owners of all
groups then meet (matchmaking under a (round, span) key, which hands each of them the same list of
what the others showed), each showing its group's layout with its members' signatures: a *claim*.
From that one list every owner computes the same owners (`plan_owners`):

- a claim counts only where its claimant owns span k in the layout it shows and more than half of
  the layout's members signed it (the caller verifies a signature, `holds`: it holds the keys and
  the admission certificates);
- a group covers the buckets its members hash into (twolevel.bucket_of); of claims whose buckets
  overlap (a bucket that split into two groups, or a claim made up by a few peers of one bucket),
  the one more members signed counts, ties to the lower sha256 of the layout;
- the groups that count are numbered in the order of their lowest bucket.

A group whose owner of span k did not come counts in no sub-span of span k, as designed.
Nothing here talks or verifies a signature.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from p2p_diloco.protocol import twolevel
from p2p_diloco.trust.wire import WireError

LAYOUT_TAG = b"p2p-diloco/group-layout/v2"
CLAIM_TAG = b"p2p-diloco/span-claim/v1"
MAX_MEMBERS = 4 * twolevel.GROUP_SIZE  # a merged group is under 2 s; more is not a group of ours
MAX_ID = 128  # bytes of a peer id in base58 (46 for today's RSA keys)
MAX_SEAL = 4096  # bytes of one member's seal (signature and key)
ROOT_BYTES = 32  # a span's partial's root (partials.root)

Holds = Callable[[str, bytes, bytes], bool]  # (member, statement, seal) -> the seal is the member's over it


@dataclass(frozen=True)
class GroupLayout:
    """A stage-1 group of one round: its members in group order, each span's owner, and each
    span's partial as the members computed it (partials.root: 32 bytes a span)."""

    round_key: bytes
    members: tuple[str, ...]
    span_owners: tuple[str, ...]
    roots: tuple[bytes, ...]

    def statement(self) -> bytes:
        """What each member signs (`parse_layout` reads it): the round's key, the members, each
        span's owner as an index into the members, and each span's partial's root."""
        if len(self.roots) != len(self.span_owners) or any(len(r) != ROOT_BYTES for r in self.roots):
            raise ValueError(f"a layout needs a root of {ROOT_BYTES} bytes per span")
        index = {m: i for i, m in enumerate(self.members)}
        out = [LAYOUT_TAG, struct.pack(">H", len(self.round_key)), self.round_key]
        out.append(struct.pack(">HH", len(self.members), len(self.span_owners)))
        for member in self.members:
            raw = member.encode()
            out += [struct.pack(">B", len(raw)), raw]
        out.append(struct.pack(f">{len(self.span_owners)}H", *(index[o] for o in self.span_owners)))
        return b"".join(out + list(self.roots))

    def buckets(self, seed: str, count: int) -> frozenset[int]:
        """The buckets of the round (of `count`) that this group's members hash into."""
        return frozenset(twolevel.bucket_of(seed, m, count) for m in self.members)


@dataclass(frozen=True)
class Claim:
    """A span owner's claim, as the assembly showed it: `by` (the peer that showed it), its group's
    layout, and the seals its members signed the layout with, by member."""

    by: str
    layout: GroupLayout
    seals: Mapping[str, bytes]

    def encode(self) -> bytes:
        """The claim as its owner shows it (`parse_claim`)."""
        statement = self.layout.statement()
        index = {m: i for i, m in enumerate(self.layout.members)}
        out = [CLAIM_TAG, struct.pack(">I", len(statement)), statement, struct.pack(">H", len(self.seals))]
        for member, seal in sorted(self.seals.items(), key=lambda item: index[item[0]]):
            out += [struct.pack(">HH", index[member], len(seal)), seal]
        return b"".join(out)


class _Reader:
    """Reads untrusted bytes front to back; anything short raises WireError."""

    def __init__(self, raw: bytes, what: str) -> None:
        self.raw, self.at, self.what = raw, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.raw):
            raise WireError(f"{self.what}: cut short")
        self.at += n
        return self.raw[self.at - n : self.at]

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def end(self) -> None:
        if self.at != len(self.raw):
            raise WireError(f"{self.what}: {len(self.raw) - self.at} bytes too many")


def parse_layout(raw: object, round_key: bytes, spans: int) -> GroupLayout:
    """A `GroupLayout.statement()` from another node (untrusted), of this round and `spans` spans:
    the layout, or WireError. Valid: the tag, this round's key, 1 to MAX_MEMBERS distinct peer ids
    of 1 to MAX_ID bytes of ASCII, exactly `spans` owners, each a member, a root of ROOT_BYTES
    per span, and nothing more."""
    if not isinstance(raw, bytes) or not raw.startswith(LAYOUT_TAG):
        raise WireError("not a group layout")
    read = _Reader(raw[len(LAYOUT_TAG) :], "group layout")
    if read.take(read.unpack(">H")[0]) != round_key:
        raise WireError("group layout: of another round")
    count, owned = read.unpack(">HH")
    if not 1 <= count <= MAX_MEMBERS or owned != spans:
        raise WireError(f"group layout: {count} members and {owned} spans (expected {spans})")
    members = tuple(_peer_id(read.take(read.unpack(">B")[0])) for _ in range(count))
    if len(set(members)) != count:
        raise WireError("group layout: a member named twice")
    indices = read.unpack(f">{spans}H")
    roots = tuple(read.take(ROOT_BYTES) for _ in range(spans))
    read.end()
    if any(i >= count for i in indices):
        raise WireError("group layout: a span owned by no member")
    return GroupLayout(round_key, members, tuple(members[i] for i in indices), roots)


def _peer_id(raw: bytes) -> str:
    if not 1 <= len(raw) <= MAX_ID or not raw.isascii() or not raw.isalnum():
        raise WireError(f"group layout: {raw[:16]!r} is not a peer id")
    return raw.decode()


def parse_claim(raw: object, by: str, round_key: bytes, spans: int) -> Claim:
    """A `Claim.encode()` that `by` showed (untrusted): the claim, or WireError. Valid: the tag, a
    valid layout (`parse_layout`), seals of members named once each, of 1 to MAX_SEAL bytes, and
    nothing more. Whether a seal holds is for `plan_owners`' caller to say."""
    if not isinstance(raw, bytes) or not raw.startswith(CLAIM_TAG):
        raise WireError("not a span claim")
    read = _Reader(raw[len(CLAIM_TAG) :], "span claim")
    layout = parse_layout(read.take(read.unpack(">I")[0]), round_key, spans)
    seals: dict[str, bytes] = {}
    for _ in range(read.unpack(">H")[0]):
        index, size = read.unpack(">HH")
        if index >= len(layout.members) or layout.members[index] in seals or not 1 <= size <= MAX_SEAL:
            raise WireError(f"span claim: a seal of member {index} ({size} bytes)")
        seals[layout.members[index]] = read.take(size)
    read.end()
    return Claim(by, layout, seals)


def signers(claim: Claim, holds: Holds) -> frozenset[str]:
    """The members of the claim's group whose seal over its layout holds."""
    statement = claim.layout.statement()
    members = set(claim.layout.members)
    return frozenset(m for m, seal in claim.seals.items() if m in members and holds(m, statement, seal))


def counted(seed: str, count: int, span: int, claims: Sequence[Claim], holds: Holds) -> tuple[Claim, ...]:
    """The claims that count for span `span`, one per group, in group order, from the claims the
    assembly showed every owner alike, in a round of `count` buckets: the module's rules."""
    ranked: list[tuple[int, bytes, Claim]] = []
    for claim in claims:
        layout = claim.layout
        if span >= len(layout.span_owners) or layout.span_owners[span] != claim.by:
            continue
        signed = len(signers(claim, holds))
        if 2 * signed > len(layout.members):
            ranked.append((-signed, hashlib.sha256(layout.statement()).digest(), claim))
    taken: list[tuple[int, Claim]] = []  # (lowest bucket, claim)
    covered: set[int] = set()
    for _, _, claim in sorted(ranked, key=lambda c: (c[0], c[1])):
        buckets = claim.layout.buckets(seed, count)
        if buckets & covered:
            continue
        covered |= buckets
        taken.append((min(buckets), claim))
    return tuple(claim for _, claim in sorted(taken, key=lambda t: t[0]))


def plan_owners(seed: str, count: int, span: int, claims: Sequence[Claim], holds: Holds) -> tuple[str, ...]:
    """Span `span`'s owner in each group that counts, in group order (`Plan.owners`)."""
    return tuple(claim.by for claim in counted(seed, count, span, claims, holds))


def plan_key(round_key: bytes, span: int, claims: Sequence[Claim]) -> bytes:
    """Stage 2's key for `span` (stage2.Plan.round_key): the round's key, the span and every claim
    the assembly showed, in any order. Owners that hold different lists (a leader that told them
    different things) then hold different keys, and refuse each other's stage-2 messages."""
    shown = sorted(hashlib.sha256(c.by.encode() + b"\0" + c.encode()).digest() for c in claims)
    return hashlib.sha256(b"".join([round_key, struct.pack(">I", span), *shown])).digest()


MAX_SHOWN = 1024  # claims in one assembly: one per group of a round
MAX_CLAIM = MAX_MEMBERS * (2 + MAX_ID + 4 + MAX_SEAL) + 64 * 1024  # a claim's bytes: the layout and a seal per member


def unfit(shown: Sequence[tuple[str, bytes]], most: int) -> str | None:
    """Why an assembly's list (from its leader, untrusted) is none of an assembly of at most `most`
    owners: more entries (or MAX_SHOWN), a claim of more than MAX_CLAIM bytes, or a peer named
    twice; None if it may be one (its claims are still each for `parse_claim`)."""
    if len(shown) > min(most, MAX_SHOWN):
        return f"{len(shown)} claims, at most {most} asked for"
    if any(len(raw) > MAX_CLAIM for _, raw in shown):
        return f"a claim over {MAX_CLAIM} bytes"
    if len({by for by, _ in shown}) != len(shown):
        return "a peer twice"
    return None


def pack_shown(shown: Sequence[tuple[str, bytes]]) -> bytes:
    """What an assembly showed, (peer, claim bytes) in its order, as an owner passes it on to its
    group's members (`unpack_shown`)."""
    out = [struct.pack(">H", len(shown))]
    for by, raw in shown:
        name = by.encode()
        out += [struct.pack(">B", len(name)), name, struct.pack(">I", len(raw)), raw]
    return b"".join(out)


def unpack_shown(raw: object) -> list[tuple[str, bytes]]:
    """A `pack_shown` from another node (untrusted): the list, or WireError. Valid: at most
    MAX_SHOWN entries, each a peer id and a claim of at most MAX_CLAIM bytes (whose own checks are
    `parse_claim`'s), and nothing more."""
    if not isinstance(raw, bytes):
        raise WireError("not an assembly's claims")
    read = _Reader(raw, "assembly's claims")
    (count,) = read.unpack(">H")
    if count > MAX_SHOWN:
        raise WireError(f"assembly's claims: {count} of them")
    shown = []
    for _ in range(count):
        by = _peer_id(read.take(read.unpack(">B")[0]))
        (size,) = read.unpack(">I")
        if size > MAX_CLAIM:
            raise WireError(f"assembly's claims: one of {size} bytes")
        shown.append((by, read.take(size)))
    read.end()
    return shown


def plan_for_member(
    shown: Sequence[Claim], owner: str, sealed: GroupLayout, seed: str, count: int, span: int, holds: Holds
) -> tuple[tuple[Claim, ...], bytes]:
    """Stage 3, for a member that owns nothing of `span`: (the claims that count, in group order,
    and stage 2's key) from what its group's owner passed on of the assembly, or WireError where the
    owner showed no claim of the layout this member sealed (`sealed`), which it cannot have been
    honest about."""
    if not any(c.by == owner and c.layout == sealed for c in shown):
        raise WireError(f"{owner} showed the assembly no claim of the layout this member sealed")
    return counted(seed, count, span, shown, holds), plan_key(sealed.round_key, span, shown)
