"""Reading a served state off the wire: a reply to `rpc_download_state`, for a joiner's averager
process (swarm/averaging/averager.py) and for a client without one (state_client.py).

The reply is capped at the size of this model's state: a server that streams without end must not
exhaust the asker's memory; one that stops sending is given up after `stall_s` of silence
(protocol/deadlines.py: the whole download's deadline follows the state's size, so a hung server must not
hold it that long). What arrived is untrusted (I4): the caller verifies it against a digest the
swarm published (`network.download_verified`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.protocol.network import ServedState, served_metadata


async def read_served_state(stream: Any, limit: int, peer: Any, stall_s: float) -> ServedState | None:
    """(metadata, tensors) from a `rpc_download_state` reply stream, or None if it held no metadata
    (a peer with nothing to serve, or one that refuses the asker). Raises past `limit` bytes, when
    nothing arrived for `stall_s`, or (WireError) when the metadata is malformed."""
    metadata: Any = None
    tensors: list[torch.Tensor] = []
    parts: list[runtime_pb2.Tensor] = []
    received = 0
    async for message in until_silent(stream, stall_s, peer):
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


async def until_silent(stream: Any, stall_s: float, peer: Any) -> Any:
    """The stream's messages; AllreduceException once none came for `stall_s`."""
    messages = stream.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(messages.__anext__(), stall_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise AllreduceException(f"{peer} sent nothing for {stall_s:g} s") from None
