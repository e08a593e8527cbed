"""A swarm peer killed with its whole process group (the kernel's out-of-memory killer, systemd's
SIGKILL after its stop timeout) leaves its shared tensors in /dev/shm, memory until the machine
restarts; the next peer started in its run dir removes them, and a peer that ends cleanly leaves
none (swarm/transport/leftovers.py)."""

import json
import re
import signal
from pathlib import Path

import pytest

from p2p_diloco.swarm.transport import leftovers
from p2p_diloco.train import checkpoint
from tests.swarm.conftest import wait_until
from tests.swarm.procs import signal_tree, wait_gone


@pytest.mark.timeout(240)
def test_a_killed_peers_shared_memory_is_removed_by_the_next_start_in_its_run_dir(swarm):
    long = {"run.rounds": "1000"}
    record = swarm.folder / "a" / leftovers.RECORD
    first = swarm.peer("a", long)
    wait_until(record.exists, [first], 120, "the peer notes its processes")
    pids = [entry["pid"] for entry in json.loads(record.read_text())]
    assert first.pid in pids and len(pids) == 3  # the peer, its DHT and its averager
    segments = [s for pid in pids for s in Path("/dev/shm").glob(f"torch_{pid}_*")]
    assert segments, "the peer shares its averaging buffers with its averager through /dev/shm"
    signal_tree(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    wait_gone(pids, deadline_s=10)
    assert all(s.exists() for s in segments)  # what a killed peer leaves

    again = swarm.peer("a", long, resume=checkpoint.latest(swarm.folder / "a") is not None)
    line = re.compile(r"removed (\d+) shared-memory segments \((\d+) MB\) in /dev/shm")
    wait_until(lambda: line.search(swarm.log("a")), [again], 120, "the next start removes them")
    assert not any(s.exists() for s in segments)
    assert int(line.search(swarm.log("a")).group(1)) >= len(segments)  # and any made after we looked
    wait_until(lambda: json.loads(record.read_text())[0]["pid"] == again.pid, [again], 120, "the new record")
    pids = [entry["pid"] for entry in json.loads(record.read_text())]
    assert any(Path("/dev/shm").glob(f"torch_{again.pid}_*"))
    again.send_signal(signal.SIGINT)
    assert again.wait(timeout=90) == 0, swarm.log("a")[-3000:]
    # A clean exit leaves nothing: before, two peers that exited 0 left 3.76 MB each (session 36).
    assert not [s.name for pid in pids for s in Path("/dev/shm").glob(f"torch_{pid}_*")]
