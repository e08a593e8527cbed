"""The all-reduce's traffic pattern in raw TCP, in the same lab: what TCP alone costs against the bound.

k NetLab hosts, each at `--rate` Mbit/s both ways, behind the same frame forwarders as
bench/allreduce.py (0 ms: the same CPU per frame). Each host runs a worker that moves what a
butterfly all-reduce of `--numel` fp32 values moves, with no libp2p, no codec and no arithmetic:
- reduce-scatter: it sends a part of numel / k values to each other host, all at once, on one TCP
  connection per pair;
- all-gather: once it has received every other host's part of its own span, it sends its span to
  each other host, all at once.
A host is done when it has received every span. The time is the slowest host's, from the moment
all were told to go; the bound is bench/allreduce.py's: 2 (k - 1) / k x the vector over the link.

    .venv/bin/python bench/tcp_butterfly.py --k 4 --rate 100 --numel 25e6 --repeats 3   # as root

`--pace 0.97` caps each connection at 0.97 x the rate / (k - 1) (SO_MAX_PACING_RATE: the kernel
spaces its packets), so that no queue builds at the link and the ACKs of the flows coming the
other way do not wait behind 100 ms of it; `--cc` sets the hosts' and the connections' congestion
control: cubic by default, most volunteers' (this machine's is bbr, which the lab's namespaces
inherited until session 35).

`--libp2p` moves the same bytes in the same phases through hivemind's p2pd and raw libp2p streams
(bench/p2p_streams.py): the stack under our all-reduce, without its protobuf, codec or signatures.
`--pieces P` moves them in our all-reduce's schedule over those streams, and `--rpc` with it
through hivemind's protobuf RPC streams, as our runner does.

Writes bench/results/tcp_butterfly.json (or --out NAME).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from netlab import NetLab, available, line_reader, next_line

HERE = Path(__file__).resolve().parent
CHUNK = 1 << 20
SO_MAX_PACING_RATE = 47  # linux/asm-generic/socket.h; TCP paces itself without the fq qdisc


def _send(conn: socket.socket, nbytes: int) -> None:
    payload = b"\0" * CHUNK
    while nbytes > 0:
        conn.sendall(payload[: min(CHUNK, nbytes)])
        nbytes -= min(CHUNK, nbytes)


def _recv(conn: socket.socket, nbytes: int) -> None:
    while nbytes > 0:
        chunk = conn.recv(min(CHUNK, nbytes))
        if not chunk:
            raise ConnectionError("a peer closed its connection early")
        nbytes -= len(chunk)


def worker(ip: str, part: int) -> None:
    """One host: listen, print the port; read the peers' addresses and "go" on stdin; move the
    butterfly's bytes; print the seconds from "go" to the last byte received. With --libp2p, the
    same through p2pd and libp2p streams (bench/p2p_streams.py)."""
    if os.environ.get("TCPB_LIBP2P"):
        import asyncio

        import p2p_streams

        asyncio.run(p2p_streams.worker(ip, part))
        return
    server = socket.create_server((ip, 0), backlog=64)
    print(server.getsockname()[1], flush=True)
    peers = json.loads(sys.stdin.readline())  # [[ip, port], ...] of the others, in host order
    me = next(i for i, p in enumerate(peers) if p is None)
    outgoing = {j: socket.create_connection(tuple(p), timeout=60) for j, p in enumerate(peers) if j > me}
    incoming = {}
    for _ in range(me):
        conn, _ = server.accept()
        incoming[int(conn.recv(8, socket.MSG_WAITALL).decode())] = conn
    for conn in outgoing.values():
        conn.sendall(f"{me:<8d}".encode())
    conns = {**outgoing, **incoming}
    for conn in conns.values():
        if cc := os.environ.get("TCPB_CC"):  # --cc
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        if pace_bps := float(os.environ.get("TCPB_PACE_BPS", "0")):  # --pace: the connection's sending rate
            conn.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(pace_bps))
    print("ready", flush=True)
    sys.stdin.readline()  # "go"
    start = time.perf_counter()
    phase(conns, part)  # reduce-scatter: my part of each other span out, their parts of mine in
    phase(conns, part)  # all-gather: my span out, each other span in
    print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def phase(conns: dict[int, socket.socket], part: int) -> None:
    """Send `part` bytes to every other host and receive `part` from each, all at once."""
    threads = [threading.Thread(target=f, args=(c, part)) for c in conns.values() for f in (_send, _recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one(lab: NetLab, k: int, part: int, timeout_s: float) -> float:
    cmd = [sys.executable, __file__, "--worker"]
    procs = [
        lab.popen(i, [*cmd, lab.hosts[i].ip, str(part)], stdin=-1, stdout=-1, text=True, bufsize=1) for i in range(k)
    ]
    outs = [line_reader(p) for p in procs]
    shown = [
        json.loads(next_line(out, 60, "worker's port")) for out in outs
    ]  # a port, or a libp2p peer's id and addresses
    for i, p in enumerate(procs):
        peers = [
            None if j == i else shown[j] if isinstance(shown[j], dict) else [lab.hosts[j].ip, shown[j]]
            for j in range(k)
        ]
        p.stdin.write(json.dumps(peers) + "\n")
        p.stdin.flush()
    for out in outs:  # every connection made before the clock starts
        if next_line(out, 60, "worker's connections") != "ready":
            raise RuntimeError("a worker did not connect to its peers")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    seconds = max(json.loads(next_line(out, timeout_s, "worker's result"))["seconds"] for out in outs)
    for p in procs:
        lab.end(p, grace_s=5)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--numel", type=float, default=25e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="tcp_butterfly")
    parser.add_argument(
        "--no-forwarders", action="store_true", help="plain veths, without bench/delaylink.py's per-frame CPU"
    )
    parser.add_argument(
        "--pace", type=float, default=0.0, help="cap each connection at PACE x the rate / (k - 1) (SO_MAX_PACING_RATE)"
    )
    parser.add_argument(
        "--cc", default="cubic", help="the hosts' and connections' congestion control (this machine's: bbr)"
    )
    parser.add_argument(
        "--libp2p",
        action="store_true",
        help="the same bytes through hivemind's p2pd and libp2p streams (bench/p2p_streams.py)",
    )
    parser.add_argument(
        "--pieces",
        type=int,
        default=0,
        help="over libp2p, our all-reduce's schedule: parts in PIECES, each answered once all are in",
    )
    parser.add_argument(
        "--rpc",
        action="store_true",
        help="with --pieces: through hivemind's protobuf RPC streams, as our all-reduce's runner uses them",
    )
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # one host's worker (internal)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return 0
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    os.environ["TCPB_PACE_BPS"] = str(args.pace * args.rate * 1e6 / 8 / (args.k - 1))  # the workers read these
    os.environ["TCPB_CC"] = args.cc or ""
    os.environ["TCPB_LIBP2P"] = "1" if args.libp2p or args.pieces else ""
    os.environ["TCPB_PIECES"] = str(args.pieces)
    os.environ["TCPB_RPC"] = "1" if args.rpc else ""
    part = int(args.numel * 4 / args.k)
    bound = 2 * (args.k - 1) * part * 8 / (args.rate * 1e6)
    delays = None if args.no_forwarders else [0.0] * args.k
    with NetLab([(args.rate, args.rate)] * args.k, tag="tcpb", delays_ms=delays, cc=args.cc) as lab:
        times = [one(lab, args.k, part, 20 * bound + 60) for _ in range(args.repeats)]
    result = {"k": args.k, "rate_mbit": args.rate, "numel": args.numel, "bound_s": bound, "times_s": times}
    result |= {
        "pace": args.pace,
        "cc": args.cc,
        "transport": "hivemind-rpc" if args.rpc else "libp2p" if args.libp2p or args.pieces else "tcp",
        "pieces": args.pieces,
    }
    result["ratio"] = statistics.median(times) / bound
    print(f"k={args.k} at {args.rate:g} Mbit/s: {[round(t, 2) for t in times]} s, {result['ratio']:.2f}x the bound")
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
