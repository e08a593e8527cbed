"""A state served and downloaded in chunks, from several holders at once (protocol/chunks.py decides).

`ChunkServer` answers `rpc_download_chunk` in a holder's averager process: the manifest of the
state asked for, or one chunk of it. It keeps the state it built a manifest for (one state, the
latest asked; KEEP_S after its last use), so that a joiner's hundreds of chunk requests cost one
read from the peer's process, and a holder that moved on to the next round still serves the
chunks of the state its joiners are downloading.

`ChunkFetcher` downloads in a joiner's averager process: it asks every holder for its manifest,
then runs `chunks.Plan` (which chunk from whom, a lying holder dropped, a dropped connection
retried), checking every chunk as it arrives. A download that ends unfinished keeps what arrived:
the next try of the same manifest asks only for the rest. Everything from the wire is untrusted
(I4): requests and manifests through trust/wire.py, replies capped at the chunk's size, and every
wait bounded (a silent holder by `stall_s`, the whole download by its deadline, I3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.protocol import chunks
from p2p_diloco.protocol.network import Assembled
from p2p_diloco.swarm.averaging.served import until_silent
from p2p_diloco.trust import wire

KEEP_S = 600.0  # a served state's copy is dropped this long after its last request
PIECE_BYTES = 512 << 10  # one message of a chunk's reply (p2pd's messages are 4 MiB at most)
MANIFEST = -1  # the chunk index that asks for the manifest
MAX_MANIFEST_BYTES = 100 * (chunks.MAX_CHUNKS + 64)  # 64 hex digits and msgpack's framing per chunk
Tasks = dict["asyncio.Task[bytes]", tuple[int, str]]  # a chunk request on its way: (chunk, holder)


class Overlong(Exception):
    """A reply longer than what was asked: no honest holder sends one."""


def request(round_: int, digest: str, index: int) -> averaging_pb2.AveragingData:
    """The request for chunk `index` (MANIFEST: the manifest) of the state (round_, digest)."""
    return averaging_pb2.AveragingData(
        group_id=MSGPackSerializer.dumps({"round": round_, "digest": digest, "chunk": index})
    )


def parse_request(message: averaging_pb2.AveragingData) -> tuple[int, str, int]:
    """(round, digest, chunk index) of a request (WireError if malformed)."""
    asked = wire.mapping(MSGPackSerializer.loads(message.group_id), "chunk request")
    index = wire.field(asked, "chunk", lambda v: wire.integer(v, MANIFEST, chunks.MAX_CHUNKS))
    return wire.field(asked, "round", wire.integer), wire.field(asked, "digest", wire.digest), index


@dataclass
class Served:
    """The state a holder serves in chunks: its manifest and its tensors' raw bytes."""

    manifest: chunks.Manifest
    parts: list[memoryview]

    def chunk(self, index: int) -> list[bytes]:
        """Chunk `index` as the messages of its reply."""
        data = b"".join(
            self.parts[p][lo:hi] for p, lo, hi in chunks.pieces(self.manifest.parts, *self.manifest.span(index))
        )
        return [data[i : i + PIECE_BYTES] for i in range(0, len(data), PIECE_BYTES)]


class ChunkServer:
    """A holder's side: the manifest and chunks of the state it serves (`answer`)."""

    def __init__(self, current_state: Callable[[], Awaitable[tuple[bytes, Any, Any]]]):
        """`current_state`: the peer's served state, read from its process through hivemind's pipe
        (its metadata serialized: `_get_current_state_from_host_process`)."""
        self._current_state = current_state
        self._served: Served | None = None
        self._lock: asyncio.Lock | None = None  # made in the averager process's loop
        self._drop: asyncio.TimerHandle | None = None

    async def answer(self, message: averaging_pb2.AveragingData) -> AsyncGenerator[averaging_pb2.DownloadData, None]:
        """The reply to one request: nothing if it is malformed or asks for a state this peer does
        not serve (it moved on: the joiner asks the others)."""
        try:
            round_, digest, index = parse_request(message)
        except (wire.WireError, ValueError, TypeError):
            return
        served = await self._state(round_, digest)
        if served is None or index >= len(served.manifest.hashes):
            return
        if index == MANIFEST:
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(served.manifest.encode()))
            return
        for piece in served.chunk(index):
            yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=piece))

    async def _state(self, round_: int, digest: str) -> Served | None:
        """The state (round_, digest) if this peer serves it now or built its manifest last."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # many joiners at once: the manifest is built once
            kept = self._served
            if kept is None or (kept.manifest.round, kept.manifest.digest) != (round_, digest):
                kept = await self._read(round_, digest)
            if kept is not None:
                self._keep(kept)
            return kept

    async def _read(self, round_: int, digest: str) -> Served | None:
        serialized, tensors, _ = await self._current_state()
        metadata = MSGPackSerializer.loads(serialized)  # this peer's own: {"round", "digest"}
        if not isinstance(metadata, dict) or (metadata.get("round"), metadata.get("digest")) != (round_, digest):
            return None
        parts = [memoryview(t.detach().to(torch.float32).contiguous().numpy()).cast("B") for t in tensors]
        # sha256 of the whole state: about a second a GB, off the loop that serves the other RPCs
        manifest = await asyncio.get_running_loop().run_in_executor(None, chunks.manifest_of, round_, digest, parts)
        return Served(manifest, parts)

    def _keep(self, served: Served) -> None:
        self._served = served
        if self._drop is not None:
            self._drop.cancel()
        self._drop = asyncio.get_running_loop().call_later(KEEP_S, self._forget)

    def _forget(self) -> None:
        self._served = None


class ChunkFetcher:
    """A joiner's side: manifests from holders, then a manifest's chunks from its holders."""

    def __init__(self, stub: Callable[[PeerID], Any]):
        self._stub = stub
        self._partial: tuple[str, list[torch.Tensor], frozenset[int]] | None = None  # (root, buffers, have)

    async def manifests(
        self, peers: list[str], wanted: tuple[int, str], limit: int, stall_s: float
    ) -> dict[str, chunks.Manifest]:
        """{holder: the manifest it sent for `wanted`}, asked of all `peers` at once, within `stall_s`
        each; a holder that fails, sends nothing or a malformed manifest is left out."""
        asks = [asyncio.wait_for(self._manifest(PeerID.from_base58(p), wanted, limit, stall_s), stall_s) for p in peers]
        answers = await asyncio.gather(*asks, return_exceptions=True)
        return {p: a for p, a in zip(peers, answers) if isinstance(a, chunks.Manifest)}

    async def _manifest(
        self, peer: PeerID, wanted: tuple[int, str], limit: int, stall_s: float
    ) -> chunks.Manifest | None:
        stream = await self._stub(peer).rpc_download_chunk(request(*wanted, MANIFEST))
        data = await _collect(stream, stall_s, peer, MAX_MANIFEST_BYTES, lambda m: m.metadata)
        return chunks.parse_manifest(MSGPackSerializer.loads(data), limit) if data else None

    async def download(
        self, manifest: chunks.Manifest, holders: list[str], deadline: float, stall_s: float
    ) -> Assembled:
        """The state of `manifest` from `holders`, by the monotonic `deadline`."""
        buffers, have = self._resumed(manifest)
        plan = chunks.start(manifest, holders, have)
        tasks: Tasks = {}
        try:
            plan = await self._run(plan, buffers, tasks, deadline, stall_s)
        finally:
            for task in tasks:
                task.cancel()
            self._partial = None if plan.done else (manifest.root, buffers, plan.have)
        problem = "" if plan.done else _unfinished(plan, deadline)
        return Assembled(buffers if plan.done else None, problem, dict(plan.dropped), plan.liars)

    async def _run(
        self, plan: chunks.Plan, buffers: list[torch.Tensor], tasks: Tasks, deadline: float, stall_s: float
    ) -> chunks.Plan:
        """Ask, wait for the first answer, check it, until the state is whole, every holder was
        dropped or the deadline passed."""
        while not plan.done:
            plan, asked = chunks.assign(plan)
            for index, holder in asked:
                tasks[asyncio.ensure_future(self._chunk(holder, plan.manifest, index, stall_s))] = (index, holder)
            left = deadline - time.monotonic()
            if not tasks or left <= 0:
                return plan
            finished, _ = await asyncio.wait(tasks, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                index, holder = tasks.pop(task)
                plan = _settle(plan, index, holder, task, buffers)
            for task, (index, holder) in list(tasks.items()):  # sent by another first, or asked of a liar
                if index in plan.have or holder in plan.dropped:
                    task.cancel()
                    del tasks[task]
        return plan

    async def _chunk(self, holder: str, manifest: chunks.Manifest, index: int, stall_s: float) -> bytes:
        start, end = manifest.span(index)
        stream = await self._stub(PeerID.from_base58(holder)).rpc_download_chunk(
            request(manifest.round, manifest.digest, index)
        )
        return await _collect(stream, stall_s, holder, end - start, lambda m: m.tensor_part.buffer)

    def _resumed(self, manifest: chunks.Manifest) -> tuple[list[torch.Tensor], frozenset[int]]:
        """The buffers and verified chunks of an unfinished try of `manifest`, or empty ones."""
        if self._partial is not None and self._partial[0] == manifest.root:
            return self._partial[1], self._partial[2]
        return [torch.empty(size // 4, dtype=torch.float32) for size in manifest.parts], frozenset()


async def _collect(stream: Any, stall_s: float, peer: Any, limit: int, take: Callable[[Any], bytes]) -> bytes:
    """The bytes `take` finds in the reply's messages; Overlong past `limit` bytes, AllreduceException
    after `stall_s` of silence (served.until_silent)."""
    data = bytearray()
    async for message in until_silent(stream, stall_s, peer):
        data += take(message)
        if len(data) > limit:
            raise Overlong(f"{peer} sent more than the {limit:,} bytes asked for")
    return bytes(data)


def _settle(plan: chunks.Plan, index: int, holder: str, task: asyncio.Task, buffers: list[torch.Tensor]) -> chunks.Plan:
    """One answer carried into the plan, and a kept chunk into the buffers."""
    error = task.exception()
    if isinstance(error, Overlong):
        return chunks.lied(plan, holder, index, str(error))
    if error is not None:
        return chunks.failed(plan, holder, index, f"{type(error).__name__} {str(error)[:80]}")
    data: bytes = task.result()
    if not data:  # it serves this state no more (moved on, and another joiner asked for its next)
        return chunks.failed(plan, holder, index, "it sent nothing")
    after = chunks.received(plan, holder, index, chunks.chunk_hash(data))
    if index in after.have and index not in plan.have:
        _write(buffers, plan.manifest, index, data)
    return after


def _write(buffers: list[torch.Tensor], manifest: chunks.Manifest, index: int, data: bytes) -> None:
    start, end = manifest.span(index)
    offset = 0
    for part, lo, hi in chunks.pieces(manifest.parts, start, end):
        buffers[part].view(torch.uint8)[lo:hi] = torch.frombuffer(
            bytearray(data[offset : offset + hi - lo]), dtype=torch.uint8
        )
        offset += hi - lo


def _unfinished(plan: chunks.Plan, deadline: float) -> str:
    held = f"{len(plan.have)} of {len(plan.manifest.hashes)} chunks"
    if time.monotonic() >= deadline:
        return f"{held} arrived before the deadline"
    return f"{held} arrived, then every holder was dropped"
