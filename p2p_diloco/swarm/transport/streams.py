"""Reply streams that end only once the caller holds every reply.

p2pd may drop replies still in flight when a handler returns and its side of the stream closes:
the caller then sees a stream that ends early, with no error, and an honest reducer's audit would
look like one answered with too few signed parts (docs/design.md §7; allreduce._send_and_receive
keeps its stream open for the same reason). So here the caller keeps its request stream open
until it holds every reply it expects, and the handler, after its last reply, waits for that end
(at most LINGER_S) before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

LINGER_S = 30.0  # at most, for a caller to end its stream once it holds every reply
JOIN_LINGER_S = 5.0  # at most, for a follower to close its join stream once it read the leader's last message


async def first_request(requests: AsyncIterator[Any]) -> Any | None:
    """The caller's request, or None if its stream ended without one."""
    return await anext(aiter(requests), None)


async def linger(requests: AsyncIterator[Any]) -> None:
    """After a handler's last reply: until the caller ends its stream, at most LINGER_S. Anything
    more it sends is ignored."""

    async def drain() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drain(), LINGER_S)


async def held_open(seconds: float) -> None:
    """After the last reply of a handler whose caller sent one request (hivemind's unary request,
    streamed reply): keep the stream open until the caller closes its side, at most `seconds`.
    hivemind's P2P reads on under a handler and cancels it when the caller's side closes, which
    the caller does once it read what it waited for. A handler that returned at once let p2pd reset
    the stream under its last reply: over yamux on TCP the reset comes behind the data, but a QUIC
    reset lets the caller's side discard what it had not read (a follower lost ACCEPTED and
    BEGIN_ALLREDUCE; docs/benchmarks.md, QUIC)."""
    await asyncio.sleep(seconds)  # a bound, not a wait for anything: the caller's close cancels it


async def ask(
    call: Callable[[AsyncIterator[Any]], Awaitable[AsyncIterator[Any]]],
    request: Any,
    complete: Callable[[list[Any]], bool],
    limit: int,
    reply_timeout_s: float | None,
) -> list[Any]:
    """Send `request` through `call` (a stub method taking a request stream) and collect the replies
    until `complete(replies)`; only then end the request stream, and read on until the handler
    ends. Raises ValueError on more than `limit` replies, and asyncio.TimeoutError if the stream
    does not open, or the next reply does not come, within `reply_timeout_s` (None: no limit; a
    peer that hung, a laptop asleep whose p2pd accepts nothing, holds a stream open for ever)."""
    received = asyncio.Event()

    async def requests() -> AsyncIterator[Any]:
        yield request
        await received.wait()

    replies: list[Any] = []
    try:
        stream = aiter(await asyncio.wait_for(call(requests()), reply_timeout_s))
        while True:
            try:
                reply = await asyncio.wait_for(anext(stream), reply_timeout_s)
            except StopAsyncIteration:
                break
            if received.is_set():
                continue  # after a complete answer: nothing counts
            replies.append(reply)
            if len(replies) > limit:
                raise ValueError(f"more than {limit} replies")
            if complete(replies):
                received.set()
    finally:
        received.set()
    return replies
