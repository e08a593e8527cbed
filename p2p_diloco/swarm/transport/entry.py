"""Finding the swarm again: entry nodes that restart, chain, or go away for a while.

A restarted bootstrap node comes up with an empty DHT; the running peers would never tell it about
themselves, and a volunteer who then joins through it would train alone. So:
- every peer and every bootstrap node pings its entry nodes (its initial peers) every
  REATTACH_S: a ping makes each side add the other to its DHT routing table, so a restarted entry
  node knows the swarm again within seconds;
- each remembers the addresses the run's peers publish in their round records (only addresses
  under the publisher's own id: a record speaks only for its signer), in a file beside its
  identity key, and on a restart pings them as well (a bootstrap node) or adds them to its
  initial peers (a peer), so that it finds the swarm even when its configured entry nodes are down.

Everything here is I/O with deadlines; a failed ping is retried at the next period.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.protocol.network import RoundRecord

logger = logging.getLogger(__name__)

REATTACH_S = 10.0  # how often a node pings its entry nodes (and a bootstrap node its remembered peers)
REMEMBER_S = 60.0  # how often a node writes the addresses it saw to its address book
PING_TIMEOUT_S = 5.0  # one connect-and-ping, at most
MAX_REMEMBERED = 16


def book_path(identity_path: Path) -> Path:
    """The address book beside an identity key: identity.key → identity.peers."""
    return identity_path.with_name(identity_path.stem + ".peers")


def remembered(identity_path: Path | None) -> list[str]:
    """The multiaddrs in the address book beside `identity_path` (none if there is no book)."""
    if identity_path is None or not book_path(identity_path).is_file():
        return []
    lines = book_path(identity_path).read_text(errors="replace").splitlines()
    return [line.strip() for line in lines if _valid(line.strip())][:MAX_REMEMBERED]


def addresses_of(records: Mapping[str, RoundRecord], me: str) -> list[str]:
    """Where the run's other peers listen, as they published it: only addresses under the
    publisher's own peer id, and only peers that serve (a client-mode peer cannot be reached)."""
    out = []
    for peer, record in sorted(records.items()):
        if peer == me or not record.serves:
            continue
        out += [a for a in record.addrs if a.endswith(f"/p2p/{peer}") and _valid(a)][:2]
    return out[:MAX_REMEMBERED]


def remember(identity_path: Path | None, maddrs: Iterable[str]) -> None:
    """Write `maddrs` to the address book (atomically: a crash leaves the old book or the new)."""
    found = list(dict.fromkeys(maddrs))[:MAX_REMEMBERED]
    if identity_path is None or not found:
        return
    path = book_path(identity_path)
    partial_path = path.with_name(path.name + ".partial")
    try:
        partial_path.write_text("".join(f"{a}\n" for a in found))
        os.replace(partial_path, path)
    except OSError as e:  # a full disk or a read-only folder: the book is an aid, not a must
        logger.debug("could not write the address book %s: %s", path, e)


def start_pings(dht: Any, maddrs: list[str]) -> Any:
    """Ping `maddrs` from the DHT's process, without waiting: returns the future of how many
    answered (so the caller holds the DHT handle only to send the request)."""
    return dht.run_coroutine(partial(_ping_all, list(maddrs)), return_future=True)


async def _ping_all(maddrs: list[str], _dht: Any, node: Any) -> int:
    answers = await asyncio.gather(*(_ping(node, text) for text in maddrs))
    return sum(answers)


async def _ping(node: Any, text: str) -> bool:
    """Connect to one entry node and ping it over the DHT protocol: each side adds the other to
    its routing table. False if it does not answer within PING_TIMEOUT_S."""
    try:
        maddr = Multiaddr(text)
        peer = PeerID.from_base58(maddr["p2p"])
        if peer == node.peer_id:
            return False
        where = maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))
        await asyncio.wait_for(node.p2p._client.connect(peer, [where]), PING_TIMEOUT_S)
        return await asyncio.wait_for(node.protocol.call_ping(peer), PING_TIMEOUT_S) is not None
    except Exception as e:  # unreachable, refused, a malformed address: try again next period
        logger.debug("entry node %s did not answer: %s", text, e)
        return False


def _valid(text: str) -> bool:
    try:
        maddr = Multiaddr(text)
        PeerID.from_base58(maddr["p2p"])
    except Exception:  # multiaddr and base58 raise several types on malformed text
        return False
    return True
