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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import P2P, P2PDaemonError

from p2p_diloco.protocol.reachability import DialBack
from p2p_diloco.swarm.transport import dialback
from p2p_diloco.swarm.transport.diagnose import start_failure
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
    unreachable: str = ""  # p2pd's error, if it could not reach any initial peer


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
            nat_port_map=False,
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
