"""Pure: the decisions of a two-level round, past one group (docs/design.md §3 "Past one group").

A round of N peers averages in groups of about s (stage 1: today's consistent all-reduce inside
each group), then the groups' owners of each span combine their groups' partials (stage 2: every
sub-span summed by two replicas in group order, so that honest replicas give the same bytes), and
every member divides each sub-span's sum by the weight it names (stage 3). Everything here is a
function of what every member can know: the round's seed (the agreed digest of θ(r)), the peers
the progress records expect, the partials and the replicas' outputs. Nothing here talks.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from p2p_diloco.trust import robust, wire
from p2p_diloco.trust.wire import WireError

GROUP_SIZE = 16  # s: the target group size; spans per group
OUTPUT_TAG = b"p2p-diloco/sub-span/v1"
PARTIAL_TAG = b"p2p-diloco/partial-sub-span/v2"


@dataclass(frozen=True)
class Levels:
    """A two-level round as a member takes part in it: the round, its key (the agreed digest of
    θ(r), which nobody chooses), its bucket count G and its span count s."""

    round: int
    round_key: bytes
    groups: int
    spans: int = GROUP_SIZE
    bucket: int | None = None  # the bucket whose key this peer's group meets under (the lowest of a merged group's)
    met: int = 0  # the groups this peer's view of the round makes: its assemblies close once that many came
    attempt: int = 1  # the round's all-reduce attempt (a retry's layouts, assemblies and stage 2 are its own)

    @property
    def seed(self) -> str:
        """What buckets and span owners are drawn by: the round's key, whatever the attempt."""
        return self.round_key.hex()

    @property
    def key(self) -> bytes:
        """What the attempt's layouts, seals and stage-2 messages are bound to: the round's key and
        the attempt, so that nothing of a failed attempt is taken for its retry."""
        return self.round_key + struct.pack(">H", self.attempt)

    def assembly_key(self, prefix: str, span: int) -> str:
        """The DHT key under which the owners of `span` in every group meet in this attempt (no '.':
        hivemind's)."""
        name = f"{prefix.replace('.', '_')}_r{self.round}a{self.attempt}"
        return f"{name}_span{span}of{self.spans}_{self.round_key.hex()[:16]}"


def levels_for(
    me: str, peers: Sequence[str], round_: int, round_key: bytes, size: int, reduces: Callable[[str], bool]
) -> tuple[Levels | None, int]:
    """(this peer's levels of round `round_`, the members its group expects) among the `peers` the
    records show at the round (this peer among them): None and every peer where the round is one
    group (fewer than 1.5 x `size` peers, or buckets that merged into one), else its merged
    bucket's (`groups_of`), meeting under that group's lowest bucket. A peer whose view of the
    round differs meets fewer mates."""
    everyone = sorted(set(peers) | {me})
    count = group_count(len(everyone), size)
    if count < 2:
        return None, len(everyone)
    seed = round_key.hex()
    groups = groups_of(seed, everyone, size, reduces)
    if len(groups) < 2:  # the buckets merged into one group: nothing to average across
        return None, len(everyone)
    mine = next(g for g in groups if me in g)
    lowest = min(bucket_of(seed, p, count) for p in mine)
    return Levels(round_, round_key, count, size, lowest, len(groups)), len(mine)


def group_weight(weights: Sequence[float], how: robust.Aggregator, cap: float) -> float:
    """A group's weight in stage 2 (its partial's Σ wᵢ), from its members' weights: as its reducers
    weigh them (robust.combine): all of them under `mean`, each capped at `cap` × the lower median
    under the clipping aggregators, at most the lower median under `trimmed-mean`. A part that
    aligned-clip dropped still counts its sender's weight: the group's estimate stands for all of it."""
    return math.fsum(robust.weighed(weights, how, cap))


def _rank(seed: str, peer: str) -> int:
    return int.from_bytes(hashlib.sha256(f"twolevel/{seed}/{peer}".encode()).digest()[:8], "big")


def group_count(expected: int, size: int = GROUP_SIZE) -> int:
    """G: how many buckets a round of `expected` peers is cut into."""
    return max(1, round(expected / size))


def buckets(seed: str, peers: Sequence[str], count: int) -> list[list[str]]:
    """Bucket b holds the peers whose sha256(seed, id) is b mod `count`, each bucket in rank order."""
    out: list[list[str]] = [[] for _ in range(count)]
    for peer in sorted(set(peers), key=lambda p: _rank(seed, p)):
        out[bucket_of(seed, peer, count)].append(peer)
    return out


def bucket_of(seed: str, peer: str, count: int) -> int:
    """The bucket of one peer (as `buckets` files it): where its round's records go (docs/design.md
    §3, "Records by bucket"), known to the peer alone from the seed and G."""
    return _rank(seed, peer) % count


def is_head(seed: str, peer: str, expected: int, size: int = GROUP_SIZE) -> bool:
    """Whether the peer also publishes its round record under the run's heads key, which joiners
    read: about `size` of `expected` peers do, those whose sha256(seed, id) falls in the lowest
    size / expected of its range (all of them where expected <= size). The seed is the agreed
    digest, so nobody picks the heads; the hash is another than the bucket's, so the heads are
    spread over the buckets."""
    if expected <= size:
        return True
    value = int.from_bytes(hashlib.sha256(f"twolevel/head/{seed}/{peer}".encode()).digest()[:8], "big")
    return value < (1 << 64) * size // expected


def merge(
    raw: Sequence[Sequence[str]], min_group: int, reduces: Callable[[str], bool] = lambda _: True
) -> list[tuple[str, ...]]:
    """Groups from buckets walked in index order: a bucket closes once the group it ends holds at
    least `min_group` members, of which at least one `reduces` (can be dialled); a short remainder
    joins the last closed group. A round of fewer peers than `min_group` is one group."""
    groups: list[list[str]] = []
    open_: list[str] = []
    for bucket in raw:
        open_ += bucket
        if len(open_) >= min_group and any(reduces(p) for p in open_):
            groups.append(open_)
            open_ = []
    if open_:
        if groups:
            groups[-1] += open_
        else:
            groups.append(open_)
    return [tuple(g) for g in groups if g]


def groups_of(
    seed: str, peers: Sequence[str], size: int = GROUP_SIZE, reduces: Callable[[str], bool] = lambda _: True
) -> list[tuple[str, ...]]:
    """The round's groups, in group order: buckets of `peers` merged to at least size / 2 members."""
    return merge(buckets(seed, peers, group_count(len(set(peers)), size)), max(2, size // 2), reduces)


def spans(numel: int, count: int) -> list[tuple[int, int]]:
    """[start, end) of `count` spans of a flat vector of `numel` values, as even as whole values allow."""
    return [(numel * k // count, numel * (k + 1) // count) for k in range(count)]


def owners(
    seed: str,
    group: Sequence[str],
    count: int,
    reduces: Callable[[str], bool] = lambda _: True,
    rates: Mapping[str, float] | None = None,
) -> list[str]:
    """The member of `group` that owns each of `count` spans, among those that `reduces` (can be
    dialled; all of them if none can): span by span to the member with the most `rates` (its
    vouched upload; equal if None) per span it would then own (D'Hondt: shares in proportion to
    the rates), ties to the lower sha256(seed, id)."""
    able = sorted([p for p in group if reduces(p)] or list(group), key=lambda p: _rank(seed, p))
    rate = [max(0.0, rates.get(p, 1.0)) if rates is not None else 1.0 for p in able]
    if not any(rate):
        rate = [1.0] * len(able)
    owned = [0] * len(able)
    out = []
    for _ in range(count):
        best = max(range(len(able)), key=lambda i: (rate[i] / (owned[i] + 1), -i))  # ties: the lower rank
        owned[best] += 1
        out.append(able[best])
    return out


@dataclass(frozen=True)
class Layout:
    """How a flat vector of `numel` values is cut into fixed spans of whole parts, the same in every
    group: padded with zeros to `padded` = spans x `span_values`, each span `parts_per_span` parts
    of `part_values` (a zero averages to zero, and adds nothing to a part's norm)."""

    numel: int
    spans: int
    part_values: int
    parts_per_span: int

    @property
    def span_values(self) -> int:
        return self.part_values * self.parts_per_span

    @property
    def padded(self) -> int:
        return self.spans * self.span_values


def layout(numel: int, spans: int, max_part_values: int) -> Layout:
    """Fixed spans of whole parts of at most `max_part_values` values (the runner's part size):
    each span as few parts as fit, the parts as even as whole values allow; the padding is less
    than `spans` x `parts_per_span` values."""
    span_values = max(1, math.ceil(numel / spans))
    parts_per_span = math.ceil(span_values / max_part_values)
    return Layout(numel, spans, math.ceil(span_values / parts_per_span), parts_per_span)


def fractions(members: Sequence[str], span_owners: Sequence[str]) -> list[int]:
    """Each member's count of spans, in `members`' order (the group's order, which the runner cuts
    the vector in): the runner's peer fractions. The spans then go to members as contiguous runs,
    in that order, whatever order `span_owners` (twolevel.owners) named them in: a member owns
    `count` spans, not particular ones."""
    return [sum(1 for o in span_owners if o == m) for m in members]


def replicas(sub: int, groups: int) -> tuple[int, int]:
    """(primary, secondary): the groups whose span owners reduce sub-span `sub` of every span."""
    return sub, (sub + 1) % groups


@dataclass(frozen=True)
class Partial:
    """A group's share of one span: Σ wᵢxᵢ over the parts its owner kept, and Σ wᵢ."""

    values: torch.Tensor  # fp32
    weight: float
    digests: tuple[bytes, ...] = ()  # the whole span's pieces' digests, as its group sealed them (partials.py)


def partial(
    parts: Sequence[torch.Tensor], weights: Sequence[float], how: robust.Aggregator, clip: float, weight_cap: float
) -> Partial:
    """A group's partial of one span from its senders' parts (in sender order): the robust
    combination (robust.combine, as a stage-1 reducer answers) times the weight it kept."""
    if not parts:
        raise ValueError("a partial needs at least one part")
    combined, fates = robust.combine(parts, weights, how, clip, weight_cap)
    if how == "mean":
        kept = list(weights)
    else:
        capped = robust.cap_weights(weights, weight_cap)
        kept = [0.0 if fate == "dropped" else w for w, fate in zip(capped, fates)]
    weight = math.fsum(w for w in kept if w > 0)
    return Partial(
        (combined * weight).float() if weight > 0 else torch.zeros_like(combined, dtype=torch.float32), weight
    )


@dataclass(frozen=True)
class Output:
    """A replica's sum of one sub-span over the groups it names, signed by `by` (the caller signs
    `statement()`)."""

    span: int
    sub: int
    groups: tuple[int, ...]
    values: torch.Tensor  # fp32: Σ of the named groups' partials, in group order
    weight: float
    by: str

    def statement(self) -> bytes:
        """What its replica signs and sends: every field, values as big-endian fp32 (`parse_output`)."""
        head = struct.pack(
            f">III{len(self.groups)}Id", self.span, self.sub, len(self.groups), *self.groups, self.weight
        )
        return OUTPUT_TAG + head + self.values.numpy().astype(">f4").tobytes()


def parse_output(raw: bytes, by: str, groups: int, spans: int, numel: int) -> Output:
    """An `Output.statement()` from another node (untrusted), of a round of `groups` groups and
    `spans` spans, whose sub-span holds `numel` values: the output, or WireError. Valid: the tag,
    a span and sub-span in range, group indices in range, strictly increasing (a sum in group order
    names each group once), a finite weight >= 0, exactly `numel` finite values."""
    if not isinstance(raw, bytes) or not raw.startswith(OUTPUT_TAG):
        raise WireError("not a sub-span output")
    at = len(OUTPUT_TAG)
    if len(raw) < at + 12:
        raise WireError("sub-span output: short header")
    span, sub, count = struct.unpack_from(">III", raw, at)
    if span >= spans or sub >= groups or count > groups:
        raise WireError(f"sub-span output: span {span}, sub-span {sub}, {count} groups out of range")
    at += 12
    if len(raw) != at + 4 * count + 8 + 4 * numel:
        raise WireError(f"sub-span output: {len(raw)} bytes for {count} groups and {numel} values")
    named = struct.unpack_from(f">{count}I", raw, at)
    if any(g >= groups for g in named) or any(a >= b for a, b in zip(named, named[1:])):
        raise WireError(f"sub-span output: groups {list(named)[:8]} not increasing indices below {groups}")
    (weight,) = struct.unpack_from(">d", raw, at + 4 * count)
    wire.real(weight, lo=0.0)
    values = torch.from_numpy(np.frombuffer(raw, dtype=">f4", offset=at + 4 * count + 8).astype(np.float32))
    if not bool(torch.isfinite(values).all()):
        raise WireError("sub-span output: values that are not finite")
    return Output(span, sub, tuple(named), values, weight, by)


def partial_statement(round_key: bytes, span: int, sub: int, group: int, piece: Partial) -> bytes:
    """What a span's owner signs and sends each replica: its group's partial of one sub-span, with
    the whole span's pieces' digests (`parse_partial`), bound to the round by `round_key`."""
    fields = struct.pack(">IIIdI", span, sub, group, piece.weight, len(piece.digests))
    head = struct.pack(">H", len(round_key)) + round_key + fields
    return PARTIAL_TAG + head + b"".join(piece.digests) + piece.values.numpy().astype(">f4").tobytes()


def parse_partial(
    raw: bytes, round_key: bytes, groups: int, spans: int, numel: int, pieces: int
) -> tuple[int, int, int, Partial]:
    """A `partial_statement` from another node (untrusted): (span, sub-span, group, partial), or
    WireError. Valid: the tag, this round's key, span, sub-span and group in range, a finite
    weight >= 0, exactly `pieces` digests of 32 bytes, exactly `numel` finite values (the sub-span's)."""
    if not isinstance(raw, bytes) or not raw.startswith(PARTIAL_TAG):
        raise WireError("not a partial sub-span")
    at = len(PARTIAL_TAG)
    if len(raw) < at + 2:
        raise WireError("partial sub-span: short header")
    (key_len,) = struct.unpack_from(">H", raw, at)
    if raw[at + 2 : at + 2 + key_len] != round_key:
        raise WireError("partial sub-span: of another round")
    at += 2 + key_len
    if len(raw) != at + 24 + 32 * pieces + 4 * numel:
        raise WireError(f"partial sub-span: {len(raw)} bytes for {pieces} digests and {numel} values")
    span, sub, group, weight, count = struct.unpack_from(">IIIdI", raw, at)
    if span >= spans or sub >= groups or group >= groups or count != pieces:
        raise WireError(f"partial sub-span: span {span}, sub-span {sub}, group {group}, {count} digests out of range")
    wire.real(weight, lo=0.0)
    at += 24
    digests = tuple(raw[at + 32 * i : at + 32 * (i + 1)] for i in range(pieces))
    values = torch.from_numpy(np.frombuffer(raw, dtype=">f4", offset=at + 32 * pieces).astype(np.float32))
    if not bool(torch.isfinite(values).all()):
        raise WireError("partial sub-span: values that are not finite")
    return span, sub, group, Partial(values, weight, digests)


def reduce_sub_span(span: int, sub: int, bounds: tuple[int, int], partials: Mapping[int, Partial], by: str) -> Output:
    """Sub-span `bounds` (within the span) of the sum of `partials` (by group), in group order,
    elementwise in fp32: the same bytes from any replica holding the same partials."""
    start, end = bounds
    total = torch.zeros(end - start, dtype=torch.float32)
    weight = 0.0
    for group in sorted(partials):
        total += partials[group].values[start:end]
        weight += partials[group].weight
    return Output(span, sub, tuple(sorted(partials)), total, weight, by)


def cross_check(output: Output, bounds: tuple[int, int], partials: Mapping[int, Partial]) -> str | None:
    """Why `output` is not the sum of the partials of the groups it names (a conviction of its
    replica), or None: it is, or a partial it names is not here to judge by."""
    if any(g not in partials for g in output.groups):
        return None
    again = reduce_sub_span(output.span, output.sub, bounds, {g: partials[g] for g in output.groups}, output.by)
    if again.weight != output.weight or not torch.equal(again.values, output.values):
        return (
            f"{output.by}'s sum of sub-span {output.sub} of span {output.span} is not the sum of the "
            f"partials of groups {list(output.groups)}"
        )
    return None


def lone_refusal(output: Output, group: int, bounds: tuple[int, int], own: Partial) -> str | None:
    """Why `output`, a sub-span's sum that names group `group` alone, is not that group's partial
    `own` of the span (whose sub-span it is: `bounds`), or None: it is, or it names other groups too
    (then the group's members cannot tell its share). A sum of one partial is that partial, bit for bit."""
    start, end = bounds
    if output.groups != (group,):
        return None
    if output.weight != own.weight or not torch.equal(output.values, own.values[start:end]):
        return f"{output.by}'s sum of sub-span {output.sub} of span {output.span} is not this group's partial"
    return None


def equivocation(a: Output, b: Output) -> str | None:
    """Why two outputs one replica signed convict it (two different sums of one sub-span), or None."""
    if a.by == b.by and (a.span, a.sub) == (b.span, b.sub) and a.statement() != b.statement():
        return f"{a.by} signed two different sums of sub-span {a.sub} of span {a.span}"
    return None


@dataclass(frozen=True)
class Settled:
    """The one output of a sub-span that every consumer gets, and whom its secondary convicted."""

    output: Output | None
    convicted: str | None = None


def settle(
    primary: Output | None,
    span: int,
    sub: int,
    bounds: tuple[int, int],
    held: Mapping[int, Partial],
    secondary: str | None,
) -> Settled:
    """The secondary's one decision for sub-span `sub` of `span`: the primary's output if it came
    in time and checks against the partials held here; else its own sum of what it holds (a
    primary that summed wrong is convicted; one that names a partial not held here cannot be
    checked and is not taken: a lie would pass); nothing if it holds none. No secondary (it is
    dead, or the primary's group is the only one): the primary's output stands, or nothing."""
    if secondary is None:
        return Settled(primary)
    own = reduce_sub_span(span, sub, bounds, held, secondary) if held else None
    if primary is None or any(g not in held for g in primary.groups):
        return Settled(own)
    if cross_check(primary, bounds, held) is not None:
        return Settled(own, convicted=primary.by)
    return Settled(primary)


def final(outputs: Sequence[Output]) -> torch.Tensor:
    """Stage 3: the sub-spans' averages (each sum over the weight it names; 0 where it names none),
    concatenated in (span, sub-span) order."""
    ordered = sorted(outputs, key=lambda o: (o.span, o.sub))
    return torch.cat([o.values / o.weight if o.weight > 0 else torch.zeros_like(o.values) for o in ordered])


def cost(peers: int, size: int = GROUP_SIZE) -> dict[str, float]:
    """Per peer, in units of one encoded Δ (M) and partners: the flat butterfly against two levels."""
    g = group_count(peers, size)
    s = min(size, peers)
    two_bytes = 2 * (s - 1) / s + (3 / s if g > 1 else 0.0)
    return {
        "flat_bytes": 2 * (peers - 1) / peers,
        "two_level_bytes": two_bytes,
        "flat_partners": peers - 1,
        "two_level_partners": (s - 1) + (2 * (g - 1) if g > 1 else 0),
        "groups": g,
    }
