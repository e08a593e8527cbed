"""An experiment for bench/allreduce.py (LOCKSTEP=1 in the workers' environment): a member hands
its next part to a reducer only once no other reducer is more than one part behind it, in
proportion to their spans. The traced all-reduce (bench/part_trace.py) showed one member's four
parts to one reducer handed off by 5.4 s and to another by 9.1 s, and a reducer can answer part i
only once every sender's part i is in. Installed before the swarm starts, as part_trace.py is; the
package carries none of it.
"""

from __future__ import annotations

import asyncio

from p2p_diloco.swarm.averaging import allreduce

WAIT_S = 30.0  # a reducer that stopped taking parts fails the all-reduce anyway: go on after this


def install() -> None:
    runner = allreduce.ConsistentAllReduceRunner
    generate = runner._generate_input_for_peer

    async def in_lockstep(self, peer_index):
        if not hasattr(self, "_lockstep"):
            self._lockstep = ({}, asyncio.Condition())
        handed, changed = self._lockstep
        counts = self.tensor_part_container.num_parts_by_peer
        me = self.ordered_peer_ids.index(self.peer_id)
        others = [j for j, n in enumerate(counts) if n > 0 and j != me and j != peer_index]
        sent = 0

        def caught_up(sent: int) -> bool:
            return all(handed.get(j, 0) + 1 > sent * counts[j] / counts[peer_index] for j in others)

        async for message in generate(self, peer_index):
            async with changed:
                try:
                    await asyncio.wait_for(changed.wait_for(lambda n=sent: caught_up(n)), WAIT_S)
                except asyncio.TimeoutError:
                    pass
            yield message
            sent += 1
            async with changed:
                handed[peer_index] = sent
                changed.notify_all()

    runner._generate_input_for_peer = in_lockstep
