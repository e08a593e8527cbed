"""A peer's own Prometheus /metrics (log.metrics_port): its latest round record, served while it runs."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from p2p_diloco.errors import ConfigError
from p2p_diloco.train.metrics import PHASES, Phase, peer_prometheus
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
    assert f'p2p_diloco_peer_phase{{run_id="p2p-diloco",peer="{peer.peer_id}",phase="idle"}} 1' in text  # done
    with pytest.raises(OSError):  # closed with the peer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_phase_says_what_the_peer_does_and_since_when():
    clock = Clock(100.0)
    phase = Phase(clock)
    assert phase.now() == ("idle", 0.0)
    phase.set("inner")
    clock.now = 112.5
    assert phase.now() == ("inner", 12.5)
    phase.set("inner")  # the same phase again: still since 100
    clock.now = 113.0
    assert phase.now() == ("inner", 13.0)
    phase.set("averaging")
    clock.now = 113.25
    assert phase.now() == ("averaging", 0.25)
    with pytest.raises(ValueError, match="unknown phase 'training'"):
        phase.set("training")


def test_the_phase_becomes_one_gauge_per_phase_and_its_seconds():
    clock = Clock(10.0)
    phase = Phase(clock)
    phase.set("catch-up")
    clock.now = 12.5
    lines = peer_prometheus({"round": 3}, "run-1", "QmPeer", phase).splitlines()
    labels = 'run_id="run-1",peer="QmPeer"'
    assert [line for line in lines if line.startswith("p2p_diloco_peer_phase")] == [
        f'p2p_diloco_peer_phase{{{labels},phase="inner"}} 0',
        f'p2p_diloco_peer_phase{{{labels},phase="averaging"}} 0',
        f'p2p_diloco_peer_phase{{{labels},phase="agreement"}} 0',
        f'p2p_diloco_peer_phase{{{labels},phase="catch-up"}} 1',
        f'p2p_diloco_peer_phase{{{labels},phase="idle"}} 0',
        f"p2p_diloco_peer_phase_seconds{{{labels}}} 2.500",
    ]
    assert "# TYPE p2p_diloco_peer_phase gauge" in lines and "# TYPE p2p_diloco_peer_phase_seconds gauge" in lines
    before_any_record = peer_prometheus(None, "run-1", "QmPeer", Phase(Clock(0.0)))
    assert f'p2p_diloco_peer_phase{{{labels},phase="idle"}} 1' in before_any_record.splitlines()


@pytest.mark.parametrize(
    "overlap, expected",
    [
        ("off", ["catch-up", "inner", "averaging", "agreement"] * 2 + ["idle"]),
        # round 0 averages while round 1 trains; round 1's all-reduce waits, then both agreements
        ("delayed", ["catch-up", "inner", "averaging", "inner", "averaging", "agreement", "idle"]),
    ],
)
def test_a_peer_goes_through_the_phases_of_its_rounds(tmp_path, monkeypatch, overlap, expected):
    peer = make_peer(tmp_path, FakeSwarm(), **{"run.rounds": "2", "swarm.overlap": overlap})
    entered = [peer.phase.now()[0]]
    set_phase = peer.phase.set

    def record(name: str) -> None:
        if name != entered[-1]:
            entered.append(name)
        set_phase(name)

    monkeypatch.setattr(peer.phase, "set", record)
    try:
        peer.run()
    finally:
        peer.close()
    assert entered == expected and set(entered) == set(PHASES)


def test_a_taken_metrics_port_is_one_line_before_anything_is_trained(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"log.metrics_port \d+ on 127.0.0.1 cannot be served"):
            make_peer(tmp_path, FakeSwarm(), **{"log.metrics_port": str(taken.getsockname()[1])})
