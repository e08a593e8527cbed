"""Past one group in real processes: N `p2p-diloco peer` processes (the tiny preset) on NetLab hosts
of their own, each behind a link of MBIT Mbit/s both ways, train ROUNDS rounds three times in one
invocation:

- **flat**: swarm.group_size above N: every round one group of N, as before two levels;
- **two levels**: swarm.group_size S: each round's peers average in groups of their bucket, then
  across groups (docs/design.md §3, "Past one group");
- **faults** (two levels): one peer is SIGKILLed in its third all-reduce at its first part (a stage-1
  member mid-transfer), another at its second stage-2 push (a span owner, a replica of other
  groups' partials, mid-stage 2): tests/swarm/faulty_peer.py's `allreduce:3:KILL` and `stage2:2:KILL`.

Reported per run: exit codes, whether every peer that recorded a round holds the same digest of
it, per round the groups the results counted and the stage-1 group sizes, each peer's median bytes
per round (the all-reduce's payload, stages 2 and 3 apart, and everything its veth carried), the
median round and all-reduce times, and the all-reduces that failed.

    .venv/bin/python bench/two_level.py --peers 8 --group-size 4    # as root; about 8 minutes on 2 cores
    .venv/bin/python bench/two_level.py --peers 9 --group-size 3 --homes 2 --out two_level_9

`--homes K`: the last K peers each behind a home router's NAT (homenet.py's `Home("cone")`, the
same link): clients, which seal their group's layout and fetch their spans but own none.

Writes bench/results/two_level.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

from p2p_diloco.swarm.transport import leftovers

from homenet import Home, HomeNet, lab_available
from netlab import NetLab
from netswarm import NetSwarm

HERE = Path(__file__).resolve().parent


def overrides(args: argparse.Namespace, group_size: int) -> dict[str, str]:
    return {
        "run.run_id": "two-level",
        "run.rounds": str(args.rounds),
        "run.eval_every_rounds": "0",
        "model.preset": "tiny",
        "model.seq_len": "32",
        "data.num_shards": "16",
        "inner.steps": "10",
        "inner.batch_size": "8",
        "inner.micro_batch_size": "8",
        "inner.precision": "fp32",
        "swarm.speed_aware": "false",
        "swarm.group_size": str(group_size),
        "swarm.matchmaking_time_s": "6",
        "swarm.averaging_timeout_s": "60",
        "swarm.agreement_timeout_s": "30",
        "swarm.join_timeout_s": "60",
    }


def lab_of(args: argparse.Namespace) -> tuple[NetLab, list[int], int]:
    """The lab, its peers' hosts and the bootstrap node's: the public peers, the bootstrap node
    (no limit), then the peers behind home routers."""
    public = args.peers - args.homes
    if not args.homes:
        return NetLab([(args.mbit, args.mbit)] * public + [(None, None)], cc="cubic"), list(range(public)), public
    homes = [Home("cone", up=args.mbit, down=args.mbit)] * args.homes
    lab = HomeNet(public + 1, homes, (args.mbit, args.mbit), cc="cubic")
    return lab, [*range(public), *(lab.home_host(j) for j in range(args.homes))], public


def run(args: argparse.Namespace, group_size: int, faults: dict[int, str], folder: Path) -> dict:
    built, hosts, bootstrap = lab_of(args)
    with built as lab:
        swarm = NetSwarm(lab, folder, overrides(args, group_size), bootstrap_host=bootstrap)
        swarm.faults = faults
        wall = swarm.run_peers(hosts, timeout_s=300 + 60 * args.rounds)
        veth = {host: sum(lab.link_bytes(host)) for host in hosts}
        records = {host: swarm.records(host) for host in hosts}
        logs = {host: (folder / f"peer{host}.log").read_text(errors="replace") for host in hosts}
    leftovers.sweep_below(folder)  # the shared memory the lab's peers left (leftovers.py)
    return summary(records, veth, logs, swarm.codes, wall) | {"group_size": group_size, "faults": faults}


def summary(records: dict, veth: dict, logs: dict, codes: dict, wall_s: float) -> dict:
    """What the peers' own files and links say of one run."""
    rounds = sorted({r for recs in records.values() for r in recs if r > 0})
    digests = {r: {recs[r]["digest"] for recs in records.values() if r in recs} for r in rounds}

    def per_round(field: str) -> dict[int, dict]:
        return {r: dict(Counter(recs[r].get(field, 1) for recs in records.values() if r in recs)) for r in rounds}

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    # a round a peer adopted from the others ends with a record of its own, of no all-reduce
    trained = {
        host: [recs[r] for r in rounds if r in recs and "bytes_sent" in recs[r]] for host, recs in records.items()
    }
    payload = [rec["bytes_sent"] + rec["bytes_received"] for recs in trained.values() for rec in recs]
    across = [sum(rec.get("across_bytes", [0, 0])) for recs in trained.values() for rec in recs]
    return {
        "exit_codes": {str(h): c for h, c in codes.items()},
        "rounds_recorded": len(rounds),
        "rounds_with_one_digest": sum(len(digests[r]) == 1 for r in rounds),
        "groups_by_round": per_round("groups"),
        "group_sizes_by_round": per_round("group_size"),
        "median_payload_bytes_per_round": median(payload),
        "median_across_bytes_per_round": median(across),
        "veth_bytes_per_peer_round": {str(h): round(veth[h] / max(1, len(trained[h]))) for h in veth},
        "median_round_s": median([rec["wall_s"] for recs in trained.values() for rec in recs if "wall_s" in rec]),
        "median_allreduce_s": median([rec["allreduce_s"] for recs in trained.values() for rec in recs]),
        "median_across_s": median([rec["across_s"] for recs in trained.values() for rec in recs if "across_s" in rec]),
        "failed_allreduce_lines": sum(log.count("all-reduce failed") for log in logs.values()),
        "wall_s": round(wall_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="S: swarm.group_size of the two-level runs")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--mbit", type=float, default=50.0, help="each peer's link, both ways")
    parser.add_argument("--runs", nargs="+", default=["flat", "two-level", "faults"])
    parser.add_argument("--out", default="two_level")
    parser.add_argument("--keep", type=Path, help="keep each run's logs and run dirs under this folder")
    parser.add_argument("--homes", type=int, default=0, help="K: the last K peers behind home routers' NAT")
    args = parser.parse_args()
    if (why := lab_available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    settings = {
        "flat": (1024, {}),
        "two-level": (args.group_size, {}),
        "faults": (args.group_size, {0: "allreduce:3:KILL", 1: "stage2:2:KILL"}),
    }
    results = {}
    for name in args.runs:
        size, faults = settings[name]
        with tempfile.TemporaryDirectory(prefix="two-level-") as tmp:
            results[name] = run(args, size, faults, args.keep / name if args.keep else Path(tmp))
        print(name, json.dumps(results[name]), flush=True)
    out = HERE / "results" / f"{args.out}.json"
    setting = {"peers": args.peers, "group_size": args.group_size, "rounds": args.rounds, "mbit": args.mbit}
    setting["homes"] = args.homes
    out.write_text(
        json.dumps({"setting": setting, "config": overrides(args, args.group_size), "runs": results}, indent=1) + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
