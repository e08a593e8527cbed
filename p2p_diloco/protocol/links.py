"""Bandwidth-aware reduction: what each peer measures of its link, and the share it may claim. Pure.

In a butterfly all-reduce every peer reduces a span of the vector; a span of fraction f costs a
peer |Δ| · (1 + (k - 2) f) bytes each way, so a fast peer should take a larger span. hivemind's
load balancer sizes the spans from a bandwidth figure each peer announces in the group's
all-gather. Three things decide whether those figures can be trusted:

- **Measured inside the all-reduce, they say nothing.** Every reducer waits for all senders' part i
  before answering it (hivemind's TensorPartReducer), so every stream, fast-to-fast included,
  moves at the slowest member's pace: a slow peer given a smaller span then measures itself the
  fastest, and the next spans make the all-reduce slower than equal spans (docs/design.md §7).
- **So peers probe each other outside the lockstep.** After an all-reduce, while the next inner
  phase trains, a peer streams a probe of `probe_size()` bytes to each other member, one at a time
  (swarm/averaging/allreduce.py). The receiver times the chunks as they arrive (`probe_rate`: the bytes after
  the first chunk over the time from the first to the last, so that connection set-up is not
  counted): that is min(sender's upload, receiver's download). It answers with the figure, and
  keeps it as what it saw of that sender. A peer's own figure (`LinkMeter`) is the slower of its
  best recent upload (what receivers reported) and download (what it measured of others' probes).
- **Claimed, a figure can lie (I4).** A peer that announces 1e12 B/s would reduce the whole vector
  alone (and could poison all of it). So a claim counts only up to what other members measured of
  that peer's probes, which they announce beside their own claim (`vouched_bandwidths`); a claim
  nobody measured counts as no claim (the balancer gives it the group's mean). Then every figure
  is capped at CLAIM_CAP times the group's lower median (`fair_bandwidths`), which bounds a pair of
  colluding peers. Every member computes the same figures from the same gathered bytes, so they
  agree on the spans.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Sequence
from typing import TypeGuard

CLAIM_CAP = 4.0  # no peer's figure counts for more than this many times the group's lower median
# Figures this close to the group's lower median count as the median (`settled_bandwidths`): a
# probe under-reads a link by up to ~20 % (bench/allreduce.py: 2.44 and 2.98 MB/s of the same
# 3.125), and one part moved by such noise costs the all-reduce more than equal spans would.
SAME_LINK = 1.25
RECENT = 5  # figures are the best of the last RECENT measurements: a probe can only under-read a link
PROBE_CHUNK = 128 * 1024  # bytes per probe message
PROBE_MIN, PROBE_MAX = 1024 * 1024, 8 * 1024 * 1024  # bytes per probe: long enough to outlast a tbf burst
PROBE_EVERY = 5  # rounds between probe sweeps (the first follows the first all-reduce)


def probe_targets(others: Sequence[str], direct: Collection[str]) -> list[str]:
    """The members of the last group a peer probes, in order: those it holds a direct (not
    relayed) connection to. A probe is 1-8 MiB: through a relay (hole punching; a member behind a
    NAT nobody punched) it would be bulk over a relay, and the relay would cut it at 128 KiB anyway.
    After an all-reduce, every sender holds a direct connection to each reducer it sent to."""
    reached = set(direct)
    return [peer for peer in others if peer in reached]


def probe_size(payload_bytes: int) -> int:
    """Bytes to probe each peer with: 1/8 of what this peer's pseudo-gradient weighs on the wire,
    within [PROBE_MIN, PROBE_MAX], in whole chunks. Every PROBE_EVERY rounds that adds at most
    1/40 of a round's traffic for a large model."""
    size = min(max(payload_bytes // 8, PROBE_MIN), PROBE_MAX)
    return size - size % PROBE_CHUNK


def probe_rate(arrivals: Sequence[tuple[float, int]]) -> float | None:
    """Bytes/s of one probe from (arrival time, bytes) of its chunks, in order: the bytes after the
    first chunk over the time from the first chunk to the last. None with fewer than 2 chunks."""
    if len(arrivals) < 2:
        return None
    seconds = arrivals[-1][0] - arrivals[0][0]
    size = sum(n for _, n in arrivals[1:])
    return size / seconds if seconds > 0 and size > 0 else None


class Best:
    """The best of the last RECENT figures (bytes/s)."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=RECENT)

    def add(self, bps: float | None) -> None:
        if bps is not None and bps > 0 and math.isfinite(bps):
            self._recent.append(float(bps))

    def value(self) -> float | None:
        return max(self._recent) if self._recent else None


class LinkMeter:
    """This peer's link, from probes: its upload (what receivers reported of its probes), its
    download (what it measured of theirs), and what it saw of each sender."""

    def __init__(self) -> None:
        self.upload, self.download = Best(), Best()
        self._seen: dict[str, Best] = {}

    def sent(self, reported_bps: float | None) -> None:
        """A receiver's report on one of this peer's probes."""
        self.upload.add(reported_bps)

    def received(self, sender: str, bps: float | None) -> None:
        """One probe from `sender`, as this peer measured it."""
        self.download.add(bps)
        self._seen.setdefault(sender, Best()).add(bps)

    def bandwidth(self) -> float | None:
        """The figure to announce: the slower direction (a span costs the same bytes both ways), or
        the one direction measured so far; None before any probe (the balancer then uses the mean)."""
        known = [v for v in (self.upload.value(), self.download.value()) if v is not None]
        return min(known) if known else None

    def seen(self) -> dict[str, float]:
        """What this peer measured of each sender's probes: announced, to vouch for their claims."""
        return {peer: value for peer, best in self._seen.items() if (value := best.value()) is not None}


def vouched_bandwidths(
    members: Sequence[str], claims: Sequence[object], seen_by: Sequence[object]
) -> list[float | None]:
    """Each member's claim, counted up to the best rate another member measured of its probes.

    `claims[i]` and `seen_by[i]` come from member `members[i]`: its figure, and what it measured of
    the others' probes by peer id. Both are untrusted: anything malformed counts as nothing. A
    member nobody measured gets None; a member's view of itself is ignored.
    """
    out: list[float | None] = []
    for i, member in enumerate(members):
        vouches = []
        for j, seen in enumerate(seen_by):
            value = seen.get(member) if j != i and isinstance(seen, dict) else None
            if _is_number(value) and math.isfinite(value) and value > 0:
                vouches.append(float(value))
        claim = claims[i]
        if not vouches or not (_is_number(claim) and math.isfinite(claim) and claim >= 0):
            out.append(None)
        else:
            out.append(min(float(claim), max(vouches)))
    return out


def fair_bandwidths(claims: Sequence[object]) -> list[float | None]:
    """The figures the load balancer may use: each claim capped at CLAIM_CAP x the lower median.

    Claims come from other peers: anything but a finite number >= 0 counts as no claim (None, which
    hivemind resolves to the mean of the others). 0 stays 0: a peer may ask to reduce nothing.
    """
    valid = [float(c) if _is_number(c) and math.isfinite(c) and c >= 0 else None for c in claims]
    positive = sorted(c for c in valid if c is not None and c > 0)
    if not positive:
        return valid
    cap = CLAIM_CAP * positive[(len(positive) - 1) // 2]
    return [None if c is None else min(c, cap) for c in valid]


def settled_bandwidths(figures: Sequence[float | None]) -> list[float | None]:
    """`fair_bandwidths`' figures with those within SAME_LINK of the group's lower median set to
    it, so that links the probes cannot tell apart get equal spans; None and 0 stay as they are.

    The balancer gives each part whole to one member: a figure 4 % under the others' (probe noise
    on equal links) moved a whole part, 8 % more bytes for two members, and the all-reduce ends
    with its most loaded member."""
    positive = sorted(f for f in figures if f is not None and f > 0)
    if not positive:
        return list(figures)
    median = positive[(len(positive) - 1) // 2]
    return [median if f and median / SAME_LINK <= f <= median * SAME_LINK else f for f in figures]


def _is_number(x: object) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def reachable_reducers(
    members: Sequence[str], reduces: Sequence[bool], serves: Sequence[bool], direct: Sequence[Collection[str]]
) -> list[bool]:
    """Which members may reduce a span of the group's vector: one whose averager reduces (not a
    client) and to which every other member can send its parts directly. That is a member that
    serves (others can dial it: a public peer), or one every other member holds a direct connection
    to (`direct[j]`: whom member j showed it is connected to, punched through NAT;
    swarm/transport/punch.py). A relay never carries a part. Every member computes the same from
    the same all-gather; a member that lies about its connections fails its own part's span."""
    return [
        bool(r) and (bool(s) or all(m in d for j, d in enumerate(direct) if j != i))
        for i, (m, r, s) in enumerate(zip(members, reduces, serves))
    ]


def cap_shares(fractions: Sequence[float], eligible: Sequence[bool], max_share: float) -> list[float]:
    """The shares of the vector each member reduces, none above `max_share` (or 1/n when n eligible
    members cannot cover the vector otherwise): what a capped member loses goes in equal parts to
    the eligible members below the cap (water-filling). A member that is not eligible (a client)
    keeps 0. Every member computes the same shares from the same inputs."""
    n = sum(bool(e) for e in eligible)
    if n == 0:
        return list(fractions)
    limit = max(max_share, 1.0 / n)
    shares = [float(f) if e else 0.0 for f, e in zip(fractions, eligible)]
    total = sum(shares)
    shares = [s / total for s in shares] if total > 0 else [1.0 / n if e else 0.0 for e in eligible]
    for _ in range(len(shares)):
        excess = sum(max(0.0, s - limit) for s in shares)
        if excess <= 1e-12:
            break
        shares = [min(s, limit) for s in shares]
        below = [i for i, (s, e) in enumerate(zip(shares, eligible)) if e and s < limit]
        for i in below:
            shares[i] += excess / len(below)
    return shares


PARTS_PER_MEMBER = 4  # a small vector is cut so that each reducing member gets about this many parts
MIN_PART_BYTES = 64 * 1024  # below this a part costs more in messages and signatures than it carries


def part_bytes(vector_bytes: int, reducers: int, largest: int) -> int:
    """The all-reduce's part size for a vector of `vector_bytes` (encoded) and `reducers` members
    that reduce: `largest` for a big vector, and for a small one small enough that each reducer
    gets about PARTS_PER_MEMBER parts (never under MIN_PART_BYTES).

    hivemind gives each part whole to the member whose span covers most of it, so a vector of one
    part was reduced entirely by one member, whatever the balancer's shares and `cap_shares` said
    (the tiny preset, 0.9 MB at scaled-fp16, under 2 MiB parts). Every member computes the same
    size from the same inputs, so they agree on the layout."""
    share = math.ceil(max(0, vector_bytes) / (max(1, reducers) * PARTS_PER_MEMBER))
    return max(min(MIN_PART_BYTES, largest), min(largest, share))
