"""`p2p-diloco demo --dir` as a user types it: a folder of theirs is refused, byte for byte untouched."""

import subprocess
import sys

CLI = [sys.executable, "-m", "p2p_diloco.cli"]


def test_demo_refuses_a_folder_with_a_users_file_and_starts_no_peer(tmp_path):
    mine = tmp_path / "runs"
    (mine / "c4-150m" / "checkpoints").mkdir(parents=True)
    (mine / "c4-150m" / "checkpoints" / "round-000042.pt").write_bytes(b"weeks of training\x00\xff")
    (mine / "notes.md").write_text("my notes\n")
    before = {p: p.read_bytes() if p.is_file() else None for p in mine.rglob("*")}
    result = subprocess.run(
        [*CLI, "demo", "--peers", "1", "--rounds", "1", "--dir", str(mine)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # no bootstrap node, no peer: nothing was started
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: --dir {mine} is not empty and was not made by the demo (it has no .p2p-diloco-demo file); "
        "choose a new or empty folder, e.g. --dir runs/demo-2"
    ]
    assert {p: p.read_bytes() if p.is_file() else None for p in mine.rglob("*")} == before
