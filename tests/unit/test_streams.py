"""swarm/transport/streams.py: a reply stream whose handler ends only once the asker holds every reply."""

import asyncio

import pytest

from p2p_diloco.swarm.transport import streams


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
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: len(got) == 3, 10, 5), 5)

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
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: len(got) == 3, 10, 5), 5)

    assert asyncio.run(main()) == []
    assert handled == []


def test_more_replies_than_the_limit_are_an_error():
    call = _pair(list(range(20)), [])

    async def main():
        return await asyncio.wait_for(streams.ask(call, "q", lambda got: False, 5, 5), 5)

    with pytest.raises(ValueError, match="more than 5 replies"):
        asyncio.run(main())


def test_a_peer_that_hangs_between_replies_or_before_the_first_is_given_up_after_one_reply_deadline():
    # A laptop asleep after its all-reduce: its p2pd holds the stream open and sends nothing.
    # Before, only the caller's whole deadline (the audit's 30 s, cut by the all-reduce's 20 s) ended the wait.
    def hanging(sent_first):
        async def handler(requests):
            await streams.first_request(requests)
            if sent_first:
                yield 1
            await asyncio.sleep(3600)  # asleep (the caller's deadline ends the test first)
            yield 2

        async def call(requests):
            return handler(requests)

        return call

    async def opening_never(requests):
        await asyncio.sleep(3600)

    async def timed(call):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(streams.ask(call, "q", lambda got: len(got) == 3, 10, 0.2), 5)
        return loop.time() - started

    for call in (hanging(sent_first=False), hanging(sent_first=True), opening_never):
        assert 0.2 <= asyncio.run(timed(call)) < 1.0  # the reply deadline, not the caller's 5 s
