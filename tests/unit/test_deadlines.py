"""Deadlines that follow the work (protocol/deadlines.py): a state download's deadline from the state's size,
and a serving peer's silence, not the whole download, bounded by swarm.join_timeout_s."""

import asyncio
import threading
import time

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol import deadlines
from p2p_diloco.swarm.averaging.served import read_served_state


def test_a_state_download_is_given_the_time_its_size_takes_at_the_slowest_link_the_run_accepts():
    # 1B parameters: θ and momentum in fp32 are 8e9 bytes (+ 1 MiB of headers); at 10 Mbit/s,
    # (8e9 + 1,048,576) x 8 / 1e7 = 6,400.84 s. The fixed 30 s of before cut it after 0.5 %.
    big = deadlines.state_download(1_000_000_000, join_timeout_s=30.0, min_download_mbps=10.0)
    assert big.total_s == pytest.approx(6400.8388608) and big.stall_s == 30.0
    # The public profile's 179.9M parameters at its 20 Mbit/s: (1.4392e9 + 1,048,576) x 8 / 2e7 = 576.1 s.
    assert deadlines.state_download(179_900_000, 60.0, 20.0).total_s == pytest.approx(576.0994304)
    # A small model: the floor, join_timeout_s.
    assert deadlines.state_download(1_000, join_timeout_s=30.0, min_download_mbps=10.0).total_s == 30.0


def test_the_slowest_link_must_be_a_positive_rate():
    for bad in ("0", "-5", "nan"):
        with pytest.raises(ConfigError, match="swarm.min_download_mbps"):
            config.load(None, {"swarm.min_download_mbps": bad})


META = {"round": 3, "digest": "3" * 32}  # as peer.py serves it


def served(values: list[torch.Tensor], pause_s: float, silent_after: int | None = None, meta: object = META):
    """A `rpc_download_state` reply as hivemind streams it: metadata with the first part, each
    tensor in parts of 1 KiB, `pause_s` between parts; silent for good after `silent_after` parts."""

    async def stream():
        metadata, sent = MSGPackSerializer.dumps(meta), 0
        for tensor in values:
            for part in split_for_streaming(serialize_torch_tensor(tensor), 1024):
                if sent == silent_after:
                    await asyncio.sleep(3600)
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata if sent == 0 else b"")
                sent += 1
                await asyncio.sleep(pause_s)

    return stream()


def test_a_slow_but_steady_server_is_read_to_the_end_past_the_silence_deadline():
    theta, momentum = torch.arange(2000, dtype=torch.float32), torch.full((2000,), 0.5)  # 8 parts each
    started = time.monotonic()
    got = asyncio.run(read_served_state(served([theta, momentum], pause_s=0.1), 1 << 20, "p1", stall_s=0.5))
    took = time.monotonic() - started
    assert got is not None
    metadata, tensors = got
    assert metadata == META and torch.equal(tensors[0], theta) and torch.equal(tensors[1], momentum)
    assert took > 2 * 0.5, f"16 parts of 1 KiB, 0.1 s apart: twice the silence deadline in all ({took:.2f} s)"


def test_a_server_that_stops_sending_is_given_up_after_the_silence_deadline():
    started = time.monotonic()
    with pytest.raises(AllreduceException, match="p1 sent nothing for 0.2 s"):
        asyncio.run(read_served_state(served([torch.ones(1000)], 0.0, silent_after=2), 1 << 20, "p1", stall_s=0.2))
    assert time.monotonic() - started < 5.0


def test_poll_until_returns_what_it_waited_for_and_never_waits_past_its_deadline():
    calls = []

    def probe():
        calls.append(time.monotonic())
        return len(calls)

    assert deadlines.poll_until(probe, lambda n: n == 3, time.monotonic() + 10, 0.01) == 3  # at the third
    calls.clear()
    started = time.monotonic()
    assert deadlines.poll_until(probe, lambda n: False, started + 0.2, 0.05) >= 2  # the last value
    assert calls[-1] - started < 0.2 + 0.05  # the last probe at the deadline, not a whole interval past it
    calls.clear()
    assert deadlines.poll_until(probe, lambda n: False, time.monotonic() - 1, 5.0) == 1  # past: one read
    stop = threading.Event()
    stop.set()
    calls.clear()
    assert deadlines.poll_until(probe, lambda n: False, time.monotonic() + 60, 5.0, stop) == 1  # stopped


def test_a_wait_on_round_records_reads_less_often_as_it_lasts(monkeypatch):
    """round_poll's pauses, on a clock of its own: 0.2 s, then 1.5x each, at most 1 s; a 15-s wait
    (swarm.agreement_timeout_s in the tests) reads 19 times where a fixed 0.2 s read 76 times."""
    now, pauses = [0.0], []

    def sleep(s):
        pauses.append(round(s, 6))
        now[0] += s

    monkeypatch.setattr(deadlines.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(deadlines.time, "sleep", sleep)
    reads = []
    deadlines.round_poll(lambda: reads.append(now[0]), lambda _: False, 15.0)
    assert pauses[:6] == [0.2, 0.3, 0.45, 0.675, 1.0, 1.0] and max(pauses) == 1.0
    assert len(reads) == 19 and reads[-1] == pytest.approx(15.0)  # the last read at the deadline
    reads.clear()
    now[0] = 0.0
    deadlines.poll_until(lambda: reads.append(now[0]), lambda _: False, 15.0, deadlines.ROUND_POLL_S)
    assert len(reads) >= 76  # one every 0.2 s from 0 to 15 (and a last at the deadline, after float sums)
    reads.clear()
    now[0] = 0.0
    # what it waits for, found at the fourth read (0.95 s): no further read
    assert deadlines.round_poll(lambda: reads.append(now[0]) or len(reads), lambda n: n == 4, 15.0) == 4
    assert reads == pytest.approx([0.0, 0.2, 0.5, 0.95])
