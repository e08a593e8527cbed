"""The two-level round (protocol/twolevel.py): its pure decisions by hand, then a simulator of 16
to 1,024 virtual peers run as property tests, with faults at every stage.

The simulator builds a round the way the design does (docs/design.md §3 "Past one group"): the
real codecs (codecs.Codec.roundtrip: what a reducer decodes of each sender's part) and the real
robust aggregators (through twolevel.partial) in stage 1, the replicas' sums and the secondary's
decision in stage 2, each member's division in stage 3. Its invariants are checked against a
reference written here apart from the module: every member that finishes holds the same bytes;
those bytes are a fixed-order computation over exactly the contributions the faults left in (and,
for the mean, the flat weighted mean of those contributions, in float64); a replica that sums
wrong or signs two sums is convicted; an owner that sends a partial its group did not seal
(protocol/partials.py: each replica checks it against the root the group sealed) is convicted, and
its group counts in no sub-span of that span.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol import codecs, twolevel
from p2p_diloco.protocol import partials as sealing
from p2p_diloco.protocol.twolevel import Output, Partial
from p2p_diloco.trust import robust

CLIP, WEIGHT_CAP = 2.0, 4.0  # the run's defaults' order: swarm.clip, swarm.weight_cap


# --- the decisions, by hand ---------------------------------------------------------------------


def test_group_count_and_merge_by_hand():
    assert [twolevel.group_count(n, 16) for n in (2, 8, 9, 16, 24, 40, 256, 1024)] == [1, 1, 1, 1, 2, 2, 16, 64]
    raw = [["a"], ["b", "c"], ["d", "e", "f"], ["g"]]
    assert twolevel.merge(raw, 2) == [("a", "b", "c"), ("d", "e", "f", "g")]  # a short bucket joins the next
    assert twolevel.merge(raw, 3) == [("a", "b", "c"), ("d", "e", "f", "g")]
    assert twolevel.merge([["a"]], 2) == [("a",)]  # fewer peers than a group: one group
    # a bucket of peers nobody can dial closes only with one that can be
    assert twolevel.merge([["x", "y"], ["z", "w"]], 2, reduces=lambda p: p in ("w",)) == [("x", "y", "z", "w")]


def test_each_peer_finds_its_merged_group_and_the_bucket_it_meets_under():
    key = bytes(range(16))
    few = [f"peer{i}" for i in range(23)]  # 23 / 16 rounds to 1: one group, as today
    assert twolevel.levels_for("peer0", few, 3, key, 16, lambda p: True) == (None, 23)
    levels, expected = twolevel.levels_for("me", few, 3, key, 16, lambda p: True)  # itself counts: 24 peers
    assert levels is not None and levels.groups == 2
    assert expected == len(next(g for g in twolevel.groups_of(key.hex(), [*few, "me"], 16) if "me" in g))
    # 4 peers of size 2 make 2 buckets; a key that puts 3 in one makes one group of all four
    four = ["a", "b", "c", "d"]
    uneven = next(
        k
        for k in (bytes([i]) * 16 for i in range(256))
        if sorted(map(len, twolevel.buckets(k.hex(), four, 2))) == [1, 3]
    )
    assert twolevel.levels_for("a", four, 3, uneven, 2, lambda p: True) == (None, 4)
    peers = [f"peer{i}" for i in range(40)]  # size 8: 5 buckets, merged to at least 4 members each
    groups = twolevel.groups_of(key.hex(), peers, 8)
    seen: dict[int, set[str]] = {}
    for me in peers:
        levels, expected = twolevel.levels_for(me, peers[::-1], 3, key, 8, lambda p: True)
        assert levels is not None and (levels.round, levels.round_key, levels.groups, levels.spans) == (3, key, 5, 8)
        assert levels.met == len(groups)
        mine = next(g for g in groups if me in g)
        assert expected == len(mine)
        assert levels.bucket == min(twolevel.bucket_of(key.hex(), p, 5) for p in mine)
        seen.setdefault(levels.bucket, set()).add(me)
    assert sorted(map(sorted, seen.values())) == sorted(sorted(g) for g in groups)  # one key a group


def test_buckets_put_every_peer_in_one_bucket_by_the_seed_alone():
    peers = [f"peer{i}" for i in range(100)]
    one, again, other = (
        twolevel.buckets("s1", peers, 6),
        twolevel.buckets("s1", peers[::-1], 6),
        twolevel.buckets("s2", peers, 6),
    )
    assert one == again  # the order peers were listed in changes nothing
    assert sorted(p for b in one for p in b) == sorted(peers)
    assert one != other  # another round's seed, other buckets: nobody picks their group
    for b, bucket in enumerate(one):
        for p in bucket:
            rank = int.from_bytes(hashlib.sha256(f"twolevel/s1/{p}".encode()).digest()[:8], "big")
            assert rank % 6 == b


def test_a_peer_knows_its_own_bucket_and_about_s_peers_of_a_round_are_heads():
    peers = [f"peer-{i:04d}" for i in range(1024)]
    filed = twolevel.buckets("seed-7", peers, 64)
    assert all(twolevel.bucket_of("seed-7", p, 64) == b for b, members in enumerate(filed) for p in members)
    heads = [sum(twolevel.is_head(f"seed-{r}", p, 1024) for p in peers) for r in range(20)]
    # about s = 16 of 1,024 a round: binomial(1024, 1/64), mean 16, standard deviation 3.97
    assert 14 <= sum(heads) / len(heads) <= 18 and min(heads) >= 4 and max(heads) <= 32, heads
    round_0 = {p for p in peers if twolevel.is_head("seed-0", p, 1024)}
    round_1 = {p for p in peers if twolevel.is_head("seed-1", p, 1024)}
    assert len(round_0 & round_1) <= 4  # another seed, other heads: nobody stays one by choice
    # spread over the buckets: no bucket of 64 holds more than 3 heads of a round
    assert max(Counter(twolevel.bucket_of("seed-0", p, 64) for p in round_0).values()) <= 3
    assert all(twolevel.is_head("s", p, 10) for p in peers[:10])  # a small run: every peer is one


def test_spans_owners_and_replicas_by_hand():
    assert twolevel.spans(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert twolevel.spans(2, 3) == [(0, 0), (0, 1), (1, 2)]
    group = ["a", "b", "c"]
    ranked = sorted(group, key=lambda p: int.from_bytes(hashlib.sha256(f"twolevel/s/{p}".encode()).digest()[:8], "big"))
    assert twolevel.owners("s", group, 5) == [ranked[0], ranked[1], ranked[2], ranked[0], ranked[1]]
    assert twolevel.replicas(0, 4) == (0, 1) and twolevel.replicas(3, 4) == (3, 0)


def test_a_partial_is_the_combination_times_the_weight_it_kept():
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    p = twolevel.partial(parts, [1.0, 3.0], "mean", CLIP, WEIGHT_CAP)
    assert p.weight == 4.0 and torch.equal(p.values, torch.tensor([10.0, 14.0]))  # 1·(1, 2) + 3·(3, 4)
    # aligned-clip drops a part against the median (one of three here), and its weight with it
    three = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.2]), torch.tensor([-1.0, -1.0])]
    a = twolevel.partial(three, [1.0, 1.0, 1.0], "aligned-clip", CLIP, WEIGHT_CAP)
    assert a.weight == 2.0
    assert torch.allclose(a.values, torch.tensor([2.0, 2.2]))


def test_a_group_weighs_in_stage_2_as_its_reducers_weigh_its_members():
    assert twolevel.group_weight([1.0, 2.0, 3.0], "mean", 2.0) == 6.0
    # clip: each weight at most 2 x the lower median of the positive ones (1): 1 + 1 + 2
    assert twolevel.group_weight([1.0, 1.0, 10.0], "clip", 2.0) == 4.0
    assert twolevel.group_weight([1.0, 1.0, 10.0], "centered-clip", 3.0) == 5.0
    # trimmed-mean: at most the lower median (2) each: 1 + 2 + 2
    assert twolevel.group_weight([1.0, 2.0, 10.0], "trimmed-mean", 2.0) == 5.0
    assert twolevel.group_weight([0.0, 0.0], "clip", 2.0) == 0.0
    assert twolevel.group_weight([-1.0, 2.0], "mean", 2.0) == 2.0  # a negative weight counts nothing


def test_levels_name_one_assembly_per_run_round_key_and_span():
    levels = twolevel.Levels(7, bytes(range(32)), groups=3, spans=16)
    assert levels.seed == bytes(range(32)).hex()
    keys = {
        twolevel.Levels(r, k, 3, 16, attempt=a).assembly_key(prefix, span)
        for r in (7, 8)
        for k in (bytes(32), bytes(range(32)))
        for a in (1, 2)
        for prefix in ("run.a", "run.b")
        for span in range(16)
    }
    assert len(keys) == 2 * 2 * 2 * 2 * 16 and not any("." in k for k in keys)  # hivemind's keys hold no '.'
    assert levels.assembly_key("my.run", 5) == "my_run_r7a1_span5of16_0001020304050607"
    # a retry binds its layouts and stage 2 to a key of its own; its buckets and owners are the round's
    retry = twolevel.Levels(7, bytes(range(32)), groups=3, spans=16, attempt=2)
    assert retry.key != levels.key and retry.seed == levels.seed
    assert levels.key == bytes(range(32)) + b"\x00\x01"


def test_sub_span_sums_cross_checks_equivocation_and_the_final_by_hand():
    parts = {0: Partial(torch.tensor([1.0, 2.0, 3.0]), 2.0), 2: Partial(torch.tensor([5.0, 6.0, 7.0]), 6.0)}
    out = twolevel.reduce_sub_span(1, 0, (1, 3), parts, "r")
    assert out.groups == (0, 2) and out.weight == 8.0 and torch.equal(out.values, torch.tensor([8.0, 10.0]))
    assert twolevel.cross_check(out, (1, 3), parts) is None
    lie = Output(1, 0, (0, 2), out.values * 2, 8.0, "r")
    assert "not the sum of the partials of groups [0, 2]" in twolevel.cross_check(lie, (1, 3), parts)
    assert twolevel.cross_check(lie, (1, 3), {0: parts[0]}) is None  # group 2's partial not here: no case
    assert "signed two different sums" in twolevel.equivocation(out, lie)
    assert twolevel.equivocation(out, Output(1, 0, (0, 2), out.values.clone(), 8.0, "r")) is None
    empty = Output(1, 1, (), torch.zeros(2), 0.0, "r")
    assert torch.equal(twolevel.final([empty, out]), torch.tensor([1.0, 1.25, 0.0, 0.0]))  # (span, sub) order


def test_the_secondary_settles_on_one_output():
    held = {0: Partial(torch.tensor([1.0, 1.0]), 1.0), 1: Partial(torch.tensor([2.0, 2.0]), 1.0)}
    primary = twolevel.reduce_sub_span(0, 0, (0, 2), held, "p")
    assert twolevel.settle(primary, 0, 0, (0, 2), held, "s").output is primary  # it checks: the primary's
    taken = twolevel.settle(None, 0, 0, (0, 2), held, "s").output
    assert taken.by == "s" and torch.equal(taken.values, primary.values)  # nothing came: its own
    liar = Output(0, 0, (0, 1), primary.values + 1, 2.0, "p")
    settled = twolevel.settle(liar, 0, 0, (0, 2), held, "s")
    assert settled.convicted == "p" and settled.output.by == "s" and torch.equal(settled.output.values, primary.values)
    assert twolevel.settle(None, 0, 0, (0, 2), {}, "s").output is None  # it holds nothing: no output
    assert twolevel.settle(primary, 0, 0, (0, 2), held, None).output is primary  # no secondary
    # A sum naming a partial the secondary does not hold cannot be checked: not taken, not convicted.
    unchecked = twolevel.settle(liar, 0, 0, (0, 2), {0: held[0]}, "s")
    assert unchecked.convicted is None and unchecked.output.by == "s" and unchecked.output.groups == (0,)


def test_cost_against_the_flat_butterfly():
    c = twolevel.cost(256, 16)
    assert c["flat_partners"] == 255 and c["two_level_partners"] == 15 + 2 * 15 == 45
    assert c["flat_bytes"] == pytest.approx(2 * 255 / 256)
    assert c["two_level_bytes"] == pytest.approx(2 * 15 / 16 + 3 / 16)  # +6 % over 2 (s - 1) / s
    assert twolevel.cost(8, 16)["two_level_partners"] == 7  # one group: the flat butterfly


# --- the simulator ------------------------------------------------------------------------------


@dataclass
class Faults:
    """What goes wrong in a round: senders that die in stage 1, owners that die after it (group,
    span), replicas that die in stage 2 ((span, sub, "primary" | "secondary")), primaries that
    sum wrong ((span, sub)), owners that send a partial their group did not seal ((group, span))."""

    senders: set[str] = field(default_factory=set)
    owners: set[tuple[int, int]] = field(default_factory=set)
    replicas: set[tuple[int, int, str]] = field(default_factory=set)
    liars: set[tuple[int, int]] = field(default_factory=set)
    forgers: set[tuple[int, int]] = field(default_factory=set)


@dataclass
class Ended:
    finished: dict[str, torch.Tensor]  # each finishing member's final vector
    outputs: dict[tuple[int, int], Output]
    convicted: set[str]
    failed: bool
    groups: list[tuple[str, ...]]


class Round:
    """One two-level round of virtual peers: deltas, weights, groups; `run(faults)` plays it."""

    def __init__(self, peers: int, size: int, numel: int, how: robust.Aggregator, codec: str, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.seed, self.size, self.how = f"digest-{seed}", size, how
        self.codec = codecs.get(codec)
        self.peers = [f"peer{i:04d}" for i in range(peers)]
        base = torch.randn(numel, generator=gen)  # honest pseudo-gradients point the same way
        self.delta = {p: base + 0.5 * torch.randn(numel, generator=gen) for p in self.peers}
        self.weight = {p: float(torch.randint(1, 1000, (1,), generator=gen)) for p in self.peers}
        self.groups = twolevel.groups_of(self.seed, self.peers, size)
        self.span_bounds = twolevel.spans(numel, size)
        self._decoded: dict[tuple[str, int], torch.Tensor] = {}

    def decoded(self, peer: str, k: int) -> torch.Tensor:
        """What span k's reducer decodes of `peer`'s part (the codec's loss in it)."""
        if (peer, k) not in self._decoded:
            a, b = self.span_bounds[k]
            self._decoded[(peer, k)] = self.codec.roundtrip(self.delta[peer][a:b])
        return self._decoded[(peer, k)]

    def stage1(self, faults: Faults) -> dict[tuple[int, int], Partial]:
        """(group, span) -> the partial its owner holds; none where the owner died."""
        out = {}
        for g, group in enumerate(self.groups):
            senders = [p for p in group if p not in faults.senders]
            for k in range(len(self.span_bounds)):
                if (g, k) in faults.owners or not senders:
                    continue
                parts = [self.decoded(p, k) for p in senders]
                made = twolevel.partial(parts, [self.weight[p] for p in senders], self.how, CLIP, WEIGHT_CAP)
                out[(g, k)] = Partial(made.values, made.weight, sealing.digests(made.values))
        return out

    def held_by(self, replica: int, k: int, j: int, made: dict, faults: Faults, convicted: set[str]) -> dict:
        """What group `replica`'s owner of span k holds of sub-span j: every partial that came and
        checks against the root its group sealed (its own unchecked); the owner of one that does
        not is convicted."""
        numel = self.span_bounds[k][1] - self.span_bounds[k][0]
        bounds = sealing.sub_spans(numel, len(self.groups))[j]
        held = {}
        for g in range(len(self.groups)):
            if (g, k) not in made:
                continue
            sealed = made[(g, k)]
            sent = Partial(sealed.values * 3 + 1, sealed.weight, sealed.digests) if (g, k) in faults.forgers else sealed
            piece = Partial(sent.values[bounds[0] : bounds[1]], sent.weight, sent.digests)
            root = sealing.root(k, sealed.weight, sealed.digests)
            if g != replica and sealing.refusal(piece, k, numel, bounds, root) is not None:
                convicted.add(self.owner(g, k))
                continue
            held[g] = sent
        return held

    def run(self, faults: Faults) -> Ended:
        made = self.stage1(faults)
        outputs, convicted, failed = {}, set(), False
        count = len(self.groups)
        for k, (a, b) in enumerate(self.span_bounds):
            for j, bounds in enumerate(sealing.sub_spans(b - a, count)):
                settled = self.stage2(k, j, bounds, made, faults, convicted)
                if settled.output is None:
                    failed = True
                    continue
                outputs[(k, j)] = settled.output
                if settled.convicted:
                    convicted.add(settled.convicted)
        if failed:
            return Ended({}, outputs, convicted, failed, self.groups)
        # Each group's members fetch every sub-span through their group's owner of its span, which
        # asked one replica or the other (by its id): one computation of the final per group.
        finished = {}
        for group in self.groups:
            fetched = [self.fetch(outputs[key], group) for key in sorted(outputs)]
            result = twolevel.final(fetched)
            finished |= {p: result for p in group if p not in faults.senders}
        return Ended(finished, outputs, convicted, failed, self.groups)

    def fetch(self, settled: Output, group: tuple[str, ...]) -> Output:
        """What a group's owner of the span got from the replica it asked: the settled output,
        held by both replicas (the primary serves only what its secondary decided)."""
        return Output(settled.span, settled.sub, settled.groups, settled.values.clone(), settled.weight, settled.by)

    def stage2(self, k: int, j: int, bounds: tuple[int, int], made: dict, faults: Faults, convicted: set[str]):
        """Sub-span j of span k: the primary's sum of what it holds, the secondary's decision on what it holds."""
        count = len(self.groups)
        first, second = twolevel.replicas(j, count)
        primary_id = self.owner(first, k) if (first, k) not in faults.owners else None
        secondary_id = self.owner(second, k) if (second, k) not in faults.owners and second != first else None
        if (k, j, "primary") in faults.replicas:
            primary_id = None
        if (k, j, "secondary") in faults.replicas:
            secondary_id = None
        held = [
            self.held_by(g, k, j, made, faults, convicted) if who else {}
            for g, who in ((first, primary_id), (second, secondary_id))
        ]
        primary = twolevel.reduce_sub_span(k, j, bounds, held[0], primary_id) if primary_id and held[0] else None
        if primary is not None and (k, j) in faults.liars:
            primary = Output(k, j, primary.groups, primary.values * 3 + 1, primary.weight, primary.by)
        return twolevel.settle(primary, k, j, bounds, held[1], secondary_id)

    def owner(self, g: int, k: int) -> str:
        return twolevel.owners(self.seed, self.groups[g], self.size)[k]

    def reference(self, faults: Faults) -> torch.Tensor:
        """The result by another road: per span and sub-span, the groups whose owner lived, each
        group's surviving senders' parts through the codec and robust.combine, times the weight
        kept, summed in group order, over the weights summed."""
        pieces = []
        count = len(self.groups)
        for k, (a, b) in enumerate(self.span_bounds):
            partial_of = {}
            for g, group in enumerate(self.groups):
                senders = [p for p in group if p not in faults.senders]
                if (g, k) in faults.owners or (g, k) in faults.forgers or not senders:
                    continue
                ws = [self.weight[p] for p in senders]
                combined, fates = robust.combine([self.decoded(p, k) for p in senders], ws, self.how, CLIP, WEIGHT_CAP)
                capped = ws if self.how == "mean" else robust.cap_weights(ws, WEIGHT_CAP)
                kept = math.fsum(w for w, f in zip(capped, fates) if f != "dropped" and w > 0)
                partial_of[g] = (combined * kept, kept)
            for start, end in sealing.sub_spans(b - a, count):
                total, weight = torch.zeros(end - start), 0.0
                for g in sorted(partial_of):
                    total += partial_of[g][0][start:end]
                    weight += partial_of[g][1]
                pieces.append(total / weight if weight > 0 else torch.zeros(end - start))
        return torch.cat(pieces)

    def flat_mean(self, faults: Faults) -> torch.Tensor:
        """The mean aggregator's result as one flat group: Σ wᵢx̂ᵢ / Σ wᵢ over every contribution
        left in, per value, in float64 (x̂: through the codec)."""
        numel = self.span_bounds[-1][1]
        total, weight = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
        for g, group in enumerate(self.groups):
            for p in group:
                if p in faults.senders:
                    continue
                for k, (a, b) in enumerate(self.span_bounds):
                    if (g, k) not in faults.owners | faults.forgers:
                        total[a:b] += self.weight[p] * self.decoded(p, k).double()
                        weight[a:b] += self.weight[p]
        return torch.where(weight > 0, total / weight.clamp(min=1e-30), torch.zeros_like(total))


@st.composite
def rounds(draw, peers: int, sizes: tuple[int, ...] = (4, 8, 16)):
    size = draw(st.sampled_from(sizes))
    how = draw(st.sampled_from(["mean", "clip", "aligned-clip", "trimmed-mean"]))
    codec = draw(st.sampled_from(["fp32", "int8"]))
    count = twolevel.group_count(peers, size)
    numel = size * max(count, 1) * 2 + draw(st.integers(0, 7))  # every sub-span holds values
    r = Round(peers, size, numel, how, codec, draw(st.integers(0, 2**16)))
    groups = len(r.groups)
    dead = draw(st.sets(st.sampled_from(r.peers), max_size=max(1, peers // 8)))
    owners = draw(st.sets(st.tuples(st.integers(0, groups - 1), st.integers(0, size - 1)), max_size=4))
    keys = st.tuples(st.integers(0, size - 1), st.integers(0, max(0, groups - 1)))
    one_replica = draw(st.sets(st.tuples(keys, st.sampled_from(["primary", "secondary"])), max_size=4))
    replicas = {(k, j, role) for (k, j), role in one_replica}
    # A primary whose secondary is gone is checked by nobody (docs/design.md: a gap of the design,
    # not simulated): liars are drawn where a secondary lives.
    liars = {
        (k, j)
        for k, j in draw(st.sets(keys, max_size=2))
        if groups > 1 and (twolevel.replicas(j, groups)[1], k) not in owners and (k, j, "secondary") not in replicas
    }
    drawn = draw(st.sets(keys, max_size=2))
    # One forger a span at most: two neighbours forging are both replicas of a sub-span colluding.
    forgers = {
        (g, k)
        for k, g in drawn
        if groups > 1
        and sum(1 for other, _ in drawn if other == k) == 1
        and forger_checked(g, k, groups, owners, replicas, liars)
        and set(r.groups[g]) - dead
    }
    return r, Faults(set(dead), owners, replicas, liars, forgers)


def forger_checked(g: int, k: int, groups: int, owners: set, replicas: set, liars: set) -> bool:
    """Whether group g's owner of span k, forging its partial, is checked by a replica that lives
    wherever it sums or decides: the decider of sub-span g (the next group's owner), and the
    primary of sub-span g - 1 (the previous group's), which must not lie itself. A replica alone
    is checked by nobody (docs/design.md: the design's gap, not simulated)."""
    before, after = (g - 1) % groups, (g + 1) % groups
    alive = (g, k) not in owners and (before, k) not in owners and (after, k) not in owners
    roles = (k, g, "secondary") not in replicas and (k, before, "primary") not in replicas
    return alive and roles and (k, before) not in liars


def check(r: Round, faults: Faults) -> None:
    ended = r.run(faults)
    every = sorted(p for group in r.groups for p in group)
    assert every == sorted(r.peers)  # every peer in exactly one group
    assert all(len(group) >= 2 for group in r.groups) or len(r.groups) == 1
    if ended.failed:  # a sub-span with neither replica (or no partial at all): nobody finishes
        assert not ended.finished
        return
    results = list(ended.finished.values())
    assert all(torch.equal(results[0], other) for other in results[1:])  # I1: one result
    assert torch.equal(results[0], r.reference(faults))  # the fixed-order reference, bit for bit
    if r.how == "mean":
        assert torch.allclose(results[0].double(), r.flat_mean(faults), rtol=1e-4, atol=1e-5)
    for (k, j), out in ended.outputs.items():  # what is left out is what the faults took out
        live = tuple(
            g
            for g in range(len(r.groups))
            if (g, k) not in faults.owners | faults.forgers and any(p not in faults.senders for p in r.groups[g])
        )
        assert out.groups == live, (k, j)
    summed = {
        (k, j)
        for k, j in faults.liars
        if (twolevel.replicas(j, len(r.groups))[0], k) not in faults.owners and (k, j, "primary") not in faults.replicas
    }
    forgers = {r.owner(g, k) for g, k in faults.forgers}  # refused by every replica they sent to
    assert ended.convicted == {r.owner(twolevel.replicas(j, len(r.groups))[0], k) for k, j in summed} | forgers


FEW = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(rounds(16))
def test_16_peers(case):
    check(*case)


@FEW
@given(rounds(64))
def test_64_peers(case):
    check(*case)


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rounds(256))
def test_256_peers(case):
    check(*case)


@settings(max_examples=1, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rounds(1024, sizes=(16,)))
def test_1024_peers(case):
    check(*case)


def test_a_round_without_faults_equals_the_flat_mean_and_one_without_a_sub_span_fails_alike():
    r = Round(64, 16, 16 * 4 * 3, "mean", "fp32", seed=1)
    assert [len(g) for g in r.groups] and len(r.groups) == 4
    clean = r.run(Faults())
    assert len(clean.finished) == 64 and not clean.convicted
    assert torch.allclose(next(iter(clean.finished.values())).double(), r.flat_mean(Faults()), rtol=1e-5, atol=1e-6)
    both = Faults(replicas={(2, 1, "primary"), (2, 1, "secondary")})
    ended = r.run(both)
    assert ended.failed and not ended.finished


def test_a_sum_of_a_group_alone_is_that_groups_partial_bit_for_bit_or_refused():
    own = Partial(torch.tensor([1.5, -0.0, 2.25, 3.0, -7.0]), 4.0)
    alone = twolevel.reduce_sub_span(2, 1, (2, 5), {3: own}, "owner")
    assert twolevel.lone_refusal(alone, 3, (2, 5), own) is None  # 0 + x is x, -0.0 included
    changed = Output(2, 1, (3,), alone.values + torch.tensor([0.0, 0.0, 1e-6]), 4.0, "owner")
    assert "owner's sum of sub-span 1 of span 2 is not this group's partial" in twolevel.lone_refusal(
        changed, 3, (2, 5), own
    )
    heavier = Output(2, 1, (3,), alone.values, 5.0, "owner")
    assert twolevel.lone_refusal(heavier, 3, (2, 5), own) is not None
    # A sum naming other groups too: the group's members cannot tell its share, and say nothing.
    both = twolevel.reduce_sub_span(2, 1, (2, 5), {0: Partial(torch.ones(5), 1.0), 3: own}, "owner")
    assert twolevel.lone_refusal(both, 3, (2, 5), own) is None
    assert twolevel.lone_refusal(changed, 0, (2, 5), own) is None  # another group's alone


def test_two_signed_sums_of_one_sub_span_convict_their_replica():
    """Real identity keys: the evidence is two statements, each verified under the replica's key."""
    key = RSAPrivateKey()
    held = {0: Partial(torch.ones(4), 1.0), 1: Partial(torch.full((4,), 2.0), 1.0)}
    honest = twolevel.reduce_sub_span(3, 2, (0, 4), held, "replica")
    other = Output(3, 2, honest.groups, honest.values + 0.5, honest.weight, "replica")
    signatures = [key.sign(o.statement()) for o in (honest, other)]
    public = key.get_public_key()
    assert all(public.verify(o.statement(), s) for o, s in zip((honest, other), signatures))
    assert "signed two different sums of sub-span 2 of span 3" in twolevel.equivocation(honest, other)
    assert not public.verify(other.statement(), signatures[0])  # one signature does not cover the other sum


# --- an output from another node ----------------------------------------------------------------


def test_an_output_goes_through_the_wire_and_back_bit_for_bit():
    out = Output(3, 5, (0, 2, 7), torch.tensor([1.5, -2.0, 3.25e-7]), 1234.5, "replica")
    back = twolevel.parse_output(out.statement(), "replica", groups=8, spans=16, numel=3)
    assert back == Output(3, 5, (0, 2, 7), back.values, 1234.5, "replica")
    assert torch.equal(back.values, out.values) and back.statement() == out.statement()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda raw: raw[:10], "not a sub-span output"),
        (lambda raw: raw[:-1], "bytes for 3 groups and 3 values"),
        (lambda raw: raw + b"\0", "bytes for 3 groups and 3 values"),
        (lambda raw: raw.replace(b"\x00\x00\x00\x07", b"\x00\x00\x00\x09", 1), r"not increasing indices below 8"),
        (
            lambda raw: raw.replace(b"\x00\x00\x00\x02\x00\x00\x00\x07", b"\x00\x00\x00\x07\x00\x00\x00\x02"),
            "increasing",
        ),
    ],
)
def test_a_malformed_output_is_one_clear_wire_error(change, why):
    raw = Output(3, 5, (0, 2, 7), torch.tensor([1.0, 2.0, 3.0]), 10.0, "r").statement()
    with pytest.raises(twolevel.WireError, match=why):
        twolevel.parse_output(change(raw), "r", groups=8, spans=16, numel=3)


def test_outputs_out_of_range_nan_or_of_negative_weight_are_refused():
    def raw(**kw):
        fields = {"span": 3, "sub": 5, "groups": (0, 2), "values": torch.ones(2), "weight": 1.0} | kw
        return Output(
            fields["span"], fields["sub"], fields["groups"], fields["values"], fields["weight"], "r"
        ).statement()

    for bad, why in [
        (raw(span=16), "out of range"),
        (raw(sub=8), "out of range"),
        (raw(weight=-1.0), "out of"),
        (raw(weight=math.inf), "not finite"),
        (raw(values=torch.tensor([1.0, math.nan])), "not finite"),
    ]:
        with pytest.raises(twolevel.WireError, match=why):
            twolevel.parse_output(bad, "r", groups=8, spans=16, numel=2)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_any_bytes_give_an_output_or_a_wire_error(raw):
    for candidate in (raw, twolevel.OUTPUT_TAG + raw):
        try:
            out = twolevel.parse_output(candidate, "r", groups=4, spans=4, numel=2)
        except twolevel.WireError:
            continue
        assert out.values.shape == (2,) and bool(torch.isfinite(out.values).all()) and out.weight >= 0
        assert list(out.groups) == sorted(set(out.groups)) and all(g < 4 for g in out.groups)


# --- a partial from another owner ---------------------------------------------------------------


def test_a_partial_goes_through_the_wire_and_back_and_anything_else_is_one_clear_wire_error():
    digests = (b"a" * 32, b"b" * 32)
    sent = twolevel.Partial(torch.tensor([1.5, -2.0, 3.25e-7]), 6.5, digests)
    raw = twolevel.partial_statement(b"round 7", 3, 5, 2, sent)
    span, sub, group, back = twolevel.parse_partial(raw, b"round 7", groups=8, spans=16, numel=3, pieces=2)
    assert (span, sub, group, back.weight, back.digests) == (3, 5, 2, 6.5, digests)
    assert torch.equal(back.values, torch.tensor([1.5, -2.0, 3.25e-7]))

    def bad(round_key=b"round 7", span=3, sub=5, group=2, weight=6.5, values=(1.0, 2.0, 3.0), digests=digests):
        return twolevel.partial_statement(
            round_key, span, sub, group, twolevel.Partial(torch.tensor(values), weight, digests)
        )

    for raw, why in [
        (bad()[:10], "not a partial"),
        (bad(round_key=b"round 8"), "another round"),
        (bad(round_key=b"round 77"), "another round"),
        (bad()[:-1], "bytes for 2 digests and 3 values"),
        (bad() + b"\0", "bytes for 2 digests and 3 values"),
        (bad(digests=digests[:1]), "bytes for 2 digests"),
        (bad(digests=digests[:1], values=(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0)), "1 digests"),
        (bad(span=16), "out of range"),
        (bad(sub=8), "out of range"),
        (bad(group=8), "out of range"),
        (bad(weight=-1.0), "out of"),
        (bad(weight=math.nan), "not finite"),
        (bad(values=(1.0, math.inf, 3.0)), "not finite"),
    ]:
        with pytest.raises(twolevel.WireError, match=why):
            twolevel.parse_partial(raw, b"round 7", groups=8, spans=16, numel=3, pieces=2)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_any_bytes_give_a_partial_or_a_wire_error(raw):
    head = twolevel.PARTIAL_TAG + b"\x00\x01k"
    for candidate in (raw, twolevel.PARTIAL_TAG + raw, head + raw):
        try:
            span, sub, group, partial = twolevel.parse_partial(candidate, b"k", groups=4, spans=4, numel=2, pieces=1)
        except twolevel.WireError:
            continue
        assert span < 4 and sub < 4 and group < 4 and partial.weight >= 0
        assert partial.values.shape == (2,) and bool(torch.isfinite(partial.values).all())
        assert len(partial.digests) == 1 and len(partial.digests[0]) == 32


# --- fixed spans on hivemind's partition ---------------------------------------------------------


def test_layout_by_hand():
    lay = twolevel.layout(1000, 16, 20)  # spans of 63 values: 4 parts of 16, padded to 16 x 64
    assert (lay.span_values, lay.parts_per_span, lay.part_values, lay.padded) == (64, 4, 16, 1024)
    assert twolevel.layout(10, 4, 100).padded == 12  # one part a span, 3 values each
    assert twolevel.fractions(["a", "b", "c"], ["b", "a", "b", "b"]) == [1, 3, 0]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 5000),
    st.sampled_from([2, 3, 4, 8, 10, 12, 16]),
    st.integers(1, 300),
    st.lists(st.integers(0, 9), min_size=1, max_size=9),
)
def test_hivemind_gives_each_member_exactly_its_spans(numel, spans, max_part, weights):
    """The real hivemind partition (TensorPartContainer: whole parts to peers at the pivots of
    their fractions) puts every span boundary of `layout` between two parts, and gives each member
    exactly `fractions` spans, in group order: the same spans in every group."""
    from hivemind.averaging.partition import TensorPartContainer

    lay = twolevel.layout(numel, spans, max_part)
    assert lay.padded >= numel and lay.part_values <= max_part
    members = [f"m{i}" for i in range(len(weights))]
    rates = {m: float(w) for m, w in zip(members, weights)}
    owner_of = twolevel.owners("seed", members, spans, rates=rates if any(weights) else None)
    counts = twolevel.fractions(members, owner_of)
    assert sum(counts) == spans
    container = TensorPartContainer(
        [torch.arange(lay.padded, dtype=torch.float32)], counts, part_size_bytes=4 * lay.part_values
    )
    start = 0
    for member, count in enumerate(counts):
        parts = [part for part, _ in container._input_parts_by_peer[member]]
        got = torch.cat(parts) if parts else torch.zeros(0)
        end = start + count * lay.span_values
        assert torch.equal(got, torch.arange(start, end, dtype=torch.float32)), (member, counts)
        start = end
