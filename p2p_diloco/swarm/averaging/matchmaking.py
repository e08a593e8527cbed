"""hivemind's matchmaking as every member runs it (`LedMatchmaking`, in the averager process): it
remembers who assembled each group, asks only the leaders `may_lead` allows, and hands the group
over the moment it is assembled.

The hand-over. hivemind's `look_for_group` returns an assembled group only after its clean-up:
the search for leaders is cancelled, and its `finally` declares in the DHT that this member no
longer looks for a group (a DHT store, waited for); a leader also waits until every follower's
join stream ended. Until then the member has not begun its all-reduce, while the other members
have, and wait for its parts for `next_chunk_timeout`. One slow DHT store (a starved DHT process,
an unresponsive DHT node, a slow home link) failed the whole group: every other member logged
"a sender was dropped" and retried without it, and the late member, seeing the swarm finish the
round without it, caught up. Here the group is returned as soon as it is assembled, and the
clean-up goes on in the background, still under hivemind's lock: the next look waits for it, so
nothing of hivemind's order changes but the hand-over (tests/swarm/test_faults.py, STALLDHT).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from p2p_diloco import faults

logger = get_logger(__name__)

KEEP_LEADERS = 16  # groups whose leader a member remembers


class LedMatchmaking(Matchmaking):
    """hivemind's matchmaking, remembering who assembled each group, asking only the leaders
    `may_lead` allows (admitted, and not left out), and returning a group once it is assembled."""

    may_lead: Any
    leaders: OrderedDict[bytes, PeerID]
    _looks: list[asyncio.Future]  # one per look in progress or waiting for hivemind's lock, in order

    @classmethod
    def adopt(cls, matchmaking: Matchmaking, may_lead: Any) -> None:
        """Make hivemind's `matchmaking` (created in the averager process) one of these."""
        matchmaking.__class__ = cls
        assert isinstance(matchmaking, LedMatchmaking)
        matchmaking.may_lead = may_lead
        matchmaking.leaders = OrderedDict()
        matchmaking._looks = []

    async def look_for_group(self, step: Any) -> GroupInfo | None:
        """hivemind's look, returned as soon as the group is assembled; its clean-up goes on."""
        assembled: asyncio.Future = asyncio.get_running_loop().create_future()
        self._looks.append(assembled)
        look = asyncio.create_task(super().look_for_group(step))
        try:
            await asyncio.wait({look, assembled}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the step was cancelled: so is the look
            look.cancel()
            self._forget(assembled)
            raise
        if assembled.done():
            look.add_done_callback(_clean_up_ended)  # called at once if it already ended
            return assembled.result()
        self._forget(assembled)
        return look.result()

    def _forget(self, assembled: asyncio.Future) -> None:
        if assembled in self._looks:
            self._looks.remove(assembled)
        assembled.cancel()

    async def _request_join_group(self, leader: PeerID) -> Any:
        if not await self.may_lead(leader, "matchmaking (as a leader)"):
            return None
        return await super()._request_join_group(leader)

    async def leader_assemble_group(self) -> GroupInfo:
        return self._assembled(await super().leader_assemble_group(), self.peer_id)

    async def follower_assemble_group(self, leader: PeerID, msg: Any) -> GroupInfo:
        return self._assembled(await super().follower_assemble_group(leader, msg), leader)

    def _assembled(self, group_info: GroupInfo, leader: PeerID) -> GroupInfo:
        """Remember the group's leader, and hand the group to the look that assembled it: the
        oldest, since hivemind runs one look at a time, in the order they began."""
        self.leaders[group_info.group_id] = leader
        while len(self.leaders) > KEEP_LEADERS:
            self.leaders.popitem(last=False)
        faults.reached(faults.FaultPoint.ASSEMBLED, dht_pid=self.group_key_manager.dht.pid)
        if self._looks:
            self._looks.pop(0).set_result(group_info)
        return group_info


def _clean_up_ended(look: asyncio.Task) -> None:
    """A look whose group was already handed over ended its clean-up: nothing depends on how."""
    if not look.cancelled() and look.exception() is not None:
        logger.debug("matchmaking clean-up after the group was assembled: %r", look.exception())
