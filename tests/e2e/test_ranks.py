"""A peer of two processes (run.nproc = 2, gloo on the CPU), in-process as rank 0 with its follower a
real child process: it trains bit for bit what one process trains, resumes bit-exactly, and ends
its follower cleanly."""

import json

import pytest

from p2p_diloco import checkpoint, config
from p2p_diloco.peer import Peer
from tests.e2e.test_peer_resume import StopAfter, digests, run_peer


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_bit_for_bit_what_one_process_trains_and_resume_bit_exactly(tmp_path, tiny_overrides):
    # Batch 4: each rank trains 2 rows; one process with micro-batches of 2 trains the same 4 rows.
    one = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "one")})
    two = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "two"), "run.nproc": "2"})
    assert one.inner.micro_batch_size == 2 and one.inner.batch_size == 4 and one.run.rounds == 3
    final = run_peer(one)
    peer = Peer(two)
    try:
        (follower,) = peer.ranks._followers
        assert follower.is_alive()
        peer.run(StopAfter(5))  # Ctrl+C after 1 of round 2's 2 steps: both ranks stop there
    finally:
        peer.close()
    assert follower.exitcode == 0  # told to exit, not terminated
    assert checkpoint.latest(two.run.dir).name == "round-000001.pt"
    assert digests(tmp_path / "two") == digests(tmp_path / "one")[:2]
    assert run_peer(two, resume=True) == final  # the resumed peer starts a follower of its own
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
    # The peer's tokens (both ranks'), and the mean loss over both ranks' rows (summed in another order).
    mine, ours = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r.get("tokens") for r in ours] == [r.get("tokens") for r in mine] == [0, 256, 256, 256]
    assert [r["train_loss"] for r in ours[1:]] == pytest.approx([r["train_loss"] for r in mine[1:]], rel=1e-6)
