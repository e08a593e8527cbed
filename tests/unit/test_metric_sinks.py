"""TensorBoard and W&B (train/sinks.py): each round's record, read back from the files they write; off by
default, a missing extra is one line at start, and a failing sink never stops training."""

from __future__ import annotations

import json
import logging
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.train import sinks
from tests.unit.fake_swarm import FakeSwarm
from tests.unit.test_round_protocol import make_peer, records, run

RECORDS = [
    {"round": 0, "tokens": 0, "digest": "ab12", "eval_loss": 5.5},
    {"round": 1, "tokens": 256, "train_loss": 4.25, "eval_loss": None, "adopted": True, "digest": "cd34"},
    {"round": 2, "tokens": 512, "train_loss": 3.75, "lr": 0.001, "dropped": [], "digest": "ef56"},
]


def needs(package: str) -> Any:
    return pytest.importorskip(package, reason=f"needs the {package} extra: pip install -e '.[{package}]'")


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `logdir`, as TensorBoard itself reads them: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no network and nothing written outside tmp_path."""
    wandb = needs("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield wandb
    wandb.teardown()  # its service process ends with the test, not with pytest


def wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The history rows of the one offline W&B run under `run_dir`, by step, read from its .wandb file:
    a 7-byte header (":W&B", magic, version), then LevelDB log records (crc, length, type) in 32 KiB
    blocks, each a wandb_internal Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    rows: dict[int, dict[str, Any]] = {}
    for payload in leveldb_records(data, 7):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows


def leveldb_records(data: bytes, at: int) -> list[bytes]:
    block, out, parts = 32768, [], b""
    while at + 7 <= len(data):
        if block - at % block < 7:  # the rest of a block too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        if kind == 0:
            break
        parts += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # FULL or LAST
            out.append(parts)
            parts = b""
    return out


def test_a_record_becomes_its_numbers_at_the_round_step():
    assert sinks.scalars(RECORDS[1]) == {"tokens": 256.0, "train_loss": 4.25, "adopted": 1.0}
    assert sinks.scalars({"round": 3, "eval_loss": float("nan"), "wall_s": float("inf"), "lr": 2e-4}) == {"lr": 2e-4}


def test_the_sinks_are_off_by_default_and_need_nothing():
    cfg = config.load(None, {})
    assert (cfg.log.tensorboard_dir, cfg.log.wandb_project, cfg.log.wandb_mode) == ("", "", "online")
    sinks.require_packages(cfg.log)  # nothing configured: nothing imported
    assert sinks.open_sinks(cfg, Path("unused"), "QmPeer").sinks == []


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("log.wandb_project", "team/proj", "log.wandb_project must be a W&B project name"),
        ("log.wandb_project", "x" * 129, "at most 128 characters"),
        ("log.wandb_mode", "disabled", "log.wandb_mode must be online or offline, got 'disabled'"),
        ("log.tensorboard_dir", " tb", "log.tensorboard_dir must not start or end with spaces"),
    ],
)
def test_bad_sink_settings_are_one_line(key, value, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, {key: value})


def test_tensorboard_gets_every_record_at_its_round(tmp_path):
    needs("tensorboard")
    sink = sinks.TensorBoardSink(tmp_path / "tb")
    for record in RECORDS:
        sink.write(record)
    assert set(tensorboard_scalars(tmp_path / "tb")) == {"tokens", "eval_loss", "train_loss", "adopted", "lr"}
    sink.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["tokens"] == [(0, 0.0), (1, 256.0), (2, 512.0)]
    assert scalars["eval_loss"] == [(0, 5.5)]  # round 1's was not finite (None in metrics.jsonl)
    assert scalars["train_loss"] == [(1, 4.25), (2, 3.75)]
    assert scalars["adopted"] == [(1, 1.0)]
    assert scalars["lr"] == [(2, pytest.approx(0.001))]  # stored as float32


def test_wandb_offline_gets_every_record_at_its_round(tmp_path, wandb_offline):
    cfg = config.load(None, {"log.wandb_project": "p2p-test", "log.wandb_mode": "offline", "run.run_id": "r1"})
    sink = sinks.WandbSink(cfg, tmp_path, "QmPeerAbcd")
    for record in RECORDS:
        sink.write(record)
    sink.close()
    wandb_offline.teardown()  # the service writes the run's file out as it stops (at exit, for a peer)
    history = wandb_history(tmp_path)
    assert sorted(history) == [0, 1, 2]
    assert {k: v for k, v in history[0].items() if not k.startswith("_")} == {"tokens": 0.0, "eval_loss": 5.5}
    assert {k: v for k, v in history[1].items() if not k.startswith("_")} == {
        "tokens": 256.0,
        "train_loss": 4.25,
        "adopted": 1.0,
    }
    assert history[2]["lr"] == 0.001 and history[2]["train_loss"] == 3.75


def test_a_peer_writes_its_rounds_to_tensorboard(tmp_path):
    needs("tensorboard")
    peer = run(make_peer(tmp_path, FakeSwarm(), **{"run.rounds": "2", "log.tensorboard_dir": "tb"}))
    written = records(peer)
    assert [r["round"] for r in written] == [0, 1, 2]
    scalars = tensorboard_scalars(tmp_path / "run" / "tb")  # relative: in run.dir
    assert scalars["train_loss"] == [(r["round"], pytest.approx(r["train_loss"])) for r in written[1:]]
    assert scalars["eval_loss"] == [(r["round"], pytest.approx(r["eval_loss"])) for r in written]
    assert scalars["total_tokens"] == [(r["round"], r["total_tokens"]) for r in written[1:]]
    assert peer.sinks.sinks == []  # closed with the peer


def test_a_peer_writes_its_rounds_to_wandb_offline(tmp_path, wandb_offline):
    options = {"log.wandb_project": "p2p-test", "log.wandb_mode": "offline"}
    peer = run(make_peer(tmp_path, FakeSwarm(), **{"run.rounds": "2", **options}))
    written = records(peer)
    wandb_offline.teardown()
    history = wandb_history(tmp_path / "run")  # under run.dir
    assert sorted(history) == [r["round"] for r in written] == [0, 1, 2]
    assert [history[r["round"]]["total_tokens"] for r in written[1:]] == [r["total_tokens"] for r in written[1:]]
    assert [history[r["round"]]["eval_loss"] for r in written] == [pytest.approx(r["eval_loss"]) for r in written]
    assert peer.sinks.sinks == []


@pytest.mark.parametrize("key, extra", [("log.tensorboard_dir", "tensorboard"), ("log.wandb_project", "wandb")])
def test_a_missing_extra_is_one_line_before_the_run_dir_is_touched(tmp_path, monkeypatch, key, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # as if not installed: `import` raises ImportError
    with pytest.raises(ConfigError) as error:
        make_peer(tmp_path, FakeSwarm(), **{key: "tb"})
    assert str(error.value) == (
        f"{key} is set but {extra} is not installed: pip install 'p2p-diloco[{extra}]', or unset {key}"
    )
    assert not (tmp_path / "run").exists()


def test_a_tensorboard_dir_that_cannot_be_written_is_one_line(tmp_path):
    needs("tensorboard")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"log.tensorboard_dir .*/file/tb cannot be written \(.+\); choose another"):
        sinks.TensorBoardSink(tmp_path / "file" / "tb")


def test_wandb_that_cannot_start_is_one_line_naming_offline(tmp_path, monkeypatch, wandb_offline):
    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb_offline, "init", refuse)
    cfg = config.load(None, {"log.wandb_project": "p2p-test"})
    with pytest.raises(ConfigError, match=r"W&B could not start a run \(RuntimeError: api_key not configured"):
        sinks.WandbSink(cfg, tmp_path, "QmPeer")


class Recording:
    def __init__(self, name: str, fail_at: int | None = None, fail_close: bool = False):
        self.name, self.fail_at, self.fail_close = name, fail_at, fail_close
        self.rounds: list[int] = []
        self.closed = 0

    def write(self, record: dict[str, Any]) -> None:
        if len(self.rounds) == self.fail_at:
            raise OSError(28, "No space left on device")
        self.rounds.append(record["round"])

    def close(self) -> None:
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("upload failed")


def test_a_failing_sink_is_turned_off_with_one_warning_and_the_peer_keeps_training(tmp_path, caplog):
    peer = make_peer(tmp_path, FakeSwarm(), **{"run.rounds": "3"})
    failing, good = Recording("Failing", fail_at=1), Recording("Good")
    peer.sinks.sinks += [failing, good]
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.sinks"):
        run(peer)
    assert peer.state.round == 3 and [r["round"] for r in records(peer)] == [0, 1, 2, 3]
    assert failing.rounds == [1] and failing.closed == 1  # round 2 failed: closed, not called again
    assert good.rounds == [1, 2, 3] and good.closed == 1  # the others go on, and are closed with the peer
    warnings = [r.getMessage() for r in caplog.records if r.name == "p2p_diloco.train.sinks"]
    assert warnings == [
        "Failing logging failed (OSError: [Errno 28] No space left on device): turned off for the rest of this run; "
        "metrics.jsonl keeps every round"
    ]


def test_a_sink_that_fails_to_close_does_not_stop_the_others(caplog):
    first, second = Recording("First", fail_close=True), Recording("Second")
    group = sinks.Sinks([first, second])
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.sinks"):
        group.close()
        group.close()  # twice: nothing left to close
    assert (first.closed, second.closed) == (1, 1)
    assert [r.getMessage() for r in caplog.records] == [
        "First logging could not be closed (RuntimeError: upload failed)"
    ]
