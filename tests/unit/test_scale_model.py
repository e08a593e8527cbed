"""bench/scale_model.py's pieces against figures worked by hand."""

from __future__ import annotations

import random

import pytest

from bench import scale_model as sm
from p2p_diloco.protocol import codecs

MB = 1e6


def peer(name: str, up_mb: float, down_mb: float, nat: bool = False) -> sm.Peer:
    return sm.Peer(name, up_mb * MB, down_mb * MB, nat)


def test_a_butterfly_of_equal_peers_is_2_m_over_n_minus_1_over_the_link():
    group = [peer(f"p{i}", 1.0, 4.0) for i in range(4)]
    assert sm.shares(group) == [0.25] * 4
    # each sends 3/4 M of its own and 3 x 1/4 M of averages: 1.5 M over 1 MB/s
    assert sm.butterfly_s(group, 100 * MB) == pytest.approx(150.0)


def test_a_peer_behind_nat_reduces_nothing_and_shares_are_capped_at_half():
    group = [peer("a", 1.0, 10.0), peer("b", 3.0, 10.0), peer("c", 2.0, 10.0, nat=True)]
    assert sm.shares(group) == pytest.approx([0.5, 0.5, 0.0])  # b's 0.75 capped at 0.5, the rest to a
    # a and b each send 0.5 M of their own and 0.5 M of averages to each of 2 others: 150 MB, over
    # 1 and 3 MB/s; c sends its whole Δ over 2 MB/s: 50 s; a is the slowest
    assert sm.butterfly_s(group, 100 * MB) == pytest.approx(150.0)


def test_the_audit_is_linear_in_the_group():
    # Each reducer's 4 audited chunks have 2 checkers of its g - 1 others, every sender's chunk of
    # each. Four reducers at 1 MB/s: a member is dealt 4 x 2 / 3 of each of 3 spans (8 items of 4
    # chunks: 32 chunks), a reducer answers 4 x 2 items of 4 chunks (32); eight: 64 and 64. When
    # every member checked every item: 3 x 4 x 4 = 48 and 7 x 8 x 4 = 224 (quadratic).
    chunk = codecs.CHUNK_VALUES * codecs.get("int8").bytes_per_value()
    three = [peer(f"p{i}", 1.0, 1.0) for i in range(3)]
    four = [peer(f"p{i}", 1.0, 1.0) for i in range(4)]
    eight = [peer(f"p{i}", 1.0, 1.0) for i in range(8)]
    assert sm.audit_s(three) == pytest.approx(2 * 3 * 4 * chunk / MB)  # both others check every item
    assert sm.audit_s(four) == pytest.approx(32 * chunk / MB)
    assert sm.audit_s(eight) == pytest.approx(64 * chunk / MB)


def test_two_levels_of_one_group_are_the_flat_butterfly_and_owners_follow_uploads():
    rng = random.Random(1)
    peers = sm.draw_peers(8, 0.0, rng)
    assert sm.two_level(peers, 10 * MB, 16, 0.0, 0.08, rng) == sm.flat(peers, 10 * MB, 0.0, 0.08)
    group = [peer("fast", 3.0, 10.0), peer("slow", 1.0, 10.0)]
    assert sm.owned_spans(group, 16) == [12, 4]  # D'Hondt on uploads 3 : 1
