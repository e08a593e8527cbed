"""Downloading a peer's served state without being a peer: the observer and `export --initial-peers`.

A peer serves its current (round, θ, momentum) to admitted askers (averager.py `rpc_download_state`).
A joiner asks through its own averager process; an observer has none. `StateClient` asks from a
thread of its own with an event loop, over a replica of the observer's DHT node's libp2p daemon
(hivemind's `replicate_p2p`), so the state never passes through a pipe between processes.

Both read the reply with `read_served_state`, which caps it at the size of this model's state:
a server that streams without end must not exhaust the asker's memory. What arrived is untrusted
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

from p2p_diloco.network import ServedState

logger = logging.getLogger(__name__)

STATE_BYTES_PER_VALUE = 2 * 4  # a served state is θ and the outer momentum, fp32
STATE_SLACK_BYTES = 1 << 20  # metadata and serialization headers


def state_limit(numel: int) -> int:
    """The most bytes a served state of a model with `numel` values may take."""
    return STATE_BYTES_PER_VALUE * numel + STATE_SLACK_BYTES


async def read_served_state(stream: Any, limit: int, peer: Any) -> ServedState | None:
    """(metadata, tensors) from a `rpc_download_state` reply stream, or None if it held no metadata
    (a peer with nothing to serve, or one that refuses the asker). Raises past `limit` bytes."""
    metadata: Any = None
    tensors: list[torch.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    received = 0
    async for message in stream:
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
    if not isinstance(metadata, dict):
        return None
    return metadata, tensors


class StateClient:
    """Fetches served states over the libp2p daemon of a DHT node in this process's care."""

    def __init__(self, dht: Any, prefix: str, numel: int, dht_lock: threading.Lock):
        self.prefix, self.limit = prefix, state_limit(numel)
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
        return await read_served_state(stream, self.limit, peer)

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
