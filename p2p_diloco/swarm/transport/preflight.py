"""What a peer asks the swarm before its DHT node starts, through one throwaway p2pd.

- **Is its identity in use?** (in_use.py), for a key it did not make just now.
- **Can others dial it?** (dialback.py), under swarm.reachability = "auto" off loopback. The
  throwaway p2pd then listens on the peer's own host and port, so that the entry nodes dial exactly
  what the real node will listen on.

It runs in the DHT process, before hivemind starts the real p2pd (node.py's SwarmDHT.run). The
throwaway p2pd runs with no port mapping and no AutoNAT (relays only if asked), and is stopped,
or killed after STOP_S, before the real one starts. A question that cannot be answered in time
says so in one line and the start goes on: the identity as free, the peer as not dialled back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P, P2PDaemonError

from p2p_diloco.protocol.reachability import DialBack
from p2p_diloco.swarm.transport import dialback
from p2p_diloco.swarm.transport.in_use import in_use

logger = logging.getLogger(__name__)

STOP_S = 5.0  # the longest wait for the throwaway p2pd to exit before it is killed


@dataclass(frozen=True)
class Preflight:
    initial_peers: tuple[str, ...]
    relays: bool  # a node reachable only through a relay can be found
    timeout_s: float  # half to start the throwaway p2pd, half for the questions
    identity: Path | None = None  # ask whether a live node uses this key
    listen: str = ""  # ask for a dial-back to this multiaddr's port ("": don't)
    port: int = 0


@dataclass(frozen=True)
class Answers:
    identity_in_use: bool = False
    dialback: tuple[DialBack, ...] = ()
    dialback_asked: bool = False


def ask(preflight: Preflight) -> Answers:
    """The swarm's answers; a throwaway p2pd that cannot start within half of preflight.timeout_s
    gives none (one line)."""
    try:
        return asyncio.run(_ask(preflight, preflight.timeout_s / 2))
    except (asyncio.TimeoutError, P2PDaemonError, OSError) as e:
        logger.info(
            "could not ask the swarm within %g s whether another node uses this identity or can dial this "
            "peer (%s): starting anyway",
            preflight.timeout_s,
            str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__,
        )
        return Answers(dialback_asked=bool(preflight.listen))


async def _ask(preflight: Preflight, step_s: float) -> Answers:
    probe = await P2P.create(  # P2PDaemonError after step_s, its p2pd then stopped by hivemind
        initial_peers=list(preflight.initial_peers),
        dht_mode="client",
        host_maddrs=[preflight.listen] if preflight.listen else ("/ip4/127.0.0.1/tcp/0",),
        nat_port_map=False,
        auto_nat=False,
        use_relay=preflight.relays,
        use_auto_relay=False,
        startup_timeout=step_s,
    )
    try:
        taken, answers = await asyncio.gather(_in_use(probe, preflight, step_s), _dialback(probe, preflight, step_s))
        return Answers(taken, answers, bool(preflight.listen))
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


async def _dialback(probe: P2P, preflight: Preflight, step_s: float) -> tuple[DialBack, ...]:
    if not preflight.listen:
        return ()
    return tuple(await dialback.ask(probe, dialback.helpers(preflight.initial_peers), preflight.port, step_s))


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
