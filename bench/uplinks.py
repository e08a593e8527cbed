"""Each lab host's uplink over time, sampled from the host's own counters: where an all-reduce
leaves its links idle.

A process started in a host's namespace sees that namespace in /proc/<pid>/net/dev, so one thread
here reads every host's `eth0` transmit counter (what tbf let onto the link) every `period_s`,
without entering any namespace.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def tx_bytes(pid: int, dev: str = "eth0") -> int:
    """Bytes `dev` of `pid`'s network namespace has transmitted."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
        name, counters = line.split(":", 1)
        if name.strip() == dev:
            return int(counters.split()[8])
    raise LookupError(f"no {dev} in process {pid}'s namespace")


class Uplinks:
    """Samples `pids`' uplinks (one process per host) from `start()` until `stop()`: `samples` is a
    list of (seconds since start, [bytes sent since start, per host])."""

    def __init__(self, pids: list[int], period_s: float = 0.1):
        self.pids, self.period_s = pids, period_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> Uplinks:
        self._base = [tx_bytes(p) for p in self.pids]
        self.started = time.time()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, list[int]]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                now = [tx_bytes(p) - b for p, b in zip(self.pids, self._base)]
            except (OSError, LookupError):  # a host's process ended: the run is over for it
                return
            self.samples.append((time.time() - self.started, now))


def busy_share(
    samples: list[tuple[float, list[int]]], host: int, rate_bps: float, window: tuple[float, float]
) -> float:
    """The share of `window` (seconds since start) in which `host`'s uplink carried at least 90 %
    of `rate_bps` (bytes/s), counted per sampling interval."""
    busy = total = 0.0
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if t0 < window[0] or t1 > window[1]:
            continue
        total += t1 - t0
        if (b[host] - a[host]) >= 0.9 * rate_bps * (t1 - t0):
            busy += t1 - t0
    return busy / total if total else 0.0


def used_share(
    samples: list[tuple[float, list[int]]], host: int, rate_bps: float, window: tuple[float, float]
) -> float:
    """The mean share of `rate_bps` (bytes/s) `host`'s uplink carried over the sampling intervals
    inside `window`."""
    inside = [
        (t1 - t0, b[host] - a[host]) for (t0, a), (t1, b) in zip(samples, samples[1:]) if window[0] < t1 <= window[1]
    ]
    seconds = window[1] - window[0]
    return sum(sent for _, sent in inside) / (rate_bps * seconds) if inside and seconds > 0 else 0.0


def timeline(samples: list[tuple[float, list[int]]]) -> dict:
    """The samples as kB sent per interval, per host, with each interval's end time."""
    steps = [[round((b - a) / 1e3) for a, b in zip(s0[1], s1[1])] for s0, s1 in zip(samples, samples[1:])]
    return {"t": [round(t, 2) for t, _ in samples[1:]], "per_host": steps}
