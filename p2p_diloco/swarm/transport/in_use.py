"""Whether a live node in the swarm already uses this peer's identity, asked before its DHT starts.

Two processes with one identity key (a peer folder copied to a second machine, two peers given the
same --identity) make libp2p route each one's streams to the other, and both sign records as one
member. hivemind asks this itself when a DHT starts with an existing key, but its throwaway p2pd
runs with UPnP/NAT-PMP port mapping and AutoNAT on whatever the caller chose (it passes none of the
caller's options on): each restart probed the user's router. Its connect also waits up to p2pd's own
default of 60 s. So hivemind's check is off (check_if_identity_free=False) and this one asks the
same question through the start's throwaway p2pd (preflight.py: no port mapping, no AutoNAT):
connect to the key's peer id through the initial peers, within `timeout_s`.

Only the answer "a node with this id answered" stops the start. A check that cannot finish in time
says so in one line and the start goes on: it guards against a mistake, and must not turn a slow
start into a failed one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure


async def in_use(probe: P2P, identity_path: Path, timeout_s: float) -> bool:
    """Whether a node with `identity_path`'s peer id answers `probe`'s connect within `timeout_s`
    (asyncio.TimeoutError if nobody could tell in time)."""
    peer_id = PeerID.from_identity(identity_path.read_bytes())
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, []), timeout_s)
        return True
    except ControlFailure:  # nobody with that id could be found or dialled
        return False
