"""`p2p-diloco observe` and `p2p-diloco status`: a run's view, served or printed.

`Observatory` keeps a `RunLog` (observatory.py) fed by polls of the run's DHT records and serves it
(web.py). The caller drives the polls: the `observe` command in its own loop, a bootstrap node
with `--observe-port` in its status loop (one thread uses the DHT handle). `status` polls for a
few seconds and prints the swarm at a glance, and one peer's rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from p2p_diloco.config import Config
from p2p_diloco.observatory import RunLog, short
from p2p_diloco.web import ObserverServer

Poll = tuple[dict, list, dict]


class Observatory:
    """A run's log and the HTTP server that shows it."""

    reader: Any = None  # what feeds it, for a caller that keeps the two together (a bootstrap node)

    def __init__(self, config: Config, healthy: Callable[[], tuple[bool, str]], host: str, port: int):
        self.log = RunLog(config.run.run_id, config.fingerprint(), config.run.rounds)
        self._lock = threading.Lock()  # polls write the log; the server's threads read it
        self.server = ObserverServer(self.view, healthy, host, port)

    def ingest(self, poll: Poll) -> None:
        with self._lock:
            self.log.ingest(*poll, now=time.time())

    def view(self) -> dict[str, Any]:
        with self._lock:
            return self.log.view(time.time())

    def close(self) -> None:
        self.server.close()


def observe(
    config: Config,
    poll: Callable[[], Poll],
    healthy: Callable[[], tuple[bool, str]],
    host: str,
    port: int,
    stop: threading.Event,
    emit: Callable[[str], None],
    poll_s: float = 1.0,
) -> None:
    """Serve the run's view until `stop` is set, polling the DHT every `poll_s` seconds."""
    observatory = Observatory(config, healthy, host, port)
    emit(
        f"observer of run {config.run.run_id!r}: dashboard {observatory.server.url}, "
        f"JSON {observatory.server.url}api/v1/run, Prometheus {observatory.server.url}metrics"
    )
    try:
        while True:
            observatory.ingest(poll())
            if stop.wait(poll_s):
                return
    finally:
        observatory.close()


def gather(config: Config, poll: Callable[[], Poll], seconds: float, poll_s: float = 1.0) -> dict[str, Any]:
    """The run's view after polling for `seconds` (at least one poll)."""
    log = RunLog(config.run.run_id, config.fingerprint(), config.run.rounds)
    deadline = time.monotonic() + seconds
    while True:
        log.ingest(*poll(), now=time.time())
        if time.monotonic() >= deadline:
            return log.view(time.time())
        time.sleep(poll_s)  # a DHT poll interval, bounded by the deadline above


def status_lines(view: dict[str, Any], peer: str | None = None) -> list[str]:
    """The swarm at a glance, then (with `peer`) that peer's rounds: counted or not, and why."""
    run, rounds, peers = view["run"], view["rounds"], view["peers"]
    online = [p for p in peers if p["online"]]
    last = rounds[-1] if rounds else None
    lines = [
        f"run {run['run_id']!r} (config {run['fingerprint']}): round {run['round']} of {run['rounds_total']}"
        + (", finished" if run["finished"] else ""),
        f"peers online: {len(online)} ({sum(1 for p in online if p['reachable'] is False)} in client mode)",
    ]
    if last is not None:
        agree = "every peer agrees" if last["all_agree"] else "peers DISAGREE"
        loss = f", train loss {last['train_loss']:.4f}" if last["train_loss"] is not None else ""
        lines.append(
            f"round {last['round']}: digest {last['digest'][:12]}, {agree}, {len(last['counted'])} counted{loss}"
        )
    if peer is not None:
        lines += _peer_lines(view, peer)
    return lines


def _peer_lines(view: dict[str, Any], peer: str) -> list[str]:
    matches = [p["peer"] for p in view["peers"] if p["peer"] == peer or p["peer"].endswith(peer)]
    if not matches:
        return [f"peer {peer}: not seen in the run (is it running, with this run's config?)"]
    who = matches[0]
    credited = next((c["tokens"] for c in view["contributors"] if c["peer"] == who), 0)
    lines = [f"peer {short(who)}: {credited:,} tokens credited in the rounds seen"]
    for r in view["rounds"][-10:]:
        why = next((n["reason"] for n in r["not_counted"] if n["peer"] == who), None)
        if who in r["counted"]:
            lines.append(f"  round {r['round']}: counted")
        elif why is not None:
            lines.append(f"  round {r['round']}: not counted: {why}")
    return lines
