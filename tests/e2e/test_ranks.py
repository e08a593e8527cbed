"""A peer of two processes (run.nproc = 2, gloo on the CPU), in-process as rank 0 with its follower a
real child process: it trains what one process trains, resumes bit-exactly, and ends its follower."""

import json

import pytest

from p2p_diloco import checkpoint, config
from p2p_diloco.peer import Peer
from tests.e2e.test_peer_resume import StopAfter, digests, run_peer


def test_two_ranks_train_bit_for_bit_what_one_process_trains(tmp_path, tiny_overrides):
    # Batch 4: each rank trains 2 rows; one process with micro-batches of 2 trains the same 4 rows.
    one = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "one")})
    two = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "two"), "run.nproc": "2"})
    assert one.inner.micro_batch_size == 2 and one.inner.batch_size == 4
    run_peer(one)
    peer = Peer(two)
    try:
        (follower,) = peer.ranks._followers
        assert follower.is_alive()
        peer.run()
    finally:
        peer.close()
    assert follower.exitcode == 0  # told to exit, not terminated
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    mine = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    # The peer's tokens (both ranks'), and the mean loss over both ranks' rows (summed in another order).
    assert [r.get("tokens") for r in records] == [r.get("tokens") for r in mine] == [0, 256, 256, 256]
    assert [r["train_loss"] for r in records[1:]] == pytest.approx([r["train_loss"] for r in mine[1:]], rel=1e-6)


def test_two_ranks_resume_bit_exactly(tmp_path, tiny_overrides):
    # Against one process's whole run, which two ranks match bit for bit (the test above).
    whole = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "whole")})
    split = config.load(None, {**tiny_overrides, "run.dir": str(tmp_path / "split"), "run.nproc": "2"})
    final = run_peer(whole)
    run_peer(split, stop=StopAfter(5))  # Ctrl+C after 1 of round 2's 2 steps: both ranks stop
    assert checkpoint.latest(split.run.dir).name == "round-000001.pt"
    assert run_peer(split, resume=True) == final
    assert digests(tmp_path / "split") == digests(tmp_path / "whole")
