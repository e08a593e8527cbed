"""The reducer of the consistent all-reduce, on hivemind's TensorPartReducer: weighted means by
hand, weight-0 senders (outer.drop_rate: a dropped peer adds nothing, and a part every sender
dropped averages to 0), and the robust combinations (trust/robust.py) as the reducer runs them."""

import asyncio

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from p2p_diloco.swarm.averaging.allreduce import RobustReducer


def reduce(parts, weights, aggregation=("mean", 1.0, 2.0), order=None, reducer_out=None):
    """Run one reducer over one part per sender, all senders concurrently (their parts arriving in
    `order`, else sender order); every sender's result."""
    order = list(range(len(parts))) if order is None else order

    async def main():
        reducer = TensorPartReducer([parts[0].shape], len(parts))
        reducer.__class__ = RobustReducer  # as ConsistentAllReduceRunner does
        reducer.aggregation = aggregation
        reducer.collecting()
        if reducer_out is not None:
            reducer_out.append(reducer)
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, parts[i], weight=weights[i]) for i in order))
        return [results[order.index(i)] for i in range(len(parts))]

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


@pytest.mark.parametrize("how", ["mean", "clip", "aligned-clip", "centered-clip", "trimmed-mean"])
def test_the_reducer_answers_every_sender_the_same_robust_combination(how):
    # One sender x 1e4 with weight x 1000: every sender gets the same bytes (I1); every robust
    # combination keeps the result near the honest parts, the mean does not.
    parts = [torch.tensor([1.0, 1.0]), torch.tensor([1.1, 0.9]), torch.tensor([0.9, 1.1]), torch.tensor([-1e4, -1e4])]
    results = reduce(parts, [1.0, 1.0, 1.0, 1000.0], (how, 1.0, 2.0))
    assert all(torch.equal(r, results[0]) for r in results)
    far = float((results[0] - torch.tensor([1.0, 1.0])).norm())
    assert far > 1000 if how == "mean" else far < 3.0, results[0]


def test_every_rpc_handler_of_the_averager_streams_as_hivemind_expects():
    # hivemind registers an rpc_* handler as streaming only if its hints are typing.AsyncIterator
    # (it reads the hint's _name): with collections.abc's, every link probe failed. The doors
    # (rpc_join_group, rpc_download_state) override hivemind's handlers and must keep their shape.
    from typing import get_type_hints

    from hivemind.p2p.servicer import ServicerBase

    from p2p_diloco.swarm.averaging.averager import DiLoCoAverager

    expected = {  # (request streams, answer streams)
        "rpc_probe": (True, True),
        "rpc_join_group": (False, True),
        "rpc_download_state": (False, True),
        "rpc_audit": (True, True),  # the auditor ends its stream once it holds every part (swarm/transport/streams.py)
        "rpc_evidence": (True, True),
        "rpc_aggregate_part": (True, True),
    }
    for name, (stream_in, stream_out) in expected.items():
        hints = get_type_hints(getattr(DiLoCoAverager, name))
        request = next(v for k, v in hints.items() if k != "context" and k != "return")
        assert ServicerBase._strip_iterator_hint(request)[1] is stream_in, name
        assert ServicerBase._strip_iterator_hint(hints["return"])[1] is stream_out, name


def test_parts_are_combined_in_sender_order_whatever_order_they_arrive_in_and_fates_are_counted():
    # Two colluders (senders 1 and 3) send -10 x an honest part: aligned-clip drops them (the
    # coordinate-wise median of the five is (1, 1)) and answers the mean of the honest three.
    honest = [torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0])]
    parts = [honest[0], -10 * honest[0], honest[1], -10 * honest[1], honest[2]]
    reducers: list = []
    forward = reduce(parts, [1.0] * 5, ("aligned-clip", 1.0, 2.0), reducer_out=reducers)
    backward = reduce(parts, [1.0] * 5, ("aligned-clip", 1.0, 2.0), order=[4, 3, 2, 1, 0])
    assert all(torch.equal(r, forward[0]) for r in forward + backward)  # the same bytes either way
    torch.testing.assert_close(forward[0], torch.tensor([4 / 3, 4 / 3]))
    assert reducers[0].fates == {(1, "dropped"): 1, (3, "dropped"): 1}
