"""libp2p hole punching (DCUtR) between two home peers, in the home-network lab (homenet.py), with
hivemind's P2P (its p2pd is go-libp2p v0.32.1): one P2P per public host (the relays) and per home.

    python bench/holepunch.py [--public 4] [--repeat 5] [--homes cone] [--idle 150] [--matrix]

Needs root and nftables. Home A dials home B through a relay that B holds a reservation with
(`/ip4/<relay>/tcp/<port>/p2p/<relay>/p2p-circuit/p2p/<B>`), and the script measures the time from
that dial until A holds a direct (non-circuit) connection to B, the addresses each side sees, and
what a stream A opens to B afterwards carries (`--bytes`, 8 MiB) and over which connection (the
stream's own address, and the bytes the relays' links carried meanwhile). `--idle S`: how long the
direct connection then stays up with nothing sent (first trial only). `--matrix`: the cone case
`--repeat` times, then symmetric homes and 1, 2 and 3 public nodes once each.

What the punch needs, and what the nodes here are given (see HOME and RELAY below):
- routers that drop what nobody asked for: `Home("cone", unsolicited="drop")` (a RST ends it);
- relays with force_reachability="public", or their relay service never starts;
- p2pd's `-relayDiscovery=0` on the homes (hivemind never passes it: `_no_relay_discovery` adds it
  to the argv), or autorelay reserves a slot only after its boot delay (minutes);
- at least 4 public nodes on distinct IPs that observe each home (identify's ActivationThresh):
  until then the home has no public address and its DCUtR service never starts;
- dht_mode="client" on the homes, or a DHT query connects them through the relay before their
  DCUtR handler exists, and DCUtR then fails once and never retries.
Writes bench/results/holepunch.json (one entry per case: public nodes and kind of home).
`HOLEPUNCH_FLAGS_RELAY` and `HOLEPUNCH_FLAGS_HOME`: more p2pd flags for the relays and the homes;
with `-metricsAddr=127.0.0.1:PORT` among them, each trial also records the relays' relay-service
counters and the homes' connections by transport (`relaysvc`, `home_conns`).

Found here (2 cores, homes at 10 Mbit/s up): cone homes and 4 public nodes punch 5 of 5, the direct
connection 19-29 ms after the relayed connect returns; a stream then opens on the direct connection
and carries 8 MiB at 9.7 Mbit/s (the home's upload) with nothing through the relays. A relayed
connection takes streams (p2pd opens every stream WithUseTransient), but its circuit carries only
about 128 KiB and lasts 2 min (go-libp2p's relay v2 defaults: p2pd runs a second relay service,
the one its -relayDataLimit and -relayTimeLimit configure, and here the default one served; with
HOLEPUNCH_FLAGS_RELAY="-relayDataLimit=32768" a 64-KiB push still passed, 3 of 3 trials): 64 KiB
passes, 8 MiB is reset and the relayed connection ends with it; an
idle one closes after ~2 min, while the punched one stays up. Symmetric homes, and 1, 2 or 3 public
nodes: the DCUtR service never starts, no punch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:  # imported as bench.holepunch (homeswarm's relay-only nodes, in the tests)
    from .homenet import Home, HomeNet, lab_available
    from .netlab import line_reader, next_line
else:  # run as a script, bench/ on sys.path
    from homenet import Home, HomeNet, lab_available
    from netlab import line_reader, next_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "holepunch.json"
SINK = "holepunch-sink"  # the binary stream handler every home serves
READY_LOG = "Starting holepunch protocol"  # p2p-holepunch's debug line once the home has a public address
RELAY = {"force_reachability": "public", "dht_mode": "server"}
HOME = {
    "force_reachability": "private",
    "dht_mode": "client",
    "use_relay": True,
    "use_auto_relay": True,
}  # and trusted_relays = initial_peers = the public nodes, and argv + -relayDiscovery=0


# --- the node: one hivemind P2P in one namespace, answering JSON commands on stdin --------------


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _p2p_setup(role: str, folder: str) -> None:
    """Sockets in the run's folder, p2p-holepunch's log lines forwarded to stdout, and (homes) the
    argv flag hivemind never passes."""
    from hivemind.p2p import P2P

    P2P._UNIX_SOCKET_PREFIX = f"/unix{folder}/hivemind-"
    log = P2P._log_p2pd_message

    def forward(line: str) -> None:
        if '"p2p-holepunch"' in line:
            record = json.loads(line)
            _emit(log={k: v for k, v in record.items() if k not in ("level", "caller", "logger")})
        log(line)

    P2P._log_p2pd_message = staticmethod(forward)
    make = P2P._make_process_args
    extra = (["-relayDiscovery=0"] if role == "home" else []) + _flags(role)
    P2P._make_process_args = staticmethod(lambda *a, **kw: [*make(*a, **kw), *extra])


def _maddr(text: str):
    """`text` as a hivemind Multiaddr that p2pd can parse: hivemind encodes each /p2p/<id> as a CIDv1
    (0x01 0x72 + multihash), Qm… ids too, which go-multiaddr rejects ("length greater than remaining
    number of bytes in buffer"); here the id is the raw multihash, as libp2p writes it."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    head, *rest = text.split("/p2p/")
    out = Multiaddr(head).to_bytes() if head else b""
    for part in rest:
        peer, _, tail = part.partition("/")
        raw = PeerID.from_base58(peer).to_bytes()  # RSA: 34 bytes, a one-byte length
        out += b"\xa5\x03" + bytes([len(raw)]) + raw + (Multiaddr("/" + tail).to_bytes() if tail else b"")
    return Multiaddr(out)


async def _node(role: str, ip: str, peers: list[str]) -> None:
    from hivemind.p2p import P2P, PeerID

    folder = tempfile.gettempdir()  # the coordinator's run folder (TMPDIR)
    _p2p_setup(role, folder)
    identity = os.path.join(folder, f"id-{os.getpid()}.key")
    P2P.generate_identity(identity)  # RSA (Qm…): hivemind mis-encodes /p2p/12D3KooW… ids
    kwargs = dict(RELAY) if role == "relay" else {**HOME, "initial_peers": peers, "trusted_relays": peers}
    p2p = await P2P.create(
        identity_path=identity, host_maddrs=[f"/ip4/{ip}/tcp/0"], check_if_identity_free=False, **kwargs
    )
    await p2p.add_binary_stream_handler(SINK, _sink)
    for maddr in peers:  # every public node observes this home (p2pd's bootstrap dials only 4)
        await p2p._client.connect(PeerID.from_base58(maddr.rsplit("/", 1)[1]), [_maddr(maddr)])
    _emit(ready=True, id=p2p.peer_id.to_base58(), maddrs=[str(m) for m in await p2p.get_visible_maddrs()])
    await _serve(p2p)


async def _serve(p2p) -> None:
    commands = {
        "circuit": _circuit,
        "dial": _dial,
        "push": _push,
        "watch": _watch,
        "conns": _conns,
        "metrics": _metrics,
    }
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            reply = await commands[cmd["cmd"]](p2p, **cmd["args"])
        except Exception as e:  # reported to the coordinator, which records it
            reply = {"error": f"{type(e).__name__}: {e}"}
        _emit(reply=cmd["cmd"], **reply)
    await p2p.shutdown()


async def _conns(p2p, peer: str | None = None) -> dict:
    """Every open connection: [peer id, remote address] (to `peer` only, if given)."""
    infos = await p2p.list_peers()
    conns = [[i.peer_id.to_base58(), str(a)] for i in infos for a in i.addrs]
    return {"conns": [c for c in conns if peer is None or c[0] == peer]}


async def _direct(p2p, peer: str) -> list[str]:
    return [addr for _, addr in (await _conns(p2p, peer))["conns"] if "p2p-circuit" not in addr]


async def _circuit(p2p, timeout_s: float) -> dict:
    """This home's first relay address, once it holds a reservation (polled every 50 ms)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        _, maddrs = await p2p._client.identify()
        circuits = [str(m) for m in maddrs if "p2p-circuit" in str(m)]
        if circuits:
            return {"circuit": circuits[0], "s": time.monotonic() - start}
        await asyncio.sleep(0.05)
    return {"circuit": None, "s": timeout_s}


async def _dial(p2p, maddr: str, peer: str, timeout_s: float) -> dict:
    """Connect to `peer` at `maddr` (a circuit address), then poll (every 10 ms) until a direct
    connection to it exists or `timeout_s` passed since the dial began."""
    from hivemind.p2p import PeerID

    start = time.monotonic()
    await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), [_maddr(maddr)]), timeout_s)
    connected = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await _direct(p2p, peer):
            break
        await asyncio.sleep(0.01)
    punched = bool(await _direct(p2p, peer))
    direct_s = time.monotonic() - connected if punched else None
    return {"connect_s": connected - start, "direct_s": direct_s, **(await _conns(p2p, peer))}


async def _push(p2p, peer: str, nbytes: int, timeout_s: float) -> dict:
    """Open a stream to `peer`'s sink, send `nbytes`, wait for its count of what arrived; on an
    error, how much was sent and when."""
    from hivemind.p2p import PeerID

    start, sent = time.monotonic(), 0
    try:
        info, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(peer), SINK), timeout_s
        )
        opened = time.monotonic()
        writer.write(nbytes.to_bytes(8, "big"))
        chunk = bytes(1 << 16)
        for offset in range(0, nbytes, len(chunk)):
            writer.write(chunk[: nbytes - offset])
            await asyncio.wait_for(writer.drain(), timeout_s)
            sent = offset + len(chunk[: nbytes - offset])
        received = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout_s), "big")
    except Exception as e:
        return {"failed": f"{type(e).__name__}: {e}", "sent": sent, "s": time.monotonic() - start}
    seconds = time.monotonic() - opened
    writer.close()
    mbit_s = round(nbytes * 8 / seconds / 1e6, 2)
    return {"over": str(info.addr), "open_s": opened - start, "s": seconds, "mbit_s": mbit_s, "received": received}


def _flags(role: str) -> list[str]:
    """Extra p2pd flags for this role's nodes: HOLEPUNCH_FLAGS_RELAY, HOLEPUNCH_FLAGS_HOME."""
    return os.environ.get(f"HOLEPUNCH_FLAGS_{role.upper()}", "").split()


async def _metrics(_p2p, role: str, prefixes: list[str]) -> dict:
    """The lines of this node's own p2pd metrics page (its -metricsAddr=127.0.0.1:PORT among its
    role's flags; read here, inside the node's namespace) that start with one of `prefixes`."""
    import urllib.request

    flags = dict(f.lstrip("-").split("=", 1) for f in _flags(role) if "=" in f)
    if "metricsAddr" not in flags:
        return {"metrics": None}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    page = opener.open(f"http://{flags['metricsAddr']}/metrics", timeout=5).read().decode()
    return {"metrics": [line for line in page.splitlines() if line.startswith(tuple(prefixes))]}


async def _sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    size, got = int.from_bytes(await reader.readexactly(8), "big"), 0
    while got < size and (data := await reader.read(min(1 << 16, size - got))):
        got += len(data)
    writer.write(got.to_bytes(8, "big"))
    await writer.drain()
    writer.close()


async def _watch(p2p, peer: str, seconds: float) -> dict:
    """Poll (every second) for `seconds` which connections to `peer` stay open: when the relayed
    one and when the direct one were last seen."""
    start, seen = time.monotonic(), {"relayed": None, "direct": None}
    while time.monotonic() - start < seconds:
        addrs = [addr for _, addr in (await _conns(p2p, peer))["conns"]]
        for kind, present in (
            ("relayed", any("p2p-circuit" in a for a in addrs)),
            ("direct", bool(await _direct(p2p, peer))),
        ):
            if present:
                seen[kind] = round(time.monotonic() - start, 1)
        await asyncio.sleep(1)
    return {"watched_s": time.monotonic() - start, "last_seen_s": seen, **(await _conns(p2p, peer))}


# --- the coordinator -------------------------------------------------------------------------------


class Node:
    """A `node` subprocess on one lab host; `ask` sends it a command and waits (with a deadline)
    for its reply, keeping the p2p-holepunch log lines that arrive meanwhile."""

    def __init__(self, net, host: int, role: str, peers: list[str], folder: str, verbose: bool, flags: str = ""):
        """`flags`: more p2pd flags for this node (its role's HOLEPUNCH_FLAGS_* otherwise)."""
        self.name, self.started = f"{role}@{net.hosts[host].ip}", time.monotonic()
        env = {**os.environ, "TMPDIR": folder, "GOLOG_LOG_LEVEL": "error,p2p-holepunch=debug"}
        env.update({f"HOLEPUNCH_FLAGS_{role.upper()}": flags} if flags else {})
        cmd = [sys.executable, str(Path(__file__).resolve()), "node", role, net.hosts[host].ip, *peers]
        stderr = None if verbose else subprocess.DEVNULL
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": stderr}
        self.proc = net.popen(host, cmd, text=True, env=env, **pipes)
        self.lines, self.logs = line_reader(self.proc), []
        ready = self.wait("ready", 60)
        self.id, self.maddrs = ready["id"], ready["maddrs"]

    def ask(self, cmd: str, wait_s: float, **args: object) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()
        reply = self.wait(cmd, wait_s + 10)
        if "error" in reply:
            raise RuntimeError(f"{self.name} {cmd}: {reply['error']}")
        return reply

    def wait(self, key: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(next_line(self.lines, max(0.01, deadline - time.monotonic()), f"{self.name}: {key}"))
            if "log" in msg:
                self.logs.append({"at_s": round(time.monotonic() - self.started, 3), **msg["log"]})
            elif msg.get("reply") == key or key in msg:
                return msg

    def holepunch_ready(self, timeout_s: float) -> float | None:
        """Seconds since start until this home's DCUtR service started, or None within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not any(READY_LOG in log.get("msg", "") for log in self.logs):
            if time.monotonic() > deadline:
                return None
            self.ask("conns", 5)  # a round trip that collects the log lines printed meanwhile
        return next(log["at_s"] for log in self.logs if READY_LOG in log.get("msg", ""))

    def quit(self, net) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it ended already
            pass
        net.end(self.proc, grace_s=10)


def start_nodes(net, public: int, folder: str, verbose: bool) -> tuple[list[Node], Node, Node]:
    relays = [Node(net, i, "relay", [], folder, verbose) for i in range(public)]
    maddrs = [f"{next(m for m in r.maddrs if '/tcp/' in m)}/p2p/{r.id}" for r in relays]
    a, b = (Node(net, net.home_host(j), "home", maddrs, folder, verbose) for j in (0, 1))
    return relays, a, b


def trial(public: int, kind: str, args: argparse.Namespace, folder: str, idle_s: float) -> dict:
    """One lab, `public` relays and two homes of `kind`: A dials B through B's relay."""
    homes = [Home(kind, unsolicited="drop"), Home(kind, unsolicited="drop")]
    with HomeNet(public=public, homes=homes) as net:
        relays, a, b = start_nodes(net, public, folder, args.verbose)
        result: dict = {"public": public, "homes": kind}
        result["dcutr_ready_s"] = [h.holepunch_ready(args.ready_timeout) for h in (a, b)]
        circuit = b.ask("circuit", 60, timeout_s=60)
        result["reservation_s"] = round(circuit["s"], 3)
        if circuit["circuit"] is None:
            return {**result, "connected": False, "punched": False, "error": "B got no relay reservation"}
        maddr = f"{circuit['circuit']}/p2p/{b.id}"
        result.update(dial_through_relay(a, b, maddr, args.punch_timeout))
        result["push_64k"] = push_stream(net, public, a, b, 64 << 10)
        result["push"] = push_stream(net, public, a, b, args.bytes)
        if idle_s > 0:
            watch = a.ask("watch", idle_s, peer=b.id, seconds=idle_s)
            result["idle"] = {**watch, "b_conns": b.ask("conns", 5, peer=a.id)["conns"]}
        result["conns_at_end"] = {h.name: h.ask("conns", 5, peer=o.id)["conns"] for h, o in ((a, b), (b, a))}
        result["holepunch_log"] = {"A": a.logs[-8:], "B": b.logs[-8:]}  # conns: a round trip that collects them
        relaysvc = ["libp2p_relaysvc_data", "libp2p_relaysvc_connections_total", "libp2p_relaysvc_reservations"]
        result["relaysvc"] = [r.ask("metrics", 10, role="relay", prefixes=relaysvc)["metrics"] for r in relays]
        swarm = ["libp2p_swarm_connections_opened_total"]
        result["home_conns"] = [h.ask("metrics", 10, role="home", prefixes=swarm)["metrics"] for h in (a, b)]
        for node in (a, b, *relays):
            node.quit(net)
    return result


def dial_through_relay(a: Node, b: Node, maddr: str, timeout_s: float) -> dict:
    try:
        dial = a.ask("dial", timeout_s, maddr=maddr, peer=b.id, timeout_s=timeout_s)
    except RuntimeError as e:
        return {"dialed": maddr, "connected": False, "punched": False, "error": str(e)}
    punched = dial["direct_s"] is not None
    return {
        "dialed": maddr,
        "connected": True,
        "connect_s": round(dial["connect_s"], 4),
        "punched": punched,
        "direct_after_connect_s": round(dial["direct_s"], 4) if punched else None,
        "a_sees": [addr for _, addr in dial["conns"]],
        "b_sees": [addr for _, addr in b.ask("conns", 5, peer=a.id)["conns"]],
    }


def push_stream(net, public: int, a: Node, b: Node, nbytes: int) -> dict:
    """A stream from A to B's sink: over which connection, how fast, what the relays carried."""
    before = [net.link_bytes(i) for i in range(public)]
    push = a.ask("push", 120, peer=b.id, nbytes=nbytes, timeout_s=120)
    after = [net.link_bytes(i) for i in range(public)]
    relayed = sum(rx1 - rx0 for (_, rx0), (_, rx1) in zip(before, after))
    if "failed" in push:
        return {
            "ok": False,
            "bytes": nbytes,
            "error": push["failed"],
            "sent": push["sent"],
            "after_s": round(push["s"], 3),
            "relays_received_bytes": relayed,
        }
    return {
        "ok": push["received"] == nbytes,
        "bytes": nbytes,
        "over": push["over"],
        "over_relay": "p2p-circuit" in push["over"],
        "open_s": round(push["open_s"], 4),
        "s": round(push["s"], 3),
        "mbit_s": push["mbit_s"],
        "relays_received_bytes": relayed,
    }


def cases(args: argparse.Namespace) -> list[tuple[int, str, int]]:
    """(public nodes, kind of home, trial) to run."""
    runs = [(args.public, args.homes, i) for i in range(args.repeat)]
    if args.matrix:
        runs += [(args.public, "symmetric", 0), *((p, args.homes, 0) for p in (1, 2, 3))]
    return runs


def summary(trials: list[dict]) -> dict:
    punched = [t for t in trials if t.get("punched")]
    times = sorted(t["direct_after_connect_s"] for t in punched)
    pushes = [t["push"] for t in trials if t.get("push", {}).get("ok")]
    return {
        "trials": len(trials),
        "punched": len(punched),
        "direct_after_connect_s": {"min": times[0], "median": times[len(times) // 2], "max": times[-1]}
        if times
        else None,
        "push_mbit_s": [p["mbit_s"] for p in pushes],
        "push_over_relay": [p["over_relay"] for p in pushes],
    }


def table(results: dict) -> str:
    rows = [f"{'case':<24} {'punched':>8} {'direct s (median)':>18} {'push Mbit/s':>12} {'push via':>9}"]
    for key, case in results["cases"].items():
        s = case["summary"]
        median = f"{s['direct_after_connect_s']['median']:.4f}" if s["direct_after_connect_s"] else "-"
        mbit = ",".join(f"{m:g}" for m in s["push_mbit_s"]) or "-"
        via = ",".join("relay" if r else "direct" for r in sorted(set(s["push_over_relay"]))) or "-"
        rows.append(f"{key:<24} {s['punched']:>3} of {s['trials']:<2} {median:>18} {mbit[:12]:>12} {via:>9}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--public", type=int, default=4, help="public nodes (relays) on the internet")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--homes", default="cone", choices=["cone", "symmetric", "double"])
    parser.add_argument("--idle", type=float, default=150, help="seconds to watch the idle connections (trial 1)")
    parser.add_argument("--bytes", type=int, default=8 << 20, help="what A pushes through a stream to B")
    parser.add_argument("--matrix", action="store_true", help="also symmetric homes and 1, 2, 3 public nodes")
    parser.add_argument("--punch-timeout", type=float, default=30)
    parser.add_argument("--ready-timeout", type=float, default=20, help="for a home's DCUtR service to start")
    parser.add_argument("--verbose", action="store_true", help="the nodes' stderr (hivemind's log) too")
    args = parser.parse_args()
    if (why := lab_available()) is not None:
        sys.exit(f"no lab here: {why}")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cases": {}}
    folder = tempfile.mkdtemp(prefix="holepunch-")  # the nodes' TMPDIR: sockets, keys
    try:
        trials: dict[str, list[dict]] = {}
        for public, kind, i in cases(args):
            key = f"public={public} homes={kind}"
            print(f"{key} trial {i + 1}", flush=True)
            try:
                main_case = i == 0 and (public, kind) == (args.public, args.homes)
                result = trial(public, kind, args, folder, args.idle if main_case else 0)
            except RuntimeError as e:  # a node that did not start or answer in time
                result = {"public": public, "homes": kind, "punched": False, "error": str(e)}
            print(json.dumps({k: v for k, v in result.items() if k != "holepunch_log"}), flush=True)
            trials.setdefault(key, []).append(result)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    meta = {"machine": platform.machine(), "when": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    for key, runs in trials.items():
        results["cases"][key] = {"summary": summary(runs), "trials": runs, **meta}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["node"]:
        asyncio.run(_node(sys.argv[2], sys.argv[3], sys.argv[4:]))
    else:
        main()
