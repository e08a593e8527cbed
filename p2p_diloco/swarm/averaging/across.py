"""A two-level round's stages 2 and 3 for one member, after its group's all-reduce (docs/design.md
§3, "Past one group", step (2)).

Stage 1 is the group's consistent, audited all-reduce, unchanged: every member then holds its
group's average of the whole vector. Then, before anything is applied:

1. *The layout.* Every member computes its group's layout alike from the all-gather: the members
   in group order and the owner of each of the round's s fixed spans (twolevel.owners, among the
   members others can dial), seals it and pushes the seal to each of the span owners
   (`AcrossServicer.rpc_layout_seal` takes it, for the round and attempt it expects).
2. *Stage 2.* The owner of span k collects its members' seals (its claim, protocol/claims.py),
   meets the span-k owners of the other groups (assembly.py) and runs stage 2 of span k
   (stage2.py) with its group's partial: the group's average of span k times the group's weight
   (twolevel.group_weight, from the weights the members showed in the all-gather).
3. *Stage 3.* Every member takes every span's decided sub-spans: an owner from its own stage 2, any
   other member from its group's owner of the span, which relays each sub-span with every replica's
   signature (else from the replicas themselves: `Stage2.fetch_decided`), with the plan it makes
   itself from what that owner shows of the assembly (claims.plan_for_member: only a list holding
   the layout this member sealed). A member thus talks to its own group only, unless an owner fails.

The result, every sub-span divided by the weight it names (twolevel.final), replaces the group's
average. Any failure fails the step (AcrossError), before anything is applied (I2).

The group's own all-gather of averages stays: every member holds its group's audited average, so
the partial an owner signs in stage 2 is one its members can recompute (step (3) of the design's
list: checking it). It costs each member one more download of (s - 1)/s of Δ than the design's
cost, where members fetch only stage 3.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol import claims, partials, twolevel
from p2p_diloco.protocol.claims import Claim, GroupLayout
from p2p_diloco.protocol.twolevel import Levels, Output, Partial
from p2p_diloco.swarm.averaging import stage2
from p2p_diloco.swarm.averaging.assembly import SEALS_WAITS, Assembly, AssemblyError, Door, Traffic, open_door
from p2p_diloco.swarm.averaging.gathered import Entry
from p2p_diloco.swarm.averaging.stage2 import Plan, Stage2, Stage2Error, Stage2Servicer
from p2p_diloco.trust import robust
from p2p_diloco.trust.wire import WireError

logger = logging.getLogger(__name__)


class AcrossError(SwarmError):
    """This member ends a two-level round without every span's decided result: nothing applied."""


@dataclass(frozen=True)
class Group:
    """What stage 2 needs of a stage-1 group, from its all-gather: its members in group order, those
    others can dial (they may own spans), each member's weight, and each member's link figure as
    the group counts it (gathered.fair: vouched for by the others' probes; 0 for one that may not
    reduce), by which its dialable members share the spans."""

    members: tuple[str, ...]
    dialable: frozenset[str]
    weights: tuple[float, ...]
    rates: tuple[float, ...] = ()


def group_of(members: Sequence[str], entries: Sequence[Entry]) -> Group:
    """A group from its members (in group order) and their all-gather entries, as `gathered.fair`
    left them; AcrossError where a member showed no weight (a peer from before two-level rounds)."""
    if any(e.weight is None for e in entries):
        raise AcrossError("a group member showed no weight in the all-gather; nothing applied")
    dialable = frozenset(m for m, e in zip(members, entries) if e.serves and e.mode != AveragingMode.CLIENT)
    weights = tuple(float(e.weight or 0.0) for e in entries)
    return Group(tuple(members), dialable, weights, tuple(float(e.bandwidth or 0.0) for e in entries))


@dataclass(frozen=True)
class AcrossStats:
    """What stages 2 and 3 of one round cost this member: seconds, and the bytes it sent and
    received (protobuf payloads, as the all-reduce counts its parts: stage 2's and 3's messages, the
    layout seals, and the claims of the owners' assembly as gathered, `assembly.Traffic`), and the
    most groups a sub-span counted."""

    seconds: float
    sent: int
    received: int
    groups: int


class _CountingStub:
    """A stage-2 stub whose calls count what they send and what comes back."""

    def __init__(self, stub: Any, traffic: Traffic) -> None:
        self._stub, self._traffic = stub, traffic

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._stub, name)

        async def counted(request: averaging_pb2.AveragingData) -> averaging_pb2.AveragingData:
            self._traffic.sent += request.ByteSize()
            answer = await call(request)
            self._traffic.received += answer.ByteSize()
            return answer

        return counted


class SpanServicer(Stage2Servicer):
    """Stage 2's handlers in a swarm peer, counting what other owners and members send and fetch."""

    def __init__(self, desk: Stage2, traffic: Traffic, door: Door) -> None:
        super().__init__(desk)
        self._traffic, self._door = traffic, door

    async def _answer(self, request: averaging_pb2.AveragingData, context: P2PContext, handle: Any) -> Any:
        """`handle`'s answer to a peer that may come in (an empty one to any other), counted."""
        if await self._door(str(context.remote_id), "stage 2"):
            answer = await handle(request, context)
        else:
            answer = averaging_pb2.AveragingData()
        self._traffic.count(answer.ByteSize(), request.ByteSize())
        return answer

    async def rpc_stage2_partial(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self._answer(request, context, self.desk.take_partial)

    async def rpc_stage2_output(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self._answer(request, context, self.desk.take_output)

    async def rpc_stage2_fetch(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self._answer(request, context, self.desk.serve)


class AcrossServicer(ServicerBase):
    """Takes the layout seals the group's members push to this peer, one of their span owners."""

    def __init__(self, door: Door = open_door, traffic: Traffic | None = None) -> None:
        self._door, self._traffic = door, traffic or Traffic()
        self.expected: bytes | None = None  # the key of the round and attempt this peer is in (Levels.key)
        self.seals: dict[str, tuple[bytes, bytes]] = {}  # member -> (statement, seal) under `expected`
        self._pushed: asyncio.Condition | None = None  # made in the averager's loop, at the first use

    @property
    def pushed(self) -> asyncio.Condition:
        if self._pushed is None:
            self._pushed = asyncio.Condition()
        return self._pushed

    def expect(self, key: bytes | None) -> None:
        """Keep the seals of round and attempt `key` from now on (before its step starts)."""
        if key != self.expected:
            self.expected, self.seals = key, {}

    async def rpc_layout_seal(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A member's seal over its layout of the round and attempt named in `group_id`: kept (one
        per member, by the peer id that sent it) where it is this peer's, checked when it is used."""
        member = str(context.remote_id)
        statement, seal = request.tensor_part.buffer, request.peer_id
        fits = len(statement) <= claims.MAX_CLAIM and len(seal) <= stage2.MAX_SEAL
        if request.group_id == self.expected and fits and await self._door(member, "layout seal"):
            async with self.pushed:
                if len(self.seals) < claims.MAX_MEMBERS or member in self.seals:
                    self.seals[member] = (statement, seal)
                self.pushed.notify_all()
        answer = averaging_pb2.AveragingData(group_id=request.group_id)
        self._traffic.count(answer.ByteSize(), request.ByteSize())
        return answer

    async def wait_for(self, key: bytes, members: Sequence[str], deadline_s: float) -> dict[str, tuple[bytes, bytes]]:
        """The seals pushed under `key` once every one of `members` pushed one, or the deadline passed."""
        async with self.pushed:
            try:
                ready = lambda: self.expected == key and all(m in self.seals for m in members)  # noqa: E731
                await asyncio.wait_for(self.pushed.wait_for(ready), deadline_s)
            except asyncio.TimeoutError:
                pass
            return dict(self.seals) if self.expected == key else {}


class Across:
    """One member's side of a two-level round: `start` in the averager process once its p2p is up,
    `levels` set before each step (None: a flat round), then `finish` after each group all-reduce."""

    def __init__(
        self,
        me: str,
        signer: RSAPrivateKey,
        namespace: str,
        wait_s: float,
        door: Door = open_door,
        patience_s: float | None = None,
        convicted: Callable[[str], None] = lambda peer: None,
    ) -> None:
        """`namespace`: the run's, for the handlers; `wait_s`: stage 2's and the assembly's wait;
        `patience_s`: how long an owner looks for the other groups' owners (Assembly's);
        `door(peer, which)`: whether a peer may come in (the averager's `may_enter`: admission in
        certified runs, and no peer this one's audits left out), at every handler and for every
        member of a claim; `convicted(peer)`: told of every peer stage 2 convicts here."""
        self.me, self._signer, self.namespace, self.wait_s = me, signer, namespace.replace(".", "_"), wait_s
        self._door, self._patience_s = door, patience_s
        self._levels: Levels | None = None
        self.traffic = Traffic()
        self.servicer = AcrossServicer(door, self.traffic)
        self._p2p: P2P | None = None
        self.stage2 = Stage2(me, signer, self._stage2_stub, wait_s, convicted)
        self.assembly: Assembly | None = None
        self.last: AcrossStats | None = None  # the last `finish`'s, once it ended with a result

    @property
    def levels(self) -> Levels | None:
        return self._levels

    @levels.setter
    def levels(self, levels: Levels | None) -> None:
        """The next step's levels; from now on its members' seals are kept."""
        self._levels = levels
        self.servicer.expect(None if levels is None else levels.key)

    async def start(self, p2p: P2P, dht: DHT, serves: bool) -> None:
        """The handlers, where others can dial this peer; a client only fetches."""
        self._p2p, self.assembly = p2p, Assembly(p2p, dht, self.namespace, self.wait_s, self._patience_s)
        self.assembly.servicer.door, self.assembly.servicer.traffic = self._door, self.traffic
        if serves:
            await self.assembly.start()
            await SpanServicer(self.stage2, self.traffic, self._door).add_p2p_handlers(p2p, namespace=self.namespace)
            await self.servicer.add_p2p_handlers(p2p, namespace=self.namespace)

    def _stage2_stub(self, peer: str) -> object:
        assert self._p2p is not None, "started"
        stub = SpanServicer.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.namespace)
        return _CountingStub(stub, self.traffic)

    def _holds(self, round_key: bytes) -> claims.Holds:
        return lambda member, statement, seal: stage2.sealed_by(member, round_key, statement, seal)

    async def finish(
        self, group: Group, results: Sequence[torch.Tensor], how: robust.Aggregator, cap: float
    ) -> list[torch.Tensor]:
        """The round's result in place of `results` (the group's averages, in the averaged tensors'
        shapes), or AcrossError."""
        levels = self.levels
        assert levels is not None and self.assembly is not None, "a two-level round, started"
        started, sent, received = time.perf_counter(), self.traffic.sent, self.traffic.received
        flat = torch.cat([r.reshape(-1).float() for r in results])
        rates = dict(zip(group.members, group.rates)) if group.rates else None
        owners = twolevel.owners(levels.seed, group.members, levels.spans, group.dialable.__contains__, rates)
        weight = twolevel.group_weight(group.weights, how, cap)
        roots, mine = _partials(flat, weight, owners, self.me)
        layout = GroupLayout(levels.key, group.members, tuple(owners), roots)
        own = stage2.seal(self._signer, levels.key, layout.statement())
        await asyncio.gather(*(self._push(owner, levels.key, layout, own) for owner in set(owners) - {self.me}))
        seals = await self._seals(levels.key, layout, own) if self.me in owners else {}
        work = []
        for span, (start, end) in enumerate(twolevel.spans(flat.numel(), levels.spans)):
            if span in mine:
                work.append(self._own(levels, span, Claim(self.me, layout, seals), mine[span]))
            else:
                work.append(self._fetched(levels, span, layout, flat[start:end], weight))
        done = await asyncio.gather(*work, return_exceptions=True)
        failed = [e for e in done if isinstance(e, BaseException)]
        if failed:
            known = (AcrossError, AssemblyError, Stage2Error, WireError)
            if not all(isinstance(e, known) for e in failed):
                raise next(e for e in failed if not isinstance(e, known))
            # every span's reason, once each (which span fails first is a race; a conviction's matters)
            whys = list(dict.fromkeys(str(e).removesuffix("; nothing applied") for e in failed))
            raise AcrossError(f"two-level round {levels.round}: {'; '.join(whys[:4])}; nothing applied")
        outputs = [o for each in done for o in each]  # type: ignore[union-attr]
        took = time.perf_counter() - started
        traffic = (self.traffic.sent - sent, self.traffic.received - received)
        self.last = AcrossStats(took, *traffic, max(len(o.groups) for o in outputs))
        return _shaped(twolevel.final(outputs), results)

    async def _push(self, owner: str, round_key: bytes, layout: GroupLayout, seal: bytes) -> None:
        """This member's seal over its group's layout to one of the group's span owners (members
        dial out: one behind a home router's NAT seals too)."""
        assert self._p2p is not None
        stub = AcrossServicer.get_stub(self._p2p, PeerID.from_base58(owner), namespace=self.namespace)
        request = averaging_pb2.AveragingData(
            group_id=round_key, tensor_part=runtime_pb2.Tensor(buffer=layout.statement()), peer_id=seal
        )
        try:
            answer = await asyncio.wait_for(stub.rpc_layout_seal(request), SEALS_WAITS * self.wait_s)
            self.traffic.count(request.ByteSize(), answer.ByteSize())
        except Exception as e:  # noqa: BLE001 - that owner's claim counts without this seal, or not at all
            logger.warning("two levels: layout seal to %s: %s", owner, type(e).__name__)

    async def _seals(self, round_key: bytes, layout: GroupLayout, own: bytes) -> dict[str, bytes]:
        """The seals of the members whose own layout is this one (this member's own among them), as
        they pushed them within the wait."""
        statement, others = layout.statement(), [m for m in layout.members if m != self.me]
        pushed = await self.servicer.wait_for(round_key, others, SEALS_WAITS * self.wait_s)
        seals = {self.me: own}
        for member in others:
            theirs, seal = pushed.get(member, (b"", b""))
            if theirs != statement:
                logger.warning("two levels: %s sealed %s layout of this group", member, "another" if theirs else "no")
            elif stage2.sealed_by(member, round_key, statement, seal):
                seals[member] = seal
        return seals

    async def _own(self, levels: Levels, span: int, claim: Claim, partial: Partial) -> list[Output]:
        """Span `span` as this member, its group's owner of it, runs it: assembly, then stage 2 with
        its group's `partial` of the span."""
        assert self.assembly is not None
        key = levels.assembly_key(self.namespace, span)
        gathered = await self.assembly.assemble(key, claim.encode(), 2 * levels.groups, levels.met or levels.groups)
        shown = await self._admitted(_parsed(gathered, levels))
        counted = claims.counted(levels.seed, levels.groups, span, shown, self._holds(levels.key))
        plan = Plan.of(claims.plan_key(levels.key, span, shown), span, levels.spans, counted, partial.values.numel())
        if self.me not in plan.owners:
            raise AcrossError(f"span {span}: the owners' assembly did not count this group's claim")
        return await self.stage2.run(plan, partial)

    async def _fetched(
        self, levels: Levels, span: int, layout: GroupLayout, average: torch.Tensor, weight: float
    ) -> list[Output]:
        """Span `span`, owned by another member of the group: stage 3. A sub-span whose sum names
        this group alone must be the group's partial as this member computes it from its group's
        `average` of the span and `weight`: else its decider is convicted and nothing is applied."""
        assert self.assembly is not None
        owner = layout.span_owners[span]
        shown = await self._admitted(
            _parsed(await self.assembly.shown_by(owner, levels.assembly_key(self.namespace, span)), levels)
        )
        holds = self._holds(levels.key)
        counted, key = claims.plan_for_member(shown, owner, layout, levels.seed, levels.groups, span, holds)
        plan = Plan.of(key, span, levels.spans, counted, average.numel())
        outputs = await self.stage2.fetch_decided(plan, via=owner)
        group = plan.owners.index(owner) if owner in plan.owners else -1  # its claim may not count
        alone = [o for o in outputs if o.groups == (group,)]  # rare: the partial is computed only then
        own = Partial(partials.scaled(average, weight), weight) if alone else Partial(average, weight)
        for output in alone:
            if (why := twolevel.lone_refusal(output, group, plan.bounds(output.sub), own)) is not None:
                self.stage2.convict(output.by, why)
                raise AcrossError(f"span {span}: {why}; nothing applied")
        return outputs

    async def _admitted(self, shown: list[Claim]) -> list[Claim]:
        """The claims with only the seals of members that may come in, from claimants that may:
        a made-up group of outsiders, or of peers this one's audits left out, seals nothing."""
        out = []
        for claim in shown:
            if not await self._door(claim.by, "span claim"):
                continue
            seals = {m: seal for m, seal in claim.seals.items() if await self._door(m, "span claim")}
            out.append(Claim(claim.by, claim.layout, seals))
        return out


def _parsed(shown: Sequence[tuple[str, bytes]], levels: Levels) -> list[Claim]:
    """The claims of an assembly's list that parse; the rest count for nothing."""
    out = []
    for by, raw in shown:
        try:
            out.append(claims.parse_claim(raw, by, levels.key, levels.spans))
        except WireError as e:
            logger.warning("two levels: %s showed a claim that does not parse: %s", by, e)
    return out


def _partials(
    flat: torch.Tensor, weight: float, owners: Sequence[str], me: str
) -> tuple[tuple[bytes, ...], dict[int, Partial]]:
    """Every span's root of its group's partial, as this member seals them in the layout
    (partials.root), and the partials of the spans this member owns, by span."""
    roots, mine = [], {}
    for span, ((start, end), owner) in enumerate(zip(twolevel.spans(flat.numel(), len(owners)), owners)):
        partial = partials.of_group(flat[start:end], weight)
        roots.append(partials.root(span, partial.weight, partial.digests))
        if owner == me:
            mine[span] = partial
    return tuple(roots), mine


def _shaped(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for tensor in like:
        out.append(flat[at : at + tensor.numel()].reshape(tensor.shape).to(tensor.dtype))
        at += tensor.numel()
    return out
