"""What one TCP flow gets of a lab link: the floor under every all-reduce figure in the netlab.

bench/allreduce.py's bound is the butterfly's payload bytes over the link's rate. The link (tc tbf
on each host's veth, bench/netlab.py) counts whole frames: a full TCP segment carries 1,448 bytes of
payload in 1,514 on the wire (Ethernet 14, IP 20, TCP 20 + 12 of timestamps), so no transfer can
beat 1.046x that bound, and the ACKs of a flow the other way share the same uplink. This bench
measures, on two lab hosts at `--rate` Mbit/s both ways without forwarders:
- one way: host 0 sends M MiB to host 1 over one connection;
- both ways: each sends M MiB to the other at once (a butterfly's traffic at k = 2);
for each M of `--mb`, each flow from the receiver's first byte to its last, against payload / rate,
and the bytes the sender's link carried per payload byte (its veth counters count one header per
GSO packet of up to 64 KiB, so they do not show the per-frame headers; tbf does count them).

    .venv/bin/python bench/tcp_floor.py --rate 25 --mb 25 100 --repeats 3   # as root, 5 minutes

Writes bench/results/tcp_floor.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from netlab import NetLab, available, line_reader, next_line

HERE = Path(__file__).resolve().parent
RECEIVER = r"""
import socket, sys, time
server = socket.create_server((sys.argv[1], 5001))
print("up", flush=True)
conn, _ = server.accept()
got, first = 0, None
while chunk := conn.recv(1 << 20):
    first = first or time.perf_counter()
    got += len(chunk)
print(got, time.perf_counter() - first, flush=True)
"""
SENDER = r"""
import socket, sys
conn = socket.create_connection((sys.argv[1], 5001))
payload = bytes(1 << 20)
for _ in range(int(sys.argv[2])):
    conn.sendall(payload)
conn.close()
"""


def transfer(lab: NetLab, senders: list[int], mb: int, rate: float) -> list[dict]:
    """Each host in `senders` sends `mb` MiB to the other host at once: per flow, its seconds, its
    ratio to payload / rate and the sender link's bytes per payload byte."""
    receivers = [1 - s for s in senders]
    servers = [lab.popen(r, [sys.executable, "-c", RECEIVER, lab.hosts[r].ip], stdout=-1, text=True) for r in receivers]
    outs = [line_reader(p) for p in servers]
    for out in outs:
        next_line(out, 30, "receiver up")
    before = [lab.link_bytes(s)[0] for s in senders]
    clients = [lab.popen(s, [sys.executable, "-c", SENDER, lab.hosts[1 - s].ip, str(mb)]) for s in senders]
    flows = []
    for s, out, sent_before in zip(senders, outs, before):
        got, seconds = next_line(out, 30 + 40 * mb * 8 / rate, "receiver's result").split()
        payload = int(got)
        flows.append(
            {
                "sender": s,
                "payload_bytes": payload,
                "seconds": float(seconds),
                "ratio": float(seconds) / (payload * 8 / (rate * 1e6)),
                "link_bytes_per_payload_byte": (lab.link_bytes(s)[0] - sent_before) / payload,
            }
        )
    for p in clients + servers:
        lab.end(p, grace_s=5)
    return flows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=25.0)
    parser.add_argument("--mb", type=int, nargs="+", default=[25, 100], help="MiB each flow sends")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    result: dict = {"rate_mbit": args.rate, "by_mib": {}}
    with NetLab([(args.rate, args.rate)] * 2, tag="tcpf") as lab:
        for mb, (name, senders) in ((m, n) for m in args.mb for n in (("one_way", [0]), ("both_ways", [0, 1]))):
            flows = [f for _ in range(args.repeats) for f in transfer(lab, senders, mb, args.rate)]
            r = result["by_mib"].setdefault(str(mb), {})[name] = {
                "ratio_median": statistics.median(f["ratio"] for f in flows),
                "ratio_max": max(f["ratio"] for f in flows),
                "link_bytes_per_payload_byte": statistics.median(f["link_bytes_per_payload_byte"] for f in flows),
                "flows": flows,
            }
            print(
                f"{mb} MiB {name}: {r['ratio_median']:.3f}x payload / rate (at most {r['ratio_max']:.3f}x), "
                f"{r['link_bytes_per_payload_byte']:.3f} link bytes per payload byte"
            )
    out = HERE / "results" / "tcp_floor.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
