"""Overlapped rounds: the all-reduce of round r runs during the inner phase of round r + 1, and the
outer update lands one round late, on the agreed θ(r): peers still agree bit for bit every round."""

import pytest

from tests.swarm.conftest import wait_until

ROUNDS = 4


@pytest.mark.timeout(240)
def test_overlapped_int4_peers_agree_on_every_round(swarm):
    # The most lossy codec with error feedback, norms and biases exact, and eager overlap: the
    # configuration furthest from the blocking fp32 rounds that the other tests check.
    extra = {"run.rounds": str(ROUNDS), "swarm.overlap": "eager", "swarm.compression": "int4"}
    peers = {name: swarm.peer(name, extra) for name in ("a", "b")}
    wait_until(lambda: all(p.poll() is not None for p in peers.values()), list(peers.values()), 200, "2 peers finish")
    assert [p.returncode for p in peers.values()] == [0, 0], [swarm.log(n)[-2000:] for n in peers]
    a, b = swarm.records("a"), swarm.records("b")
    assert sorted(a) == sorted(b) == list(range(ROUNDS + 1))
    for r in range(ROUNDS + 1):
        assert a[r]["digest"] == b[r]["digest"], f"round {r}"
    sizes = [records[r]["group_size"] for records in (a, b) for r in range(1, ROUNDS + 1)]
    assert sizes.count(2) >= len(sizes) - 2, sizes
    # every round's update came from an all-reduce that ran in the background of the next phase
    # (the last one excepted: no phase follows it), and the peer reports how long it blocked on it
    for records in (a, b):
        assert all("blocked_s" in records[r] and records[r]["bytes_sent"] > 0 for r in range(2, ROUNDS + 1))
