"""Why a node did not start, in one line that names the fix.

hivemind raises P2PDaemonError for every way its libp2p daemon fails to start, with the daemon's
own output as the text. That text is the only signal (`start_failure`). For entry nodes that could
not be reached, p2pd says only "failed to connect to bootstrap peers", whatever the cause: a wrong
port, a firewall, a host that is down, no route. So `unreachable` tries each of the first
MAX_PROBED entry nodes with a plain TCP connection (within PROBE_S each). Then it names the address,
the port and what happened there, and what to do about it.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from typing import Literal

from hivemind.utils.multiaddr import Multiaddr

PROBE_S = 3.0
MAX_PROBED = 3

StartFailure = Literal["port in use", "peers unreachable", "other"]


def start_failure(error: BaseException) -> StartFailure:
    """Why hivemind's DHT did not start, as far as its message says ("Daemon failed to start: ...
    failed to listen on any addresses: [... bind: address already in use]", "... failed to connect
    to bootstrap peers"; hivemind 1.1), or RuntimeError and TimeoutError from elsewhere in its start."""
    lowered = str(error).lower()
    if "address already in use" in lowered or "bind" in lowered:
        return "port in use"
    if "connect" in lowered or "bootstrap" in lowered or "timeout" in lowered or "dial" in lowered:
        return "peers unreachable"
    return "other"


def unreachable(initial_peers: Sequence[str]) -> str:
    """One line: what a TCP connection to each of the first entry nodes met, and the fix."""
    found = [_probe(maddr) for maddr in initial_peers[:MAX_PROBED]]
    more = f" (and {len(initial_peers) - MAX_PROBED} more)" if len(initial_peers) > MAX_PROBED else ""
    return "could not reach any initial peer: " + "; ".join(found) + more


def _probe(maddr: str) -> str:
    try:
        parsed = Multiaddr(maddr)
        names = [p.name for p in parsed.protocols()]
        host = next(str(parsed.value_for_protocol(n)) for n in ("ip4", "ip6", "dns4", "dns6", "dns") if n in names)
        port = int(parsed.value_for_protocol("tcp"))
        peer = str(parsed.value_for_protocol("p2p"))
    except Exception:  # multiaddr raises several types; node.parse_initial_peers checked these already
        return f"{maddr} is not an address with an IP, a TCP port and a peer id"
    where = f"{host} port {port}"
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            pass
    except socket.gaierror as e:
        return f"{host} does not resolve ({e.strerror}): check the address"
    except TimeoutError:
        return (
            f"{where} did not answer within {PROBE_S:g} s: a firewall drops the connection (this network's or "
            f"the node's) or the host is down; ask the node's operator whether the port is open, or try "
            f"another network"
        )
    except ConnectionRefusedError:
        return (
            f"{where} refused the connection: nothing listens there; check the port against the "
            f"--initial-peers line the node printed, and that the bootstrap node is running"
        )
    except OSError as e:
        if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return f"no route to {host} ({e.strerror}): check the address, and that this machine is online"
        return f"{where}: {e.strerror or type(e).__name__}"
    return (
        f"{where} accepts connections, but no node with the id …{peer[-6:]} answered there: copy the whole "
        f"--initial-peers line the node printed (its id changes if its key file was lost)"
    )
