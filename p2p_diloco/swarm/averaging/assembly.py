"""The span owners' assembly of a two-level round (docs/design.md §3, "The round around it", step
(1)): the owners of span k in every group meet by hivemind's matchmaking under a DHT key of their
own (the run, the round's key and the span), each bringing its claim (protocol/claims.py) to the
all-gather. The leader's assembled group gives every owner that joined it the same list of claims,
from which `claims.plan_owners` makes the same stage-2 owners everywhere, and `claims.plan_key` a
key that binds stage 2 to that very list: owners whose lists differ (a leader that told them
different things, or two assemblies where there should be one) do not take each other's messages,
and fail alike instead of averaging different things.

One `Assembly` per peer serves every span it owns: its handler (`AssemblyServicer.rpc_join_group`)
hands a join request to the look in progress under the request's key, and refuses one under any
other key, as hivemind's matchmaking refuses a request for another group.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, AsyncIterator, cast  # typing's, not collections.abc's: see pyproject.toml (UP035)

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.errors import SwarmError
from p2p_diloco.protocol import claims
from p2p_diloco.trust.wire import WireError

logger = logging.getLogger(__name__)
SCHEMA = hashlib.sha256(b"p2p-diloco/span-assembly/v1").digest()  # hivemind's matchmaking compares it
KEEP_SHOWN = 8  # assemblies whose claims an owner keeps for its group's members
SEALS_WAITS = 2  # waits an owner may spend on its members' seals before it assembles (across.py)


@dataclass(frozen=True)
class _Step:
    """What hivemind's matchmaking reads of its StepControl (which also holds shared memory and
    cross-process futures for an averager's own step, none of which a look needs here)."""

    scheduled_time: float
    deadline: float
    data_for_gather: bytes

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - get_dht_time())


Door = Callable[[str, str], Awaitable[bool]]  # (peer, which door) -> whether it may come in


class Traffic:
    """Bytes of a two-level round's messages, both ways, since this peer started (a round's share
    is the difference): stage 2's and 3's, the layout seals, and the assembly's claims."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def count(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


async def open_door(peer: str, door: str) -> bool:
    """The door of a peer with no doors (tests, a bare assembly): everyone comes in."""
    return True


class AssemblyError(SwarmError):
    """No assembly of this span's owners formed in time: stage 2 of the span cannot run here."""


class AssemblyServicer(ServicerBase):
    """Answers other owners' join requests for the looks in progress here, by group key, and the
    group's members' requests for what an assembly showed (stage 3: they make the plan themselves)."""

    def __init__(self, wait_s: float = 0.0) -> None:
        """`wait_s`: how long a member's request waits for an assembly that has not ended here yet."""
        self.looking: dict[str, Matchmaking] = {}  # hivemind group key -> the look in progress under it
        self.shown: OrderedDict[str, bytes] = OrderedDict()  # assembly key -> claims.pack_shown of what it showed
        self.wait_s = wait_s
        self._kept: asyncio.Condition | None = None  # made in the serving loop, at the first use
        self.door: Door = open_door  # whether a peer may come in (the averager's: admission, audits)
        self.traffic = Traffic()  # what its members' requests for an assembly's claims took

    @property
    def kept(self) -> asyncio.Condition:
        if self._kept is None:
            self._kept = asyncio.Condition()
        return self._kept

    async def keep(self, key: str, shown: bytes) -> None:
        async with self.kept:
            self.shown[key] = shown
            while len(self.shown) > KEEP_SHOWN:
                self.shown.popitem(last=False)
            self.kept.notify_all()

    async def rpc_assembled(
        self, request: averaging_pb2.AveragingData, context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """What the assembly under the key in `group_id` showed, once it ended here (within the
        wait); empty where there was none."""
        key = request.group_id.decode(errors="replace")
        if not await self.door(str(context.remote_id), "span owners' assembly"):
            return averaging_pb2.AveragingData(group_id=request.group_id)
        async with self.kept:
            try:
                await asyncio.wait_for(self.kept.wait_for(lambda: key in self.shown), self.wait_s)
            except asyncio.TimeoutError:
                pass
            shown = runtime_pb2.Tensor(buffer=self.shown.get(key, b""))
        answer = averaging_pb2.AveragingData(group_id=request.group_id, tensor_part=shown)
        self.traffic.count(answer.ByteSize(), request.ByteSize())
        return answer

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        look = self.looking.get(request.group_key) if isinstance(request.group_key, str) else None
        if look is not None and not await self.door(str(context.remote_id), "span owners' assembly"):
            look = None
        if look is None:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for message in look.rpc_join_group(request, context):
            yield message


class Assembly:
    """One peer's side of the span owners' assemblies: `start` once, then `assemble` per span."""

    def __init__(self, p2p: P2P, dht: DHT, namespace: str, wait_s: float, patience_s: float | None = None) -> None:
        """`namespace`: the handler's (the run's, without '.'); `wait_s`: how long a look gathers
        owners before its leader closes the group with whoever came; `patience_s` (3 waits if
        None): how long an owner looks for the others at all, which should cover the spread of
        the groups' stage-1 ends (the round's matchmaking slack: across.py)."""
        self._p2p, self._dht, self.namespace, self.wait_s = p2p, dht, namespace, wait_s
        self.patience_s = 3 * wait_s if patience_s is None else max(patience_s, 2 * wait_s)
        # a member asks its owner as soon as its own stage 1 ended: the owner's seals, then its assembly
        self.servicer = AssemblyServicer(self.patience_s + SEALS_WAITS * wait_s)

    async def start(self) -> None:
        await self.servicer.add_p2p_handlers(self._p2p, namespace=self.namespace)

    async def assemble(self, key: str, claim: bytes, most: int, close_at: int | None = None) -> list[tuple[str, bytes]]:
        """Meet the other owners under `key` (the run, the round and the span; no '.'), at most
        `most` of them (the round's groups and room for claims that will not count), showing
        `claim`: every member's (peer id, claim bytes) as the leader gathered them (untrusted: for
        claims.parse_claim), or AssemblyError. The leader closes the assembly once it holds
        `close_at` (`most` if None), or after the wait with whoever came; where nobody came within
        three waits, the list is this owner's claim alone (its group's partial makes the span)."""
        look = self._look(key, min(most, close_at or most))
        group_key = look.group_key_manager.current_key
        if group_key in self.servicer.looking:
            raise AssemblyError(f"already assembling under {key}")
        now = get_dht_time()
        step = _Step(scheduled_time=now + self.wait_s, deadline=now + self.patience_s, data_for_gather=claim)
        self.servicer.looking[group_key] = look
        try:
            group = await look.look_for_group(cast(Any, step))
        except Exception as e:  # hivemind's own errors while looking: no assembly here
            raise AssemblyError(f"span owners' assembly under {key}: {type(e).__name__} {e}") from None
        finally:
            del self.servicer.looking[group_key]
        if group is None:
            # Nobody else came: this group's own partial makes the span (the other groups' members,
            # if they assembled without it, end on another result, which agreement settles).
            logger.warning(
                "no other group's owner came to %s within %g s: this group's share alone", key, self.patience_s
            )
            shown = [(str(self._p2p.peer_id), claim)]
        else:
            shown = [(str(peer), bytes(data)) for peer, data in zip(group.peer_ids, group.gathered)]
        if (why := claims.unfit(shown, most)) is not None:  # the leader's list, which a follower takes as sent
            raise AssemblyError(f"the span owners' assembly under {key}: its leader showed {why}; nothing kept")
        # Its claim out, the others' in: the gather's payload (a leader also sends each follower the list).
        self.servicer.traffic.count(len(claim), sum(len(raw) for peer, raw in shown if peer != str(self._p2p.peer_id)))
        await self.servicer.keep(key, claims.pack_shown(shown))
        return shown

    def _look(self, key: str, most: int) -> Matchmaking:
        """hivemind's matchmaking under `key`, closing at `most` members. Its key manager and its
        leaders' list are made with the next power of 2 (hivemind warns about any other size, which
        they use for nothing here), then told `most`."""
        size = 1 << (most - 1).bit_length()
        # A join's first answer under load: with half a wait (0.83 s in the suite's settings) owners
        # gave up on their leader and split into assemblies of two and one in CI. hivemind wants it
        # under the look's minimum time (else it may deadlock); a full assembly begins at once anyway.
        request_s = min(3.0, max(self.wait_s / 2, self.patience_s / 6))
        look = Matchmaking(
            self._p2p,
            SCHEMA,
            self._dht,
            servicer_type=AssemblyServicer,
            prefix=self.namespace,  # where join requests go; the DHT key is the group key manager's
            target_group_size=size,
            min_group_size=2,  # with 1, hivemind closes a group of one at its look's first re-declaration
            min_matchmaking_time=max(self.wait_s, 2 * request_s),
            request_timeout=request_s,
            client_mode=False,
        )
        look.group_key_manager = GroupKeyManager(self._dht, key, "", size)
        look.target_group_size = look.potential_leaders.target_group_size = most
        return look

    async def shown_by(self, owner: str, key: str) -> list[tuple[str, bytes]]:
        """What the assembly under `key` showed, as `owner` (this member's group's owner of the span)
        passes it on, or AssemblyError; each claim is still for claims.parse_claim."""
        try:
            stub = AssemblyServicer.get_stub(self._p2p, PeerID.from_base58(owner), namespace=self.namespace)
            request = averaging_pb2.AveragingData(group_id=key.encode())
            answer = await asyncio.wait_for(stub.rpc_assembled(request), self.servicer.wait_s + self.wait_s)
            self.servicer.traffic.count(request.ByteSize(), answer.ByteSize())
            if not answer.tensor_part.buffer:
                raise AssemblyError(f"{owner} holds no assembly under {key}")
            return claims.unpack_shown(answer.tensor_part.buffer)
        except AssemblyError:
            raise
        except WireError as e:
            raise AssemblyError(f"{owner}'s assembly under {key}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a dead or silent owner: this member has no plan
            raise AssemblyError(f"{owner}'s assembly under {key}: {type(e).__name__} {e}") from None
