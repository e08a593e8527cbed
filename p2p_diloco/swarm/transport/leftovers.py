"""What a killed swarm peer leaves in shared memory, and its removal by the next peer of its run dir.

hivemind shares torch tensors between a peer's processes by name (torch's file_system strategy,
set in hivemind/utils/mpfuture.py): each lives in POSIX shared memory as
/dev/shm/torch_<pid>_<n>_<i>, named after the process that made it (the peer's main process: the
averaging buffers and the error-feedback residual). That is memory, not disk, and torch does not
unlink them when the process ends, cleanly or not (measured in session 36: two peers that exited 0
left 3.76 MB each, twice their 1.88 MB vector): four bytes a value each, so about 1.2 GB for a 150M
model every time, until the machine restarts. (The test suite and benches left 677 MB on this
machine in one session before the sweep below, 510 MB of lab runs in session 36.)

A swarm peer that leaves cleanly unlinks the segments named after its own process once its other
processes ended (`release_own`, at the end of `HivemindSwarm.close`): nothing maps them by name
any more.

So a swarm peer notes its processes in its run dir (`note`: pid and start time of each), and the
next peer started in that run dir removes the segments named after those of them that no process
holds any more (`sweep`), before it starts its own. Only those, and only the user's own: another
program's segments, and any named after a pid that another process holds now (the names cannot
tell whose they are), are left alone.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

RECORD = "processes.json"  # in the run dir: this peer's processes, for the next start's sweep
SHM = Path("/dev/shm")


def release_own(shm: Path = SHM) -> tuple[int, int]:
    """Unlink the segments named after this process, once no other process of it maps them (its
    averager and DHT processes ended): (how many, their bytes). Mappings this process still holds
    stay valid; only the names go."""
    count = size = 0
    for path in shm.glob(f"torch_{os.getpid()}_*"):
        try:
            bytes_ = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        count, size = count + 1, size + bytes_
    return count, size


def started_at(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if there is no such process: with
    the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19]) if fields[0] != "Z" else None  # a zombie is gone but for its exit code


def note(run_dir: Path, pids: Sequence[int]) -> None:
    """Record `pids` (this peer's processes) with their start times, replacing the last record."""
    entries = [{"pid": pid, "started": at} for pid in pids if (at := started_at(pid)) is not None]
    partial = run_dir / f"{RECORD}.partial"
    partial.write_text(json.dumps(entries) + "\n")
    os.replace(partial, run_dir / RECORD)


def sweep(run_dir: Path, shm: Path = SHM) -> tuple[int, int]:
    """Remove the shared-memory segments of the processes the last record names that are gone;
    (segments removed, their bytes). A record that cannot be read removes nothing."""
    return remove_gone(_recorded(run_dir), shm)


def remove_gone(pids: Sequence[int], shm: Path = SHM) -> tuple[int, int]:
    """Remove the user's segments named after those of `pids` that no process holds any more;
    (segments removed, their bytes)."""
    count = size = 0
    for pid in (p for p in pids if started_at(p) is None):
        for segment in shm.glob(f"torch_{pid}_*"):
            try:
                stat = segment.stat()
                if stat.st_uid != os.getuid():
                    continue
                segment.unlink()
            except OSError:  # gone meanwhile, or not ours to remove
                continue
            count, size = count + 1, size + stat.st_size
    return count, size


def _recorded(run_dir: Path) -> list[int]:
    """The pid of each process the record names (its start time there is for whoever reads the
    file); none if there is no readable record."""
    path = run_dir / RECORD
    try:
        entries = json.loads(path.read_text())
        return [pid for e in entries if (pid := int(e["pid"])) > 0 and int(e["started"]) > 0]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.warning("%s cannot be read (%s); shared memory a killed run left there stays", path, e)
        return []


def sweep_below(folder: Path, shm: Path = SHM) -> tuple[int, int]:
    """`sweep` every run dir under `folder` that holds a record: for the test suite and the
    benches, whose peers' run dirs are theirs and whose peers they kill on purpose."""
    found = [sweep(record.parent, shm) for record in sorted(folder.rglob(RECORD))]
    return sum(c for c, _ in found), sum(s for _, s in found)
