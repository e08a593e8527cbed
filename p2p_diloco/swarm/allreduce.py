"""A consistent butterfly all-reduce on hivemind's DecentralizedAverager (I1, I2).

hivemind's stock runner has each reducer send back `average - sender's part` and each sender add
that delta to its own copy. With compression, or merely different float rounding, every peer ends
with slightly different values (measured: ~1e-3 relative with fp16 between 3 peers). Here a
reducer encodes the *average itself* once per part, sends those bytes to every sender, and decodes
the same bytes for its own span; every member then copies (not adds) what it decoded. So all
members hold the same bytes, whatever the codec.

The codecs are p2p_diloco.codecs, carried in hivemind's tensor messages by `WireCodec`. The first
averaged tensor goes through the run's codec, the second (norms, biases: small) always exact. As a
sender, the runner also keeps what the codec lost of each part it sent (error feedback).

Between all-reduces, members probe each other's links (`rpc_probe`, outside the all-reduce's
lockstep) and announce what they measured, so that the load balancer gives faster peers larger
spans and no peer more than others measured of it (links.py).

hivemind also reports success when a reducer dies mid-round, leaving that span at the survivor's
own values. Here any failed reducer or banned sender fails the whole step, and the caller's
buffer keeps its pseudo-gradient for a retry: a partial average is never applied.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco import admission, codecs, faults, links
from p2p_diloco.errors import AdmissionError

logger = get_logger(__name__)


LOSSY_TENSOR = 0  # index of the averaged tensor that goes through the run's codec; any other travels exact
PROBE_RETRY_S = 0.5  # first pause before probing again a member that was busy receiving another probe


class ReceiverBusy(Exception):
    """A member was timing another member's probe: probe it again later."""


class PartialAllreduce(AllreduceException):
    """Some reducer or sender failed: the averaged vector is incomplete and must not be applied."""


class WireCodec(CompressionBase):
    """A p2p_diloco codec in hivemind's tensor message: the codec's name in `dtype`, so that a message
    decoded by anything but this class fails loudly instead of being misread."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, name: str):
        self.codec, self.exact = codecs.get(name), codecs.get("fp32")

    def _for(self, info: CompressionInfo) -> codecs.Codec:
        return self.codec if info.key == LOSSY_TENSOR else self.exact

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        codec = self._for(info)
        return runtime_pb2.Tensor(
            buffer=codec.encode(tensor), size=tensor.shape, dtype=codec.name, compression=self.compression_type
        )

    def extract(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        """Untrusted bytes (I4): only this run's codec or fp32, and a length that fits the shape."""
        if message.dtype not in (self.codec.name, self.exact.name):
            raise AllreduceException(f"a part encoded as {message.dtype!r}; this run uses {self.codec.name}")
        numel = math.prod(message.size)
        try:
            return codecs.get(message.dtype).decode(message.buffer, numel).view(tuple(message.size))
        except ValueError as e:
            raise AllreduceException(f"malformed part: {e}") from None

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self._for(info).bytes_per_value() / 4


class ZeroWeightReducer(TensorPartReducer):
    """hivemind's reducer, except that a part every sender gave weight 0 averages to zeros, not to
    0/0 = NaN: a peer may join with weight 0 (outer.drop_rate), and so may all of them."""

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            if self.denominator > 0:
                self.accumulator.div_(self.denominator)
            self.current_part_future.set_result(self.accumulator)
            self.reset_accumulators()


class ConsistentAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose every member ends with bit-identical results."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tensor_part_reducer.__class__ = ZeroWeightReducer  # same state, one method differs
        self.tensor_part_container.return_deltas = False  # results are averages, not deltas
        self.failures: list[str] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.residuals: dict[int, torch.Tensor] = {}  # tensor index -> what the codec lost of what we sent
        self._encoded: dict[int, Any] = {}  # part index -> serialized average of our span

    @property
    def codec(self) -> WireCodec:
        return self.tensor_part_container.compression

    def _encode_average(self, part_index: int, averaged: torch.Tensor) -> Any:
        """Serialize the average of one part of our span once; every sender gets these bytes."""
        if part_index not in self._encoded:
            info = self.tensor_part_container._input_parts_by_peer[self._my_index][part_index][1]
            self._encoded[part_index] = self.tensor_part_container.compression.compress(
                averaged, info, allow_inplace=False
            )
        return self._encoded[part_index]

    def should_delay_results(self, peer_id: Any) -> bool:
        """Never. hivemind makes a member that reduces nothing (a client, or a peer the load
        balancer gave no span: the slowest) upload all its parts before it may download any
        average, so its two directions take turns: 30 s instead of 16 on a 20 Mbit/s link
        (bench/balance.py). Our senders also keep their stream open until every average arrived
        (`_send_and_receive`), which a delayed reducer would wait on forever."""
        return False

    @property
    def _my_index(self) -> int:
        return self.ordered_peer_ids.index(self.peer_id)

    async def run(self) -> AsyncIterator[torch.Tensor]:
        async for averaged in super().run():
            yield averaged
        if self.failures or self.banned_senders or self.tensor_part_container.failed_size:
            raise PartialAllreduce(
                f"all-reduce incomplete: {'; '.join(self.failures) or 'a sender was dropped'} "
                f"({self.tensor_part_container.failed_size} of {self.tensor_part_container.total_size} values failed)"
            )

    async def _communicate_with_peer(self, peer_id: Any) -> None:
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            await self._reduce_own_span(peer_index)
            return
        try:
            await self._send_and_receive(peer_id, peer_index)
        except BaseException as e:
            self.failures.append(f"reducer {str(peer_id)[-6:]}: {type(e).__name__} {str(e)[:120]}")
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_span(self, peer_index: int) -> None:
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=self.weight
            )
            encoded = self._encode_average(part_index, averaged)
            # Counted here, not where the replies are sent: those may still be in flight when our
            # own result is complete. One reply per other sender.
            self.bytes_sent += len(encoded.buffer) * (len(self.sender_peer_ids) - 1)
            self.tensor_part_container.register_processed_part(peer_index, part_index, self.codec.extract(encoded))

    async def _send_and_receive(self, peer_id: Any, peer_index: int) -> None:
        """Our parts of `peer_index`'s span to it, its averages back.

        Our request stream ends only once every average arrived. The reducer's handler ends (and
        its side of the stream closes) only after our stream ended, so it cannot close the stream
        while its last answer is still on the way: on a slow link p2pd then dropped that answer
        (measured: "sent 6 parts, expected 7" for one member while the others completed)."""
        received_all = asyncio.Event()
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        if expected == 0:
            received_all.set()
        inputs = _end_after(self._counted(self._generate_input_for_peer(peer_index), peer_index), received_all)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
        part_index = 0

        def decode(msg: averaging_pb2.AveragingData) -> torch.Tensor:
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
            self.bytes_received += len(msg.tensor_part.buffer)
            return self.codec.extract(msg.tensor_part)

        try:
            async for averaged in amap_in_executor(
                decode,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                _check_part(
                    averaged, self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0], peer_id
                )
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
                if part_index == expected:
                    received_all.set()
        except ConnectionError:
            # The reducer may close its end, or even exit, as soon as its own result is complete
            # (seen in CI: "ConnectionResetError, 0 of 1010 values failed"). Once every average of
            # its span is here, that is nothing to us.
            if part_index != expected:
                raise
        if part_index != expected:
            raise AllreduceException(f"peer {peer_id} sent {part_index} parts, expected {expected}")

    async def _counted(
        self, messages: AsyncIterator[averaging_pb2.AveragingData], peer_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for msg in messages:
            faults.reached(faults.FaultPoint.ALLREDUCE_PART)
            yield msg
            self.bytes_sent += len(msg.tensor_part.buffer)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Our parts of `peer_index`'s span, encoded; what the codec lost of each goes to `residuals`."""
        parts = self.tensor_part_container._input_parts_by_peer[peer_index]
        first = True
        async for encoded in amap_in_executor(
            lambda pair: self._encode_input(*pair), as_aiter(*parts), max_prefetch=self.tensor_part_container.prefetch
        ):
            if first:
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=self.group_id,
                    tensor_part=encoded,
                    weight=self.weight,
                )
                first = False
            else:
                yield averaging_pb2.AveragingData(tensor_part=encoded, weight=self.weight)

    def _encode_input(self, part: torch.Tensor, info: CompressionInfo) -> runtime_pb2.Tensor:
        encoded = self.codec.compress(part, info)
        residual = self.residuals.get(info.key)
        if residual is not None:
            start = part.storage_offset() - self.tensor_part_container.local_tensors[info.key].storage_offset()
            residual[start : start + part.numel()] = part.reshape(-1) - self.codec.extract(encoded).reshape(-1)
        return encoded

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """As a reducer: add each sender's part to the sum, answer with the encoded average (not a delta).

        Parts are added as they arrive, whatever the answers: those wait in a queue (references to
        the one encoded average per part, shared by all senders). Answering in the same loop made
        adding a slow sender's part i+1 wait until its answer to part i had left, so every member
        waited on that sender's download as well as its upload.

        Once any sender was dropped, every later answer is an error: no member gets a partial average (I2)."""
        answers: asyncio.Queue = asyncio.Queue()
        done = object()
        task = asyncio.create_task(self._accumulate_parts(stream, sender_index, answers, done))
        try:
            while (answer := await answers.get()) is not done:
                yield answer
                if answer.code == averaging_pb2.INTERNAL_ERROR:
                    return
            await task  # its error, if any, goes to the sender as hivemind's RPCError
        finally:
            if not task.done():
                task.cancel()

    async def _accumulate_parts(
        self,
        stream: AsyncIterator[averaging_pb2.AveragingData],
        sender_index: int,
        answers: asyncio.Queue,
        done: object,
    ) -> None:
        """The adding half of `_accumulate_parts_streaming`: each part of `stream` into the sum, its
        answer (or an error) into `answers`, then `done`; bans the sender unless all its parts came."""
        part_index = 0
        expected_parts = self.parts_for_local_averaging
        try:
            async for part, weight, size in amap_in_executor(
                lambda msg: (self.codec.extract(msg.tensor_part), msg.weight, len(msg.tensor_part.buffer)),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                faults.reached(faults.FaultPoint.ALLREDUCE_PART)
                _check_part(part, expected_parts[part_index], self.sender_peer_ids[sender_index])
                if not (weight >= 0 and weight < float("inf")):
                    raise AllreduceException(f"sender {sender_index} sent weight {weight}")
                self.bytes_received += size
                averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part, weight=weight)
                if self.banned_senders:
                    # hivemind completes a part without a sender that dropped out; that average
                    # is partial. Sending it would let this sender apply it while the others fail.
                    answers.put_nowait(averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR))
                    return
                encoded = await asyncio.get_event_loop().run_in_executor(
                    None, self._encode_average, part_index, averaged
                )
                part_index += 1
                answers.put_nowait(averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded))
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
            answers.put_nowait(done)


async def _end_after(messages: AsyncIterator[Any], event: asyncio.Event) -> AsyncIterator[Any]:
    """`messages`, then wait for `event` before the stream ends."""
    async for message in messages:
        yield message
    await event.wait()


def _check_part(part: torch.Tensor, like: torch.Tensor, peer: Any) -> None:
    """Untrusted input (I4): a part must have the expected shape and finite values."""
    if part.shape != like.shape:
        raise AllreduceException(f"{peer} sent a part of shape {tuple(part.shape)}, expected {tuple(like.shape)}")
    if not bool(torch.isfinite(part).all()):
        raise AllreduceException(f"{peer} sent non-finite values")


class DiLoCoAverager(DecentralizedAverager):
    """DecentralizedAverager with the consistent runner, copying results into the averaged buffers.

    It also serves this peer's (round, θ, momentum) to joiners through `get_current_state`,
    which runs in the host process and calls `state_provider`.
    """

    def __init__(
        self,
        *args: Any,
        state_provider: Any,
        residual: torch.Tensor | None = None,
        admission: tuple[str, str] | None = None,
        **kwargs: Any,
    ):
        """`residual`: a shared-memory tensor shaped like the lossy averaged tensor; after each
        successful all-reduce it holds what the codec lost of this peer's part (error feedback).
        `admission`: (run id, organiser key) of a certified run: every group member must show a
        certificate in the all-gather before anything is averaged (swarm/gate.py)."""
        self._state_provider = state_provider
        self._admission = admission
        self.residual = residual
        self.link = links.LinkMeter()  # lives in the averager process, where probes are sent and received
        self._receiving_probe = False  # one probe arrives at a time: two would share this peer's download
        super().__init__(*args, **kwargs)

    # --- link probes (links.py) ------------------------------------------------------------

    def probe(self, peers: Sequence[str], size: int, timeout: float) -> MPFuture:
        """Probe each of `peers` in turn with `size` bytes, in the averager process; returns at once.
        The future's result is {peer: the rate it reported}, when the sweep is over."""
        future = MPFuture()
        self._outer_pipe.send(
            ("_probe", [], dict(peers=list(peers), size=size, deadline=time.monotonic() + timeout, future=future))
        )
        return future

    async def _probe(self, peers: list[str], size: int, deadline: float, future: MPFuture) -> None:
        """Probe each peer in turn. A receiver already timing another member's probe answers busy
        (two probes would share its download, and each would under-read a link): it is tried again
        after the others, with a growing pause, until the deadline."""
        reports, pending, pause = {}, list(peers), PROBE_RETRY_S
        while pending and time.monotonic() < deadline:
            busy = []
            for peer in pending:
                try:
                    rate = await asyncio.wait_for(
                        self._probe_one(PeerID.from_base58(peer), size), deadline - time.monotonic()
                    )
                except ReceiverBusy:
                    logger.debug("%s is busy with another probe: trying it again later", peer)
                    busy.append(peer)
                    continue
                except Exception as e:  # a peer that left or refuses: it is not measured this time
                    logger.debug("probe of %s failed: %r", peer, e)
                    continue
                self.link.sent(rate)
                reports[peer] = rate
            pending = busy
            if pending:  # every one left is being probed by someone else: let those probes end
                await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                pause *= 2
        if not future.done():
            future.set_result(reports)

    async def _probe_one(self, peer: PeerID, size: int) -> float | None:
        """One probe: a hello, then (once the receiver accepts) `size` bytes in chunks; the rate the
        receiver measured, or ReceiverBusy. Nothing is streamed before the receiver accepted, so a
        busy receiver's refusal cuts no stream short."""
        accepted = asyncio.Event()

        async def messages() -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(code=averaging_pb2.REQUEST_JOIN)
            await accepted.wait()
            chunk = runtime_pb2.Tensor(buffer=bytes(links.PROBE_CHUNK))
            for _ in range(max(2, size // links.PROBE_CHUNK)):
                yield averaging_pb2.AveragingData(tensor_part=chunk)

        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        async for reply in await stub.rpc_probe(messages()):
            if reply.code == averaging_pb2.NOT_LOOKING_FOR_GROUP:
                raise ReceiverBusy(str(peer))
            if reply.code == averaging_pb2.ACCEPTED:
                accepted.set()
                continue
            rate = reply.weight
            return rate if reply.code == averaging_pb2.AVERAGED_PART and math.isfinite(rate) and rate > 0 else None
        return None

    async def rpc_probe(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Another member's probe (untrusted, I4): a hello, then at most PROBE_MAX bytes in
        PROBE_CHUNK messages. One probe at a time: while one arrives, another sender's hello is
        answered busy. Answers with the rate the chunks arrived at (in `weight`)."""
        hello = await anext(aiter(stream), None)
        if hello is None or hello.code != averaging_pb2.REQUEST_JOIN:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if self._receiving_probe:
            yield averaging_pb2.AveragingData(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        self._receiving_probe = True
        sender = str(context.remote_id)
        try:
            yield averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
            arrivals, total = [], 0
            async for message in stream:
                size = len(message.tensor_part.buffer)
                total += size
                if size > links.PROBE_CHUNK or total > links.PROBE_MAX:
                    yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                    return
                arrivals.append((time.perf_counter(), size))
            rate = links.probe_rate(arrivals)
            self.link.received(sender, rate)
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, weight=rate or 0.0)
        finally:
            self._receiving_probe = False

    def link_report(self, timeout: float) -> tuple[float | None, dict[str, float]]:
        """(this peer's figure, what it measured of each sender) from the averager process."""
        future = MPFuture()
        self._outer_pipe.send(("_link_report", [], dict(future=future)))
        return future.result(timeout=timeout)

    async def _link_report(self, future: MPFuture) -> None:
        future.set_result((self.link.bandwidth(), self.link.seen()))

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind leaves this process's p2p client socket in /tmp: shut the replica down too."""
        try:
            await super()._shutdown(timeout)
        finally:
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()

    def start_step(self, weight: float, timeout: float, gather: Any, init_timeout: float) -> StepControl:
        """hivemind's `step(wait=False)` with a deadline on the hand-over to the averager process.

        hivemind waits without a deadline for the averager process to acknowledge the step; if that
        process died (measured here: torch's shared-memory manager timed out while it unpickled the
        step under load) the peer would hang forever (I3). Raises TimeoutError instead.
        """
        scheduled_time = get_dht_time() + self.matchmaking_kwargs["min_matchmaking_time"]
        data_for_gather = self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps(gather)])
        step = StepControl(
            scheduled_time=scheduled_time,
            deadline=get_dht_time() + timeout,
            allow_retries=False,
            weight=weight,
            data_for_gather=data_for_gather,
        )
        future_for_init = MPFuture()
        self._outer_pipe.send(("_step", [], dict(step=step, future_for_init=future_for_init)))
        try:
            step.attach(*future_for_init.result(timeout=init_timeout))
        except FuturesTimeout:
            future_for_init.cancel()
            raise TimeoutError(f"the averager process did not take the step within {init_timeout:g} s") from None
        step.allow_allreduce()
        return step

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    def set_target_group_size(self, size: int) -> None:
        """A group of `size` starts its all-reduce as soon as it is complete, without waiting out the
        matchmaking window; the swarm's progress tells each peer how many peers are at the round."""
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=max(2, int(size)))))

    async def _set_target_group_size(self, size: int) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    def download_state_from(self, peer: str, timeout: float) -> tuple[dict, list[torch.Tensor]] | None:
        """(metadata, tensors) served by one chosen peer, within `timeout` seconds in all (I3).

        hivemind's load_state_from_peers picks the peer itself and applies its timeout per chunk;
        a joiner must choose the peer (one that published the right digest) and bound the whole download.
        """
        future = MPFuture()
        self._outer_pipe.send(
            ("_download_state_from", [], dict(peer=peer, deadline=time.monotonic() + timeout, future=future))
        )
        return future.result(timeout=timeout + 5)

    async def _download_state_from(self, peer: str, deadline: float, future: MPFuture) -> None:
        try:
            result = await asyncio.wait_for(self._fetch_state(PeerID.from_base58(peer)), deadline - time.monotonic())
            future.set_result(result)
        except BaseException as e:  # report every failure to the caller, which tries the next peer
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    async def _fetch_state(self, peer: PeerID) -> tuple[dict, list[torch.Tensor]] | None:
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[runtime_pb2.Tensor] = []
        async for message in stream:
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not isinstance(metadata, dict):
            return None
        return metadata, tensors

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if self._admission is not None:
            _check_members(group_info, self.serializer, *self._admission)
        gathered = await super()._aggregate_with_group(_fair(group_info, self.serializer), min_vector_size, **kwargs)
        stats = getattr(self, "_last_runner_stats", {})
        return {"gathered": gathered, "allreduce_s": time.perf_counter() - started, **stats}

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        runner = ConsistentAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise AllreduceException("auxiliary peers are not used by p2p-diloco")
        # Collect the whole result first: the shared buffers change only after every part arrived,
        # so a failure leaves the caller's pseudo-gradient untouched (I2).
        if self.residual is not None:
            runner.residuals[LOSSY_TENSOR] = torch.zeros_like(self.residual)
        results = [averaged async for averaged in runner]
        for tensor, averaged in zip(tensors, results):
            tensor.copy_(averaged)
        if self.residual is not None:
            self.residual.copy_(runner.residuals[LOSSY_TENSOR])
        self._last_runner_stats = {
            "bytes_sent": runner.bytes_sent,
            "bytes_received": runner.bytes_received,
            "group_size": len(group_info.peer_ids),
        }
        self.last_updated = time.time()
        self._state_updated.set()
        faults.reached(faults.FaultPoint.ALLREDUCE_DONE)


def _check_members(group_info: GroupInfo, serializer: Any, run_id: str, organiser_key: str) -> None:
    """Certified runs: every member's certificate, from what it sent in the all-gather, must admit
    its (transport-authenticated) peer id; otherwise the whole group fails before a part is sent."""
    now = time.time()
    for peer, data in zip(group_info.peer_ids, group_info.gathered):
        try:
            user = serializer.loads(list(serializer.loads(data))[2])
            admission.check_member(user, run_id, organiser_key, str(peer), now)
        except AdmissionError as e:
            raise AllreduceException(
                f"group member {peer} is not admitted to this run ({e}): nothing averaged"
            ) from None
        except Exception:  # anything else a peer could send
            raise AllreduceException(f"group member {peer} sent malformed group data: nothing averaged") from None


def _fair(group_info: GroupInfo, serializer: Any) -> GroupInfo:
    """The group with every member's bandwidth claim counted only up to what the other members
    measured of its probes (links.vouched_bandwidths) and capped (links.fair_bandwidths), so that no
    peer can claim its way to reducing the whole vector. Each member computes the same figures
    from the same gathered bytes. Malformed gathered data is left for hivemind to refuse."""
    try:
        unpacked = [list(serializer.loads(data)) for data in group_info.gathered]
        seen = []
        for u in unpacked:
            user = serializer.loads(u[2]) if isinstance(u[2], bytes) else None
            seen.append(user.get("seen") if isinstance(user, dict) else None)
        members = [str(p) for p in group_info.peer_ids]
        fair = links.fair_bandwidths(links.vouched_bandwidths(members, [u[0] for u in unpacked], seen))
        gathered = tuple(serializer.dumps([b, *u[1:]]) for b, u in zip(fair, unpacked))
    except Exception:  # anything a peer could send: hivemind's own parsing fails the group cleanly
        return group_info
    return GroupInfo(group_info.group_id, group_info.peer_ids, gathered)
