"""An attacker's process for bench/admission.py: it joins a run's DHT and, every half second,
publishes round records that claim a round far ahead of the swarm with a made-up digest:

- **impersonation**: under each honest peer's id, signed with the forger's own key;
- **made-up ids**: under ids nobody owns, signed with the forger's key;
- **sybils** (`--sybils N`): under N fresh keys, each record signed by the key of the id it claims
  (valid signatures: only a certificate can tell them from volunteers), and progress reports too.

    python bench/forger.py RUN_TOML MADDR PEER_ID [PEER_ID ...] [--sybils N] [--seconds S]

It trains nothing and serves no state. Ends after --seconds, or on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
import time
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.transport.identity import make_validator, peer_id_of
from p2p_diloco.swarm.transport.node import start_dht
from p2p_diloco.swarm.trust import records

FORGED_DIGEST = "f0" * 16
AHEAD = 50  # rounds ahead of the swarm the forged records claim


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_toml")
    parser.add_argument("maddr")
    parser.add_argument("victims", nargs="+")
    parser.add_argument("--sybils", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=600)
    args = parser.parse_args()
    cfg = config.load(args.run_toml, {"swarm.initial_peers": args.maddr, "swarm.port": "0"})
    prefix = records.run_prefix(cfg.run.run_id, cfg.fingerprint())
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with tempfile.TemporaryDirectory() as folder:
        keys = [Path(folder) / f"k{i}.key" for i in range(1 + args.sybils)]
        nodes = []
        for key in keys:
            validator = make_validator(key)
            nodes.append((start_dht(cfg.swarm, key, [args.maddr], "private", [validator]), validator, peer_id_of(key)))
        print(f"forging as {len(nodes)} node(s)", flush=True)
        try:
            forge(nodes, prefix, args.victims, time.monotonic() + args.seconds, stop)
        finally:
            for dht, _, _ in nodes:
                dht.shutdown()


def forge(nodes: list, prefix: str, victims: list[str], deadline: float, stop: threading.Event) -> None:
    (dht, validator, _), sybils = nodes[0], nodes[1:]
    while not stop.is_set() and time.monotonic() < deadline:
        seen = records.read_rounds(dht, prefix)
        ahead = max((r.round for p, r in seen.items() if p in victims), default=0) + AHEAD
        for victim in victims:
            records.publish_round(dht, validator, prefix, RoundRecord(victim, ahead, FORGED_DIGEST, 10**6, 0.1))
        records.publish_round(dht, validator, prefix, RoundRecord("QmMadeUpPeer", ahead, FORGED_DIGEST, 10**6, 0.1))
        for node, key, peer in sybils:
            records.publish_round(node, key, prefix, RoundRecord(peer, ahead, FORGED_DIGEST, 10**6, 0.1))
            records.publish_progress(node, key, prefix, ProgressReport(peer, ahead, 10**6, 1e6, time.time()))
        stop.wait(0.5)


if __name__ == "__main__":
    main()
