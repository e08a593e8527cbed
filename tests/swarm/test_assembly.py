"""The span owners' assembly (swarm/averaging/assembly.py) between real processes: owners of one span
in three groups, each a hivemind DHT and p2pd of its own on 127.0.0.1 (tests/swarm/assembly_worker.py),
meet by hivemind's matchmaking, make the same stage-2 owners of what they were shown (a made-up
claim among them), and run stage 2 of their span with them: owners that knew nothing of each other
but the DHT end with the same average; owners that hold different lists (a leader that told them
different things) fail alike."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.swarm.procs import signal_tree
from tests.swarm.test_stage2 import reference

GROUPS = 3


def run_owners(
    tmp_path, forgers: set[int], owners: int, told_less: set[int] = frozenset(), member: bool = False
) -> tuple[dict, dict]:
    """(each owner's result, each owner's peer id), every process ended after; with `member`, also a
    member of group 0 that owns nothing of the span (tests/swarm/assembly_worker.py's `member`),
    whose result is under "member"."""
    procs = []
    names = [str(i) for i in range(owners)] + (["member"] if member else [])
    try:
        for name in names:
            log = open(tmp_path / f"{name}.log", "w")
            args = [str(owners), str(GROUPS), str(tmp_path)]
            owner = name != "member"
            cmd = [sys.executable, "-m", "tests.swarm.assembly_worker", name, *args]
            cmd += ["forge"] if owner and int(name) in forgers else []
            told = owner and int(name) in told_less
            env = {**os.environ, "TOLD_LESS": "1" if told else "", "WITH_MEMBER": "1" if member else ""}
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + 90.0
        while not all((tmp_path / f"{n}.json").exists() or p.poll() is not None for n, p in zip(names, procs)):
            assert time.monotonic() < deadline, "owners did not finish: " + (tmp_path / "0.log").read_text()[-2000:]
            time.sleep(0.1)  # a poll interval, bounded by the deadline above
        (tmp_path / "done").touch()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            signal_tree(p.pid, signal.SIGKILL)
    results = {int(n) if n != "member" else n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names}
    peers = {i: (tmp_path / f"{i}.peer").read_text() for i in range(owners)}
    return results, peers


@pytest.mark.timeout(150)
def test_span_owners_of_three_groups_assemble_agree_on_the_owners_and_average_a_made_up_claim_left_out(tmp_path):
    # Owners 0, 1 and 2 own span 0 of the groups of buckets 0, 1 and 2, each sealed by its three
    # members; owner 3 hashes into bucket 0 too and shows a group it made up of itself and one
    # member of its own (both seal it: a majority of 2). Whoever leads, every owner gets the same
    # four claims, and the made-up one, over bucket 0 with fewer seals than group 0's, does not count.
    results, peers = run_owners(tmp_path, forgers={3}, owners=4, member=True)
    assert all("error" not in r for r in results.values()), results
    assert all(results[i]["members"] == sorted(peers.values()) for i in range(4)), results
    expected = [peers[0], peers[1], peers[2]]  # by hand: the groups in bucket order
    assert all(r["owners"] == expected for r in results.values()), (results, peers)
    assert len({r["plan_key"] for r in results.values()}) == 1
    # Stage 2 with that plan: the three owners hold the same decided bytes of every sub-span, each
    # naming all three groups, and the average is the fixed-order one by hand; the forger, whom
    # the plan leaves out, ran none.
    real = [results[i] for i in range(GROUPS)]
    assert len({json.dumps(r["subs"]) for r in real}) == 1 and len(real[0]["subs"]) == GROUPS
    assert all(g == [0, 1, 2] for g in real[0]["groups"])
    assert real[0]["average"] == reference([0, 1, 2])
    assert "subs" not in results[3]
    # Stage 3: a member of group 0 that owns nothing of the span gets what the assembly showed from
    # its owner, finds the layout it sealed in it, makes the same plan itself, and fetches every
    # sub-span through that owner alone (sub-span 1's replicas are groups 1 and 2: the owner relays
    # it, with both replicas' signatures): the same bytes as the owners hold.
    assert results["member"]["subs"] == real[0]["subs"] and results["member"]["average"] == real[0]["average"]
    assert results["member"]["asked"] == [peers[0]]
    assert results["member"]["unheld"] == f"{peers[0]} holds no assembly under run-r7-span3of4"


@pytest.mark.timeout(150)
def test_owners_a_leader_told_different_things_fail_alike_instead_of_averaging_different_things(tmp_path):
    # Owner 2 makes the same owners of what it holds, but holds one claim fewer (the made-up one,
    # which counts for nothing): its stage-2 key differs, the others refuse its messages and it
    # theirs, and no owner ends with an average (I1: nobody applies a different one; I2).
    results, peers = run_owners(tmp_path, forgers={3}, owners=4, told_less={2})
    real = [results[i] for i in range(GROUPS)]
    assert all(r["owners"] == [peers[0], peers[1], peers[2]] for r in real), results
    assert real[2]["plan_key"] != real[0]["plan_key"] == real[1]["plan_key"]
    assert all("subs" not in r and "nothing applied" in r["error"] for r in real), real
