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


def test_the_audit_is_quadratic_in_the_group():
    chunk = codecs.CHUNK_VALUES * codecs.get("int8").bytes_per_value()
    four = [peer(f"p{i}", 1.0, 1.0) for i in range(4)]
    eight = [peer(f"p{i}", 1.0, 1.0) for i in range(8)]
    assert sm.audit_s(four) == pytest.approx(3 * 4 * 4 * chunk / MB)
    assert sm.audit_s(eight) / sm.audit_s(four) == pytest.approx(7 * 8 / (3 * 4))


def test_two_levels_of_one_group_are_the_flat_butterfly_and_owners_follow_uploads():
    rng = random.Random(1)
    peers = sm.draw_peers(8, 0.0, rng)
    assert sm.two_level(peers, 10 * MB, 16, 0.0, 0.08, rng) == sm.flat(peers, 10 * MB, 0.0, 0.08)
    group = [peer("fast", 3.0, 10.0), peer("slow", 1.0, 10.0)]
    assert sm.owned_spans(group, 16) == [12, 4]  # D'Hondt on uploads 3 : 1
