"""Downloading a peer's served state without being a peer: the observer and `export --initial-peers`.

A peer serves its current (round, θ, momentum) to admitted askers (averager.py `rpc_download_state`).
A joiner asks through its own averager process; an observer has none. `StateClient` asks from a
thread of its own with an event loop, over a replica of the observer's DHT node's libp2p daemon
(hivemind's `replicate_p2p`), so the state never passes through a pipe between processes.

Both read the reply with `read_served_state`, which caps it at the size of this model's state:
a server that streams without end must not exhaust the asker's memory; one that stops sending is
given up after `stall_s` of silence (deadlines.py: the whole download's deadline follows the
state's size, so a hung server must not hold it that long). What arrived is untrusted
(I4): the caller verifies it against a digest the swarm published (`network.download_verified`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.deadlines import state_bytes
from p2p_diloco.network import ServedState, served_metadata

logger = logging.getLogger(__name__)


async def read_served_state(stream: Any, limit: int, peer: Any, stall_s: float) -> ServedState | None:
    """(metadata, tensors) from a `rpc_download_state` reply stream, or None if it held no metadata
    (a peer with nothing to serve, or one that refuses the asker). Raises past `limit` bytes, when
    nothing arrived for `stall_s`, or (WireError) when the metadata is malformed."""
    metadata: Any = None
    tensors: list[torch.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    received = 0
    async for message in _until_silent(stream, stall_s, peer):
        received += len(message.tensor_part.buffer) + len(message.metadata)
        if received > limit:
            raise AllreduceException(f"{peer} sent more than the {limit:,} bytes a state of this model takes")
        if message.metadata:
            metadata = MSGPackSerializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    if metadata is None:
        return None
    return served_metadata(metadata), tensors  # untrusted: WireError if malformed (the caller's problem line)


async def _until_silent(stream: Any, stall_s: float, peer: Any) -> Any:
    """The stream's messages; AllreduceException once none came for `stall_s`."""
    messages = stream.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(messages.__anext__(), stall_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise AllreduceException(f"{peer} sent nothing for {stall_s:g} s") from None


class StateClient:
    """Fetches served states over the libp2p daemon of a DHT node in this process's care."""

    def __init__(self, dht: Any, prefix: str, numel: int, dht_lock: threading.Lock, stall_s: float):
        self.prefix, self.limit, self.stall_s = prefix, state_bytes(numel), stall_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="state-client", daemon=True)
        self._thread.start()
        with dht_lock:  # replicate_p2p asks the DHT process once, through its pipe
            self._p2p = self._run(dht.replicate_p2p(), timeout=30.0)

    def fetch(self, peer: str, timeout: float) -> ServedState | None:
        """The state `peer` serves now, within `timeout` seconds in all (I3)."""
        return self._run(asyncio.wait_for(self._fetch(PeerID.from_base58(peer)), timeout), timeout + 5.0)

    async def _fetch(self, peer: PeerID) -> ServedState | None:
        from p2p_diloco.swarm.averager import DiLoCoAverager  # which imports this module

        # The handler's name is the serving class's: DiLoCoAverager's, not hivemind's base class.
        stub = DiLoCoAverager.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        return await read_served_state(stream, self.limit, peer, self.stall_s)

    def _run(self, coroutine: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def close(self) -> None:
        try:  # the replica's client socket file goes with it; the daemon stays with its DHT node
            self._run(self._p2p.shutdown(), timeout=5.0)
        except Exception as e:  # a DHT process already gone: nothing left to close
            logger.debug("closing the state client's libp2p replica: %r", e)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
