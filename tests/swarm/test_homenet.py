"""The home-network lab of bench/homenet.py: each kind of home router shows the internet what a
real one would, nothing reaches a home unasked but a forwarded port, and the lab leaves nothing
behind."""

import json
import re
import subprocess
import sys

import pytest

from bench.homenet import Home, HomeNet, answer, lab_available, listen_forever, reachable, seen_from
from bench.netlab import line_reader, namespaces, next_line
from bench.netswarm import CLI, ENV, ROOT, NetSwarm

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=f"no home-network lab here: {lab_available()}")

HOMES = [Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000), Home("cone", unsolicited="drop")]


@pytest.mark.timeout(120)
def test_each_kind_of_home_router_maps_and_filters_as_a_real_one():
    with HomeNet(public=3, homes=HOMES) as net:
        prefix = net.prefix
        # From one local port to three public hosts: the address and port each of them sees.
        seen = {j: [seen_from(net, net.home_host(j), dst, src_port=40000 + j)[0] for dst in range(3)] for j in range(4)}
        for j in range(5):
            listen_forever(net, net.home_host(j), 4000)
        inbound = {j: reachable(net, 0, net.wan_ip(j), 4000) for j in range(5)}
        unasked = {j: answer(net, 0, net.wan_ip(j), 4000) for j in (0, 4)}
        to_private = reachable(net, 0, net.hosts[net.home_host(0)].ip, 4000, timeout_s=1.0)
        home_to_home = reachable(net, net.home_host(0), net.wan_ip(3), 4000)
    # Endpoint-independent mapping: one public address and port, whatever the destination.
    assert seen[0] == ["11.0.0.100:40000"] * 3 and seen[3] == ["11.0.0.103:40003"] * 3
    # Symmetric: a port per destination (fully random: all three equal about once in 10^9).
    assert {s.split(":")[0] for s in seen[1]} == {"11.0.0.101"} and len(set(seen[1])) > 1
    # Double NAT: the carrier's address, not the home router's.
    assert seen[2] == ["11.0.0.152:40002"] * 3
    # Replies only: a listener at home is reached only through the port its router forwards.
    assert inbound == {0: False, 1: False, 2: False, 3: True, 4: False}
    # What nobody asked for: a RST from the router's own kernel, or silence (most home routers)
    assert unasked == {0: "refused", 4: "no answer"}
    assert not to_private and home_to_home
    assert namespaces(prefix) == []


@pytest.mark.timeout(180)
def test_a_peer_learns_at_start_whether_others_can_dial_it_and_a_wrong_entry_address_is_one_line(tmp_path):
    """`check-network` in each kind of home (protocol/reachability.py, swarm/transport/dialback.py):
    the bootstrap node dials back the address it saw each home at. Only the home whose router
    forwards the peer's port is public; each line names the address the internet saw. Beside them,
    two volunteers with a wrong entry address (a port nothing listens on; a port the node's
    firewall drops) and one whose machine has no route out are told so in one line each, and
    exit 2 (swarm/transport/diagnose.py). With swarm.upnp (`--upnp`), a home whose router maps
    ports on request is public at the mapped port; one whose router does not is told to turn it on."""
    if lab_available(upnp=True) is not None:
        pytest.skip(f"no UPnP router in the lab here: {lab_available(upnp=True)}")
    homes = [Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000), Home("cone")]
    homes.append(Home("cone", upnp=True))
    with HomeNet(public=1, homes=homes) as net:
        bootstrap = NetSwarm(net, tmp_path, {}, bootstrap_host=0).maddr
        drop = "add table inet t; add chain inet t in { type filter hook input priority 0; }; add rule inet t in"
        subprocess.run(["ip", "netns", "exec", net.hosts[0].netns, "nft", f"{drop} tcp dport 5555 drop"], check=True)
        wrong = {"refused": _with_port(bootstrap, 1), "dropped": _with_port(bootstrap, 5555)}
        net.take_offline(4)
        asks = [(j, bootstrap, "4000" if j == 3 else "0") for j in range(4)]
        asks += [(0, wrong["refused"], "0"), (1, wrong["dropped"], "0"), (4, bootstrap, "0")]
        asks += [(5, bootstrap, "0", "--upnp"), (0, bootstrap, "0", "--upnp")]
        checks = [
            net.popen(
                net.home_host(j),
                [*CLI, "check-network", "--initial-peers", entry, "--port", port, *flags],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
                cwd=ROOT,
            )
            for j, entry, port, *flags in asks
        ]
        out = [(*proc.communicate(timeout=120), proc.returncode) for proc in checks]
    lines = [stdout.strip() for stdout, _, _ in out[:4]]
    assert [rc for _, _, rc in out] == [3, 3, 3, 0, 2, 2, 2, 0, 3], out
    assert lines[0].startswith("reachability: private at 11.0.0.100 port ") and "connection refused" in lines[0]
    assert lines[1].startswith("reachability: private at 11.0.0.101 port ")
    assert lines[2].startswith("reachability: private at 11.0.0.152 port "), lines[2]  # the carrier's address
    assert lines[3].startswith("reachability: public at 11.0.0.103 port 4000: entry node …"), lines[3]
    assert all("forward a TCP port" in lines[j] for j in range(3)) and "forward" not in lines[3]
    refused, dropped, offline = (stderr.strip().splitlines() for _, stderr, _ in out[4:7])
    port = _port(wrong["refused"])
    assert refused == [
        f"error: could not reach any initial peer: 11.0.0.10 port {port} refused the connection: "
        f"nothing listens there; check the port against the --initial-peers line the node printed, "
        f"and that the bootstrap node is running"
    ]
    assert dropped == [
        "error: could not reach any initial peer: 11.0.0.10 port 5555 did not answer within 3 s: a "
        "firewall drops the connection (this network's or the node's) or the host is down; ask the "
        "node's operator whether the port is open, or try another network"
    ]
    mapped, unmapped = out[7][0].strip(), out[8]
    assert re.match(r"reachability: public at 11\.0\.0\.105 port \d+: entry node …\w{6} dialled it back on the port "
                    r"its router mapped \(UPnP\)", mapped), out[7]  # fmt: skip
    assert unmapped[0].startswith("reachability: private at 11.0.0.100 port "), unmapped
    assert "swarm.upnp: no router mapped a port within 8 s: turn on UPnP (or NAT-PMP)" in unmapped[1], unmapped
    assert offline == [
        "error: could not reach any initial peer: no route to 11.0.0.10 (Network is unreachable): check the "
        "address, and that this machine is online"
    ]


def _port(maddr: str) -> int:
    return int(maddr.split("/tcp/")[1].split("/")[0])


def _with_port(maddr: str, port: int) -> str:
    return maddr.replace(f"/tcp/{_port(maddr)}/", f"/tcp/{port}/")


class LabNode:
    """A DHT node of the product on a lab host (tests/swarm/punch_node.py), asked through stdin."""

    def __init__(self, net: HomeNet, host: int, tier: str, key, entries: list[str]):
        cmd = [sys.executable, "-m", "tests.swarm.punch_node", tier, net.hosts[host].ip, str(key), *entries]
        self.proc = net.popen(host, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        self.lines = line_reader(self.proc)

    def started(self, timeout_s: float = 60) -> "LabNode":
        shown = json.loads(next_line(self.lines, timeout_s, "a lab node's start"))
        self.id, self.maddr = shown["id"], shown["maddrs"][0]  # (a home's is behind its router)
        return self

    def ask(self, line: str, timeout_s: float) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(next_line(self.lines, timeout_s, line))


@pytest.mark.timeout(180)
def test_two_cone_nat_homes_punch_a_direct_connection_through_relays_at_their_entry_nodes(tmp_path):
    """swarm.hole_punching (swarm/transport/punch.py, node.nat_options): two private nodes behind
    cone-NAT routers that drop what nobody asked for reach each other through a relay at their entry
    nodes, and libp2p punches a direct connection (DCUtR). Four public nodes, on distinct addresses:
    below four observers go-libp2p never learns a home's public address, and punches nothing."""
    homes = [Home("cone", unsolicited="drop"), Home("cone", unsolicited="drop")]
    with HomeNet(public=4, homes=homes) as net:
        first = LabNode(net, 0, "public", tmp_path / "p0.key", []).started()
        others = [LabNode(net, i, "public", tmp_path / f"p{i}.key", [first.maddr]) for i in (1, 2, 3)]
        entries = [first.maddr] + [node.started().maddr for node in others]
        a, b = (LabNode(net, net.home_host(j), "private", tmp_path / f"h{j}.key", entries) for j in (0, 1))
        a.started(), b.started()
        took = a.ask(f"punch {b.id} 25", 40)["punched"][b.id]  # (within the node's 30-s answer deadline)
        seen_by_b = b.ask("direct", 10)["direct"]
        circuits = {"a": a.ask("circuits", 10)["circuits"], "b": b.ask("circuits", 10)["circuits"]}
    assert took is not None, "no direct connection between the homes within 25 s"
    # 0.11 s measured here. With p2pd's relay discovery left on and AutoNAT's own idea of the relays'
    # reachability (swarm.hole_punching before node.nat_options), the same punch took 20.6 s.
    assert took < 10, f"the punch took {took:.1f} s"
    assert a.id in seen_by_b, "the punched connection is direct on both sides"
    # The relayed connections, counted where they were dialled: A's punch went through a relay
    # (one per relay tried, each cut at 128 KiB each way: processes.RELAY_LIMITS), and B dialled
    # none: a DHT query never connected the homes through a relay (p2pd's DHT a client's).
    assert 1 <= circuits["a"] <= len(entries) and circuits["b"] == 0, circuits


@pytest.mark.scenario  # in the suite: the punch itself (test_two_cone_nat_homes_punch_*), and the spans in-process
@pytest.mark.timeout(600)
def test_two_homes_with_only_entry_nodes_public_average_every_round_over_their_punched_connection(tmp_path):
    """swarm.hole_punching end to end (swarm/punching.py, links.reachable_reducers): two volunteers
    behind cone NAT, no public peer, four bootstrap nodes as relays. Each punches to the other, and
    they average every round in a group of two, each reducing a span for the other over the punched
    connection; their parts never cross an entry node."""
    from bench.homeswarm import run

    rounds = 4
    homes = [Home("cone", unsolicited="drop"), Home("cone", unsolicited="drop")]
    result = run(homes, rounds, {"swarm.hole_punching": "true"}, tmp_path, None, entry_nodes=4, public_peer=False)
    assert result["digests_agree"]
    for peer in result["peers"].values():
        assert peer["tier"].startswith("private, hole punching") and peer["group_sizes"] == [2] * rounds, peer
    # Each home's router carried the all-reduce on the connection to the other home: at least what
    # that home counted of it (half of the two homes' counts), and more than on any entry node's.
    for j, flows in enumerate(result["router_flows"].values()):
        direct = flows[f"home{1 - j}"]
        assert direct >= result["allreduce_bytes"] / 2, flows
        assert all(direct > n for who, n in flows.items() if who.startswith("entry")), flows


@pytest.mark.scenario  # in the suite: a joiner among homes in-process (test_round_protocol.py), the punch itself
@pytest.mark.timeout(900)
def test_a_home_that_joins_a_swarm_of_homes_late_catches_up_from_the_homes_it_punched_to(tmp_path):
    """agreement.backed's `reachable`: with no public peer, only homes hold the swarm's state. A
    third home starts after round 3, punches to the two others and downloads their state over a
    punched connection. (Before, nobody could serve it: it trained from θ(0), a model of its own.)
    Whether it then averages in the others' groups is the protocol's late-joiner timing, not this:
    in rounds of ~4 s it caught up again each round in one run of 14, and averaged rounds 8-14 with
    them in another (docs/benchmarks.md)."""
    from bench.homeswarm import run

    rounds = 14
    homes = [Home("cone", unsolicited="drop")] * 3
    settings = {"swarm.hole_punching": "true"}
    result = run(homes, rounds, settings, tmp_path, None, entry_nodes=4, public_peer=False, late=(2, 3))
    assert result["digests_agree"]
    late = result["peers"]["home2-cone+drop"]
    assert late["caught_up"], late  # it took the homes' state: it trained nothing of its own first
    assert late["failed_tries"] == 0, late
    # the state came over a punched connection: the late home's router carried it from a home
    flows = result["router_flows"]["home2-cone+drop"]
    assert max(flows["home0"], flows["home1"]) > max(n for who, n in flows.items() if who.startswith("entry")), flows
