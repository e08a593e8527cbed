"""The demo's folder: one it made, or an empty one; never a folder that holds a user's files."""

import os

import pytest

from p2p_diloco.demo import MARKER, prepare_folder, stale_entries
from p2p_diloco.errors import ConfigError

A_PREVIOUS_DEMO = [MARKER, "run.toml", "bootstrap.key", "bootstrap.peers", "peer-0", "peer-0.log", "peer-12"]


def listing(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_a_missing_or_empty_folder_has_nothing_to_remove(tmp_path):
    assert stale_entries(tmp_path / "new", None) == []
    assert stale_entries(tmp_path, []) == []


def test_a_non_empty_folder_without_the_marker_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"not made by the demo .*choose a new or empty folder"):
        stale_entries(tmp_path, ["run.toml", "peer-0"])  # even names a demo writes: it did not write these


def test_a_previous_demos_folder_loses_only_what_a_demo_writes(tmp_path):
    names = [*A_PREVIOUS_DEMO, "notes.txt", "peer-a", "run.toml.bak", "peer-0.log.old", "checkpoints"]
    assert stale_entries(tmp_path, names) == [
        "bootstrap.key",
        "bootstrap.peers",
        "peer-0",
        "peer-0.log",
        "peer-12",
        "run.toml",
    ]  # the marker stays: the folder remains the demo's at every moment


def test_a_missing_folder_is_created_with_the_marker(tmp_path):
    prepare_folder(tmp_path / "runs" / "demo")
    assert sorted(os.listdir(tmp_path / "runs" / "demo")) == [MARKER]


def test_an_empty_folder_is_marked(tmp_path):
    prepare_folder(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [MARKER]


def test_a_folder_with_a_users_file_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "thesis.tex").write_bytes(b"\\chapter{one}\n")
    (tmp_path / "peer-0").mkdir()
    (tmp_path / "peer-0" / "metrics.jsonl").write_text("{}\n")
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match="not made by the demo"):
        prepare_folder(tmp_path)
    assert listing(tmp_path) == before


def test_a_file_given_as_the_folder_is_refused(tmp_path):
    (tmp_path / "run.toml").write_text("mine")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        prepare_folder(tmp_path / "run.toml")
    assert (tmp_path / "run.toml").read_text() == "mine"


def test_a_previous_demos_files_go_and_everything_else_stays(tmp_path):
    demo = tmp_path / "demo"
    prepare_folder(demo)
    for name in ["run.toml", "bootstrap.key", "peer-0.log"]:
        (demo / name).write_text("old")
    (demo / "peer-0" / "checkpoints").mkdir(parents=True)
    (demo / "peer-0" / "checkpoints" / "round-000001.pt").write_text("old")
    (demo / "notes.txt").write_text("mine")
    prepare_folder(demo)
    assert listing(demo) == {MARKER: (demo / MARKER).read_bytes(), "notes.txt": b"mine"}


def test_a_link_among_a_previous_demos_names_is_removed_never_followed(tmp_path):
    demo, mine = tmp_path / "demo", tmp_path / "mine"
    prepare_folder(demo)
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"\x00\x01")
    (demo / "peer-0").symlink_to(mine, target_is_directory=True)
    (demo / "peer-0.log").symlink_to(mine / "data.bin")
    prepare_folder(demo)
    assert sorted(os.listdir(demo)) == [MARKER]
    assert (mine / "data.bin").read_bytes() == b"\x00\x01"
