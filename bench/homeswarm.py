"""A training swarm in the home-network lab (homenet.py): a bootstrap node and a public peer on the
"internet", and volunteers behind home routers, every one a real `p2p-diloco` process.

    python bench/homeswarm.py [--homes cone,cone] [--rounds 10] [--set key=value ...]

A kind of home is cone, symmetric or double; `+upnp` gives its router UPnP (miniupnpd), e.g.
`--homes cone+upnp,symmetric --set swarm.upnp=true`; `+drop` a router that drops what nobody asked
for. Hole punching between homes, with four entry nodes as relays and no public peer:
`--homes cone+drop,cone+drop --entry-nodes 4 --no-public-peer --set swarm.hole_punching=true`;
`--late 2@3` starts home 2's peer once the first peer recorded round 3 (a late joiner).

Reports, per peer and round, the size of the group its round was averaged in, how many all-reduce
attempts failed (and what the log said), whether every peer holds the same digest every round, and
the time. Writes bench/results/homeswarm.json (one entry per scenario, keyed by its homes and settings).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import tempfile
import threading
import time
from pathlib import Path

if __package__:  # imported as bench.homeswarm (the tests)
    from .homenet import Home, HomeNet
    from .netswarm import NetSwarm
else:  # run as a script, bench/ on sys.path
    from homenet import Home, HomeNet
    from netswarm import NetSwarm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "homeswarm.json"
TINY = {
    "model.preset": "tiny",
    "model.seq_len": "64",
    "inner.steps": "10",
    "inner.batch_size": "8",
    "inner.micro_batch_size": "8",
    "run.eval_every_rounds": "0",
}
FAILED_TRY = re.compile(r"attempt \d of \d\)?; retrying|all-reduce failed|a sender was dropped")


def run(
    homes: list[Home],
    rounds: int,
    settings: dict[str, str],
    folder: Path,
    restart: tuple[int, int] | None,
    entry_nodes: int = 1,
    public_peer: bool = True,
    late: tuple[int, int] | None = None,
) -> dict:
    """One scenario: returns what each peer's records and log say. `restart`: (home, round): that
    home's router restarts (HomeNet.restart_router) once its peer recorded the round. `entry_nodes`
    bootstrap nodes on the internet (hosts 0 …), then a public peer unless not `public_peer`.
    `late`: (home, round): that home's peer starts once the first peer recorded the round."""
    overrides = {**TINY, "run.rounds": str(rounds), "run.run_id": "homeswarm", **settings}
    with HomeNet(public=entry_nodes + public_peer, homes=homes) as net:
        swarm = NetSwarm(net, folder, overrides, 0, tuple(range(1, entry_nodes)))
        peers = [entry_nodes] * public_peer + [net.home_host(j) for j in range(len(homes))]
        restarted: list[float] = []
        if restart is not None:
            threading.Thread(target=_restart_at, args=(net, swarm, *restart, restarted), daemon=True).start()
        later = {}
        if late is not None:
            first = peers[0]
            later = {net.home_host(late[0]): lambda: late[1] in _records_so_far(swarm.peer_dir(first))}
        wall_s = swarm.run_peers(peers, timeout_s=60 * rounds + 300, late=later)
        flows = {f"home{j}-{_kind(h)}": _by_whom(net, net.flows(j), entry_nodes) for j, h in enumerate(homes)}
        relayed = {f"entry{h}": swarm.relayed(h) for h in range(entry_nodes)}
        records = {host: swarm.records(host) for host in peers}
        logs = {host: (folder / f"peer{host}.log").read_text() for host in peers}
    names = {entry_nodes: "public", **{net.home_host(j): f"home{j}-{_kind(h)}" for j, h in enumerate(homes)}}
    held = lambda h, r: records[h].get(r, {})  # noqa: E731  (a late peer holds no early round)
    digests = [{records[h][r]["digest"] for h in peers if r in records[h]} for r in range(1, rounds + 1)]
    digests_agree = all(len(found) == 1 for found in digests)
    allreduce = sum(r.get("bytes_sent", 0) + r.get("bytes_received", 0) for h in peers for r in records[h].values())
    sent = sum(r.get("bytes_sent", 0) for h in peers for r in records[h].values())
    relayed_bytes = sum(r["bytes"] for r in relayed.values())
    return {
        "wall_s": round(wall_s, 1),
        "router_restarted": {"home": restart[0], "after_round": restart[1]} if restarted else None,
        "digests_agree": digests_agree,
        # What each home's router carried, by whom (connection tracking): to the other homes (a
        # punched connection), the public peer, each entry node (DHT records, dial-backs, relayed
        # signalling: a relayed connection rides the home's one connection to its relay), beside
        # what the peers counted of their all-reduces (sent and received).
        "router_flows": flows,
        "allreduce_bytes": allreduce,
        # What each entry node's relay counted, from its p2pd's own counters (relay_metrics.py):
        # homes reserve slots at their entry nodes only, but p2pd misses circuits (a floor, not a
        # bound: docs/benchmarks.md). The share is of the all-reduce bytes the peers sent (each once).
        "relayed": relayed,
        "relayed_share_of_allreduce": float(f"{relayed_bytes / sent:.3g}") if sent else None,
        "peers": {
            names[h]: {
                "tier": next(
                    (
                        line.split("reachability: ", 1)[1][:90]
                        for line in logs[h].splitlines()
                        if "reachability: " in line
                    ),
                    "",
                ),
                "group_sizes": [held(h, r).get("group_size", 0) for r in range(1, rounds + 1)],
                "adopted_rounds": sum(bool(held(h, r).get("adopted")) for r in range(1, rounds + 1)),
                "caught_up": [line.split("] ", 1)[1] for line in logs[h].splitlines() if "caught up with" in line],
                "failed_tries": len(FAILED_TRY.findall(logs[h])),
                "first_failure": next((line for line in logs[h].splitlines() if FAILED_TRY.search(line)), ""),
            }
            for h in peers
        },
    }


def _by_whom(net: HomeNet, flows: dict[str, int], entry_nodes: int) -> dict[str, int]:
    names = {net.hosts[h].ip: f"entry{h}" for h in range(entry_nodes)}
    names.update({net.hosts[entry_nodes].ip: "public"} if net.public > entry_nodes else {})
    names.update({net.wan_ip(j): f"home{j}" for j in range(len(net.homes))})
    return {names.get(ip, ip): n for ip, n in sorted(flows.items())}


def _kind(home: Home) -> str:
    return home.nat + "+upnp" * home.upnp + "+drop" * (home.unsolicited == "drop")


def _records_so_far(run_dir: Path) -> set[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["round"] for line in lines if line.endswith("}")}


def _restart_at(net: HomeNet, swarm: NetSwarm, home: int, round_: int, restarted: list[float]) -> None:
    path = swarm.peer_dir(net.home_host(home)) / "metrics.jsonl"
    deadline = time.monotonic() + 60 * round_ + 300  # as long as run_peers waits for the whole run
    while not (path.exists() and any(json.loads(line)["round"] >= round_ for line in path.read_text().splitlines())):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)  # a poll of the peer's file; the restart's moment is only roughly that round's end
    net.restart_router(home)
    restarted.append(time.monotonic())
    print(f"home {home}'s router restarted after its peer's round {round_}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--homes", default="cone,cone", help="kinds of home: cone, symmetric, double (+upnp)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="a config override key=value (repeat)")
    parser.add_argument("--restart-router", metavar="HOME@ROUND", help="restart home HOME's router after ROUND")
    parser.add_argument("--folder", type=Path, help="keep the peers' logs and run dirs here (default: a temporary one)")
    parser.add_argument("--entry-nodes", type=int, default=1, help="bootstrap nodes on the internet (relays)")
    parser.add_argument("--no-public-peer", action="store_true", help="only the homes train")
    parser.add_argument("--late", metavar="HOME@ROUND", help="start home HOME's peer once the first peer has ROUND")
    args = parser.parse_args()
    homes = [_home(kind) for kind in args.homes.split(",")]
    settings = dict(s.split("=", 1) for s in args.set)
    restart = tuple(map(int, args.restart_router.split("@"))) if args.restart_router else None
    late = tuple(map(int, args.late.split("@"))) if args.late else None
    shape = {"entry_nodes": args.entry_nodes, "public_peer": not args.no_public_peer, "late": late}
    if args.folder is not None:
        result = run(homes, args.rounds, settings, args.folder, restart, **shape)
    else:
        with tempfile.TemporaryDirectory(prefix="homeswarm-") as folder:
            result = run(homes, args.rounds, settings, Path(folder), restart, **shape)
    key = f"{args.homes} {' '.join(args.set)}".strip() + (f" restart {args.restart_router}" if restart else "")
    key += f" entry-nodes {args.entry_nodes}" * (args.entry_nodes != 1) + " no-public-peer" * args.no_public_peer
    key += f" late {args.late}" if late else ""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[key] = {**result, "rounds": args.rounds, "machine": platform.machine(), "when": time.strftime("%Y-%m-%d")}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results[key], indent=1))


def _home(kind: str) -> Home:
    """`cone`, `symmetric` or `double`, with `+upnp` (a UPnP router) and `+drop` (a router that
    drops what nobody asked for: hole punching needs it) as they apply."""
    nat, *extras = kind.split("+")
    return Home(nat, upnp="upnp" in extras, unsolicited="drop" if "drop" in extras else "reset")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
