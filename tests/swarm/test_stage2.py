"""Stage 2 of a two-level round (swarm/averaging/stage2.py) between real processes: three owners of
one span, each its own process and p2pd on 127.0.0.1 (tests/swarm/stage2_worker.py), with a
primary that lies, an owner that sends a partial its group did not seal, and one that is
SIGKILLed as it would push its sum."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.swarm.procs import signal_tree
from tests.swarm.stage2_worker import partial_of

GROUPS, NUMEL = 3, 10  # sub-spans of 3, 3 and 4 values


def run_owners(tmp_path, faults: dict[int, str], timeout_s: float = 60.0) -> dict[int, dict | None]:
    """Each owner's result file (None for one that wrote none); every process ended after."""
    procs = []
    try:
        for g in range(GROUPS):
            env = {**os.environ, "FAULT": faults.get(g, "")}
            log = open(tmp_path / f"{g}.log", "w")
            cmd = [sys.executable, "-m", "tests.swarm.stage2_worker", str(g), str(GROUPS), str(NUMEL), str(tmp_path)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "owners did not finish: " + (tmp_path / "0.log").read_text()[-2000:]
            if all(p.poll() is not None or (tmp_path / f"{g}.json").exists() for g, p in enumerate(procs)):
                (tmp_path / "done").touch()  # every owner holds its result or died: none need serve on
            time.sleep(0.1)  # a poll interval, bounded by the deadline above
    finally:
        for p in procs:
            signal_tree(p.pid, signal.SIGKILL)
    out = {}
    for g in range(GROUPS):
        path = tmp_path / f"{g}.json"
        out[g] = json.loads(path.read_text()) if path.exists() else None
    return out


def reference(groups: list[int]) -> list[float]:
    """By hand: Σ of the named groups' partials in group order, fp32, over Σ of their weights."""
    total = torch.zeros(NUMEL, dtype=torch.float32)
    for g in sorted(groups):
        total += partial_of(g, NUMEL).values
    return (total / sum(partial_of(g, NUMEL).weight for g in groups)).tolist()


@pytest.mark.timeout(120)
def test_three_owners_end_with_the_same_average_and_a_lying_primary_is_convicted(tmp_path):
    (tmp_path / "honest").mkdir()
    honest = run_owners(tmp_path / "honest", {})
    assert all(r is not None and "error" not in r for r in honest.values()), honest
    assert len({json.dumps(r["subs"]) for r in honest.values()}) == 1  # the same bytes everywhere (I1)
    assert all(s["groups"] == [0, 1, 2] for s in honest[0]["subs"])
    # (1 + 2 + 3) x [1..10] / 8 over 1 + 2 + 3: [1..10] / 8, exact in fp32.
    assert honest[0]["average"] == reference([0, 1, 2]) == [v / 8 for v in range(1, 11)]
    assert all(r["convicted"] == [] for r in honest.values())

    (tmp_path / "lie").mkdir()
    lied = run_owners(tmp_path / "lie", {1: "lie"})
    liar = lied[1]["id"]
    assert lied[2]["convicted"] == [liar]  # sub-span 1's decider checked the sum and took its own
    assert len({json.dumps(r["subs"]) for r in lied.values()}) == 1, lied  # the liar too gets the decided bytes
    assert lied[0]["average"] == reference([0, 1, 2])

    # An owner that sends 100 times its group's partial under the digests its group sealed: every
    # replica it sent to refuses it and convicts it, and its group counts in no sub-span, on
    # every owner alike (its own primary's sum names its group, which the decider does not hold).
    (tmp_path / "forge").mkdir()
    forged = run_owners(tmp_path / "forge", {1: "forge"})
    forger = forged[1]["id"]
    assert forged[0]["convicted"] == forged[2]["convicted"] == [forger], forged
    assert len({json.dumps(r["subs"]) for r in forged.values()}) == 1, forged
    assert all(s["groups"] == [0, 2] for s in forged[0]["subs"])
    assert forged[0]["average"] == reference([0, 2]) == [v / 8 for v in range(1, 11)]  # (1 + 3) v / 8 / 4


@pytest.mark.timeout(120)
def test_a_primary_killed_as_it_pushes_its_sum_leaves_the_others_the_same_result_or_the_same_failure(tmp_path):
    # Owner 1 is sub-span 1's primary and sub-span 0's decider. It dies as it would push its sum
    # of sub-span 1: that sub-span's decider (owner 2) decides its own sum. Sub-span 0 survives
    # only if owner 1 had decided it and answered owner 0 before dying (its decision, signed, is
    # then with owner 0): the two survivors hold the same bytes, or both end without (I1, I2).
    ended = run_owners(tmp_path, {1: "kill"})
    assert ended[1] is None  # it died before it could write anything
    a, b = ended[0], ended[2]
    if "error" in a or "error" in b:
        assert "sub-spans [0]" in a.get("error", "") and "sub-spans [0]" in b.get("error", ""), (a, b)
    else:
        assert a["subs"] == b["subs"] and a["average"] == b["average"]
        assert a["average"][3:6] == reference(a["subs"][1]["groups"])[3:6]


@pytest.mark.timeout(120)
def test_a_decider_killed_once_it_decided_loses_its_sub_span_alike_for_every_owner(tmp_path):
    # Owner 2 decides sub-span 1 (its primary: owner 1) and dies before it answers anyone. The
    # primary holds no signature of the decision, so it serves nothing: both survivors end without
    # sub-span 1, and nothing is applied anywhere (I2), rather than each its own sum.
    ended = run_owners(tmp_path, {2: "kill-decider"})
    assert ended[2] is None
    for survivor in (ended[0], ended[1]):
        assert survivor is not None and "sub-spans [1]" in survivor.get("error", ""), ended


@pytest.mark.timeout(120)
def test_a_forging_owner_that_decides_its_own_sum_is_refuted_by_its_primary_for_every_owner(tmp_path):
    # Owner 1 sends forged partials and, as sub-span 0's decider, decides its own sum (its forged
    # partial in it) instead of owner 0's. Owner 0, sub-span 0's primary, refused that partial:
    # it refutes the decision instead of abstaining, so neither survivor applies it (before, the
    # decider's lone decision was taken from it with the primary silent).
    ended = run_owners(tmp_path, {1: "forge-decide"})
    forger = ended[1]["id"]
    for survivor in (ended[0], ended[2]):
        assert "sub-spans [0]" in survivor.get("error", ""), ended
        assert survivor["convicted"] == [forger]
