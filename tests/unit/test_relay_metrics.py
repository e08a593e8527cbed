"""A relay's counters from its p2pd's Prometheus page (swarm/transport/relay_metrics.py): read from a
real HTTP server on 127.0.0.1, and anything that is not a page of counts is one SwarmError."""

import http.server
import threading

import pytest

from p2p_diloco.errors import SwarmError
from p2p_diloco.swarm.transport import relay_metrics
from p2p_diloco.swarm.transport.relay_metrics import Relayed

# As go-libp2p writes them (the names and labels of p2pd's page on a relay that punched for homes).
PAGE = """# HELP libp2p_relaysvc_connections_total Relay Connection Total
# TYPE libp2p_relaysvc_connections_total counter
libp2p_relaysvc_connections_total{type="closed"} 2
libp2p_relaysvc_connections_total{type="opened"} 3
# HELP libp2p_relaysvc_data_transferred_bytes_total Bytes Transferred Total
# TYPE libp2p_relaysvc_data_transferred_bytes_total counter
libp2p_relaysvc_data_transferred_bytes_total 17262
libp2p_relaysvc_reservations_total{type="closed"} 1
libp2p_relaysvc_reservations_total{type="opened"} 4
libp2p_relaysvc_reservations_total{type="renewed"} 6
libp2p_relaysvc_status 1
libp2p_rcmgr_connections{dir="inbound",scope="system"} 12
go_goroutines 93
"""


def test_the_counters_of_a_relay_that_punched_are_read_by_hand():
    # 3 circuits opened, 2 closed: 1 open; 4 reservations opened, 1 closed (renewals are not new ones): 3
    assert relay_metrics.parse(PAGE) == Relayed(bytes=17262, circuits=3, open_circuits=1, reservations=3)
    assert relay_metrics.parse(PAGE).line() == "relayed 0.02 MB over 3 circuits (1 open), 3 reservations"
    assert Relayed(5754, 1, 1, 1).line() == "relayed 0.01 MB over 1 circuit (1 open), 1 reservation"


def test_a_relay_that_counted_nothing_yet_is_all_zeros():
    # go-libp2p shows a labelled counter only once it counted: a fresh relay's page has no such line
    fresh = "# HELP libp2p_relaysvc_data_transferred_bytes_total x\nlibp2p_relaysvc_data_transferred_bytes_total 0\n"
    assert relay_metrics.parse(fresh) == Relayed(0, 0, 0, 0)
    assert relay_metrics.parse("") == Relayed(0, 0, 0, 0)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("libp2p_relaysvc_data_transferred_bytes_total lots", "not a number"),
        ("libp2p_relaysvc_data_transferred_bytes_total -5", "not a count"),
        ("libp2p_relaysvc_data_transferred_bytes_total NaN", "not a count"),
        ("libp2p_relaysvc_data_transferred_bytes_total +Inf", "not a count"),
        ('libp2p_relaysvc_connections_total{type="opened" 3', "not a sample"),
        ("<html>502 Bad Gateway</html>", "not a sample"),
    ],
)
def test_a_page_that_is_not_counts_is_one_error(line, problem):
    with pytest.raises(SwarmError, match=f"p2pd's metrics: {problem}"):
        relay_metrics.parse(PAGE + line + "\n")


class _Page(http.server.BaseHTTPRequestHandler):
    body = PAGE.encode()

    def do_GET(self):
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def test_the_page_is_read_off_loopback_and_a_closed_or_oversized_one_is_one_error(server, monkeypatch):
    port = server.server_address[1]
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy that would refuse: never asked
    assert relay_metrics.read(port).bytes == 17262
    monkeypatch.setattr(_Page, "body", b"x" * (relay_metrics.MAX_TEXT + 1))
    with pytest.raises(SwarmError, match=f"p2pd's metrics on 127.0.0.1:{port}: over"):
        relay_metrics.read(port)
    server.shutdown()
    server.server_close()
    with pytest.raises(SwarmError, match=f"p2pd's metrics on 127.0.0.1:{port} cannot be read"):
        relay_metrics.read(port, timeout_s=2)
