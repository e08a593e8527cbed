"""A peer's own Prometheus /metrics (log.metrics_port): its latest round record, served while it runs."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.metrics import peer_prometheus
from tests.unit.fake_swarm import FakeSwarm
from tests.unit.test_round_protocol import make_peer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_latest_round_record_becomes_gauges():
    record = {
        "round": 7,
        "total_tokens": 3000,
        "tokens_per_s": 512.5,
        "train_loss": float("nan"),
        "group_size": 3,
        "allreduce_s": 0.25,
        "bytes_sent": 1024,
        "adopted": True,
        "digest": "ab",
    }
    text = peer_prometheus(record, "run-1", "QmPeer")
    labels = 'run_id="run-1",peer="QmPeer"'
    for line in (
        f"p2p_diloco_peer_round{{{labels}}} 7",
        f"p2p_diloco_peer_total_tokens{{{labels}}} 3000",
        f"p2p_diloco_peer_tokens_per_s{{{labels}}} 512.5",
        f"p2p_diloco_peer_group_size{{{labels}}} 3",
        f"p2p_diloco_peer_allreduce_s{{{labels}}} 0.25",
        f"p2p_diloco_peer_adopted{{{labels}}} 1",
    ):
        assert line in text.splitlines()
    assert "train_loss" not in text and "eval_loss" not in text  # not finite, or absent: not exported
    assert peer_prometheus(None, "run-1", "QmPeer") == "\n"  # before its first record: nothing to say


def test_a_peer_serves_its_metrics_while_it_runs(tmp_path):
    port = free_port()
    peer = make_peer(tmp_path, FakeSwarm(), **{"log.metrics_port": str(port), "run.rounds": "2"})
    try:
        peer.run()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        peer.close()
    last = list(peer.metrics.records())[-1]
    assert f'p2p_diloco_peer_round{{run_id="p2p-diloco",peer="{peer.peer_id}"}} 2' in text
    assert f'p2p_diloco_peer_total_tokens{{run_id="p2p-diloco",peer="{peer.peer_id}"}} {last["total_tokens"]}' in text
    with pytest.raises(OSError):  # closed with the peer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_a_taken_metrics_port_is_one_line_before_anything_is_trained(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"log.metrics_port \d+ on 127.0.0.1 cannot be served"):
            make_peer(tmp_path, FakeSwarm(), **{"log.metrics_port": str(taken.getsockname()[1])})
