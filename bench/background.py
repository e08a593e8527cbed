"""What a peer's link carries besides pseudo-gradients, against the number of peers.

N real peers (`p2p-diloco peer`, the tiny preset) and a bootstrap node, each on a NetLab host with
an unlimited link, start one long inner phase (H = 100,000: no all-reduce, no state download runs
in the window). Once every peer has joined and SETTLE_S passed, each host's veth counters are read,
and again WINDOW_S later: what crossed meanwhile is the swarm's background (the DHT's heartbeats,
progress reports and records, entry-node pings), per peer and second, up and down.

    .venv/bin/python bench/background.py --peers 2 4 8     # as root; about 5 minutes on 2 cores

Writes bench/results/background.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco.protocol import deadlines

from netlab import NetLab, available
from netswarm import NetSwarm

HERE = Path(__file__).resolve().parent
SETTLE_S = 20.0  # after the last peer joined: its first reads and stores are not the steady rate
WINDOW_S = 30.0
JOIN_TIMEOUT_S = 240.0


def overrides() -> dict[str, str]:
    return {
        "run.run_id": "background",
        "run.rounds": "1",
        "run.eval_every_rounds": "0",
        "model.preset": "tiny",
        "model.seq_len": "32",
        "data.num_shards": "16",
        "inner.steps": "100000",
        "inner.batch_size": "4",
        "inner.micro_batch_size": "4",
        "swarm.speed_aware": "false",
    }


def measure(n: int, folder: Path) -> dict:
    with NetLab([(None, None)] * (n + 1)) as lab:
        swarm = NetSwarm(lab, folder, overrides(), bootstrap_host=n)
        procs = [swarm._start(host) for host in range(n)]
        logs = [folder / f"peer{host}.log" for host in range(n)]

        def joined() -> bool:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a peer exited before all joined; see {folder}")
            return all(log.exists() and "joined the swarm" in log.read_text() for log in logs)

        if not deadlines.poll_until(joined, bool, time.monotonic() + JOIN_TIMEOUT_S, 0.5):
            raise RuntimeError(f"not every peer joined within {JOIN_TIMEOUT_S:g} s; see {folder}")
        time.sleep(SETTLE_S)  # the measurement's own timing, not a synchronisation
        before = [lab.link_bytes(host) for host in range(n + 1)]
        started = time.monotonic()
        time.sleep(WINDOW_S)  # the measurement window
        after = [lab.link_bytes(host) for host in range(n + 1)]
        seconds = time.monotonic() - started
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a peer exited during the window; see {folder}")
    rates = [((a[0] - b[0]) / seconds, (a[1] - b[1]) / seconds) for a, b in zip(after, before)]
    peers = rates[:n]
    return {
        "peers": n,
        "window_s": seconds,
        "up_bytes_per_s": [round(up) for up, _ in peers],
        "down_bytes_per_s": [round(down) for _, down in peers],
        "median_up_bytes_per_s": statistics.median(up for up, _ in peers),
        "median_down_bytes_per_s": statistics.median(down for _, down in peers),
        "bootstrap_up_down_bytes_per_s": [round(rates[n][0]), round(rates[n][1])],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="background-") as tmp:
        for n in args.peers:
            result = measure(n, Path(tmp) / f"n{n}")
            results.append(result)
            up, down = result["median_up_bytes_per_s"], result["median_down_bytes_per_s"]
            print(f"{n} peers: {up / 1e3:.1f} KB/s up, {down / 1e3:.1f} KB/s down per peer (median)", flush=True)
    out = HERE / "results" / "background.json"
    out.write_text(json.dumps({"window_s": WINDOW_S, "settle_s": SETTLE_S, "runs": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
