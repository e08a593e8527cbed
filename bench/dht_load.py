"""What the run's records cost the DHT, per key: N DHT-only nodes running the real heartbeat.

N processes on 127.0.0.1, each a hivemind DHT node with the peer's signing validator, a `RunDHT`
and the real `Heartbeat` of an open run: each publishes a round record, and reports progress at
a steady rate, as a peer in its inner phase does (no model, no averager: only the records). In
each node's forked DHT process, the handlers other nodes call (`rpc_find`, `rpc_store`) count
what they answer and receive, per record key: a find's answer splits into the value (every
peer's entry under the key) and the rest (the node's nearest neighbours). After SETTLE_S, the
counts over WINDOW_S are the steady state, per peer and second; `max_served_*` is the busiest
node's (the ones nearest to a key answer every read of it).

    .venv/bin/python bench/dht_load.py --nodes 8            # about 1.5 minutes on 2 cores
    .venv/bin/python bench/dht_load.py --nodes 16 32 --out dht_load_scale   # about 6 minutes
    .venv/bin/python bench/dht_load.py --nodes 16 32 --bucket-size 8 --out dht_load_buckets

`--bucket-size S`: the records by bucket, as the two-level round lays them out (docs/design.md
§3, "Records by bucket"): the nodes are cut into G = round(N / S) buckets (node i in bucket i mod G:
the balanced buckets `twolevel.merge` aims at), and each node's heartbeat publishes and reads the
round and progress records under its bucket's keys only (`records.bucket_prefix`), so that a key
holds at most about S entries. Without it (0): one key of each kind for the whole run, as today.

Writes bench/results/dht_load.json (or --out NAME).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from hivemind.dht.protocol import DHTProtocol, P2PContext, dht_pb2  # counted in each node's DHT process

HERE = Path(__file__).resolve().parent
SETTLE_S, WINDOW_S, START_TIMEOUT_S, END_GRACE_S = 20.0, 30.0, 120.0, 15.0
RATE = 1000.0  # tokens/s each node reports
ROUND = 3  # the round every node is in (its records and, by bucket, their keys)


def count_per_key(folder: Path, index: int, names: dict[bytes, str]) -> None:
    """Patch hivemind's DHT handlers, before the DHT process forks, to count bytes per key."""
    counts: Counter[str] = Counter()
    find, store = DHTProtocol.rpc_find, DHTProtocol.rpc_store

    async def rpc_find(self, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
        response = await find(self, request, context)
        for key, result in zip(request.keys, response.results):
            name = names.get(key, "other")
            counts[f"find_calls:{name}"] += 1
            counts[f"find_value_bytes:{name}"] += len(result.value)
            counts[f"find_nodes_bytes:{name}"] += result.ByteSize() - len(result.value)
        counts["find_request_bytes"] += request.ByteSize()
        _flush(counts, folder / f"counts{index}.json")
        return response

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        name = names.get(request.keys[0], "other") if request.keys else "other"
        counts[f"store_calls:{name}"] += len(request.keys)
        counts[f"store_bytes:{name}"] += request.ByteSize()
        _flush(counts, folder / f"counts{index}.json")
        return await store(self, request, context)

    DHTProtocol.rpc_find, DHTProtocol.rpc_store = rpc_find, rpc_store


_flushed = [0.0]
_flush_lock = threading.Lock()


def _flush(counts: Counter[str], path: Path) -> None:
    """Write the cumulative counts at most every half second, atomically."""
    with _flush_lock:
        if time.monotonic() - _flushed[0] < 0.5:
            return
        _flushed[0] = time.monotonic()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"time": time.time(), "counts": dict(counts)}))
        os.replace(tmp, path)


def node(index: int, folder: Path, initial: str, buckets: int) -> None:
    """One DHT-only node: the real heartbeat of an open run, progress at a steady rate, until killed;
    with `buckets` > 1, under the keys of its bucket (index mod buckets)."""
    import hivemind
    from hivemind.dht.routing import DHTID

    from p2p_diloco.config import Config
    from p2p_diloco.protocol.network import RoundRecord
    from p2p_diloco.swarm.heartbeat import Entries, Heartbeat
    from p2p_diloco.swarm.transport.identity import make_validator
    from p2p_diloco.swarm.trust import records
    from p2p_diloco.swarm.trust.gate import Gate
    from p2p_diloco.swarm.trust.run_dht import RunDHT

    config, identity = Config(), folder / f"id{index}.key"
    run = records.run_prefix(config.run.run_id, config.fingerprint())
    prefixes = [records.bucket_prefix(run, ROUND, b, buckets) for b in range(buckets)]
    keys = [(key(p), key.__name__) for key in (records.progress_key, records.rounds_key) for p in prefixes]
    names = {DHTID.generate(source=k).to_bytes(): name for k, name in keys}
    prefix = prefixes[index % buckets]
    count_per_key(folder, index, names)
    validator = make_validator(identity)
    dht = hivemind.DHT(
        initial_peers=[initial] if initial else None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity),
        record_validators=[validator],
        start=True,
    )
    if not initial:
        (folder / "addr.tmp").write_text(str(dht.get_visible_maddrs()[0]))
        os.replace(folder / "addr.tmp", folder / "addr")
    (folder / f"counts{index}.json").write_text(json.dumps({"time": time.time(), "counts": {}}))  # ready
    run_dht = RunDHT(dht, validator, prefix)
    heartbeat = Heartbeat(run_dht, run_dht.peer_id, Gate(config, run_dht.peer_id), Entries(dht))
    addrs = tuple(str(m) for m in dht.get_visible_maddrs())
    record = RoundRecord(run_dht.peer_id, ROUND, "ab" * 32, 100_000, 3.5, addrs, serves=True)
    run_dht.publish_round(record)
    heartbeat.published(record)
    heartbeat.start()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the end: shut the DHT down, p2pd's files with it
    try:
        while True:  # an inner phase at a steady rate: what the heartbeat sees between rounds
            time.sleep(0.5)  # the pace of the reports, as a trainer's steps
            heartbeat.report_progress(ROUND, int(RATE * (time.monotonic() - started)), RATE)
    finally:
        dht.shutdown()


def snapshot(folder: Path, n: int) -> list[dict[str, int]]:
    return [json.loads((folder / f"counts{i}.json").read_text())["counts"] for i in range(n)]


def wait_started(proc: subprocess.Popen, ready: Path, what: str) -> None:
    """Wait until a node wrote `ready` (its DHT is up), at most START_TIMEOUT_S; RuntimeError if it
    exited or did not."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not start (its output is above)")
        time.sleep(0.2)  # polling for a file, with a deadline


def bucket_count(n: int, bucket_size: int) -> int:
    """G: the buckets of n nodes (1: one key for the run)."""
    return max(1, round(n / bucket_size)) if bucket_size > 0 else 1


def measure(n: int, folder: Path, buckets: int = 1) -> dict:
    """Nodes started one after another (all at once, some of 16 on 2 cores failed to reach the first
    node within p2pd's bootstrap timeout), then the window."""
    cmd = [sys.executable, __file__, "--buckets", str(buckets), "--node"]
    procs = [subprocess.Popen([*cmd, "0", str(folder), ""], start_new_session=True)]
    try:
        wait_started(procs[0], folder / "addr", "the first node")
        addr = (folder / "addr").read_text()
        for i in range(1, n):
            procs.append(subprocess.Popen([*cmd, str(i), str(folder), addr], start_new_session=True))
            wait_started(procs[-1], folder / f"counts{i}.json", f"node {i}")
        time.sleep(SETTLE_S)  # the measurement's own timing: the nodes' starts are not the steady rate
        before = snapshot(folder, n)
        started = time.monotonic()
        time.sleep(WINDOW_S)  # the measurement window
        after, seconds = snapshot(folder, n), time.monotonic() - started
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a node exited during the window; see {folder}")
    finally:
        end(procs)
    return {**summarise(n, before, after, seconds), "buckets": buckets, "entries_per_key": math.ceil(n / buckets)}


def end(procs: list[subprocess.Popen]) -> None:
    """Each node's process group: SIGTERM (its DHT shuts down and p2pd removes its socket; a
    SIGKILL left 49 temporary folders and sockets in /tmp), SIGKILL after END_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)  # our own process groups, each a node and its children
            except ProcessLookupError:  # a node that failed to start, and its group, are gone
                pass
        deadline = time.monotonic() + END_GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
        if all(p.poll() is not None for p in procs):
            return


def summarise(n: int, before: list[dict[str, int]], after: list[dict[str, int]], seconds: float) -> dict:
    deltas = [{k: a[k] - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    names = sorted({k for d in deltas for k in d})
    per_peer = {k: round(sum(d.get(k, 0) for d in deltas) / n / seconds, 1) for k in names}
    served = [sum(v for k, v in d.items() if k.startswith(("find_value", "find_nodes"))) / seconds for d in deltas]
    return {
        "nodes": n,
        "window_s": round(seconds, 2),
        "per_peer_per_s": per_peer,
        "find_answer_bytes_per_peer_per_s": round(sum(served) / n),
        "max_served_find_bytes_per_s": round(max(served)),
        "median_served_find_bytes_per_s": round(statistics.median(served)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8])
    parser.add_argument("--out", default="dht_load")
    parser.add_argument("--bucket-size", type=int, default=0, help="records by bucket of this many nodes (0: one key)")
    parser.add_argument("--buckets", type=int, default=1, help=argparse.SUPPRESS)  # a node's (internal)
    parser.add_argument("--node", nargs=3, help=argparse.SUPPRESS)  # a node of the measurement (internal)
    args = parser.parse_args()
    if args.node:
        node(int(args.node[0]), Path(args.node[1]), args.node[2], args.buckets)
        return 0
    results = []
    for n in args.nodes:
        with tempfile.TemporaryDirectory(prefix="dht-load-") as tmp:
            result = measure(n, Path(tmp), bucket_count(n, args.bucket_size))
        results.append(result)
        print(
            f"{n} nodes in {result['buckets']} bucket(s): "
            f"{result['find_answer_bytes_per_peer_per_s'] / 1e3:.1f} KB/s of find answers per peer, "
            f"the busiest node {result['max_served_find_bytes_per_s'] / 1e3:.1f} KB/s"
        )
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps({"settle_s": SETTLE_S, "window_s": WINDOW_S, "runs": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
