"""Checkpoints: atomic, pruned, verified; damage, mismatches and full disks give clear errors."""

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.errors import CheckpointError, WriteError
from p2p_diloco.protocol import outer
from p2p_diloco.train import checkpoint
from tests.unit.full_disk import PAGE, fill, remount, tmpfs


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


def big_payload(round_):
    """A checkpoint of about 64 KiB: larger than the space the full-disk test leaves."""
    out = payload(round_)
    params = {"w": torch.arange(16 * 1024, dtype=torch.float32) + round_}
    out.update(params=params, momentum={"w": torch.ones(4)})
    out["digest"] = outer.digest(round_, params, out["momentum"])
    return out


def test_a_full_disk_keeps_the_checkpoints_and_leaves_no_temporary_file(tmp_path):
    with tmpfs(tmp_path / "disk", 1024 * 1024) as disk:
        for r in (1, 2):
            checkpoint.save(disk, big_payload(r), keep=2)
        fill(disk, leave_bytes=4 * PAGE)  # round 3's file gets 16 KiB in, then the disk is full
        with pytest.raises(WriteError) as failed:
            checkpoint.save(disk, big_payload(3), keep=2)
        assert str(failed.value) == (
            f"cannot write {checkpoint.path_for(disk, 3)} (No space left on device); free space on {disk} or "
            "choose another --run.dir; the checkpoint of round 2 is intact, continue with --resume"
        )
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["round-000001.pt", "round-000002.pt"]
        assert checkpoint.load(checkpoint.latest(disk))["params"]["w"][:2].tolist() == [2.0, 3.0]


def test_a_read_only_disk_is_named_with_its_fix(tmp_path):
    with tmpfs(tmp_path / "disk", 1024 * 1024) as disk:
        remount(disk, "ro")
        with pytest.raises(WriteError) as failed:
            checkpoint.save(disk, payload(0), keep=2)
    assert str(failed.value) == (
        f"cannot write {checkpoint.path_for(disk, 0)} (Read-only file system); remount {disk} read-write or "
        "choose another --run.dir"
    )
