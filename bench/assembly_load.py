"""What a two-level round's span assemblies cost the DHT: N DHT-only nodes running the real
`Assembly` (docs/design.md §3, "Past one group"; swarm/averaging/assembly.py).

N processes on 127.0.0.1, each a hivemind DHT node with its own p2pd (NAT probing off). The nodes
form G = round(N / S) groups of about S (node i in group i mod G), and each member of a group owns
one of its S spans (node i: span (i div G) mod S), as `twolevel.owners` deals spans among a group
of S. Every ROUND_PERIOD_S, each node meets the other groups' owners of its span under the
round's assembly key (`Levels.assembly_key`: the run, the round and the span) with a claim of
CLAIM_BYTES_PER_MEMBER x S random bytes (a layout and S seals' size), as an owner does after its
group's stage 1. In each node's forked DHT process the handlers other nodes call (`rpc_find`,
`rpc_store`) count what they answer and receive under the assembly keys (bench/dht_load.py's
counters); after each round one owner of each span reads its key and counts the subkeys (the
owners that declared themselves under it).

    .venv/bin/python bench/assembly_load.py --nodes 16 32 --group-size 8   # about 7 minutes

Writes bench/results/assembly_load.json (or --out NAME): per N, per node and round: the DHT
requests served for assembly keys and their bytes (the busiest node's too), the owners each
assembly gathered, how long it took, and the most subkeys a key held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from dht_load import count_per_key, end, snapshot, wait_started  # this folder's: the DHT's counters

HERE = Path(__file__).resolve().parent
NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}
PREFIX = "assemblyload"
WAIT_S = 5.0  # stage 2's wait at the default swarm.averaging_timeout_s (60 s / 12): the assembly's
ROUND_PERIOD_S = 30.0
CLAIM_BYTES_PER_MEMBER = 600  # a member's name, owner index and root in the layout, and its seal
FIRST_ROUND_IN_S = 15.0  # after the last node started
RESULTS_TIMEOUT_S = 120.0  # past the last round's start


def layout_of(n: int, size: int) -> tuple[int, int]:
    """(G, S): the groups of n nodes and the spans of a group."""
    return max(2, round(n / size)), size


def assembly_key(r: int, span: int, groups: int, size: int) -> str:
    from p2p_diloco.protocol.twolevel import Levels

    return Levels(r, f"round {r}".encode().ljust(32, b"."), groups, size).assembly_key(PREFIX, span)


def node(index: int, folder: Path, initial: str, n: int, size: int, rounds: int) -> None:
    """One owner: a DHT and p2pd, its span's assembly every round at the time in FOLDER/go."""
    import hivemind
    from hivemind.dht.routing import DHTID

    groups, spans = layout_of(n, size)
    span = (index // groups) % spans
    keys = [assembly_key(r, k, groups, spans) for r in range(rounds) for k in range(spans)]
    count_per_key(folder, index, {DHTID.generate(source=f"{k}.0b").to_bytes(): "assembly" for k in keys})
    dht = hivemind.DHT(
        initial_peers=[initial] if initial else None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **NO_NAT
    )
    if not initial:
        (folder / "addr.tmp").write_text(str(dht.get_visible_maddrs()[0]))
        os.replace(folder / "addr.tmp", folder / "addr")
    (folder / f"counts{index}.json").write_text(json.dumps({"time": time.time(), "counts": {}}))  # ready
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        out = asyncio.run(owner(dht, folder, index, (groups, spans, span), rounds))
        (folder / f"result{index}.json").write_text(json.dumps(out))
        signal.pause()  # serve the others' DHT requests until the measurement ends it
    finally:
        dht.shutdown()


async def owner(dht, folder: Path, index: int, layout: tuple[int, int, int], rounds: int) -> list[dict]:
    from p2p_diloco.swarm.averaging.assembly import Assembly, AssemblyError

    groups, spans, span = layout
    p2p = await dht.replicate_p2p()
    assembly = Assembly(p2p, dht, PREFIX, WAIT_S)
    await assembly.start()
    while not (folder / "go").exists():
        await asyncio.sleep(0.2)  # polling for the start time, which the measurement writes
    go = float((folder / "go").read_text())
    out = []
    for r in range(rounds):
        await asyncio.sleep(max(0.0, go + r * ROUND_PERIOD_S - time.time()))  # the round's start, as scheduled
        key, began = assembly_key(r, span, groups, spans), time.monotonic()
        try:
            shown = await assembly.assemble(key, os.urandom(CLAIM_BYTES_PER_MEMBER * spans), 2 * groups, groups)
            entry: dict = {"round": r, "owners": len(shown), "s": round(time.monotonic() - began, 2)}
        except AssemblyError as e:
            entry = {"round": r, "error": str(e)}
        if index < groups * spans and index % groups == 0:  # one owner of each span: the key's subkeys
            found = await dht.get(f"{key}.0b", latest=True, return_future=True)
            entry["subkeys"] = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        out.append(entry)
    return out


def measure(n: int, size: int, rounds: int, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--node"]
    spec = [str(n), str(size), str(rounds)]
    procs = [subprocess.Popen([*cmd, "0", str(folder), "", *spec], start_new_session=True)]
    try:
        wait_started(procs[0], folder / "addr", "the first node")
        addr = (folder / "addr").read_text()
        for i in range(1, n):
            procs.append(subprocess.Popen([*cmd, str(i), str(folder), addr, *spec], start_new_session=True))
            wait_started(procs[-1], folder / f"counts{i}.json", f"node {i}")
        go = time.time() + FIRST_ROUND_IN_S
        (folder / "go").write_text(repr(go))
        time.sleep(FIRST_ROUND_IN_S / 2)  # the measurement's own timing: settle before the counts start
        before = snapshot(folder, n)
        deadline = time.monotonic() + FIRST_ROUND_IN_S / 2 + (rounds - 1) * ROUND_PERIOD_S + RESULTS_TIMEOUT_S
        while not all((folder / f"result{i}.json").exists() for i in range(n)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"owners did not end their rounds; see {folder}")
            time.sleep(0.5)  # polling for the results, with a deadline
        time.sleep(1.0)  # the counters flush every half second
        after = snapshot(folder, n)
        results = [json.loads((folder / f"result{i}.json").read_text()) for i in range(n)]
    finally:
        end(procs)
    return summarise(n, size, rounds, before, after, results)


def summarise(n: int, size: int, rounds: int, before: list[dict], after: list[dict], results: list[list]) -> dict:
    groups, spans = layout_of(n, size)
    per_node = [{k: a[k] - b.get(k, 0) for k in a if k.endswith(":assembly")} for a, b in zip(after, before)]
    served = [
        sum(v for k, v in d.items() if k.startswith("find_calls") or k.startswith("store_calls")) for d in per_node
    ]
    kinds = sorted({k for d in per_node for k in d})
    entries = [e for node_results in results for e in node_results]
    done = [e for e in entries if "error" not in e]
    return {
        "nodes": n,
        "groups": groups,
        "spans": spans,
        "rounds": rounds,
        "per_node_per_round": {k: round(sum(d.get(k, 0) for d in per_node) / n / rounds, 1) for k in kinds},
        "max_requests_served_per_round": round(max(served) / rounds, 1),
        "median_requests_served_per_round": round(statistics.median(served) / rounds, 1),
        "assemblies": len(entries),
        "failed": len(entries) - len(done),
        "owners_gathered": {str(k): v for k, v in sorted(Counter(e["owners"] for e in done).items())},
        "median_assembly_s": statistics.median(e["s"] for e in done) if done else None,
        "max_subkeys_per_key": max((e["subkeys"] for e in entries if "subkeys" in e), default=0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[16])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="assembly_load")
    parser.add_argument("--node", nargs=6, help=argparse.SUPPRESS)  # one owner of the measurement (internal)
    args = parser.parse_args()
    if args.node:
        i, folder, initial, n, size, rounds = args.node
        node(int(i), Path(folder), initial, int(n), int(size), int(rounds))
        return 0
    runs = []
    for n in args.nodes:
        with tempfile.TemporaryDirectory(prefix="assembly-load-") as tmp:
            result = measure(n, args.group_size, args.rounds, Path(tmp))
        runs.append(result)
        print(json.dumps(result))
    out = HERE / "results" / f"{args.out}.json"
    meta = {"wait_s": WAIT_S, "round_period_s": ROUND_PERIOD_S, "claim_bytes_per_member": CLAIM_BYTES_PER_MEMBER}
    out.write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
