"""Swarm addresses from the config, checked before anything starts."""

import socket

import pytest

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.swarm.transport.node import listen_maddrs, parse_initial_peers, relays

PEER_ID = "QmW6jYSj4CRDDYnptoKGFN2nFvhFYYUrynQh5Nsu72XBP8"
PEER = f"/ip4/1.2.3.4/tcp/31337/p2p/{PEER_ID}"


def swarm(**values):
    return config.load().replace("swarm", **values).swarm


def test_listen_and_announce_addresses():
    assert listen_maddrs(swarm(host="127.0.0.1", port=0)) == (["/ip4/127.0.0.1/tcp/0"], [])
    assert listen_maddrs(swarm(host="::", port=5)) == (["/ip6/::/tcp/5"], [])
    assert listen_maddrs(swarm(port=31337, announce_host="5.6.7.8", quic=True)) == (
        ["/ip4/0.0.0.0/tcp/31337", "/ip4/0.0.0.0/udp/31337/quic-v1"],
        ["/ip4/5.6.7.8/tcp/31337", "/ip4/5.6.7.8/udp/31337/quic-v1"],
    )
    assert listen_maddrs(swarm(port=31337, announce_host="5.6.7.8")) == (
        ["/ip4/0.0.0.0/tcp/31337"],
        ["/ip4/5.6.7.8/tcp/31337"],
    )


def test_bad_addresses_name_the_fix():
    with pytest.raises(ConfigError, match="needs a fixed port"):
        listen_maddrs(swarm(announce_host="5.6.7.8"))
    with pytest.raises(ConfigError, match="is not an IP address"):
        listen_maddrs(swarm(host="localhost"))
    with pytest.raises(ConfigError, match="has no /p2p/<peer id> part"):
        parse_initial_peers(["/ip4/1.2.3.4/tcp/31337"])
    with pytest.raises(ConfigError, match="is not a multiaddr"):
        parse_initial_peers(["1.2.3.4:31337"])
    assert parse_initial_peers([PEER]) == [PEER]


def test_the_relays_are_swarm_relays_or_else_the_initial_peers():
    relay = f"/ip4/5.6.7.8/tcp/4001/p2p/{PEER_ID}"
    assert relays(swarm(), [PEER]) == [PEER]
    assert relays(swarm(relays=(relay,)), [PEER]) == [relay]
    assert relays(swarm(), []) == []
    with pytest.raises(ConfigError, match=r"^relay '/ip4/5.6.7.8/tcp/4001' has no /p2p/<peer id> part"):
        relays(swarm(relays=("/ip4/5.6.7.8/tcp/4001",)), [PEER])


def test_a_dht_that_did_not_start_is_explained_by_hiveminds_text_alone():
    """hivemind raises P2PDaemonError for a taken port and for unreachable peers alike, with the
    daemon's output as its text (these two as hivemind 1.1.12's p2pd wrote them): only the text
    chooses the fix named (diagnose.start_failure)."""
    from hivemind.p2p import P2PDaemonError

    from p2p_diloco.errors import EntryUnreachable
    from p2p_diloco.swarm.transport.node import start_error, start_failure

    taken = P2PDaemonError(
        "Daemon failed to start: 2026/12/05 23:49:35 failed to listen on any addresses: "
        "[listen tcp4 127.0.0.1:56231: bind: address already in use]"
    )
    unreachable = P2PDaemonError("Daemon failed to start: 2026/12/05 23:49:22 failed to connect to bootstrap peers")
    late = P2PDaemonError("Daemon failed to start in 10.0 seconds")
    assert [start_failure(e) for e in (taken, unreachable, late)] == ["port in use", "peers unreachable", "other"]
    cfg = swarm(host="127.0.0.1", port=56231)
    assert str(start_error(taken, cfg, [PEER])).startswith("port 56231 on 127.0.0.1 is already in use")
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        refused = start_error(unreachable, cfg, [f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}"])
    assert isinstance(refused, EntryUnreachable) and refused.exit_code == 2
    assert str(refused) == (
        f"could not reach any initial peer: 127.0.0.1 port {port} refused the connection: nothing listens there; "
        f"check the port against the --initial-peers line the node printed, and that the bootstrap node is running"
    )
    assert str(start_error(unreachable, cfg, [])).startswith("could not start the DHT node: Daemon failed to start")
    assert str(start_error(late, cfg, [PEER])) == (
        "could not start the DHT node: Daemon failed to start in 10.0 seconds (swarm.join_timeout_s; on a slow or "
        "busy machine, raise it: --swarm.join_timeout_s 120)"
    )


def test_an_entry_node_that_accepts_but_is_not_the_node_named_says_so():
    from p2p_diloco.swarm.transport.diagnose import unreachable

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        line = unreachable([f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}"] * 4)
    assert line.startswith(f"could not reach any initial peer: 127.0.0.1 port {port} accepts connections, ")
    assert f"no node with the id …{PEER_ID[-6:]} answered there" in line and line.endswith("(and 1 more)")


def test_hole_punching_makes_public_nodes_relays_and_private_ones_reserve_at_their_entry_nodes():
    from hivemind.p2p import P2P

    from p2p_diloco.swarm.transport.node import nat_options

    entries = ["/ip4/11.0.0.10/tcp/4000/p2p/QmRaD8544wRPBqk31WmynQySKsmLjJBqBhwd5UeXwaN6vp"]
    off = {"auto_nat": False, "use_relay": False, "use_auto_relay": False}
    assert nat_options(False, True, entries) == nat_options(False, False, entries) == off
    relay = nat_options(True, True, entries)
    assert relay["use_relay"] and relay["force_reachability"] == "public" and not relay["use_auto_relay"]
    home = nat_options(True, False, entries)
    assert home["use_auto_relay"] and home["auto_nat"] and home["trusted_relays"] == entries
    assert home["force_reachability"] == "private" and home["dht_mode"] == "client"
    assert nat_options(True, False, []) == off  # no entry node, no relay: p2pd would not start with none
    # p2pd's relay discovery (a 3-minute boot delay) is off wherever it looks for relays, and only there
    assert "-relayDiscovery=0" in P2P._make_process_args("p2pd", autoRelay=True, relay=True)
    assert not any(a.startswith("-relayDiscovery") for a in P2P._make_process_args("p2pd", autoRelay=False))
    # a relay's flags-configured service keeps go-libp2p's limits, as its other one does (processes.RELAY_LIMITS)
    relaying = P2P._make_process_args("p2pd", relay=True)
    for flag in ("-relayDataLimit=131072", "-relayTimeLimit=2m0s", "-relayBufferSize=2048"):
        assert flag in relaying
    assert not any(a.startswith("-relayDataLimit") for a in P2P._make_process_args("p2pd", relay=False))


def test_only_a_hole_punching_node_dials_out_of_its_listening_port():
    # Two nodes that dial each other out of their listening ports at once make one TCP connection
    # (simultaneous open) on which both dials fail; a private node's hole punch needs that port.
    from p2p_diloco.swarm.transport.node import p2pd_env

    entries = ["/ip4/11.0.0.10/tcp/4000/p2p/QmRaD8544wRPBqk31WmynQySKsmLjJBqBhwd5UeXwaN6vp"]
    assert p2pd_env(True, False, entries) == {"LIBP2P_TCP_REUSEPORT": "true"}
    ephemeral = {"LIBP2P_TCP_REUSEPORT": "false"}
    assert p2pd_env(False, True, entries) == p2pd_env(False, False, entries) == ephemeral
    assert p2pd_env(True, True, entries) == p2pd_env(True, False, []) == ephemeral  # a relay; nobody to punch through


def test_the_metrics_port_goes_to_the_next_p2pd_only_and_on_loopback():
    # A DHT process asks for it before its node starts (node.SwarmDHT.run): the throwaway p2pd of a
    # later check must not get it too (p2pd exits when its metrics port is taken).
    from hivemind.p2p import P2P

    from p2p_diloco.swarm.transport.processes import metrics_at

    metrics_at(9464)
    assert "-metricsAddr=127.0.0.1:9464" in P2P._make_process_args("p2pd", relay=True)
    assert not any(a.startswith("-metricsAddr") for a in P2P._make_process_args("p2pd", relay=True))
    metrics_at(9464)
    metrics_at(None)
    assert not any(a.startswith("-metricsAddr") for a in P2P._make_process_args("p2pd", relay=True))


def test_a_dht_call_past_its_deadline_names_the_call_and_what_to_do():
    """A peer of 24 on 2 cores (bench/many_peers.py, load 30) stopped with 'the DHT process did not
    answer within 60 s': nothing said which call. Now the line names it."""
    from concurrent.futures import Future

    from p2p_diloco.errors import SwarmError
    from p2p_diloco.swarm.transport.node import SwarmDHT, _named

    node = SwarmDHT.__new__(SwarmDHT)  # its deadline alone: no process to start for this
    node.timeout_s = 0.05
    never = Future()
    with pytest.raises(SwarmError, match=r"did not answer a read of 'r-abc_rounds' within 0.05 s .*overloaded"):
        node._answer(never, False, f"a read of {_named('r-abc_rounds')}")
    assert never.cancelled()
    assert _named(b"\x00" * 20) == "bytes" and _named("k" * 200) == repr("k" * 200)[:80]
