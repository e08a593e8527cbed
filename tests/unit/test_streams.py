"""streams.py: a reply stream whose handler ends only once the asker holds every reply."""

import asyncio

import pytest

from p2p_diloco.swarm import streams


def _pair(replies, handled):
    """A handler that sends `replies`, then lingers; `call` connects it as a stub method would."""

    async def handler(requests):
        request = await streams.first_request(requests)
        for reply in replies:
            yield (request, reply)
        await streams.linger(requests)
        handled.append("ended after the asker")

    async def call(requests):
        return handler(requests)

    return call


def test_the_asker_ends_its_stream_once_complete_and_the_handler_then_ends():
    handled: list[str] = []
    call = _pair([1, 2, 3], handled)

    async def main():
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: len(got) == 3, 10), 5)

    assert asyncio.run(main()) == [("q", 1), ("q", 2), ("q", 3)]
    assert handled == ["ended after the asker"]  # it did not return before the asker had every reply


def test_a_refusal_is_an_empty_answer_not_a_hang():
    handled: list[str] = []

    async def refusing(requests):
        if await streams.first_request(requests) == "q":
            return
        yield "never"

    async def call(requests):
        return refusing(requests)

    async def main():
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: len(got) == 3, 10), 5)

    assert asyncio.run(main()) == []
    assert handled == []


def test_more_replies_than_the_limit_are_an_error():
    call = _pair(list(range(20)), [])

    async def main():
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: False, 5), 5)

    with pytest.raises(ValueError, match="more than 5 replies"):
        asyncio.run(main())
