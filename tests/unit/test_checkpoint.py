"""Checkpoints: atomic, pruned, verified; damage and mismatches give clear errors."""

import pytest
import torch

from p2p_diloco import checkpoint, config, outer
from p2p_diloco.errors import CheckpointError


def payload(round_, cfg=None):
    cfg = cfg or config.load()
    params = {"w": torch.arange(4, dtype=torch.float32) + round_}
    momentum = {"w": torch.ones(4)}
    return {
        "round": round_,
        "params": params,
        "momentum": momentum,
        "digest": outer.digest(round_, params, momentum),
        "shared_config": cfg.shared_dict(),
        "config": cfg.to_dict(),
        "fingerprint": cfg.fingerprint(),
        "trainer": {"step": 3},
        "data": {"epoch": 0, "index": 1, "offset": 2, "tokens_consumed": 9},
        "rng": {"torch": torch.get_rng_state()},
    }


def test_save_load_round_trip_and_keep(tmp_path):
    for r in range(5):
        checkpoint.save(tmp_path, payload(r), keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["round-000003.pt", "round-000004.pt"]
    loaded = checkpoint.load(checkpoint.latest(tmp_path), config.load().shared_dict())
    assert loaded["round"] == 4 and loaded["params"]["w"].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert loaded["trainer"] == {"step": 3}
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = checkpoint.save(tmp_path, payload(1), keep=3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt.*move it away"):
        checkpoint.load(path)


def test_flipped_tensor_bytes_fail_the_digest(tmp_path):
    bad = payload(1)
    bad["params"]["w"][0] += 1  # the recorded digest no longer matches the tensors
    path = checkpoint.save(tmp_path, bad, keep=3)
    with pytest.raises(CheckpointError, match="is corrupt: its tensors hash to"):
        checkpoint.load(path)


def test_checkpoint_from_another_config_names_the_fields(tmp_path):
    path = checkpoint.save(tmp_path, payload(1), keep=3)
    other = config.load(None, {"inner.steps": "7"})
    with pytest.raises(CheckpointError, match=r"another run config \(inner.steps: 500 != 7\)"):
        checkpoint.load(path, other.shared_dict())


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"hello": 1}, path)
    with pytest.raises(CheckpointError, match="not a p2p-diloco checkpoint"):
        checkpoint.load(path)
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.load(tmp_path / "missing.pt")


def test_listing_ignores_temporary_and_foreign_files(tmp_path):
    checkpoint.save(tmp_path, payload(2), keep=3)
    (tmp_path / "checkpoints" / ".round-000009.pt.123.tmp").write_bytes(b"partial")
    (tmp_path / "checkpoints" / "notes.txt").write_text("hi")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["round-000002.pt"]
    assert checkpoint.latest(tmp_path / "nowhere") is None
