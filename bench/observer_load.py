"""Observer load: the DHT requests a run's nodes serve, without an observer and with one.

A bootstrap node and three peers (tiny preset, H = 20 fixed, NAT features off as everywhere on
127.0.0.1) train for ROUNDS rounds, once per condition: no observer, `p2p-diloco observe` at its
default poll interval (5 s), and at `--poll-s 1`; every condition twice, interleaved (A B C A B C).
Every process runs through bench/dht_count.py, which counts the DHT requests its node serves
(hivemind's `rpc_ping`, `rpc_store`, `rpc_find`) and the ones it sends. The observer starts before
the peers (its join is not measured) with `--eval-every 0` (its held-out loss downloads states
over the peers' state protocol, not DHT requests, and would only take CPU from the peers).

Measured, from the moment every peer finished round FROM to the moment every peer finished round
ROUNDS: the requests all nodes served, per second and per round, and the requests the observer
sent. The observer is a client node and serves nothing, so each request it sends is one that a
node of the swarm serves: its share is what it sent over what the swarm served for itself in the
same window (the swarm's own requests). The served rates are also compared between runs, (with -
without) / without against the mean of the runs without an observer: that difference is as noisy
as the runs are (about 10 % between two identical runs), so it only bounds the share. Also the
rounds of the window that the observer's log holds: a round shorter than its poll may be missed.

    python bench/observer_load.py              # about 6 minutes on 2 cores
    python bench/observer_load.py --repeats 4  # more runs per condition

Writes bench/results/observer_load.json and observer_load.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import lab
from lab import TINY_FIXED_H, LocalSwarm

HERE = Path(__file__).resolve().parent
COUNTER = HERE / "dht_count.py"
PEERS = ("a", "b", "c")
FROM, ROUNDS = 2, 8  # measured from the end of round FROM to the end of round ROUNDS (every peer)
CONFIG = {**TINY_FIXED_H, "run.run_id": "observer-load", "run.rounds": "1000", "run.eval_every_rounds": "0"}
CONDITIONS = [("no observer", None), ("observe, default poll (5 s)", 5.0), ("observe --poll-s 1", 1.0)]
REPEATS = 2
START_DEADLINE_S = 90.0
ROUNDS_DEADLINE_S = 300.0
SERVED = ("served_ping", "served_store", "served_find")
SENT = ("sent_ping", "sent_store", "sent_find")


def counts(folder: Path) -> dict[str, Counter]:
    """{command: cumulative counts} over every process that wrote its counts to `folder`."""
    out: dict[str, Counter] = {}
    for path in folder.glob("*.json"):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced meanwhile (writes are atomic: read it next time)
            continue
        out.setdefault(found["command"], Counter()).update(found["counts"])
    return out


def since(end: dict[str, Counter], start: dict[str, Counter]) -> dict[str, dict[str, int]]:
    return {command: dict(total - start.get(command, Counter())) for command, total in end.items()}


def start_observer(swarm: LocalSwarm, poll_s: float) -> str:
    """`p2p-diloco observe` through the counter, ended with the swarm (lab.close): its JSON API's URL
    once it serves."""
    out = swarm.folder / "observer.out"
    cmd = [sys.executable, str(COUNTER), "observe", "--config", str(swarm.run_toml), "--initial-peers", swarm.maddr]
    cmd += ["--port", "0", "--eval-every", "0", "--poll-s", str(poll_s)]
    with open(out, "w") as stdout, open(swarm.folder / "observer.log", "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=lab.ENV, start_new_session=True)
    swarm.procs["observer"] = proc
    swarm.groups.add(proc.pid)
    swarm.wait(lambda: "dashboard" in out.read_text() or proc.poll() is not None, START_DEADLINE_S, "observer up")
    if proc.poll() is not None:
        raise RuntimeError(f"the observer exited with {proc.returncode}; see {swarm.folder}/observer.log")
    return next(w for w in out.read_text().replace(",", " ").split() if w.endswith("api/v1/run"))


def rounds_seen(url: str) -> dict[str, list[int]]:
    """The rounds FROM + 1 .. ROUNDS - 1 (over by the window's end) that the observer's log holds,
    and those in which it counted peers: a round shorter than its poll interval may be missed."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        view = json.loads(answer.read())
    closed = range(FROM + 1, ROUNDS)
    held = [r for r in view["rounds"] if r["round"] in closed]
    return {"held": [r["round"] for r in held], "counted": [r["round"] for r in held if r["counted"]]}


def all_reached(swarm: LocalSwarm, round_: int) -> bool:
    for name in PEERS:
        if not swarm.running(name):
            raise RuntimeError(f"peer {name} exited with {swarm.procs[name].returncode}; see {swarm.folder}")
        if max(swarm.records(name), default=-1) < round_:
            return False
    return True


def run_once(folder: Path, poll_s: float | None) -> dict:
    """One swarm, measured from the end of round FROM to the end of round ROUNDS."""
    tally = folder / "counts"
    tally.mkdir(parents=True)
    # Every process lab.py starts runs through the counter: `p2p-diloco` with DHTProtocol counted.
    lab.CLI = [sys.executable, str(COUNTER)]
    lab.ENV = {**lab.ENV, "DHT_COUNTS_DIR": str(tally)}
    with LocalSwarm(folder, CONFIG) as swarm:
        url = start_observer(swarm, poll_s) if poll_s is not None else None
        for shard, name in enumerate(PEERS):
            swarm.start(name, {"data.shard": str(shard)})
        swarm.wait(lambda: all_reached(swarm, FROM), ROUNDS_DEADLINE_S, f"every peer at round {FROM}")
        start, t0 = counts(tally), time.monotonic()
        swarm.wait(lambda: all_reached(swarm, ROUNDS), ROUNDS_DEADLINE_S, f"every peer at round {ROUNDS}")
        end, t1 = counts(tally), time.monotonic()
        seen = rounds_seen(url) if url is not None else None
    return {**summary(since(end, start), t1 - t0, poll_s), "observer_rounds_seen": seen}


def summary(window: dict[str, dict[str, int]], seconds: float, poll_s: float | None) -> dict:
    """One run's window: the requests the swarm's nodes served, and the observer's share of them.
    The observer serves nothing (a client node): every request it sends is one a node serves."""
    served = Counter()
    for command in ("bootstrap", "peer"):
        served.update({k: v for k, v in window.get(command, {}).items() if k in SERVED})
    observer = window.get("observe", {})
    sent = sum(observer.get(k, 0) for k in SENT)
    total = sum(served.values())
    return {
        "poll_s": poll_s,
        "seconds": round(seconds, 2),
        "rounds": ROUNDS - FROM,
        "served": dict(served),
        "served_per_s": round(total / seconds, 2),
        "served_per_round": round(total / (ROUNDS - FROM), 1),
        "sent_by_all_per_s": round(sum(w.get(k, 0) for w in window.values() for k in SENT) / seconds, 2),
        "by_node": {c: {k: v for k, v in w.items() if k in SERVED + SENT} for c, w in window.items()},
        "observer_sent": {k: v for k, v in observer.items() if k.startswith("sent")},
        "observer_sent_per_s": round(sent / seconds, 2),
        # what the observer adds to the requests the swarm served for itself in the same window
        "observer_added_share": round(sent / (total - sent), 4) if total > sent else None,
    }


def shares(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per condition: the observer's requests over the swarm's own (each run), and the served rate
    against the mean of the runs without an observer (the difference method: as noisy as the runs)."""
    base = statistics.mean(r["served_per_s"] for r in runs[CONDITIONS[0][0]])
    out = {}
    for name, _ in CONDITIONS:
        rates = [r["served_per_s"] for r in runs[name]]
        out[name] = {
            "served_per_s": rates,
            "served_per_round": [r["served_per_round"] for r in runs[name]],
            "spread_between_repeats": round((max(rates) - min(rates)) / statistics.mean(rates), 4),
            "difference_share": round((statistics.mean(rates) - base) / base, 4),
            "observer_sent_per_s": [r["observer_sent_per_s"] for r in runs[name]],
            "observer_added_share": [r["observer_added_share"] for r in runs[name]],
            "observer_rounds_held": [len(r["observer_rounds_seen"]["held"]) for r in runs[name] if r["poll_s"]],
            "closed_rounds": ROUNDS - FROM - 1,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs per condition (default: %(default)s)")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name, _ in CONDITIONS}
    for repeat in range(args.repeats):
        for name, poll_s in CONDITIONS:
            with tempfile.TemporaryDirectory() as folder:
                result = run_once(Path(folder), poll_s)
            runs[name].append(result)
            print(f"{name} (#{repeat + 1}):", json.dumps({k: v for k, v in result.items() if k != "by_node"}))
    results = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "peers": len(PEERS),
        "window_rounds": [FROM, ROUNDS],
        "summary": shares(runs),
        "runs": runs,
    }
    (HERE / "results" / "observer_load.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["summary"], indent=1))
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(f"{name} #{i + 1}", r) for name, rs in results["runs"].items() for i, r in enumerate(rs)]
    labels = [label for label, _ in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    done = [0.0] * len(runs)
    for kind in SERVED:
        widths = [r["served"].get(kind, 0) / r["seconds"] for _, r in runs]
        left.barh(labels, widths, left=done, label=kind.replace("served_", "rpc_"))
        done = [x + w for x, w in zip(done, widths)]
    left.set_xlabel("DHT requests served per second (bootstrap node + 3 peers)")
    left.legend(fontsize=7, loc="lower right")
    right.barh(labels, [100 * (r["observer_added_share"] or 0) for _, r in runs], color="tab:purple")
    right.axvline(5, color="k", linestyle="--", linewidth=1, label="the 5 % target")
    right.set_xlabel("the observer's requests, % of the swarm's own in the same window")
    right.legend(fontsize=7, loc="lower right")
    left.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "observer_load.png", dpi=110)


if __name__ == "__main__":
    main()
