"""Stage 2 of a two-level round over the network: one span's owners, one per group, combine their
groups' partials (docs/design.md §3, "Past one group"; the decisions are protocol/twolevel.py).

Span k is cut into G sub-spans, one per group. Sub-span j has two replicas, the span's owners in
groups j (the primary) and j + 1 (the secondary, which decides):

1. Every owner sends its partial's sub-span j, signed, to both replicas of j (`rpc_stage2_partial`).
2. The primary sums the partials it holds once all came or its wait ended, in group order
   (twolevel.reduce_sub_span), signs the sum and pushes it to the secondary (`rpc_stage2_output`).
3. The secondary decides once (twolevel.settle): the primary's sum if it came and checks against
   the partials it holds, its own sum if it did not come in time; a primary whose sum does not
   check is convicted. It signs what it decided and answers the primary's push with that
   signature where it took the primary's sum.
4. Every owner fetches every sub-span as its secondary decided it (`rpc_stage2_fetch`), from the
   secondary or, failing that, from the primary, which serves its sum only with the secondary's
   signature. An output counts only with the signature of its sub-span's decider, so every owner
   that ends holds the same bytes (I1); an owner missing a sub-span ends with nothing (I2).

If the secondary dies before it decides, the sub-span is lost and the round fails alike for every
owner: the primary cannot know that the secondary never decided, and serving its own sum then
could give two owners two different averages. A group whose owner sent nothing counts in no
sub-span of that span.

Everything from another owner is untrusted (I4): statements go through twolevel's parsers, each
is bound to the round's key, and each signature is checked against a key shown with it that must
hash to the claimed peer id (identity.key_of).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco import faults
from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol import claims, partials, twolevel
from p2p_diloco.protocol.twolevel import Output, Partial
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust.wire import WireError

logger = get_logger(__name__)

KEEP_ROUNDS = 2  # rounds whose partials and decisions an owner keeps, every span it owns in each
MAX_UNPLANNED = 2  # rounds' worth of spans other owners may open here before this owner planned them
MAX_SEAL = 4096  # bytes of a signature and a key
DECIDE_AFTER = 1.5  # the secondary decides alone this many waits after it started
FETCH_UNTIL = 2.5  # an owner looks for every decided sub-span until this many waits after it started


class Stage2Error(SwarmError):
    """This owner ends stage 2 without every sub-span of its span: nothing of the round is applied."""


@dataclass(frozen=True)
class Plan:
    """One span's stage 2, as every owner of it computes it: the round's key (the agreed seed), the
    span, the round's span count, the span's owner in each group ('' where a group has none), the
    span's values, and the root each group's members sealed of its partial (partials.root)."""

    round_key: bytes
    span: int
    spans: int
    owners: tuple[str, ...]
    numel: int
    roots: tuple[bytes, ...]

    @classmethod
    def of(cls, key: bytes, span: int, spans: int, counted: Sequence[claims.Claim], numel: int) -> Plan:
        """The plan of the claims that count (claims.counted), in group order."""
        owners = tuple(c.by for c in counted)
        return cls(key, span, spans, owners, numel, tuple(c.layout.roots[span] for c in counted))

    @property
    def groups(self) -> int:
        return len(self.owners)

    @property
    def key(self) -> bytes:
        """What names this span's stage 2 in every message: the round's key and the span."""
        return self.round_key + struct.pack(">I", self.span)

    def bounds(self, sub: int) -> tuple[int, int]:
        """Where sub-span `sub` lies in the span."""
        return partials.sub_spans(self.numel, self.groups)[sub]

    def piece(self, sub: int) -> tuple[int, int]:
        """Sub-span `sub` within a replica's pieces, which hold that sub-span alone."""
        start, end = self.bounds(sub)
        return 0, end - start

    def decider(self, sub: int) -> str:
        """Who decides sub-span `sub`: its secondary, or its primary where the secondary's group has no owner."""
        secondary = self.owners[twolevel.replicas(sub, self.groups)[1]]
        return secondary if secondary and self.groups > 1 else self.owners[sub]


@dataclass
class _Round:
    plan: Plan | None = None
    planned: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    held: dict[int, dict[int, Partial]] = field(default_factory=dict)  # sub-span -> group -> partial
    decided: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # sub-span -> (statement, decider's seal)
    cosigned: dict[int, bytes] = field(
        default_factory=dict
    )  # sub-span -> its primary's seal over the decided statement
    contested: set[int] = field(default_factory=set)  # sub-spans whose decision this peer, their primary, refuted
    primary_done: set[int] = field(default_factory=set)  # sub-spans whose primary this peer is, and has ended
    relayed: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # sub-span -> (statement, every seal)
    forged: dict[int, set[int]] = field(default_factory=dict)  # sub-span -> groups whose partial this peer refused


def signed_bytes(round_key: bytes, statement: bytes) -> bytes:
    """What a stage-2 signature covers: the statement, bound to the round."""
    return struct.pack(">H", len(round_key)) + round_key + statement


def seal(signer: RSAPrivateKey, round_key: bytes, statement: bytes) -> bytes:
    """`signer`'s signature over the statement, with its public key: (length, signature, key)."""
    signature = signer.sign(signed_bytes(round_key, statement))
    return struct.pack(">H", len(signature)) + signature + identity.public_key_bytes(signer)


def sealed_by(peer: str, round_key: bytes, statement: bytes, sealed: bytes) -> bool:
    """Whether `sealed` (from another node) is `peer`'s signature over the statement, with a key
    that hashes to `peer`."""
    if not isinstance(sealed, bytes) or not 2 <= len(sealed) <= MAX_SEAL:
        return False
    (length,) = struct.unpack_from(">H", sealed)
    signature, key = sealed[2 : 2 + length], sealed[2 + length :]
    public = identity.key_of(peer, key) if len(signature) == length else None
    return public is not None and public.verify(signed_bytes(round_key, statement), signature)


def _message(round_key: bytes, sub: int, statement: bytes = b"", sealed: bytes = b"") -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(
        group_id=round_key, weight=float(sub), tensor_part=runtime_pb2.Tensor(buffer=statement), peer_id=sealed
    )


def _paired(decider_seal: bytes, primary_seal: bytes) -> bytes:
    """A served decision's seals: the decider's, then its primary's (empty where it has none)."""
    return struct.pack(">H", len(decider_seal)) + decider_seal + primary_seal


def _unpaired(raw: bytes) -> tuple[bytes, bytes]:
    """(decider's seal, primary's seal) from another node's `_paired` (b"" for what is not there)."""
    if len(raw) < 2:
        return b"", b""
    (length,) = struct.unpack_from(">H", raw)
    return (raw[2 : 2 + length], raw[2 + length :]) if len(raw) >= 2 + length else (b"", b"")


def _sub_of(message: averaging_pb2.AveragingData, groups: int) -> int | None:
    sub = message.weight
    return int(sub) if 0 <= sub < groups and sub == int(sub) else None


class _Rounds:
    """The stage-2 rounds a peer keeps, by plan key, and the waits on their changes."""

    def __init__(self) -> None:
        self._rounds: OrderedDict[bytes, _Round] = OrderedDict()  # Plan.key (a round's span) -> its state
        # A round's spans, as this peer's latest plan says: an owner may own all of its group's
        # spans (its other members behind NAT), each its own stage 2 here.
        self._spans = twolevel.GROUP_SIZE

    def _round(self, key: bytes, plan: Plan | None = None) -> _Round | None:
        """The state of span round `key`; a new one only if planned here or fewer than MAX_UNPLANNED
        rounds' spans are open unplanned. Planning one keeps the latest KEEP_ROUNDS rounds' spans."""
        r = self._rounds.get(key)
        if r is None:
            unplanned = sum(1 for x in self._rounds.values() if x.plan is None)
            if plan is None and unplanned >= MAX_UNPLANNED * self._spans:
                return None
            r = self._rounds[key] = _Round()
        if plan is not None and r.plan is None:
            r.plan, self._spans = plan, plan.spans
            r.planned.set()
            planned = [k for k, x in self._rounds.items() if x.plan is not None]
            for old in planned[: -KEEP_ROUNDS * plan.spans]:
                del self._rounds[old]
        return r

    async def _until(self, r: _Round, ready: Callable[[], bool], deadline: float) -> bool:
        async with r.changed:
            try:
                await asyncio.wait_for(r.changed.wait_for(ready), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            return ready()

    async def _note(self, r: _Round, change: Callable[[], object]) -> None:
        async with r.changed:
            change()
            r.changed.notify_all()


class Stage2(_Rounds):
    """One peer's side of stage 2 for the spans it owns: runs its own (`run`) and answers the other
    owners (`take_partial`, `take_output`, `serve`: Stage2Servicer's handlers hand them on), and
    its group's members, to whom it relays every sub-span of its span (stage 3)."""

    def __init__(
        self,
        me: str,
        signer: RSAPrivateKey,
        stub: Callable[[str], Any],
        wait_s: float,
        convicted: Callable[[str], None] = lambda peer: None,
    ):
        """`stub(peer)`: an RPC stub with the Stage2Servicer methods for `peer`; `wait_s`: how long
        a replica waits for the partials (its other waits are multiples of it); `convicted(peer)`:
        told of every peer this one convicts (the averager then refuses it at every door)."""
        super().__init__()
        self.me, self._signer, self._stub, self.wait_s, self._told = me, signer, stub, wait_s, convicted
        self.convicted: set[str] = set()  # owners whose partial, sum or decision did not check here

    def convict(self, peer: str, why: str) -> None:
        """Refuse `peer` from now on (and tell the averager), saying why."""
        self.convicted.add(peer)
        logger.warning("stage 2: convicted %s: %s", peer, why)
        self._told(peer)

    async def run(self, plan: Plan, partial: Partial) -> list[Output]:
        """Stage 2 of `plan` with this peer's group's `partial` of the span: every sub-span's
        decided output, in order, or Stage2Error."""
        r = self._round(plan.key, plan)
        assert r is not None  # a planned round is always kept
        group = plan.owners.index(self.me)
        started = time.monotonic()
        if plan.groups == 1:  # its group alone: its own sum, decided here for its group's members
            output = twolevel.reduce_sub_span(plan.span, 0, (0, plan.numel), {0: partial}, self.me)
            decided = (output.statement(), seal(self._signer, plan.round_key, output.statement()))
            await self._note(r, lambda: r.decided.setdefault(0, decided))
            return [output]
        sends = [self._send_partial(r, plan, group, sub, partial) for sub in range(plan.groups)]
        roles = [self._as_primary(r, plan, group, started), self._as_secondary(r, plan, group - 1, started)]
        await asyncio.gather(*sends, *roles)
        return await self._fetch_all(r, plan, started)

    async def fetch_decided(self, plan: Plan, via: str = "") -> list[Output]:
        """Stage 3, for a member that owns nothing of the span: every sub-span as its decider decided
        it, first from `via` (its group's owner of the span, which relays only what every replica
        of it signed), else from its replicas, or Stage2Error."""
        return await self._fetch_all(_Round(plan=plan), plan, time.monotonic(), via)

    async def _fetch_all(self, r: _Round, plan: Plan, started: float, via: str = "") -> list[Output]:
        outputs = await asyncio.gather(*(self._fetch(r, plan, sub, started, via) for sub in range(plan.groups)))
        missing = [sub for sub, output in enumerate(outputs) if output is None]
        if missing:
            raise Stage2Error(f"span {plan.span}: no decided sum of sub-spans {missing}; nothing applied")
        return [output for output in outputs if output is not None]

    async def _send_partial(self, r: _Round, plan: Plan, group: int, sub: int, partial: Partial) -> None:
        """This group's partial of sub-span `sub`, signed, to both its replicas (kept here where this peer is one)."""
        start, end = plan.bounds(sub)
        piece = Partial(partial.values[start:end].clone(), partial.weight, partial.digests)
        statement = twolevel.partial_statement(plan.round_key, plan.span, sub, group, piece)
        message = _message(plan.key, sub, statement, seal(self._signer, plan.round_key, statement))
        for peer in {plan.owners[i] for i in twolevel.replicas(sub, plan.groups)} - {""}:
            if peer == self.me:
                await self._note(r, lambda: r.held.setdefault(sub, {}).setdefault(group, piece))
                continue
            try:
                await asyncio.wait_for(self._stub(peer).rpc_stage2_partial(message), self.wait_s)
            except Exception as e:  # noqa: BLE001 - a dead or slow replica: the other has it
                logger.warning(
                    "stage 2: partial of span %d sub-span %d to %s: %s", plan.span, sub, peer, type(e).__name__
                )

    async def _as_primary(self, r: _Round, plan: Plan, sub: int, started: float) -> None:
        """Sum sub-span `sub` once every group's partial is here or the wait ended, push it to the
        decider, and check what the decider decided (`_countersign`)."""
        owned = {group for group, owner in enumerate(plan.owners) if owner}
        await self._until(r, lambda: set(r.held.get(sub, {})) >= owned, started + self.wait_s)
        held = dict(r.held.get(sub, {}))
        try:
            if held:
                await self._push(r, plan, sub, held)
        finally:
            await self._note(r, lambda: r.primary_done.add(sub))

    async def _push(self, r: _Round, plan: Plan, sub: int, held: dict[int, Partial]) -> None:
        faults.reached(faults.FaultPoint.STAGE2, peer=self.me, span=plan.span, sub=sub)
        statement = twolevel.reduce_sub_span(plan.span, sub, plan.piece(sub), held, self.me).statement()
        own = seal(self._signer, plan.round_key, statement)
        decider = plan.decider(sub)
        if decider == self.me:  # the secondary's group has no owner: the primary decides
            await self._note(r, lambda: r.decided.setdefault(sub, (statement, own)))
            return
        try:
            answer = await asyncio.wait_for(
                self._stub(decider).rpc_stage2_output(_message(plan.key, sub, statement, own)), self.wait_s
            )
        except Exception as e:  # noqa: BLE001 - the decider may be dead: then nobody may serve this sum
            logger.warning("stage 2: sum of span %d sub-span %d to %s: %s", plan.span, sub, decider, type(e).__name__)
            return
        decided, decider_seal = answer.tensor_part.buffer, answer.peer_id
        if sealed_by(decider, plan.round_key, decided, decider_seal):
            await self._countersign(r, plan, sub, held, decided, decider_seal, own if decided == statement else None)

    async def _countersign(
        self,
        r: _Round,
        plan: Plan,
        sub: int,
        held: dict[int, Partial],
        decided: bytes,
        decider_seal: bytes,
        own: bytes | None,
    ) -> None:
        """As the primary: sign the decider's decision if it is this peer's sum (`own`: its seal)
        or checks against the partials held here; refute it, and convict the decider, if it does
        not check; neither where a group it names is not held here."""
        output = _parsed(plan, sub, decided, plan.decider(sub))
        if own is None and output is not None and set(output.groups) & r.forged.get(sub, set()):
            # It names a partial this peer refused as its group did not seal it. The decider may
            # have been sent a sealed one (its owner equivocating), so it is refuted, not convicted.
            logger.warning("stage 2: refuted span %d sub-span %d's decision: it names a forged partial", plan.span, sub)
            await self._note(r, lambda: r.contested.add(sub))
            return
        if own is None and output is not None and any(g not in held for g in output.groups):
            return  # cannot judge: abstain, as a dead primary would
        if own is None and (output is None or twolevel.cross_check(output, plan.piece(sub), held) is not None):
            self.convict(plan.decider(sub), f"its decision of span {plan.span} sub-span {sub} does not check")
            await self._note(r, lambda: r.contested.add(sub))
            return
        cosign = own if own is not None else seal(self._signer, plan.round_key, decided)

        def keep() -> None:
            r.decided.setdefault(sub, (decided, decider_seal))
            r.cosigned.setdefault(sub, cosign)

        await self._note(r, keep)

    async def _as_secondary(self, r: _Round, plan: Plan, sub: int, started: float) -> None:
        """Decide sub-span `sub` alone if the primary's sum has not come by DECIDE_AFTER waits."""
        sub %= plan.groups
        if plan.decider(sub) != self.me or await self._until(
            r, lambda: sub in r.decided, started + DECIDE_AFTER * self.wait_s
        ):
            return
        async with r.changed:
            if sub not in r.decided:
                self._decide(r, plan, sub, None)
                r.changed.notify_all()

    def _decide(self, r: _Round, plan: Plan, sub: int, primary: Output | None) -> None:
        """The decider's one decision (twolevel.settle), signed; under `r.changed`."""
        settled = twolevel.settle(primary, plan.span, sub, plan.piece(sub), r.held.get(sub, {}), self.me)
        if settled.convicted is not None:
            self.convict(settled.convicted, f"its sum of span {plan.span} sub-span {sub} does not check")
        if settled.output is not None:
            statement = settled.output.statement()
            r.decided[sub] = (statement, seal(self._signer, plan.round_key, statement))
            faults.reached(faults.FaultPoint.STAGE2_DECIDED, peer=self.me, span=plan.span, sub=sub)

    async def _fetch(self, r: _Round, plan: Plan, sub: int, started: float, via: str = "") -> Output | None:
        """Sub-span `sub` as its decider decided it: from this peer's own roles, else from `via`
        (with every replica's signature), else from its primary (the same; a primary that refuted
        it ends it), else, the primary silent, from the decider alone. What came with every
        replica's signature is kept for this peer's group (`serve`)."""
        if sub in r.contested:
            return None
        if sub in r.decided:
            return _parsed(plan, sub, r.decided[sub][0], plan.decider(sub))
        deadline = started + FETCH_UNTIL * self.wait_s
        primary, decider = plan.owners[sub], plan.decider(sub)
        for peer in [p for p in dict.fromkeys((via, primary, decider)) if p not in ("", self.me)]:
            try:
                answer = await asyncio.wait_for(
                    self._stub(peer).rpc_stage2_fetch(_message(plan.key, sub)), max(0.1, deadline - time.monotonic())
                )
            except Exception as e:  # noqa: BLE001 - the other replica may serve it
                logger.warning(
                    "stage 2: fetch of span %d sub-span %d from %s: %s", plan.span, sub, peer, type(e).__name__
                )
                continue
            if answer.code == averaging_pb2.PROTOCOL_VIOLATION and peer == primary != decider:
                return None  # the primary refuted the decision: nobody applies it
            statement, (decider_seal, primary_seal) = answer.tensor_part.buffer, _unpaired(answer.peer_id)
            if not sealed_by(decider, plan.round_key, statement, decider_seal):
                continue
            cosigned = primary in ("", decider) or sealed_by(primary, plan.round_key, statement, primary_seal)
            if peer in (via, primary) and not cosigned:
                continue
            if cosigned:
                relayed = (statement, answer.peer_id)
                await self._note(r, lambda: r.relayed.setdefault(sub, relayed))  # noqa: B023 - awaited at once
            return _parsed(plan, sub, statement, decider)
        return None

    async def _planned(self, request: averaging_pb2.AveragingData) -> tuple[_Round, Plan, int] | None:
        """The round, plan and sub-span another owner's request names, once planned here (within the wait)."""
        r = self._round(request.group_id)
        if r is None:
            return None
        try:
            await asyncio.wait_for(r.planned.wait(), self.wait_s)
        except asyncio.TimeoutError:
            return None
        plan = r.plan
        sub = _sub_of(request, plan.groups) if plan is not None else None
        return None if plan is None or sub is None else (r, plan, sub)

    async def _taken(
        self, request: averaging_pb2.AveragingData, context: P2PContext, check: Callable[..., Any], what: str
    ) -> tuple[_Round, Plan, int, Any] | averaging_pb2.AveragingData:
        """The round, plan and sub-span another owner's request names, with what `check` made of
        its statement; or the answer that refuses it (`check` said why, as a str)."""
        named = await self._planned(request)
        if named is None:
            return _message(b"", 0)
        r, plan, sub = named
        sender = str(context.remote_id)
        value = check(plan, sub, sender, self.me, request.tensor_part.buffer, request.peer_id)
        if isinstance(value, _Guilty):
            self.convict(sender, f"its {what} of span {plan.span} sub-span {sub}: {value}")
            await self._note(r, lambda: r.forged.setdefault(sub, set()).add(value.group))
        if isinstance(value, str):
            logger.warning("stage 2: %s from %s refused: %s", what, sender, value)
            return _message(plan.key, sub)
        return r, plan, sub, value

    async def take_partial(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """As a replica: another group's owner's partial of a sub-span this peer replicates."""
        taken = await self._taken(request, context, _partial_refusal, "partial")
        if isinstance(taken, averaging_pb2.AveragingData):
            return taken
        r, plan, sub, (group, partial) = taken
        await self._note(r, lambda: r.held.setdefault(sub, {}).setdefault(group, partial))
        return _message(plan.key, sub, b"held")

    async def take_output(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """As a decider: the primary's sum. Answers with what this peer decided, signed (the
        primary's sum, then kept with the primary's signature, or its own)."""
        taken = await self._taken(request, context, _output_from, "sum")
        if isinstance(taken, averaging_pb2.AveragingData):
            return taken
        r, plan, sub, output = taken
        statement = request.tensor_part.buffer
        # Every partial the sum names should be here to check it by (each owner sent it to both replicas).
        await self._until(r, lambda: set(output.groups) <= set(r.held.get(sub, {})), time.monotonic() + self.wait_s)
        async with r.changed:
            if sub not in r.decided:
                self._decide(r, plan, sub, output)
                if sub in r.decided and r.decided[sub][0] == statement:
                    r.cosigned[sub] = request.peer_id
                r.changed.notify_all()
        if sub not in r.decided:
            return _message(plan.key, sub)
        decided, decider_seal = r.decided[sub]
        return _message(plan.key, sub, decided, decider_seal)

    async def serve(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        """A sub-span as its decider decided it, with its primary's signature where this peer holds
        it; PROTOCOL_VIOLATION where this peer, its primary, refuted it; empty where it holds
        nothing once its roles ended (within the wait)."""
        named = await self._planned(request)
        if named is None:
            return _message(b"", 0)
        r, plan, sub = named
        is_primary = plan.owners[sub] == self.me
        if not is_primary and plan.decider(sub) != self.me:  # relayed to this peer's group (stage 3)
            await self._until(r, lambda: sub in r.relayed, time.monotonic() + FETCH_UNTIL * self.wait_s)
            return _message(plan.key, sub, *r.relayed.get(sub, (b"", b"")))

        def known() -> bool:
            return sub in r.decided or sub in r.contested or (is_primary and sub in r.primary_done)

        await self._until(r, known, time.monotonic() + DECIDE_AFTER * self.wait_s)
        if sub in r.contested:
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION, group_id=plan.key)
        if sub not in r.decided or (is_primary and sub not in r.cosigned and plan.decider(sub) != self.me):
            return _message(plan.key, sub)
        statement, decider_seal = r.decided[sub]
        return _message(plan.key, sub, statement, _paired(decider_seal, r.cosigned.get(sub, b"")))


def _partial_refusal(
    plan: Plan, sub: int, sender: str, me: str, statement: bytes, sealed: bytes
) -> str | tuple[int, Partial]:
    """(group, partial) from `sender`'s statement of sub-span `sub`, or why it is refused."""
    if me not in {plan.owners[i] for i in twolevel.replicas(sub, plan.groups)}:
        return f"this peer is no replica of sub-span {sub}"
    if not sealed_by(sender, plan.round_key, statement, sealed):
        return "not signed by its sender"
    start, end = plan.bounds(sub)
    pieces = len(partials.chunk_bounds(plan.numel))
    try:
        span, named_sub, group, partial = twolevel.parse_partial(
            statement, plan.round_key, plan.groups, plan.spans, end - start, pieces
        )
    except WireError as e:
        return str(e)
    if (span, named_sub) != (plan.span, sub) or plan.owners[group] != sender:
        return f"span {span} sub-span {named_sub} of group {group}: not what its sender owns"
    if (why := partials.refusal(partial, span, plan.numel, (start, end), plan.roots[group])) is not None:
        return _Guilty(why, group)  # it signed this partial, and its claim's layout that its group sealed
    return group, partial


class _Guilty(str):
    """Why a partial is refused that convicts its signer, group `group`'s owner."""

    group: int

    def __new__(cls, why: str, group: int) -> _Guilty:
        made = super().__new__(cls, why)
        made.group = group
        return made


def _output_from(plan: Plan, sub: int, sender: str, me: str, statement: bytes, sealed: bytes) -> Output | str:
    """The primary's signed sum of sub-span `sub`, or why it is refused."""
    if plan.owners[sub] != sender or plan.decider(sub) != me:
        return f"not sub-span {sub}'s primary, or this peer is not its decider"
    if not sealed_by(sender, plan.round_key, statement, sealed):
        return "not signed by its sender"
    return _parsed(plan, sub, statement, sender) or "not a sum of this sub-span"


def _parsed(plan: Plan, sub: int, statement: bytes, by: str) -> Output | None:
    """Sub-span `sub`'s output in `statement` (from another node), or None if it is not one."""
    start, end = plan.bounds(sub)
    try:
        output = twolevel.parse_output(statement, by, plan.groups, plan.spans, end - start)
    except WireError:
        return None
    return output if (output.span, output.sub) == (plan.span, sub) else None


class Stage2Servicer(ServicerBase):
    """Stage 2's handlers for a p2p that hosts only stage 2 (tests, benches); each hands the call to the `Stage2`."""

    def __init__(self, desk: Stage2):
        self.desk = desk

    async def rpc_stage2_partial(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self.desk.take_partial(request, context)

    async def rpc_stage2_output(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self.desk.take_output(request, context)

    async def rpc_stage2_fetch(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        return await self.desk.serve(request, context)
