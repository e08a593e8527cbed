"""Bandwidth-aware reduction: measured figures that cannot spiral down, claims that cannot take over."""

import math

import torch

from p2p_diloco.protocol import links


def test_lower_median_caps_a_liar():
    # Honest peers at 10, 12 and 20 MB/s; a liar claims 1e12. Lower median of the four = 12: cap 48.
    assert links.fair_bandwidths([10.0, 12.0, 20.0, 1e12]) == [10.0, 12.0, 20.0, 48.0]


def test_two_peers_a_liar_gets_at_most_cap_shares():
    fair = links.fair_bandwidths([5.0, 1e15])
    assert fair == [5.0, 20.0]  # lower median of two is the honest figure
    assert fair[1] / sum(fair) == 0.8  # never the sole reducer


def test_garbage_claims_count_as_none_and_zero_stays_zero():
    assert links.fair_bandwidths([10.0, float("nan"), "fast", -3.0, True, 0.0, math.inf]) == [
        10.0,
        None,
        None,
        None,
        None,
        0.0,
        None,
    ]
    assert links.fair_bandwidths([None, None]) == [None, None]


def test_honest_figures_within_the_cap_are_untouched():
    assert links.fair_bandwidths([1.0, 2.0, 3.9]) == [1.0, 2.0, 3.9]


def test_figures_the_probes_cannot_tell_apart_count_as_equal():
    # Four equal links probed at 2.44, 2.97, 2.98, 2.98 MB/s (bench/allreduce.py): lower median
    # 2.97; 2.44 is within 1.25x of it (2.97 / 1.25 = 2.376), so every member gets the same span.
    assert links.settled_bandwidths([2.44e6, 2.98e6, 2.97e6, 2.98e6]) == [2.97e6] * 4
    # A real difference stays: lower median 3; 1 and 10 are beyond 1.25x, 3.5 is not (3.75).
    assert links.settled_bandwidths([1.0, 3.0, 3.5, 10.0]) == [1.0, 3.0, 3.0, 10.0]
    # At the edges: 3.75 = 3 x 1.25 is the same link, 3.76 is not; 2.4 = 3 / 1.25 is, 2.39 is not.
    assert links.settled_bandwidths([3.0, 3.75, 3.76, 2.4, 2.39, 3.0]) == [3.0, 3.0, 3.76, 3.0, 2.39, 3.0]
    # No claim (None: the balancer's mean) and 0 (reduces nothing) are left alone.
    assert links.settled_bandwidths([None, 0.0, 5.0, 6.0]) == [None, 0.0, 5.0, 5.0]
    assert links.settled_bandwidths([None, 0.0]) == [None, 0.0]


def test_meter_announces_the_slower_direction_of_its_best_recent_probes():
    meter = links.LinkMeter()
    assert meter.bandwidth() is None
    meter.sent(1000.0)  # a receiver saw this peer's probe arrive at 1000 B/s: its upload
    assert meter.bandwidth() == 1000.0  # the one direction measured so far
    meter.received("p1", 2000.0)  # p1's probe arrived at 2000 B/s: its download
    assert meter.bandwidth() == 1000.0
    meter.sent(100.0)  # a probe to a slow receiver: not a slower link
    assert meter.bandwidth() == 1000.0
    for _ in range(links.RECENT):
        meter.sent(300.0)
    assert meter.bandwidth() == 300.0  # the old figure ages out: a link that got slower is believed
    meter.received("p2", 50.0)
    meter.received("p1", float("nan"))  # nothing measured: ignored
    assert meter.seen() == {"p1": 2000.0, "p2": 50.0}


def test_probe_rate_leaves_out_the_first_chunk():
    # Chunks of 100 bytes at t = 5 (after connection set-up), 6, 7, 8: 300 bytes in 3 s.
    assert links.probe_rate([(5.0, 100), (6.0, 100), (7.0, 100), (8.0, 100)]) == 100.0
    assert links.probe_rate([(5.0, 100)]) is None
    assert links.probe_rate([(5.0, 100), (5.0, 100)]) is None


def test_probe_size_is_an_eighth_of_the_payload_within_bounds():
    assert links.probe_size(10) == links.PROBE_MIN
    assert links.probe_size(40 * 2**20) == 5 * 2**20
    assert links.probe_size(10**12) == links.PROBE_MAX
    assert links.probe_size(40 * 2**20 + 12345) % links.PROBE_CHUNK == 0


def test_a_claim_counts_up_to_what_others_measured_of_it():
    members = ["a", "b", "c"]
    claims = [100.0, 1e12, 50.0]
    seen_by = [{"b": 80.0, "c": 40.0}, {"a": 90.0, "c": 45.0}, {"a": 95.0, "b": 70.0, "c": 1e9}]
    # a: min(100, max(90, 95)); b: min(1e12, max(80, 70)); c: min(50, max(40, 45)) - its own 1e9 is ignored
    assert links.vouched_bandwidths(members, claims, seen_by) == [95.0, 80.0, 45.0]


def test_unmeasured_or_malformed_claims_count_as_none():
    members = ["a", "b", "c"]
    seen_by = [{"b": "fast"}, ["a", 10.0], {"a": 30.0, "b": float("inf")}]
    # b: only garbage vouches; c: nobody measured it; a: vouched 30 but claimed garbage
    assert links.vouched_bandwidths(members, [20.0, 5.0, 5.0], seen_by) == [20.0, None, None]
    assert links.vouched_bandwidths(members, ["x", 5.0, 5.0], seen_by) == [None, None, None]


def test_no_member_reduces_more_than_its_share_cap():
    # The balancer gave the fast peer everything: capped at half, the rest split equally.
    assert links.cap_shares([1.0, 0.0, 0.0], [True, True, True], 0.5) == [0.5, 0.25, 0.25]
    # Already within the cap: unchanged. A client keeps 0.
    assert links.cap_shares([0.4, 0.4, 0.2, 0.0], [True, True, True, False], 0.5) == [0.4, 0.4, 0.2, 0.0]
    assert links.cap_shares([1.0, 0.0], [True, False], 0.5) == [1.0, 0.0]  # the only reducer reduces all
    # Two eligible members and a cap of 0.3: they cannot cover the vector, so each takes 1/2.
    assert links.cap_shares([0.9, 0.1], [True, True], 0.3) == [0.5, 0.5]
    # Water-filling over two steps: 0.7 -> 0.4 gives 0.1 each to the others; 0.45 -> 0.4 again.
    shares = links.cap_shares([0.7, 0.35, 0.05, 0.0], [True, True, True, True], 0.4)
    assert max(shares) <= 0.4 + 1e-12 and abs(sum(shares) - 1) < 1e-12, shares


def test_a_small_vector_is_cut_so_that_every_reducer_gets_parts():
    mib = 2 * 1024 * 1024
    # The tiny preset at scaled-fp16 (943,267 bytes with the exact tensor) among 3 reducers: 12
    # parts of ceil(943,267 / 12) bytes, about 4 per member.
    assert links.part_bytes(943_267, 3, mib) == 78_606
    assert links.part_bytes(943_267, 2, mib) == 117_909
    # A big model keeps the measured 2 MiB; a very small vector is not cut below 64 KiB.
    assert links.part_bytes(500_000_000, 8, mib) == mib
    assert links.part_bytes(4_000, 3, mib) == links.MIN_PART_BYTES
    # No reducer (all clients) and an empty vector still give a valid size.
    assert links.part_bytes(943_267, 0, mib) == math.ceil(943_267 / 4)
    assert links.part_bytes(0, 3, mib) == links.MIN_PART_BYTES
    assert links.part_bytes(943_267, 3, 1024) == 1024  # never above the largest


def test_the_part_size_spreads_a_small_vector_over_the_members_in_hivemind_s_layout():
    """hivemind's own layout (TensorPartContainer), which gives each part whole to one member."""
    from hivemind.averaging.partition import TensorPartContainer

    tensors = [torch.zeros(235_000)]  # 940 kB in fp32
    fractions = [1 / 3, 1 / 3, 1 / 3]
    whole = TensorPartContainer(tensors, fractions, part_size_bytes=2 * 1024 * 1024)
    assert sorted(whole.num_parts_by_peer) == [0, 0, 1]  # before: one member reduced everything
    cut = TensorPartContainer(tensors, fractions, part_size_bytes=links.part_bytes(940_000, 3, 2 * 1024 * 1024))
    # 78,334 bytes make parts of 19,583 values: 12 of them and a 13th of the 4 values left over.
    assert cut.num_parts_by_peer == (4, 4, 5)


def test_a_peer_probes_only_the_members_it_holds_a_direct_connection_to():
    # A, B and C were in the last group; this peer holds direct connections to C and A (and to D,
    # not a member): it probes A and C, in the group's order; B (a home nobody punched to) only
    # through a relay, so not at all.
    assert links.probe_targets(["A", "B", "C"], {"C", "A", "D"}) == ["A", "C"]
    assert links.probe_targets(["A", "B"], set()) == []


def test_a_sweep_sends_no_probe_to_a_member_it_reaches_only_through_a_relay():
    import asyncio
    import time

    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.averaging.probes import LinkProber

    direct, relayed = (PeerID(bytes([0x12, 0x20, i]) + bytes(31)) for i in (1, 2))
    probed = []

    class Stub:
        def __init__(self, peer):
            self.peer = peer

        async def rpc_probe(self, messages):
            probed.append(self.peer)

            async def replies():
                yield averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, weight=5e6)

            return replies()

    async def connections():
        return {direct.to_base58()}

    async def admitted(_peer, _door):
        return True

    prober = LinkProber(Stub, admitted, connections)
    peers = [relayed.to_base58(), direct.to_base58()]
    reports = asyncio.run(prober.sweep(peers, links.PROBE_MIN, time.monotonic() + 10))
    assert probed == [direct] and reports == {direct.to_base58(): 5e6}
