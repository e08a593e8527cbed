"""A group's partial as its members seal it, and a replica's check of an owner's partial
(protocol/partials.py): pieces and sub-spans by hand, the same bytes on every member, and every way
an owner can send what its group did not compute."""

import hashlib
import struct

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.protocol import partials, twolevel


def test_pieces_and_sub_spans_by_hand():
    assert partials.chunk_bounds(5) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]  # fewer values than CHUNKS
    assert len(partials.chunk_bounds(10_000)) == partials.CHUNKS
    assert partials.chunk_bounds(0) == []
    # 10 values, 3 groups: pieces of one value, runs of 3, 3 and 4 (what stage 2 cut before).
    assert partials.sub_spans(10, 3) == [(0, 3), (3, 6), (6, 10)]
    # 2,050 values: 1,024 pieces, of 2 values but the two of 3 (at 1,023 and 2,047 by spans' rounding);
    # 3 groups take 341, 341 and 342 pieces.
    pieces = partials.chunk_bounds(2050)
    assert sum(1 for a, b in pieces if b - a == 3) == 2 and pieces[-1] == (2047, 2050)
    runs = [(0, pieces[340][1]), (pieces[341][0], pieces[681][1]), (pieces[682][0], 2050)]
    assert partials.sub_spans(2050, 3) == runs
    # More groups than pieces: the last sub-spans are empty, none overlap, all of the span is covered.
    assert partials.sub_spans(2, 3) == [(0, 0), (0, 1), (1, 2)]
    for numel in (1, 7, 1023, 1025, 5000):
        for groups in (1, 2, 3, 16, 40):
            cut = partials.sub_spans(numel, groups)
            assert cut[0][0] == 0 and cut[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
            starts = {a for a, _ in partials.chunk_bounds(numel)} | {numel}
            assert all(start in starts and end in starts for start, end in cut)  # whole pieces


def test_a_digest_and_a_root_by_hand():
    values = torch.tensor([1.0, -2.5, 3.0])
    assert partials.digest(values) == hashlib.sha256(struct.pack(">3f", 1.0, -2.5, 3.0)).digest()
    digests = partials.digests(values)
    assert digests == tuple(hashlib.sha256(struct.pack(">f", v)).digest() for v in (1.0, -2.5, 3.0))
    root = hashlib.sha256(partials.ROOT_TAG + struct.pack(">Id", 4, 2.5) + b"".join(digests)).digest()
    assert partials.root(4, 2.5, digests) == root
    assert partials.root(5, 2.5, digests) != root and partials.root(4, 2.0, digests) != root


def test_every_member_computes_the_same_partial_bytes():
    average = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    weight = 7.123456789
    a, b = partials.of_group(average, weight), partials.of_group(average.clone(), weight)
    assert a.values.dtype == torch.float32 and torch.equal(a.values, b.values) and a.digests == b.digests
    # By hand, in numpy: each value times the weight rounded to fp32, the product rounded to fp32.
    by_hand = average.numpy() * np.float32(weight)
    assert by_hand.dtype == np.float32
    assert np.array_equal(a.values.numpy(), by_hand)
    assert a.weight == weight and len(a.digests) == partials.CHUNKS


def sealed(numel=50, groups=3, weight=2.0):
    group = partials.of_group(torch.arange(numel, dtype=torch.float32) / 7, weight)
    return group, partials.root(1, group.weight, group.digests), partials.sub_spans(numel, groups)


def piece_of(group, bounds, values=None, weight=None, digests=None):
    start, end = bounds
    return twolevel.Partial(
        group.values[start:end].clone() if values is None else values,
        group.weight if weight is None else weight,
        group.digests if digests is None else digests,
    )


def test_a_replica_takes_what_the_group_sealed_and_nothing_else():
    group, root, cut = sealed()
    for bounds in cut:
        assert partials.refusal(piece_of(group, bounds), 1, 50, bounds, root) is None
    bounds = cut[1]
    start, end = bounds
    changed = group.values[start:end].clone()
    changed[2] += 1e-6  # one value (value 18 of 50: sub-span 1 is values 16-32), one ulp or so
    assert bounds == (16, 33)
    assert "piece 18" in partials.refusal(piece_of(group, bounds, values=changed), 1, 50, bounds, root)
    assert "weight" in partials.refusal(piece_of(group, bounds, weight=4.0), 1, 50, bounds, root)
    # Values times 100 with digests made for them: the root the members sealed does not match.
    forged = partials.of_group(group.values * 100, group.weight)
    assert "digests" in partials.refusal(piece_of(forged, bounds), 1, 50, bounds, root)
    assert "digests" in partials.refusal(piece_of(group, bounds, digests=group.digests[:-1]), 1, 50, bounds, root)
    assert "digests" in partials.refusal(piece_of(group, bounds), 2, 50, bounds, root)  # another span's root
    # The sub-span of another replica, sent to this one: its pieces are not this sub-span's.
    assert partials.refusal(piece_of(group, cut[0]), 1, 50, cut[1], root) is not None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(0, 49), st.floats(-1e3, 1e3, allow_nan=False), st.integers(0, 2))
def test_any_one_value_changed_is_refused(at, delta, sub):
    group, root, cut = sealed()
    start, end = cut[sub]
    values = group.values[start:end].clone()
    if not start <= at < end or float(values[at - start] + delta) == float(values[at - start]):
        return
    values[at - start] += delta
    assert partials.refusal(piece_of(group, cut[sub], values=values), 1, 50, cut[sub], root) is not None
