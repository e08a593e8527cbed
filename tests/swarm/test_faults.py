"""Fault injection with real processes: a peer crashes (SIGKILL) or hangs (SIGSTOP) in a chosen phase.

Every test asserts that the survivors finish later rounds, agree on every digest, and lose no more
than the configured deadlines. (A reducer lost in the middle of the all-reduce is tested at the
all-reduce level in test_average.py; as a whole-peer fault it is issue 4's work: see its note.)
"""

import pytest

from tests.swarm.conftest import SWARM, wait_until

ROUNDS = 12
FAST = {"run.rounds": str(ROUNDS)}
AGREEMENT_S = float(SWARM["swarm.agreement_timeout_s"])
MATCHMAKING_S = float(SWARM["swarm.matchmaking_time_s"])


def run_with_fault(swarm, fault):
    """Two survivors and a subject that fails as `fault` says; returns the survivors' records and
    the last round the subject completed (it took part in that round's averaging)."""
    survivors = [swarm.peer("a", FAST), swarm.peer("b", FAST)]
    wait_until(lambda: swarm.records("a") and swarm.records("b"), survivors, 90, "survivors up")
    subject = swarm.peer("c", FAST, fault=fault)
    wait_until(lambda: all(p.poll() is not None for p in survivors), survivors, 220, "survivors finish")
    assert [p.returncode for p in survivors] == [0, 0], swarm.log("a")[-3000:]
    assert subject.poll() is None or subject.returncode == -9
    last = max(swarm.records("c"))
    assert last < ROUNDS - 2, "the fault must leave the survivors rounds to finish"
    return swarm.records("a"), swarm.records("b"), last


def assert_agree_every_round(a, b, since):
    """Equal digests in every round both peers recorded (one may catch up past a round instead of
    training it), and both finished the run."""
    assert max(a) == max(b) == ROUNDS
    common = set(a) & set(b)
    assert len(common & set(range(since, ROUNDS + 1))) >= ROUNDS - since - 1
    for r in sorted(common):
        assert a[r]["digest"] == b[r]["digest"], f"round {r}"


def normal_round_s(records):
    walls = sorted(rec["wall_s"] for rec in records.values() if "wall_s" in rec)
    return walls[len(walls) // 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_peer_lost_in_the_inner_phase(swarm, signal_name):
    # the subject completes a round in the swarm, then crashes or hangs as its second inner phase starts
    a, b, last = run_with_fault(swarm, f"inner:2:{signal_name}")
    assert_agree_every_round(a, b, last)
    # the survivors lose at most a few rounds of averaging together, then average as a pair to the end
    assert [a[r]["group_size"] for r in range(ROUNDS - 2, ROUNDS + 1)] == [2, 2, 2]
    lost_s = sum(rec["wall_s"] for r, rec in a.items() if r > last and "wall_s" in rec) - (ROUNDS - last) * normal_round_s(a)
    # Bound today: the agreement deadline once (waiting for the lost peer's digest), plus up to two
    # matchmaking timeouts while the survivors fall back into step. Issue 4 aims at one deadline.
    assert lost_s <= AGREEMENT_S + 2 * 3 * MATCHMAKING_S, f"the fault cost {lost_s:.1f} s"
