"""Bandwidth-aware reduction: what each peer measures of its link, and the share it may claim. Pure.

Status: the cap is applied to every group; the measurement is recorded (metrics `link_mbit_s`)
but not announced, because in hivemind's lockstep all-reduce it cannot tell a fast link from a
slow one (see the second point below and bench/balance.py). Spans are therefore equal unless a
peer announces a figure of its own, which the cap bounds.

In a butterfly all-reduce every peer reduces a span of the vector; a span of fraction f costs a
peer |Δ| · (1 + (k - 2) f) bytes each way, so a fast peer should take a larger span. hivemind's
load balancer sizes the spans from a bandwidth figure each peer announces in the group's
all-gather. Two things go wrong with announced figures:

- **Measured naively, it says nothing.** Bytes moved over the all-reduce's duration is the pace
  of the group's slowest link for everyone (they all wait for it), and it feeds back: a peer with
  a small span moves fewer bytes, measures less, gets a smaller span. So a peer measures each
  stream with each other peer (its parts to their span, their parts to its span) over that
  stream's own duration, and sums the rates: a stream with a slow peer is slow, but takes only its
  share of this link (allreduce.py). That is still a lower bound on what the link can carry, so
  a peer would announce the best of its recent measurements (`LinkMeter`). Measured on emulated
  links, this still fails: every reducer waits for all senders' part i before answering it
  (hivemind's TensorPartReducer), so every stream, fast-fast included, moves at the slowest
  peer's pace, and the slow peer, given a smaller span, then measured itself the fastest
  (bench/balance.py: 28, 24, 24, 40, 43 s against 24 s for equal spans). Telling links apart
  needs a measurement outside the lockstep (a probe, or the reducers' view of which sender is
  always last); until then peers announce nothing.
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

    def record(self, upload_bps: float, download_bps: float) -> None:
        """One all-reduce's throughput each way (0: not measured, e.g. a peer given no span to
        reduce receives no parts). The slower direction limits this peer: a span costs the same
        bytes both ways."""
        rates = [r for r in (upload_bps, download_bps) if r > 0 and math.isfinite(r)]
        if rates:
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
