"""`python bench/fork_stress.py [--starts N]`: many DHT starts from a parent whose threads are busy.

hivemind forks its DHT and averager processes from a parent that has threads: hivemind's own
MPFuture backend (it unpickles every answer of a child), torch's op threads, the peer's prefetcher
and heartbeat. This parent runs four such threads the whole time:
- `garbage`: makes reference cycles whose finalizer closes a pipe (as a dropped hivemind handle or
  multiprocessing Connection does), so that collections of the cycle GC, with finalizers that
  release the GIL, run in that thread again and again;
- `torch`: small matmuls and tensor allocations (torch releases the GIL inside each op);
- `dht-reader`: reads a long-lived DHT node in a loop (its answers arrive on the MPFuture backend
  thread, which unpickles them);
- `logger`: debug records through a handler (frames materialised by findCaller).

Then it starts `--starts` DHT nodes one after another, each way (`--modes`):
- `hivemind`: hivemind's own fork (`DHT.start`) at whatever moment the threads are in;
- `ours`: `node.start_dht`, which forks inside processes.quiet_fork.
Each child is asked whether its cycle GC still collects (a fork during another thread's collection
leaves the child with "a collection is in progress" for life: it never collects again), then
stopped. A child that died, or did not start within the deadline, is counted, never waited on.

Results: bench/results/fork_stress.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import hivemind
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p_diloco import config  # noqa: E402
from p2p_diloco.errors import SwarmError  # noqa: E402
from p2p_diloco.swarm.transport.node import start_dht  # noqa: E402
from p2p_diloco.swarm.transport.processes import stop_process, wait_result, wait_started  # noqa: E402

OUT = Path(__file__).parent / "results" / "fork_stress.json"
START_TIMEOUT_S = 30.0
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
GC_THRESHOLD = 100  # allocations between collections of the youngest generation (Python's default: 700)


class Finalized:
    """One object of a reference cycle whose finalizer closes a pipe: the GIL is released inside
    a collection of the cycle GC, and another thread may fork then."""

    def __init__(self) -> None:
        self.me = self
        self.fds = os.pipe()

    def __del__(self) -> None:
        for fd in self.fds:
            os.close(fd)


def garbage(stop: threading.Event) -> None:
    """Cycles only: the collections are the automatic ones (GC_THRESHOLD), as in a peer, where
    nothing calls gc.collect() (quiet_fork pauses automatic collections, not explicit ones)."""
    while not stop.is_set():
        for _ in range(50):
            Finalized()


def torch_ops(stop: threading.Event) -> None:
    a = torch.randn(64, 64)
    while not stop.is_set():
        a = torch.tanh(a @ torch.randn(64, 64)) + torch.zeros(64, 64)


def dht_reader(stop: threading.Event, node: hivemind.DHT) -> None:
    while not stop.is_set():
        node.get("fork-stress", latest=True)


def logger_thread(stop: threading.Event) -> None:
    log = logging.getLogger("fork-stress")
    while not stop.is_set():
        log.debug("a record with %s", [object() for _ in range(10)])


async def _gc_collects(_dht: object, _node: object) -> bool:
    """In the DHT process: does its cycle GC still collect a cycle?"""
    cycle: list = []
    cycle.append(cycle)
    del cycle
    return gc.collect() > 0


def start_hivemind(_cfg: config.Config, _folder: Path) -> hivemind.DHT:
    dht = hivemind.DHT(host_maddrs=LOOPBACK, start=False)
    dht.start()  # hivemind's own fork, at whatever moment the other threads are in
    wait_started(dht, "DHT process", START_TIMEOUT_S)
    return dht


def start_ours(cfg: config.Config, folder: Path) -> hivemind.DHT:
    return start_dht(cfg.swarm, None, [], "public")


def one_start(start: object, cfg: config.Config, folder: Path) -> str:
    """'ok', 'gc_stuck' (the child's GC never collects), 'died' or 'start_failed'."""
    try:
        dht = start(cfg, folder)  # type: ignore[operator]
    except SwarmError as e:
        return "died" if "died" in str(e) else "start_failed"
    try:
        future = dht.run_coroutine(_gc_collects, return_future=True)
        collects = wait_result(dht, future, "DHT process", START_TIMEOUT_S)
        return "ok" if collects else "gc_stuck"
    except SwarmError:
        return "died"
    finally:
        stop_process(dht, "DHT process")


def run_mode(mode: str, starts: int, cfg: config.Config, folder: Path) -> dict:
    start = {"hivemind": start_hivemind, "ours": start_ours}[mode]
    counts = {"ok": 0, "gc_stuck": 0, "died": 0, "start_failed": 0}
    began = time.perf_counter()
    for i in range(starts):
        counts[one_start(start, cfg, folder)] += 1
        print(f"{mode} {i + 1}/{starts}: {counts}", flush=True)
    return {"starts": starts, **counts, "seconds": round(time.perf_counter() - began, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=40, help="DHT starts per mode")
    parser.add_argument("--modes", default="hivemind,ours")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(2)
    gc.set_threshold(GC_THRESHOLD)
    cfg = config.load(None, {"swarm.host": "127.0.0.1", "swarm.join_timeout_s": str(START_TIMEOUT_S)})
    stop = threading.Event()
    node = hivemind.DHT(host_maddrs=LOOPBACK, start=True)
    busy: list[tuple[Callable[..., None], tuple]] = [
        (garbage, ()),
        (torch_ops, ()),
        (dht_reader, (node,)),
        (logger_thread, ()),
    ]
    threads = [threading.Thread(target=f, args=(stop, *a), name=f.__name__, daemon=True) for f, a in busy]
    results = {}
    try:
        for t in threads:
            t.start()
        with tempfile.TemporaryDirectory() as folder:
            for mode in args.modes.split(","):
                results[mode] = run_mode(mode, args.starts, cfg, Path(folder))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        stop_process(node, "DHT process")
    report = {
        "what": "DHT starts from a parent with busy threads (bench/fork_stress.py)",
        "busy_threads": [f.__name__ for f, _ in busy],
        "python": platform.python_version(),
        "hivemind": hivemind.__version__,
        "cpus": os.cpu_count(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
