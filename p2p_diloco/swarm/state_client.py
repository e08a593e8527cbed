"""Downloading a peer's served state without being a peer: the observer and `export --initial-peers`.

A peer serves its current (round, θ, momentum) to admitted askers (swarm/averaging/averager.py `rpc_download_state`).
A joiner asks through its own averager process; an observer has none. `StateClient` asks from a
thread of its own with an event loop, over a replica of the observer's DHT node's libp2p daemon
(hivemind's `replicate_p2p`), so the state never passes through a pipe between processes.

Both read the reply with `served.read_served_state`, which caps it at the size of this model's
state and gives up on a silent server; what arrived is untrusted (I4).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.protocol.deadlines import state_bytes
from p2p_diloco.protocol.network import ServedState
from p2p_diloco.swarm.averaging.averager import DiLoCoAverager
from p2p_diloco.swarm.averaging.served import read_served_state
from p2p_diloco.swarm.trust.run_dht import RunDHT

logger = logging.getLogger(__name__)


class StateClient:
    """Fetches served states over the libp2p daemon of a DHT node in this process's care."""

    def __init__(self, run_dht: RunDHT, numel: int, stall_s: float):
        self.prefix, self.limit, self.stall_s = run_dht.prefix, state_bytes(numel), stall_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="state-client", daemon=True)
        self._thread.start()
        with run_dht.turn() as dht:  # replicate_p2p asks the DHT process once, through its pipe
            self._p2p = self._run(dht.replicate_p2p(), timeout=30.0)

    def fetch(self, peer: str, timeout: float) -> ServedState | None:
        """The state `peer` serves now, within `timeout` seconds in all (I3)."""
        return self._run(asyncio.wait_for(self._fetch(PeerID.from_base58(peer)), timeout), timeout + 5.0)

    async def _fetch(self, peer: PeerID) -> ServedState | None:
        # The handler's name is the serving class's: DiLoCoAverager's, not hivemind's base class.
        stub = DiLoCoAverager.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        return await read_served_state(stream, self.limit, peer, self.stall_s)

    def _run(self, coroutine: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def close(self) -> None:
        try:  # the replica's client socket file goes with it; the daemon stays with its DHT node
            self._run(self._p2p.shutdown(), timeout=5.0)
        except Exception as e:  # a DHT process already gone: nothing left to close
            logger.debug("closing the state client's libp2p replica: %r", e)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
