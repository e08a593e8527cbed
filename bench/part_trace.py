"""Where a member's butterfly waits: the time of every part and average it sends and receives, for
bench/allreduce.py --trace. Installed by bench/allreduce_worker.py before the swarm starts (the
averager process is forked from it, so it inherits the wrappers); each event is one JSON line
appended to $PART_TRACE: [monotonic s, event, other member's index, part index].

- `sent`: this member's part for a reducer went to hivemind's writer (the sender's generator was
  asked for the next message, or ended);
- `part`: a sender's part of this member's span arrived and was checked;
- `averaged`: every sender's part of one part index is in, and this member combined it;
- `answered`: this member's average of a part went to hivemind's writer for one sender;
- `average`: a reducer's average arrived and was checked.

A bench aid only: the package itself carries none of this.
"""

from __future__ import annotations

import json
import os
import time

from hivemind.averaging.partition import TensorPartContainer

from p2p_diloco.swarm.averaging import allreduce


def _note(event: str, other: int, part: int) -> None:
    with open(os.environ["PART_TRACE"], "a") as out:
        out.write(json.dumps([time.monotonic(), event, other, part]) + "\n")


def install() -> None:
    runner = allreduce.ConsistentAllReduceRunner
    counted, take, streaming = runner._counted, runner._take_part, runner._accumulate_parts_streaming

    async def traced_counted(self, messages, peer_index):
        part = 0
        async for message in counted(self, messages, peer_index):
            yield message
            _note("sent", peer_index, part)
            part += 1

    def traced_take(self, sender_index, part_index, *args, **kwargs):
        out = take(self, sender_index, part_index, *args, **kwargs)
        _note("part", sender_index, part_index)
        return out

    async def traced_streaming(self, stream, sender_index):
        part = 0
        async for answer in streaming(self, stream, sender_index):
            yield answer
            _note("answered", sender_index, part)
            part += 1

    finished = allreduce.RobustReducer.check_current_part_finished

    def traced_finished(self):
        index = self.current_part_index
        finished(self)
        if self.current_part_index != index:
            _note("averaged", -1, index)

    processed = TensorPartContainer.register_processed_part

    def traced_processed(self, peer_index, part_index, part):
        _note("average", peer_index, part_index)
        return processed(self, peer_index, part_index, part)

    runner._counted, runner._take_part, runner._accumulate_parts_streaming = (
        traced_counted,
        traced_take,
        traced_streaming,
    )
    allreduce.RobustReducer.check_current_part_finished = traced_finished
    TensorPartContainer.register_processed_part = traced_processed
