"""A peer's tier (protocol/reachability.py) and the dial-back's wire and dial (swarm/transport/dialback.py).

The dials here go to listeners of this test on 127.0.0.1; the dial-back across home routers is
tests/swarm/test_homenet.py's."""

import asyncio
import json
import socket

import pytest

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol.reachability import DialBack, beaten_since, decide, line, needs_dialback, nobody_serves
from p2p_diloco.swarm.transport import dialback
from p2p_diloco.trust.wire import WireError

HELPER = "12D3KooWRpp5oLfaJCWcqYHa3S3MVB5UMhaNYxVPVr4CqLP3f3N2"
ENTRY = [f"/ip4/11.0.0.10/tcp/31337/p2p/{HELPER}"]


def test_only_auto_off_loopback_with_an_entry_node_asks():
    assert needs_dialback("auto", "0.0.0.0", ENTRY)
    assert needs_dialback("auto", "192.168.1.2", ENTRY)
    assert not needs_dialback("auto", "127.0.0.1", ENTRY)  # every peer it can meet is on this machine
    assert not needs_dialback("auto", "::1", ENTRY)
    assert not needs_dialback("auto", "0.0.0.0", [])  # the first node of a swarm: nobody to ask
    assert not needs_dialback("public", "0.0.0.0", ENTRY) and not needs_dialback("private", "0.0.0.0", ENTRY)


def test_one_dial_that_got_through_makes_a_peer_public_and_failures_alone_make_it_private():
    refused = DialBack("a" * 46, "11.0.0.100", 4000, "connection refused")
    reached = DialBack("b" * 46, "11.0.0.100", 4000)
    assert decide("auto", "0.0.0.0", True, [refused, reached]).tier == "public"
    private = decide("auto", "0.0.0.0", True, [refused, refused])
    assert (private.tier, private.seen, private.port) == ("private", "11.0.0.100", 4000)
    assert "connection refused" in private.how
    # Nobody answered: as before this setting existed, with a line that names the override.
    unknown = decide("auto", "0.0.0.0", True, [])
    assert unknown.tier == "public" and 'swarm.reachability = "private"' in unknown.how
    assert decide("private", "0.0.0.0", True, [reached]).tier == "private"  # the config wins
    assert decide("public", "0.0.0.0", True, [refused]).tier == "public"
    assert decide("auto", "127.0.0.1", False, []).tier == "public"


def test_the_tier_line_names_the_address_and_for_a_private_peer_the_fix():
    private = line(decide("auto", "0.0.0.0", True, [DialBack(HELPER, "11.0.0.100", 4000, "connection refused")]))
    assert private.startswith(
        "reachability: private at 11.0.0.100 port 4000: the dial-back failed (connection refused)"
    )
    for fix in ("forward a TCP port", "swarm.port", "swarm.upnp", "IPv6", "WSL2"):
        assert fix in private
    public = line(decide("auto", "0.0.0.0", True, [DialBack(HELPER, "11.0.0.103", 4000)]))
    assert public == (
        f"reachability: public at 11.0.0.103 port 4000: entry node …{HELPER[-6:]} dialled it back; "
        f"this peer reduces and serves its state"
    )
    assert "\n" not in private and "\n" not in public
    refused = [DialBack(HELPER, "11.0.0.100", 4000, "connection refused")]
    punching = line(decide("auto", "0.0.0.0", True, refused), hole_punching=True)
    assert punching.startswith("reachability: private, hole punching at 11.0.0.100 port 4000:")
    assert "reduces for a group only if every other member holds one to it" in punching
    assert line(decide("auto", "0.0.0.0", True, [DialBack(HELPER, "11.0.0.103", 4000)]), True) == public


def test_the_old_settings_name_their_replacements():
    with pytest.raises(ConfigError, match=r'client_mode.*swarm.reachability = "private"'):
        config.load(None, {"swarm.client_mode": "true"})
    with pytest.raises(ConfigError, match=r"nat_traversal.*swarm.upnp.*swarm.hole_punching"):
        config.load(None, {"swarm.nat_traversal": "true"})
    with pytest.raises(ConfigError, match="swarm.reachability"):
        config.load(None, {"swarm.reachability": "sometimes"})


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"seen": "11.0.0.1", "port": 4000}',  # no failure field
        b'{"seen": "not an address", "port": 4000, "failure": ""}',
        b'{"seen": "11.0.0.1", "port": 0, "failure": ""}',
        b'{"seen": "11.0.0.1", "port": 70000, "failure": ""}',
        b'{"seen": "11.0.0.1", "port": true, "failure": ""}',
        b'{"seen": "11.0.0.1", "port": 4000, "failure": 7}',
        json.dumps({"seen": "11.0.0.1", "port": 4000, "failure": "x" * 201}).encode(),
        b'{"seen": "' + b"1" * 100 + b'", "port": 4000, "failure": ""}',
    ],
)
def test_a_malformed_answer_is_a_wire_error(raw):
    with pytest.raises(WireError):
        dialback.parse_answer(raw, HELPER)


def test_answers_and_requests_that_parse():
    answer = dialback.parse_answer(b'{"seen": "2001:db8::1", "port": 4000, "failure": "", "extra": 1}', HELPER)
    assert answer == DialBack(HELPER, "2001:db8::1", 4000, "") and answer.reached
    assert dialback.parse_request(b'{"port": 31337}') == 31337
    for bad in (b'{"port": 0}', b'{"port": "31337"}', b"{}", b"port=1"):
        with pytest.raises(WireError):
            dialback.parse_request(bad)
    assert dialback.helpers([*ENTRY, ENTRY[0].replace("11.0.0.10", "11.0.0.11")] + [ENTRY[0]] * 5) == [
        dialback.PeerID.from_base58(HELPER)
    ]  # one entry node at two addresses is asked once
    assert dialback.helpers(["/ip4/11.0.0.10/tcp/1/p2p/not-base58!", *ENTRY]) == [dialback.PeerID.from_base58(HELPER)]


async def _listener(greeting: bytes | None) -> tuple[asyncio.base_events.Server, int]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if greeting is not None:
            writer.write(greeting)
            await writer.drain()
        await reader.read(1)  # until the dialler closes
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_public_peer_counts_as_live_for_a_private_one_only_once_it_beats_again():
    before = {"pub": 100.0, "other": 5.0}  # each peer's last beat, by its own clock
    assert not beaten_since({"pub"}, before, before)  # SIGKILLed: its last beat stays what it was
    assert not beaten_since({"pub"}, before, {"pub": 100.0, "other": 6.0})  # only a client beat
    assert beaten_since({"pub"}, before, {"pub": 100.5})
    assert beaten_since({"new"}, before, {"new": 1.0})  # first seen: any beat is new (clocks differ)
    assert not beaten_since(set(), before, {"pub": 101.0})  # no peer that serves


def test_a_private_peer_without_a_public_one_is_told_what_happened_and_what_to_do():
    start = nobody_serves("r", None, 20)
    assert start.startswith("no reachable peer of run 'r' within 20 s: a private peer (swarm.reachability) needs")
    later = nobody_serves("r", 7, 20)
    assert later.startswith("no reachable peer of run 'r' at round 7 within 20 s: its public peers left")
    assert all('set swarm.reachability = "public"' in said for said in (start, later))
    # under hole punching, beside homes it could not punch to (a symmetric NAT's: measured in the lab)
    homes = nobody_serves("r", None, 30, unpunched=2)
    assert homes == (
        "no reachable peer of run 'r' within 30 s: 2 private peers of the run train, but no direct connection "
        "to any of them formed (hole punching needs both routers to keep one public port per connection, cone "
        "NAT; one that gives each destination its own port, symmetric NAT, cannot be punched); start a public "
        'peer, or set swarm.reachability = "public" if others can dial this one'
    )
    assert nobody_serves("r", 4, 30, unpunched=1).startswith(
        "no reachable peer of run 'r' at round 4 within 30 s: 1 private peer of the run trains, but no direct "
        "connection to it formed"
    )


def test_a_dial_counts_only_a_libp2p_greeting(monkeypatch):
    monkeypatch.setattr(dialback, "DIAL_S", 0.5)  # the silent listener's wait

    async def run() -> tuple[str, str, str, str]:
        libp2p, port_a = await _listener(dialback.GREETING)
        other, port_b = await _listener(b"SSH-2.0-OpenSSH_9.6\r\n")
        silent, port_c = await _listener(None)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port_d = closed.getsockname()[1]  # bound, never listening: refused
            got = await asyncio.gather(*(dialback.dial("127.0.0.1", p) for p in (port_a, port_b, port_c, port_d)))
        for server in (libp2p, other, silent):
            server.close()
        return tuple(got)

    reached, wrong, quiet, refused = asyncio.run(run())
    assert reached == ""
    assert wrong == "something other than a libp2p node answered"
    assert quiet == "something other than a libp2p node answered"  # nothing within DIAL_S
    assert refused == "connection refused"


def test_an_entry_node_dials_each_address_once_at_a_time():
    helper = dialback.Helper()
    helper.dialling.add("11.0.0.100")
    assert asyncio.run(helper._dial_once("11.0.0.100", 4000)).startswith("busy")
    helper.dialling = {f"11.0.1.{i}" for i in range(dialback.MAX_DIALS)}
    assert asyncio.run(helper._dial_once("11.0.0.101", 4000)).startswith("busy")


def test_the_mapped_port_is_that_of_a_public_address_p2pd_announces_never_port_0():
    from p2p_diloco.swarm.transport.preflight import mapped_port

    me = "/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    local = [f"/ip4/127.0.0.1/tcp/4000{me}", f"/ip4/192.168.1.2/tcp/4000{me}"]
    assert mapped_port(local) == 0
    assert mapped_port([*local, f"/ip4/11.0.0.100/tcp/0{me}"]) == 0  # a mapping the router refused
    assert mapped_port([f"/ip4/100.64.1.2/tcp/5000{me}", f"/ip6/2001:db8::1/tcp/6000{me}"]) == 0  # a carrier's; IPv6
    assert mapped_port([*local, f"/ip4/11.0.0.100/tcp/19771{me}"]) == 19771
