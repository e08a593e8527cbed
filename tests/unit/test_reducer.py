"""The reducer of the consistent all-reduce: weighted means by hand, and weight-0 senders
(outer.drop_rate): a dropped peer adds nothing, and a part every sender dropped averages to 0."""

import asyncio

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from p2p_diloco.swarm.allreduce import ZeroWeightReducer


def reduce(parts, weights):
    """Run one reducer over one part per sender, all senders concurrently; every sender's result."""

    async def main():
        reducer = TensorPartReducer([parts[0].shape], len(parts))
        reducer.__class__ = ZeroWeightReducer  # as ConsistentAllReduceRunner does
        return await asyncio.gather(
            *(reducer.accumulate_part(i, 0, p, weight=w) for i, (p, w) in enumerate(zip(parts, weights)))
        )

    return asyncio.run(main())


@pytest.mark.parametrize(
    "weights, expected",
    [
        ([1.0, 3.0, 0.0], [2.5, 5.0]),  # (1·[1, 2] + 3·[3, 6]) / 4; the dropped [100, 100] adds nothing
        ([0.0, 2.0, 0.0], [3.0, 6.0]),  # one contributor: its own values
        ([0.0, 0.0, 0.0], [0.0, 0.0]),  # everyone dropped: zeros, not 0/0 = NaN
    ],
)
def test_weighted_mean_with_dropped_senders(weights, expected):
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([100.0, 100.0])]
    results = reduce(parts, weights)
    for result in results:
        assert result.tolist() == expected


def test_every_rpc_handler_of_the_averager_streams_as_hivemind_expects():
    # hivemind registers an rpc_* handler as streaming only if its hints are typing.AsyncIterator
    # (it reads the hint's _name): with collections.abc's, every link probe failed. The doors
    # (rpc_join_group, rpc_download_state) override hivemind's handlers and must keep their shape.
    from typing import get_type_hints

    from hivemind.p2p.servicer import ServicerBase

    from p2p_diloco.swarm.averager import DiLoCoAverager

    expected = {  # (request streams, answer streams)
        "rpc_probe": (True, True),
        "rpc_join_group": (False, True),
        "rpc_download_state": (False, True),
        "rpc_aggregate_part": (True, True),
    }
    for name, (stream_in, stream_out) in expected.items():
        hints = get_type_hints(getattr(DiLoCoAverager, name))
        request = next(v for k, v in hints.items() if k != "context" and k != "return")
        assert ServicerBase._strip_iterator_hint(request)[1] is stream_in, name
        assert ServicerBase._strip_iterator_hint(hints["return"])[1] is stream_out, name
