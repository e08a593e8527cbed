"""A training swarm in the home-network lab (homenet.py): a bootstrap node and a public peer on the
"internet", and volunteers behind home routers, every one a real `p2p-diloco` process.

    python bench/homeswarm.py [--homes cone,cone] [--rounds 10] [--set key=value ...]

A kind of home is cone, symmetric or double; `+upnp` gives its router UPnP (miniupnpd), e.g.
`--homes cone+upnp,symmetric --set swarm.upnp=true`; `+drop` a router that drops what nobody asked
for. Hole punching between homes, with four entry nodes as relays and no public peer:
`--homes cone+drop,cone+drop --entry-nodes 4 --no-public-peer --set swarm.hole_punching=true`;
`--late 2@3` starts home 2's peer once the first peer recorded round 3 (a late joiner);
`--relays 4` adds four relay-only nodes and gives them to every peer as swarm.relays: what their
links carry bounds what was relayed.

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
    from .holepunch import Node
    from .homenet import Home, HomeNet
    from .netswarm import NetSwarm
else:  # run as a script, bench/ on sys.path
    from holepunch import Node

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
    relays: int = 0,
) -> dict:
    """One scenario: returns what each peer's records and log say. `restart`: (home, round): that
    home's router restarts (HomeNet.restart_router) once its peer recorded the round. `entry_nodes`
    bootstrap nodes on the internet (hosts 0 …), then a public peer unless not `public_peer`, then
    `relays` relay-only nodes (swarm.relays: their links carry nothing but what they relay, and
    libp2p's own identify and ping). `late`: (home, round): that home's peer starts once the first
    peer recorded the round."""
    overrides = {**TINY, "run.rounds": str(rounds), "run.run_id": "homeswarm", **settings}
    folder.mkdir(parents=True, exist_ok=True)  # the relay-only nodes' TMPDIR (keys, sockets)
    with HomeNet(public=entry_nodes + public_peer + relays, homes=homes) as net:
        relay_hosts = list(range(entry_nodes + public_peer, entry_nodes + public_peer + relays))
        relay_nodes = [_relay_only(net, host, folder) for host in relay_hosts]
        if relay_nodes:
            overrides["swarm.relays"] = ",".join(f"{_tcp(r.maddrs)}/p2p/{r.id}" for r in relay_nodes)
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
        relay_links = {f"relay{h}": dict(zip(("sent", "received"), net.link_bytes(h))) for h in relay_hosts}
        for node in relay_nodes:
            node.quit(net)
        records = {host: swarm.records(host) for host in peers}
        logs = {host: (folder / f"peer{host}.log").read_text() for host in peers}
    names = {entry_nodes: "public", **{net.home_host(j): f"home{j}-{_kind(h)}" for j, h in enumerate(homes)}}
    held = lambda h, r: records[h].get(r, {})  # noqa: E731  (a late peer holds no early round)
    digests = [{records[h][r]["digest"] for h in peers if r in records[h]} for r in range(1, rounds + 1)]
    digests_agree = all(len(found) == 1 for found in digests)
    allreduce = sum(r.get("bytes_sent", 0) + r.get("bytes_received", 0) for h in peers for r in records[h].values())
    sent = sum(r.get("bytes_sent", 0) for h in peers for r in records[h].values())
    relayed_bytes = sum(link["received"] for link in relay_links.values())
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
        # What each relay-only node's link carried (`relays`): every byte it relayed arrived on it
        # once, so what it received bounds what it relayed. The share is of the all-reduce bytes the
        # peers sent (each once).
        "relay_links": relay_links,
        "relayed_share_of_allreduce": float(f"{relayed_bytes / sent:.3g}") if sent and relay_links else None,
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


def _relay_only(net: HomeNet, host: int, folder: Path):
    """A relay and nothing else on `host`: hivemind's P2P as a public node of the product runs it
    (relay on, reachability forced public, processes.RELAY_LIMITS), with no DHT of the run."""
    from p2p_diloco.swarm.transport.processes import RELAY_LIMITS

    flags = " ".join(f"-{k}={v}" for k, v in RELAY_LIMITS.items())
    return Node(net, host, "relay", [], str(folder), verbose=False, flags=flags)


def _tcp(maddrs: list[str]) -> str:
    return next(m.split("/p2p/")[0] for m in maddrs if "/tcp/" in m)


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
    parser.add_argument("--relays", type=int, default=0, help="relay-only nodes on the internet (swarm.relays)")
    args = parser.parse_args()
    homes = [_home(kind) for kind in args.homes.split(",")]
    settings = dict(s.split("=", 1) for s in args.set)
    restart = tuple(map(int, args.restart_router.split("@"))) if args.restart_router else None
    late = tuple(map(int, args.late.split("@"))) if args.late else None
    shape = {"entry_nodes": args.entry_nodes, "public_peer": not args.no_public_peer, "late": late}
    shape["relays"] = args.relays
    if args.folder is not None:
        result = run(homes, args.rounds, settings, args.folder, restart, **shape)
    else:
        with tempfile.TemporaryDirectory(prefix="homeswarm-") as folder:
            result = run(homes, args.rounds, settings, Path(folder), restart, **shape)
    key = f"{args.homes} {' '.join(args.set)}".strip() + (f" restart {args.restart_router}" if restart else "")
    key += f" entry-nodes {args.entry_nodes}" * (args.entry_nodes != 1) + " no-public-peer" * args.no_public_peer
    key += f" late {args.late}" if late else ""
    key += f" relays {args.relays}" if args.relays else ""
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
