"""Whether a live node in the swarm already uses this peer's identity, asked before its DHT starts.

Two processes with one identity key (a peer folder copied to a second machine, two peers given the
same --identity) make libp2p route each one's streams to the other, and both sign records as one
member. hivemind asks this itself when a DHT starts with an existing key, but its throwaway p2pd
runs with UPnP/NAT-PMP port mapping and AutoNAT on whatever the caller chose (it passes none of the
caller's options on): each restart probed the user's router. Its connect also waits up to p2pd's own
default of 60 s. So hivemind's check is off (check_if_identity_free=False) and this one asks the
same question: a p2pd with no port mapping and no AutoNAT (relays only if swarm.nat_traversal),
asked to connect to the key's peer id through the initial peers, within `timeout_s`.

Only the answer "a node with this id answered" stops the start. A check that cannot finish in time
says so in one line and the start goes on: it guards against a mistake, and must not turn a slow
start into a failed one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

logger = logging.getLogger(__name__)

STOP_S = 5.0  # the longest wait for the throwaway p2pd to exit before it is killed


def in_use(identity_path: Path, initial_peers: Sequence[str], relays: bool, timeout_s: float) -> bool:
    """Whether a node with `identity_path`'s peer id answers in the swarm (run in the DHT process,
    before its own p2pd starts). False, with one log line, if the check does not finish within
    `timeout_s` (half for the throwaway p2pd to start, half for the connect)."""
    try:
        return asyncio.run(_ask(identity_path, initial_peers, relays, timeout_s / 2))
    except (asyncio.TimeoutError, P2PDaemonError, OSError) as e:
        logger.info(
            "could not check within %g s whether another node uses the identity %s (%s): starting anyway",
            timeout_s,
            identity_path,
            str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__,
        )
        return False


async def _ask(identity_path: Path, initial_peers: Sequence[str], relays: bool, step_s: float) -> bool:
    peer_id = PeerID.from_identity(identity_path.read_bytes())
    probe = await P2P.create(  # P2PDaemonError after step_s, its p2pd then stopped by hivemind
        initial_peers=list(initial_peers),
        dht_mode="client",
        nat_port_map=False,
        auto_nat=False,
        use_relay=relays,
        use_auto_relay=False,
        startup_timeout=step_s,
    )
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, []), step_s)
        return True
    except ControlFailure:  # nobody with that id could be found or dialled
        return False
    finally:
        await _stop(probe)


async def _stop(probe: P2P) -> None:
    """End the throwaway p2pd; kill it if it has not exited within STOP_S."""
    probe._terminate()
    child = probe._child
    if child is None:
        return
    try:
        await asyncio.wait_for(child.wait(), STOP_S)
    except asyncio.TimeoutError:
        logger.debug("the throwaway p2pd (pid %s) did not exit within %g s: killed", child.pid, STOP_S)
        child.kill()
