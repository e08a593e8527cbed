"""One of the product's DHT nodes, for the home-network lab: `python -m tests.swarm.punch_node
public|private HOST KEY [ENTRY ...]` starts it (swarm.hole_punching on, the tier given, listening
on HOST, identity KEY), prints {"id", "maddrs"} as a JSON line, then answers each line of stdin:
`punch PEER SECONDS` with {"punched": {PEER: seconds or null}}, `direct` with {"direct": [...]},
and `circuits` with {"circuits": N}: the relayed connections this node dialled, from its p2pd's
own metrics on 127.0.0.1 of its host (go-libp2p counts each connection it opens by transport, on
the dialler's side; a relay's own counters are not reliable: docs/design.md, "Hole punching")."""

import json
import re
import sys
import urllib.request
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.swarm.transport import punch
from p2p_diloco.swarm.transport.identity import peer_id_of
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.transport.processes import stop_process


def main() -> None:
    tier, host, name, *entries = sys.argv[1:]
    key = Path(name)
    peer_id_of(key)  # made here: nothing to ask the swarm about it
    cfg = config.load(None, {"swarm.host": host, "swarm.hole_punching": "true"}).swarm
    dht = start_dht(cfg, key, entries, tier, metrics_port=0)
    try:
        print(json.dumps({"id": str(dht.peer_id), "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "punch":
                print(json.dumps({"punched": punch.punch_all(dht, [args[0]], entries, float(args[1]))}), flush=True)
            elif cmd == "direct":
                print(json.dumps({"direct": sorted(dht.run_coroutine(punch.direct_of))}), flush=True)
            elif cmd == "circuits":
                print(json.dumps({"circuits": _circuits_dialled(dht.metrics_port)}), flush=True)
    finally:
        stop_process(dht, "DHT process")


CIRCUITS = re.compile(r"^libp2p_swarm_connections_opened_total\{([^}]*)\} (\d+)$", re.M)


def _circuits_dialled(port: int) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    page = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ('dir="outbound"', 'transport="p2p-circuit"')
    return sum(int(n) for labels, n in CIRCUITS.findall(page) if all(w in labels.split(",") for w in wanted))


if __name__ == "__main__":
    main()
