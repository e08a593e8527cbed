"""Past 8 peers in real processes: one flat group of N peers on this machine, as the swarm is today.

N real `p2p-diloco peer` processes (the tiny preset, H fixed) and a bootstrap node on 127.0.0.1
train ROUNDS rounds. Reported per N: whether every peer finished, the group sizes of each round
(from every peer's metrics.jsonl), whether every peer that recorded a round holds the same digest
of it, the median round's wall time and all-reduce time, and the all-reduces that failed (the
peers' WARN lines). Every peer shares this machine's 2 cores, so the round time is the CPU's, not
the network's: what this shows is whether one group of N forms, averages and agrees, not how fast
it would on N machines (docs/benchmarks.md, "Past 8 peers").

    .venv/bin/python bench/many_peers.py --peers 8 12 16    # about 15 minutes on 2 cores

Writes bench/results/many_peers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from lab import TINY_FIXED_H, LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 6
RUN = {
    **TINY_FIXED_H,
    "run.run_id": "many-peers",
    "run.rounds": str(ROUNDS),
    "run.eval_every_rounds": "0",
    "inner.steps": "10",
    "inner.batch_size": "8",
    "inner.micro_batch_size": "8",
    "swarm.matchmaking_time_s": "6",
    "swarm.averaging_timeout_s": "60",
    "swarm.agreement_timeout_s": "30",
    "swarm.join_timeout_s": "60",
}


def run(n: int, folder: Path) -> dict:
    names = [f"p{i:02d}" for i in range(n)]
    started = time.monotonic()
    with LocalSwarm(folder, RUN) as lab:
        for name in names:
            lab.start(name)
        lab.wait(lambda: all(not lab.running(p) for p in names), 300 + 60 * n, f"{n} peers finish")
        codes = {p: lab.procs[p].returncode for p in names}
    records = {p: lab.records(p) for p in names}
    return summary(n, codes, records, folder, time.monotonic() - started)


def summary(n: int, codes: dict, records: dict, folder: Path, wall_s: float) -> dict:
    """What the peers' own files say of the run."""
    rounds = sorted({r for recs in records.values() for r in recs if r > 0})
    sizes = {r: Counter(recs[r].get("group_size", 0) for recs in records.values() if r in recs) for r in rounds}
    # a peer whose group's digest lost agreement adopts the majority's state: its last line of the round
    adopted = {r: sum(bool(recs[r].get("adopted")) for recs in records.values() if r in recs) for r in rounds}
    digests = {r: {recs[r]["digest"] for recs in records.values() if r in recs} for r in rounds}
    walls = [rec["wall_s"] for recs in records.values() for rec in recs.values() if "wall_s" in rec]
    averaging = [rec["allreduce_s"] for recs in records.values() for rec in recs.values() if "allreduce_s" in rec]
    logs = [(folder / f"{p}.log").read_text(errors="replace") for p in codes]
    failed = sum(log.count("all-reduce failed") for log in logs)
    return {
        "peers": n,
        "exit_codes": dict(Counter(codes.values())),
        "rounds_recorded": len(rounds),
        "group_sizes_by_round": {r: dict(sizes[r]) for r in rounds},
        "adopted_by_round": {r: adopted[r] for r in rounds},
        "rounds_with_one_digest": sum(len(digests[r]) == 1 for r in rounds),
        "median_round_s": round(statistics.median(walls), 2) if walls else None,
        "median_allreduce_s": round(statistics.median(averaging), 2) if averaging else None,
        "failed_allreduce_lines": failed,
        "wall_s": round(wall_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 12, 16])
    parser.add_argument("--out", default="many_peers")
    parser.add_argument("--keep", type=Path, help="keep each run's logs and run dirs under this folder")
    args = parser.parse_args()
    results = []
    for n in args.peers:
        with tempfile.TemporaryDirectory(prefix="many-peers-") as tmp:
            result = run(n, args.keep / str(n) if args.keep else Path(tmp))
        results.append(result)
        print(json.dumps(result), flush=True)
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps({"rounds": ROUNDS, "config": RUN, "runs": results}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
