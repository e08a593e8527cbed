"""One of the product's DHT nodes, for the home-network lab: `python -m tests.swarm.punch_node
public|private HOST KEY [ENTRY ...]` starts it (swarm.hole_punching on, the tier given, listening
on HOST, identity KEY), prints {"id", "maddrs"} as a JSON line, then answers each line of stdin:
`punch PEER SECONDS` with {"punched": {PEER: seconds or null}}, `direct` with {"direct": [...]},
and on a public node (a relay, its p2pd's metrics on 127.0.0.1 of its host) `relayed` with
{"relayed": {"bytes", "circuits", "open_circuits", "reservations"}} (relay_metrics.py)."""

import dataclasses
import json
import sys
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.swarm.transport import punch, relay_metrics
from p2p_diloco.swarm.transport.identity import peer_id_of
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.transport.processes import stop_process


def main() -> None:
    tier, host, name, *entries = sys.argv[1:]
    key = Path(name)
    peer_id_of(key)  # made here: nothing to ask the swarm about it
    cfg = config.load(None, {"swarm.host": host, "swarm.hole_punching": "true"}).swarm
    dht = start_dht(cfg, key, entries, tier, metrics_port=0 if tier == "public" else None)
    try:
        print(json.dumps({"id": str(dht.peer_id), "maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "punch":
                print(json.dumps({"punched": punch.punch_all(dht, [args[0]], entries, float(args[1]))}), flush=True)
            elif cmd == "direct":
                print(json.dumps({"direct": sorted(dht.run_coroutine(punch.direct_of))}), flush=True)
            elif cmd == "relayed":
                relayed = dataclasses.asdict(relay_metrics.read(dht.metrics_port))
                print(json.dumps({"relayed": relayed}), flush=True)
    finally:
        stop_process(dht, "DHT process")


if __name__ == "__main__":
    main()
