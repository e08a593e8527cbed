"""What a bootstrap node's relay carried, from its p2pd's own Prometheus metrics.

A bootstrap node started with `--metrics-port PORT` has its p2pd serve libp2p's metrics on
127.0.0.1:PORT (processes.metrics_at). Its relay service (on under swarm.hole_punching: node.nat_options)
counts there the bytes it relayed in both directions and the circuits it opened and closed. A
relayed connection carries a hole punch's signalling and the requests of matchmaking, never parts,
averages or states (docs/design.md, "Hole punching"): these counters are what shows it.

The text comes from our own daemon, on loopback; it is parsed as anything read off a socket all the
same: a value we cannot read is a SwarmError, never a wrong figure.
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

from p2p_diloco.errors import SwarmError

BYTES = "libp2p_relaysvc_data_transferred_bytes_total"
CIRCUITS = "libp2p_relaysvc_connections_total"
RESERVATIONS = "libp2p_relaysvc_reservations_total"
MAX_TEXT = 4 << 20  # p2pd's whole metrics page is ~50 KB
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
_LABEL = re.compile(r'^(\w+)="([^"\\]*)"$')


@dataclass(frozen=True)
class Relayed:
    """Since the node started: bytes relayed (both directions summed), circuits opened and still
    open, and reservations open (private peers that others can reach through this node)."""

    bytes: int
    circuits: int
    open_circuits: int
    reservations: int

    def line(self) -> str:
        return (
            f"relayed {self.bytes / 1e6:.2f} MB over {self.circuits} circuit{'s' * (self.circuits != 1)} "
            f"({self.open_circuits} open), {self.reservations} reservation{'s' * (self.reservations != 1)}"
        )


def parse(text: str) -> Relayed:
    """The relay's counters in a Prometheus text page. A counter the page lacks is 0 (go-libp2p shows
    a labelled counter only once it counted); a line that is not a sample is a SwarmError."""
    samples: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise SwarmError(f"p2pd's metrics: not a sample: {line[:80]!r}")
        name, labels, value = match.groups()
        if name.startswith("libp2p_relaysvc_"):
            samples[(name, _type_of(labels))] = _count(value, line)
    opened = samples.get((CIRCUITS, "opened"), 0.0)
    reserved = samples.get((RESERVATIONS, "opened"), 0.0)
    return Relayed(
        bytes=int(samples.get((BYTES, ""), 0.0)),
        circuits=int(opened),
        open_circuits=max(0, int(opened - samples.get((CIRCUITS, "closed"), 0.0))),
        reservations=max(0, int(reserved - samples.get((RESERVATIONS, "closed"), 0.0))),
    )


def _type_of(labels: str | None) -> str:
    """The `type` label of a sample ("opened", "closed"...), or "" if it has none."""
    for pair in (labels or "{}")[1:-1].split(","):
        match = _LABEL.match(pair.strip())
        if match and match[1] == "type":
            return match[2]
    return ""


def _count(value: str, line: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise SwarmError(f"p2pd's metrics: not a number: {line[:80]!r}") from None
    if not math.isfinite(number) or number < 0:
        raise SwarmError(f"p2pd's metrics: not a count: {line[:80]!r}")
    return number


def read(port: int, timeout_s: float = 2.0) -> Relayed:
    """The relay's counters from the p2pd serving its metrics on 127.0.0.1:`port` (no proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as answer:
            body = answer.read(MAX_TEXT + 1)
    except (OSError, urllib.error.URLError) as e:
        raise SwarmError(f"p2pd's metrics on 127.0.0.1:{port} cannot be read: {e}") from None
    if len(body) > MAX_TEXT:
        raise SwarmError(f"p2pd's metrics on 127.0.0.1:{port}: over {MAX_TEXT} bytes")
    return parse(body.decode("utf-8", "replace"))
