"""A single peer in-process: rounds commit, resume is bit-exact, a stop discards the partial round."""

import json
import threading

import pytest

from p2p_diloco import config
from p2p_diloco.errors import CheckpointError, ConfigError
from p2p_diloco.peer import Peer
from p2p_diloco.train import checkpoint


def digests(run_dir):
    return [json.loads(line)["digest"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_peer(cfg, resume=False, stop=None):
    peer = Peer(cfg, resume=resume)
    try:
        peer.run(stop)
        return peer.state.digest()
    finally:
        peer.close()


class StopAfter(threading.Event):
    """A stop flag that turns on by itself after `n` checks: a Ctrl+C at a chosen inner step."""

    def __init__(self, n):
        super().__init__()
        self.left = n

    def is_set(self):
        self.left -= 1
        return self.left < 0 or super().is_set()


def test_rounds_write_metrics_and_checkpoints(tiny_config):
    run_peer(tiny_config)
    run_dir = tiny_config.run.dir
    records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert r["inner_steps"] == 2 and r["tokens"] == 2 * 4 * 32 and r["group_size"] == 1
        assert {"train_loss", "eval_loss", "digest", "wall_s", "compute_s"} <= set(r)
        assert 0 < r["compute_s"] <= r["wall_s"]
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == [
        "round-000001.pt",
        "round-000002.pt",
        "round-000003.pt",
    ]
    assert config.load(f"{run_dir}/config.toml") == tiny_config


def test_resume_continues_bit_exactly(tmp_path, tiny_overrides):
    whole = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "whole")})
    split = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "split")})
    final = run_peer(whole)
    # Stop after 1 of round 2's 2 inner steps: checks are 1 per round start + 1 per inner step.
    run_peer(split, stop=StopAfter(5))
    assert checkpoint.latest(split.run.dir).name == "round-000001.pt"
    assert run_peer(split, resume=True) == final
    assert digests(tmp_path / "split") == digests(tmp_path / "whole")


def test_existing_checkpoints_need_resume(tiny_config):
    run_peer(tiny_config.replace("run", rounds=1))
    with pytest.raises(ConfigError, match="already holds checkpoints.*pass --resume"):
        Peer(tiny_config)


def test_resume_with_another_config_is_refused(tiny_config):
    run_peer(tiny_config)
    with pytest.raises(CheckpointError, match=r"inner.lr: 0.003 != 0.001"):
        Peer(tiny_config.replace("inner", lr=1e-3), resume=True)


def test_two_peers_cannot_share_a_run_dir(tiny_config):
    first = Peer(tiny_config)
    try:
        with pytest.raises(ConfigError, match="another peer is running"):
            Peer(tiny_config, resume=True)
    finally:
        first.close()
