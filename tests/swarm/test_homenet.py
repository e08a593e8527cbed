"""The home-network lab of bench/homenet.py: each kind of home router shows the internet what a
real one would, nothing reaches a home unasked but a forwarded port, and the lab leaves nothing
behind."""

import subprocess

import pytest

from bench.homenet import Home, HomeNet, lab_available, listen_forever, reachable, seen_from
from bench.netlab import namespaces
from bench.netswarm import CLI, ENV, ROOT, NetSwarm

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=f"no home-network lab here: {lab_available()}")

HOMES = [Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000)]


@pytest.mark.timeout(120)
def test_each_kind_of_home_router_maps_and_filters_as_a_real_one():
    with HomeNet(public=3, homes=HOMES) as net:
        prefix = net.prefix
        # From one local port to three public hosts: the address and port each of them sees.
        seen = {j: [seen_from(net, net.home_host(j), dst, src_port=40000 + j)[0] for dst in range(3)] for j in range(4)}
        for j in range(4):
            listen_forever(net, net.home_host(j), 4000)
        inbound = {j: reachable(net, 0, net.wan_ip(j), 4000) for j in range(4)}
        to_private = reachable(net, 0, net.hosts[net.home_host(0)].ip, 4000, timeout_s=1.0)
        home_to_home = reachable(net, net.home_host(0), net.wan_ip(3), 4000)
    # Endpoint-independent mapping: one public address and port, whatever the destination.
    assert seen[0] == ["11.0.0.100:40000"] * 3 and seen[3] == ["11.0.0.103:40003"] * 3
    # Symmetric: a port per destination (fully random: all three equal about once in 10^9).
    assert {s.split(":")[0] for s in seen[1]} == {"11.0.0.101"} and len(set(seen[1])) > 1
    # Double NAT: the carrier's address, not the home router's.
    assert seen[2] == ["11.0.0.152:40002"] * 3
    # Replies only: a listener at home is reached only through the port its router forwards.
    assert inbound == {0: False, 1: False, 2: False, 3: True}
    assert not to_private and home_to_home
    assert namespaces(prefix) == []


@pytest.mark.timeout(180)
def test_a_peer_learns_at_start_whether_others_can_dial_it(tmp_path):
    """`check-network` in each kind of home (protocol/reachability.py, swarm/transport/dialback.py):
    the bootstrap node dials back the address it saw each home at. Only the home whose router
    forwards the peer's port is public; each line names the address the internet saw."""
    homes = [Home("cone"), Home("symmetric"), Home("double"), Home("cone", forward=4000)]
    with HomeNet(public=1, homes=homes) as net:
        bootstrap = NetSwarm(net, tmp_path, {}, bootstrap_host=0).maddr
        checks = {
            j: net.popen(
                net.home_host(j),
                [*CLI, "check-network", "--initial-peers", bootstrap, "--port", "4000" if j == 3 else "0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
                cwd=ROOT,
            )
            for j in range(4)
        }
        out = {j: (*proc.communicate(timeout=120), proc.returncode) for j, proc in checks.items()}
    lines = {j: stdout.strip() for j, (stdout, _, _) in out.items()}
    assert {j: rc for j, (_, _, rc) in out.items()} == {0: 3, 1: 3, 2: 3, 3: 0}, out
    assert lines[0].startswith("reachability: private at 11.0.0.100 port ") and "connection refused" in lines[0]
    assert lines[1].startswith("reachability: private at 11.0.0.101 port ")
    assert lines[2].startswith("reachability: private at 11.0.0.152 port "), lines[2]  # the carrier's address
    assert lines[3].startswith("reachability: public at 11.0.0.103 port 4000: entry node …"), lines[3]
    assert all("forward a TCP port" in lines[j] for j in range(3)) and "forward" not in lines[3]
