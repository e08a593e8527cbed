"""A killed peer's shared memory (swarm/transport/leftovers.py): noted, and removed by the next start
only for the noted processes that are gone. The segments here are files in a folder standing for
/dev/shm; the real ones: tests/swarm/test_leftovers.py."""

import json
import os
import subprocess
import sys

from p2p_diloco.swarm.transport import leftovers


def _gone_pid(run_dir) -> int:
    """A process noted in `run_dir` while it lived, then ended and reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    leftovers.note(run_dir, [proc.pid, os.getpid()])
    proc.stdin.close()
    proc.wait(timeout=30)
    return proc.pid


def test_the_next_start_removes_only_the_segments_of_noted_processes_that_are_gone(tmp_path):
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run_dir.mkdir()
    gone = _gone_pid(run_dir)
    noted = json.loads((run_dir / leftovers.RECORD).read_text())
    assert [e["pid"] for e in noted] == [gone, os.getpid()] and all(e["started"] > 0 for e in noted)
    (shm / f"torch_{gone}_123_0").write_bytes(b"x" * 1000)
    (shm / f"torch_{gone}_123_1").write_bytes(b"x" * 24)
    kept = [
        shm / f"torch_{os.getpid()}_9_0",  # a noted process that still runs
        shm / f"torch_{gone}0_1_0",  # another pid that begins with the same digits
        shm / f"torch_{gone + 1}_1_0",  # a process nobody noted
        shm / f"other_{gone}_1",  # not torch's
    ]
    for path in kept:
        path.write_bytes(b"y")
    assert leftovers.sweep(run_dir, shm) == (2, 1024)
    assert sorted(p.name for p in shm.iterdir()) == sorted(p.name for p in kept)
    assert leftovers.sweep(run_dir, shm) == (0, 0)  # nothing left to remove


def test_no_record_or_a_bad_one_removes_nothing(tmp_path, caplog):
    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    run_dir.mkdir()
    (shm / "torch_999999_1_0").write_bytes(b"x")
    assert leftovers.sweep(run_dir, shm) == (0, 0)  # a run dir never used by a swarm peer
    for bad in ("{", '[{"pid": "x", "started": 1}]', '[{"pid": 999999}]', '"text"', "[1]"):
        (run_dir / leftovers.RECORD).write_text(bad)
        assert leftovers.sweep(run_dir, shm) == (0, 0), bad
    assert (shm / "torch_999999_1_0").exists()
    assert "cannot be read" in caplog.text


def test_sweep_below_reaches_every_noted_run_dir_under_a_folder(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    pids = []
    for name in ("a", "b/w0"):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        pids.append(_gone_pid(run_dir))
        (shm / f"torch_{pids[-1]}_1_0").write_bytes(b"x" * 10)
    assert leftovers.sweep_below(tmp_path / "runs", shm) == (2, 20)
    assert list(shm.iterdir()) == []


def test_a_clean_end_unlinks_the_segments_named_after_this_process_only(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    mine = [shm / f"torch_{os.getpid()}_7_0", shm / f"torch_{os.getpid()}_7_1"]
    others = [shm / f"torch_{os.getpid()}0_1_0", shm / f"torch_{os.getpid() + 1}_1_0", shm / f"other_{os.getpid()}_1"]
    mine[0].write_bytes(b"x" * 1000)
    mine[1].write_bytes(b"x" * 80)
    for path in others:
        path.write_bytes(b"y")
    assert leftovers.release_own(shm) == (2, 1080)
    assert sorted(p.name for p in shm.iterdir()) == sorted(p.name for p in others)
