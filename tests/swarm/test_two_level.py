"""A two-level round between real peers (docs/design.md §3, "Past one group"): each averages in the
group of its bucket, then the groups' span owners combine their groups' partials (stage 2), and
every member takes every span's decided result (stage 3). Every peer ends with the same bytes,
the weighted mean over all groups by hand."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch

from p2p_diloco.protocol import twolevel
from tests.swarm.average_worker import EXACT, NUMEL
from tests.swarm.conftest import ENV
from tests.swarm.test_average import read_line

SPANS = 4  # s: spans per group (16 in a real run); two members own two each


def round_key_splitting(peers: list[str], groups: int) -> bytes:
    """A round key under which the peers fall evenly into `groups` buckets (a test picks it; a run's
    is the agreed digest of θ(r), which nobody picks)."""
    for attempt in range(1000):
        key = hashlib.sha256(f"round 0 digest {attempt}".encode()).digest()
        sizes = [len(b) for b in twolevel.buckets(key.hex(), peers, groups)]
        if sizes == [len(peers) // groups] * groups:
            return key
    raise AssertionError("no round key splits the peers evenly in 1000 tries")


def start(swarm, weights: list[float]) -> tuple[list[subprocess.Popen], list[str]]:
    workers = []
    for i, w in enumerate(weights):
        args = [swarm.maddr, str(i), str(w), "fp32", str(swarm.folder / f"w{i}"), str(NUMEL), "mean", "two-level"]
        workers.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.swarm.average_worker", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=ENV,
                start_new_session=True,
            )
        )
        swarm.procs.append(workers[-1])
        swarm.sessions.add(workers[-1].pid)
    peers = []
    for w in workers:
        ready = read_line(w, 90).split()
        assert ready[0] == "ready", ready
        peers.append(ready[1])
    return workers, peers


@pytest.mark.timeout(240)
def test_two_groups_of_two_end_with_the_same_bytes_the_weighted_mean_of_all(swarm):
    weights = [1.0, 2.0, 1.0, 3.0]
    workers, peers = start(swarm, weights)
    key = round_key_splitting(peers, 2)
    for w in workers:
        w.stdin.write(f"go {key.hex()} 2 {SPANS} 2\n")
        w.stdin.flush()
    results = [json.loads(read_line(w, 120)) for w in workers]
    for w in workers:
        w.stdin.close()
        assert w.wait(timeout=60) == 0
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    # Each peer averaged in a group of two (its bucket), not in one group of four.
    assert [r["group"] for r in results] == [2, 2, 2, 2]
    assert len({r["sha256"] for r in results}) == 1, "every peer of both groups must hold the same bytes"
    # Peer i sends (i + 1) x the ramp (1 + j/1000) and (i + 1) x (j + 1)/1000 exact; each group's
    # partial is its weighted sum, so the result is the weighted mean over all four:
    # (1·1 + 2·2 + 1·3 + 3·4) / 7 = 20/7.
    factor = 20 / 7
    expected = factor * (1 + torch.arange(NUMEL, dtype=torch.float32) / 1000)
    expected_exact = factor * (torch.arange(EXACT, dtype=torch.float32) + 1) / 1000
    torch.testing.assert_close(torch.tensor(results[0]["values"]), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(results[0]["exact"]), expected_exact, rtol=1e-6, atol=0)
