"""hivemind's ServicerBase tells a streaming rpc_* handler from a unary one by its return hint,
and recognises only typing's AsyncIterator: with collections.abc's (what ruff's UP035 rewrites it
to), a handler that streams is registered as unary and every call to it fails without a log line.
It happened twice: every link probe failed (rpc_probe), and no group ever formed (rpc_join_group,
when it moved to swarm/averaging/gathered.py). This checks every handler the averager serves."""

import inspect

from p2p_diloco.swarm.averaging.averager import DiLoCoAverager


def test_every_averager_rpc_that_yields_is_registered_as_streaming():
    DiLoCoAverager._rpc_handlers = None  # collected afresh from the class as it is now
    DiLoCoAverager._collect_rpc_handlers()
    handlers = {h.method_name: h for h in DiLoCoAverager._rpc_handlers}
    yielding = [name for name in handlers if inspect.isasyncgenfunction(getattr(DiLoCoAverager, name))]
    expected = {"rpc_join_group", "rpc_probe", "rpc_audit", "rpc_lots", "rpc_verdicts", "rpc_aggregate_part"}
    assert expected | {"rpc_download_chunk"} <= set(yielding)
    unary = [name for name in yielding if not handlers[name].stream_output]
    assert not unary, f"registered as unary though they yield (a collections.abc AsyncIterator hint?): {unary}"


def test_the_span_owners_assembly_serves_its_join_requests_as_a_stream():
    from p2p_diloco.swarm.averaging.assembly import AssemblyServicer

    AssemblyServicer._rpc_handlers = None
    AssemblyServicer._collect_rpc_handlers()
    handlers = {h.method_name: h for h in AssemblyServicer._rpc_handlers}
    assert handlers["rpc_join_group"].stream_output  # the leader's answers: ACCEPTED, then BEGIN_ALLREDUCE
