"""A consistent butterfly all-reduce on hivemind's DecentralizedAverager (I1, I2).

hivemind's stock runner has each reducer send back `average - sender's part` and each sender add
that delta to its own copy. With compression, or merely different float rounding, every peer ends
with slightly different values (about 1e-3 relative with fp16, docs/design.md §7). Here a
reducer encodes the *average itself* once per part, sends those bytes to every sender, and decodes
the same bytes for its own span; every member then copies (not adds) what it decoded. So all
members hold the same bytes, whatever the codec.

The codecs are p2p_diloco.protocol.codecs, carried in hivemind's tensor messages by `WireCodec`. The first
averaged tensor goes through the run's codec, the second (norms, biases: small) always exact. As a
sender, the runner also keeps what the codec lost of each part it sent (error feedback).

Between all-reduces, members probe each other's links (`rpc_probe`, outside the all-reduce's
lockstep) and announce what they measured, so that the load balancer gives faster peers larger
spans and no peer more than others measured of it (protocol/links.py).

hivemind also reports success when a reducer dies mid-round, leaving that span at the survivor's
own values. Here any failed reducer or banned sender fails the whole step, and the caller's
buffer keeps its pseudo-gradient for a retry: a partial average is never applied.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter

from p2p_diloco import faults
from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.ledger import Ledger
from p2p_diloco.trust import audit, robust

logger = get_logger(__name__)


LOSSY_TENSOR = 0  # index of the averaged tensor that goes through the run's codec; any other travels exact


@dataclass(frozen=True)
class AllreduceStats:
    """What one all-reduce moved, as this member's runner counted it (encoded bytes)."""

    bytes_sent: int
    bytes_received: int
    butterfly_s: float = 0.0  # the reduce-scatter and all-gather of the parts, until every average arrived
    audit_s: float = 0.0  # then the audit of the other reducers (auditor.py), before anything is applied
    audit_bytes: int = 0  # what their answers to the audit took, apart from bytes_received
    groups: int = 1  # a two-level round's: the most groups a sub-span counted (across.py)
    spans: int = 0  # a two-level round's spans a group (0: a flat round)
    across_s: float = 0.0  # a two-level round's stages 2 and 3, after the audit
    across_sent: int = 0  # their messages' bytes (apart from bytes_sent and bytes_received)
    across_received: int = 0


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

    def encoded_bytes(self, tensors: Sequence[torch.Tensor]) -> int:
        """The bytes `tensors` take on the wire, as hivemind counts them when it cuts parts."""
        infos = (CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors))
        return int(
            sum(t.numel() * t.element_size() * self.estimate_compression_ratio(i) for t, i in zip(tensors, infos))
        )


class _Collected:
    """Stands in for hivemind's accumulator tensor: keeps each sender's part and weight of the
    current part index instead of adding them up, so the reducer can combine them robustly, in
    sender order whatever order they arrived in."""

    def __init__(self, sender_of: dict[int, int]) -> None:
        self.sender_of = sender_of  # id(part) -> sender index, noted by RobustReducer.accumulate_part
        self.parts: dict[int, tuple[torch.Tensor, float]] = {}  # sender index -> (part, weight)

    def add_(self, part: torch.Tensor, alpha: float) -> None:
        self.parts[self.sender_of.pop(id(part), -1 - len(self.parts))] = (part, float(alpha))

    def in_sender_order(self) -> tuple[list[int], list[torch.Tensor], list[float]]:
        senders = sorted(self.parts)
        return senders, [self.parts[i][0] for i in senders], [self.parts[i][1] for i in senders]


class RobustReducer(TensorPartReducer):
    """hivemind's reducer, except that a part is combined by `robust.aggregate` once every sender's
    piece of it arrived (trust/robust.py): weights capped, outsized parts clipped, or a trimmed mean. It
    holds one part index at a time: k parts of PART_SIZE_BYTES, not a model copy. A part every
    sender gave weight 0 averages to zeros, not 0/0 = NaN (a peer may join with weight 0,
    outer.drop_rate, and so may all of them)."""

    aggregation: tuple[robust.Aggregator, float, float] = ("mean", 1.0, 2.0)  # (how, clip, weight cap)
    sender_of: dict[int, int]
    fates: Counter  # (sender index, "clipped" or "dropped") -> parts of this span

    def collecting(self) -> None:
        """Become the reducer of this class (its __class__ is set on hivemind's instance)."""
        self.sender_of, self.fates = {}, Counter()
        self.accumulator = _Collected(self.sender_of)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Collected(self.sender_of)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        self.sender_of[id(tensor_part)] = sender_index
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            senders, parts, weights = self.accumulator.in_sender_order()
            how, clip, cap = self.aggregation
            if parts:
                result, fates = robust.combine(parts, weights, how, clip, cap)
                self.fates.update((sender, fate) for sender, fate in zip(senders, fates) if fate)
            else:
                result = torch.zeros(self.part_shapes[self.current_part_index])
            self.current_part_future.set_result(result)
            self.reset_accumulators()


class ConsistentAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose every member ends with bit-identical results."""

    def __init__(self, *args: Any, ledger: Ledger, **kwargs: Any):
        """`ledger`: signs what this member sends and checks what it receives (ledger.py)."""
        aggregation = kwargs.pop("aggregation", ("mean", 1.0, 2.0))
        super().__init__(*args, **kwargs)
        self.ledger = ledger
        self.tensor_part_reducer.__class__ = RobustReducer  # same state; parts are kept, then combined
        self.tensor_part_reducer.aggregation = aggregation
        self.tensor_part_reducer.collecting()
        self.tensor_part_container.return_deltas = False  # results are averages, not deltas
        self.failures: list[str] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.residuals: dict[int, torch.Tensor] = {}  # tensor index -> what the codec lost of what we sent
        self._encoded: dict[int, Any] = {}  # part index -> serialized average of our span
        self._signatures: dict[int, bytes] = {}  # part index -> our signature of that average

    @property
    def aggregation(self) -> tuple[robust.Aggregator, float, float]:
        return self.tensor_part_reducer.aggregation

    def stats(self) -> AllreduceStats:
        """The bytes this member sent and received in this all-reduce, so far."""
        return AllreduceStats(self.bytes_sent, self.bytes_received)

    def fates(self) -> str:
        """What this member's reduction did to the senders' parts of its span, for the log ('' if
        nothing): parts clipped to the clip norm, parts dropped for pointing against the median."""
        by_sender: dict[int, list[str]] = {}
        for (sender, fate), count in sorted(self.tensor_part_reducer.fates.items()):
            if 0 <= sender < len(self.sender_peer_ids):
                by_sender.setdefault(sender, []).append(f"{count} {fate}")
        total = self.tensor_part_reducer.num_parts
        return "; ".join(f"{self.sender_peer_ids[s]}: {', '.join(v)} of {total}" for s, v in by_sender.items())

    @property
    def codec(self) -> WireCodec:
        return self.tensor_part_container.compression

    def _encode_average(self, part_index: int, averaged: torch.Tensor) -> Any:
        """Serialize the average of one part of our span once; every sender gets these bytes."""
        if part_index not in self._encoded:
            info = self.tensor_part_container._input_parts_by_peer[self._my_index][part_index][1]
            encoded = self.tensor_part_container.compression.compress(averaged, info, allow_inplace=False)
            self._signatures[part_index] = self.ledger.sign_average(self._my_index, part_index, encoded)
            self._encoded[part_index] = encoded
        return self._encoded[part_index]

    def should_delay_results(self, peer_id: Any) -> bool:
        """Never. hivemind makes a member that reduces nothing (a client, or a peer the load
        balancer gave no span: the slowest) upload all its parts before it may download any
        average, so its two directions take turns, nearly doubling its time on a slow link
        (docs/benchmarks.md, bench/balance.py). Our senders also keep their stream open until every average arrived
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
            why = " ".join(str(e).split())[:400]  # a dial error lists each address's on lines of their own
            self.failures.append(f"reducer {str(peer_id)[-6:]}: {type(e).__name__} {why}")
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_span(self, peer_index: int) -> None:
        """Our own parts of our span go through the codec and the ledger like anyone's: every part
        of a span is combined as its reducer shows it to the audit."""
        sender_index = self.sender_peer_ids.index(self.peer_id)
        parts = self.tensor_part_container._input_parts_by_peer[peer_index]
        for part_index, (part, info) in enumerate(parts):
            encoded, signature = self._encode_input(peer_index, part_index, part, info)
            self.ledger.accept_part(peer_index, sender_index, part_index, self.weight, encoded, signature)
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, self.codec.extract(encoded), weight=self.weight
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
        while its last answer is still on the way: on a slow link p2pd would drop that answer, and
        that member alone would fail the round ("sent 6 parts, expected 7")."""
        received_all = asyncio.Event()
        expected = self.tensor_part_container.num_parts_by_peer[peer_index]
        if expected == 0:
            received_all.set()
        inputs = _end_after(self._counted(self._generate_input_for_peer(peer_index), peer_index), received_all)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
        part_index = 0

        def decode(msg: averaging_pb2.AveragingData) -> tuple[torch.Tensor, averaging_pb2.AveragingData]:
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
            self.bytes_received += len(msg.tensor_part.buffer)
            return self.codec.extract(msg.tensor_part), msg

        try:
            async for averaged in amap_in_executor(
                decode,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                averaged, msg = averaged
                check_part(
                    averaged, self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0], peer_id
                )
                self.ledger.accept_average(peer_index, part_index, msg.tensor_part, msg.peer_id)
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
                if part_index == expected:
                    received_all.set()
        except ConnectionError:
            # The reducer may close its end, or even exit, as soon as its own result is complete
            # (hivemind then raises ConnectionResetError). Once every average of
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
        numbered = [(i, part, info) for i, (part, info) in enumerate(parts)]
        first = True
        async for encoded, signature in amap_in_executor(
            lambda item: self._encode_input(peer_index, *item),
            as_aiter(*numbered),
            max_prefetch=self.tensor_part_container.prefetch,
        ):
            # AveragingData has no field for a signature; `peer_id` (bytes) is unused in this stream.
            if first:
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=self.group_id,
                    tensor_part=encoded,
                    weight=self.weight,
                    peer_id=signature,
                )
                first = False
            else:
                yield averaging_pb2.AveragingData(tensor_part=encoded, weight=self.weight, peer_id=signature)

    def _encode_input(
        self, peer_index: int, part_index: int, part: torch.Tensor, info: CompressionInfo
    ) -> tuple[runtime_pb2.Tensor, bytes]:
        """One part for `peer_index`, encoded, and its seal signed (ledger.py); what the codec lost
        goes to `residuals`."""
        encoded = self.codec.compress(part, info)
        decoded = self.codec.extract(encoded)
        residual = self.residuals.get(info.key)
        if residual is not None:
            start = part.storage_offset() - self.tensor_part_container.local_tensors[info.key].storage_offset()
            residual[start : start + part.numel()] = part.reshape(-1) - decoded.reshape(-1)
        return encoded, self.ledger.sign_part(peer_index, part_index, self.weight, encoded, decoded)

    def _take_part(
        self,
        sender_index: int,
        part_index: int,
        decoded: torch.Tensor | AllreduceException,
        msg: averaging_pb2.AveragingData,
        like: torch.Tensor,
    ) -> torch.Tensor:
        """A sender's part of our span, checked (I4) once its signature verified. A malformed part
        its sender signed (a weight that is not finite and >= 0, bytes that do not decode, values
        that are not finite, chunk norms that are not its values') is kept as a case against the
        sender (ledger.py), which anyone can judge; a well-formed part of the wrong size makes this
        member refuse the sender."""
        sender = str(self.sender_peer_ids[sender_index])
        signed = self.ledger.accept_part(
            self._my_index, sender_index, part_index, msg.weight, msg.tensor_part, msg.peer_id
        )
        why = malformed(decoded, msg.weight, signed.seal.norms)
        if why is not None:
            self.ledger.garbage[sender] = (self._my_index, part_index, msg)
            raise AllreduceException(f"{sender} signed and sent a malformed part ({why})")
        assert isinstance(decoded, torch.Tensor)  # malformed() said so
        if decoded.shape != like.shape:
            self.ledger.misfits.add(sender)
        check_part(decoded, like, sender)
        return decoded

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """As a reducer: add each sender's part to the sum, answer with the encoded average (not a delta).

        Parts are added as they arrive, whatever the answers: those wait in a queue (references to
        the one encoded average per part, shared by all senders). Answering in the same loop would
        make adding a slow sender's part i+1 wait until its answer to part i had left, so every
        member would wait on that sender's download as well as its upload.

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
            async for decoded, msg in amap_in_executor(
                lambda msg: (_try_extract(self.codec, msg.tensor_part), msg),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                faults.reached(faults.FaultPoint.ALLREDUCE_PART)
                part = self._take_part(sender_index, part_index, decoded, msg, expected_parts[part_index])
                self.bytes_received += len(msg.tensor_part.buffer)
                averaged = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, part, weight=msg.weight
                )
                if self.banned_senders:
                    # hivemind completes a part without a sender that dropped out; that average
                    # is partial. Sending it would let this sender apply it while the others fail.
                    answers.put_nowait(averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR))
                    return
                encoded = await asyncio.get_event_loop().run_in_executor(
                    None, self._encode_average, part_index, averaged
                )
                answers.put_nowait(
                    averaging_pb2.AveragingData(
                        code=averaging_pb2.AVERAGED_PART, tensor_part=encoded, peer_id=self._signatures[part_index]
                    )
                )
                part_index += 1
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
            answers.put_nowait(done)


def _try_extract(codec: WireCodec, message: runtime_pb2.Tensor) -> torch.Tensor | AllreduceException:
    try:
        return codec.extract(message)
    except AllreduceException as e:
        return e


async def _end_after(messages: AsyncIterator[Any], event: asyncio.Event) -> AsyncIterator[Any]:
    """`messages`, then wait for `event` before the stream ends."""
    async for message in messages:
        yield message
    await event.wait()


def malformed(
    decoded: torch.Tensor | AllreduceException, weight: float, norms: Sequence[float] | None = None
) -> str | None:
    """Why a signed part is malformed whatever the group (anyone can check it from the part
    alone, evidence.judge): its weight, its bytes, its values, its signed chunk norms (where
    given). None if it is not."""
    if not (0.0 <= weight < float("inf")):
        return f"weight {weight}"
    if isinstance(decoded, AllreduceException):
        return str(decoded)
    if not bool(torch.isfinite(decoded).all()):
        return "non-finite values"
    return None if norms is None else audit.misnormed(norms, decoded)


def check_part(part: torch.Tensor, like: torch.Tensor, peer: Any) -> None:
    """Untrusted input (I4): a part must have the expected shape and finite values."""
    if part.shape != like.shape:
        raise AllreduceException(f"{peer} sent a part of shape {tuple(part.shape)}, expected {tuple(like.shape)}")
    if not bool(torch.isfinite(part).all()):
        raise AllreduceException(f"{peer} sent non-finite values")
