"""What a peer asks the swarm before its DHT node starts, through one throwaway p2pd.

- **Is its identity in use?** (in_use.py), for a key it did not make just now.
- **Can others dial it?** (dialback.py), under swarm.reachability = "auto" off loopback. The
  throwaway p2pd then listens on the peer's own host and port, so that the entry nodes dial exactly
  what the real node will listen on.

With swarm.upnp, the throwaway p2pd first asks the home router for a port mapping (UPnP IGD or
NAT-PMP, which p2pd finds in about 5 s), and the dial-back is asked for the mapped port: a peer is
public by UPnP only if the mapping works from outside. (The real node maps a port of its own, and
announces it.)

It runs in the DHT process, before hivemind starts the real p2pd (node.py's SwarmDHT.run). The
throwaway p2pd runs with no AutoNAT (relays only if asked) and maps no port unless asked, and is stopped,
or killed after STOP_S, before the real one starts. A question that cannot be answered in time
says so in one line and the start goes on: the identity as free, the peer as not dialled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError

from p2p_diloco.protocol.reachability import DialBack
from p2p_diloco.swarm.transport import dialback
from p2p_diloco.swarm.transport.diagnose import start_failure
from p2p_diloco.swarm.transport.in_use import in_use

logger = logging.getLogger(__name__)

STOP_S = 5.0  # the longest wait for the throwaway p2pd to exit before it is killed
UPNP_WAIT_S = 8.0  # for the router's port mapping (p2pd searches for a router for 5 s, then asks it)


@dataclass(frozen=True)
class Preflight:
    initial_peers: tuple[str, ...]
    relays: bool  # a node reachable only through a relay can be found
    timeout_s: float  # half to start the throwaway p2pd, half for the questions
    identity: Path | None = None  # ask whether a live node uses this key
    listen: str = ""  # ask for a dial-back to this multiaddr's port ("": don't)
    port: int = 0
    upnp: bool = False  # map the port on the router first, and ask the dial-back for the mapped one


@dataclass(frozen=True)
class Answers:
    identity_in_use: bool = False
    dialback: tuple[DialBack, ...] = ()
    dialback_asked: bool = False
    unreachable: str = ""  # p2pd's error, if it could not reach any initial peer
    mapped: int = 0  # the public port the router mapped (swarm.upnp), 0 if none


def ask(preflight: Preflight) -> Answers:
    """The swarm's answers; a throwaway p2pd that cannot start within half of preflight.timeout_s
    gives none (one line)."""
    try:
        return asyncio.run(_ask(preflight, preflight.timeout_s / 2))
    except P2PDaemonError as e:
        if start_failure(e) == "peers unreachable":  # the node's own p2pd would fail alike: say so now
            return Answers(unreachable=str(e))
        return _unanswered(preflight, e)
    except (asyncio.TimeoutError, OSError) as e:
        return _unanswered(preflight, e)


def _unanswered(preflight: Preflight, e: BaseException) -> Answers:
    logger.info(
        "could not ask the swarm within %g s whether another node uses this identity or can dial this "
        "peer (%s): starting anyway",
        preflight.timeout_s,
        str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__,
    )
    return Answers(dialback_asked=bool(preflight.listen))


async def _ask(preflight: Preflight, step_s: float) -> Answers:
    try:
        probe = await P2P.create(  # P2PDaemonError after step_s, its p2pd then stopped by hivemind
            initial_peers=list(preflight.initial_peers),
            dht_mode="client",
            host_maddrs=[preflight.listen] if preflight.listen else ("/ip4/127.0.0.1/tcp/0",),
            nat_port_map=preflight.upnp,
            auto_nat=False,
            use_relay=preflight.relays,
            use_auto_relay=False,
            startup_timeout=step_s,
        )
    except P2PDaemonError:
        # hivemind leaves the failed p2pd to asyncio's child watcher, whose thread reaps it; were the loop
        # closed by then, the watcher would log a warning of its own: the volunteer's one line would be two.
        await asyncio.to_thread(_join_reapers, STOP_S)
        raise
    try:
        taken, (answers, mapped) = await asyncio.gather(
            _in_use(probe, preflight, step_s), _dialback(probe, preflight, step_s)
        )
        return Answers(taken, answers, bool(preflight.listen), mapped=mapped)
    finally:
        await _stop(probe)


async def _in_use(probe: P2P, preflight: Preflight, step_s: float) -> bool:
    if preflight.identity is None:
        return False
    try:
        return await in_use(probe, preflight.identity, step_s)
    except asyncio.TimeoutError:
        logger.info(
            "could not check within %g s whether another node uses the identity %s: starting anyway",
            step_s,
            preflight.identity,
        )
        return False


async def _dialback(probe: P2P, preflight: Preflight, step_s: float) -> tuple[tuple[DialBack, ...], int]:
    """The entry nodes' answers, and the port the router mapped (0: none, or not asked)."""
    if not preflight.listen:
        return (), 0
    mapped = await _mapped_port(probe) if preflight.upnp else 0
    port = mapped or preflight.port
    return tuple(await dialback.ask(probe, dialback.helpers(preflight.initial_peers), port, step_s)), mapped


async def _mapped_port(probe: P2P) -> int:
    """The public port the router mapped for the throwaway p2pd, once p2pd announces it (within
    UPNP_WAIT_S), or 0 with one line."""
    deadline = time.monotonic() + UPNP_WAIT_S
    while True:
        port = mapped_port(await probe.get_visible_maddrs(latest=True))
        if port or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.25)  # a poll of p2pd's own addresses, bounded by the deadline
    if not port:
        logger.warning(
            "swarm.upnp: no router mapped a port within %g s: turn on UPnP (or NAT-PMP) in the router's "
            "settings, or forward a port by hand and set swarm.port",
            UPNP_WAIT_S,
        )
    return port


def mapped_port(maddrs: Sequence[Any]) -> int:
    """The TCP port of the first address with a globally routable IPv4 host: the one a router
    mapped (p2pd announces a failed mapping with port 0: not one)."""
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and parts[4].isdigit() and int(parts[4]):
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(parts[2]).is_global:
                    return int(parts[4])
    return 0


def _join_reapers(timeout_s: float) -> None:
    """Wait up to `timeout_s` for asyncio's child-watcher threads ("asyncio-waitpid-<pid>", one per
    child process it waits for) to reap the children: in the DHT process before it starts, only p2pd."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name.startswith("asyncio-waitpid-"):
            thread.join(max(0.0, deadline - time.monotonic()))


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
