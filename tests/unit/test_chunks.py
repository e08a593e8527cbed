"""A state downloaded in chunks from several holders (protocol/chunks.py, network.download_chunked):
which chunk goes to whom, a lying holder dropped after one chunk, a dropped connection costing
only its chunk, manifests that disagree, and manifests parsed with bounds. Expected values by hand."""

import hashlib

import pytest
import torch

from p2p_diloco.errors import StateDownloadError
from p2p_diloco.protocol import chunks
from p2p_diloco.protocol.network import Assembled, download_chunked
from p2p_diloco.trust.wire import WireError

A, B, C, D = "QmAAA", "QmBBB", "QmCCC", "QmDDD"
DIGEST, OTHER = "ab" * 16, "cd" * 16


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def four_chunks() -> chunks.Manifest:
    """A state of two tensors of 100 000 bytes: chunks of 64 KiB, the last of 3392 bytes."""
    return chunks.Manifest(7, DIGEST, (100_000, 100_000), 65536, tuple(sha(bytes([i])) for i in range(4)))


def test_chunk_size_follows_the_state_size():
    assert chunks.chunk_bytes_for(1_440_000_000) == 4 * 1024 * 1024  # 150M parameters: 344 chunks of 4 MiB
    assert chunks.chunk_bytes_for(20_000_000) == 5 * 65536  # 20e6 / 64 = 312 500, up to 5 × 64 KiB
    assert chunks.chunk_bytes_for(900_000) == 65536  # a tiny state: 14 chunks of the smallest size


def test_a_chunk_across_two_tensors_is_cut_at_their_border():
    m = four_chunks()
    assert m.span(1) == (65536, 131072) and m.span(3) == (196608, 200000)
    assert chunks.pieces(m.parts, *m.span(1)) == [(0, 65536, 100000), (1, 0, 31072)]
    assert chunks.pieces(m.parts, *m.span(3)) == [(1, 96608, 100000)]


def test_the_manifest_hashes_each_chunk_of_the_tensors_bytes():
    theta, momentum = bytes(range(256)) * 400, bytes(100_000)  # 102 400 and 100 000 bytes
    m = chunks.manifest_of(3, DIGEST, [memoryview(theta), memoryview(momentum)])
    whole = theta + momentum
    assert m.chunk_bytes == 65536 and len(m.hashes) == 4  # 202 400 bytes: 3 × 65 536 + 5 792
    assert m.hashes == tuple(sha(whole[i * 65536 : (i + 1) * 65536]) for i in range(4))
    assert chunks.parse_manifest(m.encode(), limit=202_400) == m


@pytest.mark.parametrize(
    "change, why",
    [
        ({"parts": [100_000, 100_002]}, "not fp32"),
        ({"parts": [100_000, 100_000, 4, 4, 4]}, "more tensors than θ and momentum"),
        ({"parts": [200_000, 200_000]}, "more than the model's state"),
        ({"chunk_bytes": 1024}, "chunks too small"),
        ({"chunk_bytes": 8 << 20}, "chunks too big"),
        ({"hashes": [sha(b"")] * 5}, "one hash too many"),
        ({"hashes": ["zz" * 32] * 4}, "not hex"),
        ({"digest": "x"}, "malformed digest"),
        ({"round": -1}, "negative round"),
    ],
)
def test_a_malformed_or_oversized_manifest_is_refused(change, why):
    value = {**four_chunks().encode(), **change}
    with pytest.raises(WireError):
        chunks.parse_manifest(value, limit=300_000)


def test_a_manifest_is_no_mapping():
    with pytest.raises(WireError):
        chunks.parse_manifest([1, 2], limit=300_000)


def test_chunks_are_dealt_in_turns_and_the_end_is_asked_twice():
    plan = chunks.start(four_chunks(), [A, B, C])
    plan, asked = chunks.assign(plan, per_holder=2)
    # 4 chunks, 3 holders: each takes the next free chunk in turn, then the idle ones ask for a
    # chunk one other holder is sending (the fewest senders, the lowest index), never their own.
    assert asked == [(0, A), (1, B), (2, C), (3, A), (0, B), (1, C)]
    assert chunks.assign(plan, per_holder=2)[1] == []  # everyone has 2 on their way


def test_a_holder_that_lies_about_one_chunk_is_dropped_and_its_chunk_asked_of_another():
    m = four_chunks()
    plan, asked = chunks.assign(chunks.start(m, [A, B, C]), per_holder=1)
    assert asked == [(0, A), (1, B), (2, C)]
    plan = chunks.received(plan, B, 1, sha(b"a lie"))
    assert plan.dropped.keys() == {B} and plan.liars == {B} and "chunk 1" in plan.dropped[B]
    plan = chunks.received(plan, A, 0, m.hashes[0])
    plan, asked = chunks.assign(plan, per_holder=1)
    assert asked == [(1, A)]  # B's chunk goes to A; C still sends 2
    plan = chunks.received(plan, C, 2, m.hashes[2])
    plan, asked = chunks.assign(plan, per_holder=1)
    assert asked == [(3, C)]
    plan = chunks.received(chunks.received(plan, A, 1, m.hashes[1]), C, 3, m.hashes[3])
    assert plan.done and plan.have == {0, 1, 2, 3} and plan.live == [A, C]


def test_a_dropped_connection_costs_its_chunk_and_two_cost_the_holder():
    m = four_chunks()
    plan, _ = chunks.assign(chunks.start(m, [A, B]), per_holder=1)  # (0, A), (1, B)
    plan = chunks.received(plan, B, 1, m.hashes[1])
    plan = chunks.failed(plan, A, 0, "ConnectionResetError")
    assert plan.failures == {A: 1} and not plan.dropped and plan.have == {1}
    plan, asked = chunks.assign(plan, per_holder=1)
    assert asked == [(0, A), (2, B)]  # only what is missing, chunk 1 is kept
    plan = chunks.failed(plan, A, 0, "silent for 30 s")
    assert plan.dropped.keys() == {A} and not plan.liars  # failing is no lie: it is not refused later
    plan, asked = chunks.assign(plan, per_holder=1)
    assert asked == []  # B is still busy with 2; chunk 0 waits for it
    plan = chunks.received(plan, B, 2, m.hashes[2])
    assert chunks.assign(plan, per_holder=1)[1] == [(0, B)]


def test_a_resumed_download_asks_only_for_the_missing_chunks():
    plan = chunks.start(four_chunks(), [A, B], have=[0, 2, 9])  # 9: no such chunk
    assert plan.have == {0, 2}
    assert chunks.assign(plan, per_holder=1)[1] == [(1, A), (3, B)]


def test_a_plan_with_every_holder_dropped_is_stuck():
    m = four_chunks()
    plan, _ = chunks.assign(chunks.start(m, [A]), per_holder=1)
    assert not chunks.stuck(plan)
    plan = chunks.lied(plan, A, 0, "sent 70 000 bytes")
    assert chunks.stuck(plan) and plan.liars == {A}


def test_holders_that_send_the_same_manifest_vote_for_it():
    honest, other = four_chunks(), chunks.Manifest(7, DIGEST, (100_000, 100_000), 65536, (sha(b"x"),) * 4)
    moved_on = chunks.Manifest(8, OTHER, (100_000, 100_000), 65536, (sha(b"y"),) * 4)
    groups = chunks.manifest_groups({A: honest, D: other, B: honest, C: moved_on}, 7, DIGEST)
    assert groups == [(honest, [A, B]), (other, [D])]  # C's state is not the one asked for
    tie = chunks.manifest_groups({A: honest, D: other}, 7, DIGEST)
    assert [m for m, _ in tie] == sorted([honest, other], key=lambda m: m.root)


STATE = [torch.ones(3), torch.zeros(3)]


def fetched(tensors=STATE, liars=frozenset(), dropped=None, problem=""):
    return lambda manifest, holders: Assembled(tensors, problem, dict(dropped or {}), liars)


def test_a_state_from_the_majority_manifest_is_returned_when_it_has_the_agreed_digest():
    m = four_chunks()
    got = download_chunked(lambda peers: {p: m for p in peers}, fetched(), [A, B, C], lambda *_: DIGEST, (7, DIGEST))
    assert got == ([A, B, C], ({"round": 7, "digest": DIGEST}, STATE))


def test_without_manifests_the_caller_asks_one_holder_at_a_time():
    assert download_chunked(lambda peers: {}, fetched(), [A], lambda *_: DIGEST, (7, DIGEST)) is None

    def broken(peers):
        raise TimeoutError("the averager process did not answer")

    assert download_chunked(broken, fetched(), [A], lambda *_: DIGEST, (7, DIGEST)) is None


def test_a_majority_manifest_of_a_wrong_state_costs_one_download_then_the_next_is_tried():
    lie, honest = chunks.Manifest(7, DIGEST, (100_000, 100_000), 65536, (sha(b"x"),) * 4), four_chunks()
    asked = []

    def fetch(manifest, holders):
        asked.append(holders)
        return Assembled([torch.full((3,), float(manifest is lie)), torch.zeros(3)], "", {}, frozenset())

    def verify(metadata, tensors):
        return OTHER if tensors[0][0] == 1 else DIGEST

    got = download_chunked(lambda p: {A: lie, B: lie, C: honest}, fetch, [A, B, C], verify, (7, DIGEST))
    assert asked == [[A, B], [C]] and got is not None and got[0] == [C]


def test_a_holder_dropped_from_a_download_that_succeeded_is_named_in_the_log():
    said = []
    m = four_chunks()
    got = download_chunked(
        lambda peers: {p: m for p in peers},
        fetched(liars=frozenset({B}), dropped={B: "chunk 1 hashes to 0c…"}),
        [A, B],
        lambda *_: DIGEST,
        (7, DIGEST),
        say=lambda fmt, *args: said.append(fmt % args),
    )
    assert got is not None and said == [f"lying holder {B} was asked for no more chunks: chunk 1 hashes to 0c…"]


def test_liars_and_wrong_states_are_named_so_the_catch_up_asks_them_no_more():
    m = four_chunks()
    with pytest.raises(StateDownloadError) as e:
        download_chunked(
            lambda peers: {p: m for p in peers},
            fetched(None, frozenset({B}), {B: "chunk 1 hashes to …", C: "2 failed chunks"}, "every holder was dropped"),
            [A, B, C],
            lambda *_: DIGEST,
            (7, DIGEST),
        )
    assert e.value.served == {B: (7, None)}  # C only failed: it may be asked again
    assert "every holder was dropped" in str(e.value)
    with pytest.raises(StateDownloadError) as e:
        download_chunked(lambda peers: {A: m}, fetched(), [A], lambda *_: OTHER, (7, DIGEST))
    assert e.value.served == {A: (7, OTHER)}


def test_a_download_the_averager_process_failed_blames_no_holder():
    def broken(manifest, holders):
        raise TimeoutError("the averager process did not answer")

    m = four_chunks()
    with pytest.raises(StateDownloadError) as e:
        download_chunked(lambda peers: {A: m, B: m}, broken, [A, B], lambda *_: DIGEST, (7, DIGEST))
    assert e.value.served == {} and "TimeoutError the averager process did not answer" in str(e.value)
