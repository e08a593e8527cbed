"""Starting a DHT node: listen and announce addresses, identity file, initial peers, NAT features.

hivemind's errors (a daemon that does not start, a port in use, a key that is not a key, peers that
cannot be reached) become SwarmError with a message that names the problem and the fix.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

import hivemind
from hivemind.p2p import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import SwarmSection
from p2p_diloco.errors import ConfigError, EntryUnreachable, SwarmError
from p2p_diloco.protocol import reachability
from p2p_diloco.protocol.reachability import Reachability, Setting
from p2p_diloco.swarm.transport import diagnose, dialback, preflight
from p2p_diloco.swarm.transport.diagnose import start_failure
from p2p_diloco.swarm.transport.identity import MADE_HERE, not_a_key
from p2p_diloco.swarm.transport.preflight import Preflight
from p2p_diloco.swarm.transport.processes import (
    children_started,
    metrics_at,
    quiet_fork,
    stop_process,
    wait_result,
    wait_started,
)

logger = logging.getLogger(__name__)

DECIDED_S = 5.0  # for the DHT process's decision to arrive once it reported ready (it is sent first)
PREFLIGHT_SHARE = 0.25  # of swarm.join_timeout_s, for asking whether the identity is in use and for a dial-back


class SwarmDHT(hivemind.DHT):
    """hivemind's DHT, forked with no garbage collection in flight (processes.quiet_fork), and
    with a deadline and a liveness check on its start and on every call that waits for its answer.

    hivemind waits for the DHT process without a deadline: for it to start, and for each answer
    (get, store, run_coroutine, hence peer_id and get_visible_maddrs). A DHT process that dies (a
    segfault while it imports a module, say) would leave its caller waiting forever.
    `timeout_s` (swarm.join_timeout_s) bounds the start and each call; a dead process is a
    SwarmError within processes.LIVENESS_S.
    """

    def __init__(
        self,
        *args: Any,
        timeout_s: float,
        preflight: Preflight | None = None,
        setting: Setting = "public",
        host: str = "",
        hole_punching: bool = False,
        relays: Sequence[str] = (),
        metrics_port: int | None = None,
        **kwargs: Any,
    ):
        """`preflight`: what to ask the swarm first; `setting` (swarm.reachability) and `host`
        (swarm.host): what decides the node's tier, with the preflight's answers; `hole_punching`
        (swarm.hole_punching): p2pd's NAT features for that tier (`nat_options`, with `relays`);
        `metrics_port`: where its p2pd serves Prometheus metrics, on 127.0.0.1 (processes.metrics_at)."""
        self.timeout_s = timeout_s  # read by run_in_background, which hivemind's __init__ calls
        self.preflight, self.setting, self.host = preflight, setting, host
        self.hole_punching, self.relays, self.metrics_port = hole_punching, list(relays), metrics_port
        self._decided, self._decide = mp.Pipe(duplex=False)
        super().__init__(*args, check_if_identity_free=False, **kwargs)  # preflight.py asks instead

    def run(self) -> None:
        """The DHT process: first ask the swarm (preflight.py), then decide this node's tier."""
        answers = preflight.ask(self.preflight) if self.preflight else preflight.Answers()
        if answers.unreachable:
            self._ready.set_exception(P2PDaemonError(answers.unreachable))  # start_dht explains it
            return
        if answers.identity_in_use:
            self._ready.set_exception(SwarmError(identity_in_use(self.preflight)))
            return
        reach = reachability.decide(
            self.setting, self.host, answers.dialback_asked, answers.dialback, mapped=bool(answers.mapped)
        )
        self.kwargs["client_mode"] = not reach.serves
        self.kwargs.update(nat_options(self.hole_punching, reach.serves, self.relays))
        os.environ.update(p2pd_env(self.hole_punching, reach.serves, self.relays))  # this process's p2pd
        self._decide.send(reach)
        metrics_at(self.metrics_port)  # after the preflight's throwaway p2pd: this node's own
        super().run()

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        with quiet_fork("DHT process"):
            self.start()
        self._outer_pipe = OneSendAtATime(self._outer_pipe)  # type: ignore[has-type]  # hivemind: untyped
        if await_ready:
            wait_started(self, "DHT process", timeout or self.timeout_s)
            if not self._decided.poll(DECIDED_S):  # sent before the DHT node started: there when it is ready
                raise SwarmError("the DHT process started without deciding this peer's reachability")
            self.reachability: Reachability = self._decided.recv()

    def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        what = f"a read of {_named(args[0] if args else kwargs.get('key'))}"
        return self._answer(super().get(*args, return_future=True, **kwargs), return_future, what)

    def store(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        what = f"a store of {_named(args[0] if args else kwargs.get('key'))}"
        return self._answer(super().store(*args, return_future=True, **kwargs), return_future, what)

    def run_coroutine(self, coro: Any, return_future: bool = False) -> Any:
        what = f"a call of {getattr(coro, '__name__', None) or type(coro).__name__}"
        return self._answer(super().run_coroutine(coro, return_future=True), return_future, what)

    def _answer(self, future: Any, return_future: bool, what: str) -> Any:
        if return_future:
            return future
        try:
            return wait_result(self, future, "DHT process", self.timeout_s)
        except FuturesTimeout:
            future.cancel()
            raise SwarmError(
                f"the DHT process did not answer {what} within {self.timeout_s:g} s (swarm.join_timeout_s): the "
                f"machine may be overloaded (free some CPU or raise swarm.join_timeout_s), or the DHT nodes it "
                f"asks do not answer"
            ) from None


def _named(key: Any) -> str:
    """A DHT key as a log line shows it: the run's record keys are short strings; anything else by type."""
    return repr(key)[:80] if isinstance(key, str) else type(key).__name__


def identity_in_use(check: Preflight | None) -> str:
    path = check.identity if check else None
    return (
        f"the identity {path} is in use by another running node of the swarm (two nodes with one key take "
        f"each other's messages): stop that node, or give this peer its own folder or --identity"
    )


class OneSendAtATime:
    """hivemind's DHT handle writes each call to one pipe and waits for the answer on a future of
    its own. Two threads writing at once could interleave their bytes, so each write takes this
    lock, and only the write: a thread waiting for a slow answer (3 s for each try of a node that
    sleeps) does not hold up the others' calls. A child forked while a write was in flight makes
    its own lock (the copy would be held for ever)."""

    def __init__(self, pipe: Any):
        self._pipe, self._pid, self._lock = pipe, os.getpid(), threading.Lock()

    def send(self, message: Any) -> None:
        if os.getpid() != self._pid:
            self._pid, self._lock = os.getpid(), threading.Lock()
        with self._lock:
            self._pipe.send(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def parse_initial_peers(maddrs: Sequence[str], what: str = "initial peer") -> list[str]:
    """Check each initial peer (or relay: `what`) is a full multiaddr with a /p2p/ peer id, e.g.
    /ip4/1.2.3.4/tcp/31337/p2p/12D3..."""
    for text in maddrs:
        try:
            maddr = Multiaddr(text)
        except Exception as e:  # multiaddr raises several types for malformed text
            raise ConfigError(
                f"{what} {text!r} is not a multiaddr ({e}); copy the line the bootstrap node printed"
            ) from None
        if "/p2p/" not in str(maddr):
            raise ConfigError(
                f"{what} {text!r} has no /p2p/<peer id> part; copy the full line the bootstrap node printed"
            )
    return list(maddrs)


def relays(cfg: SwarmSection, initial_peers: Sequence[str]) -> list[str]:
    """The relays a private node holds a slot at and reaches other private nodes through under
    swarm.hole_punching: swarm.relays, or else its initial peers."""
    return parse_initial_peers(cfg.relays, "relay") or list(initial_peers)


def listen_maddrs(cfg: SwarmSection, port: int | None = None) -> tuple[list[str], list[str]]:
    """(host multiaddrs, announce multiaddrs) from the config's host, port (or `port`, the one
    chosen for it), announce_host and quic (QUIC on the UDP port of the same number)."""
    port = cfg.port if port is None else port
    try:
        version = "ip6" if ipaddress.ip_address(cfg.host).version == 6 else "ip4"
    except ValueError:
        raise ConfigError(f"swarm.host {cfg.host!r} is not an IP address; use e.g. 0.0.0.0 or 127.0.0.1") from None
    if cfg.announce_host and cfg.port == 0:
        raise ConfigError(
            "an announced address needs a fixed port: set --port / swarm.port (e.g. 31337) and forward it"
        )
    transports = [f"tcp/{port}"] + ([f"udp/{port}/quic-v1"] if cfg.quic else [])
    host = [f"/{version}/{cfg.host}/{t}" for t in transports]
    announce = [f"/ip4/{cfg.announce_host}/{t}" for t in transports] if cfg.announce_host else []
    return host, announce


def start_dht(
    cfg: SwarmSection,
    identity_path: Path | None,
    initial_peers: Sequence[str],
    setting: Setting,
    validators: Sequence[Any] = (),
    metrics_port: int | None = None,
) -> SwarmDHT:
    """Start a DHT node in a background process and join the swarm through `initial_peers`. Its
    tier (`setting`, or under "auto" the dial-back's answer) is `.reachability`; a public node
    answers others' dial-backs. `metrics_port`: its p2pd's Prometheus metrics on 127.0.0.1 (a
    bootstrap node's `--metrics-port`)."""
    dialback_wanted = reachability.needs_dialback(setting, cfg.host, initial_peers)
    # The dial-back asks for the port the node will listen on: chosen now if the config leaves it to the system.
    port = cfg.port or (_free_port(cfg.host) if dialback_wanted else 0)
    host, announce = listen_maddrs(cfg, port)
    _check_port_free(cfg.host, cfg.port)
    if metrics_port is not None:  # 0: a free one (the node's .metrics_port says which)
        metrics_port = metrics_port or _free_port("127.0.0.1")
        _check_port_free("127.0.0.1", metrics_port)
    try:
        with children_started():  # a signal to the peer's group leaves the DHT process to the peer
            dht = SwarmDHT(
                initial_peers=parse_initial_peers(initial_peers),
                start=True,
                host_maddrs=host,
                announce_maddrs=announce or None,
                identity_path=str(identity_path) if identity_path else None,
                record_validators=list(validators),
                nat_port_map=cfg.upnp,  # UPnP/NAT-PMP probe the LAN: only when asked for
                hole_punching=cfg.hole_punching,
                relays=relays(cfg, initial_peers),
                metrics_port=metrics_port,
                startup_timeout=cfg.join_timeout_s,
                timeout_s=cfg.join_timeout_s,
                preflight=_preflight(cfg, identity_path, initial_peers, host[0] if dialback_wanted else "", port),
                setting=setting,
                host=cfg.host,
            )
    except (SwarmError, ConfigError):
        raise
    except Exception as e:  # hivemind raises P2PDaemonError, RuntimeError, TimeoutError... with long texts
        raise start_error(e, cfg, initial_peers) from None
    if dht.reachability.serves:
        dht.run_coroutine(_serve_dialback)
    return dht


def nat_options(hole_punching: bool, serves: bool, relays: Sequence[Any]) -> dict[str, Any]:
    """p2pd's NAT features for a node of this tier. Off unless swarm.hole_punching: AutoNAT and
    relays reach out to other nodes unasked. With it (go-libp2p's relay, then DCUtR hole punch;
    docs/design.md, "Hole punching"):
    - a public node is a relay for private ones and answers AutoNAT. Its reachability is forced
      public: go-libp2p starts the relay service only once it believes so.
    - a private node reserves a slot at its `relays` (swarm.relays, or its entry nodes: static
      relays, no discovery: processes._our_flags), so that others reach it through them and punch a direct
      connection. Its p2pd's own DHT is a client's: as a server, a DHT query could connect two homes
      through a relay before the hole-punch handler is up, and DCUtR would never retry."""
    if not hole_punching or not (serves or relays):  # (a private node with no relay punches nothing)
        return {"auto_nat": False, "use_relay": False, "use_auto_relay": False}
    if serves:
        return {"auto_nat": True, "use_relay": True, "use_auto_relay": False, "force_reachability": "public"}
    return {
        "auto_nat": True,  # p2pd starts its hole-punch service with AutoNAT, or never
        "use_relay": True,
        "use_auto_relay": True,
        "force_reachability": "private",
        "dht_mode": "client",
        "trusted_relays": list(relays),
    }


def p2pd_env(hole_punching: bool, serves: bool, relays: Sequence[Any]) -> dict[str, str]:
    """p2pd's environment for a node of this tier: it dials out of its listening TCP port
    (go-libp2p's SO_REUSEPORT default) only where it punches holes, which needs that port.

    Two nodes that each dial out of their listening port to the other's, within one one-way
    delay, make one TCP connection by simultaneous open, not two: both ends then start noise as
    its initiator and both dials fail ("noise: message is too short"), and go-libp2p refuses to
    redial either address for seconds ("dial backoff"). Peers dial each other at the same moment
    (at a DHT start, at an all-reduce's start): at a round trip of 80 ms a fresh group of four lost
    a member that way in 1 of 5 first all-reduces (bench/allreduce.py --rtt-ms 80; go-libp2p#2925).
    From an ephemeral port the two dials make two connections, and both succeed."""
    punches = hole_punching and not serves and bool(relays)  # as nat_options: a private node that reserves
    return {"LIBP2P_TCP_REUSEPORT": "true" if punches else "false"}


def ask_reachability(cfg: SwarmSection, initial_peers: Sequence[str]) -> Reachability:
    """This machine's tier under swarm.reachability = "auto", from a DHT node with a new identity
    that joins through `initial_peers` and leaves (`p2p-diloco check-network`)."""
    dht = start_dht(cfg, None, initial_peers, "auto")
    try:
        return dht.reachability
    finally:
        stop_process(dht, "DHT process")


async def _serve_dialback(_: Any, node: Any) -> None:  # run in the DHT process: node is its DHTNode
    await dialback.serve(node.p2p)


def _preflight(
    cfg: SwarmSection, identity_path: Path | None, initial_peers: Sequence[str], listen: str, port: int
) -> Preflight | None:
    """What to ask the swarm before the node starts (preflight.py), or None if nothing."""
    identity = None
    if identity_path is not None and identity_path.exists():
        _check_identity(identity_path)
        if initial_peers and identity_path.resolve() not in MADE_HERE:  # nobody to ask; a key made just now
            identity = identity_path
    if identity is None and not listen:
        return None
    share = cfg.join_timeout_s * PREFLIGHT_SHARE
    return Preflight(tuple(initial_peers), cfg.hole_punching, share, identity, listen, port, upnp=cfg.upnp)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _check_port_free(host: str, port: int) -> None:
    """libp2p listens with SO_REUSEPORT, so a second node on a taken port starts and misbehaves
    instead of failing: check with a plain bind first."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SwarmError(
                f"port {port} on {host} is not free ({e.strerror}); stop what uses it or choose "
                f"another port (0 picks a free one)"
            ) from None


def _check_identity(path: Path) -> None:
    """The identity file must hold the libp2p private key hivemind wrote there, nothing else."""
    from hivemind.proto import crypto_pb2

    try:
        key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        ok = bool(key.data)
    except Exception:  # protobuf raises DecodeError and others on foreign bytes
        ok = False
    if not ok:
        raise SwarmError(not_a_key(path))


def start_error(error: Exception, cfg: SwarmSection, initial_peers: Sequence[str]) -> SwarmError:
    """hivemind's start error as one line with the fix (diagnose.py); entry nodes that cannot be
    reached are EntryUnreachable (exit 2: the address or the network is wrong, not the program)."""
    text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    cause = start_failure(error)
    if cause == "port in use":
        return SwarmError(
            f"port {cfg.port} on {cfg.host} is already in use ({text}); choose another --swarm.port or 0 for any"
        )
    if initial_peers and cause == "peers unreachable":
        return EntryUnreachable(diagnose.unreachable(initial_peers))
    if "failed to start in" in text:  # hivemind's startup_timeout: p2pd did not say it was up in time
        return SwarmError(
            f"could not start the DHT node: {text} (swarm.join_timeout_s; on a slow or busy machine, raise it: "
            f"--swarm.join_timeout_s 120)"
        )
    return SwarmError(f"could not start the DHT node: {text}")
