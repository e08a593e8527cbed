"""Bandwidth-aware reduction: what each peer measures of its link, and the share it may claim. Pure.

In a butterfly all-reduce every peer reduces a span of the vector; a span of fraction f costs a
peer |Δ| · (1 + (k - 2) f) bytes each way, so a fast peer should take a larger span. hivemind's
load balancer sizes the spans from a bandwidth figure each peer announces in the group's
all-gather. Two things go wrong with announced figures:

- **Measured, honestly, it feeds back.** A peer's throughput in one all-reduce is bytes moved over
  the time it was moving them, and a peer with a small span moves fewer bytes while it waits for
  the slowest member: it measures less, gets a smaller span, measures less again. Throughput
  measured this way is a lower bound on what the link can carry, so a peer announces the best of
  its recent measurements (`LinkMeter`), which a small span cannot drag down.
- **Claimed, it can lie (I4).** A peer that announces 1e12 B/s would reduce the whole vector alone
  (and could poison all of it). Every member therefore caps every figure at CLAIM_CAP times the
  group's lower median before balancing (`fair_bandwidths`): one liar among honest peers gets at
  most CLAIM_CAP shares of an honest peer's, never the whole vector. Every member computes the
  same figures from the same gathered claims, so they agree on the spans.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

CLAIM_CAP = 4.0  # no peer's figure counts for more than this many times the group's lower median
RECENT = 5  # a peer announces the best of its last RECENT measurements


class LinkMeter:
    """This peer's throughput, from its recent all-reduces (bytes/s)."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=RECENT)

    def record(self, bytes_sent: int, send_s: float, bytes_received: int, receive_s: float) -> None:
        """One all-reduce: the slower direction is what limits this peer (a span costs the same both ways)."""
        rates = [b / s for b, s in ((bytes_sent, send_s), (bytes_received, receive_s)) if b > 0 and s > 0]
        if len(rates) == 2:
            self._recent.append(min(rates))

    def bandwidth(self) -> float | None:
        """The figure to announce; None before the first measurement (hivemind then assumes the group's mean)."""
        return max(self._recent) if self._recent else None


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


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
