"""Downloading a peer's served state without being a peer: the observer and `export --initial-peers`.

A peer serves its current (round, θ, momentum) to admitted askers (swarm/averaging/averager.py `rpc_download_state`).
A joiner asks through its own averager process; an observer has none. `StateClient` asks from a
thread of its own with an event loop, over a replica of the observer's DHT node's libp2p daemon
(hivemind's `replicate_p2p`), so the state never passes through a pipe between processes.

Like a joiner, it downloads in chunks from several holders at once (`manifests`, `download_chunks`:
swarm/averaging/chunked.py's `ChunkFetcher`, each chunk checked against its holder's manifest), or
a whole state from one holder (`fetch`: `served.read_served_state`, capped at the size of this
model's state, giving up on a silent server). What arrived is untrusted (I4).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2p_diloco.protocol import chunks
from p2p_diloco.protocol.deadlines import state_bytes
from p2p_diloco.protocol.network import Assembled, ServedState
from p2p_diloco.swarm.averaging.averager import DiLoCoAverager
from p2p_diloco.swarm.averaging.chunked import ChunkFetcher
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
        self._fetcher = ChunkFetcher(self._stub)

    def _stub(self, peer: PeerID) -> Any:
        # The handlers' names are the serving class's: DiLoCoAverager's, not hivemind's base class.
        return DiLoCoAverager.get_stub(self._p2p, peer, namespace=self.prefix)

    def fetch(self, peer: str, timeout: float) -> ServedState | None:
        """The state `peer` serves now, within `timeout` seconds in all (I3)."""
        return self._run(asyncio.wait_for(self._fetch(PeerID.from_base58(peer)), timeout), timeout + 5.0)

    async def _fetch(self, peer: PeerID) -> ServedState | None:
        stream = await self._stub(peer).rpc_download_state(averaging_pb2.DownloadRequest())
        return await read_served_state(stream, self.limit, peer, self.stall_s)

    def manifests(self, peers: list[str], wanted: tuple[int, str]) -> dict[str, chunks.Manifest]:
        """{holder: its manifest of the state `wanted`} (round, digest), asked of `peers` at once,
        each within the stall time; those that sent none are left out."""
        return self._run(self._fetcher.manifests(peers, wanted, self.limit, self.stall_s), self.stall_s + 5.0)

    def download_chunks(self, manifest: chunks.Manifest, holders: list[str], timeout: float) -> Assembled:
        """The state of `manifest` in chunks from `holders` at once, within `timeout` seconds in all."""
        deadline = time.monotonic() + timeout
        return self._run(self._fetcher.download(manifest, holders, deadline, self.stall_s), timeout + 5.0)

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
