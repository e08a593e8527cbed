"""Chunks served and fetched (swarm/averaging/chunked.py), in one process: holders' ChunkServers
answer a joiner's ChunkFetcher through stubs that stand in for libp2p. A lying holder costs one
chunk, a dropped connection only the chunk in flight, and a second try resumes."""

import asyncio
import time

import torch
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.protocol import chunks
from p2p_diloco.swarm.averaging import chunked

A, B, C = "QmAAA", "QmBBB", "QmCCC"
DIGEST = "ab" * 16
# θ and momentum of 40 000 values each: 320 000 bytes, 5 chunks of 64 KiB (the last 57 856 bytes)
THETA, MOMENTUM = torch.arange(40_000, dtype=torch.float32), torch.arange(40_000, dtype=torch.float32) / 7


def server() -> chunked.ChunkServer:
    async def current():
        return MSGPackSerializer.dumps({"round": 4, "digest": DIGEST}), [THETA, MOMENTUM], None

    return chunked.ChunkServer(current)


class Link:
    """libp2p standing in: each holder's server, what each was asked, and injected faults."""

    def __init__(self, servers, lie_on=None, drop_on=None):
        self.servers, self.asked = servers, []
        self.lie_on, self.drop_on = lie_on or {}, set(drop_on or ())

    def stub(self, peer):
        link, name = self, peer.to_base58()

        class Stub:
            async def rpc_download_chunk(self, request):
                index = chunked.parse_request(request)[2]
                link.asked.append((name, index))
                if (name, index) in link.drop_on:
                    link.drop_on.discard((name, index))
                    raise ConnectionResetError("the connection dropped")
                return link.reply(name, index, request)

        return Stub()

    async def reply(self, name, index, request):
        async for message in self.servers[name].answer(request):
            if self.lie_on.get(name) == index:
                message.tensor_part.buffer = bytes(len(message.tensor_part.buffer))
            yield message


def download(link, holders, resume_from=None):
    fetcher = resume_from or chunked.ChunkFetcher(link.stub)
    fetcher._stub = link.stub

    async def run():
        manifests = await fetcher.manifests(holders, (4, DIGEST), limit=400_000, stall_s=5.0)
        manifest, group = chunks.manifest_groups(manifests, 4, DIGEST)[0]
        return group, await fetcher.download(manifest, group, time.monotonic() + 20, stall_s=5.0)

    return fetcher, *asyncio.run(run())


def chunks_asked(link):
    return [(h, i) for h, i in link.asked if i != chunked.MANIFEST]


def test_three_holders_each_send_chunks_and_the_state_arrives_whole():
    link = Link({A: server(), B: server(), C: server()})
    _, group, got = download(link, [A, B, C])
    assert group == [A, B, C] and got.problem == "" and not got.dropped
    assert torch.equal(got.tensors[0], THETA) and torch.equal(got.tensors[1], MOMENTUM)
    assert {h for h, _ in chunks_asked(link)} == {A, B, C}
    assert sorted({i for _, i in chunks_asked(link)}) == [0, 1, 2, 3, 4]


def test_a_holder_that_lies_about_a_chunk_is_dropped_after_that_one_chunk():
    link = Link({A: server(), B: server(), C: server()}, lie_on={B: 1})
    _, _, got = download(link, [A, B, C])
    assert got.liars == {B} and "chunk 1" in got.dropped[B]
    assert [i for h, i in chunks_asked(link) if h == B] == [1, 4]  # its second chunk was already asked for
    assert torch.equal(got.tensors[0], THETA) and torch.equal(got.tensors[1], MOMENTUM)


def test_a_holder_that_sends_more_than_a_chunk_is_a_liar():
    class Flood:
        """The right manifest, then 70 000 bytes for a chunk of 65 536."""

        async def answer(self, request):
            if chunked.parse_request(request)[2] == chunked.MANIFEST:
                async for message in server().answer(request):
                    yield message
                return
            yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=bytes(70_000)))

    link = Link({A: server(), B: Flood()})
    _, group, got = download(link, [A, B])
    assert group == [A, B] and got.liars == {B} and "more than the 65,536 bytes" in got.dropped[B]
    assert torch.equal(got.tensors[0], THETA) and torch.equal(got.tensors[1], MOMENTUM)


def test_a_dropped_connection_costs_only_its_chunk():
    link = Link({A: server(), B: server()}, drop_on={(A, 0)})
    _, _, got = download(link, [A, B])
    assert got.problem == "" and not got.dropped  # one drop does not cost the holder
    asked = chunks_asked(link)
    assert asked[0] == (A, 0) and asked[1:].count((A, 0)) + asked[1:].count((B, 0)) >= 1  # asked again
    assert torch.equal(got.tensors[0], THETA) and torch.equal(got.tensors[1], MOMENTUM)


def test_a_download_cut_short_resumes_with_only_the_missing_chunks():
    # A sends chunks 0 and 1 (2 at a time), then 2 and 3 drop: it is given up, with 0 and 1 kept
    link = Link({A: server()}, drop_on={(A, 2), (A, 3)})
    fetcher, _, got = download(link, [A])
    assert got.tensors is None and "2 of 5 chunks" in got.problem and chunks_asked(link) == [(A, i) for i in range(4)]
    again = Link({A: server()})
    _, _, got = download(again, [A], resume_from=fetcher)
    assert chunks_asked(again) == [(A, 2), (A, 3), (A, 4)]
    assert torch.equal(got.tensors[0], THETA) and torch.equal(got.tensors[1], MOMENTUM)


def test_a_holder_serves_nothing_for_a_state_it_does_not_hold():
    async def answers(round_, digest):
        return [m async for m in server().answer(chunked.request(round_, digest, chunked.MANIFEST))]

    assert asyncio.run(answers(5, DIGEST)) == [] and asyncio.run(answers(4, "cd" * 16)) == []
    assert len(asyncio.run(answers(4, DIGEST))) == 1
    bad = averaging_pb2.AveragingData(group_id=b"\xc1 not msgpack")
    assert asyncio.run(_all(server().answer(bad))) == []


async def _all(answers):
    return [m async for m in answers]
