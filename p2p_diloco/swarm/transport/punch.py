"""A direct connection to a peer behind NAT: reached through a relay, then punched (DCUtR).

Under swarm.hole_punching, a private node holds a relay slot at each of its entry nodes
(node.nat_options). Another node reaches it at `<entry node>/p2p-circuit/p2p/<its id>`; go-libp2p
then has the two dial each other at the same moment over their routers (DCUtR), and a direct
connection forms where both routers map a port the same for every destination (cone NAT) and drop
what nobody asked for. The relayed connection is for that signalling only: `punch` reports a
direct connection or none, and nothing here sends over the relay.

Both nodes must already have learned their public address from what at least four public nodes
on distinct addresses saw of them (go-libp2p's identify; below that its hole-punch service never
starts): a run with fewer public nodes punches nothing. Measured in the home-network lab:
bench/holepunch.py, docs/benchmarks.md "Hole punching".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

POLL_S = 0.05  # how often a wait for the direct connection looks
DIAL_S = 5.0  # the longest wait for a relayed connection through one entry node
RETRY_S = 0.5  # after a relay that did not connect
ATTEMPT_S = 3.0  # the longest wait for the punch over one relayed connection (measured: 20-30 ms)
P2P_CODE = b"\xa5\x03"  # the multiaddr code of /p2p/ (421), as a varint


def circuit(relay: Multiaddr | str, peer: str) -> Multiaddr:
    """`peer`'s address through `relay` (a multiaddr ending in /p2p/<relay id>), in the binary form
    p2pd reads: hivemind writes every /p2p/ id as a CIDv1, which go-multiaddr refuses in a dial
    ("length greater than remaining number of bytes in buffer"); libp2p's form is the raw multihash."""
    head, *ids = str(relay).split("/p2p/")
    hops = b"".join(_p2p(i) for i in ids)
    return Multiaddr(Multiaddr(head).to_bytes() + hops + Multiaddr("/p2p-circuit").to_bytes() + _p2p(peer))


def _p2p(peer: str) -> bytes:
    raw = PeerID.from_base58(peer).to_bytes()  # a multihash of at most 127 bytes: a one-byte length
    return P2P_CODE + bytes([len(raw)]) + raw


async def direct_peers(p2p: P2P) -> set[str]:
    """The peers this node holds a direct (not relayed) connection to."""
    return {str(info.peer_id) for info in await p2p.list_peers() if any(_direct(a) for a in info.addrs)}


async def direct_of(_dht: Any, node: Any) -> set[str]:
    """`direct_peers` of a DHT process's node (for `dht.run_coroutine`)."""
    return await direct_peers(node.p2p)


def _direct(addr: Multiaddr) -> bool:
    return "p2p-circuit" not in str(addr)


async def punch(p2p: P2P, peer: str, relays: Sequence[Multiaddr | str], timeout_s: float) -> float | None:
    """Seconds until this node held a direct connection to `peer` (0.0: it already did), or None if
    none formed within `timeout_s`. Each try reaches `peer` through the next of `relays` and waits
    ATTEMPT_S for the punch; then it drops the relayed connection (go-libp2p punches once per
    connection: a node whose hole-punch service was not up yet gets another chance)."""
    start = time.monotonic()
    target = PeerID.from_base58(peer)
    attempt = 0
    while True:
        if peer in await direct_peers(p2p):
            return time.monotonic() - start if attempt else 0.0  # (0.0: held before this call)
        left = timeout_s - (time.monotonic() - start)
        if left <= 0 or not relays:
            return None
        relay, attempt = relays[attempt % len(relays)], attempt + 1
        try:
            await asyncio.wait_for(p2p._client.connect(target, [circuit(relay, peer)]), min(DIAL_S, left))
        except Exception:  # noqa: BLE001 — p2pd's errors are plain texts; the next relay may do
            await asyncio.sleep(RETRY_S)
            continue
        if await _direct_within(p2p, peer, min(ATTEMPT_S, timeout_s - (time.monotonic() - start))):
            return time.monotonic() - start
        with contextlib.suppress(Exception):
            await p2p._client.disconnect(target)


async def _direct_within(p2p: P2P, peer: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if peer in await direct_peers(p2p):
            return True
        await asyncio.sleep(POLL_S)
    return False


def punch_all(dht: Any, peers: Sequence[str], relays: Sequence[Multiaddr | str], timeout_s: float) -> dict:
    """`punch` to each of `peers` at once, from the peer's process: run in `dht`'s process, whose
    p2pd holds the connections (the averager's replica uses the same daemon)."""
    return dht.run_coroutine(punch_job(peers, relays, timeout_s))


def punch_job(peers: Sequence[str], relays: Sequence[Multiaddr | str], timeout_s: float) -> Any:
    """`punch` to each of `peers` at once, as a job for `dht.run_coroutine`: {peer: seconds or None}."""
    return functools.partial(_punch_all, list(peers), [str(r) for r in relays], timeout_s)


async def _punch_all(peers: list[str], relays: list[str], timeout_s: float, _dht: Any, node: Any) -> dict:
    times = await asyncio.gather(*(punch(node.p2p, peer, relays, timeout_s) for peer in peers))
    return dict(zip(peers, times))
