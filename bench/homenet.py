"""An emulated internet of home routers, on one machine: public hosts on an "internet" bridge, and
homes whose one host sits behind a NAT router (nftables masquerade), each in a network namespace.

    with HomeNet(public=2, homes=[Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000)]) as net:
        net.popen(net.home_host(0), [...])      # a process in the first home, behind its router
        net.hosts[0].ip                         # 11.0.0.10: the first public host

Kinds of home:
- `cone`: endpoint-independent mapping (Linux masquerade keeps a flow's source port where it can,
  the same for every destination), replies only: nothing reaches the host unasked;
- `symmetric`: `masquerade random,fully-random`: each flow gets a random port, per destination;
- `double`: a carrier-grade NAT (100.64.0.0/10) in front of the home router: two masquerades;
- `forward=PORT`: the router also forwards PORT (TCP and UDP) to the home's host;
- `unsolicited`: what the router does with a connection nobody at home asked for: `reset` (its own
  kernel answers a TCP SYN with a RST, as Linux does with no filter) or `drop` (silence, as most
  home routers and carrier NATs do). TCP hole punching can work only through routers that drop: a
  RST from one router ends the other's fresh mapping;
- `upnp=True`: the router maps ports on request (miniupnpd, UPnP IGD and NAT-PMP, on its LAN side
  only), as home routers with UPnP turned on do; `apt-get install miniupnpd-nftables`.
Each home's link is shaped at its router's WAN port with tbf, `up` and `down` Mbit/s apart.

Addresses: the internet side uses 11.0.0.0/24, public-looking (libp2p hole-punches only between
public addresses), but only inside the namespaces made here: nothing has a route to the host's
interfaces, so no packet leaves the lab. Homes are 192.168.<j+1>.0/24 (the host is .2). Needs root,
iproute2 and nftables. Like NetLab (netlab.py), it ends every process it started and deletes every
namespace it made on close, also when the code inside it fails.

    python bench/homenet.py selftest    # what each kind of home shows a public host
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

if __package__:  # imported as bench.homenet (the tests)
    from .netlab import Host, NetLab, _ip, _limit, _run, available, line_reader, next_line
else:  # run as a script, bench/ on sys.path
    from netlab import Host, NetLab, _ip, _limit, _run, available, line_reader, next_line

INTERNET = "11.0.0"  # public-looking, lab-only (see the module's docstring)
CARRIER = "100.64"  # RFC 6598 shared address space: a carrier's NAT
PUBLIC_BASE, ROUTER_BASE, CARRIER_BASE = 10, 100, 150  # last octets on the internet bridge


@dataclass(frozen=True)
class Home:
    nat: Literal["cone", "symmetric", "double"] = "cone"
    forward: int | None = None  # a port the router forwards to the home's host
    unsolicited: Literal["reset", "drop"] = "reset"  # a SYN to the router that nobody asked for
    upnp: bool = False  # the router maps ports for the home's host on request (miniupnpd)
    up: float | None = 10.0  # Mbit/s the home sends (None: no limit)
    down: float | None = 50.0


def lab_available(upnp: bool = False) -> str | None:
    """Why a home-network lab (`upnp`: with a UPnP router) cannot be built here, or None if it can."""
    if shutil.which("nft") is None:
        return "nft not found: apt-get install nftables (.ci/run installs it)"
    if upnp and _miniupnpd() is None:
        return "miniupnpd not found: apt-get install miniupnpd-nftables (.ci/run installs it)"
    return available()


class HomeNet(NetLab):
    """`public` hosts on the internet bridge (hosts 0 … public-1), then one host per home."""

    def __init__(
        self,
        public: int,
        homes: list[Home],
        public_link: tuple[float | None, float | None] = (None, None),
        cc: str | None = None,
    ):
        self.public, self.homes = public, homes
        self._folders: list[Path] = []  # a UPnP router's config and leases, removed on close
        super().__init__([public_link] * public + [(h.up, h.down) for h in homes], tag="phn", cc=cc)

    def home_host(self, j: int) -> int:
        """The host index of home `j`'s host."""
        return self.public + j

    def wan_ip(self, j: int) -> str:
        """The address home `j` shows the internet: its router's, or its carrier's."""
        base = CARRIER_BASE if self.homes[j].nat == "double" else ROUTER_BASE
        return f"{INTERNET}.{base + j}"

    def restart_router(self, j: int) -> None:
        """What a restart of home `j`'s router does to the connections through it: its connection
        tracking table, every NAT mapping in it, is gone (the carrier's, for a double NAT, stays)."""
        _run("ip", "netns", "exec", f"{self.prefix}r{j}", "conntrack", "-F")

    def flows(self, j: int) -> dict[str, int]:
        """Bytes (both ways) home `j`'s router forwarded so far, by the address outside it they went
        to or came from (an nftables set with counters, `_ACCT`: every packet, also of connections
        that closed meanwhile)."""
        out = subprocess.run(
            ["ip", "netns", "exec", f"{self.prefix}r{j}", "nft", "-j", "list", "set", "inet", "acct", "remote"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found = [item["set"] for item in json.loads(out)["nftables"] if "set" in item]
        elements = found[0].get("elem", []) if found else []
        return {e["elem"]["val"]: e["elem"]["counter"]["bytes"] for e in elements}

    def take_offline(self, j: int) -> None:
        """Home `j`'s host loses its default route, as a machine whose network is not up: nothing
        outside its home has a route from it."""
        _ip(self.hosts[self.home_host(j)].netns, "route", "del", "default")

    def _hosts(self, links: list[tuple[float | None, float | None]]) -> list[Host]:
        public = [Host(i, f"{self.prefix}p{i}", f"{INTERNET}.{PUBLIC_BASE + i}", *links[i]) for i in range(self.public)]
        homes = [
            Host(self.public + j, f"{self.prefix}h{j}", f"192.168.{j + 1}.2", *links[self.public + j])
            for j in range(len(self.homes))
        ]
        return public + homes

    def _build(self) -> None:
        self._add_netns(self.bridge_ns)
        _ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip(self.bridge_ns, "link", "set", "br0", "up")
        for host in self.hosts[: self.public]:
            self._add_netns(host.netns)
            _ip(host.netns, "link", "set", "lo", "up")
            self._plug(host.netns, f"p{host.index}", f"{host.ip}/24", host.up_mbit, host.down_mbit)
        for j, home in enumerate(self.homes):
            self._build_home(j, home, self.hosts[self.public + j])

    def _build_home(self, j: int, home: Home, host: Host) -> None:
        """Router (and carrier) namespaces, the home's host behind them, and their NAT rules."""
        router = f"{self.prefix}r{j}"
        self._add_netns(router)
        self._add_netns(host.netns)
        for ns in (router, host.netns):
            _ip(ns, "link", "set", "lo", "up")
        if home.nat == "double":
            carrier = f"{self.prefix}c{j}"
            self._add_netns(carrier)
            _ip(carrier, "link", "set", "lo", "up")
            self._plug(carrier, f"c{j}", f"{INTERNET}.{CARRIER_BASE + j}/24", None, None)
            cgn = f"{CARRIER}.{j + 1}"
            _link(carrier, "cgn0", f"{cgn}.1/24", router, "eth0", f"{cgn}.2/24")
            _ip(router, "route", "add", "default", "via", f"{cgn}.1")
            _route_and_nat(carrier, "cgn0", "", None, None, home.unsolicited)
        else:
            self._plug(router, f"r{j}", f"{INTERNET}.{ROUTER_BASE + j}/24", None, None)
        _limit(router, "eth0", home.up)  # the home's upload: what leaves its router
        lan = f"192.168.{j + 1}"
        _link(router, "lan0", f"{lan}.1/24", host.netns, "eth0", f"{host.ip}/24")
        _limit(router, "lan0", home.down)  # the home's download: what its router hands in
        _ip(host.netns, "route", "add", "default", "via", f"{lan}.1")
        random = " random,fully-random" if home.nat == "symmetric" else ""
        _route_and_nat(router, "lan0", random, home.forward, host.ip, home.unsolicited)
        _nft(router, _ACCT)  # for `flows`
        if home.upnp:
            self._start_upnp(j, router)

    def _start_upnp(self, j: int, router: str) -> None:
        """miniupnpd in home `j`'s router, answering on its LAN port only, with the nftables chains
        its backend adds mappings to (the lab's forward chain lets DNATed traffic in already)."""
        _nft(router, _UPNP_CHAINS)
        folder = Path(tempfile.mkdtemp(prefix=f"{self.prefix}upnp{j}-"))
        self._folders.append(folder)
        conf = folder / "miniupnpd.conf"
        conf.write_text(_UPNP_CONF.format(lease=folder / "leases", uuid=uuid.uuid4()))
        cmd = ["ip", "netns", "exec", router, str(_miniupnpd()), "-f", str(conf), "-d", "-P", str(folder / "pid")]
        self.procs.append(
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        )

    def close(self) -> None:
        super().close()
        for folder in self._folders:
            shutil.rmtree(folder, ignore_errors=True)


def _link(ns_a: str, dev_a: str, addr_a: str, ns_b: str, dev_b: str, addr_b: str) -> None:
    """A veth pair between two namespaces, addressed and up."""
    _ip(ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
    for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
        _ip(ns, "addr", "add", addr, "dev", dev)
        _ip(ns, "link", "set", dev, "up")


def _route_and_nat(
    router: str, lan: str, random: str, forward: int | None, inside: str | None, unsolicited: str = "reset"
) -> None:
    """A NAT router: forwards, masquerades what leaves its WAN port (`eth0`), lets in replies only,
    (`forward`) one port to `inside`, and answers or drops what nobody asked for (`unsolicited`)."""
    _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    dnat = ""
    if forward is not None:
        dnat = f'iifname "eth0" meta l4proto {{ tcp, udp }} th dport {forward} dnat to {inside}'
    rules = f"""
table ip nat {{
  chain prerouting {{
    type nat hook prerouting priority -100;
    {dnat}
  }}
  chain postrouting {{
    type nat hook postrouting priority 100;
    oifname "eth0" masquerade{random}
  }}
}}
table ip filter {{
  chain forward {{
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "{lan}" accept
    ct status dnat accept
  }}
}}
{_SILENT if unsolicited == "drop" else ""}
"""
    _nft(router, rules)


def _miniupnpd() -> str | None:
    """miniupnpd's path (in /usr/sbin, which a user's PATH may lack), or None."""
    return shutil.which("miniupnpd") or next((p for p in ("/usr/sbin/miniupnpd",) if Path(p).exists()), None)


# What a router forwards, counted by the outside address (HomeNet.flows). eth0 is its WAN port.
_ACCT = """
add table inet acct
add set inet acct remote { type ipv4_addr; size 4096; flags dynamic; counter; }
add chain inet acct through { type filter hook forward priority -10; }
add rule inet acct through oifname "eth0" update @remote { ip daddr }
add rule inet acct through iifname "eth0" update @remote { ip saddr }
"""


def _nft(netns: str, rules: str) -> None:
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"nft in {netns} failed: {result.stderr.strip()}")


# miniupnpd 2.3's nftables backend adds its rules to these chains of `inet filter` (its defaults),
# which base chains must jump to; the lab's own `ip nat` and `ip filter` tables stay as they are.
_UPNP_CHAINS = """
table inet filter {
  chain forward { type filter hook forward priority 0; policy accept; jump miniupnpd; }
  chain miniupnpd { }
  chain prerouting { type nat hook prerouting priority -100; policy accept; jump prerouting_miniupnpd; }
  chain postrouting { type nat hook postrouting priority 100; policy accept; jump postrouting_miniupnpd; }
  chain prerouting_miniupnpd { }
  chain postrouting_miniupnpd { }
}
"""
# Answers on the LAN port only; maps ports 1024-65535 for the home's own addresses (secure mode).
_UPNP_CONF = """ext_ifname=eth0
listening_ip=lan0
enable_upnp=yes
enable_natpmp=yes
secure_mode=yes
system_uptime=yes
lease_file={lease}
uuid={uuid}
allow 1024-65535 192.168.0.0/16 1024-65535
deny 0-65535 0.0.0.0/0 0-65535
"""


# A router that drops: nothing new or out of order from the internet reaches its own stack, so it
# answers nothing (forwarded ports are DNATed before this hook, and pass).
_SILENT = """
table inet silent {
  chain input {
    type filter hook input priority 0; policy accept;
    iifname "eth0" ct state new drop
    iifname "eth0" ct state invalid drop
  }
}
"""


# --- what a public host sees of a connection ---------------------------------------------------------


def seen_from(net: HomeNet, src: int, dst: int, connections: int = 1, src_port: int = 0) -> list[str]:
    """The `ip:port` that public host `dst` sees for each of `connections` TCP connections that host
    `src` opens to it (from local port `src_port`, if given: the same local port each time)."""
    listener = net.popen(dst, [sys.executable, __file__, "_listen", net.hosts[dst].ip, str(connections)], **_pipe())
    out = line_reader(listener)
    port = next_line(out, 30, "listener's port")
    connect = [sys.executable, __file__, "_connect", net.hosts[dst].ip, port, str(connections), str(src_port)]
    net.popen(src, connect).wait(timeout=60)
    seen = [next_line(out, 30, f"connection {i} seen") for i in range(connections)]
    listener.wait(timeout=30)
    return seen


def answer(net: HomeNet, src: int, ip: str, port: int, timeout_s: float = 2.0) -> str:
    """What host `src` gets when it opens a TCP connection to `ip:port`: "connected", "refused" (a
    RST), or "no answer" within `timeout_s`."""
    probe = [sys.executable, "-c", _PROBE, ip, str(port), str(timeout_s)]
    return {0: "connected", 3: "refused"}.get(net.popen(src, probe).wait(timeout=timeout_s + 30), "no answer")


def reachable(net: HomeNet, src: int, ip: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether host `src` can open a TCP connection to `ip:port` (something must listen there)."""
    return answer(net, src, ip, port, timeout_s) == "connected"


def listen_forever(net: HomeNet, host: int, port: int) -> subprocess.Popen:
    """A TCP listener on all of `host`'s addresses at `port`, until the lab ends it."""
    return net.popen(host, [sys.executable, __file__, "_serve", str(port)])


_PROBE = """import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])).close()
except ConnectionRefusedError:
    sys.exit(3)
except OSError:
    sys.exit(4)
"""


def _pipe() -> dict:
    return {"stdout": subprocess.PIPE, "text": True}


def _listen(ip: str, connections: int) -> None:
    import socket

    with socket.create_server((ip, 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(30)
        for _ in range(connections):
            conn, (peer_ip, peer_port) = server.accept()
            conn.close()
            print(f"{peer_ip}:{peer_port}", flush=True)


def _connect(ip: str, port: int, connections: int, src_port: int) -> None:
    import socket

    for _ in range(connections):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", src_port))
            s.settimeout(30)
            s.connect((ip, port))


def _serve(port: int) -> None:
    import socket

    with socket.create_server(("0.0.0.0", port)) as server:
        while True:
            conn, _ = server.accept()
            conn.close()


def selftest() -> None:
    homes = [Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000)]
    with HomeNet(public=2, homes=homes) as net:
        for j, home in enumerate(homes):
            seen = [seen_from(net, net.home_host(j), dst, src_port=40000 + j)[0] for dst in (0, 1)]
            print(f"home {j} ({home.nat}{', forwards 4000' if home.forward else ''}): public hosts see {seen}")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "_listen":
        _listen(sys.argv[2], int(sys.argv[3]))
    elif command == "_connect":
        _connect(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif command == "_serve":
        _serve(int(sys.argv[2]))
    elif command == "selftest":
        selftest()
