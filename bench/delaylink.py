"""A link's one-way delay, in user space: the network lab's stand-in for netem (bench/netlab.py).

This kernel has neither netem nor the fq or etf qdiscs that an eBPF EDT delay needs. So a host of
the lab that is given a delay keeps its address on a TAP device, `tap0`, and this forwarder,
running in the host's namespace, carries every frame between `tap0` and the host's veth `eth0`
after `delay_ms`, both ways, in arrival order:

    the host's stack ⇄ tap0 ⇄ [this forwarder: delay_ms each way] ⇄ eth0 ⇄ the lab's bridge

The round trip between two hosts grows by twice the sum of their delays. The veth's rate limit
(tc tbf on its egress) still applies to what the forwarder sends out, after the delay. Frames for
tap0's MAC reach eth0 as another host's (the stack drops them there: PACKET_OTHERHOST) and this
forwarder's packet socket, which sees every frame; eth0 has no address and answers no ARP
(arp_ignore=1, set by the lab), so the stack sees each frame once, through tap0.

    ip netns exec <ns> python bench/delaylink.py 20      # 20 ms each way; prints "ready" once running

Standard library only. A frame is held in memory for the delay: at 100 Mbit/s and 40 ms, 500 KB.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
ETH_P_ALL = 0x0003
FRAME = 65536  # bytes read at most per frame (no GRO on a veth: 1514 in practice)
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # asm-generic/socket.h; Python's socket module lacks them


def open_tap(name: str) -> int:
    """A file descriptor on the existing TAP device `name` (ip tuntap add ... mode tap)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def open_wire(name: str) -> socket.socket:
    """A packet socket bound to `name` that sees every frame it receives and sends whole frames."""
    wire = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    wire.bind((name, ETH_P_ALL))
    wire.setblocking(False)
    # Past the system's caps (root): a frame sent waits in the veth's tbf queue, and counts against
    # this socket's send buffer until it leaves. The default (~90 frames, ~50 ms at 20 Mbit/s)
    # dropped 2-3 % of the frames here before tbf's own 100 ms queue would have.
    wire.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    wire.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
    return wire


def received(wire: socket.socket) -> list[bytes]:
    """The frames that arrived on the wire from outside, not those this host sent out."""
    frames = []
    while True:
        try:
            frame, address = wire.recvfrom(FRAME)
        except BlockingIOError:
            return frames
        if address[2] != socket.PACKET_OUTGOING:
            frames.append(frame)


def read_tap(fd: int) -> list[bytes]:
    frames = []
    while True:
        try:
            frames.append(os.read(fd, FRAME))
        except BlockingIOError:
            return frames


def forward(tap: int, wire: socket.socket, delay_s: float) -> None:
    """Carry frames both ways, each `delay_s` after it arrived, until killed."""
    outbound: collections.deque[tuple[float, bytes]] = collections.deque()  # host -> wire
    inbound: collections.deque[tuple[float, bytes]] = collections.deque()  # wire -> host
    while True:
        due = [q[0][0] for q in (outbound, inbound) if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
        ready, _, _ = select.select([tap, wire], [], [], timeout)
        now = time.monotonic()
        if tap in ready:
            outbound.extend((now + delay_s, frame) for frame in read_tap(tap))
        if wire in ready:
            inbound.extend((now + delay_s, frame) for frame in received(wire))
        while outbound and outbound[0][0] <= now:
            _send(lambda f: wire.send(f), outbound.popleft()[1], "out")
        while inbound and inbound[0][0] <= now:
            _send(lambda f: os.write(tap, f), inbound.popleft()[1], "in")


def _send(write, frame: bytes, way: str) -> None:
    """One frame out; a full queue drops it, as a link's would (TCP sends it again)."""
    try:
        write(frame)
    except OSError as e:  # ENOBUFS: the veth's tbf queue is full (a link's drop); EAGAIN: this socket's buffer
        why = errno.errorcode.get(e.errno or 0, "?")
        dropped[way, why] = dropped.get((way, why), 0) + 1


dropped: dict[tuple[str, str], int] = {}  # frames a full queue took, by way and error (reported on SIGTERM)


def main(argv: list[str]) -> None:
    delay_ms = float(argv[0])
    tap, wire = open_tap("tap0"), open_wire("eth0")

    def report(signum: int, frame: object) -> None:
        print(f"delaylink {delay_ms:g} ms: frames dropped by a full queue {dropped}", file=sys.stderr, flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, report)
    print("ready", flush=True)
    forward(tap, wire, delay_ms / 1000.0)


if __name__ == "__main__":
    main(sys.argv[1:])
