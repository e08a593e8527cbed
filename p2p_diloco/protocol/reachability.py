"""Whether other peers can dial this one: its tier, decided once at start (docs/design.md §3,
"Reachability").

A peer behind a home router can dial out, but nobody can dial in: a reducer there cannot be sent
its parts, and a state it serves cannot be downloaded. Such a peer must be a client. Which one it
is, a peer finds out at start by a dial-back (swarm/transport/dialback.py). It asks the entry nodes
to connect to the address they saw it at, on the port it listens on. A peer that listens on
loopback, or that has no entry node to ask (the first node of a swarm), is public.

Tiers:
- **public**: others dial it; it reduces a span of the group's vector and serves its state;
- **private**: it dials out only; it sends its parts to the group's reducers and receives the
  average (hivemind's client mode), and never reduces or serves;
- **punched** (a private peer under swarm.hole_punching, in its round records and the observer's
  view): it also punches direct connections to other private peers, and reduces a span for a
  group whose every other member holds one to it (swarm/punching.py); it serves no state.

Everything here is pure: the dial-back's I/O gives `decide` its answers, and the start prints
`line`.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from p2p_diloco.config import ReachabilitySetting as Setting

Tier = Literal["public", "private"]


@dataclass(frozen=True)
class DialBack:
    """One entry node's answer: the address it saw this peer at, and whether its dial to that
    address and the peer's port reached a libp2p node ("" if it did; else why not)."""

    helper: str
    seen: str
    port: int
    failure: str = ""

    @property
    def reached(self) -> bool:
        return not self.failure


@dataclass(frozen=True)
class Reachability:
    """A peer's tier, and how it was decided (`how` completes the sentence "public: ...")."""

    tier: Tier
    how: str
    seen: str = ""  # the address the entry nodes saw, when one answered
    port: int = 0

    @property
    def serves(self) -> bool:
        return self.tier == "public"


def loopback(host: str) -> bool:
    """Whether `host` (swarm.host) keeps the peer on this machine, where every peer can dial it."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def needs_dialback(setting: Setting, host: str, initial_peers: Sequence[str]) -> bool:
    """Whether the start asks entry nodes to dial back: only `auto`, off loopback, with someone to ask."""
    return setting == "auto" and bool(initial_peers) and not loopback(host)


def decide(setting: Setting, host: str, asked: bool, answers: Sequence[DialBack], mapped: bool = False) -> Reachability:
    """The tier from the config and the dial-back's answers (`asked`: whether it was asked;
    `mapped`: for a port the router mapped on request, swarm.upnp)."""
    if setting != "auto":
        return Reachability(setting, "set by swarm.reachability")
    if loopback(host):
        return Reachability("public", f"it listens on {host}, where only peers of this machine can dial it")
    if not asked:
        return Reachability("public", "no entry node to ask (the first node of a swarm is public)")
    if not answers:
        return Reachability(
            "public",
            "no entry node answered the dial-back, so it stays public as before; if others cannot dial this "
            'machine, set swarm.reachability = "private"',
        )
    reached = [a for a in answers if a.reached]
    first = (reached or list(answers))[0]
    if reached:
        how = f"entry node …{first.helper[-6:]} dialled it back" + (
            " on the port its router mapped (UPnP)" if mapped else ""
        )
        return Reachability("public", how, first.seen, first.port)
    return Reachability("private", f"the dial-back failed ({first.failure})", first.seen, first.port)


def line(reach: Reachability, hole_punching: bool = False) -> str:
    """The one line a volunteer reads at start: the tier, what it means, and the fix if private.
    `hole_punching` (swarm.hole_punching): a private peer then also punches to other private ones."""
    where = f" at {reach.seen} port {reach.port}" if reach.seen else ""
    if reach.serves:
        return f"reachability: public{where}: {reach.how}; this peer reduces and serves its state"
    if hole_punching:
        return (
            f"reachability: private, hole punching{where}: {reach.how}; this peer punches direct connections "
            f"to other private peers through its entry nodes' relays (cone NAT only), and reduces for a group "
            f"only if every other member holds one to it; it serves no state. To be public: forward a TCP port "
            f"on your router to this machine and set swarm.port to it, or turn on swarm.upnp"
        )
    return (
        f"reachability: private{where}: {reach.how}; this peer sends its parts and receives the average "
        f"through public peers, but reduces and serves nothing. To be public: forward a TCP port on your "
        f"router to this machine and set swarm.port to it (swarm.announce_host to the router's public "
        f"address if it differs), or turn on swarm.upnp, or use IPv6; under WSL2, turn on mirrored networking"
    )


def beaten_since(serving: Iterable[str], before: Mapping[str, float], now: Mapping[str, float]) -> bool:
    """Whether one of the `serving` peers sent a heartbeat since `before` was read. A beat's time
    is its sender's own clock, so it is compared only with that sender's earlier beats: a peer
    SIGKILLed a moment ago still looks live to a staleness test for seconds, but beats no more."""
    return any(now.get(p, -math.inf) > before.get(p, -math.inf) for p in serving)


def nobody_serves(run_id: str, round_: int | None, timeout_s: float, unpunched: int = 0) -> str:
    """Why a private peer stops: no public peer of its run beat within `timeout_s` (at start, or at
    `round_`, where its public peers left: its own state alone is one nobody could ever adopt).
    `unpunched`: the live private peers of the run it could not punch to (swarm.hole_punching)."""
    if unpunched:
        where = "" if round_ is None else f" at round {round_}"
        why = (
            f"{unpunched} private peer{'s' * (unpunched > 1)} of the run train{'s' * (unpunched == 1)}, but no "
            "direct connection to "
            f"{'any of them' if unpunched > 1 else 'it'} formed (hole punching needs both routers to keep one "
            "public port per connection, cone NAT; one that gives each destination its own port, symmetric "
            "NAT, cannot be punched)"
        )
    elif round_ is None:
        where, why = "", "a private peer (swarm.reachability) needs at least one peer that others can dial"
    else:
        where = f" at round {round_}"
        why = (
            "its public peers left, and a private peer (swarm.reachability) does not train on alone: "
            "nobody could download its state, so the private peers would each train a model of their own"
        )
    return (
        f"no reachable peer of run {run_id!r}{where} within {timeout_s:g} s: {why}; start a public peer, "
        f'or set swarm.reachability = "public" if others can dial this one'
    )
