"""A state downloaded from several holders at once, in chunks: the decisions, as pure functions.

A served state is its tensors' raw bytes one after the other (θ then the outer momentum, fp32:
8 bytes a parameter, 1.44 GB at 150M). A holder publishes on request its **manifest**: the
round and digest it serves, the byte size of each tensor, and the sha256 of every fixed-size
chunk of those bytes (`chunk_bytes_for`: the same for every holder of a state, so honest holders
of one state send equal manifests, I1). The joiner takes the manifest most of its holders sent
(`manifest_groups`), asks each holder that sent it for chunks (`Plan`), checks every chunk
against the manifest as it arrives, and checks the assembled state against the digest the swarm
agreed on at the end, as a whole download always was (network.download_chunked).

Who lies costs little: a holder whose chunk does not hash to the manifest's entry is dropped at
that chunk and its chunks go to the others (`Plan.received`); a holder whose manifest is not the
majority's is never asked for a chunk; a manifest that a majority of the holders asked sent but
whose assembled state misses the agreed digest costs one download, and the next manifest is
tried. A dropped connection costs the chunk in flight: what arrived is kept (`Plan.failed`), and
a holder is given up after MAX_FAILURES of them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from p2p_diloco.trust import wire

MAX_CHUNK_BYTES = 4 << 20  # a chunk of a big state: 1.7 s at 20 Mbit/s, and one p2pd message at most
MIN_CHUNK_BYTES = 64 << 10  # a small state is still cut in CHUNKS_PER_STATE, but not below this
CHUNKS_PER_STATE = 64  # a small state is cut into about this many chunks, so that every holder sends some
MAX_CHUNKS = 1 << 16  # a manifest lists at most this many chunks (256 GB at 4 MiB: 32B parameters)
MAX_PARTS = 4  # the served tensors: θ and the momentum
MAX_FAILURES = 2  # dropped connections after which a holder is given up for this download
PER_HOLDER = 2  # chunks asked of one holder at once: the next one is on its way while one arrives
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def chunk_bytes_for(total_bytes: int) -> int:
    """The chunk size of a state of `total_bytes`: MAX_CHUNK_BYTES for a big state, about
    1/CHUNKS_PER_STATE of a small one (a multiple of 64 KiB, at least MIN_CHUNK_BYTES)."""
    share = -(-total_bytes // CHUNKS_PER_STATE)
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, -(-share // MIN_CHUNK_BYTES) * MIN_CHUNK_BYTES))


def chunk_hash(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a holder says it serves: (round, digest), its tensors' byte sizes, its chunks' sha256."""

    round: int
    digest: str
    parts: tuple[int, ...]  # bytes of each served tensor, in order (θ, momentum)
    chunk_bytes: int
    hashes: tuple[str, ...]  # sha256 hex of chunk i: bytes [i × chunk_bytes, (i + 1) × chunk_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts)

    @property
    def root(self) -> str:
        """One hash of the whole manifest: equal manifests, equal roots (what holders vote with)."""
        return chunk_hash(repr(self.encode()).encode())

    def span(self, index: int) -> tuple[int, int]:
        """The bytes [start, end) of chunk `index` in the state."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def encode(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "digest": self.digest,
            "parts": list(self.parts),
            "chunk_bytes": self.chunk_bytes,
            "hashes": list(self.hashes),
        }


def parse_manifest(value: Any, limit: int) -> Manifest:
    """A manifest another peer sent (I4, WireError if malformed): a state of at most `limit` bytes,
    a chunk size within bounds, and exactly one hash per chunk."""
    m = wire.mapping(value, "state manifest")
    parts = wire.field(m, "parts", lambda v: wire.items(v, MAX_PARTS + 1, lambda p: wire.integer(p, 4, limit)))
    if not 1 <= len(parts) <= MAX_PARTS or any(p % 4 for p in parts) or sum(parts) > limit:
        raise wire.WireError(f"'parts': {len(parts)} tensors of fp32 in at most {limit:,} bytes expected")
    chunk = wire.field(m, "chunk_bytes", lambda v: wire.integer(v, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES))
    hashes = wire.field(m, "hashes", lambda v: wire.items(v, MAX_CHUNKS + 1, lambda h: wire.text(h, 64, _SHA256)))
    if len(hashes) != -(-sum(parts) // chunk):
        raise wire.WireError(f"'hashes': {len(hashes)} for {-(-sum(parts) // chunk)} chunks")
    return Manifest(wire.field(m, "round", wire.integer), wire.field(m, "digest", wire.digest), parts, chunk, hashes)


def manifest_of(round_: int, digest: str, parts: list[memoryview]) -> Manifest:
    """The manifest of a state whose tensors' raw bytes are `parts` (the holder's side)."""
    sizes = tuple(len(p) for p in parts)
    chunk = chunk_bytes_for(sum(sizes))
    empty = Manifest(round_, digest, sizes, chunk, ())
    hashes = []
    for index in range(-(-sum(sizes) // chunk)):
        h = hashlib.sha256()
        for part, lo, hi in pieces(sizes, *empty.span(index)):
            h.update(parts[part][lo:hi])
        hashes.append(h.hexdigest())
    return replace(empty, hashes=tuple(hashes))


def pieces(sizes: tuple[int, ...], start: int, end: int) -> list[tuple[int, int, int]]:
    """The bytes [start, end) of the state as (tensor, lo, hi) slices of its tensors, in order."""
    out, offset = [], 0
    for part, size in enumerate(sizes):
        lo, hi = max(start, offset), min(end, offset + size)
        if lo < hi:
            out.append((part, lo - offset, hi - offset))
        offset += size
    return out


def manifest_groups(manifests: Mapping[str, Manifest], round_: int, digest: str) -> list[tuple[Manifest, list[str]]]:
    """The manifests for (round_, digest) that holders sent, each with its holders (in the order
    asked), the one most holders sent first (ties: the smallest root, the same on every joiner).
    A holder that sent a manifest of another state is in no group: it is asked for nothing."""
    groups: dict[str, tuple[Manifest, list[str]]] = {}
    for peer, m in manifests.items():
        if (m.round, m.digest) == (round_, digest):
            groups.setdefault(m.root, (m, []))[1].append(peer)
    return sorted(groups.values(), key=lambda g: (-len(g[1]), g[0].root))


@dataclass(frozen=True)
class Plan:
    """One download's progress: which chunks arrived, which are on their way from whom, and which
    holders are still asked. Every change is a new Plan (the I/O in swarm/averaging/chunked.py
    only carries out what these functions decide)."""

    manifest: Manifest
    holders: tuple[str, ...]  # in the order asked; those dropped stay listed, and are skipped
    have: frozenset[int] = frozenset()
    busy: tuple[tuple[int, str], ...] = ()  # (chunk, holder) asked and not answered yet
    failures: Mapping[str, int] = field(default_factory=dict)
    dropped: Mapping[str, str] = field(default_factory=dict)  # holder -> why it is asked no more
    liars: frozenset[str] = frozenset()  # dropped for what no honest holder sends (not for failing)

    @property
    def done(self) -> bool:
        return len(self.have) == len(self.manifest.hashes)

    @property
    def live(self) -> list[str]:
        return [h for h in self.holders if h not in self.dropped]

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.manifest.hashes)) if i not in self.have]


def assign(plan: Plan, per_holder: int = PER_HOLDER) -> tuple[Plan, list[tuple[int, str]]]:
    """The chunks to ask for now: each live holder gets up to `per_holder` in flight, taking turns
    in the order asked, first the missing chunks nobody is asked for (lowest first), then, once
    none is left, a chunk another holder is still sending (the end of a download waits for the
    fastest holder, not the slowest)."""
    asked: list[tuple[int, str]] = []
    busy = list(plan.busy)
    while True:
        turn = _next_ask(plan, busy, per_holder)
        if turn is None:
            return replace(plan, busy=tuple(busy)), asked
        busy.append(turn)
        asked.append(turn)


def _next_ask(plan: Plan, busy: list[tuple[int, str]], per_holder: int) -> tuple[int, str] | None:
    """One (chunk, holder) to add, or None: the holder with the fewest in flight gets the first
    chunk nobody is sending, else the chunk the fewest (and then the lowest) are sending."""
    load = {h: sum(1 for _, b in busy if b == h) for h in plan.live}
    idle = [h for h in plan.live if load[h] < per_holder]
    if not idle:
        return None
    holder = min(idle, key=lambda h: load[h])
    senders = {i: [b for j, b in busy if j == i] for i in plan.missing}
    free = [i for i in plan.missing if not senders[i]]
    if free:
        return free[0], holder
    others = [i for i in plan.missing if holder not in senders[i]]
    return (min(others, key=lambda i: (len(senders[i]), i)), holder) if others else None


def received(plan: Plan, holder: str, index: int, sha256: str) -> Plan:
    """`holder` sent chunk `index`, which hashes to `sha256`: kept if it matches the manifest;
    otherwise the holder lied (or broke) and is asked for nothing more. Either way nobody else is
    still waited on for that chunk when it is kept (the caller cancels their requests)."""
    if sha256 != plan.manifest.hashes[index]:
        why = f"chunk {index} hashes to {sha256[:12]}, the manifest says {plan.manifest.hashes[index][:12]}"
        return _drop(_unbusy(plan, holder, index), holder, why, liar=True)
    return replace(plan, have=plan.have | {index}, busy=tuple((i, h) for i, h in plan.busy if i != index))


def failed(plan: Plan, holder: str, index: int, reason: str) -> Plan:
    """`holder`'s answer for chunk `index` did not come (dropped connection, silence): the chunk is
    asked again; the holder is given up after MAX_FAILURES such failures."""
    count = plan.failures.get(holder, 0) + 1
    plan = replace(_unbusy(plan, holder, index), failures={**plan.failures, holder: count})
    return _drop(plan, holder, f"{count} failed chunks, the last: {reason}") if count >= MAX_FAILURES else plan


def lied(plan: Plan, holder: str, index: int, reason: str) -> Plan:
    """`holder` sent something no honest holder sends for chunk `index` (more bytes than the chunk
    holds): dropped at once, like a chunk of the wrong hash."""
    return _drop(_unbusy(plan, holder, index), holder, f"chunk {index}: {reason}", liar=True)


def _unbusy(plan: Plan, holder: str, index: int) -> Plan:
    return replace(plan, busy=tuple(b for b in plan.busy if b != (index, holder)))


def _drop(plan: Plan, holder: str, why: str, liar: bool = False) -> Plan:
    busy = tuple(b for b in plan.busy if b[1] != holder)
    liars = plan.liars | {holder} if liar else plan.liars
    return replace(plan, busy=busy, dropped={**plan.dropped, holder: why}, liars=liars)


def stuck(plan: Plan) -> bool:
    """No chunk on its way and none that can be asked for: every holder was dropped."""
    return not plan.done and not plan.busy and not plan.live


def start(manifest: Manifest, holders: Iterable[str], have: Iterable[int] = ()) -> Plan:
    """A download of `manifest` from `holders`; `have`: chunks already verified by an earlier try
    of the same manifest (a download resumed: only the others are asked for)."""
    return Plan(manifest, tuple(dict.fromkeys(holders)), frozenset(i for i in have if 0 <= i < len(manifest.hashes)))
