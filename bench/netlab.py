"""Emulated internet links on one machine: each host in a Linux network namespace of its own, a
veth pair from each host into a bridge that lives in a namespace of its own, and `tc tbf` on both
ends of each veth (egress of the host end = the host's upload, egress of the bridge end = its
download). netem is absent from this kernel (and fq, which an eBPF delay would need): a host given
a one-way delay (`delays_ms`) keeps its address on a TAP device, and bench/delaylink.py, in its
namespace, carries its frames to and from its veth that much later (in a lab given delays, every
host, 0 ms included). Links have no loss.

    with NetLab([(100, 100), (100, 100), (5, 100)]) as lab:   # (up, down) Mbit/s per host; None = no limit
    with NetLab([(20, 20)] * 2, delays_ms=[10, 10]) as lab:   # a round trip of 2 x (10 + 10) = 40 ms
        proc = lab.popen(0, [sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        print(measure_tcp(lab, 2, 0, seconds=2))             # ~4.8 Mbit/s: host 2 uploads at 5 Mbit/s

Needs root, `ip` and `tc` (iproute2). Namespaces are named `pdl<pid>-h<i>` and `pdl<pid>-br`; host i
has the address 10.201.0.<i+1>/24, which exists only inside the lab, so no traffic leaves it.
Every process started with `popen` runs in a session of its own and is ended by process group on
`close()` (also on errors), which then deletes every namespace the lab made. A lab left behind by a
crashed run whose pid was reused is deleted on start (only namespaces with this very prefix).

    python bench/netlab.py selftest     # 2 hosts at 20 Mbit/s: the measured TCP rate and round trip
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

SUBNET = "10.201.0"
# tbf's bucket: 32 KiB splits every 64 KiB GSO packet and costs 20-30 % CPU here; 128 KiB does not.
BURST_BYTES = 128 * 1024
QUEUE_LATENCY = "100ms"  # how long a packet may wait in tbf's queue before it is dropped


def available() -> str | None:
    """Why a lab cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} (iproute2) not found" if missing else None


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ip: str
    up_mbit: float | None  # None: no limit
    down_mbit: float | None
    delay_ms: float = 0.0  # added to every frame it sends and receives (bench/delaylink.py)


class NetLab:
    """N hosts behind one bridge; `links[i]` = (upload, download) of host i in Mbit/s."""

    def __init__(
        self,
        links: list[tuple[float | None, float | None]],
        tag: str = "pdl",
        delays_ms: list[float] | None = None,
        cc: str | None = None,
    ):
        """`tag`: the namespaces' prefix before the pid (a lab of another shape has its own);
        `delays_ms[i]`: host i's one-way delay each way (the round trip between hosts i and j
        grows by 2 (delays_ms[i] + delays_ms[j]); given, every host is behind a forwarder, 0 ms
        included (the same CPU cost at every delay); `cc`: the hosts' TCP congestion control
        (None: whatever a new namespace gets from this machine, bbr here; `congestion_control`)."""
        self.cc = cc
        self._allowed: str | None = None  # this machine's list of allowed congestion controls, if the lab widened it
        self.prefix = f"{tag}{os.getpid()}-"
        self.bridge_ns = self.prefix + "br"
        self.forwarded = delays_ms is not None  # every host behind bench/delaylink.py, even at 0 ms
        hosts = self._hosts(links)
        delays = delays_ms or [0.0] * len(hosts)
        self.hosts = [dataclasses.replace(h, delay_ms=d) for h, d in zip(hosts, delays, strict=True)]
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces this lab created, deleted in reverse on close
        # The lab's processes' TMPDIR (`popen`): what a SIGKILLed one leaves (torch's shared-memory
        # folders, p2pd's sockets) goes with the lab, not into /tmp.
        self.tmp = tempfile.mkdtemp(prefix=f"{self.prefix}tmp-")
        _delete_namespaces(self.prefix)  # what a crashed run with our pid left (this prefix only)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hosts(self, links: list[tuple[float | None, float | None]]) -> list[Host]:
        return [Host(i, f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}", up, down) for i, (up, down) in enumerate(links)]

    def _build(self) -> None:
        self._add_netns(self.bridge_ns)
        _ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip(self.bridge_ns, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_netns(host.netns)
            _ip(host.netns, "link", "set", "lo", "up")
            if self.cc is not None:
                self._congestion_control(host.netns)
            self._plug(host.netns, f"v{host.index}", f"{host.ip}/24", host.up_mbit, host.down_mbit)
            if self.forwarded:
                # Every host, 0 ms where none: a veth hands over frames whose checksum it left to
                # the (absent) hardware, which a TAP device cannot take; the stack behind a TAP
                # finishes its own. A delayed host could not talk to an undelayed one.
                self._delay(host)

    def _delay(self, host: Host) -> None:
        """Move host's address from its veth to a TAP device and start bench/delaylink.py between them."""
        _ip(host.netns, "addr", "del", f"{host.ip}/24", "dev", "eth0")
        _run("ip", "netns", "exec", host.netns, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/conf/eth0/arp_ignore")
        _ip(host.netns, "tuntap", "add", "dev", "tap0", "mode", "tap")
        _ip(host.netns, "addr", "add", f"{host.ip}/24", "dev", "tap0")
        _ip(host.netns, "link", "set", "tap0", "up")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delaylink.py")
        forwarder = self.popen(
            host.index, [sys.executable, script, f"{host.delay_ms:g}"], stdout=subprocess.PIPE, text=True
        )
        next_line(line_reader(forwarder), 30, f"host {host.index}'s delay forwarder")

    def _plug(self, netns: str, port: str, address: str, up: float | None, down: float | None) -> None:
        """A veth pair from `netns` (its end `eth0`, with `address`) into the bridge (its end `port`),
        rate-limited both ways."""
        _ip(netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
        _ip(self.bridge_ns, "link", "set", port, "master", "br0", "up")
        _ip(netns, "addr", "add", address, "dev", "eth0")
        _ip(netns, "link", "set", "eth0", "up")
        _limit(netns, "eth0", up)
        _limit(self.bridge_ns, port, down)

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def _congestion_control(self, netns: str) -> None:
        """Set the lab's congestion control in `netns`. A namespace may only take one this machine
        allows: a missing one is allowed for the lab's life (`close` restores the list)."""
        allowed = _sysctl_value("net.ipv4.tcp_allowed_congestion_control")
        if self.cc not in allowed.split():
            self._allowed = self._allowed or allowed
            _run("sysctl", "-q", "-w", f"net.ipv4.tcp_allowed_congestion_control={allowed} {self.cc}")
        _run("ip", "netns", "exec", netns, "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={self.cc}")

    def congestion_control(self) -> str:
        """The congestion control the lab's hosts' TCP runs (host 0's, as every host's)."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.hosts[0].netns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    def popen(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside host `host`'s namespace, in a session of its own (its process group
        id is its pid), so that it and everything it forks (hivemind's p2pd) can be ended together.
        Its TMPDIR is the lab's own folder, unless `env` names another one than this process's."""
        env = dict(kwargs.pop("env", None) or os.environ)
        if env.get("TMPDIR") == os.environ.get("TMPDIR"):
            env["TMPDIR"] = self.tmp
        netns = ["ip", "netns", "exec", self.hosts[host].netns]
        proc = subprocess.Popen([*netns, *cmd], start_new_session=True, env=env, **kwargs)
        self.procs.append(proc)
        return proc

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(sent, received) bytes on host `host`'s link so far, as the kernel counts them.

        One header is counted per GSO packet.
        """
        out = subprocess.run(
            ["ip", "-n", self.hosts[host].netns, "-s", "-j", "link", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def end(self, proc: subprocess.Popen, grace_s: float = 5.0) -> None:
        """Give `proc` `grace_s` seconds to exit (after the caller asked it to), then SIGKILL its
        process group: that also ends what it leaves behind (hivemind's p2pd, DHT, averager)."""
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in the kernel: nothing more a signal can do
            pass

    def close(self) -> None:
        """End every process started here (SIGTERM, 5 s, SIGKILL), then delete every namespace this lab made."""
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            self.end(proc, grace_s=max(0.0, deadline - time.monotonic()))
        self.procs.clear()
        # A process that left its group (setsid) would keep a deleted namespace alive: it can only
        # be a descendant of ours, since nobody else enters these namespaces, so end it by pid.
        for name in self._made:
            for pid in _netns_pids(name):
                _kill(pid)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        if self._allowed is not None:
            subprocess.run(
                ["sysctl", "-q", "-w", f"net.ipv4.tcp_allowed_congestion_control={self._allowed}"],
                capture_output=True,
                timeout=30,
            )
            self._allowed = None
        shutil.rmtree(self.tmp, ignore_errors=True)  # made by this lab, used by its processes only


def namespaces(prefix: str) -> list[str]:
    """Names of existing namespaces that start with `prefix`."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _delete_namespaces(prefix: str) -> None:
    for name in namespaces(prefix):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _netns_pids(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid in out.split()]


def _limit(netns: str, dev: str, mbit: float | None) -> None:
    """Rate-limit what `dev` sends (its egress) with a token bucket."""
    if mbit is not None:
        _run(
            "tc",
            "-n",
            netns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{mbit * 1000:g}kbit",
            "burst",
            str(BURST_BYTES),
            "latency",
            QUEUE_LATENCY,
        )


def _sysctl_value(key: str) -> str:
    return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def _ip(netns: str, *args: str) -> None:
    _run("ip", "-n", netns, *args)


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the group already ended
        pass


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- reading a child's stdout with deadlines ------------------------------------------------------


def line_reader(proc: subprocess.Popen) -> queue.Queue[str | None]:
    """A queue of `proc`'s stdout lines (None at EOF), filled by a thread, so a wait can have a deadline."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def next_line(lines: queue.Queue[str | None], timeout_s: float, what: str) -> str:
    """The next line, or RuntimeError naming `what` after `timeout_s` seconds or at EOF."""
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"{what}: nothing within {timeout_s:g} s") from None
    if line is None:
        raise RuntimeError(f"{what}: the process ended")
    return line


# --- a self-check: plain TCP between two hosts ------------------------------------------------------


def measure_tcp(lab: NetLab, src: int, dst: int, seconds: float = 2.0) -> float:
    """Mbit/s of TCP payload that host `src` pushes to host `dst` in `seconds` (after a warm-up
    that excludes the token buckets' initial burst)."""
    receiver = lab.popen(
        dst, [sys.executable, __file__, "_recv", lab.hosts[dst].ip, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    out = line_reader(receiver)
    port = next_line(out, 30, "TCP receiver's port")
    sender = lab.popen(src, [sys.executable, __file__, "_send", lab.hosts[dst].ip, port, str(seconds)])
    result = json.loads(next_line(out, seconds + 30, "TCP receiver's result"))
    for proc in (sender, receiver):
        proc.wait(timeout=30)
    return result["mbit_s"]


def measure_rtt(lab: NetLab, src: int, dst: int, tries: int = 5) -> float:
    """The lowest of `tries` TCP handshakes' times (one round trip each) from host `src` to `dst`, in s."""
    receiver = lab.popen(
        dst, [sys.executable, __file__, "_listen", lab.hosts[dst].ip], stdout=subprocess.PIPE, text=True
    )
    port = next_line(line_reader(receiver), 30, "TCP listener's port")
    prober = lab.popen(
        src,
        [sys.executable, __file__, "_connect", lab.hosts[dst].ip, port, str(tries)],
        stdout=subprocess.PIPE,
        text=True,
    )
    result = json.loads(next_line(line_reader(prober), 60, "round trip"))
    prober.wait(timeout=30)
    lab.end(receiver, grace_s=0)
    return result["rtt_s"]


def _listen(ip: str) -> None:
    with socket.create_server((ip, 0), backlog=64) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(60)
        while True:  # the lab ends it
            server.accept()[0].close()


def _connect(ip: str, port: int, tries: int) -> None:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        with socket.create_connection((ip, port), timeout=30):
            times.append(time.perf_counter() - start)
    print(json.dumps({"rtt_s": min(times)}), flush=True)


def _recv(ip: str, seconds: float) -> None:
    warmup_s = min(0.5, seconds / 4)
    with socket.create_server((ip, 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            first = start = end = None
            counted = 0  # bytes that arrived after `start`
            while chunk := conn.recv(1 << 20):
                now = time.perf_counter()
                first = first or now
                if start is not None:
                    counted, end = counted + len(chunk), now
                elif now - first >= warmup_s:
                    start = now
    print(json.dumps({"mbit_s": counted * 8 / (end - start) / 1e6}), flush=True)


def _send(ip: str, port: int, seconds: float) -> None:
    payload = b"\0" * (1 << 20)
    with socket.create_connection((ip, port), timeout=30) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


if __name__ == "__main__":
    if sys.argv[1] == "_recv":
        _recv(sys.argv[2], float(sys.argv[3]))
    elif sys.argv[1] == "_listen":
        _listen(sys.argv[2])
    elif sys.argv[1] == "_connect":
        _connect(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "_send":
        _send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1] == "selftest":
        with NetLab([(20, 20), (20, 20)]) as lab:
            print(f"host 0 -> host 1 at 20 Mbit/s: {measure_tcp(lab, 0, 1):.2f} Mbit/s of TCP payload")
            print(f"round trip: {measure_rtt(lab, 0, 1) * 1000:.2f} ms")
        with NetLab([(20, 20), (20, 20)], delays_ms=[10, 10]) as lab:
            print(f"with 10 ms each way at each host: {measure_tcp(lab, 0, 1):.2f} Mbit/s of TCP payload")
            print(f"round trip: {measure_rtt(lab, 0, 1) * 1000:.2f} ms (2 x (10 + 10) = 40 ms added)")
