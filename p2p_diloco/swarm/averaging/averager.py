"""The averager process: hivemind's DecentralizedAverager with the consistent all-reduce
(allreduce.py), state serving and download for joiners, and admission at its doors (swarm/trust/doors.py).

`BoundedAverager` puts a deadline on every wait of the peer's process on the averager process.
`DiLoCoAverager` holds, as plain objects with their own state, the parts that check and answer
the other members: the link prober (probes.py), the auditor (auditor.py), the evidence desk
(swarm/averaging/evidence.py), the all-gather's checks (gathered.py) and this member's side of the all-reduce
(`Reduction`). They reach other members through `_stub`, which reads the p2p replica that hivemind
creates in the averager process after the fork; the averager declares their RPC handlers.

hivemind runs it as a child process of the peer; `start_step`, `set_target_group_size`,
`set_revoked`, `download_state_from`, `state_manifests`, `download_chunks`, `probe`,
`link_report`, `convicted_peers` and `verify_accusation` are called in the peer's process and
answered in the averager's, through hivemind's pipe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator  # typing's, not collections.abc's: see pyproject.toml (UP035)

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco import faults
from p2p_diloco.protocol import chunks, links
from p2p_diloco.protocol.deadlines import state_bytes
from p2p_diloco.protocol.network import Assembled
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.swarm.averaging.across import Across, Group, group_of
from p2p_diloco.swarm.averaging.allreduce import LOSSY_TENSOR, AllreduceStats, ConsistentAllReduceRunner
from p2p_diloco.swarm.averaging.auditor import Auditor
from p2p_diloco.swarm.averaging.chunked import ChunkFetcher, ChunkServer
from p2p_diloco.swarm.averaging.evidence import EvidenceDesk
from p2p_diloco.swarm.averaging.gathered import Entry, Gathering, fair, reducers
from p2p_diloco.swarm.averaging.ledger import Ledger
from p2p_diloco.swarm.averaging.matchmaking import LedMatchmaking
from p2p_diloco.swarm.averaging.probes import LinkProber
from p2p_diloco.swarm.averaging.served import read_served_state
from p2p_diloco.swarm.transport import punch, streams
from p2p_diloco.swarm.transport.processes import quiet_fork, wait_result, wait_started
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.doors import Doors
from p2p_diloco.train import metrics
from p2p_diloco.trust import robust

logger = get_logger(__name__)
START_TIMEOUT_S = 30.0  # the averager's start deadline if its DHT has none of its own (swarm.join_timeout_s's default)


def _not_a_failed_step(record: logging.LogRecord) -> bool:
    """hivemind logs every failed averaging step with its traceback (`_step`), and hands the
    same exception to the step's future, which step.py reports in one line ("no other peer
    reached round 3 within the matchmaking window"). A peer alone would print a traceback a round."""
    return not (record.funcName == "_step" and record.levelno >= logging.ERROR)


# Installed in the peer's process before the averager forks: the child inherits it.
logging.getLogger("hivemind.averaging.averager").addFilter(_not_a_failed_step)


@dataclass(frozen=True)
class Averaged:
    """One successful all-reduce, as the averager process hands it to the step (step.py)."""

    gathered: dict[Any, Any]  # peer id -> what that member showed in the all-gather (step.py's dict)
    allreduce_s: float  # from the group formed to the result in the shared buffers
    stats: AllreduceStats


class BoundedAverager(DecentralizedAverager):
    """hivemind's DecentralizedAverager with a deadline on every wait of the peer's process on the
    averager process (I3), and the controls of matchmaking and of state downloads that step.py and
    joiners use. Only DiLoCoAverager is built: hivemind names the RPC handlers after that class."""

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Fork the averager process with no garbage collection in flight (processes.quiet_fork) and
        wait until it is ready within the deadline its DHT was given (swarm.join_timeout_s): hivemind
        waits forever, also for a process that died while it started. SwarmError otherwise."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as hivemind does: the child inherits it
        self._log_tag = f"peer {str(self.dht.peer_id)[-4:]} averager"
        with quiet_fork("averaging process"):
            self.start()
        deadline_s = timeout if timeout is not None else float(getattr(self.dht, "timeout_s", START_TIMEOUT_S))
        if await_ready:
            wait_started(self, "averaging process", deadline_s)

    def run(self) -> None:
        """The averager process: its log lines name the peer, as the main process's do."""
        metrics.tag_process_logs(getattr(self, "_log_tag", "averager"))
        super().run()

    def _stub(self, peer: PeerID) -> Any:
        """This averager's RPC stub for `peer`. hivemind creates the p2p replica (`_p2p`) in the
        averager process, after the fork: it is read at each call, not when the parts are made."""
        return self.get_stub(self._p2p, peer, namespace=self.prefix)

    def _in_process(self, method: str, **kwargs: Any) -> MPFuture:
        """Have the averager process run its `method(**kwargs, future=...)` (hivemind's pipe); the future."""
        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))
        return future

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind leaves this process's p2p client socket in /tmp: shut the replica down too.
        After a SIGTERM to the peer's group p2pd is gone (swarm/transport/processes.py): hivemind's handler
        removal then fails, and there is nothing left to remove."""
        try:
            await super()._shutdown(timeout)
        except (OSError, ConnectionError) as e:
            logger.debug("averager shutdown without p2pd: %s", e)
        finally:
            if getattr(self, "_p2p", None) is not None:
                await self._p2p.shutdown()

    def start_step(self, weight: float, timeout: float, gather: Any, init_timeout: float) -> StepControl:
        """hivemind's `step(wait=False)` with a deadline on the hand-over to the averager process.

        hivemind waits without a deadline for the averager process to acknowledge the step; if that
        process dies, or stalls unpickling the step under load, the peer would hang forever (I3).
        Raises TimeoutError instead.
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
            step.attach(*wait_result(self, future_for_init, "averaging process", init_timeout))
        except FuturesTimeout:
            future_for_init.cancel()
            raise TimeoutError(f"the averager process did not take the step within {init_timeout:g} s") from None
        step.allow_allreduce()
        return step

    def matchmaking_idle(self, timeout: float) -> bool:
        """Whether no look for a group runs in the averager process (a cancelled step's look ends
        only after its own clean-up: a DHT write, then hivemind's 'disband')."""
        return bool(wait_result(self, self._in_process("_matchmaking_idle"), "averaging process", timeout))

    async def _matchmaking_idle(self, future: MPFuture) -> None:
        future.set_result(not self._matchmaking.is_looking_for_group)

    def set_round_key(self, group_bits: str, timeout: float) -> None:
        """The matchmaking key of the next step, once no look for a group runs (TimeoutError after
        `timeout`): a look re-declares itself under the averager's current key every few seconds,
        so a key changed under a cancelled step's look that has not ended yet would move that step
        into the next round's group, and the round would be lost ("group members [...] averaged
        another round; result dropped")."""
        wait_result(self, self._in_process("_set_group_bits", group_bits=group_bits), "averaging process", timeout)

    async def _set_group_bits(self, group_bits: str, future: MPFuture) -> None:
        try:
            async with self._matchmaking.lock_looking_for_group:  # the look in progress, if any, ends first
                self._matchmaking.group_key_manager.group_bits = group_bits
            future.set_result(None)
        except Exception as e:  # hivemind's own version hands any failure to the asker
            if not future.done():
                future.set_exception(e)

    def set_levels(self, levels: Levels | None) -> None:
        """The next step's two-level round (None: flat), before the step (across.py)."""
        self._outer_pipe.send(("_set_levels", [], dict(levels=levels)))

    def set_target_group_size(self, size: int) -> None:
        """A group of `size` starts its all-reduce as soon as it is complete, without waiting out the
        matchmaking window; the swarm's progress tells each peer how many peers are at the round."""
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=max(2, int(size)))))

    async def _set_target_group_size(self, size: int) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    def download_state_from(self, peer: str, timeout: float, stall_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        """(metadata, tensors) served by one chosen peer, within `timeout` seconds in all and with
        no silence of `stall_s` (I3, protocol/deadlines.py).

        hivemind's load_state_from_peers picks the peer itself and applies its timeout per chunk;
        a joiner must choose the peer (one that published the right digest) and bound the whole download.
        """
        deadline = time.monotonic() + timeout
        future = self._in_process("_download_state_from", peer=peer, deadline=deadline, stall_s=stall_s)
        return wait_result(self, future, "averaging process", timeout + 5)

    async def _download_state_from(self, peer: str, deadline: float, stall_s: float, future: MPFuture) -> None:
        allowed = deadline - time.monotonic()
        try:
            fetching = self._fetch_state(PeerID.from_base58(peer), stall_s)
            future.set_result(await asyncio.wait_for(fetching, allowed))
        except asyncio.TimeoutError:
            future.set_exception(TimeoutError(f"the whole state did not arrive within {allowed:.0f} s"))
        except BaseException as e:  # report every failure to the caller, which tries the next peer
            if not future.done():
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    async def _fetch_state(self, peer: PeerID, stall_s: float) -> tuple[dict, list[torch.Tensor]] | None:
        stream = await self._stub(peer).rpc_download_state(averaging_pb2.DownloadRequest())
        return await read_served_state(stream, state_bytes(self.total_size), peer, stall_s)

    def state_manifests(self, peers: list[str], wanted: tuple[int, str], stall_s: float) -> dict[str, chunks.Manifest]:
        """{holder: its manifest of the state `wanted`} (round, digest), asked of `peers` at once,
        each within `stall_s` (chunked.py); those that sent none are left out."""
        future = self._in_process("_state_manifests", peers=peers, wanted=wanted, stall_s=stall_s)
        return wait_result(self, future, "averaging process", stall_s + 5)

    async def _state_manifests(
        self, peers: list[str], wanted: tuple[int, str], stall_s: float, future: MPFuture
    ) -> None:
        fetching = self.chunk_fetcher.manifests(peers, wanted, state_bytes(self.total_size), stall_s)
        await _answer(future, fetching)

    def download_chunks(
        self, manifest: chunks.Manifest, holders: list[str], timeout: float, stall_s: float
    ) -> Assembled:
        """The state of `manifest` in chunks from `holders` at once, within `timeout` in all (chunked.py)."""
        deadline = time.monotonic() + timeout
        future = self._in_process(
            "_download_chunks", manifest=manifest, holders=holders, deadline=deadline, stall_s=stall_s
        )
        return wait_result(self, future, "averaging process", timeout + 5)

    async def _download_chunks(
        self, manifest: chunks.Manifest, holders: list[str], deadline: float, stall_s: float, future: MPFuture
    ) -> None:
        await _answer(future, self.chunk_fetcher.download(manifest, holders, deadline, stall_s))


async def _answer(future: MPFuture, work: Any) -> None:
    """`work`'s result, or its failure, to the peer's process."""
    try:
        future.set_result(await work)
    except BaseException as e:  # every failure goes to the caller, which says so
        if not future.done():
            future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))


class DiLoCoAverager(BoundedAverager):
    """The averager with the consistent runner (`Reduction`), copying results into the averaged
    buffers, and the parts that answer other members between and after all-reduces.

    It also serves this peer's (round, θ, momentum) to joiners through `get_current_state`,
    which runs in the host process and calls `state_provider`.
    """

    def __init__(
        self,
        *args: Any,
        start: bool,
        state_provider: Any,
        signer: RSAPrivateKey,
        residual: torch.Tensor | None = None,
        admission: tuple[str, str] | None = None,
        aggregation: tuple[robust.Aggregator, float, float] = ("mean", 1.0, 2.0),
        max_reduce_share: float = 1.0,
        leads_only_direct: bool = False,
        stage2_wait_s: float = 5.0,
        assembly_patience_s: float | None = None,
        **kwargs: Any,
    ):
        """`start`: as hivemind's, once the parts below exist (the averager process forks with them).
        `residual`: a shared-memory tensor shaped like the lossy averaged tensor; after each
        successful all-reduce it holds what the codec lost of this peer's part (error feedback).
        `admission`: (run id, organiser key) of a certified run: its doors (swarm/trust/doors.py) refuse peers
        that are not admitted at matchmaking, in the all-gather, at state downloads and probes.
        `signer`: this peer's identity key; it signs every part and average (ledger.py).
        `leads_only_direct`: as a leader, admit only peers this one holds a direct connection to (a
        private peer under hole punching: swarm/punching.py; nobody else could send it parts), and
        none while `set_leading(False)` (a public peer is live: it leads).
        `stage2_wait_s`, `assembly_patience_s`: the wait of a two-level round's stage 2 and assembly,
        and how long its owners look for the other groups' (across.py)."""
        self._state_provider, self._leads_only_direct = state_provider, leads_only_direct
        self._leading = True
        self._doors = Doors(*admission, self._published_certificates) if admission is not None else None
        super().__init__(*args, start=False, **kwargs)
        self.chunk_server = ChunkServer(self._get_current_state_from_host_process)
        self.chunk_fetcher = ChunkFetcher(self._stub)
        self.prober = LinkProber(self._stub, self.may_enter, lambda: punch.direct_peers(self._p2p))
        self.evidence = EvidenceDesk(self._stub, self.serializer, self.allreduce_kwargs["compression"], aggregation)
        self.auditor = Auditor(self._stub, self.evidence, self._adopt_matchmaking)
        self.gathering = Gathering(
            self.serializer.loads, self.peer_id, self._doors, self.auditor.left_out, self.auditor.bench, self._leader_of
        )
        two_level = (stage2_wait_s, self.may_enter, assembly_patience_s, self.auditor.convict)
        self.across = Across(str(self.peer_id), signer, self.prefix, *two_level)
        self.reduction = Reduction(
            self.serializer, self.gathering, self.auditor, signer, aggregation, max_reduce_share, residual
        )
        self.reduction.across = self.across
        if start:
            self.run_in_background(await_ready=True)

    async def add_p2p_handlers(self, p2p: Any, *args: Any, **kwargs: Any) -> None:
        """hivemind's handlers, then a two-level round's (across.py), in the averager process."""
        await super().add_p2p_handlers(p2p, *args, **kwargs)
        await self.across.start(p2p, self.dht, serves=True)

    async def _set_levels(self, levels: Levels | None) -> None:
        self.across.levels = levels

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Any]:
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    # --- admission (swarm/trust/doors.py) ---------------------------------------------------------------

    async def _published_certificates(self) -> dict[str, str]:
        found = await self.dht.get(records.certificates_key(self.prefix), latest=True, return_future=True)
        return records.certificates_in(found)

    async def may_enter(self, peer: Any, door: str) -> bool:
        """Whether `peer` may come through `door`: not if it was convicted in an audit or left out
        after an unanswered one (auditor.py); otherwise always in open runs, and if admitted in
        certified ones."""
        if (reason := self.auditor.left_out(peer)) is not None:
            if self._doors is not None:
                self._doors.log_refusal(str(peer), door, reason)
            return False
        if self._doors is None or await self._doors.admitted(str(peer)):
            return True
        self._doors.log_refusal(str(peer), door, "it holds no valid certificate for this run, or was revoked")
        return False

    def set_leading(self, leading: bool) -> None:
        """Whether this peer admits followers; before every step (`leads_only_direct` peers only)."""
        if self._leads_only_direct:
            self._outer_pipe.send(("_set_leading", [], dict(leading=leading)))

    async def _set_leading(self, leading: bool) -> None:
        self._leading = leading

    def set_revoked(self, revoked: frozenset[str]) -> None:
        """The organiser's revocations, as the host process read them (swarm/trust/gate.py); before every step."""
        if self._doors is not None:
            self._outer_pipe.send(("_set_revoked", [], dict(revoked=frozenset(revoked))))

    async def _set_revoked(self, revoked: frozenset[str]) -> None:
        assert self._doors is not None
        self._doors.set_revoked(revoked)
        self._adopt_matchmaking()

    def _adopt_matchmaking(self) -> None:
        """hivemind's matchmaking (created in this process) as LedMatchmaking, before the first step."""
        if type(self._matchmaking) is Matchmaking:
            LedMatchmaking.adopt(self._matchmaking, self.may_enter)

    async def _step(self, **kwargs: Any) -> None:
        self._adopt_matchmaking()
        if self.across.assembly is None:  # a client: hivemind added no handlers, it only fetches
            await self.across.start(self._p2p, self.dht, serves=False)
        await super()._step(**kwargs)

    def _leader_of(self, group_id: bytes) -> PeerID | None:
        """Who assembled the recent group `group_id`, if this member's matchmaking remembers it."""
        return getattr(self._matchmaking, "leaders", {}).get(group_id)

    # --- RPC handlers --------------------------------------------------------------------------
    # hivemind's ServicerBase serves the rpc_* functions of the servicer's class: it collects them
    # with their typing hints (`_collect_rpc_handlers`), registers each as
    # "<prefix>::DiLoCoAverager.rpc_<name>" (`add_p2p_handlers`) and `get_stub` calls them by those
    # names. The parts that answer (prober, auditor, evidence desk) are plain objects, so each of
    # their handlers is declared here and hands the call on. `aclosing` ends the part's generator
    # with the call, so that its clean-up (the prober's one-probe-at-a-time flag) runs at once.

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """As a leader: refuse, before hivemind sees it, a join request that the all-gather's
        checks refuse (`Gathering.refusal`). After the last message, the stream stays open until
        the follower closes it (`streams.held_open`: a reset under QUIC lost the last messages)."""
        if self.gathering.refusal(context.remote_id, request.gather) is not None:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        elif self._leads_only_direct and not (
            self._leading and str(context.remote_id) in await punch.direct_peers(self._p2p)
        ):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
        else:
            async for response in super().rpc_join_group(request, context):
                yield response
        await streams.held_open(streams.JOIN_LINGER_S)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """This peer's state, only for admitted peers (an outsider gets an empty answer)."""
        if not await self.may_enter(context.remote_id, "state download"):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_download_chunk(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The manifest or one chunk of this peer's state, only for admitted peers (`ChunkServer.answer`)."""
        if not self.allow_state_sharing or not await self.may_enter(context.remote_id, "state download"):
            return
        async with aclosing(self.chunk_server.answer(request)) as answers:
            async for message in answers:
                yield message

    async def rpc_probe(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Another member's link probe (`LinkProber.answer`)."""
        async with aclosing(self.prober.answer(stream, context)) as answers:
            async for message in answers:
                yield message

    async def rpc_audit(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's audit of this reducer's span (`Auditor.answer`)."""
        async with aclosing(self.auditor.answer(requests, context)) as answers:
            async for message in answers:
                yield message

    async def rpc_lots(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's audit lot, answered with every member's (`Auditor.answer_lots`)."""
        async with aclosing(self.auditor.answer_lots(requests, context)) as answers:
            async for message in answers:
                yield message

    async def rpc_verdicts(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member's audit verdicts, answered with every member's (`Auditor.answer_verdicts`)."""
        async with aclosing(self.auditor.answer_verdicts(requests, context)) as answers:
            async for message in answers:
                yield message

    async def rpc_evidence(
        self, requests: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A peer's request for the case behind one of this peer's convictions (`EvidenceDesk.answer`)."""
        async with aclosing(self.evidence.answer(requests, context)) as answers:
            async for message in answers:
                yield message

    # --- asked from the peer's process ---------------------------------------------------------

    def probe(self, peers: Sequence[str], size: int, timeout: float) -> MPFuture:
        """Probe each of `peers` in turn with `size` bytes, in the averager process; returns at once.
        The future's result is {peer: the rate it reported}, when the sweep is over."""
        return self._in_process("_probe", peers=list(peers), size=size, deadline=time.monotonic() + timeout)

    async def _probe(self, peers: list[str], size: int, deadline: float, future: MPFuture) -> None:
        reports = await self.prober.sweep(peers, size, deadline)
        if not future.done():
            future.set_result(reports)

    def link_report(self, timeout: float) -> tuple[float | None, dict[str, float]]:
        """(this peer's figure, what it measured of each sender) from the averager process."""
        return wait_result(self, self._in_process("_link_report"), "averaging process", timeout)

    async def _link_report(self, future: MPFuture) -> None:
        future.set_result(self.prober.report())

    def convicted_peers(self, timeout: float) -> frozenset[str]:
        """The reducers this averager convicted, asked from the host process."""
        return self._in_process("_convicted_peers").result(timeout=timeout)

    async def _convicted_peers(self, future: MPFuture) -> None:
        future.set_result(frozenset(self.auditor.convicted))

    def verify_accusation(self, accuser: str, accused: str) -> MPFuture:
        """Ask `accuser` for its case against `accused` and judge it, in the averager process; the
        future's result is whether `accused` is now convicted here."""
        return self._in_process("_verify_accusation", accuser=accuser, accused=accused)

    async def _verify_accusation(self, accuser: str, accused: str, future: MPFuture) -> None:
        verdict = await self.evidence.verdict(accuser, accused)
        if verdict is not None and not verdict[0]:  # `forged` proves nothing against the accused
            self.auditor.convict(accused)
            logger.warning("convicted reducer %s on the evidence of %s: %s", accused, accuser, verdict[1])
        future.set_result(accused in self.auditor.convicted)

    # --- the all-reduce (hivemind's hooks, around `Reduction`) -------------------------------------

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Averaged:
        """The group's all-reduce, once its all-gather checks out (`Reduction.admitted`). hivemind's
        own version returns only the gathered data; this one also returns what the runner counted."""
        started = time.perf_counter()
        group_info = self.reduction.admitted(group_info)
        try:
            gathered, stats = await self._balanced_allreduce(group_info, min_vector_size, **kwargs)
        except BaseException as e:  # as in hivemind's own version: any failure fails the step
            if isinstance(e, Exception):
                logger.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e
        return Averaged(gathered, time.perf_counter() - started, stats)

    async def _balanced_allreduce(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any
    ) -> tuple[dict[Any, Any], AllreduceStats]:
        """hivemind's `_aggregate_with_group` body: spans from the bandwidths in the all-gather, then
        the all-reduce on the shared buffers; (the gathered data, the runner's counts)."""
        bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes)))
        modes = tuple(map(AveragingMode, mode_ids))
        downloads = [b if mode != AveragingMode.CLIENT else 0.0 for b, mode in zip(bandwidths, modes)]
        loop = asyncio.get_event_loop()
        fractions = await loop.run_in_executor(None, load_balance_peers, self.total_size, downloads, min_vector_size)
        async with enter_asynchronously(self.get_tensors()) as local_tensors:
            stats = await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=fractions, **kwargs)
        return gathered, stats

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> AllreduceStats:
        """hivemind's hook, with the consistent runner (`Reduction`); what the runner counted."""
        group_id = group_info.group_id if group_id is None else group_id
        on = dict(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix)
        runner = self.reduction.runner(tensors, group_info, group_id, **on, **kwargs)
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            raise AllreduceException("auxiliary peers are not used by p2p-diloco")
        stats = await self.reduction.apply(runner, tensors, group_info)
        self.last_updated = time.time()
        self._state_updated.set()
        faults.reached(faults.FaultPoint.ALLREDUCE_DONE)
        return stats


class Reduction:
    """This member's side of a group's all-reduce around the consistent runner (allreduce.py): the
    all-gather's checks before a part is sent, the runner and its ledger, the audit, and the result
    applied to the shared buffers. Held by DiLoCoAverager, whose hivemind hooks call it."""

    def __init__(
        self,
        serializer: Any,
        gathering: Gathering,
        auditor: Auditor,
        signer: RSAPrivateKey,
        aggregation: tuple[robust.Aggregator, float, float],
        max_share: float,
        residual: torch.Tensor | None,
    ):
        """See DiLoCoAverager's arguments; `serializer`: hivemind's, that wrote the all-gather."""
        self._serializer, self._gathering, self._auditor = serializer, gathering, auditor
        self._signer = signer
        self._aggregation = aggregation  # (robust.Aggregator, clip, weight cap): how this peer reduces
        self._max_share = max_share  # no member reduces more of the vector than this
        self._residual = residual
        self.across: Across | None = None  # a two-level round's stages 2 and 3, where its levels are set

    def admitted(self, group_info: GroupInfo) -> GroupInfo:
        """The group, every member's bandwidth claim counted only as far as the others vouched for
        it (gathered.fair), once every entry parsed, every member is admitted, and none is left out
        by this member's audits; AllreduceException otherwise, before a part is sent."""
        entries = self._gathering.entries(group_info)
        self._gathering.admit_members(group_info, entries)
        left_out = {str(p): why for p in group_info.peer_ids if (why := self._auditor.left_out(p)) is not None}
        if left_out:  # a leader that let a convicted or benched reducer in: fail before a part is sent
            raise AllreduceException(f"group members left out by this peer's audits: {left_out}; nothing averaged")
        return fair(group_info, entries, self._serializer)

    def runner(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes, **kwargs: Any
    ) -> ConsistentAllReduceRunner:
        """The group's runner (hivemind's runner arguments in `kwargs`), each span capped at
        `max_share` of the vector; kept for the audits of its reducers' spans (auditor.py)."""
        entries = self._gathering.entries(group_info)  # parsed before, in `admitted`
        reduces = reducers(group_info, entries)
        kwargs["peer_fractions"] = tuple(links.cap_shares(kwargs["peer_fractions"], reduces, self._max_share))
        vector = kwargs["compression"].encoded_bytes(tensors)
        kwargs["part_size_bytes"] = links.part_bytes(vector, sum(reduces), kwargs["part_size_bytes"])
        runner = ConsistentAllReduceRunner(
            ledger=self._ledger(group_info, group_id, entries),
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            aggregation=self._aggregation,
            **kwargs,
        )
        self._auditor.keep(runner)
        return runner

    def _group(self, group_info: GroupInfo) -> Group:
        """The group as stage 2 needs it (across.py), from its all-gather; AcrossError where a
        member showed no weight (a peer from before two-level rounds)."""
        return group_of([str(p) for p in group_info.peer_ids], self._gathering.entries(group_info))

    def _ledger(self, group_info: GroupInfo, group_id: bytes, entries: list[Entry]) -> Ledger:
        """The all-reduce's ledger, with every member's identity key from the all-gather."""
        peers = [str(p) for p in group_info.peer_ids]
        senders = [p for p, e in zip(peers, entries) if e.mode != AveragingMode.AUX]
        ledger = Ledger(group_id, peers, senders, self._signer, self._gathering.member_keys(group_info, entries))
        ledger.shown_weights = {p: e.weight for p, e in zip(peers, entries) if e.weight is not None}
        return ledger

    async def apply(
        self, runner: ConsistentAllReduceRunner, tensors: Sequence[torch.Tensor], group_info: GroupInfo
    ) -> AllreduceStats:
        """Run the all-reduce and copy (not add) its averages into `tensors`, or in a two-level round
        what stages 2 and 3 made of them (across.py); what it counted."""
        # Collect the whole result first: the shared buffers change only after every part arrived,
        # so a failure leaves the caller's pseudo-gradient untouched (I2).
        if self._residual is not None:
            runner.residuals[LOSSY_TENSOR] = torch.zeros_like(self._residual)
        started = time.perf_counter()
        try:
            results = [averaged async for averaged in runner]
            butterfly_done = time.perf_counter()
            pace = runner.stats().bytes_received / max(butterfly_done - started, 1e-3)
            # every member's lot, then every other reducer's answer checked, before anything is applied
            audit_bytes = await self._auditor.check(runner, pace, butterfly_done - started)
        finally:
            self._auditor.settle(runner.ledger)
            if fates := runner.fates():  # clipping is routine for a robust aggregator; a dropped part is news
                level = logging.INFO if " dropped" in fates else logging.DEBUG
                logger.log(level, "parts of this peer's span: %s", fates)
        across: dict[str, Any] = {}
        if self.across is not None and self.across.levels is not None and self.across.levels.groups > 1:
            how, _, cap = self._aggregation
            results = await self.across.finish(self._group(group_info), results, how, cap)
            cost = self.across.last
            assert cost is not None  # set by a finish that returned
            across = dict(
                groups=cost.groups,
                spans=self.across.levels.spans,
                across_s=cost.seconds,
                across_sent=cost.sent,
                across_received=cost.received,
            )
        for tensor, averaged in zip(tensors, results):
            tensor.copy_(averaged)
        if self._residual is not None:
            self._residual.copy_(runner.residuals[LOSSY_TENSOR])
        butterfly_s, audit_s = butterfly_done - started, time.perf_counter() - butterfly_done
        stats = runner.stats()
        return dataclasses.replace(stats, butterfly_s=butterfly_s, audit_s=audit_s, audit_bytes=audit_bytes, **across)
